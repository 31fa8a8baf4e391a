"""A problem's attention at other magnitudes, for tests of kernels that multiply in float16."""

from __future__ import annotations

import torch

from mla_bench.layouts import NOPE_DIM, PagedCache
from mla_bench.layouts.ops import write_cache
from mla_bench.problem import Problem


def magnified(problem: Problem, q_factor: float, kv_factor: float) -> Problem:
    """The same attention with the query times ``q_factor`` and the cache's tokens times ``kv_factor`` (powers of
    two: bf16 values stay exact), the softmax scale divided by both: equal scores, outputs times ``kv_factor``."""
    problem.q = problem.q * q_factor
    problem.kv = problem.kv * kv_factor
    problem.scale = problem.scale / (q_factor * kv_factor)
    return _rewritten(problem)


def latent_columns_magnified(problem: Problem, factors: torch.Tensor) -> Problem:
    """The same scores with each latent column of the cache's tokens times its entry of ``factors`` (powers of two)
    and the query's divided by it: output columns times ``factors``. Block-scaled layouts whose blocks get one factor
    each store the same codes, their block exponents shifted."""
    latent = (problem.q[..., :NOPE_DIM] / factors.to(problem.q.device)).to(problem.q.dtype)
    problem.q = torch.cat([latent, problem.q[..., NOPE_DIM:]], -1)
    problem.kv = torch.cat([problem.kv[:, :NOPE_DIM] * factors.to(problem.kv.device), problem.kv[:, NOPE_DIM:]], -1)
    return _rewritten(problem)


def _rewritten(problem: Problem) -> Problem:
    """``problem`` with its cache rebuilt from its tokens."""
    layout, meta = problem.cache.layout, problem.meta
    problem.cache = PagedCache.empty(layout, meta.num_blocks, meta.page_size, device=problem.kv.device,
                                     tensor_scale=layout.fit_tensor_scale(problem.kv))
    write_cache(problem.cache, problem.kv, meta.token_slots)
    return problem
