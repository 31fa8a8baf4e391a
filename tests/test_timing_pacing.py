"""The per-launch timer's pacing (``timing._events`` and ``Pacer``) against a simulated host and GPU, on the CPU.

The simulation keeps two clocks: the host's (what enqueueing costs) and the GPU's (each entry starts when the GPU is
free and the host has enqueued it, so a GPU that drains its queue waits for the host). An event's time is when the
GPU reaches it. A launch queue of limited depth blocks the host until its oldest entry completes. Times in us.
"""

from __future__ import annotations

import random
import statistics
from collections import deque

import pytest
import torch

from mla_bench import timing

CLOCK_GHZ = 1.98
RECORD_US = 0.5        # the host's cost of recording an event


class Timeline:
    def __init__(self, host_us: float, gpu_us: float, syncs: bool = False, queue: int = 10 ** 9) -> None:
        self.host = self.gpu = 0.0
        self.host_us, self.gpu_us, self.syncs, self.queue = host_us, gpu_us, syncs, queue
        self.pending: deque[float] = deque()  # GPU end times (in order) of the entries not done when the host looked
        self.launches, self.slept_us = 0, 0.0

    def enqueue(self, host_cost: float, gpu_cost: float) -> float:
        """The host spends ``host_cost``, then queues an entry taking the GPU ``gpu_cost``; its GPU start time."""
        self.host += host_cost
        while self.pending and self.pending[0] <= self.host:
            self.pending.popleft()
        if len(self.pending) >= self.queue:
            self.host = self.pending.popleft()
        start = max(self.gpu, self.host)
        self.gpu = start + gpu_cost
        self.pending.append(self.gpu)
        return start

    def synchronize(self) -> None:
        self.host = max(self.host, self.gpu)
        self.pending.clear()

    def launch(self) -> None:
        self.launches += 1
        self.enqueue(self.host_us * random.uniform(0.8, 1.6), self.gpu_us)
        if self.syncs:
            self.host = max(self.host, self.gpu)


@pytest.fixture
def timeline(monkeypatch):
    """Installs a fake ``torch.cuda`` Event, ``_sleep`` and ``synchronize`` over a Timeline set by the test."""
    state: dict[str, Timeline] = {}

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at: float | None = None

        def record(self) -> None:
            self.at = state["t"].enqueue(RECORD_US, 0.0)

        def query(self) -> bool:
            return self.at <= state["t"].host

        def elapsed_time(self, other: "Event") -> float:
            return (other.at - self.at) / 1e3

    def sleep(cycles: int) -> None:
        us = cycles / (CLOCK_GHZ * 1e3)
        state["t"].slept_us += us
        state["t"].enqueue(2.0, us)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: state["t"].synchronize())

    def use(t: Timeline) -> Timeline:
        state["t"] = t
        random.seed(0)
        return t
    return use


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


@pytest.mark.parametrize("host_us, gpu_us, queue", [
    (25.0, 22.0, 10 ** 9),   # the 128-head b1 decode: a host about as fast as the GPU
    (200.0, 3.0, 10 ** 9),   # a slow host part, a short kernel
    (2500.0, 100.0, 10 ** 9),  # 32 launches take the host longer than the capped sleep: the chunk halves
    (5.0, 20.0, 40),         # a queue shorter than a chunk's entries blocks the host while the GPU sleeps
], ids=["host-like-gpu", "slow-host", "very-slow-host", "short-queue"])
def test_samples_are_the_gpus_time_however_slow_the_host(timeline, host_us, gpu_us, queue):
    t = timeline(Timeline(host_us, gpu_us, queue=queue))
    samples, behind = timing._events([t.launch], 600)
    assert len(samples) == 600 and behind == 0
    assert _median_us(samples) == pytest.approx(gpu_us, rel=0.05)
    assert max(samples) * 1e3 < gpu_us + 1.0  # no kept sample includes the host's time
    # The GPU sleeps about as long as the host queues, plus the drops on the way (doublings, halvings at the cap).
    assert t.slept_us < 0.7e6 + 2 * 600 * host_us


def test_a_short_queue_costs_a_few_capped_sleeps_not_one_a_chunk(timeline):
    t = timeline(Timeline(5.0, 20.0, queue=40))
    pacer = timing.Pacer()
    timing._events([t.launch], 2500, pacer)  # the 50 ms warm-up
    assert pacer.chunk < timing.CHUNK and t.slept_us < 0.5e6


def test_without_pacing_the_same_samples_are_the_hosts(timeline):
    """The simulation reproduces the bug the pacing fixes: launches queued as they come time the host."""
    t = timeline(Timeline(25.0, 22.0))
    starts, ends = [], []
    for _ in range(200):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t.launch()
        end.record()
        starts.append(start)
        ends.append(end)
    assert _median_us([s.elapsed_time(e) for s, e in zip(starts, ends)]) > 1.2 * 22.0


def test_drops_are_rare_once_the_sleep_has_settled(timeline):
    t = timeline(Timeline(25.0, 22.0))
    pacer = timing.Pacer()
    timing._events([t.launch], 2000, pacer)
    launched = t.launches
    timing._events([t.launch], 2000, pacer)
    assert t.launches - launched < 1.1 * 2000  # under one chunk in ten dropped


def test_a_gpu_bound_launch_ends_with_almost_no_sleep(timeline):
    """Each call's first chunk starts on an idle GPU and needs a sleep as long as the host takes to queue it; later
    chunks queue behind the previous one's work, and their sleep shrinks geometrically (an eighth every SHRINK_AFTER
    chunks) from 1 ms: about 34 ms in all, then nearly nothing."""
    t = timeline(Timeline(5.0, 50.0))
    pacer = timing.Pacer()
    samples, behind = timing._events([t.launch], 2000, pacer)
    assert behind == 0 and _median_us(samples) == pytest.approx(50.0, rel=0.01)
    assert t.slept_us < 40e3
    slept = t.slept_us
    timing._events([t.launch], 8000, pacer)  # the latency suite's 400 ms window
    assert t.slept_us - slept < 0.02 * 8000 * 50.0


def test_a_launch_that_syncs_is_counted_behind_and_the_pacer_gives_up_once(timeline):
    t = timeline(Timeline(10.0, 5.0, syncs=True))
    pacer = timing.Pacer()
    samples, behind = timing._events([t.launch], 300, pacer)
    assert pacer.gave_up and behind == len(samples) == 300
    slept = t.slept_us
    assert slept < 0.3e6  # doubling to the cap, then one chunk at it: not a halving of the chunk down to 1
    timing._events([t.launch], 300, pacer)
    assert t.slept_us == slept  # a pacer that gave up sleeps no more


def test_the_pacer_shrinks_after_chunks_in_a_row_and_gives_up_only_at_the_cap():
    floor, start, cap = timing.SLEEP_CYCLES
    pacer = timing.Pacer()
    for _ in range(timing.SHRINK_AFTER - 1):
        pacer.kept_ahead(first=False)
    assert pacer.sleep(first=False) == start
    pacer.kept_ahead(first=False)
    assert pacer.sleep(first=False) == start - start // 8 and pacer.sleep(first=True) == start
    assert not pacer.fell_behind(False, 32, first_launch_late=True) and pacer.kept_in_a_row == 0  # below the cap
    while pacer.sleep(first=False) < cap:
        assert not pacer.fell_behind(False, 32, first_launch_late=False)
    assert pacer.sleep(first=False) == cap and not pacer.fell_behind(False, 20, first_launch_late=False)
    assert pacer.chunk == 10 and pacer.sleep(first=False) == cap // 2 and not pacer.gave_up  # halved from 20 queued
    pacer.fell_behind(False, 10, first_launch_late=False)
    assert pacer.sleep(first=False) == cap
    assert pacer.fell_behind(False, 10, first_launch_late=True) and pacer.gave_up  # one launch outlasts the cap
    for _ in range(1000):
        pacer.kept_ahead(first=True)
    assert pacer.sleep(first=True) == floor
