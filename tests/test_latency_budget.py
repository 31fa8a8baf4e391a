"""What a measurement is held against: the latency suite's input sets against the free device memory (by what a
set holds, not by what a launch reads; the sets of a workload built once, shared by its impls), and a DCP row of W
ranks against W GPUs' ceilings."""

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


def _count_builds(monkeypatch) -> list[int]:
    """The seeds ``latency.build_problem`` is called with, in order."""
    seeds: list[int] = []

    def counting(workload: Workload, device):
        seeds.append(workload.seed)
        return build_problem(workload, device)
    monkeypatch.setattr(latency, "build_problem", counting)
    return seeds


def test_the_input_sets_of_a_workload_are_built_once_in_order_when_first_asked_for(monkeypatch):
    """The latency run built every set again for every impl: 821 sets where 398 would do on the H100 baseline.
    Asking for set 3 builds sets 0 to 3 from their own seeds; asking again, for it or one before, builds nothing."""
    seeds, frees = _count_builds(monkeypatch), iter([7 << 30, 1 << 30])
    workload = Workload.uniform(Mode.DECODE, 1, 1, 64, seed=11)
    sets = latency.InputSets(workload, torch.device("cpu"), free_bytes=lambda device: next(frees),
                             allocated=lambda device: 500 * len(seeds) * (len(seeds) + 1))  # set i: 1000 * (i + 1)
    assert seeds == [] and sets.free == 7 << 30  # probed when made, before any set
    third = sets.problem(3)
    expected = [latency.input_set(workload, i).seed for i in range(4)]
    assert seeds == expected and len(set(expected)) == 4 and third.workload.seed == expected[3]
    assert sets.problem(3) is third and sets.problem(1).workload.seed == expected[1]
    assert [sets.problem_bytes(i) for i in range(4)] == [1000, 2000, 3000, 4000]
    assert seeds == expected and sets.free == 7 << 30  # nothing built again, free not probed again
    built_s = sets.build_s
    assert built_s > 0 and sets.problem(2) is not None and sets.build_s == built_s


@pytest.mark.gpu
def test_impls_timed_on_one_workload_share_its_input_sets(monkeypatch):
    """Two impls on one InputSets: each set is built once, and what a set holds counts its shared problem, which
    stays resident while the second impl is timed."""
    from impls.torch_eager import TorchEager
    device = torch.device("cuda")
    seeds = _count_builds(monkeypatch)
    workload = Workload.uniform(Mode.DECODE, 1, 1, 64)
    ceilings, sets = timing.measure_ceilings(device), latency.InputSets(workload, device)
    first, second = (latency.time_impl(TorchEager(), workload, device, ceilings, sets) for _ in range(2))
    assert first.status == second.status == "passed", (first.message, second.message)
    count = max(first.metrics["input_sets"], second.metrics["input_sets"])
    assert count > 1 and seeds == [latency.input_set(workload, i).seed for i in range(count)]
    assert sets.problem_bytes(0) > 0 and second.details["set_bytes"] >= sets.problem_bytes(0)
    assert 0 < first.details["build_s"] <= first.details["wall_s"] and second.details["build_s"] == 0.0


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
