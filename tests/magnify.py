"""A problem's attention at other magnitudes, for tests of kernels that multiply in float16."""

from __future__ import annotations

from mla_bench.layouts import PagedCache
from mla_bench.layouts.ops import write_cache
from mla_bench.problem import Problem


def magnified(problem: Problem, q_factor: float, kv_factor: float) -> Problem:
    """The same attention with the query times ``q_factor`` and the cache's tokens times ``kv_factor`` (powers of
    two: bf16 values stay exact), the softmax scale divided by both: equal scores, outputs times ``kv_factor``."""
    problem.q = problem.q * q_factor
    problem.kv = problem.kv * kv_factor
    problem.scale = problem.scale / (q_factor * kv_factor)
    layout, meta = problem.cache.layout, problem.meta
    problem.cache = PagedCache.empty(layout, meta.num_blocks, meta.page_size, device=problem.kv.device,
                                     tensor_scale=layout.fit_tensor_scale(problem.kv))
    write_cache(problem.cache, problem.kv, meta.token_slots)
    return problem
