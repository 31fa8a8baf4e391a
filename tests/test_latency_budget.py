"""What a measurement is held against: the latency suite's input sets against the free device memory (by what a
set holds, not by what a launch reads; the sets of a workload built once, shared by its impls), and a DCP row of W
ranks against W GPUs' ceilings."""

from __future__ import annotations

import pytest
import torch

from mla_bench import timing
from mla_bench.costs import cost
from mla_bench.problem import Problem, build_problem
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


def _count_builds(monkeypatch) -> list[Workload]:
    """The workloads ``latency.build_problem`` is called with, in order."""
    built: list[Workload] = []

    def counting(workload: Workload, device):
        built.append(workload)
        return build_problem(workload, device)
    monkeypatch.setattr(latency, "build_problem", counting)
    return built


def _tensors(problem) -> dict[str, torch.Tensor]:
    """Every tensor a problem holds, by a name saying where."""
    fields = {name: getattr(problem, name) for name in ("kv", "w_uk", "w_uv", "q", "k_nope", "k_pe", "v",
                                                       "topk_indices", "sparse_indices")}
    fields.update({f"meta.{name}": getattr(problem.meta, name) for name in ("query_start_loc", "kv_start_loc",
                                                                           "seq_lens", "block_table", "token_slots")})
    if problem.cache is not None:
        fields["cache.data"] = problem.cache.data
    return {name: tensor for name, tensor in fields.items() if tensor is not None}


@pytest.mark.parametrize("mode, fields", [(Mode.DECODE, {"layout": "fp8_ds_mla"}),
                                          (Mode.SPARSE_DECODE, {"layout": "fp8_ds_mla", "topk": 8}),
                                          (Mode.PREFILL, {}), (Mode.CHUNKED_PREFILL, {"chunk_size": 16})])
def test_a_copied_problem_holds_the_same_values_at_new_addresses(mode, fields):
    """The latency suite's sets past the first are copies: a launch on one must read none of another's bytes (else
    the rotation leaves them in L2), and must read the same inputs."""
    q_len = 1 if mode in (Mode.DECODE, Mode.SPARSE_DECODE) else 3
    workload = Workload.uniform(mode, 2, q_len, 40 if mode is not Mode.PREFILL else q_len, page_size=16, **fields)
    problem = build_problem(workload)
    copied = problem.copy()
    tensors, copies = _tensors(problem), _tensors(copied)
    assert tensors.keys() == copies.keys() and len(tensors) >= 9
    for name, tensor in tensors.items():
        assert torch.equal(copies[name], tensor), name
        assert copies[name].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr(), name
    assert copied.workload == workload and copied.scale == problem.scale and copied.meta.kv_lens == problem.meta.kv_lens
    if problem.cache is not None:
        assert copied.cache.layout is problem.cache.layout and copied.cache.tensor_scale == problem.cache.tensor_scale


def test_the_input_sets_of_a_workload_are_made_once_in_order_when_first_asked_for(monkeypatch):
    """The latency run built every set again for every impl (821 sets where 398 would do on the H100 baseline), each
    from its own seed: 0.9-9.9 s a set on the H100 machine's host. Set 0 is built from the workload, the others
    copied from it; asking again, for a set or one before it, makes nothing."""
    built, frees = _count_builds(monkeypatch), iter([7 << 30, 1 << 30])
    workload = Workload.uniform(Mode.DECODE, 1, 1, 64, seed=11)
    made = []
    sets = latency.InputSets(workload, torch.device("cpu"), free_bytes=lambda device: next(frees),
                             allocated=lambda device: 1000 * len(made))
    assert built == [] and sets.free == 7 << 30  # probed when made, before any set
    real_copy = Problem.copy
    monkeypatch.setattr(Problem, "copy", lambda self: made.append(1) or real_copy(self))
    made.append(1)  # the build below counts as a thousand bytes too
    third = sets.problem(3)
    assert built == [workload] and len(made) == 4
    first = sets.problem(0)
    assert third is not first and torch.equal(third.q, first.q) and third.q.data_ptr() != first.q.data_ptr()
    assert sets.problem(3) is third and [sets.problem_bytes(i) for i in range(4)] == [0, 1000, 1000, 1000]
    assert built == [workload] and len(made) == 4 and sets.free == 7 << 30  # nothing made again, free not probed
    made_s = sets.build_s
    assert made_s > 0 and sets.problem(2) is not None and sets.build_s == made_s


@pytest.mark.gpu
def test_impls_timed_on_one_workload_share_its_input_sets(monkeypatch):
    """Two impls on one InputSets: the workload is built once, and what a set holds counts its shared problem, which
    stays resident while the second impl is timed."""
    from impls.torch_eager import TorchEager
    device = torch.device("cuda")
    built = _count_builds(monkeypatch)
    workload = Workload.uniform(Mode.DECODE, 1, 1, 64)
    ceilings, sets = timing.measure_ceilings(device), latency.InputSets(workload, device)
    first, second = (latency.time_impl(TorchEager(), workload, device, ceilings, sets) for _ in range(2))
    assert first.status == second.status == "passed", (first.message, second.message)
    count = max(first.metrics["input_sets"], second.metrics["input_sets"])
    assert count > 1 and built == [workload]
    assert all(sets.problem_bytes(i) == sets.problem_bytes(0) > 0 for i in range(count))
    assert second.details["set_bytes"] >= sets.problem_bytes(0)
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
