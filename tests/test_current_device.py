"""Triton compiles for and launches on the current CUDA device, whatever device its tensors are on: a problem on
cuda:1 while cuda:0 is current ran cuda:0's kernels over cuda:1's memory (an illegal address, or slow peer reads).
Every public function of ``impls/triton`` that launches a kernel makes its tensors' device current around the
launch (``common.on_device``), so an impl called directly, outside the CLI that makes ``--device`` current, is right.

On the CPU: the helper enters ``torch.cuda.device`` for an indexed CUDA device only, and every kernel launch of each
entry point (the interpreter's, recorded instead of run) happens inside the guard with its problem's device. With two
GPUs: problems on cuda:1 pass the judge while cuda:0 is current.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from impls.triton import common
from impls.triton.cache_ops import gather_cache_triton, write_cache_triton
from impls.triton.chunked import TritonChunkedPrefill
from impls.triton.decode import DecodeConfig, TritonDecode
from impls.triton.kv_indices import kv_indices_triton
from impls.triton.merge import merge_attn_states, rescale_partial
from impls.triton.prefill import TritonPrefill
from impls.triton.sparse import TritonSparse, TritonSparseRagged
from mla_bench.layouts import LATENT_DIM
from mla_bench.problem import build_problem
from mla_bench.registry import resolve
from mla_bench.workload import Mode, Workload
from suites.judge import judge

DECODE = Workload(mode="decode", q_lens=(1, 2), kv_lens=(70, 9), page_size=16)
PREFILL = Workload(mode="prefill", q_lens=(5, 3), kv_lens=(5, 3))
CHUNKED = Workload(mode="chunked_prefill", q_lens=(3, 2), kv_lens=(40, 9), page_size=16, chunk_size=16)


def sparse(transform: str) -> Workload:
    return Workload(mode="sparse_decode", q_lens=(1, 1), kv_lens=(70, 33), page_size=16, topk=32,
                    index_transform=transform)


def test_the_guard_makes_an_indexed_cuda_device_current_and_leaves_the_rest_alone(monkeypatch):
    """``torch.cuda.device`` (host-side: no synchronization, no allocation) for ``cuda:N``; nothing for the CPU or
    for ``cuda`` without an index, which is the current device already."""
    guard = common.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1  # the real one, not entered: no GPU here
    events = []

    @contextlib.contextmanager
    def device(which):
        events.append(("enter", which))
        yield
        events.append(("exit", which))

    monkeypatch.setattr(torch.cuda, "device", device)
    with common.on_device(torch.device("cuda:1")):
        assert events == [("enter", torch.device("cuda:1"))]
    assert events == [("enter", torch.device("cuda:1")), ("exit", torch.device("cuda:1"))]
    for other in (torch.device("cpu"), torch.device("cuda")):
        with common.on_device(other):
            pass
    assert len(events) == 2


@pytest.fixture
def watch(monkeypatch):
    """Records each guard entered (``entered``: its device) and each interpreted kernel launch (``launches``: the
    kernel's name and the device the innermost guard made current, None outside any); launches are recorded, not run
    (what they compute is tested elsewhere)."""
    current, seen = [], types.SimpleNamespace(entered=[], launches=[])

    @contextlib.contextmanager
    def on_device(device):
        seen.entered.append(device)
        current.append(device)
        try:
            yield
        finally:
            current.pop()

    def launch(self, *args, grid, warmup, **kwargs):
        seen.launches.append((self.__name__, current[-1] if current else None))

    monkeypatch.setattr(common, "on_device", on_device, raising=False)  # raising=False: absent before the guard
    monkeypatch.setattr(InterpretedFunction, "run", launch)
    return seen


def _run_impl(impl, workload: Workload):
    def run(watch):
        problem = build_problem(workload)
        plan = impl.plan(problem)
        impl.run(plan)
        return problem.device
    return run


def _decode_plan_and_run(watch):
    """Split in two, so that the merge kernel runs too; plan enters the guard (on a GPU it may compile the split
    kernel and ask the driver about it: ``_prepare_clusters``)."""
    impl = TritonDecode()
    impl.config = DecodeConfig(block_m=16, block_n=16, num_splits=2)
    problem = build_problem(DECODE)
    plan = impl.plan(problem)
    assert watch.entered == [problem.device] and not watch.launches
    impl.run(plan)
    return problem.device


def _cache_ops(watch):
    cache = build_problem(DECODE).cache
    slots = torch.tensor([0, 5, 17])
    write_cache_triton(cache, torch.randn(3, LATENT_DIM), slots)
    gather_cache_triton(cache, slots)
    return cache.data.device


def _kv_indices(watch):
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    kv_indices_triton(torch.tensor([0, 2, 3], dtype=torch.int32), table, 3)
    return table.device


def _merges(watch):
    parts = [(torch.randn(3, 4, 512), torch.randn(3, 4)) for _ in range(2)]
    merge_attn_states(*parts[0], *parts[1])
    rescale_partial(parts[0][0], torch.stack([lse for _, lse in parts]), rank=1)
    return parts[0][0].device


ENTRY_POINTS = {
    "triton_decode": (_decode_plan_and_run, {"_decode_split_kernel", "_merge_splits_kernel"}),
    "triton_prefill": (_run_impl(TritonPrefill(), PREFILL), {"_prefill_kernel"}),
    "triton_chunked_prefill": (_run_impl(TritonChunkedPrefill(), CHUNKED),
                               {"_gather_kernel", "_prefill_kernel", "_merge_kernel"}),
    "triton_sparse": (_run_impl(TritonSparse(), sparse("paged")), {"_sparse_kernel"}),
    "triton_sparse_ragged": (_run_impl(TritonSparseRagged(), sparse("ragged")), {"_sparse_kernel"}),
    "cache_ops": (_cache_ops, {"write_bf16_kernel", "gather_bf16_kernel"}),
    "kv_indices": (_kv_indices, {"_kv_indices_kernel"}),
    "merge": (_merges, {"_merge_kernel", "_rescale_kernel"}),
}


@pytest.mark.skipif(not common.INTERPRETING, reason="records launches through Triton's interpreter (a CPU-only "
                    "session); the two-GPU test below covers a GPU host")
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_kernel_launch_runs_with_its_tensors_device_made_current(entry, watch):
    """Each launch of each entry point (the impls' plan and run, the public cache, index and merge functions)
    happens inside ``common.on_device`` with the problem's device."""
    call, kernels = ENTRY_POINTS[entry]
    device = call(watch)
    assert {name for name, _ in watch.launches} == kernels
    outside = [name for name, guarded in watch.launches if guarded != device]
    assert not outside, f"launched without {device} made current: {outside}"


# ---- on two GPUs --------------------------------------------------------------------------------------------------

GPU_CASES = {
    "triton_decode": DECODE,
    # the default plan on Hopper: Gluon split kernels in clusters, compiled in plan (_prepare_clusters)
    "triton_decode-b32-ctx4096": Workload.uniform(Mode.DECODE, 32, 1, 4096, preset="deepseek-v3-tp8",
                                                  layout="fp8_ds_mla", page_size=64),
    "triton_prefill": PREFILL,
    "triton_chunked_prefill": CHUNKED,
    "triton_sparse": sparse("paged"),
    "triton_sparse_ragged": sparse("ragged"),
}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: a problem on cuda:1 while cuda:0 "
                                                           "is current")
@pytest.mark.parametrize("case", GPU_CASES)
def test_a_problem_on_the_second_gpu_passes_while_the_first_is_current(case):
    """Before the guard these launched on cuda:0 over cuda:1's memory; the current device is left as it was."""
    with torch.cuda.device(0):
        problem = build_problem(GPU_CASES[case], torch.device("cuda", 1))
        verdict = judge(resolve(case.split("-")[0]).load(), problem)
        assert torch.cuda.current_device() == 0
    assert verdict.status == "passed", verdict.violations or verdict.message
