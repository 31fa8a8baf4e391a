"""The decode's split kernel launched as a programmatic dependent of the stream's previous kernel
(``DecodeConfig.overlap_launch``, Hopper): its programs start while that kernel still runs, so each split kernel must
read nothing but the plan's work rows before its wait (``WAIT_PRIOR``), but for the hint that asks L2 for its first
keys (``KEYS_AHEAD``, the bf16 kernels), whose block-table entry may be stale.

The proof is a previous kernel that lets its dependents start at once and writes the queries (or the block table)
only 50 us later: every split kernel's output must be the one of the new contents, bit for bit. A planted launch that
skips the wait reads the old ones, and the same check must catch it. Both kernels are queued behind a sleeping one,
so that the host's launch time cannot order them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from impls.triton import common, decode
from impls.triton.decode import DecodeConfig, TritonDecode
from mla_bench.problem import build_problem
from test_triton_decode import SINGLE, VARLEN, Configured, _fp8_mma, _narrow, _quantized_wgmma, _ws, workload

pytestmark = [pytest.mark.conformance, pytest.mark.decode, pytest.mark.gpu]

LATE_NS = 50_000  # how long the previous kernel runs after releasing its dependents: many times a decode's start
QUEUE_CYCLES = 20_000_000  # a sleep (~10 ms) while the host queues both kernels


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _late_copy_kernel(src, dst, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr):
    """Let the stream's next kernel start now, then copy ``src`` to ``dst`` after ``DELAY_NS``."""
    gdc_launch_dependents()
    start = _now()
    now = start
    while now - start < DELAY_NS:
        now = _now()
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + at, tl.load(src + at, mask=at < n), mask=at < n)


def _late_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    n = src.numel()
    _late_copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, DELAY_NS=LATE_NS, BLOCK=1024)


def _decode_after_a_late_write(impl: TritonDecode, problem, written: str = "queries") -> None:
    """Run ``impl`` right after a kernel that writes new ``written`` late (queries: fresh ones; the block table: each
    request's row moved to the next request, whose lengths must be the same), and compare with an eager run on
    them."""
    plan = impl.plan(problem)
    assert plan.overlap_launch, "the plan does not launch its split kernel as a programmatic dependent"
    target = plan.q if written == "queries" else plan.block_table
    old = target.clone()
    new = torch.randn_like(old) * 0.5 if written == "queries" else old.roll(1, dims=0)
    target.copy_(new)
    want = [t.clone() for t in impl.run(plan)]
    target.copy_(old)
    torch.cuda.synchronize()
    impl.poison(plan)
    torch.cuda._sleep(QUEUE_CYCLES)
    _late_copy(new, target)
    out, lse = impl.run(plan)
    torch.cuda.synchronize()
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), f"the decode read {written} from before the wait"


KERNEL_CASES = [  # (config, layout, page size, heads, forced splits): each split kernel once, most with a merge
    (DecodeConfig(block_m=16, block_n=64, num_stages=3, early_merge=True), "bf16", 64, 16, 2),  # the Triton kernel
    (_ws(), "fp8_ds_mla", 64, 16, 3),                # decode_rs_fp8 (TMA loader)
    (_ws(), "nvfp4", 64, 16, None),                  # decode_rs_fp8, stored directly
    (_ws(), "fp4_mx16", 64, 16, 2),                  # decode_ws
    (_narrow(16), "bf16", 1, 16, 2),                 # decode_wgmma_narrow
    (_quantized_wgmma(64), "fp8_e4m3", 64, 64, 2),   # decode_wgmma_quantized
    (_fp8_mma(), "fp8_ds_mla", 64, 16, 2),           # decode_mma_fp8
    (_quantized_wgmma(16), "fp8_ds_mla", 16, 16, 2),  # decode_wgmma_fp8 (8 warps)
    (DecodeConfig(block_m=64, block_n=64, num_warps=8, gluon=True), "bf16", 64, 128, 2),  # decode_wgmma_ws
    (DecodeConfig(block_m=64, block_n=64, num_warps=8, gluon=True, tma_loader=False), "bf16", 16, 128, 2),  # wgmma
]


def _needs_hopper() -> torch.device:
    device = torch.device("cuda")
    if not torch.cuda.is_available() or not common.has_wgmma(device):
        pytest.skip("needs a Hopper GPU (programmatic dependent launch and the Gluon kernels)")
    return device


@pytest.mark.parametrize("config, layout, page_size, heads, splits", KERNEL_CASES,
                         ids=["triton", "rs-fp8", "rs-nvfp4", "ws-mx16", "narrow-ps1", "quantized64", "mma-fp8",
                              "wgmma-fp8", "wgmma-ws", "wgmma"])
def test_every_split_kernel_waits_for_the_queries_of_the_kernel_before_it(config, layout, page_size, heads, splits):
    device = _needs_hopper()
    problem = build_problem(workload(layout, page_size, VARLEN, heads=heads, seed=page_size + heads), device)
    _decode_after_a_late_write(Configured(dataclasses.replace(config, num_splits=splits)), problem)


SAME_LENGTHS = ((1, 1, 1, 1), (150, 150, 150, 150))  # rows of the block table that can trade places
AHEAD_CASES = [KERNEL_CASES[0], KERNEL_CASES[4], (_narrow(16), "bf16", 64, 16, 2), *KERNEL_CASES[8:]]


@pytest.mark.parametrize("config, layout, page_size, heads, splits", AHEAD_CASES,
                         ids=["triton", "narrow-ps1", "narrow-ps64", "wgmma-ws", "wgmma"])
def test_the_kernels_that_ask_l2_ahead_read_the_block_table_written_before_them(config, layout, page_size, heads,
                                                                               splits):
    device = _needs_hopper()
    assert decode.FIRST_KEYS_AHEAD > 0
    problem = build_problem(workload(layout, page_size, SAME_LENGTHS, heads=heads, seed=7), device)
    _decode_after_a_late_write(Configured(dataclasses.replace(config, num_splits=splits)), problem, "block table")


class _SkipsTheWait:
    """Planted bug: the split kernel launched as a programmatic dependent without its wait."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**kwargs, "WAIT_PRIOR": False})


@pytest.mark.parametrize("kernel, layout, written", [("_decode_split_kernel", "bf16", "queries"),
                                                     ("_decode_split_kernel_rs_fp8", "fp8_ds_mla", "queries"),
                                                     ("_decode_split_kernel", "bf16", "block table")],
                         ids=["triton", "rs-fp8", "triton-table"])
def test_a_split_kernel_that_skips_its_wait_reads_the_old_contents_and_is_caught(monkeypatch, kernel, layout,
                                                                                 written):
    device = _needs_hopper()
    monkeypatch.setattr(decode, kernel, _SkipsTheWait(getattr(decode, kernel)))
    mix = SINGLE if written == "queries" else SAME_LENGTHS
    problem = build_problem(workload(layout, 64, mix, heads=16, seed=5), device)
    impl = TritonDecode() if layout == "bf16" else Configured(_ws())
    with pytest.raises(AssertionError, match=f"read {written} from before the wait"):
        _decode_after_a_late_write(impl, problem, written)
