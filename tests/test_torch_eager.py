"""The torch baseline passes the judge; a planted bug (zeros) fails it; unsupported input is refused."""

from __future__ import annotations

import pytest
import torch

from mla_bench.errors import UnsupportedConfig
from mla_bench.problem import build_problem
from mla_bench.registry import resolve
from mla_bench.workload import Workload
from suites.judge import judge
from impls.torch_eager import TorchEager

MIXES = [
    ((1, 1, 1), (33, 64, 7)),        # decode, a length on a page boundary
    ((3, 3), (64, 20)),              # MTP
    ((1, 4, 0, 2), (300, 17, 5, 2)), # varlen with a request that asks nothing
]


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mix", range(len(MIXES)))
def test_torch_eager_passes_the_judge(mode, dtype, mix):
    q_lens, kv_lens = MIXES[mix]
    w = Workload(mode=mode, q_lens=q_lens, kv_lens=kv_lens, page_size=16, dtype=dtype, seed=mix, num_heads=16)
    verdict = judge(resolve("torch_eager").load(), build_problem(w))
    assert verdict.status == "passed", verdict.violations or verdict.message


def test_padding_requests_give_zero_rows_and_minus_inf():
    w = Workload(mode="decode", q_lens=(1, 2), kv_lens=(10, 0), page_size=4)
    impl = TorchEager()
    out, lse = impl.run(impl.plan(build_problem(w)))
    assert bool((out[1:] == 0).all()) and bool(torch.isneginf(lse[1:]).all())


class ReturnsZeros(TorchEager):
    """Planted bug: the right shapes, nothing computed."""

    name = "planted_zeros"

    def run(self, plan):
        out, lse = super().run(plan)
        return torch.zeros_like(out), torch.zeros_like(lse)


class ReadsTheWrongLastKey(TorchEager):
    """Planted bug: each request's last key is read from the slot before it (an off-by-one in the slot map)."""

    name = "planted_off_by_one"

    def plan(self, problem):
        plan = super().plan(problem)
        for slots in plan.request_slots:
            if len(slots) > 1:
                slots[-1] = slots[-2]
        return plan


@pytest.mark.parametrize("bug", [ReturnsZeros, ReadsTheWrongLastKey])
def test_planted_bugs_fail_the_judge(bug):
    w = Workload(mode="decode", q_lens=(1, 1, 1), kv_lens=(33, 64, 7), page_size=16, seed=4)
    verdict = judge(bug(), build_problem(w))
    assert verdict.status == "failed"
    assert verdict.violations


def test_unsupported_combinations_are_refused_at_plan_time_with_the_reason():
    impl = TorchEager()
    for workload, reason in [
        (Workload(mode="decode", q_lens=(1,), kv_lens=(8,), layout="fp8_ds_mla"), "layout fp8_ds_mla"),
        (Workload(mode="sparse_decode", q_lens=(1,), kv_lens=(8,), topk=4), "mode sparse_decode"),
        (Workload(mode="decode", q_lens=(1,), kv_lens=(8,), dtype="float16"), "dtype float16"),
    ]:
        with pytest.raises(UnsupportedConfig, match=reason):
            impl.plan(build_problem(workload))
        assert judge(impl, build_problem(workload)).status == "unsupported"


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.meta.block_table.__setitem__((0, 0), -1), r"block_table\[0, 0\] = -1 points outside the cache"),
    (lambda p: p.meta.block_table.__setitem__((1, 0), p.cache.num_blocks), r"block_table\[1, 0\] = \d+ points outside"),
    (lambda p: setattr(p.meta, "kv_lens", (10, 999)), "request 1: kv_len 999 exceeds the block table's capacity"),
    (lambda p: setattr(p, "q", p.q[:2]), r"q has 2 rows but sum\(q_lens\) = 3"),
    (lambda p: setattr(p.meta, "block_table", p.meta.block_table.tolist()), r"block_table must be .*got list"),
])
def test_a_bad_block_table_or_inconsistent_lengths_are_errors_in_plan(edit, message):
    """Without these checks a negative page wraps around to another request's keys (silently wrong) and a page past
    the cache fails inside torch's indexing."""
    problem = build_problem(Workload(mode="decode", q_lens=(1, 2), kv_lens=(10, 40), page_size=16, seed=3))
    edit(problem)
    for impl in (TorchEager(), resolve("torch_eager_host_cache").load()):
        with pytest.raises(ValueError, match=message):
            impl.plan(problem)
