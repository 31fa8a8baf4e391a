"""Placement and hidden costs: where the cache lives, what the profiler counts, and the suite's rules catching
one planted bug each (on the CPU twins of the counts here; the CUDA parts are marked ``gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from rich.console import Console

from impls.torch_eager import TorchEager, TorchEagerHostCache
from mla_bench.errors import UnsupportedConfig
from mla_bench.hidden_costs import COST_METRICS, _move_target, _non_blocking, count_trace, profile_costs
from mla_bench.problem import build_problem
from mla_bench.registry import Capabilities, ImplEntry, resolve
from mla_bench.results import Result
from mla_bench.workload import Workload
from placement_impls import (SYNCING_BUILDER, UNIQUE_PAGES_BUILDER, AllocatesInRun, CastsCacheIntoDeviceBuffer,
                              CopiesCacheEveryStep, CopiesLengthsToHostInRun, HandsCacheToAsTensor,
                              LastMatmulOnQueryDevice, MirrorsCacheOnce, StaticDecode, SyncsInRun, TolistInRun)
from reports.hidden_costs import hidden_cost_html, hidden_cost_table
from suites import bench_placement
from suites.base import RunContext
from suites.judge import judge
from suites.placement import METADATA_BUILDERS, MetadataBuilder, PlacementSuite, default_workloads, select_workloads

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: the bus, GPU kernels and CUDA syncs")

# A decode whose cache (20 pages of 16 tokens, 368,640 B) dwarfs queries + outputs + metadata (~107 KB), with a
# padding request and a length off a page boundary.
HOST = Workload(mode="decode", q_lens=(1, 1, 1), kv_lens=(200, 0, 77), preset="deepseek-v3-tp8", page_size=16,
                cache_device="cpu")
PLANTED = (SyncsInRun, AllocatesInRun, CopiesCacheEveryStep, TolistInRun, LastMatmulOnQueryDevice,
           CopiesLengthsToHostInRun, HandsCacheToAsTensor, MirrorsCacheOnce, CastsCacheIntoDeviceBuffer)


def entry(cls) -> ImplEntry:
    return ImplEntry(cls.name, f"placement_impls:{cls.__name__}", "path", cls)


def run_suite(impls, device="cpu", workloads=(HOST,), builders=METADATA_BUILDERS) -> list[Result]:
    ctx = RunContext(impls=[entry(c) if isinstance(c, type) else c for c in impls], device=torch.device(device))
    return list(PlacementSuite(list(workloads), builders=builders, reps=1).run(ctx))


def verdicts(results: list[Result]) -> dict[tuple[str | None, str], Result]:
    return {(r.impl, r.check): r for r in results if r.impl is not None}


# ---- where the cache lives --------------------------------------------------------------------------------------
def test_cache_device_unset_leaves_label_json_and_key_unchanged():
    w = Workload.uniform("decode", 2, 1, 64)
    assert "cache_device" not in w.to_dict() and "cache" not in w.label
    moved = w.replace(cache_device="cpu")
    assert moved.label == w.label + " cache-cpu"
    assert moved.to_dict()["cache_device"] == "cpu" and moved.key != w.key
    assert Workload.from_dict(json.loads(json.dumps(moved.to_dict()))) == moved
    assert Workload.from_dict(w.to_dict()) == w


@pytest.mark.parametrize("fields, message", [
    (dict(mode="decode", cache_device="disk"), "cache_device must be None or one of"),
    (dict(mode="prefill", cache_device="cpu"), "only for modes that read the cache"),
])
def test_bad_cache_device_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Workload(q_lens=(1,), kv_lens=(8,), **fields)


def test_cache_device_places_the_cache():
    problem = build_problem(HOST)
    assert problem.cache.data.device.type == "cpu"
    if not CUDA:
        with pytest.raises(ValueError, match="cache on cuda, but CUDA is not available"):
            build_problem(HOST.replace(cache_device="cuda"))


def test_capabilities_declare_placement_and_default_to_the_cache_with_the_queries():
    on_cpu = HOST
    for device in ("cpu", "cuda"):  # refusal reads only the device type: no GPU needed
        assert TorchEager.capabilities.refusal(on_cpu.replace(cache_device=None), device) is None
        assert TorchEagerHostCache.capabilities.refusal(on_cpu, device) is None
    assert TorchEager.capabilities.refusal(on_cpu, "cuda") == "cache on cpu with queries on cuda"
    assert TorchEagerHostCache.capabilities.refusal(on_cpu.replace(cache_device=None), "cuda") == \
        "cache on cuda with queries on cuda"
    assert TorchEagerHostCache.capabilities.placement() == "cache on cpu, attention on cpu"
    assert StaticDecode.capabilities.placement() == "cache with the queries, attention on the device, graph-safe"
    assert resolve("torch_eager_host_cache").load().capabilities.attention_device == "cpu"
    with pytest.raises(ValueError, match="cache_devices"):
        Capabilities(modes=frozenset({"decode"}), cache_devices=frozenset({"tpu"}))
    with pytest.raises(ValueError, match="attention_device"):
        Capabilities(modes=frozenset({"decode"}), attention_device="gpu")


def test_host_cache_baseline_passes_the_judge_and_refuses_what_it_lacks():
    assert judge(TorchEagerHostCache(), build_problem(HOST)).status == "passed"
    with pytest.raises(UnsupportedConfig, match="mode prefill"):
        TorchEagerHostCache().plan(build_problem(Workload.uniform("prefill", 1, 4, 8)))


@pytest.mark.parametrize("bug", [StaticDecode, *PLANTED])
def test_planted_bugs_are_invisible_to_the_accuracy_judge(bug):
    """The placement bugs compute the right answer: only the placement suite can see them."""
    assert judge(bug(), build_problem(HOST)).status == "passed"


# ---- counting ---------------------------------------------------------------------------------------------------
def test_cpu_counts_see_host_reads_plain_copies_and_allocations():
    x = torch.randn(256, 64)
    _, costs = profile_costs(lambda: x.sum().item(), "cpu")
    assert costs.syncs == 1 and costs.sync_events == {"aten::_local_scalar_dense": 1}
    _, costs = profile_costs(lambda: torch.nonzero(x > 0), "cpu")
    assert costs.syncs == 1
    _, costs = profile_costs(lambda: x.clone(), "cpu")
    assert (costs.d2d_copies, costs.d2d_bytes, costs.syncs) == (1, x.nbytes, 0)
    assert costs.allocations == 1 and costs.alloc_bytes == x.nbytes and costs.launches == 1
    _, costs = profile_costs(lambda: x.to(torch.bfloat16), "cpu")  # a conversion is compute, not a copy
    assert costs.d2d_copies == 0 and costs.alloc_bytes == x.nbytes // 2
    out = torch.empty_like(x)
    _, costs = profile_costs(lambda: (torch.mul(x, x, out=out), out.add_(x)), "cpu")
    assert (costs.launches, costs.allocations, costs.syncs, costs.d2d_copies) == (2, 0, 0, 0)


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # torch.tensor(t) and new_tensor(t), on purpose
def test_cpu_counts_see_value_reads_and_device_moves_no_operator_shows():
    x = torch.randint(1, 9, (64,), dtype=torch.int32)
    for read, name in ((x.tolist, "Tensor.tolist"), (x.numpy, "Tensor.numpy"), (lambda: np.asarray(x), "numpy.asarray"),
                       (lambda: torch.unique(x), "aten::_unique2"), (lambda: torch.bincount(x), "aten::bincount")):
        _, costs = profile_costs(read, "cpu")
        assert costs.syncs == 1 and costs.sync_events == {name: 1}, (name, costs.sync_events)
    # a move to a named device counts its bytes (once per tensor and device where it copies nothing here), a copy
    # inside it is not a d2d copy too, and a dtype change alone moves nothing
    _, costs = profile_costs(lambda: (x.to("cpu"), x.cpu(), x.to(torch.device("cpu"), copy=True)), "cpu")
    assert (costs.d2h_copies, costs.d2h_bytes, costs.d2d_copies) == (2, 2 * x.nbytes, 0)
    assert costs.moved_bytes == 2 * x.nbytes and costs.copy_events == {f"d2h {x.nbytes} B (to cpu)": 2}
    assert costs.sync_events == {"blocking copy to the CPU": 3}  # on a GPU the host waits for each
    _, costs = profile_costs(lambda: x.to("cpu", non_blocking=True), "cpu")
    assert costs.d2h_bytes == x.nbytes and costs.syncs == 0
    # a tensor handed to a constructor with a device is moved too (no ``to`` call shows it); list data is not
    for move in (lambda: torch.as_tensor(x, device="cpu"), lambda: torch.asarray(x, device="cpu"),
                 lambda: torch.tensor(x, device="cpu"), lambda: x.new_tensor(x, device="cpu")):
        _, costs = profile_costs(move, "cpu")
        assert costs.d2h_bytes == x.nbytes and costs.copy_events == {f"d2h {x.nbytes} B (to cpu)": 1}
    _, costs = profile_costs(lambda: (torch.as_tensor(x), torch.tensor([1, 2], device="cpu")), "cpu")
    assert costs.moved_bytes == 0
    _, costs = profile_costs(lambda: x.to(torch.float64), "cpu")
    assert costs.moved_bytes == 0 and costs.syncs == 0
    _, costs = profile_costs(lambda: x[:0].to("cpu"), "cpu")  # a move of no bytes is no copy
    assert costs.copy_events == {} and costs.d2h_copies == 0
    assert _move_target(torch.Tensor.to, (0,), {}) == "cuda"  # a bare device index names a GPU


def test_cpu_counts_read_non_blocking_where_each_overload_of_a_move_puts_it():
    """A ``True`` in ``copy``'s place is no ``non_blocking``: the host still waits for that move to the CPU."""
    x = torch.randint(1, 9, (64,), dtype=torch.int32)
    other = torch.empty(0, dtype=x.dtype)  # names the device and dtype only
    moves = {  # the call -> whether the host waits for it
        "to(device, dtype, False, True)": (lambda: x.to("cpu", x.dtype, False, True), True),
        "to(device, dtype, True)": (lambda: x.to("cpu", x.dtype, True), False),
        "to(other, False, True)": (lambda: x.to(other, False, True), True),
        "to(other, True)": (lambda: x.to(other, True), False),
        "to(tensor=other)": (lambda: x.to(tensor=other), True),
        "to(tensor=other, non_blocking=True)": (lambda: x.to(tensor=other, non_blocking=True), False),
        "to(device=, dtype=, non_blocking=False, copy=True)":
            (lambda: x.to(device="cpu", dtype=x.dtype, non_blocking=False, copy=True), True),
    }
    for name, (move, waits) in moves.items():
        _, costs = profile_costs(move, "cpu")
        assert costs.d2h_bytes == x.nbytes, name
        assert costs.sync_events == ({"blocking copy to the CPU": 1} if waits else {}), (name, costs.sync_events)
    _, costs = profile_costs(lambda: (x.to(torch.float64, False, True), x.to(float, True)), "cpu")  # no device
    assert costs.moved_bytes == 0 and costs.syncs == 0
    # the overloads no CPU-only count can show: a dtype first, cuda(device, non_blocking), cpu() (always blocks)
    assert not _non_blocking(torch.Tensor.to, (x, torch.float64, False, True), {})
    assert _non_blocking(torch.Tensor.to, (x, float, True), {})
    assert not _non_blocking(torch.Tensor.to, (x, None, torch.float64, False, True), {})
    assert _non_blocking(torch.Tensor.cuda, (x, 0, True), {}) and not _non_blocking(torch.Tensor.cuda, (x, 0), {})
    assert _non_blocking(torch.Tensor.cuda, (x,), {"non_blocking": True})
    assert not _non_blocking(torch.Tensor.cpu, (x,), {})


def test_a_tensor_moved_to_one_device_blocking_and_not_counts_as_one_copy_and_one_wait():
    """Once per tensor and device in a call: the blocking and the non_blocking move of one tensor counted twice."""
    x = torch.randint(1, 9, (64,), dtype=torch.int32)
    _, costs = profile_costs(lambda: (x.to("cpu"), x.to("cpu", non_blocking=True)), "cpu")
    assert costs.copy_events == {f"d2h {x.nbytes} B (to cpu)": 1}
    assert costs.sync_events == {"blocking copy to the CPU": 1}


def test_profiling_leaves_no_profiler_chatter_on_stderr_unless_the_user_asks_for_it():
    script = ("import torch; from mla_bench.hidden_costs import profile_costs; "
              "profile_costs(lambda: torch.randn(8).sum(), 'cpu'); profile_costs(lambda: torch.randn(8), 'cpu')")

    def stderr_of(**env) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"} | env
        done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, check=True)
        return done.stderr

    chatty = stderr_of(KINETO_LOG_LEVEL="5")  # the user's level wins over ours
    if "USDT" not in chatty:
        pytest.skip(f"this torch ({torch.__version__}) writes no profiler start/stop lines at any level")
    assert "USDT" not in stderr_of()


def test_cuda_trace_counting_reads_kernels_memcpy_bytes_syncs_and_device_allocations():
    """The CUDA branch on a trace in kineto's format: GPU activities all count, host events only in the window."""
    def cpu(cat, name, ts, dur=1.0, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    def memory(ts, nbytes, device_type):
        return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": ts,
                "args": {"Bytes": nbytes, "Device Type": device_type}}

    trace = [
        cpu("user_annotation", "mla_bench::measured", 100.0, 100.0),
        cpu("gpu_user_annotation", "mla_bench::measured", 150.0, 100.0),
        cpu("cuda_runtime", "cudaLaunchKernel", 110.0, correlation=1),
        cpu("cuda_driver", "cuLaunchKernelEx", 115.0, correlation=2),
        cpu("cuda_runtime", "cudaMemcpyAsync", 120.0, correlation=3),
        cpu("cuda_runtime", "cudaStreamSynchronize", 121.0, correlation=4),
        cpu("cuda_runtime", "cudaMemcpyAsync", 130.0, correlation=5),
        cpu("cuda_runtime", "cudaDeviceSynchronize", 250.0, correlation=6),  # the profiler's stop: outside
        cpu("kernel", "attention_kernel", 160.0, correlation=1),
        cpu("kernel", "_triton_decode", 170.0, correlation=2),
        cpu("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 180.0, bytes=4096, correlation=3),
        cpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 190.0, bytes=1 << 20, correlation=5),
        cpu("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 195.0, bytes=512, correlation=5),
        cpu("gpu_memcpy", "Memcpy HtoH (Pinned -> Pageable)", 196.0, bytes=77, correlation=5),  # no GPU memory
        memory(140.0, 2048, 1), memory(141.0, -2048, 1), memory(142.0, 8, 0), memory(300.0, 64, 1),
    ]
    costs = count_trace(trace, cuda=True)
    assert costs.traced == "cuda" and costs.launches == 2
    assert (costs.d2h_copies, costs.d2h_bytes, costs.h2d_copies, costs.h2d_bytes) == (1, 4096, 1, 1 << 20)
    assert (costs.d2d_copies, costs.d2d_bytes) == (1, 512)
    assert costs.syncs == 1 and costs.sync_events == {"cudaStreamSynchronize": 1}
    assert (costs.allocations, costs.alloc_bytes) == (1, 2048)  # device memory only, inside the window
    assert costs.moved_bytes == 4096 + (1 << 20)


# ---- the suite and its rules --------------------------------------------------------------------------------------
def test_clean_impls_pass_every_rule_with_the_full_hidden_cost_row():
    results = run_suite([resolve("torch_eager"), resolve("torch_eager_host_cache"), StaticDecode],
                        workloads=(HOST, HOST.replace(cache_device=None)))
    assert results and all(r.status == "passed" for r in results), [r.message for r in results if not r.ok]
    costs = [r for r in results if r.check == "hidden_cost"]
    assert len(costs) == 6
    for r in costs:
        assert set(r.metrics) == set(COST_METRICS) and r.metrics["launches"] > 0 and r.metrics["run_ms"] > 0
        assert Result.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    checks = {(r.impl, r.check, r.label) for r in results}
    assert ("static_decode", "graph_safe", HOST.label) in checks
    assert ("torch_eager_host_cache", "cache_traffic", HOST.label) in checks
    # torch_eager keeps the cache with the queries: the host-memory traffic rule is not its to keep.
    assert not any(r.impl == "torch_eager" and r.check != "hidden_cost" for r in results)
    assert {r.label.split(" | ")[0] for r in results if r.check == "metadata_sync"} == \
        {"fast.build_step"}


def test_each_planted_bug_is_flagged_by_its_rule_naming_what_was_seen():
    found = verdicts(run_suite(PLANTED, builders=()))
    sync = found[("planted_item_in_run", "graph_safe")]
    assert sync.status == "failed" and "synchronized the host 1x (aten::_local_scalar_dense x1)" in sync.message
    alloc = found[("planted_alloc_in_run", "graph_safe")]
    out_bytes = 3 * 16 * 512 * 2
    assert alloc.status == "failed" and f"allocated 1x ({out_bytes} B)" in alloc.message
    copy = found[("planted_cache_copy", "cache_traffic")]
    cache_bytes = build_problem(HOST).cache.data.nbytes
    assert copy.status == "failed" and copy.metrics["moved_bytes"] >= cache_bytes
    assert f"d2h {cache_bytes} B (to cpu) x1" in copy.message and f"the cache is {cache_bytes} B" in copy.message
    handed = found[("planted_cache_as_tensor", "cache_traffic")]
    assert handed.status == "failed" and f"d2h {cache_bytes} B (to cpu) x1" in handed.message
    mirror = found[("planted_cache_mirror", "cache_traffic")]  # a second step moves nothing: the first one does
    assert mirror.status == "failed" and "B in the first step in explicit moves" in mirror.message
    assert "B per step" not in mirror.message and mirror.metrics["moved_bytes"] >= cache_bytes
    host_copy = found[("planted_cpu_copy_in_run", "graph_safe")]
    assert host_copy.status == "failed" and "(blocking copy to the CPU x1)" in host_copy.message
    # a converting copy_ into a device buffer is compute on the CPU: it shows on a GPU (test below)
    assert found[("planted_cache_cast_copy", "cache_traffic")].status == "passed"
    assert all(r.status == "passed" for r in found.values() if r.check == "hidden_cost")


def test_host_reads_and_moves_that_no_cpu_operator_shows_are_flagged():
    """A ``.tolist()`` in a graph-safe run, a builder sizing its output with ``torch.unique``, and the llama.cpp
    placement (scores on the host, the last matmul on the queries' device) are all caught on the CPU."""
    found = verdicts(run_suite([TolistInRun, LastMatmulOnQueryDevice, resolve("torch_eager_host_cache")],
                               builders=(UNIQUE_PAGES_BUILDER,)))
    sync = found[("planted_tolist_in_run", "graph_safe")]
    assert sync.status == "failed" and "synchronized the host 1x (Tensor.tolist x1)" in sync.message
    matmul = found[("planted_matmul_on_query_device", "cache_traffic")]
    values = (200 + 77) * 512 * 4  # the float32 values of every context token, moved for the last matmul
    assert matmul.status == "failed" and "in explicit moves to a device (CPU twin of bus traffic)" in matmul.message
    assert matmul.metrics["moved_bytes"] >= values > matmul.metrics["budget_bytes"], matmul.metrics
    assert found[("torch_eager_host_cache", "cache_traffic")].status == "passed"  # queries, outputs, lse, table
    (builder,) = [r for r in run_suite([], builders=(UNIQUE_PAGES_BUILDER,)) if r.check == "metadata_sync"]
    assert builder.status == "failed" and "aten::_unique2 x1" in builder.message


def test_a_metadata_builder_that_reads_a_device_value_on_the_host_is_flagged():
    results = run_suite([], builders=METADATA_BUILDERS + (SYNCING_BUILDER,))
    status = {r.label.split(" | ")[0]: r for r in results}
    assert status["planted_max_qo_len_on_device"].status == "failed"
    assert "aten::_local_scalar_dense x1" in status["planted_max_qo_len_on_device"].message
    assert status["fast.build_step"].status == "passed"


def test_refusals_and_crashes_become_results():
    class Crashes(StaticDecode):
        name = "planted_crash"

        def run(self, plan):
            raise RuntimeError("boom")

    class Mumbles(StaticDecode):
        name = "planted_mumble"

        def plan(self, problem):
            raise UnsupportedConfig("")

    workloads = (Workload.uniform("prefill", 1, 4, 8, preset="deepseek-v3-tp8"), HOST)
    found = {(r.impl, r.label): r for r in run_suite([TorchEagerHostCache, Crashes, Mumbles], workloads=workloads,
                                                      builders=())}
    refused = found[("torch_eager_host_cache", workloads[0].label)]
    assert refused.status == "unsupported" and "mode prefill" in refused.message
    crashed = found[("planted_crash", HOST.label)]
    assert crashed.status == "error" and "boom" in crashed.message
    mumbled = found[("planted_mumble", HOST.label)]  # a refusal that says nothing tells the reader nothing
    assert mumbled.status == "error" and "UnsupportedConfig with no reason" in mumbled.message


def test_an_impl_that_writes_into_the_shared_problem_fails_and_the_next_impl_gets_it_intact():
    """The impls of a workload share one problem: before, a plan that resized an input made the next impl error out,
    and nothing named the impl that did it (helper 88)."""
    class ResizesBlockTable(StaticDecode):
        name = "planted_resizes_block_table"

        def plan(self, problem):  # after taking its own slots from it
            plan = super().plan(problem)
            problem.meta.block_table.data = problem.meta.block_table.data[:1].clone()
            return plan

    class ScalesCache(StaticDecode):
        name = "planted_scales_cache"

        def run(self, plan):
            plan.problem.cache.data.mul_(2)
            return super().run(plan)

    class RaisesAfterWriting(StaticDecode):
        name = "planted_raises_after_writing"

        def plan(self, problem):
            problem.q.mul_(3)
            raise RuntimeError("boom")

    found = verdicts(run_suite([ResizesBlockTable, StaticDecode, ScalesCache, RaisesAfterWriting, StaticDecode],
                               builders=()))
    resized = found[("planted_resizes_block_table", "hidden_cost")]
    # its own next plan (the step is measured more than once) reads the table it cut: an error, naming the write
    assert resized.status in ("failed", "error") and "wrote into its inputs: meta.block_table (now" in \
        resized.message, resized.message
    scaled = found[("planted_scales_cache", "hidden_cost")]
    assert scaled.status == "failed" and "cache.data (" in scaled.message, scaled.message
    raised = found[("planted_raises_after_writing", "hidden_cost")]
    assert raised.status == "error" and "boom" in raised.message and "wrote into its inputs: q (" in raised.message
    assert found[("static_decode", "hidden_cost")].status == "passed"  # after each of them, the problem as built
    assert all(r.status == "passed" for (impl, _), r in found.items() if impl == "static_decode")


def test_bad_impls_builders_and_workloads_give_results_or_errors_naming_them():
    class NoCapabilities:  # duck-typed: plans and runs, declares nothing
        name = "planted_no_capabilities"
        plan, run = StaticDecode.plan, StaticDecode.run

    class NowhereCache(StaticDecode):
        name = "planted_cache_nowhere"
        capabilities = Capabilities(modes=frozenset({"decode"}), cache_devices=frozenset())

    def applies_badly(problem):
        raise RuntimeError("applies exploded")

    shaky = MetadataBuilder("planted_shaky_builder", SYNCING_BUILDER.build, applies_badly)
    found = {(r.impl, r.check): r for r in run_suite([ImplEntry("x", "x", "path", NoCapabilities), NowhereCache],
                                                      builders=(shaky,))}
    bare = found[("x", "hidden_cost")]
    assert bare.status == "error" and "declares no Capabilities (its capabilities is NoneType)" in bare.message
    nowhere = found[("planted_cache_nowhere", "hidden_cost")]
    assert nowhere.status == "unsupported" and "cache on cpu with queries on cpu" in nowhere.message
    shaken = found[(None, "metadata_sync")]
    assert shaken.status == "error" and "applies exploded" in shaken.message
    with pytest.raises(ValueError, match="given no workloads"):
        PlacementSuite([])


def test_default_workloads_honour_the_run_filters():
    workloads = default_workloads(torch.device("cpu"))
    assert {w.cache_device for w in workloads if w.mode.value == "decode"} == {None, "cpu"}
    ctx = RunContext(impls=[], device=torch.device("cpu"), modes=["decode"], page_sizes=[32, 64])
    chosen = select_workloads(workloads, ctx)
    assert {w.mode.value for w in chosen} == {"decode"} and {w.page_size for w in chosen} == {32, 64}
    assert len(chosen) == 4


# ---- the table and the benchmark --------------------------------------------------------------------------------
def test_hidden_cost_table_and_html_fragment():
    results = run_suite([resolve("torch_eager_host_cache"), CopiesCacheEveryStep], builders=())
    console = Console(record=True, width=250)
    console.print(hidden_cost_table(results))
    text = console.export_text()
    assert "torch_eager_host_cache" in text and "cache_traffic failed" in text and "cache_traffic passed" in text
    hostile = Result("placement", "hidden_cost", "error", "<script>alert(1)</script>", None, "a & b",
                     message="refused <b>")
    fragment = hidden_cost_html(results + [hostile])
    assert fragment.startswith('<table class="hidden-costs">') and "<script>" not in fragment
    assert "&lt;script&gt;" in fragment and "a &amp; b" in fragment and "planted_cache_copy" in fragment
    assert hidden_cost_html([r for r in results if r.suite != "placement"]) == ""


def test_benchmark_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_placement.main(["--device", "cpu", "--contexts", "64", "--batches", "1,2", "--page-size", "16",
                                 "--reps", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(row["batch"], row["context"]) for row in doc["comparison"]] == [(1, 64), (2, 64)]
    for row in doc["comparison"]:
        assert row["impls"]["torch_eager_host_cache"]["cache"] == "cpu"
        assert row["impls"]["torch_eager"]["cache"] == "device"
    assert all(Result.from_dict(r).ok for r in doc["results"])
    assert "cache on the CPU vs on the device" in capsys.readouterr().out


# ---- on the GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
def test_on_cuda_host_cache_moves_only_queries_and_outputs_and_planted_bugs_are_flagged():
    results = run_suite([resolve("torch_eager"), resolve("torch_eager_host_cache"), StaticDecode, *PLANTED],
                        device="cuda", workloads=(HOST, HOST.replace(cache_device=None)), builders=())
    found = {(r.impl, r.check, r.workload.get("cache_device")): r for r in results}
    host = found[("torch_eager_host_cache", "hidden_cost", "cpu")]
    budget = found[("torch_eager_host_cache", "cache_traffic", "cpu")]
    assert budget.status == "passed", budget.message
    assert 0 < host.metrics["h2d_bytes"] + host.metrics["d2h_bytes"] <= budget.metrics["budget_bytes"]
    attention = found[("torch_eager_host_cache", "attention_device", "cpu")]
    assert attention.status == "passed", attention.message
    assert found[("torch_eager", "hidden_cost", "cpu")].status == "unsupported"  # cache on cpu, queries on cuda
    assert found[("torch_eager", "hidden_cost", None)].metrics["h2d_bytes"] == 0
    clean = found[("static_decode", "graph_safe", None)]
    assert clean.status == "passed", clean.message
    for bug in ("planted_cache_copy", "planted_cache_as_tensor", "planted_cache_mirror", "planted_cache_cast_copy"):
        copy = found[(bug, "cache_traffic", "cpu")]
        assert copy.status == "failed" and copy.metrics["moved_bytes"] >= copy.metrics["cache_bytes"], copy.metrics
        assert "over the bus" in copy.message, copy.message
    for bug in ("planted_item_in_run", "planted_alloc_in_run", "planted_tolist_in_run", "planted_cpu_copy_in_run"):
        assert found[(bug, "graph_safe", None)].status == "failed", found[(bug, "hidden_cost", None)].metrics
    assert "cudaStreamSynchronize" in found[("planted_item_in_run", "graph_safe", None)].message
    matmul = found[("planted_matmul_on_query_device", "cache_traffic", "cpu")]
    assert matmul.status == "failed" and "over the bus" in matmul.message, matmul.metrics
    wrong_device = found[("planted_matmul_on_query_device", "attention_device", "cpu")]
    assert wrong_device.status == "failed" and "attention is declared on the CPU" in wrong_device.message


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_host_cache_copies_the_block_table_over_once():
    """Page 1 and one long request among short ones: the block table is as large as the queries and outputs together,
    so a second host copy of it (one to check, one for the slots) exceeds the budget, which counts it once."""
    skewed = HOST.replace(q_lens=(1,) * 32, kv_lens=(8192,) + (1,) * 31, page_size=1)
    results = run_suite([resolve("torch_eager_host_cache")], device="cuda", workloads=(skewed,), builders=())
    budget = verdicts(results)[("torch_eager_host_cache", "cache_traffic")]
    assert budget.status == "passed", budget.message
    table = 32 * (8192 + 1) * 4  # 8192 pages and the spare column: it crossed once, and nothing more than the budget
    assert budget.metrics["budget_bytes"] - table < budget.metrics["moved_bytes"] <= budget.metrics["budget_bytes"]


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_a_metadata_builder_that_syncs_is_flagged():
    results = run_suite([], device="cuda", workloads=(HOST.replace(cache_device=None),),
                        builders=METADATA_BUILDERS + (SYNCING_BUILDER, UNIQUE_PAGES_BUILDER))
    status = {r.label.split(" | ")[0]: r for r in results}
    for planted in ("planted_max_qo_len_on_device", "planted_distinct_pages_on_device"):
        assert status[planted].status == "failed", status[planted].metrics
    assert all(status[b.name].status == "passed" for b in METADATA_BUILDERS if b.name in status), \
        [r.message for r in results if not r.ok]
