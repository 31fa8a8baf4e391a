"""Count what a piece of work really costs: kernel launches, copies across and within memories, host
synchronizations and allocations, read from one torch profiler trace.

``profile_costs(fn, device)`` runs ``fn`` under ``torch.profiler`` (``profile_memory=True``, shapes recorded, the
CUDA activity added when ``device`` is a CUDA device), marks the call with a ``record_function`` window, exports
the trace and counts ``fn``'s events: host-side ones inside the window (the profiler's own synchronizing stop
falls outside it) and, on CUDA, the GPU activities.

What each count means depends on what the trace can see:

- on CUDA: ``launches`` are GPU kernels; copies are the GPU's memcpy activities (``Memcpy HtoD`` / ``DtoH`` /
  ``DtoD``, bytes as the driver reports them); ``syncs`` are host waits (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking ``cudaMemcpy``); allocations are the CUDA caching
  allocator's (host allocations, such as the 0-dim tensors Python scalars become, are left out). The GPU is idle
  when profiling starts and ``fn`` is all that runs under the profiler, so every GPU activity of the trace is
  ``fn``'s; host-side events count inside the window.
- on a CPU-only run host and device memory are one: ``launches`` are top-level operator calls (each would launch
  at least one kernel on a GPU); same-dtype ``aten::copy_`` calls are ``d2d`` copies (a dtype conversion is
  compute, as on a GPU where it is a kernel, not a memcpy); explicit moves to a named device
  (``Tensor.to(device)``, ``.to(other_tensor)``, ``.cpu()``, ``.cuda()``, and a tensor handed with ``device=`` to
  ``torch.tensor``, ``as_tensor``, ``asarray`` or ``Tensor.new_tensor``) are ``d2h`` (to the CPU) or ``h2d`` (to a
  GPU) copies of the tensor's bytes whether or not they copy here, since on a GPU run they may cross the bus (the
  twin cannot tell a host-cache tensor from a GPU one, so it errs toward reporting the copy; one that copies
  nothing here counts once per tensor and device in a call; a copy inside one is not a ``d2d`` copy too);
  ``syncs`` are host reads of tensor values that would wait for a GPU (``.item()``, ``bool(t)``, ``int(t)``:
  ``aten::_local_scalar_dense``; ``.tolist()``, ``.numpy()``, ``numpy.asarray(t)``; output sizes that depend on
  values: ``aten::nonzero``, ``unique``, ``bincount``; ``aten::equal``) and every move to the CPU that is not
  ``non_blocking`` (on a GPU the host waits for the copy); allocations are every host allocation, Python scalars
  wrapped into 0-dim tensors included. The moves and value reads no operator shows are marked in the trace by a
  ``TorchFunctionMode`` while ``fn`` runs. A ``copy_`` into a buffer of another device shows on a GPU only (here a
  same-dtype one counts as a ``d2d`` copy, a converting one as compute).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile, record_function

# The metric names of the hidden-cost table, in display order (reports read them by these names).
COST_METRICS = ("plan_ms", "run_ms", "launches", "h2d_copies", "h2d_bytes", "d2h_copies", "d2h_bytes",
                "d2d_copies", "d2d_bytes", "syncs", "allocations", "alloc_bytes")
COUNTS = COST_METRICS[2:]

_WINDOW = "mla_bench::measured"
_MOVE, _VALUE_READ = "mla_bench::move", "mla_bench::value_read"  # the CPU twin's marks (see ``_HostTwin``)
_KINETO_QUIET = 6  # Kineto's log levels run from 0 (verbose) to 5 (its "USDT" start and stop lines)
_CUDA_SYNCS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                         "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"})
_CPU_MEMORY, _CUDA_MEMORY = 0, 1  # the trace's "Device Type" of an allocation (c10::DeviceType)
_HOST_READS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::_unique",
                         "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                         "aten::unique_dim_consecutive", "aten::bincount"})
# Tensor methods that hand values to Python or numpy (no operator of the trace shows them), and explicit moves.
_VALUE_READS = {torch.Tensor.tolist: "Tensor.tolist", torch.Tensor.numpy: "Tensor.numpy",
                torch.Tensor.__array__: "numpy.asarray"}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
# Constructors that take data and a ``device``: handed a tensor, they move it as ``to`` does (the data's argument).
_CONSTRUCTORS = {torch.tensor: 0, torch.as_tensor: 0, torch.asarray: 0, torch.Tensor.new_tensor: 1}
_WAITS = "waits"  # a move mark's last word where the host waits for the copy (to the CPU, not non_blocking)
# CUPTI's memcpy kinds (A: CUDA arrays, device memory; P: a peer GPU); HtoH never touches a GPU: not counted.
_MEMCPY_KINDS = {"HtoD": "h2d", "HtoA": "h2d", "DtoH": "d2h", "AtoH": "d2h", "DtoD": "d2d", "DtoA": "d2d",
                 "AtoD": "d2d", "AtoA": "d2d", "PtoP": "d2d"}
# Element sizes by the C++ type names the profiler records for operator inputs (an unknown one counts 1 B).
_ITEMSIZE = {"double": 8, "float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "short int": 2,
             "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
             "c10::Float8_e8m0fnu": 1, "c10::Float4_e2m1fn_x2": 1, "c10::complex<float>": 8,
             "c10::complex<double>": 16}


@dataclass
class Costs:
    """The counts of one profiled call, and what was seen (for messages naming the culprit)."""

    traced: str = "cpu"  # "cuda" when the trace holds GPU activities, else "cpu"
    launches: int = 0
    h2d_copies: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0
    d2d_copies: int = 0
    d2d_bytes: int = 0
    syncs: int = 0
    allocations: int = 0
    alloc_bytes: int = 0
    sync_events: dict[str, int] = field(default_factory=dict)   # event name -> count
    copy_events: dict[str, int] = field(default_factory=dict)   # "<kind> <bytes> B" -> count

    @property
    def moved_bytes(self) -> int:
        """Bytes moved between memories: over the bus on CUDA; on a CPU-only run (one memory) the explicit moves to
        a named device, which stand in for them."""
        return self.h2d_bytes + self.d2h_bytes

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTS}

    def __add__(self, other: "Costs") -> "Costs":
        total = Costs(self.traced, **{n: getattr(self, n) + getattr(other, n) for n in COUNTS})
        total.sync_events = dict(Counter(self.sync_events) + Counter(other.sync_events))
        total.copy_events = dict(Counter(self.copy_events) + Counter(other.copy_events))
        return total

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe_syncs(self) -> str:
        return ", ".join(f"{name} x{n}" for name, n in sorted(self.sync_events.items())) or "none"

    def describe_copies(self) -> str:
        """The copies seen, the most bytes first (the culprit leads)."""
        def largest_first(item: tuple[str, int]) -> int:
            return -int(item[0].split()[1]) * item[1]
        return ", ".join(f"{what} x{n}" for what, n in sorted(self.copy_events.items(), key=largest_first)) or "none"


def profile_costs(fn: Callable[[], Any], device: torch.device | str) -> tuple[Any, Costs]:
    """Call ``fn()`` once under the profiler; return its result and the costs of that call."""
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)  # no earlier GPU work in the trace: every GPU activity in it is fn's
    # Kineto (torch 2.13) writes "USDT: profiler_start" and "profiler_stop" to stderr for every trace at each of
    # its log levels; one level above them it is silent. A level the user set wins. Read at the first trace.
    os.environ.setdefault("KINETO_LOG_LEVEL", str(_KINETO_QUIET))
    with profile(activities=activities, profile_memory=True, record_shapes=True) as prof:
        with record_function(_WINDOW), (contextlib.nullcontext() if cuda else _HostTwin()):
            result = fn()
        if cuda:
            torch.cuda.synchronize(device)  # outside the window: lets the GPU finish before the trace is read
    return result, count_trace(_export(prof), cuda)


class _HostTwin(TorchFunctionMode):
    """On a CPU-only trace, marks what no operator of the trace shows: a tensor's values read into Python or numpy,
    and an explicit move to a named device (with the tensor's bytes and address; the tensor is kept alive until
    the call ends, so no other tensor takes that address meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_READS:
            with record_function(f"{_VALUE_READ} {_VALUE_READS[func]}"):
                return func(*args, **kwargs)
        source, target = _move(func, args, kwargs)
        if target is None:
            return func(*args, **kwargs)
        self.moved.append(source)
        waits = f" {_WAITS}" if target == "cpu" and not _non_blocking(func, args, kwargs) else ""
        with record_function(f"{_MOVE} {target} {source.nbytes} {source.data_ptr()}{waits}"):
            return func(*args, **kwargs)


def _move(func: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, str | None]:
    """The tensor an explicit move copies and the device type it names; (None, None) for any other call, or a move
    of no bytes."""
    if func in _CONSTRUCTORS:
        at = _CONSTRUCTORS[func]
        source, args, kwargs = (args[at] if len(args) > at else None), (), {"device": kwargs.get("device")}
    elif func in _MOVES and args:
        source, args = args[0], args[1:]
    else:
        return None, None
    if not isinstance(source, torch.Tensor) or not source.nbytes:
        return None, None
    target = _move_target(func, args, kwargs)
    return (source, target) if target else (None, None)


def _non_blocking(func: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a move (``args`` as the mode gets them, ``self`` first) asks for ``non_blocking``: the keyword, or the
    positional argument where torch's overload puts it: ``to(device, dtype, non_blocking, copy)``,
    ``to(dtype | tensor, non_blocking, copy)``, ``cuda(device, non_blocking)``. A ``True`` elsewhere (``copy``) is
    not it; ``cpu()`` and the constructors take none, so they always block."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    if func is torch.Tensor.to:  # a dtype (a Python type too) or a tensor first: non_blocking is next, else third
        at = 2 if len(args) > 1 and isinstance(args[1], (torch.dtype, type, torch.Tensor)) else 3
    elif func is torch.Tensor.cuda:
        at = 2
    else:
        return False
    return len(args) > at and bool(args[at])


def _move_target(func: Any, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """The device type a move names, or None (``to(dtype)`` alone, or a constructor without a device, moves
    nothing)."""
    if func in (torch.Tensor.cpu, torch.Tensor.cuda):
        return func.__name__
    for value in (kwargs.get("device"), kwargs.get("tensor"), *args):  # to(tensor=other) names one too
        if isinstance(value, torch.Tensor):
            return value.device.type
        if isinstance(value, (str, torch.device)):
            return torch.device(value).type
        if type(value) is int:  # a bare device index names a GPU
            return "cuda"
    return None


def _export(prof: profile) -> list[dict[str, Any]]:
    fd, path = tempfile.mkstemp(suffix=".json", prefix="mla_bench_trace_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def count_trace(events: list[dict[str, Any]], cuda: bool) -> Costs:
    """Count the events of a chrome trace that lie in the measured window (see the module docstring)."""
    windows = [e for e in events if e.get("name") == _WINDOW and e.get("ph") == "X"
               and str(e.get("cat", "")).lower() == "user_annotation"]
    if len(windows) != 1:
        raise RuntimeError(f"expected one profiler window {_WINDOW!r} in the trace, found {len(windows)}")
    start, end = windows[0]["ts"], windows[0]["ts"] + windows[0]["dur"]

    def inside(e: dict[str, Any]) -> bool:
        return start <= e.get("ts", -1.0) <= end

    costs = Costs(traced="cuda" if cuda else "cpu")
    syncs: Counter[str] = Counter()
    copies: Counter[str] = Counter()
    ops = [e for e in events if _cat(e) == "cpu_op" and inside(e)]
    memory = _CUDA_MEMORY if cuda else _CPU_MEMORY
    for e in events:
        if e.get("name") == "[memory]" and inside(e) and _arg(e, "Device Type") == memory and _arg(e, "Bytes", 0) > 0:
            costs.allocations += 1
            costs.alloc_bytes += int(_arg(e, "Bytes", 0))
    if cuda:
        for e in events:
            if _cat(e) in ("cuda_runtime", "cuda_driver") and inside(e):
                name = re.sub(r"(_v\d+)?(_ptsz|_ptds)?$", "", e["name"])
                if name in _CUDA_SYNCS:
                    syncs[name] += 1
            elif _cat(e) == "kernel":
                costs.launches += 1
            elif _cat(e) == "gpu_memcpy":
                words = e["name"].split()  # "Memcpy HtoD (Pageable -> Device)"
                kind = _MEMCPY_KINDS.get(words[1] if len(words) > 1 else "")
                if kind:
                    _add_copy(costs, copies, kind, int(_arg(e, "bytes", 0)))
    else:
        costs.launches = len(_top_level(ops))
        marks = [e for e in events if _cat(e) == "user_annotation" and inside(e)
                 and str(e.get("name", "")).startswith((f"{_MOVE} ", f"{_VALUE_READ} "))]
        moves = [e for e in marks if e["name"].startswith(_MOVE)]
        for e in ops:
            if e["name"] in _HOST_READS:
                syncs[e["name"]] += 1
            elif e["name"] == "aten::copy_" and not any(_nested(e, move) for move in moves):
                nbytes = _plain_copy_bytes(e)
                if nbytes is not None:
                    _add_copy(costs, copies, "d2d", nbytes)
        moved: set[tuple[str, ...]] = set()  # a move that copies nothing here counts once per tensor and device
        for e in sorted(marks, key=lambda e: e["ts"]):
            what, *rest = e["name"].split()[1:]
            if e["name"].startswith(_VALUE_READ):
                syncs[what] += 1
                continue
            if rest[-1] == _WAITS:
                syncs["blocking copy to the CPU"] += 1
            tensor = (what, *rest[:2])  # the device, the bytes and the address: blocking or not, the same move
            if tensor not in moved or any(_nested(op, e) for op in ops if op["name"] == "aten::copy_"):
                moved.add(tensor)
                _add_copy(costs, copies, "h2d" if what == "cuda" else "d2h", int(rest[0]), f"to {what}")
    costs.syncs = sum(syncs.values())
    costs.sync_events, costs.copy_events = dict(syncs), dict(copies)
    return costs


def _cat(e: dict[str, Any]) -> str:
    return str(e.get("cat", "")).lower()


def _arg(e: dict[str, Any], name: str, default: Any = None) -> Any:
    return e.get("args", {}).get(name, default)


def _add_copy(costs: Costs, seen: Counter[str], kind: str, nbytes: int, via: str = "") -> None:
    setattr(costs, f"{kind}_copies", getattr(costs, f"{kind}_copies") + 1)
    setattr(costs, f"{kind}_bytes", getattr(costs, f"{kind}_bytes") + nbytes)
    seen[f"{kind} {nbytes} B" + (f" ({via})" if via else "")] += 1


def _nested(e: dict[str, Any], outer: dict[str, Any]) -> bool:
    """Whether event ``e`` runs inside ``outer`` on the same thread."""
    return e.get("tid") == outer.get("tid") and outer["ts"] <= e["ts"] <= outer["ts"] + outer.get("dur", 0.0)


def _plain_copy_bytes(e: dict[str, Any]) -> int | None:
    """Bytes of a same-dtype ``aten::copy_(self, src)``; None for a dtype conversion."""
    types, dims = _arg(e, "Input type", []), _arg(e, "Input Dims", [])
    if len(types) < 2 or len(dims) < 2 or types[0] != types[1]:
        return None
    numel = 1
    for d in dims[1]:
        numel *= d
    return numel * _ITEMSIZE.get(types[1], 1)


def _top_level(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Operator calls not nested in another operator call of the same thread."""
    top, open_ends = [], {}
    for e in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        tid = e.get("tid")
        if e["ts"] >= open_ends.get(tid, float("-inf")):
            top.append(e)
            open_ends[tid] = e["ts"] + e.get("dur", 0.0)
    return top


# ---- one decode/prefill step of an impl -------------------------------------------------------------------------
@dataclass
class StepCosts:
    """The costs of an impl's ``plan`` and ``run`` on one problem, and their wall times (median, ms); ``first``: the
    first plan and run together (lazy set-up, and what an impl does once, such as copying a host cache over)."""

    plan: Costs
    run: Costs
    plan_ms: float
    run_ms: float
    first: Costs | None = None

    @property
    def step(self) -> Costs:
        return self.plan + self.run

    def metrics(self) -> dict[str, float]:
        """The hidden-cost table's row: times plus the step's counts (plan and run together)."""
        return {"plan_ms": self.plan_ms, "run_ms": self.run_ms, **self.step.counts()}


def measure_step(impl: Any, problem: Any, reps: int = 3) -> StepCosts:
    """Plan and run ``impl`` on ``problem``: a first step (lazy init, JIT compiles, capability refusal as
    ``UnsupportedConfig``), then a second, each plan and run under the profiler, then ``reps`` timed steps without
    it."""
    device = problem.device
    plan, first_plan = profile_costs(lambda: impl.plan(problem), device)
    _, first_run = profile_costs(lambda: impl.run(plan), device)
    plan, plan_costs = profile_costs(lambda: impl.plan(problem), device)
    _, run_costs = profile_costs(lambda: impl.run(plan), device)
    plan_times, run_times = [], []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        plan = impl.plan(problem)
        _sync(device)
        t1 = time.perf_counter()
        impl.run(plan)
        _sync(device)
        t2 = time.perf_counter()
        plan_times.append((t1 - t0) * 1e3)
        run_times.append((t2 - t1) * 1e3)
    return StepCosts(plan_costs, run_costs, statistics.median(plan_times), statistics.median(run_times),
                     first_plan + first_run)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
