"""vLLM's Triton MLA decode (``decode_attention_fwd``, the TRITON_MLA backend; SGLang's triton backend runs
the same kernel), called as vLLM's backend calls it.

Semantics taken from vLLM's ``triton_mla.py``: q ``[rows, H, 576]``, the cache viewed as ``[blocks, page, 1, 576]``
with values ``[..., :512]``, the block table as ``req_to_token``, one length per row, a float32 workspace
``[rows, H, splits, 512 + 1]``, natural-log lse ``[rows, H]``. A row with no key makes the kernel divide by zero,
so (as vLLM's callers do) its length is clamped to 1 and its row is overwritten with out 0, lse -inf. One
difference, on purpose: vLLM's backend hands the kernel an lse in the queries' dtype (bf16 rounds an lse near 10
by up to 0.03, beyond the bench's lse bound); here it is float32, so the kernel's own error is what is judged.

Two generations of the API, told apart by ``decode_attention_fwd``'s signature:

- with ``is_mla`` (vLLM 0.33): the backend passes ``is_mla=True`` (a 512-wide latent tile and a 64-wide rope tile;
  without it the kernel pads the 576 dims to one 1024-wide tile), the layer's ``k_scale`` and ``v_scale`` on every
  cache (a no-op on bf16), ``num_kv_splits`` from the batch's longest request and the SM count (``_kv_splits``), and
  uniform multi-token decode as one row per token, each with its causal extent;
- before it: 4 splits, one query per request, ``k_scale`` only with an fp8 cache.

Calling vLLM 0.33's kernel the old way (no ``is_mla``, 4 splits) measured 1.6-6.9x slower than vLLM's own call on an
H100 (NOTES.md, session 27).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch

from impls.external import BrokenPackage, installed, require
from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import NOPE_DIM
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

LEGACY_KV_SPLITS = 4  # vLLM's choice before is_mla (1 under batch invariance)


def _kv_splits(max_kv_len: int, sm_count: int) -> int:
    """vLLM 0.33's ``_compute_num_kv_splits``: a power of two near one split per 512 keys of the longest request,
    at most two per SM."""
    ideal = 1 << (max(1, max_kv_len // 512) - 1).bit_length()
    return min(ideal, 2 * sm_count)


@dataclass
class VllmPlan:
    args: tuple
    kwargs: dict
    out: torch.Tensor
    lse: torch.Tensor
    empty: torch.Tensor


class VllmTritonMLA(Impl):
    name = "vllm_triton_mla"
    description = "vLLM's Triton MLA decode (TRITON_MLA backend)"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), layouts=frozenset({"bf16", "fp8_e4m3"}),
                                dtypes=frozenset({"bfloat16"}), devices=frozenset({"cuda"}),
                                query_len_kinds=frozenset({"single", "uniform"}))

    def __init__(self) -> None:
        module = require("vllm.v1.attention.ops.triton_decode_attention", "vllm.attention.ops.triton_decode_attention",
                         names=("decode_attention_fwd",), hint="vLLM is not installed (pip install vllm)")
        self._fwd = module.decode_attention_fwd
        params = inspect.signature(self._fwd).parameters
        if "lse" not in params:  # an installed vLLM of another version: an error to see, not a silent skip
            raise BrokenPackage(f"{installed('vllm')} is installed but its decode_attention_fwd returns no lse "
                                "(need a vLLM with the lse output)")
        self._has_k_scale = "k_scale" in params
        self._mla_api = "is_mla" in params
        if not self._mla_api:
            self.description = f"vLLM's Triton MLA decode (TRITON_MLA backend before is_mla, {LEGACY_KV_SPLITS} splits)"
            self.capabilities = dataclasses.replace(self.capabilities, query_len_kinds=frozenset({"single"}))

    def plan(self, problem: Problem) -> VllmPlan:
        cache, meta = problem.cache, problem.meta
        fp8 = problem.workload.layout == "fp8_e4m3"
        if fp8 and not self._has_k_scale:
            raise UnsupportedConfig(f"{self.name}: layout fp8_e4m3 needs a vLLM whose decode takes k_scale")
        view = torch.float8_e4m3fn if fp8 else torch.bfloat16
        kv = cache.data.view(view).view(cache.num_blocks, cache.page_size, 1, -1)
        block_table, row_lens = self._rows(problem)
        rows, heads = problem.q.shape[0], problem.q.shape[1]
        # The stand-in kernels of the tests run on the CPU, where any count will do.
        sms = torch.cuda.get_device_properties(problem.device).multi_processor_count \
            if problem.device.type == "cuda" else 1
        splits = _kv_splits(max(meta.kv_lens, default=0), sms) if self._mla_api else LEGACY_KV_SPLITS
        out = torch.empty(rows, heads, NOPE_DIM, dtype=problem.q.dtype, device=problem.device)
        lse = torch.empty(rows, heads, dtype=torch.float32, device=problem.device)
        logits = torch.empty(rows, heads, splits, NOPE_DIM + 1, dtype=torch.float32, device=problem.device)
        kwargs = {}
        if fp8 or self._mla_api:  # the layer scale: switches an fp8 cache to the dequantize path, a no-op on bf16
            scale = torch.tensor(cache.tensor_scale if fp8 else 1.0, dtype=torch.float32, device=problem.device)
            kwargs["k_scale"] = scale
            if self._mla_api:
                kwargs.update(v_scale=scale, is_mla=True)
        args = (problem.q.contiguous(), kv, kv[..., :NOPE_DIM], out, lse, block_table, row_lens.clamp_min(1),
                logits, splits, problem.scale, cache.page_size)
        return VllmPlan(args, kwargs, out, lse, row_lens == 0)

    @staticmethod
    def _rows(problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        """One block-table row and length per query row: a request's ``q`` tokens see its first ``kv - q + 1 + t``
        keys (vLLM's fp8 FlashMLA fallback expands a uniform multi-token block so; its TRITON_MLA backend takes one
        query a request)."""
        meta, q_len = problem.meta, max(problem.meta.q_lens, default=1)
        if q_len == 1:
            return meta.block_table, meta.seq_lens
        causal = torch.arange(1 - q_len, 1, device=meta.seq_lens.device, dtype=meta.seq_lens.dtype)
        return (meta.block_table.repeat_interleave(q_len, dim=0),
                (meta.seq_lens[:, None] + causal).flatten().clamp_min(0))

    def poison(self, plan: VllmPlan) -> None:
        plan.out.fill_(float("nan"))
        plan.lse.fill_(float("nan"))

    def run(self, plan: VllmPlan) -> tuple[torch.Tensor, torch.Tensor]:
        self._fwd(*plan.args, **plan.kwargs)
        plan.out.masked_fill_(plan.empty[:, None, None], 0.0)
        plan.lse.masked_fill_(plan.empty[:, None], float("-inf"))
        return plan.out, plan.lse
