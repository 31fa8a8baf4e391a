"""Accuracy: every selected impl judged against the float64 reference on every workload of the sweep.

Per workload the Problem and its references are built once and shared by every impl; an impl whose declared
capabilities refuse the workload is reported ``unsupported`` without building anything. Metrics carry the
``kernel.`` / ``e2e.`` prefixes, details the tolerances applied (the gate reads them).
"""

from __future__ import annotations

import traceback
from typing import Iterator

import torch

from mla_bench.problem import build_problem
from mla_bench.registry import Impl
from mla_bench.results import Result
from mla_bench.workload import Workload
from suites import sweeps
from suites.base import RunContext, load_impls
from suites.judge import References, judge, judged_tolerances


class AccuracySuite:
    name = "accuracy"
    shardable = True

    def workloads(self, ctx: RunContext) -> list[Workload]:
        return sweeps.shard(sweeps.select(ctx), ctx)

    def run(self, ctx: RunContext) -> Iterator[Result]:
        impls, failures = load_impls(ctx, self.name)
        yield from failures
        for workload in self.workloads(ctx):
            ctx.progress(workload.label)
            yield from judge_workload(workload, impls, ctx.device)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()


def judge_workload(workload: Workload, impls: list[Impl], device: torch.device) -> Iterator[Result]:
    """One Result per impl on ``workload``: the problem and references are built once, only if some impl
    accepts the workload."""
    accepted = []
    for impl in impls:
        reason = impl.capabilities.refusal(workload, device)
        if reason:
            yield _result(workload, impl, "unsupported", message=f"{impl.name}: unsupported {reason}")
        else:
            accepted.append(impl)
    if not accepted:
        return
    try:
        problem = build_problem(workload, device)
        refs = References.of(problem)
    except Exception:  # noqa: BLE001 - a bench failure on one workload must not stop the others
        message = f"could not build the problem or its reference:\n{traceback.format_exc()}"
        for impl in accepted:
            yield _result(workload, impl, "error", message=message)
        return
    for impl in accepted:
        try:
            verdict = judge(impl, problem, refs)
        except Exception:  # noqa: BLE001 - the judge could not undo what the impl did to the problem (a field deleted)
            yield _result(workload, impl, "error", message=f"judging it raised:\n{traceback.format_exc()}")
            problem = build_problem(workload, device)  # the same inputs (one seed), intact, for the next impls
            continue
        yield _result(workload, impl, verdict.status, metrics=verdict.metrics(),
                      message=verdict.message or "; ".join(verdict.violations),
                      details={"violations": verdict.violations, "tolerance": judged_tolerances(workload)})


def _result(workload: Workload, impl: Impl, status: str, **fields) -> Result:
    return Result("accuracy", "accuracy", status, impl=impl.name, workload=workload.to_dict(), label=workload.label,
                  **fields)
