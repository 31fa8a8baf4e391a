"""The attention core every reference path is built on: masked softmax attention in float64.

Empty rows (no visible key) give out 0 and lse -inf; lse is the natural log of the softmax denominator.
"""

from __future__ import annotations

import torch

from reference.checks import check_ragged_rows, check_same_device, check_tensor, check_values

# Score-matrix elements per block of query rows: bounds the reference's memory on long contexts.
_BLOCK_ELEMENTS = 1 << 25


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[M, H, D]`` over ``k`` ``[N, Hk, D]`` / ``v`` ``[N, Hk, Dv]`` (``Hk`` is 1 or H).

    ``visible`` ``[M, N]`` (bool, or None for all) says which keys each query row may see.
    Returns ``out`` ``[M, H, Dv]`` and ``lse`` ``[M, H]``, both float64.
    """
    check_attend_inputs(q, k, v, visible)
    check_values(scale, q=q, k=k, v=v)
    return attend_prechecked(q, k, v, visible, scale)


def check_attend_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None) -> None:
    """The structure of ``attend``'s inputs: dtypes, shapes, one device, and a bool mask (or None)."""
    check_tensor("q", q, 3)
    check_tensor("k", k, 3, last=q.shape[-1])
    check_tensor("v", v, 3)
    if visible is not None and (not isinstance(visible, torch.Tensor) or visible.dtype != torch.bool):
        got = visible.dtype if isinstance(visible, torch.Tensor) else type(visible).__name__
        raise ValueError(f"visible must be a bool tensor (or None), got {got}")
    check_same_device(q=q, k=k, v=v, visible=visible)
    if k.shape[1] not in (1, q.shape[1]) or v.shape[1] != k.shape[1] or v.shape[0] != k.shape[0]:
        raise ValueError(f"k / v must be [N, 1 or {q.shape[1]}, D] with matching N and heads, got "
                         f"{list(k.shape)} and {list(v.shape)}")
    if visible is not None and visible.shape != (q.shape[0], k.shape[0]):
        raise ValueError(f"visible must be [{q.shape[0]}, {k.shape[0]}], got {list(visible.shape)}")


def attend_prechecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` without the checks, for callers that checked their own inputs (the value check reads them all)."""
    q, k, v = q.double(), k.double(), v.double()
    rows, heads = q.shape[0], q.shape[1]
    n = k.shape[0]
    out = torch.zeros(rows, heads, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64, device=q.device)
    if rows == 0 or n == 0:
        return out, lse
    step = max(1, _BLOCK_ELEMENTS // max(1, heads * n))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        scores = _heads_einsum("mhd,nhd->mhn", q[r0:r1], k) * float(scale)  # a Fraction passes the check
        if visible is not None:
            scores = scores.masked_fill(~visible[r0:r1, None, :], float("-inf"))
        probs, lse[r0:r1] = masked_softmax(scores)
        out[r0:r1] = _heads_einsum("mhn,nhd->mhd", probs, v)
    return out, lse


def _heads_einsum(spec: str, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """``einsum(spec, x, shared)`` where ``shared`` ``[N, Hk, D]`` has one head (MQA, never expanded) or H."""
    if shared.shape[1] == 1:
        return torch.einsum(spec.replace("nhd", "nd"), x, shared[:, 0])
    return torch.einsum(spec, x, shared)


def masked_softmax(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of ``scores`` (-inf = masked) and its natural-log LSE; a row with no finite
    score gives probabilities 0 and lse -inf (never NaN)."""
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
    return torch.where(empty[..., None], 0.0, probs), lse


def causal_visible(q_len: int, kv_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[q_len, kv_len]`` mask: query ``i`` sees key ``j`` iff ``j <= kv_len - q_len + i``."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= kv_len - q_len + i


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int] | tuple[int, ...],
                     kv_lens: list[int] | tuple[int, ...], scale: float,
                     causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a ragged batch: request ``b`` owns ``q_lens[b]`` rows of ``q`` and ``kv_lens[b]`` rows of
    ``k`` / ``v``, each request after the previous one. Causal masking aligns queries to the end of the keys."""
    check_attend_inputs(q, k, v, None)
    q_lens, kv_lens = check_ragged_rows(q_lens, kv_lens, q, "k", k, causal)
    check_values(scale, q=q, k=k, v=v)
    return ragged_attention_prechecked(q, k, v, q_lens, kv_lens, scale, causal)


def ragged_attention_prechecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens, kv_lens, scale: float,
                                causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``ragged_attention`` without the checks, for callers that checked their own inputs."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    q0 = k0 = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        visible = causal_visible(q_len, kv_len, q.device) if causal else None
        rows, keys = slice(q0, q0 + q_len), slice(k0, k0 + kv_len)
        out[rows], lse[rows] = attend_prechecked(q[rows], k[keys], v[keys], visible, scale)
        q0, k0 = q0 + q_len, k0 + kv_len
    return out, lse
