"""Judge one impl on one problem: plan, poison, run, compare with the float64 reference, apply tolerances.

The verdict's status is ``unsupported`` (refused at plan time, with the reason), ``error`` (anything raised
past planning, with the traceback, or a refusal that gives no reason), ``failed`` (a tolerance broken; each
violation named) or ``passed``.
Quantized layouts get two error reports: ``kernel`` (against the reference on the dequantized cache, judged
by the kernel tolerance) and ``e2e`` (against the original values, judged by the layout's e2e tolerance).
``run`` must return two tensors on the problem's device, ``out`` in the problem's dtype (else ``error``), and
neither ``plan`` nor ``run`` may change the problem (the values, dtype or shape of its tensors: queries, cache
pages, metadata; nor rebind or delete a field such as ``scale``, nor add one, nor rewrite the frozen workload, dims
or layout with ``object.__setattr__``): one that does ``failed``, naming what,
and it is restored (after ``plan`` already, so the reference is computed from the problem as given) for the run and
the next impl.
A plan that passes is run again, poisoned again, as a CUDA graph replays one plan: a second run that differs from
the first is judged like it (a workspace zeroed only in ``plan``, a counter left set, an index transform applied in
place to a buffer of the plan: right once, wrong on every replay; the verdict then carries the second run's errors),
and ``replay_max_abs`` says how far the two runs' outputs differ (0 for an impl that is deterministic run to run).
"""

from __future__ import annotations

import math
import threading
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from mla_bench.compare import ErrorMetrics, compare, normalize_lse
from mla_bench.errors import UnsupportedConfig, reraise_interrupt
from mla_bench.problem import Problem
from mla_bench.process_state import ProcessState
from mla_bench.registry import Impl
from mla_bench.tolerances import lossless, tolerance_for
from mla_bench.workload import Workload
from reference.expected import Expected, expected
from suites.base import refusal

STATUSES = ("passed", "failed", "unsupported", "error")


@dataclass
class Verdict:
    status: str
    kernel: ErrorMetrics | None = None
    e2e: ErrorMetrics | None = None
    violations: list[str] = field(default_factory=list)
    message: str = ""
    replay_max_abs: float | None = None  # largest |run 2 - run 1| over out and lse (NaN matches NaN; inf for
    # another shape or an infinity against a number); None where the plan was not run twice (it failed at once)

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "unsupported")

    def metrics(self) -> dict[str, float]:
        """The verdict's numbers for a Result: ``kernel.*`` and ``e2e.*`` errors, and ``replay_max_abs``."""
        metrics = {f"{kind}.{name}": value for kind, errors in (("kernel", self.kernel), ("e2e", self.e2e))
                   if errors is not None for name, value in errors.to_dict().items()}
        if self.replay_max_abs is not None:
            metrics["replay_max_abs"] = self.replay_max_abs
        return metrics


@dataclass
class References:
    """The reference answers of one problem, computed once and shared by every impl judged on it."""

    cache: Expected
    original: Expected

    @classmethod
    def of(cls, problem: Problem) -> "References":
        cache = expected(problem, "cache")
        exact = problem.cache is None or lossless(problem.workload.dtype, problem.workload.layout)
        return cls(cache, cache if exact else expected(problem, "original"))


class InputGuard:
    """A problem's inputs as an impl found them: ``restore()`` puts back every field the impl rebound, deleted or
    added and every tensor it reshaped or wrote, keeping the first description of each change; ``violation()`` names
    them (None when there were none). Suites whose impls share one problem guard it around each impl. A change may
    come from a thread an earlier impl left running (``_LEFT_RUNNING``): the violation names those that were running
    when this guard began."""

    def __init__(self, problem: Problem) -> None:
        self.threads = set(threading.enumerate())
        self.process = ProcessState.now()
        self.settings: dict[str, str] = {}  # the process's settings the impl changed: what -> its first description
        self.owners = _owners(problem)
        self.fields = _attributes(problem)
        self.saved = {name: (tensor, tensor.clone(), _layout(tensor)) for name, (_, _, tensor) in self.fields.items()
                      if isinstance(tensor, torch.Tensor)}
        self.changed: dict[tuple[str, str], str] = {}  # (input, kind of change) -> its first description

    def restore(self) -> None:
        for key, entry in {**_restore_fields(self.fields, self.owners), **_restore_changed(self.saved)}.items():
            self.changed.setdefault(key, entry)
        for change in self.process.restore():
            self.settings.setdefault(change.partition(" (")[0], change)
        _LEFT_RUNNING.update(t for t in threading.enumerate() if t not in self.threads)

    def violation(self) -> str | None:
        named = changes_named(list(self.changed.values()), list(self.settings.values()))
        earlier = sorted(t.name for t in _LEFT_RUNNING if t in self.threads)  # running when this impl began
        if named is None or not earlier:
            return named
        return f"{named}; by it, or by a thread an earlier impl left running: {', '.join(earlier)}"


# Threads an impl started and left running when its guard last restored its inputs: a write one makes later is
# blamed on whichever impl then runs, so that impl's violation names them.
_LEFT_RUNNING: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def changes_named(inputs: list[str], settings: list[str], then: str = "restored for the next impl") -> str | None:
    """What an impl changed that the next impl would see: its ``inputs`` and the process's ``settings``
    (``process_state``), and what was done about it (``then``); None when nothing."""
    parts = ([f"wrote into its inputs: {', '.join(inputs)}"] if inputs else []) + \
        ([f"changed the process's settings: {', '.join(settings)}"] if settings else [])
    return f"{'; '.join(parts)} ({then})" if parts else None


def with_violation(status: str, message: str, violation: str | None) -> tuple[str, str]:
    """A suite's ``(status, message)`` for an impl, given what it wrote into inputs it shares (``violation``, None
    when nothing): failed, or still error, with the violation after the message."""
    if violation is None:
        return status, message
    return "error" if status == "error" else "failed", f"{message}\n{violation}" if message else violation


def judge(impl: Impl, problem: Problem, refs: References | None = None) -> Verdict:
    """Run ``impl`` on ``problem`` and judge its output and whether it left its inputs as they were."""
    guard = InputGuard(problem)
    verdict = _judge(impl, problem, refs, between_runs=guard.restore)
    guard.restore()
    violation = guard.violation()
    if violation is None:
        return verdict
    if verdict.status == "error":
        return Verdict("error", message=f"{verdict.message}\n{violation}")
    return Verdict("failed", verdict.kernel, verdict.e2e, verdict.violations + [violation],
                   replay_max_abs=verdict.replay_max_abs)


def _owners(problem: Problem) -> dict[str, object]:
    """The objects whose attributes make up a problem's inputs, by the prefix of their attributes' names: the problem,
    its metadata, cache, workload, dims and the cache's layout (the last three frozen, but ``object.__setattr__``
    rewrites them in place; the layout is shared by every problem of its name)."""
    cache = problem.cache
    owners = {"": problem, "meta.": problem.meta, "cache.": cache, "workload.": problem.workload, "dims.": problem.dims,
              "cache.layout.": cache.layout if cache is not None else None}
    return {prefix: owner for prefix, owner in owners.items() if owner is not None}


def _attributes(problem: Problem) -> dict[str, tuple[object, str, object]]:
    """Every attribute of the problem's ``_owners`` (tensors, ``scale``, ``meta.kv_lens``, ``workload.kv_lens``, ...),
    each with the object and attribute that hold it: an impl that rebinds one changes what the reference, or the next
    impl, reads."""
    return {prefix + name: (owner, name, value) for prefix, owner in _owners(problem).items()
            for name, value in vars(owner).items()}


def _restore_fields(saved: dict[str, tuple[object, str, object]],
                    owners: dict[str, object]) -> dict[tuple[str, str], str]:
    """The fields an impl rebound to other objects or deleted, rebound to theirs, and the attributes it added to
    their ``owners``, removed: (name, kind of change) -> the name with what changed. ``object.__setattr__``, as a
    frozen owner was rewritten."""
    changed = {}
    for name, (owner, attr, value) in saved.items():
        present = vars(owner)
        if attr in present and present[attr] is value:
            continue
        kind = "rebound" if attr in present else "deleted"
        object.__setattr__(owner, attr, value)
        changed[(name, kind)] = f"{name} ({kind})"
    for prefix, owner in owners.items():
        for attr in [attr for attr in vars(owner) if prefix + attr not in saved]:
            object.__delattr__(owner, attr)
            changed[(prefix + attr, "added")] = f"{prefix}{attr} (added)"
    return changed


def _layout(tensor: torch.Tensor) -> tuple:
    """What an in-place ``.data =``, ``set_`` or ``unsqueeze_`` changes while the values may stay equal."""
    return tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.data_ptr()


def _restore_changed(saved: dict[str, tuple[torch.Tensor, torch.Tensor, tuple]]) -> dict[tuple[str, str], str]:
    """The tensors an impl changed the dtype or shape of in place, or whose bits differ from their saved copies,
    restored: (name, kind of change) -> the name with what changed."""
    changed = {}
    for name, (tensor, copy, layout) in saved.items():
        if _layout(tensor) != layout:
            changed[(name, "reshaped")] = (f"{name} (now {tensor.dtype} {list(tensor.shape)} in place, was "
                                           f"{copy.dtype} {list(copy.shape)})")
            tensor.data = copy.clone()
            saved[name] = (tensor, copy, _layout(tensor))
            continue
        bits, saved_bits = _bits(tensor), _bits(copy)
        if not torch.equal(bits, saved_bits):  # compared before counting: a count of a cache's size is not free
            changed[(name, "written")] = f"{name} ({int(torch.count_nonzero(bits != saved_bits))} elements)"
            tensor.copy_(copy)
    return changed


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as integers of its element size (NaN poison compares equal to itself)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def fingerprint(problem: Problem) -> dict[str, object]:
    """Each field of ``problem`` (its metadata's and cache's too) as a cheap print: a tensor by its layout and the sum
    of its 32-bit words (of its bytes where its size or offset is no multiple of 4), anything else by identity. What
    ``InputGuard`` finds with full copies, for inputs too large to copy (the latency suite's shared input sets)."""
    return {name: (_layout(value), _word_sum(value)) if isinstance(value, torch.Tensor) else id(value)
            for name, (_, _, value) in _attributes(problem).items()}


def _word_sum(tensor: torch.Tensor) -> int:
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 and raw.storage_offset() % 4 == 0 else raw
    return int(words.sum(dtype=torch.int64))


def changed_fields(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """The fields whose ``fingerprint`` differs between ``before`` and ``after``, added and deleted ones too."""
    return ([f"{name} ({'deleted' if name not in after else 'changed'})" for name in before
             if after.get(name) != before[name]] + [f"{name} (added)" for name in after if name not in before])


def check_outputs(result: object, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """``run``'s result as ``(out, lse)``; ValueError unless it is two tensors on the problem's device with ``out``
    in the problem's dtype (the comparison is in float64: a bf16 answer can pass a float32 problem's tolerance, and a
    float32 answer hides the rounding a bf16 caller gets)."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and all(isinstance(t, torch.Tensor) for t in result)):
        parts = f" of ({', '.join(type(x).__name__ for x in result)})" if isinstance(result, (tuple, list)) else ""
        raise ValueError(f"run must return (out, lse), two tensors; it returned a {type(result).__name__}{parts}")
    out, lse = result
    if out.dtype != problem.dtype:
        raise ValueError(f"out is {out.dtype} {list(out.shape)}; the problem's dtype is {problem.dtype}")
    if not lse.dtype.is_floating_point:  # a complex lse's imaginary part would be dropped, an integer one rounded
        raise ValueError(f"lse is {lse.dtype} {list(lse.shape)}; it must be real floating point")
    for name, tensor in (("out", out), ("lse", lse)):
        if tensor.device.type != problem.device.type or problem.device.index not in (None, tensor.device.index):
            raise ValueError(f"{name} is on {tensor.device}; the problem is on {problem.device}")
    return out, lse


def _judge(impl: Impl, problem: Problem, refs: References | None, between_runs: Callable[[], None]) -> Verdict:
    """Plan, run, compare, and run a passing plan again (``judge`` without the check of the inputs, which
    ``between_runs`` restores so that the second run reads what the first did)."""
    try:
        plan = impl.plan(problem)
    except UnsupportedConfig as exc:
        status, message = refusal(exc)
        return Verdict(status, message=message)
    except BaseException as exc:  # noqa: BLE001 - any crash of an impl (sys.exit too) is a result
        reraise_interrupt(exc)
        return Verdict("error", message=traceback.format_exc())
    between_runs()  # what plan changed in the problem is restored (and named) before the reference reads it
    try:
        refs = refs or References.of(problem)  # before run: what run writes into its inputs cannot move it
        first = _poisoned_run(impl, plan, problem)
        kernel, e2e, violations = _errors(first, refs, problem)
    except BaseException as exc:  # noqa: BLE001
        reraise_interrupt(exc)
        return Verdict("error", message=traceback.format_exc())
    if violations:  # a second run would only repeat what the first broke
        return Verdict("failed", kernel, e2e, violations)
    between_runs()
    try:
        second = _poisoned_run(impl, plan, problem)
        shapes = [f"{name} has shape {list(b.shape)}, the first run's {list(a.shape)}"
                  for name, a, b in zip(("out", "lse"), first, second) if a.shape != b.shape]
        difference = math.inf if shapes else _largest_difference(first, second)
        if difference:
            kernel, e2e, again = _errors(second, refs, problem) if not shapes else (kernel, e2e, shapes)
            violations = [f"second run of the same plan: {v}" for v in again]
    except BaseException as exc:  # noqa: BLE001
        reraise_interrupt(exc)
        return Verdict("error", message=f"the second run of the same plan raised:\n{traceback.format_exc()}")
    return Verdict("failed" if violations else "passed", kernel, e2e, violations, replay_max_abs=difference)


def _poisoned_run(impl: Impl, plan: object, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one run after poisoning, the lse normalized, both copied (the next run may reuse the
    buffers); the tensors the run returned are then spoiled (``_spoil``)."""
    impl.poison(plan)
    out, lse = check_outputs(impl.run(plan), problem)
    if problem.device.type == "cuda":
        torch.cuda.synchronize(problem.device)
    caps = impl.capabilities
    answer = out.clone(), normalize_lse(lse.clone(), caps.lse_base, caps.empty_lse)
    _spoil(problem, out, lse)
    return answer


def _spoil(problem: Problem, *returned: torch.Tensor) -> None:
    """NaN into the tensors a run returned, once copied: a second run that returns them again without writing them
    (outputs computed once, in ``plan``: stale on every CUDA-graph replay) returns NaN, whatever the impl's own
    ``poison`` covers. An output that cannot be written in place (expanded, an inference tensor), or that shares
    memory with an input (a view of q: the impl would be blamed for this write), is left as it is."""
    inputs = {value.untyped_storage().data_ptr() for _, _, value in _attributes(problem).values()
              if isinstance(value, torch.Tensor)}
    for tensor in returned:
        if tensor.untyped_storage().data_ptr() in inputs:
            continue
        try:
            tensor.detach().fill_(math.nan)
        except RuntimeError:
            continue


def _errors(answer: tuple[torch.Tensor, torch.Tensor], refs: References,
            problem: Problem) -> tuple[ErrorMetrics, ErrorMetrics, list[str]]:
    """Kernel and end-to-end errors of one run's answer, and the tolerances it breaks."""
    kernel = compare(*answer, refs.cache.out, refs.cache.lse)
    e2e = compare(*answer, refs.original.out, refs.original.lse)
    w = problem.workload
    violations = [f"kernel: {v}" for v in tolerance_for(w.dtype, w.layout, "kernel").violations(kernel)]
    violations += [f"e2e: {v}" for v in tolerance_for(w.dtype, w.layout, "e2e").violations(e2e)]
    return kernel, e2e, violations


def judged_tolerances(workload: Workload) -> dict[str, dict[str, float]]:
    """The tolerances ``judge`` applies to a workload's ``kernel.*`` and ``e2e.*`` metrics, as a result records them
    for the gate (``details["tolerance"]``)."""
    return {kind: tolerance_for(workload.dtype, workload.layout, kind).to_dict() for kind in ("kernel", "e2e")}


def _largest_difference(first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...]) -> float:
    """Largest |a - b| over paired tensors of one shape; equal values (infinities, NaN against NaN) differ by 0, a
    value against NaN or an infinity by inf."""
    worst = 0.0
    for a, b in zip(first, second):
        a, b = a.double(), b.double()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        diff = torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=math.inf, posinf=math.inf))
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst
