"""``triton_prefill``: MLA's compute-friendly prefill (ragged causal MHA, qk 192, v 128) in one Triton kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from impls.triton.cache_ops import triton_unavailable
from impls.triton.common import check_placed
from impls.triton.prefill_kernel import PrefillConfig, check_mha_inputs, default_config, mha_prefill
from mla_bench.metadata.reference import cumulative
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode


def check_problem(problem: Problem, cu_seqlens_k: torch.Tensor, key_lens: Sequence[int]) -> None:
    """ValueError, at plan time, for what ``mha_prefill`` refuses or reads wrongly: its own checks, queries
    and keys with other row counts than the lengths give (``sum(q_lens)``, ``sum(key_lens)``), and offsets other
    than the lengths' (read on the host): the kernel reads and writes the rows the offsets name, past the end of a
    shorter tensor (it corrupted the heap) or another request's. Devices: the plan's outputs are on the problem's,
    the other inputs must be on q's (``check_mha_inputs``)."""
    meta = problem.meta
    check_placed(problem.device, "the problem", q=problem.q)
    check_mha_inputs(problem.q, problem.k_nope, problem.k_pe, problem.v, meta.query_start_loc, cu_seqlens_k,
                     problem.scale)
    for name, tensor, rows in (("q", problem.q, sum(meta.q_lens)), ("k_nope", problem.k_nope, sum(key_lens))):
        if tensor.shape[0] != rows:  # k_pe and v have k_nope's rows (check_mha_inputs)
            raise ValueError(f"{name} has {tensor.shape[0]} rows but the lengths give {rows}")
    for name, offsets, lens in (("query_start_loc", meta.query_start_loc, meta.q_lens),
                                ("cu_seqlens_k", cu_seqlens_k, key_lens)):
        got, want = offsets.tolist(), cumulative(list(lens))
        if got != want:
            i = next(i for i, (g, w) in enumerate(zip(got + [None], want + [None])) if g != w)
            raise ValueError(f"{name} must hold the lengths' {len(want)} offsets: entry {i} is {got[i:i + 1]}, "
                             f"the lengths give {want[i:i + 1]}")


@dataclass
class PrefillPlan:
    problem: Problem
    out: torch.Tensor  # [T, H, 128], written by run
    lse: torch.Tensor  # [T, H] float32
    config: PrefillConfig


class TritonPrefill(Impl):
    name = "triton_prefill"
    description = "Triton flash attention: ragged causal MHA with the rope key shared by all heads"
    capabilities = Capabilities(
        modes=frozenset({Mode.PREFILL}),
        dtypes=frozenset({"bfloat16", "float16"}),
        graph_safe=True,
    )

    def __init__(self, config: PrefillConfig | None = None) -> None:
        self.config = config

    def refusal(self, problem: Problem) -> str | None:
        return super().refusal(problem) or triton_unavailable(problem.device)

    def plan(self, problem: Problem) -> PrefillPlan:
        check_problem(problem, problem.meta.kv_start_loc, problem.meta.kv_lens)
        tokens, heads = problem.q.shape[:2]
        out = torch.empty(tokens, heads, problem.out_dim, dtype=problem.q.dtype, device=problem.device)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=problem.device)
        return PrefillPlan(problem, out, lse, self.config or default_config(problem.device))

    def poison(self, plan: PrefillPlan) -> None:
        plan.out.fill_(float("nan"))
        plan.lse.fill_(float("nan"))

    def run(self, plan: PrefillPlan) -> tuple[torch.Tensor, torch.Tensor]:
        p = plan.problem
        return mha_prefill(p.q, p.k_nope, p.k_pe, p.v, p.meta.query_start_loc, p.meta.kv_start_loc,
                           p.meta.max_qo_len, p.scale, causal=True, out=plan.out, lse=plan.lse, config=plan.config)
