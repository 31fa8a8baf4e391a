"""What a measurement is held against: the latency suite's input sets against the free device memory (by what a
set holds, not by what a launch reads), and a DCP row of W ranks against W GPUs' ceilings."""

from __future__ import annotations

import pytest
import torch

from mla_bench import timing
from mla_bench.costs import cost
from mla_bench.problem import build_problem
from mla_bench.workload import Mode, Workload
from suites import bench_paths, latency

L2 = 50 << 20


def test_the_input_sets_fit_in_the_free_memory_by_what_a_set_holds():
    """A 128-head decode of one request reads 353 KB a launch, but a set holds 32 MiB of up/down-projection weights
    (and its cache, queries and latents: torch_eager's plan keeps the whole problem). Budgeted at twice the bytes a
    launch reads, 1 GiB free admitted 256 sets, 8 GiB of them."""
    workload = Workload.uniform(Mode.DECODE, 1, 1, 64, preset="deepseek-v3")
    work, problem, free, fraction = cost(workload), build_problem(workload), 1 << 30, latency.MEMORY_FRACTION
    held = sum(t.nbytes for t in (problem.kv, problem.w_uk, problem.w_uv, problem.q, problem.cache.data))
    old = timing.sets_for_cold_l2(work.bytes, L2, limit=max(1, int(fraction * free // (2 * work.bytes))))
    assert old * held > 8 * fraction * free  # the scenario: the old budget overflows its share many times over
    sets = latency.sets_that_fit(work.bytes, held, free, L2)
    assert 1 < sets and sets * held <= fraction * free < (sets + 1) * held
    assert latency.sets_that_fit(work.bytes, free, free, L2) == 1  # a set larger than the budget is still timed, alone


def test_a_set_that_fits_many_times_still_stops_at_a_cold_l2():
    assert latency.sets_that_fit(L2, 1 << 20, 80 << 30, L2) == timing.COLD_L2_FACTOR


@pytest.mark.gpu
def test_the_latency_suite_measures_what_a_set_holds_on_the_device():
    from impls.torch_eager import TorchEager
    device = torch.device("cuda")
    workload = Workload.uniform(Mode.DECODE, 1, 1, 64, preset="deepseek-v3")
    problem = build_problem(workload)
    result = latency.time_impl(TorchEager(), workload, device, timing.measure_ceilings(device))
    assert result.status == "passed", result.message
    assert result.details["set_bytes"] >= problem.w_uk.nbytes + problem.w_uv.nbytes + problem.cache.data.nbytes


def test_a_dcp_row_of_w_ranks_is_a_fraction_of_w_gpus_ceilings(monkeypatch):
    """W=2 ranks on the same per-GPU rate as W=1 take half the time: their traffic over all ranks is twice the GB/s
    and TFLOP/s, and against one GPU's ceilings read as 161% of the copy bandwidth."""
    monkeypatch.setattr(bench_paths, "ROWS", [])
    one = {"copy_GBps": 3000.0, "bf16_TFLOPs": 700.0}
    assert bench_paths.ceilings_of(one, 2) == {"copy_GBps": 6000.0, "bf16_TFLOPs": 1400.0}
    nbytes, flops = 64 * 131072 * 1152, 2 * (576 + 512) * 16 * 64 * 131072
    w1, w2 = (bench_paths.row("dcp", "dcp", f"W={w}", {"ms": 4.0 / w}, flops, nbytes, bench_paths.ceilings_of(one, w))
              for w in (1, 2))
    assert w2["GBps"] == pytest.approx(2 * w1["GBps"]) and w1["of_copy"] == pytest.approx(0.805, abs=1e-3)
    assert w2["of_copy"] == pytest.approx(w1["of_copy"]) and w2["of_matmul"] == pytest.approx(w1["of_matmul"])
