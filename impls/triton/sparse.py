"""Sparse top-k impls: ``triton_sparse`` reads the paged cache by PAGED indices, ``triton_sparse_ragged``
gathers every request's tokens into one request-after-request buffer and reads it by RAGGED indices.

The RAGGED buffer keeps each token's cache encoding (for ``bf16`` that is the dequantized bf16 key, as in
SGLang's ``dequantize_k_cache_paged``; for FP8 layouts the codes and scales), and the kernel decodes it as it
decodes the cache. Dequantizing ``fp8_ds_mla`` into a bf16 buffer instead rounds every key whose scale is not a
power of two: measured here, an lse error of 0.013 to 0.045, beyond the bf16 kernel bound of 0.005.

Each declares the one index transform it takes; the other is refused at plan time with ``UnsupportedConfig``
(SGLang PR 21835: a backend that received indices of the other transform crashed mid-forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impls.triton.latent_io import LAYOUT_CODES, cache_tensor_scale, layout_code
from impls.triton.sparse_kernel import SparseConfig, check_indices, check_wgmma, default_config, sparse_mqa
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

SPARSE_MODES = frozenset({Mode.SPARSE_DECODE, Mode.SPARSE_PREFILL})


@dataclass
class SparsePlan:
    problem: Problem
    out: torch.Tensor
    lse: torch.Tensor
    config: SparseConfig
    layout: int                         # kernel constexpr of the row source's layout
    buffer: torch.Tensor | None = None  # RAGGED: [N, bytes_per_token] the requests' tokens, in order


class _TritonSparseBase(Impl):
    def __init__(self, config: SparseConfig | None = None) -> None:
        self.config = config

    def _outputs(self, problem: Problem, layout: int, buffer: torch.Tensor | None = None) -> SparsePlan:
        tokens, heads = problem.q.shape[:2]
        # what sparse_mqa takes, checked here so that plan refuses it, not run
        check_indices(problem.sparse_indices, tokens, problem.q.device, f"{self.name}: sparse_indices")
        out = torch.empty(tokens, heads, problem.out_dim, dtype=problem.q.dtype, device=problem.device)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=problem.device)
        config = self.config or default_config(problem.device, heads, layout, problem.q.dtype)
        check_wgmma(config, problem.device, layout, problem.q.dtype)
        return SparsePlan(problem, out, lse, config, layout, buffer)

    def poison(self, plan: SparsePlan) -> None:
        plan.out.fill_(float("nan"))
        plan.lse.fill_(float("nan"))


class TritonSparse(_TritonSparseBase):
    name = "triton_sparse"
    description = "sparse top-k MQA reading (and dequantizing) the paged cache by PAGED slot indices"
    capabilities = Capabilities(modes=SPARSE_MODES, layouts=frozenset(LAYOUT_CODES),
                                index_transforms=frozenset({"paged"}), graph_safe=True)

    def plan(self, problem: Problem) -> SparsePlan:
        return self._outputs(problem, layout_code(problem.cache.layout.name))

    def run(self, plan: SparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
        p = plan.problem
        return sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), plan.layout, p.scale, cache_tensor_scale(p.cache),
                          plan.out, plan.lse, plan.config)


class TritonSparseRagged(_TritonSparseBase):
    name = "triton_sparse_ragged"
    description = "sparse top-k MQA over the requests' tokens gathered in order, by RAGGED row indices"
    capabilities = Capabilities(modes=SPARSE_MODES, layouts=frozenset(LAYOUT_CODES),
                                index_transforms=frozenset({"ragged"}), graph_safe=True)

    def plan(self, problem: Problem) -> SparsePlan:
        cache = problem.cache
        buffer = torch.empty(problem.meta.token_slots.shape[0], cache.layout.bytes_per_token, dtype=torch.uint8,
                             device=problem.device)
        return self._outputs(problem, layout_code(cache.layout.name), buffer)

    def run(self, plan: SparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
        p = plan.problem
        torch.index_select(p.cache.rows(), 0, p.meta.token_slots, out=plan.buffer)
        return sparse_mqa(p.q, p.sparse_indices, plan.buffer, plan.layout, p.scale, cache_tensor_scale(p.cache),
                          plan.out, plan.lse, plan.config)
