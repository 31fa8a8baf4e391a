"""FlashMLA (deepseek-ai/FlashMLA): ``flash_mla_with_kvcache`` (dense decode over a bf16 cache, sparse decode
over the ``fp8_ds_mla_pow2`` cache with 64 or 128 heads) and ``flash_mla_sparse_fwd`` (sparse prefill over bf16
latent rows). The sparse decode's Hopper kernel rounds each tile scale to bf16 (``splitkv_mla.cuh``), so it
takes the power-of-two scales its own quantizer writes; the exact fp32 scales of ``fp8_ds_mla`` are refused.

From ``flash_mla_interface.py``: q ``[B, s_q, H, 576]`` (every request the same query length), k_cache
``[blocks, 64, 1, 576]`` bf16 (or ``[blocks, page, 1, 656]`` FP8 with per-128 scales and bf16 rope),
``block_table`` int32, ``cache_seqlens`` int32, out ``[B, s_q, H, 512]``, lse ``[B, H, s_q]`` natural log,
+inf for a row with no key (declared; the bench maps it to -inf). Sparse indices are physical cache slots
(the PAGED transform), -1 invalid. ``get_mla_metadata`` takes no arguments in current FlashMLA and the old
``(cache_seqlens, s_q * H, 1, ...)`` in earlier versions; both are handled. ``flash_mla_sparse_fwd`` takes
q ``[T, H, 576]``, kv ``[rows, 1, 576]`` and indices ``[T, 1, topk]`` into those rows: the paged cache's slots
(PAGED) or a gathered copy of every request's tokens (RAGGED); it returns ``(out, max_logits, lse)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from impls.external import require
from mla_bench.errors import UnsupportedConfig
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

HINT = "FlashMLA is not installed (build github.com/deepseek-ai/FlashMLA)"
TOPK_ALIGN = 128  # the sparse kernels walk top-k in blocks; -1 padding up to a multiple is ignored by them


@dataclass
class FlashMLAPlan:
    call: Any          # the kernel call with every argument bound
    tokens: int
    heads: int


def _pad_topk(indices: torch.Tensor) -> torch.Tensor:
    pad = (-indices.shape[-1]) % TOPK_ALIGN
    if pad:
        indices = torch.cat([indices, indices.new_full((*indices.shape[:-1], pad), -1)], dim=-1)
    return indices.to(torch.int32).contiguous()


class FlashMLA(Impl):
    name = "flashmla"
    description = "FlashMLA flash_mla_with_kvcache: dense decode (bf16, page 64), sparse decode (fp8_ds_mla_pow2)"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE, Mode.SPARSE_DECODE}),
                                layouts=frozenset({"bf16", "fp8_ds_mla_pow2"}), dtypes=frozenset({"bfloat16"}),
                                devices=frozenset({"cuda"}), page_sizes=frozenset({64}),
                                query_len_kinds=frozenset({"single", "uniform"}),
                                index_transforms=frozenset({"paged"}), empty_lse="+inf")

    def __init__(self) -> None:
        self._mla = require("flash_mla", names=("get_mla_metadata", "flash_mla_with_kvcache"), hint=HINT)

    def refusal(self, problem: Problem) -> str | None:
        w = problem.workload
        wanted = "bf16" if w.mode is Mode.DECODE else "fp8_ds_mla_pow2"
        if w.mode in self.capabilities.modes and w.layout != wanted:
            why = "; its kernel rounds tile scales to bf16" if w.layout == "fp8_ds_mla" else ""
            return f"layout {w.layout} in mode {w.mode.value} (FlashMLA's {w.mode.value} takes {wanted}{why})"
        heads = problem.q.shape[1]
        if w.mode is Mode.SPARSE_DECODE and heads not in (64, 128):
            return f"{heads} heads in mode sparse_decode (FlashMLA's sparse decode runs 64 or 128)"
        return super().refusal(problem)

    def _metadata(self, seqlens: torch.Tensor, q_per_head_k: int, heads: int, topk: int | None) -> tuple:
        try:
            return self._mla.get_mla_metadata()
        except TypeError:  # FlashMLA before the scheduler moved into the first call
            extra = {} if topk is None else {"num_heads_q": heads, "is_fp8_kvcache": True, "topk": topk}
            return self._mla.get_mla_metadata(seqlens, q_per_head_k, 1, **extra)

    def plan(self, problem: Problem) -> FlashMLAPlan:
        w, meta, cache = problem.workload, problem.meta, problem.cache
        batch, s_q = meta.batch, w.q_lens[0]
        tokens, heads = problem.q.shape[0], problem.q.shape[1]
        q = problem.q.reshape(batch, s_q, heads, -1).contiguous()
        view = torch.bfloat16 if w.mode is Mode.DECODE else torch.float8_e4m3fn
        k_cache = cache.data.view(view).view(cache.num_blocks, cache.page_size, 1, -1)
        seqlens = meta.seq_lens.to(torch.int32)
        if w.mode is Mode.DECODE:
            sched, splits = self._metadata(seqlens, s_q * heads, heads, None)
            kwargs = dict(softmax_scale=problem.scale, causal=s_q > 1)
            args = (q, k_cache, meta.block_table, seqlens, 512, sched, splits)
        else:
            indices = _pad_topk(problem.sparse_indices).view(batch, s_q, -1)
            sched, splits = self._metadata(seqlens, s_q * heads, heads, indices.shape[-1])
            kwargs = dict(softmax_scale=problem.scale, causal=False, is_fp8_kvcache=True, indices=indices)
            args = (q, k_cache, None, None, 512, sched, splits)
        fn = self._mla.flash_mla_with_kvcache
        return FlashMLAPlan(lambda: fn(*args, **kwargs), tokens, heads)

    def run(self, plan: FlashMLAPlan) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = plan.call()
        return out.reshape(plan.tokens, plan.heads, -1), lse.transpose(1, 2).reshape(plan.tokens, plan.heads)


class FlashMLASparsePrefill(Impl):
    name = "flashmla_sparse"
    description = "FlashMLA flash_mla_sparse_fwd: sparse top-k attention over bf16 latent rows (PAGED or RAGGED)"
    capabilities = Capabilities(modes=frozenset({Mode.SPARSE_PREFILL, Mode.SPARSE_DECODE}),
                                layouts=frozenset({"bf16"}), dtypes=frozenset({"bfloat16"}),
                                devices=frozenset({"cuda"}), head_counts=frozenset({64, 128}), empty_lse="+inf")

    def __init__(self) -> None:
        self._mla = require("flash_mla", names=("flash_mla_sparse_fwd",), hint=HINT)

    def plan(self, problem: Problem) -> FlashMLAPlan:
        rows = problem.cache.rows().view(torch.bfloat16)
        if problem.workload.index_transform == "ragged":
            rows = rows[problem.meta.token_slots]  # the gathered buffer RAGGED indices point into
        elif problem.workload.index_transform != "paged":
            raise UnsupportedConfig(f"{self.name}: index transform {problem.workload.index_transform}")
        q, kv = problem.q.contiguous(), rows.unsqueeze(1).contiguous()
        indices = _pad_topk(problem.sparse_indices).unsqueeze(1)
        fn, scale = self._mla.flash_mla_sparse_fwd, problem.scale
        return FlashMLAPlan(lambda: fn(q, kv, indices, scale, 512), q.shape[0], q.shape[1])

    def run(self, plan: FlashMLAPlan) -> tuple[torch.Tensor, torch.Tensor]:
        out, _max_logits, lse = plan.call()[:3]
        return out, lse
