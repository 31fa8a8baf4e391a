"""Judge one impl on one problem: plan, poison, run, compare with the float64 reference, apply tolerances.

The verdict's status is ``unsupported`` (refused at plan time, with the reason), ``error`` (anything raised
past planning, with the traceback), ``failed`` (a tolerance broken; each violation named) or ``passed``.
Quantized layouts get two error reports: ``kernel`` (against the reference on the dequantized cache, judged
by the kernel tolerance) and ``e2e`` (against the original values, judged by the layout's e2e tolerance).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch

from mla_bench.compare import ErrorMetrics, compare, normalize_lse
from mla_bench.errors import UnsupportedConfig
from mla_bench.problem import Problem
from mla_bench.registry import Impl
from mla_bench.tolerances import tolerance_for
from reference.expected import Expected, expected

STATUSES = ("passed", "failed", "unsupported", "error")


@dataclass
class Verdict:
    status: str
    kernel: ErrorMetrics | None = None
    e2e: ErrorMetrics | None = None
    violations: list[str] = field(default_factory=list)
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "unsupported")


@dataclass
class References:
    """The reference answers of one problem, computed once and shared by every impl judged on it."""

    cache: Expected
    original: Expected

    @classmethod
    def of(cls, problem: Problem) -> "References":
        cache = expected(problem, "cache")
        lossless = problem.cache is None or problem.workload.layout == "bf16"
        return cls(cache, cache if lossless else expected(problem, "original"))


def judge(impl: Impl, problem: Problem, refs: References | None = None) -> Verdict:
    """Run ``impl`` on ``problem`` and judge its output."""
    try:
        plan = impl.plan(problem)
    except UnsupportedConfig as exc:
        return Verdict("unsupported", message=str(exc))
    except Exception:  # noqa: BLE001 - any crash of an impl is a result, not a bench failure
        return Verdict("error", message=traceback.format_exc())
    try:
        impl.poison(plan)
        out, lse = impl.run(plan)
        if problem.device.type == "cuda":
            torch.cuda.synchronize(problem.device)
        refs = refs or References.of(problem)
        caps = impl.capabilities
        lse = normalize_lse(lse, caps.lse_base, caps.empty_lse)
        kernel = compare(out, lse, refs.cache.out, refs.cache.lse)
        e2e = compare(out, lse, refs.original.out, refs.original.lse)
    except Exception:  # noqa: BLE001
        return Verdict("error", message=traceback.format_exc())
    w = problem.workload
    violations = [f"kernel: {v}" for v in tolerance_for(w.dtype, w.layout, "kernel").violations(kernel)]
    violations += [f"e2e: {v}" for v in tolerance_for(w.dtype, w.layout, "e2e").violations(e2e)]
    return Verdict("failed" if violations else "passed", kernel, e2e, violations)
