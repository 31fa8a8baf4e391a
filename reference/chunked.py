"""Chunked prefill (vLLM's MLA prefill with context): the context in chunks of at most ``chunk_size`` tokens.

Per request: each context chunk is up-projected and attended without a mask, the partial results are merged
by LSE; the new tokens attend each other causally; prefix and suffix are merged. The result equals MHA over
``[context ; new tokens]`` with the usual causal alignment.
"""

from __future__ import annotations

import torch

from mla_bench.layouts import LATENT_DIM, NOPE_DIM, ROPE_DIM
from reference.checks import check_int, check_lengths, check_same_device, check_shape, check_tensor, check_values
from reference.core import attend_prechecked, causal_visible, ragged_attention_prechecked
from reference.merge import merge_attn_states
from reference.mha import mha_keys, up_project


def context_lens(q_lens, kv_lens) -> list[int]:
    """Tokens of context (already cached before this step) per request; padding requests have none."""
    return [kv - q if kv else 0 for q, kv in zip(q_lens, kv_lens)]


def check_prefill_inputs(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                         context: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, q_lens, kv_lens,
                         scale: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """All checks of a prefill with context, chunked or not, before any work; returns the lengths as tuples.
    ``q`` ``[T, H, P + 64]`` (``T`` is ``sum(q_lens)``) sets the heads and the nope width ``P``, ``w_uv`` the value
    width ``V``: the new tokens' ``k_nope`` ``[T, H, P]``, ``k_pe`` ``[T, 64]`` and ``v`` ``[T, H, V]``, the weights
    ``[H, 512, P]`` and ``[H, 512, V]``, the ``context`` latent ``[sum ctx, 576]``."""
    q_lens, kv_lens = check_lengths(q_lens, kv_lens)
    if any(q_len > kv_len for q_len, kv_len in zip(q_lens, kv_lens)):
        raise ValueError(f"a prefill's new tokens are keys too: every q_len needs kv_len >= q_len, got "
                         f"q_lens={list(q_lens)}, kv_lens={list(kv_lens)}")
    check_tensor("q", q, 3)
    check_tensor("w_uv", w_uv, 3)
    tokens, heads, nope, dv = sum(q_lens), q.shape[1], q.shape[2] - ROPE_DIM, w_uv.shape[2]
    if nope < 1:
        raise ValueError(f"q must be wider than its {ROPE_DIM} rope columns, got shape {list(q.shape)}")
    check_shape("q", q, (tokens, heads, nope + ROPE_DIM))
    check_shape("k_nope", k_nope, (tokens, heads, nope))
    check_shape("k_pe", k_pe, (tokens, ROPE_DIM))
    check_shape("v", v, (tokens, heads, dv))
    check_shape("w_uk", w_uk, (heads, NOPE_DIM, nope))
    check_shape("w_uv", w_uv, (heads, NOPE_DIM, dv))
    check_tensor("context", context, 2, last=LATENT_DIM)
    ctx_tokens = sum(context_lens(q_lens, kv_lens))
    if context.shape[0] != ctx_tokens:
        raise ValueError(f"context has {context.shape[0]} tokens, the requests need {ctx_tokens}")
    inputs = dict(q=q, k_nope=k_nope, k_pe=k_pe, v=v, context=context, w_uk=w_uk, w_uv=w_uv)
    check_same_device(**inputs)
    check_values(scale, **inputs)
    return q_lens, kv_lens


def chunked_prefill(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                    context: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, q_lens, kv_lens,
                    scale: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` / ``k_nope`` / ``k_pe`` / ``v`` hold the new tokens (ragged by ``q_lens``); ``context`` ``[sum ctx, 576]``
    the context latent of each request, request after request."""
    check_int("chunk_size", chunk_size, 1)
    q_lens, kv_lens = check_prefill_inputs(q, k_nope, k_pe, v, context, w_uk, w_uv, q_lens, kv_lens, scale)
    heads, dv = q.shape[1], v.shape[-1]
    out = torch.zeros(q.shape[0], heads, dv, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    q0 = c0 = 0
    for q_len, ctx_len in zip(q_lens, context_lens(q_lens, kv_lens)):
        rows = slice(q0, q0 + q_len)
        prefix = (out[rows].clone(), lse[rows].clone())
        for start in range(0, ctx_len, chunk_size):
            chunk = context[c0 + start:c0 + min(ctx_len, start + chunk_size)]
            ck_nope, ck_pe, cv = up_project(chunk, w_uk, w_uv)
            partial = attend_prechecked(q[rows], mha_keys(ck_nope, ck_pe), cv, None, scale)
            prefix = merge_attn_states(*prefix, *partial)
        suffix = attend_prechecked(q[rows], mha_keys(k_nope[rows], k_pe[rows]), v[rows],
                                   causal_visible(q_len, q_len, q.device), scale)
        out[rows], lse[rows] = merge_attn_states(*prefix, *suffix)
        q0, c0 = q0 + q_len, c0 + ctx_len
    return out, lse


def context_token_rows(q_lens, kv_lens) -> torch.Tensor:
    """Rows of the ragged per-token arrays (``Problem.kv``, ``meta.token_slots``) that hold context tokens."""
    rows, start = [], 0
    for ctx_len, kv_len in zip(context_lens(q_lens, kv_lens), kv_lens):
        rows.extend(range(start, start + ctx_len))
        start += kv_len
    return torch.tensor(rows, dtype=torch.int64)


def prefill_with_context(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                         context: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, q_lens, kv_lens,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchunked ground truth of ``chunked_prefill``: one causal MHA over ``[context ; new tokens]``."""
    q_lens, kv_lens = check_prefill_inputs(q, k_nope, k_pe, v, context, w_uk, w_uv, q_lens, kv_lens, scale)
    ctx_k_nope, ctx_k_pe, ctx_v = up_project(context, w_uk, w_uv)
    keys_nope, keys_pe, values = [], [], []
    q0 = c0 = 0
    for q_len, ctx_len in zip(q_lens, context_lens(q_lens, kv_lens)):
        keys_nope += [ctx_k_nope[c0:c0 + ctx_len], k_nope[q0:q0 + q_len].double()]
        keys_pe += [ctx_k_pe[c0:c0 + ctx_len], k_pe[q0:q0 + q_len].double()]
        values += [ctx_v[c0:c0 + ctx_len], v[q0:q0 + q_len].double()]
        q0, c0 = q0 + q_len, c0 + ctx_len
    keys = mha_keys(torch.cat(keys_nope), torch.cat(keys_pe))
    return ragged_attention_prechecked(q, keys, torch.cat(values), q_lens, kv_lens, scale)
