"""The torch baseline with the paged cache in host memory: attention runs on the CPU next to the cache, and only
the queries (in) and the output and lse (out) cross the bus; the cache never does.

This is the placement llama.cpp meant when the KV cache is not offloaded (PR 13648 fixed a matmul that still ran
on the GPU and pulled the cache over every step). On a CPU-only problem it computes what ``torch_eager`` does.
"""

from __future__ import annotations

import torch

from impls.torch_eager.impl import TorchEager, TorchEagerPlan, check_inputs, decode
from mla_bench.metadata.reference import request_token_slots
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities
from mla_bench.workload import Mode


class TorchEagerHostCache(TorchEager):
    name = "torch_eager_host_cache"
    description = "the torch baseline with the cache in host memory: CPU attention, only queries and outputs cross"
    capabilities = Capabilities(
        modes=frozenset({Mode.DECODE}),
        layouts=frozenset({"bf16"}),
        dtypes=frozenset({"bfloat16", "float16", "float32"}),
        devices=frozenset({"cpu", "cuda"}),
        cache_devices=frozenset({"cpu"}),
        attention_device="cpu",
    )

    def plan(self, problem: Problem) -> TorchEagerPlan:
        """The slot lists on the host, from one host copy of the block table, which is also the one checked (the
        metadata crosses once per step; a second copy can exceed the bus budget with page 1 and skewed lengths)."""
        meta = problem.meta
        block_table = meta.block_table
        if isinstance(block_table, torch.Tensor):  # anything else is named by the check, not failing in .to
            block_table = block_table.to(problem.cache.data.device)
        check_inputs(problem, block_table)
        slots = [request_token_slots(block_table, b, n, meta.page_size) for b, n in enumerate(meta.kv_lens)]
        return TorchEagerPlan(problem, slots)

    def run(self, plan: TorchEagerPlan) -> tuple[torch.Tensor, torch.Tensor]:
        p = plan.problem
        out, lse = decode(p, p.q.to(p.cache.data.device), plan.request_slots)
        return out.to(p.device), lse.to(p.device)
