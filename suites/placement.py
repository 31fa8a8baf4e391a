"""The placement suite: what each impl's ``plan`` and ``run`` really cost per step, and the rules those costs keep.

Per impl and workload one ``hidden_cost`` Result holds the step's table row (``COST_METRICS``: plan and run
wall times, then kernel launches, copies and their bytes, host syncs and allocations of plan and run together;
the per-phase counts are in ``details``). Then one Result per rule that applies:

- ``graph_safe``: an impl that declares ``graph_safe`` neither synchronizes the host nor allocates in ``run``.
- ``cache_traffic``: an impl that keeps the cache in host memory (declares ``cache_devices`` with "cpu") moves no
  more bytes per step (plan and run) across the bus than the queries, outputs, lse and metadata: never the cache.
- ``attention_device``: an impl that declares attention on the CPU launches no GPU kernel in ``run`` (CUDA only:
  on a CPU-only run there is nothing to launch).
- ``metadata_sync``: each paged-metadata builder (``METADATA_BUILDERS``) builds without a host sync.

On a CPU-only run (CI) the same rules read the CPU twins of the counts (see ``mla_bench.hidden_costs``): host
reads of tensor values for syncs, host allocations, and for bus traffic both the explicit moves to a named device
and the plain copies within the one memory. Launches on the wrong device (``attention_device``) show on a GPU only.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from mla_bench.errors import UnsupportedConfig, reraise_interrupt
from mla_bench.hidden_costs import StepCosts, measure_step, profile_costs
from mla_bench.metadata import fast
from mla_bench.problem import Problem, build_problem
from mla_bench.registry import Capabilities, ImplEntry, ImplNotInstalled
from mla_bench.results import Result
from mla_bench.workload import Workload
from suites.base import RunContext, refusal
from suites.judge import InputGuard, with_violation

SUITE = "placement"
DEFAULT_PRESET = "deepseek-v3-tp8"


# ---- metadata builders whose host syncs are checked -----------------------------------------------------------
@dataclass(frozen=True)
class MetadataBuilder:
    """A per-step metadata builder, called on a problem's device tensors (``applies``: which problems it needs)."""

    name: str
    build: Callable[[Problem], Any]
    applies: Callable[[Problem], bool] = lambda problem: True


def _has_topk(problem: Problem) -> bool:
    return problem.topk_indices is not None


def _step(problem: Problem) -> dict[str, torch.Tensor]:
    """The whole per-step build from lengths already on the device (one host-to-device copy) and the block table."""
    meta = problem.meta
    return fast.step_of(meta.query_start_loc, meta.seq_lens, meta.block_table, meta.page_size, meta.q_lens,
                        meta.kv_lens)


# The per-step builders of mla_bench/metadata/fast.py (the reference builders are plain host loops, not meant for
# the hot path).
METADATA_BUILDERS: tuple[MetadataBuilder, ...] = (
    MetadataBuilder("fast.build_step", _step),
    MetadataBuilder("fast.transform_indices_paged", lambda p: fast.transform_indices_paged(
        p.topk_indices, p.meta.query_start_loc, p.meta.seq_lens, p.meta.block_table, p.meta.page_size), _has_topk),
    MetadataBuilder("fast.transform_indices_ragged", lambda p: fast.transform_indices_ragged(
        p.topk_indices, p.meta.query_start_loc, p.meta.seq_lens, p.meta.kv_start_loc), _has_topk),
)


# ---- workloads -------------------------------------------------------------------------------------------------
def default_workloads(device: torch.device, preset: str = DEFAULT_PRESET, seed: int = 0) -> list[Workload]:
    """Decode with the cache with the queries and in host memory, a prefill, and a sparse decode (for the
    metadata builders): real sizes on a GPU, small ones on the CPU."""
    common = dict(preset=preset, seed=seed)
    if device.type == "cuda":
        decode = [Workload.uniform("decode", b, 1, 4096, page_size=64, **common) for b in (1, 8)]
        others = [Workload.uniform("prefill", 2, 512, 512, **common),
                  Workload.uniform("sparse_decode", 8, 1, 4096, page_size=64, topk=2048, **common)]
    else:
        decode = [Workload(mode="decode", q_lens=(1, 1), kv_lens=(200, 77), page_size=16, **common)]
        others = [Workload.uniform("prefill", 2, 16, 48, **common),
                  Workload(mode="sparse_decode", q_lens=(1, 1), kv_lens=(200, 77), page_size=16, topk=64, **common)]
    return [w for d in decode for w in (d, d.replace(cache_device="cpu"))] + others


def select_workloads(workloads: Iterable[Workload], ctx: RunContext) -> list[Workload]:
    """The run context's filters: modes kept, cache layouts and page sizes substituted where the mode has a cache."""
    chosen = []
    for w in workloads:
        if ctx.modes and w.mode.value not in ctx.modes:
            continue
        variants = [w]
        if w.mode.uses_cache and ctx.layouts:
            variants = [v.replace(layout=layout) for v in variants for layout in ctx.layouts]
        if w.mode.uses_cache and ctx.page_sizes:
            variants = [v.replace(page_size=ps) for v in variants for ps in ctx.page_sizes]
        chosen += [v for v in variants if v not in chosen]
    return chosen


# ---- rules -----------------------------------------------------------------------------------------------------
def traffic_budget(problem: Problem) -> dict[str, int]:
    """What may cross the bus per step with the cache in host memory: queries in, outputs and lse out, metadata."""
    tokens, heads = problem.q.shape[0], problem.q.shape[1]
    meta = [getattr(problem.meta, name) for name in ("query_start_loc", "kv_start_loc", "seq_lens", "block_table",
                                                      "token_slots")]
    if problem.sparse_indices is not None:
        meta.append(problem.sparse_indices)
    return {"queries": problem.q.nbytes,
            "outputs": tokens * heads * problem.out_dim * problem.q.element_size(),
            "lse": tokens * heads * 4,
            "metadata": sum(t.nbytes for t in meta)}


def graph_safety(step: StepCosts) -> tuple[dict[str, float], str]:
    """Rule ``graph_safe``: ``run`` neither syncs nor allocates. Returns (metrics, violation or "")."""
    run = step.run
    problems = []
    if run.syncs:
        problems.append(f"synchronized the host {run.syncs}x ({run.describe_syncs()})")
    if run.allocations:
        problems.append(f"allocated {run.allocations}x ({run.alloc_bytes} B)")
    metrics = {"syncs": run.syncs, "allocations": run.allocations, "alloc_bytes": run.alloc_bytes}
    return metrics, ("run " + " and ".join(problems) + ": not CUDA-graph safe") if problems else ""


def cache_traffic(step: StepCosts, problem: Problem) -> tuple[dict[str, float], str]:
    """Rule ``cache_traffic``: neither a step nor the first one moves more than ``traffic_budget``: over the bus on
    CUDA; on a CPU-only run neither the explicit moves to a device nor the plain copies, the two CPU twins of bus
    traffic, may exceed it. The first step counts too: a cache copied over once and reused is stale as soon as the
    engine writes a token, and holds the memory the host cache was for. Returns (metrics, violation or "")."""
    budget = traffic_budget(problem)
    allowed, cache_bytes = sum(budget.values()), problem.cache.data.nbytes
    steps = {"per step": step.step, **({"in the first step": step.first} if step.first is not None else {})}
    metrics = {"moved_bytes": max(c.moved_bytes for c in steps.values()), "budget_bytes": allowed,
               "cache_bytes": cache_bytes}
    over = []
    for when, costs in steps.items():
        if costs.traced == "cuda":
            seen = {"over the bus": costs.moved_bytes}
        else:
            metrics["copied_bytes"] = max(metrics.get("copied_bytes", 0), costs.d2d_bytes)
            seen = {"in explicit moves to a device (CPU twin of bus traffic)": costs.moved_bytes,
                    "in plain copies (CPU twin of bus traffic)": costs.d2d_bytes}
        over += [f"{n} B {when} {where} ({costs.describe_copies()})" for where, n in seen.items() if n > allowed]
    if not over:
        return metrics, ""
    parts = " + ".join(f"{name} {n} B" for name, n in budget.items())
    return metrics, (f"moved {' and '.join(over)}, more than the budget {allowed} B ({parts}); the cache is "
                     f"{cache_bytes} B")


def attention_placement(step: StepCosts) -> tuple[dict[str, float], str]:
    """Rule ``attention_device``: CPU attention launches no GPU kernel in ``run``. Returns (metrics, violation)."""
    launches = step.run.launches
    message = f"run launched {launches} GPU kernels although attention is declared on the CPU" if launches else ""
    return {"launches": launches}, message


def rules_for(caps: Capabilities, problem: Problem) -> list[tuple[str, Callable[[StepCosts], tuple]]]:
    """The rules that apply to an impl with ``caps`` on ``problem``."""
    rules: list[tuple[str, Callable[[StepCosts], tuple]]] = []
    if caps.graph_safe:
        rules.append(("graph_safe", graph_safety))
    if problem.workload.cache_device == "cpu" and caps.cache_devices is not None and "cpu" in caps.cache_devices:
        rules.append(("cache_traffic", lambda step: cache_traffic(step, problem)))
    if caps.attention_device == "cpu" and problem.device.type == "cuda":
        rules.append(("attention_device", attention_placement))
    return rules


# ---- the suite ---------------------------------------------------------------------------------------------------
def _inputs_checked(guard: InputGuard, status: str, message: str) -> tuple[str, str]:
    """``(status, message)`` of an impl's step once ``guard`` has restored its problem: failed (or still error) with
    the inputs it wrote into named, when it wrote into any."""
    guard.restore()
    return with_violation(status, message, guard.violation())


class PlacementSuite:
    """Hidden costs and placement rules of every impl over a set of workloads (``default_workloads`` if None).
    ``reps`` timed steps per impl and workload (default 5 on CUDA, 1 on the CPU, where times are only indicative)."""

    name = SUITE
    unapplied_filters = ("sweep", "dcp_world")  # its own workloads (``default_workloads``), not the sweep's

    def __init__(self, workloads: Iterable[Workload] | None = None,
                 builders: Iterable[MetadataBuilder] = METADATA_BUILDERS, reps: int | None = None) -> None:
        self.given = None if workloads is None else list(workloads)
        if self.given is not None and not self.given:
            raise ValueError("PlacementSuite was given no workloads (None picks the defaults)")
        self.builders = tuple(builders)
        self.reps = reps

    def workloads(self, ctx: RunContext) -> list[Workload]:
        """The workloads ``run`` measures: those given, else the defaults for the device after the run's filters."""
        if self.given is not None:
            return self.given
        return select_workloads(default_workloads(ctx.device, ctx.preset or DEFAULT_PRESET, ctx.seed), ctx)

    def run(self, ctx: RunContext) -> Iterator[Result]:
        impls = [self._load(entry) for entry in ctx.impls]
        for w in self.workloads(ctx):
            ctx.progress(w.label)
            try:
                problem = build_problem(w, ctx.device)
            except Exception:  # noqa: BLE001 - a workload that cannot be built is a result, not a crash
                yield Result(SUITE, "hidden_cost", "error", None, w.to_dict(), w.label,
                             message=traceback.format_exc())
                continue
            for builder in self.builders:
                yield from self._metadata_result(builder, problem)
            for entry, loaded in zip(ctx.impls, impls):
                yield from self._impl_results(entry.name, loaded, problem)

    @staticmethod
    def _load(entry: ImplEntry) -> Any:
        """The impl, or the reason it cannot load (a string)."""
        try:
            return entry.load()
        except ImplNotInstalled as exc:
            return f"not installed: {exc}"
        except BaseException as exc:  # noqa: BLE001 - sys.exit too: a broken impl is a result, not the run's end
            reraise_interrupt(exc)
            return traceback.format_exc()

    def _impl_results(self, name: str, impl: Any, problem: Problem) -> Iterator[Result]:
        w = problem.workload

        def result(check: str, status: str, metrics: dict[str, float] | None = None, message: str = "",
                   details: dict[str, Any] | None = None) -> Result:
            return Result(SUITE, check, status, name, w.to_dict(), w.label, metrics or {}, details or {}, message)

        if isinstance(impl, str):
            yield result("hidden_cost", "unsupported" if impl.startswith("not installed") else "error", message=impl)
            return
        caps = getattr(impl, "capabilities", None)
        if not isinstance(caps, Capabilities):
            yield result("hidden_cost", "error", message=f"{name} declares no Capabilities (its capabilities is "
                                                          f"{type(caps).__name__}): the placement rules read them")
            return
        guard = InputGuard(problem)  # the impls share the problem: what one writes into it, the next would read
        try:
            step = measure_step(impl, problem, self.reps or (5 if problem.device.type == "cuda" else 1))
        except UnsupportedConfig as exc:
            status, message = _inputs_checked(guard, *refusal(exc))
            yield result("hidden_cost", status, message=message)
            return
        except BaseException as exc:  # noqa: BLE001 - an impl's crash (sys.exit too) is its result
            reraise_interrupt(exc)
            status, message = _inputs_checked(guard, "error", traceback.format_exc())
            yield result("hidden_cost", status, message=message)
            return
        status, message = _inputs_checked(guard, "passed", "")
        details = {"placement": caps.placement(), "traced": step.run.traced,
                   "plan": step.plan.to_dict(), "run": step.run.to_dict()}
        yield result("hidden_cost", status, step.metrics(), message, details)
        for check, rule in rules_for(caps, problem):
            metrics, violation = rule(step)
            yield result(check, "failed" if violation else "passed", metrics, violation)

    @staticmethod
    def _metadata_result(builder: MetadataBuilder, problem: Problem) -> Iterator[Result]:
        """The builder's ``metadata_sync`` Result on ``problem``, if it applies (a builder that raises: ``error``)."""
        w = problem.workload
        label = f"{builder.name} | {w.label}"
        try:
            if not builder.applies(problem):
                return
            builder.build(problem)  # warm-up
            _, costs = profile_costs(lambda: builder.build(problem), problem.device)
        except Exception:  # noqa: BLE001
            yield Result(SUITE, "metadata_sync", "error", None, w.to_dict(), label, message=traceback.format_exc())
            return
        message = f"{builder.name} synchronized the host {costs.syncs}x ({costs.describe_syncs()})" if costs.syncs \
            else ""
        yield Result(SUITE, "metadata_sync", "failed" if message else "passed", None, w.to_dict(), label,
                     costs.counts(), {"builder": builder.name, "copies": costs.copy_events}, message)

