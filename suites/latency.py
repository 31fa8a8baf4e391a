"""Latency: plan time and run time of every impl on every workload of the sweep, on a CUDA device.

Per workload, input sets are made when an impl first asks for them and shared by every impl timed on the workload
(``InputSets``), then dropped: set 0 is the workload's problem, every other set a copy of it at new addresses
(``Problem.copy``; a cold L2 takes other addresses, not other values). Per (impl, workload): enough
sets to exceed several times the L2 size, at most ``timing.MAX_SETS`` (a workload too small for that says
``cold_l2: false`` in its details) and at most as many as fit in ``MEMORY_FRACTION`` of the device memory free before
the workload's sets existed (``sets_that_fit``; sets an earlier impl made past that count stay resident beside, so
up to twice the share can be held), are planned (plan time measured on the host, per set), then ``run``
is timed over the rotating sets with CUDA events around CUDA-graph replays (``mla_bench.timing``), for about
``WINDOW_MS`` of launches, the host kept ahead of the GPU (``host_behind`` in the details counts samples where it
could not be). Metrics: median, IQR and spread (of the medians of consecutive slices) of run, median and IQR of plan,
GB/s and TFLOP/s (``mla_bench.costs``; a sparse workload's bytes count the distinct tokens input set 0's top-k indices
select) and each as a fraction of the device's copy bandwidth and bf16 matmul rate measured in the same run (yielded
once per device as the ``ceilings`` result). The details also say what the row cost the run (``wall_s``, of which
``build_s`` made the sets it was first to ask for), an impl's error or refusal in ``plan`` included.
On CPU there is no latency: each impl gets one ``unsupported`` result saying so. Nor for decode context parallel
(``DCP_REASON``): each run of it is a job for other processes, whose hand-off events would report.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable, Iterator

import torch

from mla_bench import timing
from mla_bench.costs import cost
from mla_bench.errors import UnsupportedConfig, reraise_interrupt
from mla_bench.problem import Problem, build_problem
from mla_bench.process_state import ProcessState
from mla_bench.registry import Impl
from mla_bench.results import Result
from mla_bench.workload import Mode, Workload
from suites import sweeps
from suites.base import RunContext, load_impls, refusal
from suites.judge import changed_fields, changes_named, fingerprint, with_violation

CPU_REASON = "latency is measured on CUDA devices only; on CPU (Triton interpreter) only correctness is checked"
DCP_REASON = ("latency is not measured for dcp: each run is a job for rank processes of their own, so events on "
              "this process's GPU would time the job's hand-off and the problem's copies, not the step (`python -m "
              "suites.bench_paths --parts dcp` times each rank's step as a graph replay)")
MEMORY_FRACTION = 0.3  # the rotating input sets may use at most this share of the free device memory
# Each (impl, workload) is timed over about this long of launches, so that its slices sample any slower spell (see
# timing.TimingStats.spread), however short a launch: up to 18,000 launches of a 22 us decode.
WINDOW_MS, MAX_ITERS = 400.0, 20_000


class LatencySuite:
    name = "latency"
    shardable = True

    def workloads(self, ctx: RunContext) -> list[Workload]:
        return sweeps.shard(sweeps.select(ctx), ctx) if ctx.device.type == "cuda" else []

    def run(self, ctx: RunContext) -> Iterator[Result]:
        if ctx.device.type != "cuda":
            for entry in ctx.impls:
                yield Result(self.name, "latency", "unsupported", impl=entry.name, label="(all workloads)",
                             message=CPU_REASON)
            return
        impls, failures = load_impls(ctx, self.name)
        yield from failures
        ceilings = timing.measure_ceilings(ctx.device)
        yield Result(self.name, timing.CEILINGS_CHECK, "passed", label=ceilings.device_name, metrics=ceilings.metrics())
        for workload in self.workloads(ctx):
            ctx.progress(workload.label)
            sets = InputSets(workload, ctx.device)
            for impl in impls:
                yield time_impl(impl, workload, ctx.device, ceilings, sets)
                torch.cuda.empty_cache()  # the impl's plans
            del sets
            torch.cuda.empty_cache()  # the workload's input sets


def free_memory(device: torch.device) -> int:
    """The bytes free on ``device`` (the driver's count, not the caching allocator's)."""
    return torch.cuda.mem_get_info(device)[0]


class InputSets:
    """The input sets of one workload on one device, made when first asked for and shared by every impl timed on the
    workload: ``problem(i)`` makes every set up to ``i`` not made yet, in order: set 0 built from the workload (drawn
    on the host, then moved: 0.9-9.9 s a set of issue 5's b32-b128 rows on the H100 machine's host, session 66), the
    others copies of it (``Problem.copy``: each tensor copied where it lives). ``free``: the device bytes free when it
    was made, before any set; ``problem_bytes(i)``: the device bytes set ``i``'s problem holds (what was allocated
    while making it); ``build_s``: the seconds spent making sets so far. Runs of different impls read the same
    tensors: a plan must not write into its problem's (``damaged`` tells, by ``judge.fingerprint``; ``time_impl``
    fails such an impl and discards the sets). ``free_bytes`` and ``allocated`` probe the device's memory
    (injectable, for a test without a GPU)."""

    def __init__(self, workload: Workload, device: torch.device,
                 free_bytes: Callable[[torch.device], int] = free_memory,
                 allocated: Callable[[torch.device], int] = torch.cuda.memory_allocated):
        self.workload, self.device, self.allocated = workload, device, allocated
        self.free = free_bytes(device)
        self._problems: list[Problem] = []
        self._bytes: list[int] = []
        self._prints: list[dict[str, object]] = []  # each set's fingerprint as made
        self.build_s = 0.0

    def problem(self, i: int) -> Problem:
        while len(self._problems) <= i:
            before, start = self.allocated(self.device), time.perf_counter()
            self._problems.append(self._problems[0].copy() if self._problems else
                                  build_problem(self.workload, self.device))
            self._prints.append(fingerprint(self._problems[-1]))
            self.build_s += time.perf_counter() - start
            self._bytes.append(self.allocated(self.device) - before)
        return self._problems[i]

    def damaged(self) -> list[str]:
        """What differs from the sets as made (``judge.fingerprint``), set by set: an impl wrote into its inputs."""
        found = []
        for i, (problem, made) in enumerate(zip(self._problems, self._prints)):
            changed = changed_fields(made, fingerprint(problem))
            if changed:
                found.append(f"set {i}: {', '.join(changed)}")
        return found

    def discard(self) -> None:
        """Forget the sets: the next impl gets new ones, made as the first were."""
        self._problems, self._bytes, self._prints = [], [], []

    def problem_bytes(self, i: int) -> int:
        self.problem(i)
        return self._bytes[i]


def sets_that_fit(work_bytes: int, set_bytes: int, free: int, l2_bytes: int) -> int:
    """Input sets to rotate: enough for a cold L2 by the ``work_bytes`` a launch reads (``timing.sets_for_cold_l2``),
    but no more than fit in ``MEMORY_FRACTION`` of ``free`` device bytes at ``set_bytes`` each: what one set holds, its
    problem (the whole paged cache, unread pages too, queries, weights: kept alive by ``InputSets`` while the impls of
    the workload are timed) and its plan's own buffers. At 128 heads the weights alone are 32 MiB, about 95 times what
    a one-request decode of 64 keys reads."""
    return timing.sets_for_cold_l2(work_bytes, l2_bytes, limit=max(1, int(MEMORY_FRACTION * free // max(1, set_bytes))))


def time_impl(impl: Impl, workload: Workload, device: torch.device, ceilings: timing.Ceilings,
              sets: InputSets | None = None) -> Result:
    """One latency Result of ``impl`` on ``workload``, over the input sets of ``sets`` (shared with the other impls
    timed on the workload; made here when not given)."""
    def result(status: str, **fields) -> Result:
        return Result("latency", "latency", status, impl=impl.name, workload=workload.to_dict(),
                      label=workload.label, **fields)

    reason = impl.capabilities.refusal(workload, device)
    if reason:
        return result("unsupported", message=f"{impl.name}: unsupported {reason}")
    if workload.mode is Mode.DCP:
        return result("unsupported", message=f"{impl.name}: {DCP_REASON}")
    inputs = sets if sets is not None else InputSets(workload, device)
    process = ProcessState.now()
    row = _time_on_sets(impl, workload, device, ceilings, inputs, result)
    damage, settings = inputs.damaged(), process.restore()
    if damage:  # the next impl must not time what this one left: its sets are made again
        inputs.discard()
    then = "the sets are made again" + (" and the settings put back" if settings else "") + " for the next impl"
    violation = changes_named(["; ".join(damage)], settings, then) if damage else changes_named([], settings)
    row.status, row.message = with_violation(row.status, row.message, violation)
    return row


def _time_on_sets(impl: Impl, workload: Workload, device: torch.device, ceilings: timing.Ceilings, inputs: InputSets,
                  result: Callable[..., Result]) -> Result:
    """``time_impl``'s row, its impl timed over ``inputs``."""
    started = time.perf_counter()
    built_before = inputs.build_s
    plans, plan_ms = [], []

    def add_plan(i: int) -> None:
        problem = inputs.problem(i)
        plan_ms.append(timing.time_host(lambda: plans.append(impl.plan(problem)), device))

    def spent() -> dict[str, float]:
        """What the row cost the run, also where it fails: the sets it was first to ask for, plans (a first compile
        included), graph captures and the timing itself."""
        return {"build_s": inputs.build_s - built_before, "wall_s": time.perf_counter() - started}

    try:
        problem0 = inputs.problem(0)
        before = inputs.allocated(device)
        add_plan(0)
        work = cost(workload, problem0.topk_indices)  # sparse: the tokens set 0's indices select
        # measured, not derived from shapes: what a set keeps depends on the impl (which buffers its plan allocates,
        # whether it copies inputs); both the shared problem and the plan stay resident while timing
        set_bytes = inputs.problem_bytes(0) + inputs.allocated(device) - before
        count = sets_that_fit(work.bytes, set_bytes, inputs.free, ceilings.l2_bytes)
        for i in range(1, count):
            add_plan(i)
        stats = timing.time_rotation([lambda plan=plan: impl.run(plan) for plan in plans], device,
                                     target_ms=WINDOW_MS, max_iters=MAX_ITERS)
    except UnsupportedConfig as exc:
        status, message = refusal(exc)
        return result(status, message=message, details=spent())
    except BaseException as exc:  # noqa: BLE001 - an impl's crash (sys.exit too) is its result
        reraise_interrupt(exc)
        return result("error", message=traceback.format_exc(), details=spent())
    plan = timing.TimingStats.of(plan_ms, method="host")
    metrics = {**stats.metrics("run_ms"), **plan.metrics("plan_ms"), "bytes": work.bytes, "flops": work.flops,
               "gbps": work.gbps(stats.median), "tflops": work.tflops(stats.median),
               "copy_fraction": work.gbps(stats.median) / ceilings.copy_gbps,
               "matmul_fraction": work.tflops(stats.median) / ceilings.matmul_tflops,
               "input_sets": count, "iterations": stats.count}
    return result("passed", metrics=metrics,
                  details={"timer": stats.method, "fallback": stats.fallback, "host_behind": stats.host_behind,
                           "device": ceilings.device_name,
                           "set_bytes": set_bytes, "rotation_bytes": count * work.bytes, "l2_bytes": ceilings.l2_bytes,
                           "cold_l2": timing.rotation_is_cold(count, work.bytes, ceilings.l2_bytes), **spent()})
