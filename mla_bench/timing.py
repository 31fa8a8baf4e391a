"""GPU timing: CUDA events around CUDA-graph replays, warm-up, cold L2, median and IQR; device ceilings.

``time_rotation(fns)`` times a list of callables, one per input set at its own addresses, replayed round robin so each
launch finds the L2 cold (the sets together should exceed several times the L2 size: ``sets_for_cold_l2``).
Each callable is captured in a CUDA graph; if one cannot be captured (it syncs, or allocates in a way capture
refuses) every set is timed as plain launches between events, and the stats say which timer and why. With
``one_graph`` the whole rotation is one graph, replayed whole, and a sample is a replay's time over the number of
callables: launches back to back inside a graph, as a model's step graph runs them, without each sample paying a
graph launch (which matters for kernels of a few microseconds).

``measure_ceilings(device)`` gives the two numbers every result is a fraction of: device-to-device copy
bandwidth (read + write bytes) and the bf16 matmul rate on 8192^3, measured once per device per process.
``time_copy(bytes)`` times a copy of a given size the same way as a kernel, for a size-matched reference.
``cuda_event_timer`` is a clock for pytest-benchmark that reads the GPU's own timeline (host gaps included).

Events time what the GPU did between them only while the host is ahead of the GPU: if the GPU drains its queue, a
start event fires at once and the launch after it is still being enqueued, so the sample is the host's time. A
22 us decode graph takes the host 20-34 us to enqueue with its two events (an H100's host, from one second to the
next), so per-launch samples were the host's in some seconds and the GPU's in others. ``_events`` therefore enqueues
launches in chunks behind a GPU sleep long enough for the host to queue them all, and keeps a chunk only if the GPU
had not reached the chunk's first launch when its last was queued, or counts it in ``host_behind`` where the host
cannot get ahead (see ``_events`` and ``Pacer``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

CEILINGS_CHECK = "ceilings"  # the check name of the Result that carries a device's ceilings
GRAPH = "cuda_graph"
EVENTS = "cuda_events"
COLD_L2_FACTOR = 4          # the rotating input sets together exceed this many times the L2 size
MAX_SETS = 256              # ... but a rotation holds at most this many sets (see sets_for_cold_l2)
DEFAULT_L2_BYTES = 50 << 20  # when the device does not report its L2 size
MATMUL_N = 8192
COPY_BYTES = 1 << 30
COPY_PAGE = 4096            # time_copy moves whole pages of this many bytes each way
COPY_TRIES = 4              # ... and times this many sizes a page apart, keeping the fastest
SPREAD_WINDOWS = 5          # TimingStats.spread: the range of the medians of this many consecutive slices,
SPREAD_MIN_SAMPLES = 10     # ... each of at least this many samples (else the spread is 0)
CHUNK = 32                  # launches queued behind one GPU sleep at first (see Pacer.fell_behind)
SLEEP_CYCLES = (1 << 12, 1 << 21, 1 << 27)  # the sleep's floor, start and cap in GPU clock cycles (~2 us, 1 ms, 70 ms)
SHRINK_AFTER = 4            # the sleep shortens by an eighth after this many chunks kept in a row


@dataclass
class TimingStats:
    """Per-launch times in milliseconds. ``spread``: the largest minus the smallest median of ``SPREAD_WINDOWS``
    consecutive slices of the samples, in launch order. A slower spell within the measurement (anything that slows
    every launch for tens of milliseconds) moves whole slices, where the IQR of all samples barely moves, and the gate
    reads both as noise. The spells first seen this way (a 22 us decode at 24.5-26 us for seconds at a time) were the
    host falling behind the GPU, which ``_events`` now prevents; ``host_behind`` counts samples where it could not."""

    median: float
    p25: float
    p75: float
    minimum: float
    mean: float
    count: int
    method: str = GRAPH     # GRAPH or EVENTS
    fallback: str = ""      # why graphs were not used
    spread: float = 0.0
    host_behind: int = 0    # samples the host may have enqueued late (it could not get ahead: see _events)

    @property
    def iqr(self) -> float:
        return self.p75 - self.p25

    @classmethod
    def of(cls, samples_ms: list[float], method: str = GRAPH, fallback: str = "",
           host_behind: int = 0) -> "TimingStats":
        if not samples_ms:
            raise ValueError("no timing samples")
        ordered = sorted(samples_ms)
        return cls(median=statistics.median(ordered), p25=_quantile(ordered, 0.25), p75=_quantile(ordered, 0.75),
                   minimum=ordered[0], mean=statistics.fmean(ordered), count=len(ordered), method=method,
                   fallback=fallback, spread=_spread(samples_ms), host_behind=host_behind)

    def metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix: median, prefix_p25, prefix_p75, prefix_iqr, prefix_min, prefix_spread}`` for a Result."""
        return {prefix: self.median, f"{prefix}_p25": self.p25, f"{prefix}_p75": self.p75,
                f"{prefix}_iqr": self.iqr, f"{prefix}_min": self.minimum, f"{prefix}_spread": self.spread}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _spread(samples_ms: list[float]) -> float:
    """``TimingStats.spread``: over ``SPREAD_WINDOWS`` slices of equal size (to one sample), in launch order; 0 when a
    slice would hold fewer than ``SPREAD_MIN_SAMPLES`` (a slice's median is then one or two launches, not a spell)."""
    n = len(samples_ms)
    if n < SPREAD_WINDOWS * SPREAD_MIN_SAMPLES:
        return 0.0
    bounds = [n * k // SPREAD_WINDOWS for k in range(SPREAD_WINDOWS + 1)]
    medians = [statistics.median(samples_ms[a:b]) for a, b in zip(bounds, bounds[1:])]
    return max(medians) - min(medians)


def _quantile(ordered: list[float], q: float) -> float:
    """Linear-interpolated quantile of sorted samples."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def l2_cache_bytes(device: torch.device) -> int:
    """The device's L2 size as it reports it."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def sets_for_cold_l2(bytes_per_set: int, l2_bytes: int, limit: int = MAX_SETS) -> int:
    """How many input sets (each at its own addresses) make the rotation exceed ``COLD_L2_FACTOR`` times the L2
    size, at most ``limit`` and never more than ``MAX_SETS``. Every set is made, planned and captured, so a workload
    of a few hundred KB would need thousands (the tiny sweep's decode on an H100: 15,000 sets, 132 s for one impl); at
    the cap such a workload is timed with its inputs partly in L2, which ``rotation_is_cold`` reports."""
    return max(1, min(limit, MAX_SETS, math.ceil(COLD_L2_FACTOR * l2_bytes / max(1, bytes_per_set))))


def rotation_is_cold(sets: int, bytes_per_set: int, l2_bytes: int) -> bool:
    """Whether ``sets`` input sets together exceed ``COLD_L2_FACTOR`` times the L2 size."""
    return sets * bytes_per_set >= COLD_L2_FACTOR * l2_bytes


def time_host(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall time of ``fn`` in milliseconds, the device drained before and after (plan time: host work)."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def time_rotation(fns: list[Callable[[], Any]], device: torch.device, target_ms: float = 200.0,
                  min_iters: int = 20, max_iters: int = 2000, use_graphs: bool = True,
                  warmup_ms: float = 50.0, one_graph: bool = False) -> TimingStats:
    """Time ``fns[i % n]`` launches round robin and return per-launch stats. Warm-up: every callable once before
    capture, then launches for at least ``warmup_ms`` (clocks ramp up) before the measured ones. ``one_graph``:
    the rotation captured as one graph (see the module docstring)."""
    if not fns:
        raise ValueError("time_rotation needs at least one callable")
    with torch.cuda.device(device):
        warm_up(fns)
        launches, method, fallback = list(fns), EVENTS, ""
        if use_graphs:
            try:
                launches, method = (_capture_all(fns) if one_graph else capture_graphs(fns)), GRAPH
            except Exception as exc:  # noqa: BLE001 - any capture failure means: time plain launches
                fallback = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc) else ''}"
                torch.cuda.synchronize()
        per_sample = len(fns) if len(launches) < len(fns) else 1  # callables run by one timed launch
        pacer = Pacer()  # what the warm-up learns about the host's pace carries into the measurement
        rough, _ = _events(launches, len(launches), pacer)   # one full rotation warm (and a first estimate)
        per_launch = max(statistics.median(rough), 1e-3)
        _events(launches, int(min(max_iters, warmup_ms / per_launch)), pacer)
        iters = int(min(max_iters, max(min_iters, 3 * len(launches), target_ms / per_launch)))
        samples, behind = _events(launches, iters, pacer)
        return TimingStats.of([t / per_sample for t in samples], method, fallback, behind)


def time_copy(num_bytes: int, device: torch.device, l2_bytes: int) -> TimingStats:
    """A device-to-device copy moving ``num_bytes`` (read + write), timed like a kernel under test (cold L2, one
    graph): how fast the device moves that many bytes at all. At a few hundred MB it is below the 1 GiB copy rate
    of ``measure_ceilings`` (ramp-up and tail are a larger share), which a fraction of that rate hides.

    The driver's memcpy (torch's ``copy_``) runs 1.5x slower at some sizes than at sizes a page away (an H200:
    304,218,112 bytes each way in 146.5 us, 304,222,208 in 228.1 us; which sizes is not a simple alignment rule),
    so ``COPY_TRIES`` sizes a ``COPY_PAGE`` apart around ``num_bytes / 2`` are timed and the fastest is returned."""
    if num_bytes <= 0:
        raise ValueError(f"time_copy needs a positive byte count, got {num_bytes}")
    first = max(1, round(num_bytes / 2 / COPY_PAGE)) * COPY_PAGE
    best = None
    for half in range(first, first + COPY_TRIES * COPY_PAGE, COPY_PAGE):
        pairs = [(torch.empty(half, dtype=torch.uint8, device=device),
                  torch.empty(half, dtype=torch.uint8, device=device))
                 for _ in range(sets_for_cold_l2(num_bytes, l2_bytes))]
        stats = time_rotation([lambda src=src, dst=dst: dst.copy_(src) for src, dst in pairs], device, one_graph=True)
        best = stats if best is None or stats.median < best.median else best
        del pairs
    return best


def warm_up(fns: list[Callable[[], Any]], rounds: int = 1) -> None:
    """Run every callable ``rounds`` times on a side stream, then synchronize: compiles, autotunes, fills the impl's
    caches (and connects a process group's communicators) before anything is captured or timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(rounds):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def capture_graphs(fns: list[Callable[[], Any]]) -> list[Callable[[], Any]]:
    """One CUDA graph per callable, sharing a memory pool (they replay in capture order); returns their replays."""
    graphs: list[torch.cuda.CUDAGraph] = []
    pool = None
    for fn in fns:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        pool = graph.pool()
        graphs.append(graph)
    return [graph.replay for graph in graphs]


def _capture_all(fns: list[Callable[[], Any]]) -> list[Callable[[], Any]]:
    """One CUDA graph running every callable once, in order."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return [graph.replay]


@dataclass
class Pacer:
    """How ``_events`` keeps the host ahead: the GPU sleep (in GPU clock cycles) before a call's first chunk, which
    starts on an idle GPU, and before each later chunk, which queues behind the previous one's work; the chunk's
    size; how many chunks in a row were kept; and whether it gave up (see ``fell_behind``)."""

    opening: int = SLEEP_CYCLES[1]
    following: int = SLEEP_CYCLES[1]
    chunk: int = CHUNK
    kept_in_a_row: int = 0
    gave_up: bool = False

    def sleep(self, first: bool) -> int:
        return self.opening if first else self.following

    def kept_ahead(self, first: bool) -> None:
        """A chunk was queued ahead: after ``SHRINK_AFTER`` in a row, sleep an eighth less (never under the floor), so
        the sleep settles near what the host needs with a drop now and then, not one chunk in six."""
        self.kept_in_a_row += 1
        if self.kept_in_a_row % SHRINK_AFTER == 0:
            self._set(first, max(SLEEP_CYCLES[0], self.sleep(first) - self.sleep(first) // 8))

    def fell_behind(self, first: bool, queued: int, first_launch_late: bool) -> bool:
        """A chunk of ``queued`` launches was not queued ahead: sleep twice as long, up to the cap; at the cap, halve
        the chunk and the sleep (a launch queue too short for the chunk blocks the host while the GPU sleeps, and a
        host slower than the capped sleep a chunk needs a shorter chunk); give up when one launch outlasts the capped
        sleep (it syncs, or its host part takes longer than 70 ms). True: keep the chunk (given up), else drop it."""
        self.kept_in_a_row = 0
        sleep, cap = self.sleep(first), SLEEP_CYCLES[2]
        if sleep == cap and (first_launch_late or queued == 1):
            self.gave_up = True
        elif sleep < cap:
            self._set(first, min(cap, 2 * sleep))
        else:
            self.chunk = max(1, min(self.chunk, queued) // 2)
            self._set(first, sleep // 2)
        return self.gave_up

    def _set(self, first: bool, sleep: int) -> None:
        if first:
            self.opening = sleep
        else:
            self.following = sleep


def _events(launches: list[Callable[[], Any]], iters: int, pacer: Pacer | None = None) -> tuple[list[float], int]:
    """Milliseconds of each of ``iters`` launches (round robin, events around each), and how many of them the host
    may have enqueued late. Launches go in chunks (``pacer.chunk``), each behind a GPU sleep and a ``woke`` event.
    If the GPU has passed ``woke`` by the time the chunk's last launch is queued, some launch of the chunk may have
    started before the host had queued it: the chunk is dropped and the pacer sleeps longer (``Pacer.fell_behind``).
    Once the pacer gives up, chunks go without sleeps, all are kept, and those not queued ahead count as behind. One
    sync at the end."""
    pacer = pacer or Pacer()
    timed: list[tuple[list[torch.cuda.Event], list[torch.cuda.Event]]] = []
    kept = behind = done = 0
    while kept < iters:
        first, n = not timed, min(pacer.chunk, iters - kept)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        woke = torch.cuda.Event()
        if not pacer.gave_up:
            torch.cuda._sleep(pacer.sleep(first))
        woke.record()
        first_launch_late = False
        for i, (start, end) in enumerate(zip(starts, ends)):
            start.record()
            launches[done % len(launches)]()
            end.record()
            done += 1
            if i == 0:
                first_launch_late = woke.query()
        if not woke.query():
            pacer.kept_ahead(first)
        elif not (pacer.gave_up or pacer.fell_behind(first, n, first_launch_late)):
            continue  # dropped
        else:
            behind += n
        timed.append((starts, ends))
        kept += n
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for starts, ends in timed for s, e in zip(starts, ends)], behind


# ---- ceilings -----------------------------------------------------------------------------------------------------
@dataclass
class Ceilings:
    """What the device can do, measured here: copy bandwidth (GB/s, read + write) and bf16 matmul (TFLOP/s)."""

    device_name: str
    copy_gbps: float
    matmul_tflops: float
    l2_bytes: int

    def metrics(self) -> dict[str, float]:
        return {"copy_gbps": self.copy_gbps, "matmul_tflops": self.matmul_tflops, "l2_bytes": self.l2_bytes}


_CEILINGS: dict[int, Ceilings] = {}


def measure_ceilings(device: torch.device) -> Ceilings:
    """Copy bandwidth of a 1 GiB device-to-device copy and the rate of a random bf16 8192^3 matmul, once per
    device per process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CEILINGS:
        device = torch.device("cuda", index)
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy = time_rotation([lambda: dst.copy_(src)], device, use_graphs=False, min_iters=10, target_ms=200,
                             warmup_ms=300)
        del src, dst
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16, generator=gen)
        out = torch.empty_like(a)
        matmul = time_rotation([lambda: torch.mm(a, b, out=out)], device, use_graphs=False, min_iters=10,
                               target_ms=200, warmup_ms=300)
        del a, b, out
        torch.cuda.empty_cache()
        _CEILINGS[index] = Ceilings(
            device_name=torch.cuda.get_device_name(index),
            copy_gbps=2 * COPY_BYTES / (copy.median * 1e-3) / 1e9,
            matmul_tflops=2 * MATMUL_N ** 3 / (matmul.median * 1e-3) / 1e12,
            l2_bytes=l2_cache_bytes(device))
    return _CEILINGS[index]


# ---- pytest-benchmark ---------------------------------------------------------------------------------------------
class CudaEventTimer:
    """A clock (seconds) read from CUDA events: ``@pytest.mark.benchmark(timer=cuda_event_timer)`` makes
    pytest-benchmark time the GPU's timeline between two calls instead of the host's. That timeline includes the
    GPU waiting for the host: each call drains the queue, so a round's first launch (and every launch that the host
    takes longer to enqueue than the GPU to run) is timed from when the host began enqueueing it. For launches of
    tens of microseconds or less, read the latency suite, whose timer keeps the host ahead (``_events``).

    The clock adds each call's time since the previous call's event: CUDA gives an event interval as a float32 of
    milliseconds, so one interval from a fixed origin would step by 8 us after 100 s and by 62.5 us after 1000 s
    (and pytest-benchmark measures the clock's precision once per session, at its start)."""

    def __init__(self) -> None:
        self._last: torch.cuda.Event | None = None
        self._seconds = 0.0

    def __call__(self) -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        if self._last is not None:
            self._seconds += self._last.elapsed_time(event) * 1e-3
        self._last = event
        return self._seconds

    def __repr__(self) -> str:
        return "cuda_event_timer"


cuda_event_timer = CudaEventTimer()
