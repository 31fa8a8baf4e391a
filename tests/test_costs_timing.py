"""The cost model against the numbers measured on an H200 (MLA_FACTS.md), the timing statistics, and on a GPU
the timer itself (graphs, fallback, cold-L2 rotation, ceilings, pytest-benchmark)."""

from __future__ import annotations

import random
import struct
import time

import pytest
import torch

from mla_bench import timing
from mla_bench.costs import Cost, cost, visible_keys
from mla_bench.problem import build_problem
from mla_bench.workload import Mode, Workload


@pytest.mark.parametrize("preset, batch, ctx, ms, gbps, tflops", [
    ("deepseek-v3-tp8", 32, 4096, 0.076, 2001, 60),   # the Triton peer, 16 heads
    ("deepseek-v3-tp8", 64, 16384, 0.444, 2727, 82),
    ("deepseek-v3", 128, 4096, 0.269, 2380, 543),      # FlashInfer, 128 heads
])
def test_decode_cost_matches_the_measured_table(preset, batch, ctx, ms, gbps, tflops):
    work = cost(Workload.uniform(Mode.DECODE, batch, 1, ctx, preset=preset))
    assert work.gbps(ms) == pytest.approx(gbps, rel=0.01)
    assert work.tflops(ms) == pytest.approx(tflops, rel=0.01)


def test_costs_count_only_what_is_read_and_seen():
    causal = Workload(Mode.DECODE, (3, 0), (10, 0))
    assert visible_keys(causal) == [8, 9, 10]
    sparse = Workload(Mode.SPARSE_DECODE, (1, 1), (5, 40), topk=16, page_size=16)
    assert visible_keys(sparse) == [5, 16]                                  # -1 padding is not read
    dense = cost(Workload(Mode.DECODE, (1, 1), (5, 40), page_size=16))
    assert sparse_cost(sparse).bytes == dense.bytes - (45 - 21) * 1152      # only valid top-k rows read
    prefill = Workload(Mode.SPARSE_PREFILL, (4,), (40,), topk=16, page_size=16)
    q_and_out = 4 * 4 * (576 * 2 + 512 * 2 + 4)                             # 4 x 16 picks of 37 to 40 tokens
    assert sparse_cost(prefill).bytes == 33 * 1152 + q_and_out and sparse_cost(prefill).flops == 4 * 16 * 4 * 2 * 1088
    prefill = Workload(Mode.PREFILL, (4,), (4,))
    heads = prefill.dims.num_heads
    assert cost(prefill).flops == (1 + 2 + 3 + 4) * heads * 2 * (192 + 128)
    assert cost(prefill).bytes == 4 * heads * 192 * 2 + 4 * (heads * 256 * 2 + 128) + 4 * heads * (128 * 2 + 4)


def sparse_cost(workload: Workload) -> Cost:
    """The cost of a sparse workload with its problem's own top-k indices."""
    return cost(workload, build_problem(workload).topk_indices)


def test_sparse_bytes_are_the_distinct_tokens_the_indices_select():
    """MTP sparse decode: two query tokens of a request pick 4 keys each, 2 of them shared: 6 tokens read, not
    min(kv_len, 4 + 4) = 8. Random picks of 2048 from 4096 share a quarter: 12277 tokens read, not 16384."""
    mtp = Workload(Mode.SPARSE_DECODE, (2,), (8,), topk=4, page_size=4)
    picks = torch.tensor([[0, 1, 2, 3], [5, 3, 4, 2]], dtype=torch.int32)
    assert cost(mtp, picks).bytes == 6 * 1152 + 2 * 4 * 576 * 2 + 2 * 4 * (512 * 2 + 4)
    assert cost(mtp, picks).flops == 2 * 4 * 4 * 2 * 1088
    assert cost(mtp, torch.tensor([[0, 1, -1, -1], [1, 0, 7, -1]], dtype=torch.int32)).bytes \
        == cost(mtp, picks).bytes - 3 * 1152                                # -1 is no token
    wide = Workload(Mode.SPARSE_DECODE, (2,) * 4, (4096,) * 4, topk=2048)
    assert sparse_cost(wide).bytes == 12277 * 1152 + 8 * 4 * (576 * 2 + 512 * 2 + 4)
    with pytest.raises(ValueError, match="pass topk_indices"):
        cost(mtp)


def test_a_request_without_queries_reads_none_of_its_cache():
    """A request of kv_len 20 and no query token: no kernel reads its 20 tokens (nor a prefill its keys)."""
    alone = cost(Workload(Mode.DECODE, (1,), (10,)))
    assert cost(Workload(Mode.DECODE, (1, 0), (10, 20))) == alone
    assert cost(Workload(Mode.CHUNKED_PREFILL, (3, 0), (10, 20), chunk_size=8)) \
        == cost(Workload(Mode.CHUNKED_PREFILL, (3,), (10,), chunk_size=8))
    assert cost(Workload(Mode.PREFILL, (2, 0), (5, 9))) == cost(Workload(Mode.PREFILL, (2,), (5,)))


def test_a_query_that_sees_no_key_is_written_but_not_read():
    """A padding request (kv_len 0) gets out 0 and lse -inf written, but its queries need not be read."""
    heads, out_row = 4, 4 * (512 * 2 + 4)
    padded = cost(Workload(Mode.DECODE, (1, 1), (0, 10)))
    assert padded.bytes == 10 * 1152 + heads * 576 * 2 + 2 * out_row
    assert padded.bytes == cost(Workload(Mode.DECODE, (1,), (10,))).bytes + out_row
    sparse = Workload(Mode.SPARSE_DECODE, (1, 1), (0, 10), topk=4, page_size=4)
    assert sparse_cost(sparse).bytes == 4 * 1152 + heads * 576 * 2 + 2 * out_row


def test_timing_stats_median_and_iqr():
    stats = timing.TimingStats.of([5.0, 1.0, 2.0, 4.0, 3.0])
    assert (stats.median, stats.p25, stats.p75, stats.iqr, stats.minimum) == (3.0, 2.0, 4.0, 2.0, 1.0)
    assert stats.metrics("run_ms") == {"run_ms": 3.0, "run_ms_p25": 2.0, "run_ms_p75": 4.0, "run_ms_iqr": 2.0,
                                       "run_ms_min": 1.0, "run_ms_spread": 0.0}  # too few samples for slices
    with pytest.raises(ValueError):
        timing.TimingStats.of([])


def test_a_slower_spell_moves_the_spread_where_the_iqr_barely_moves():
    """An H100's spells: most windows of a 22 us decode at 22.0 us, one in five at 25 (session 57)."""
    rng = random.Random(0)
    steady = [22.0 + rng.uniform(-0.2, 0.2) for _ in range(5000)]
    spell = steady[:2000] + [25.0 + rng.uniform(-0.2, 0.2) for _ in range(1000)] + steady[3000:]
    for samples in (steady, spell):
        assert timing.TimingStats.of(samples).iqr < 0.3
    assert timing.TimingStats.of(steady).spread < 0.1
    assert 2.8 < timing.TimingStats.of(spell).spread < 3.2
    # the slices are in launch order: the same samples sorted would make every slice a spell of its own
    assert timing.TimingStats.of(sorted(spell)).spread > timing.TimingStats.of(spell).spread


def test_the_spread_slices_are_even_and_none_is_a_lone_outlier():
    """21 samples in fives by ceiling would leave one sample alone in the last slice, its median the outlier."""
    assert timing.TimingStats.of([10.0] * 20 + [30.0]).spread == 0.0  # under 10 a slice: no spread
    assert timing.TimingStats.of([10.0] * 55 + [30.0]).spread == 0.0  # slices of 11-12: one outlier moves none
    assert timing.TimingStats.of([10.0] * 48 + [30.0] * 8).spread == 20.0  # a spell of 8 in the last slice of 11


def test_rotation_exceeds_the_l2_several_times():
    l2 = 50 << 20
    n = timing.sets_for_cold_l2(5 << 20, l2)
    assert n * (5 << 20) >= timing.COLD_L2_FACTOR * l2 > (n - 1) * (5 << 20)
    assert timing.sets_for_cold_l2(4 << 30, l2) == 1 and timing.sets_for_cold_l2(1, l2, limit=8) == 8
    assert timing.rotation_is_cold(n, 5 << 20, l2) and not timing.rotation_is_cold(n - 1, 5 << 20, l2)


def test_a_rotation_never_holds_more_than_max_sets_however_small_the_workload():
    l2 = 50 << 20
    sets = timing.sets_for_cold_l2(128 << 10, l2, limit=10 ** 6)  # a tiny decode: 1600 sets would be cold
    assert sets == timing.MAX_SETS and not timing.rotation_is_cold(sets, 128 << 10, l2)


@pytest.mark.gpu
def test_graph_timing_and_its_fallback_on_the_gpu():
    device = torch.device("cuda")
    x = [torch.randn(1 << 22, device=device) for _ in range(4)]
    graphed = timing.time_rotation([lambda t=t: t.mul_(1.0) for t in x], device)
    assert graphed.method == timing.GRAPH and graphed.median > 0 and graphed.count >= 20
    syncing = timing.time_rotation([lambda t=t: t.sum().item() for t in x], device)  # .item() cannot be captured
    assert syncing.method == timing.EVENTS and syncing.fallback
    assert syncing.host_behind == syncing.count and graphed.host_behind == 0  # a syncing launch leaves no queue
    whole = timing.time_rotation([lambda t=t: t.mul_(1.0) for t in x], device, one_graph=True)
    assert whole.method == timing.GRAPH and whole.median == pytest.approx(graphed.median, rel=0.5)


@pytest.mark.gpu
def test_a_host_slower_than_the_gpu_is_not_timed():
    """Each launch takes the host 200 us and the GPU a few: per-launch events time the GPU only if the host queues
    launches ahead of it. Without the sleeps of ``_events`` every sample was the host's 200 us."""
    device = torch.device("cuda")
    x = torch.randn(1 << 16, device=device)

    def slow_host() -> None:
        until = time.perf_counter() + 200e-6
        while time.perf_counter() < until:
            pass
        x.mul_(1.0)

    gpu = timing.time_rotation([lambda: x.mul_(1.0)], device, use_graphs=False)
    host_bound = timing.time_rotation([slow_host], device, use_graphs=False, target_ms=5, max_iters=200)
    assert host_bound.host_behind == 0 and host_bound.count >= 20
    assert host_bound.median < min(0.05, 3 * gpu.median), (host_bound.median, gpu.median)


def test_a_copy_of_no_bytes_is_refused():
    with pytest.raises(ValueError, match="positive byte count"):
        timing.time_copy(0, torch.device("cpu"), 50 << 20)


@pytest.mark.gpu
def test_a_size_matched_copy_grows_with_its_size_and_stays_near_the_ceiling_rate():
    device = torch.device("cuda")
    ceilings = timing.measure_ceilings(device)
    small, large = (timing.time_copy(n, device, ceilings.l2_bytes) for n in (16 << 20, 512 << 20))
    assert small.method == large.method == timing.GRAPH
    assert large.median > 4 * small.median
    assert (512 << 20) / (large.median * 1e-3) / 1e9 < 1.2 * ceilings.copy_gbps
    # Sizes where the driver's memcpy alone is 1.5x slower (a few KiB from fast ones) time like their neighbours.
    for fast, slow in ((151_003_136, 151_000_064), (608_436_224, 608_444_416)):
        a, b = (timing.time_copy(n, device, ceilings.l2_bytes).median for n in (fast, slow))
        assert b < 1.15 * a


@pytest.mark.gpu
def test_the_latency_suite_times_a_tiny_workload_on_max_sets_and_says_its_l2_is_warm():
    from impls.torch_eager import TorchEager
    from suites.latency import time_impl
    from suites.sweeps import tiny
    device = torch.device("cuda")
    workload = tiny()[0]
    result = time_impl(TorchEager(), workload, device, timing.measure_ceilings(device))
    assert result.status == "passed", result.message
    assert result.metrics["input_sets"] == timing.MAX_SETS and result.details["cold_l2"] is False
    assert result.details["rotation_bytes"] == timing.MAX_SETS * cost(workload).bytes


def test_the_latency_suite_does_not_time_a_multi_process_dcp_run():
    """Each run of triton_dcp is a job for rank processes: events around it time the hand-off (seconds of start-up
    per launch before the ranks were kept), over up to MAX_SETS input sets and hundreds of launches."""
    from impls.triton.dcp.impl import TritonDcp
    from suites.latency import time_impl
    workload = Workload(Mode.DCP, (1, 1), (33, 40), page_size=16, dcp_world=2)
    ceilings = timing.Ceilings("a GPU", copy_gbps=3000.0, matmul_tflops=700.0, l2_bytes=50 << 20)
    result = time_impl(TritonDcp(), workload, torch.device("cuda"), ceilings)
    assert result.status == "unsupported" and "not measured for dcp" in result.message and not result.metrics


@pytest.mark.gpu
def test_ceilings_are_plausible():
    ceilings = timing.measure_ceilings(torch.device("cuda"))
    assert 100 < ceilings.copy_gbps < 20_000 and 10 < ceilings.matmul_tflops < 5_000
    assert ceilings.l2_bytes >= 1 << 20


def test_the_cuda_event_clock_keeps_microseconds_long_after_its_first_reading(monkeypatch):
    """CUDA gives an event interval as a float32 of milliseconds: read from a fixed first event, an interval of 50 us
    1000 s later came out as 0 or 62.5 us (the float32 step at 1e6 ms)."""
    gpu_ms = [0.0]  # the fake GPU's clock

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = 0.0

        def record(self) -> None:
            self.at = gpu_ms[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: "Event") -> float:
            return struct.unpack("f", struct.pack("f", end.at - self.at))[0]  # cudaEventElapsedTime's float

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = timing.CudaEventTimer()
    assert clock() == 0.0
    gpu_ms[0] += 1e6 + 0.0123
    start = clock()
    gpu_ms[0] += 0.05
    assert clock() - start == pytest.approx(50e-6, abs=1e-8)


@pytest.mark.gpu
@pytest.mark.benchmark(timer=timing.cuda_event_timer, min_rounds=20)
def test_pytest_benchmark_with_the_cuda_event_timer(request):
    pytest.importorskip("pytest_benchmark")
    benchmark = request.getfixturevalue("benchmark")
    from impls.torch_eager import TorchEager
    from mla_bench.problem import build_problem

    impl = TorchEager()
    plan = impl.plan(build_problem(Workload.uniform(Mode.DECODE, 4, 1, 1024, preset="deepseek-v3-tp8"), "cuda"))
    benchmark(impl.run, plan)
    assert benchmark.stats.stats.median > 0
