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

from impls.triton.cache_ops import triton_unavailable
from impls.triton.latent_io import LAYOUT_CODES, cache_tensor_scale, layout_code
from impls.triton.common import check_e4m3, check_token_slots
from impls.triton.sparse_kernel import (SparseConfig, check_inputs, check_wgmma, default_config, sparse_mqa,
                                        split_workspace)
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

SPARSE_MODES = frozenset({Mode.SPARSE_DECODE, Mode.SPARSE_PREFILL})
# the Triton kernel takes either; the Gluon kernel (SparseConfig.wgmma) bf16 only: the default config runs it on bf16
# queries only, and plan refuses float16 asked of it (check_wgmma)
SPARSE_DTYPES = frozenset({"bfloat16", "float16"})


@dataclass
class SparsePlan:
    problem: Problem
    out: torch.Tensor
    lse: torch.Tensor
    config: SparseConfig
    layout: int                         # kernel constexpr of the row source's layout
    buffer: torch.Tensor | None = None  # RAGGED: [N, bytes_per_token] the requests' tokens, in order
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # the cut lists' partials (split_workspace)


class _TritonSparseBase(Impl):
    def __init__(self, config: SparseConfig | None = None) -> None:
        self.config = config

    def refusal(self, problem: Problem) -> str | None:
        """Beyond the capabilities: CPU problems without the Triton interpreter (its launcher failed on them in run)."""
        return super().refusal(problem) or triton_unavailable(problem.device)

    def _outputs(self, problem: Problem, rows: torch.Tensor, buffer: torch.Tensor | None = None) -> SparsePlan:
        """The plan's outputs and tiles, once what ``sparse_mqa`` takes is checked (so that plan refuses it, not run);
        ``rows``: the source run reads."""
        layout = layout_code(problem.cache.layout.name)
        q = problem.q
        check_inputs(q, problem.sparse_indices, rows, layout, problem.scale, name=self.name,
                     tensor_scale=problem.cache.tensor_scale)
        tokens, heads = q.shape[:2]
        out = torch.empty(tokens, heads, problem.out_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
        config = self.config or default_config(q.device, heads, layout, q.dtype)
        check_e4m3(q.device, problem.cache.layout.name, self.name)
        check_wgmma(config, q.device, layout, q.dtype)
        return SparsePlan(problem, out, lse, config, layout, buffer, split_workspace(q, problem.sparse_indices, config))

    def poison(self, plan: SparsePlan) -> None:
        for tensor in (plan.out, plan.lse, *(plan.workspace or ())):
            tensor.fill_(float("nan"))


class TritonSparse(_TritonSparseBase):
    name = "triton_sparse"
    description = "sparse top-k MQA reading (and dequantizing) the paged cache by PAGED slot indices"
    capabilities = Capabilities(modes=SPARSE_MODES, layouts=frozenset(LAYOUT_CODES), dtypes=SPARSE_DTYPES,
                                index_transforms=frozenset({"paged"}), graph_safe=True)

    def plan(self, problem: Problem) -> SparsePlan:
        return self._outputs(problem, problem.cache.rows())

    def run(self, plan: SparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
        p = plan.problem
        return sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), plan.layout, p.scale, cache_tensor_scale(p.cache),
                          plan.out, plan.lse, plan.config, plan.workspace)


class TritonSparseRagged(_TritonSparseBase):
    name = "triton_sparse_ragged"
    description = "sparse top-k MQA over the requests' tokens gathered in order, by RAGGED row indices"
    capabilities = Capabilities(modes=SPARSE_MODES, layouts=frozenset(LAYOUT_CODES), dtypes=SPARSE_DTYPES,
                                index_transforms=frozenset({"ragged"}), graph_safe=True)

    def plan(self, problem: Problem) -> SparsePlan:
        """Also refuses token slots or a cache that run would gather wrongly (``check_token_slots``): a slot outside
        the cache was an IndexError in run (a device-side assert on a GPU), a short list a short buffer whose missing
        rows the kernel skips."""
        cache, meta = problem.cache, problem.meta
        try:
            check_token_slots(problem)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        buffer = torch.empty(meta.token_slots.shape[0], cache.layout.bytes_per_token, dtype=torch.uint8,
                             device=problem.device)
        return self._outputs(problem, buffer, buffer)

    def run(self, plan: SparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
        p = plan.problem
        torch.index_select(p.cache.rows(), 0, p.meta.token_slots, out=plan.buffer)
        return sparse_mqa(p.q, p.sparse_indices, plan.buffer, plan.layout, p.scale, cache_tensor_scale(p.cache),
                          plan.out, plan.lse, plan.config, plan.workspace)
