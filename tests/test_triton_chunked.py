"""triton_chunked_prefill against the float64 reference; its workspace stays bounded by MCC.

Planted bug: an impl that drops the last context chunk must fail the judge.
"""

from __future__ import annotations

import math

import pytest
import torch

import impls.triton  # noqa: F401
from impls.triton import cache_ops
from impls.triton.chunked import TritonChunkedPrefill, context_lens, context_segments
from mla_bench.problem import build_problem
from mla_bench.registry import resolve
from mla_bench.workload import Workload
from suites.judge import judge

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, compiled kernels on a GPU

Q_LENS, KV_LENS = (5, 9, 0, 3), (40, 9, 13, 27)  # a request without context, one without queries


def chunked(mcc, layout="bf16", q_lens=Q_LENS, kv_lens=KV_LENS, **kw):
    return Workload(mode="chunked_prefill", q_lens=q_lens, kv_lens=kv_lens, page_size=8, chunk_size=mcc,
                    layout=layout, **kw)


@pytest.mark.parametrize("mcc", [1, 7, 9, 200])  # one token, a page -1 / +1 (chunks start mid-page), everything
def test_chunked_prefill_passes_the_judge_for_every_mcc(mcc):
    lens = dict(q_lens=(3, 0, 2), kv_lens=(9, 4, 5)) if mcc == 1 else {}  # one-token chunks: keep them few
    problem = build_problem(chunked(mcc, seed=mcc, **lens), DEVICE)
    verdict = judge(resolve("triton_chunked_prefill").load(), problem)
    assert verdict.status == "passed", verdict.violations or verdict.message


@pytest.mark.parametrize("layout, dtype", [("fp8_ds_mla", "bfloat16"), ("fp8_e4m3", "bfloat16"),
                                           ("fp8_ds_mla_pow2", "bfloat16"), ("bf16", "float16")])
def test_chunked_prefill_dequantizes_fp8_caches(layout, dtype):
    verdict = judge(TritonChunkedPrefill(), build_problem(chunked(12, layout, dtype=dtype), DEVICE))
    assert verdict.status == "passed", verdict.violations or verdict.message


def test_fp4_caches_are_refused_until_their_gather_exists():
    verdict = judge(TritonChunkedPrefill(), build_problem(chunked(12, "nvfp4"), DEVICE))
    assert verdict.status == "unsupported" and "nvfp4" in verdict.message


class DropsTheLastChunk(TritonChunkedPrefill):
    """Planted bug: the last context chunk is never attended."""

    def plan(self, problem):
        plan = super().plan(problem)
        plan.chunks = plan.chunks[:-1]
        return plan


def test_dropping_the_last_chunk_fails_the_judge():
    verdict = judge(DropsTheLastChunk(), build_problem(chunked(16), DEVICE))
    assert verdict.status == "failed", verdict.message


@pytest.mark.parametrize("mcc", [1, 5, 16, 64, 1000])
def test_chunks_cover_the_context_once_in_order_within_the_workspace(mcc):
    plan = TritonChunkedPrefill().plan(build_problem(chunked(mcc), DEVICE))
    ctx = context_lens(Q_LENS, KV_LENS)
    assert ctx == [35, 0, 0, 24]  # request 2 has no queries: its context is never read
    assert len(plan.chunks) == math.ceil(sum(ctx) / mcc)
    assert all(c.num_tokens <= mcc for c in plan.chunks)
    assert plan.workspace.rows == min(mcc, sum(ctx)) == plan.workspace.latent.shape[0]
    pieces = [piece for chunk in context_segments(ctx, mcc) for piece in chunk]
    covered = [(b, p) for b, start, end in pieces for p in range(start, end)]
    assert covered == [(b, p) for b, n in enumerate(ctx) for p in range(n)]


def test_workspace_depends_on_mcc_not_on_the_context_length():
    heads, mcc = 4, 16
    short = TritonChunkedPrefill().plan(build_problem(chunked(mcc, q_lens=(5, 3), kv_lens=(40, 30)), DEVICE))
    long = TritonChunkedPrefill().plan(build_problem(chunked(mcc, q_lens=(5, 3), kv_lens=(400, 300)), DEVICE))
    tokens = 8
    expect = mcc * (576 + heads * 256) * 2 + 2 * tokens * heads * (128 + 1) * 4
    assert short.workspace_bytes == long.workspace_bytes == expect
    assert len(long.chunks) == math.ceil((395 + 297) / mcc) > len(short.chunks)


def _slot_set(p, index, slot):
    slots = p.meta.token_slots.clone()
    slots[index] = slot
    p.meta.token_slots = slots


def _new_keys_short(p):
    p.k_nope, p.k_pe, p.v = p.k_nope[:-1], p.k_pe[:-1], p.v[:-1]


PLAN_REFUSALS = {  # what run() read wrongly or failed on halfway, each refused by plan now
    "slot past the cache": (lambda p: _slot_set(p, 0, p.cache.num_slots + 5), r"must lie in the cache's \[0, 56\)"),
    "negative slot": (lambda p: _slot_set(p, 0, -1), r"must lie in the cache's \[0, 56\), got \[-1,"),  # zeros
    "token_slots short": (lambda p: setattr(p.meta, "token_slots", p.meta.token_slots[:-3]), r"token_slots .*\[29\]"),
    "nan scale": (lambda p: setattr(p, "scale", float("nan")), "softmax scale"),  # out 0 with lse NaN
    "int64 offsets": (lambda p: setattr(p.meta, "query_start_loc", p.meta.query_start_loc.long()), "int32"),
    "short new keys": (_new_keys_short, "k_nope has 4 rows but the lengths give 5"),
    "one head's w_uk": (lambda p: setattr(p, "w_uk", p.w_uk[:1]), r"w_uk must be \[4, 512, 128\], got \[1,"),
    "query offsets past q": (lambda p: setattr(p.meta, "query_start_loc",  # heap corruption in the suffix's run
                                               torch.tensor([0, 3, 9], dtype=torch.int32, device=DEVICE)),
                             r"query_start_loc must hold the lengths' 3 offsets: entry 2 is \[9\], .* give \[5\]"),
    # another device than the problem's, where the gather kernel runs
    "token_slots elsewhere": (lambda p: setattr(p.meta, "token_slots", p.meta.token_slots.to("meta")),
                              r"token_slots is on meta but the problem is on (cpu|cuda)"),
    "cache elsewhere": (lambda p: setattr(p, "cache", p.cache.to("meta")),
                        r"cache is on meta but the problem is on (cpu|cuda)"),
}


@pytest.mark.parametrize("case", PLAN_REFUSALS)
def test_chunked_plan_refuses_what_its_run_would_read_wrongly(case):
    """A slot outside the cache was gathered as zeros and one head's w_uk broadcast to every head (plausible
    answers); int64 offsets failed after every context chunk had run, at the suffix; slots on another device failed
    in plan's range check (NotImplementedError on meta), a cache there planned."""
    spoil, message = PLAN_REFUSALS[case]
    p = build_problem(chunked(7, q_lens=(3, 2), kv_lens=(20, 9)), DEVICE)
    spoil(p)
    with pytest.raises(ValueError, match=message):
        TritonChunkedPrefill().plan(p)


def test_cpu_problems_without_the_interpreter_are_refused(monkeypatch):
    """Without TRITON_INTERPRET the run crashed in Triton's launcher; refused up front instead."""
    monkeypatch.setattr(cache_ops, "INTERPRETED", False)  # the kernels compiled, not interpreted
    verdict = judge(TritonChunkedPrefill(), build_problem(chunked(7, q_lens=(3,), kv_lens=(9,)), "cpu"))
    assert verdict.status == "unsupported" and "need TRITON_INTERPRET=1" in verdict.message, verdict.message
