"""What a measurement is held against: the latency suite's input sets against the free device memory (by what a
set holds, not by what a launch reads; the sets of a workload built once, shared by its impls), and a DCP row of W
ranks against W GPUs' ceilings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_bench import timing
from mla_bench.costs import cost
from mla_bench.problem import Problem, build_problem
from mla_bench.registry import Capabilities, Impl
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


def _tensors(value, name: str = "problem") -> dict[str, torch.Tensor]:
    """Every tensor ``value`` holds, through dataclass fields, lists, tuples and dicts, by a name saying where (a
    field added to Problem, PagedMetadata or PagedCache is walked too)."""
    if isinstance(value, torch.Tensor):
        return {name: value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", item) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        items = [(f"[{key!r}]", item) for key, item in value.items()]
    else:
        return {}
    return {path: tensor for suffix, item in items for path, tensor in _tensors(item, name + suffix).items()}


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
    storages = [{t.untyped_storage().data_ptr() for t in group.values()} for group in (tensors, copies)]
    assert not storages[0] & storages[1]  # no copied tensor shares an original's storage, whichever field
    assert copied.workload == workload and copied.scale == problem.scale and copied.meta.kv_lens == problem.meta.kv_lens
    if problem.cache is not None:
        assert copied.cache.layout is problem.cache.layout and copied.cache.tensor_scale == problem.cache.tensor_scale


def test_the_input_sets_of_a_workload_are_made_once_in_order_when_first_asked_for(monkeypatch):
    """The latency run built every set again for every impl (821 sets where 398 would do on the H100 baseline), each
    from its own seed: 0.9-9.9 s a set on the H100 machine's host. Set 0 is built from the workload, the others
    copied from it; asking again, for a set or one before it, makes nothing. A build reads as 5000 bytes, a copy as
    1000: each set's bytes are what making it allocated, in its own place."""
    built, frees = _count_builds(monkeypatch), iter([7 << 30, 1 << 30])
    workload = Workload.uniform(Mode.DECODE, 1, 1, 64, seed=11)
    copied = []
    sets = latency.InputSets(workload, torch.device("cpu"), free_bytes=lambda device: next(frees),
                             allocated=lambda device: 5000 * len(built) + 1000 * len(copied))
    assert built == [] and sets.free == 7 << 30  # probed when made, before any set
    real_copy = Problem.copy
    monkeypatch.setattr(Problem, "copy", lambda self: copied.append(self) or real_copy(self))
    third = sets.problem(3)
    first = sets.problem(0)
    assert built == [workload] and len(copied) == 3 and all(source is first for source in copied)
    assert third is not first and torch.equal(third.q, first.q) and third.q.data_ptr() != first.q.data_ptr()
    assert sets.problem(3) is third and [sets.problem_bytes(i) for i in range(4)] == [5000, 1000, 1000, 1000]
    assert built == [workload] and len(copied) == 3 and sets.free == 7 << 30  # nothing made again, free not probed
    made_s = sets.build_s
    assert made_s > 0 and sets.problem(2) is not None and sets.build_s == made_s


class _Planned(Impl):
    """A CPU impl for ``time_impl`` without a GPU: its plan 'allocates' ``plan_bytes`` (appended to ``ledger``, which
    the test's ``allocated`` sums), records the problem it was given, and raises on the set numbered ``fail_at``."""
    name = "planned"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), devices=frozenset({"cpu"}))

    def __init__(self, ledger: list[int], plan_bytes: int, fail_at: int | None = None) -> None:
        self.ledger, self.plan_bytes, self.fail_at, self.problems = ledger, plan_bytes, fail_at, []

    def plan(self, problem):
        if len(self.problems) == self.fail_at:
            raise RuntimeError("planted: plan fails")
        self.problems.append(problem)
        self.ledger.append(self.plan_bytes)
        return problem

    def run(self, plan):
        return plan.q, plan.q


def test_impls_timed_on_one_workload_share_its_sets_and_budget_by_what_they_hold(monkeypatch):
    """``time_impl`` on a CPU (the timers stubbed): a second impl, and one after an impl that failed in its plan,
    makes no set the first made; each impl rotates over distinct problems at distinct addresses, the shared ones;
    ``set_bytes`` is the shared problem's bytes plus the impl's own plan, and the count stops at what fits in
    MEMORY_FRACTION of the memory free before the sets (10,000 bytes: 3 sets of a 1000-byte problem, 1 of a problem
    and a 2000-byte plan); ``build_s`` goes to the impl that made the sets, the failed one's row too."""
    built, copied, plans = _count_builds(monkeypatch), [], []
    real_copy = Problem.copy
    monkeypatch.setattr(Problem, "copy", lambda self: copied.append(1) or real_copy(self))
    monkeypatch.setattr(timing, "time_host", lambda fn, device: fn() or 0.5)
    monkeypatch.setattr(timing, "time_rotation",
                        lambda fns, device, **kw: [fn() for fn in fns] and timing.TimingStats.of([0.01] * len(fns)))
    device, workload = torch.device("cpu"), Workload.uniform(Mode.DECODE, 1, 1, 64)
    sets = latency.InputSets(workload, device, free_bytes=lambda device: 10_000,
                             allocated=lambda device: 1000 * (len(built) + len(copied)) + sum(plans))
    work = cost(workload)
    ceilings = timing.Ceilings("cpu", copy_gbps=1.0, matmul_tflops=1.0, l2_bytes=work.bytes)  # 4 sets for a cold L2
    failing, small, large = _Planned(plans, 0, fail_at=2), _Planned(plans, 0), _Planned(plans, 2000)
    failed = latency.time_impl(failing, workload, device, ceilings, sets)
    assert failed.status == "error" and "planted" in failed.message and (len(built), len(copied)) == (1, 2)
    assert 0 < failed.details["build_s"] <= failed.details["wall_s"]  # the sets it made are on its row
    first = latency.time_impl(small, workload, device, ceilings, sets)
    plans.clear()  # the plans of an impl are dropped once it is timed
    second = latency.time_impl(large, workload, device, ceilings, sets)
    assert first.status == second.status == "passed", (first.message, second.message)
    assert built == [workload] and len(copied) == 2  # the failed impl's sets served both
    assert first.metrics["input_sets"] == 3 and first.details["set_bytes"] == 1000 and not first.details["cold_l2"]
    assert second.metrics["input_sets"] == 1 and second.details["set_bytes"] == 3000
    assert first.details["build_s"] == second.details["build_s"] == 0.0
    assert 0 <= first.details["build_s"] <= first.details["wall_s"]
    assert [id(p) for p in small.problems] == [id(sets.problem(i)) for i in range(3)]
    assert len({p.cache.data.data_ptr() for p in small.problems}) == 3 and large.problems[0] is small.problems[0]


class _Writes(_Planned):
    """A ``_Planned`` impl that writes into its inputs in ``run``, by ``write(problem)``."""
    name = "writes"

    def __init__(self, ledger: list[int], write) -> None:
        super().__init__(ledger, 0)
        self.write = write

    def run(self, plan):
        self.write(plan)
        return super().run(plan)


def _timed_on_the_cpu(monkeypatch):
    """``(device, workload, sets, ceilings)`` for ``time_impl`` on the CPU, its timers calling each launch once."""
    monkeypatch.setattr(timing, "time_host", lambda fn, device: fn() or 0.5)
    monkeypatch.setattr(timing, "time_rotation",
                        lambda fns, device, **kw: [fn() for fn in fns] and timing.TimingStats.of([0.01] * len(fns)))
    device, workload = torch.device("cpu"), Workload.uniform(Mode.DECODE, 1, 1, 64)
    sets = latency.InputSets(workload, device, free_bytes=lambda device: 10 ** 9, allocated=lambda device: 0)
    return device, workload, sets, timing.Ceilings("cpu", copy_gbps=1.0, matmul_tflops=1.0, l2_bytes=1)


def _raise(exc: BaseException):
    raise exc


@pytest.mark.parametrize("exc", [SystemExit(0), GeneratorExit("closed")])
def test_an_impl_that_exits_while_timed_is_an_error_row_and_the_next_impl_is_timed(monkeypatch, exc):
    """sys.exit (or GeneratorExit) in an impl's run ended the suite and the run: neither is an Exception."""
    device, workload, sets, ceilings = _timed_on_the_cpu(monkeypatch)
    exits = latency.time_impl(_Writes([], lambda p: _raise(exc)), workload, device, ceilings, sets)
    assert exits.status == "error" and type(exc).__name__ in exits.message, exits.message
    assert latency.time_impl(_Planned([], 0), workload, device, ceilings, sets).status == "passed"


def test_an_impl_that_changes_the_processs_settings_fails_and_they_are_put_back(monkeypatch):
    device, workload, sets, ceilings = _timed_on_the_cpu(monkeypatch)
    row = latency.time_impl(_Writes([], lambda p: torch.set_default_device("meta")), workload, device, ceilings, sets)
    assert row.status == "failed" and "changed the process's settings: torch's default device (now meta, was cpu)" \
        in row.message, row.message
    assert torch.get_default_device() == torch.device("cpu")
    assert latency.time_impl(_Planned([], 0), workload, device, ceilings, sets).status == "passed"


@pytest.mark.parametrize("write, says", [
    (lambda p: p.cache.data.view(torch.uint8)[0].add_(1), "cache.data (changed)"),
    (lambda p: p.q.mul_(2), "q (changed)"),
    (lambda p: setattr(p.meta, "kv_lens", [1]), "meta.kv_lens (changed)"),
    (lambda p: p.meta.block_table.resize_(1, 1), "meta.block_table (changed)"),
    (lambda p: object.__setattr__(p.workload, "kv_lens", (2,)), "workload.kv_lens (changed)"),
])
def test_an_impl_that_writes_into_the_shared_sets_fails_and_the_next_impl_gets_new_ones(monkeypatch, write, says):
    """The impls of a workload time one set of problems, made once; an impl that writes into one (a byte of the
    cache, a field rebound, a tensor resized) fails naming it, and the next impl is timed on sets made again."""
    built, plans = _count_builds(monkeypatch), []
    device, workload, sets, ceilings = _timed_on_the_cpu(monkeypatch)
    writer, clean = _Writes(plans, write), _Planned(plans, 0)
    wrote = latency.time_impl(writer, workload, device, ceilings, sets)
    assert wrote.status == "failed" and "wrote into its inputs: set 0: " in wrote.message and says in wrote.message
    assert wrote.message.endswith("(the sets are made again for the next impl)"), wrote.message
    after = latency.time_impl(clean, workload, device, ceilings, sets)
    assert after.status == "passed" and len(built) == 2  # made again from the workload, as the first were
    assert clean.problems[0] is not writer.problems[0] and torch.equal(clean.problems[0].q, build_problem(
        workload, device).q)
    assert workload.kv_lens == clean.problems[0].workload.kv_lens == (64,)  # sets are made from the workload as given


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
