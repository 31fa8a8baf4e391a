"""The float64 answer to a Problem, from the cache as stored or from the original values.

``source="cache"`` reads keys from the (dequantized) paged cache: the error against it is the kernel's own.
``source="original"`` uses the values before quantization: the error against it is end-to-end (kernel plus
cache format). For the bf16 layout and for prefill both are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_bench.layouts.ops import gather_cache
from mla_bench.problem import Problem
from mla_bench.workload import Mode
from reference.absorbed import latent_mqa
from reference.chunked import context_token_rows, prefill_with_context
from reference.mha import mha_attention
from reference.sparse import sparse_latent_mqa

SOURCES = ("cache", "original")


@dataclass
class Expected:
    out: torch.Tensor  # float64 [T, H, Dv]
    lse: torch.Tensor  # float64 [T, H], natural log, -inf for empty rows


def latent_tokens(problem: Problem, source: str) -> torch.Tensor:
    """Every request's latent tokens, request after request, as float64 ``[N, 576]``."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "original" or problem.cache is None:
        return problem.kv.double()
    return gather_cache(problem.cache, problem.meta.token_slots).to(problem.device)  # the cache may live elsewhere


def expected(problem: Problem, source: str = "cache") -> Expected:
    """The reference output of ``problem``'s mode."""
    w, meta = problem.workload, problem.meta
    mode = w.mode
    if mode in (Mode.DECODE, Mode.DCP):
        out, lse = latent_mqa(problem.q, latent_tokens(problem, source), meta.q_lens, meta.kv_lens, problem.scale)
    elif mode.sparse:
        out, lse = sparse_latent_mqa(problem.q, latent_tokens(problem, source), problem.topk_indices, meta.q_lens,
                                     meta.kv_lens, problem.scale)
    elif mode is Mode.PREFILL:
        out, lse = mha_attention(problem.q, problem.k_nope, problem.k_pe, problem.v, meta.q_lens, meta.kv_lens,
                                 problem.scale)
    elif mode is Mode.CHUNKED_PREFILL:
        rows = context_token_rows(meta.q_lens, meta.kv_lens).to(problem.device)
        context = latent_tokens(problem, source)[rows]
        out, lse = prefill_with_context(problem.q, problem.k_nope, problem.k_pe, problem.v, context, problem.w_uk,
                                        problem.w_uv, meta.q_lens, meta.kv_lens, problem.scale)
    else:  # pragma: no cover - Mode is a closed enum
        raise ValueError(f"no reference for mode {mode}")
    return Expected(out, lse)
