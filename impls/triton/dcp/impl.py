"""``triton_dcp``: the DCP path as a registered impl, each call a real multi-process run (see ``launch``); each
rank attends its shard with the Triton paged decode (``attention="triton_decode"``, the default)."""

from __future__ import annotations

import torch

from impls.triton.dcp.attention import shard_attention
from impls.triton.dcp.launch import default_backend, run_dcp
from impls.triton.decode import KERNEL_LAYOUTS
from mla_bench.errors import UnsupportedConfig
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode


class TritonDcp(Impl):
    name = "triton_dcp"
    description = "decode context parallel over W processes (gloo / NCCL), combined by LSE"
    capabilities = Capabilities(modes=frozenset({Mode.DCP}), layouts=frozenset(KERNEL_LAYOUTS))  # the decode's

    def __init__(self, attention: str = "triton_decode") -> None:
        shard_attention(attention)  # an unknown name is refused here, not in every rank of every run
        self.attention = attention

    def plan(self, problem: Problem) -> Problem:
        world = problem.workload.dcp_world
        if problem.device.type == "cuda" and default_backend(world) != "nccl":
            raise UnsupportedConfig(f"{self.name}: W={world} ranks need {world} GPUs, "
                                    f"{torch.cuda.device_count()} visible")
        return problem

    def run(self, plan: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        outcome = run_dcp(plan, attention=self.attention)
        return outcome.out.to(plan.device), outcome.lse.to(plan.device)
