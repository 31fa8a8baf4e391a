"""vLLM's Triton MLA decode (``decode_attention_fwd``, the TRITON_MLA backend; SGLang's triton backend runs
the same kernel).

Semantics taken from vLLM's ``triton_mla.py``: q ``[B, H, 576]`` (one query per request), the cache viewed as
``[blocks, page, 1, 576]`` with values ``[..., :512]``, the block table as ``req_to_token``, ``seq_lens``,
a float32 workspace ``[B, H, splits, 512 + 1]``, natural-log lse ``[B, H]``. A request with no key makes the
kernel divide by zero, so (as vLLM's callers do) its length is clamped to 1 and its row is overwritten with
out 0, lse -inf. The ``fp8_e4m3`` layout runs with the per-tensor ``k_scale`` where the vLLM version has it;
a bf16 cache runs without one, as in vLLM's TRITON_MLA backend.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from impls.external import require
from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import NOPE_DIM
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl, ImplNotInstalled
from mla_bench.workload import Mode

NUM_KV_SPLITS = 4  # vLLM's choice (1 under batch invariance)


@dataclass
class VllmPlan:
    args: tuple
    kwargs: dict
    out: torch.Tensor
    lse: torch.Tensor
    empty: torch.Tensor


class VllmTritonMLA(Impl):
    name = "vllm_triton_mla"
    description = "vLLM's Triton MLA decode (TRITON_MLA backend), num_kv_splits 4"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), layouts=frozenset({"bf16", "fp8_e4m3"}),
                                dtypes=frozenset({"bfloat16"}), devices=frozenset({"cuda"}),
                                query_len_kinds=frozenset({"single"}))

    def __init__(self) -> None:
        module = require("vllm.v1.attention.ops.triton_decode_attention", "vllm.attention.ops.triton_decode_attention",
                         hint="vLLM is not installed (pip install vllm)")
        self._fwd = module.decode_attention_fwd
        params = inspect.signature(self._fwd).parameters
        if "lse" not in params:
            raise ImplNotInstalled("this vLLM's decode_attention_fwd returns no lse (need vLLM with the lse output)")
        self._has_k_scale = "k_scale" in params

    def plan(self, problem: Problem) -> VllmPlan:
        cache, meta = problem.cache, problem.meta
        fp8 = problem.workload.layout == "fp8_e4m3"
        if fp8 and not self._has_k_scale:
            raise UnsupportedConfig(f"{self.name}: layout fp8_e4m3 needs a vLLM whose decode takes k_scale")
        view = torch.float8_e4m3fn if fp8 else torch.bfloat16
        kv = cache.data.view(view).view(cache.num_blocks, cache.page_size, 1, -1)
        batch, heads = problem.q.shape[0], problem.q.shape[1]
        out = torch.empty(batch, heads, NOPE_DIM, dtype=problem.q.dtype, device=problem.device)
        lse = torch.empty(batch, heads, dtype=torch.float32, device=problem.device)
        logits = torch.empty(batch, heads, NUM_KV_SPLITS, NOPE_DIM + 1, dtype=torch.float32, device=problem.device)
        kwargs = {}
        if fp8:  # as vLLM's backend: a k_scale switches the kernel to its fp8 dequantize path
            kwargs["k_scale"] = torch.tensor(cache.tensor_scale, dtype=torch.float32, device=problem.device)
        args = (problem.q.contiguous(), kv, kv[..., :NOPE_DIM], out, lse, meta.block_table, meta.seq_lens.clamp_min(1),
                logits, NUM_KV_SPLITS, problem.scale, cache.page_size)
        return VllmPlan(args, kwargs, out, lse, meta.seq_lens == 0)

    def poison(self, plan: VllmPlan) -> None:
        plan.out.fill_(float("nan"))
        plan.lse.fill_(float("nan"))

    def run(self, plan: VllmPlan) -> tuple[torch.Tensor, torch.Tensor]:
        self._fwd(*plan.args, **plan.kwargs)
        plan.out.masked_fill_(plan.empty[:, None, None], 0.0)
        plan.lse.masked_fill_(plan.empty[:, None], float("-inf"))
        return plan.out, plan.lse
