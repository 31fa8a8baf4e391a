"""``triton_dcp``: the DCP path as a registered impl, each call a job for real rank processes (``launch``,
``ranks``); each rank attends its shard with the Triton paged decode (``attention="triton_decode"``, the default).
An impl made with another shard attention declares that attention's layouts: a layout it cannot read is refused
before any rank runs."""

from __future__ import annotations

import dataclasses

import torch

from impls.triton.dcp.attention import TritonDecodeShardAttention, shard_attention
from impls.triton.dcp.launch import default_backend, run_dcp
from mla_bench.dims import check_softmax_scale
from mla_bench.errors import UnsupportedConfig, describe
from mla_bench.layouts import LATENT_DIM
from mla_bench.metadata.reference import check_dcp
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode


class TritonDcp(Impl):
    name = "triton_dcp"
    description = "decode context parallel over W processes (gloo / NCCL), combined by LSE"
    # the default attention's layouts (the registered impl's); an impl made with another declares that one's
    capabilities = Capabilities(modes=frozenset({Mode.DCP}), layouts=TritonDecodeShardAttention.layouts)

    def __init__(self, attention: str = "triton_decode") -> None:
        layouts = shard_attention(attention).layouts  # an unknown name is refused here, not in every rank of every run
        self.attention = attention
        self.capabilities = dataclasses.replace(self.capabilities, layouts=layouts)

    def plan(self, problem: Problem) -> Problem:
        w = problem.workload
        try:  # run_dcp's own check (vLLM's rule too), made here so that such a workload is unsupported, not an error
            check_dcp(w.page_size, w.dcp_world, w.dcp_interleave)
        except ValueError as exc:
            raise UnsupportedConfig(f"{self.name}: {exc}") from None
        check_softmax_scale(problem.scale)  # else the ranks fail once started (the torch attention: NaN lse)
        # else queries of another shape failed in the ranks, float32 ones were rounded into the decode's bf16 buffer
        want = (w.total_q, w.dims.num_heads, LATENT_DIM)
        if problem.q.dtype != problem.dtype or tuple(problem.q.shape) != want:
            raise ValueError(f"{self.name}: q must be {problem.dtype} {list(want)} (the workload's dtype, tokens and "
                             f"heads), got {describe(problem.q)}")
        if problem.device.type == "cuda" and default_backend(w.dcp_world) != "nccl":
            raise UnsupportedConfig(f"{self.name}: dcp over W={w.dcp_world} ranks needs {w.dcp_world} GPUs, "
                                    f"{torch.cuda.device_count()} visible")
        return problem

    def run(self, plan: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        outcome = run_dcp(plan, attention=self.attention)
        return outcome.out.to(plan.device), outcome.lse.to(plan.device)
