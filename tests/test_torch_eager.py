"""The torch baseline passes the judge; a planted bug (zeros) fails it; unsupported input is refused."""

from __future__ import annotations

import pytest
import torch

from mla_bench.errors import UnsupportedConfig
from mla_bench.problem import build_problem
from mla_bench.registry import resolve
from mla_bench.workload import Workload
from suites.judge import judge
from impls.torch_eager import TorchEager, TorchEagerHostCache

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
        (Workload(mode="chunked_prefill", q_lens=(1,), kv_lens=(8,), chunk_size=4), "mode chunked_prefill"),
    ]:
        with pytest.raises(UnsupportedConfig, match=reason):
            impl.plan(build_problem(workload))
        assert judge(impl, build_problem(workload)).status == "unsupported"


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.meta.block_table.__setitem__((0, 0), -1), r"block_table\[0, 0\] = -1 points outside the cache"),
    (lambda p: p.meta.block_table.__setitem__((1, 0), p.cache.num_blocks), r"block_table\[1, 0\] = \d+ points outside"),
    (lambda p: setattr(p.meta, "kv_lens", (10, 999)), "request 1: kv_len 999 exceeds the block table's capacity"),
    (lambda p: setattr(p, "q", p.q[:2]), r"q must be torch.bfloat16 \[3, 4, 576\] .*got torch.bfloat16 \[2, 4, 576\]"),
    (lambda p: setattr(p.meta, "block_table", p.meta.block_table.tolist()), r"block_table must be .*got list"),
    (lambda p: setattr(p.meta, "q_lens", (3,)), "q_lens has 1 requests but kv_lens has 2"),
    (lambda p: setattr(p.meta, "q_lens", (4, -1)), "request 1: lengths must be >= 0"),
    (lambda p: setattr(p.meta, "kv_lens", (10, 1)), r"request 1: query longer than context \(q_len=2 > kv_len=1\)"),
    (lambda p: setattr(p, "q", p.q.float()), r"q must be torch.bfloat16 .*got torch.float32 \[3, 4, 576\]"),
    (lambda p: setattr(p, "q", p.q[..., :512]), r"q must be .*\[3, 4, 576\] .*got torch.bfloat16 \[3, 4, 512\]"),
    (lambda p: setattr(p, "q", p.q[:, :0]), r"got torch.bfloat16 \[3, 0, 576\]"),
])
def test_a_bad_block_table_lengths_or_queries_are_errors_in_plan(edit, message):
    """Without these checks a negative page wraps around to another request's keys (silently wrong), a page past
    the cache fails inside torch's indexing, q_lens of another count or sign were read silently (zip dropped a
    request), a query longer than its context gave NaN rows, and queries of another dtype gave out in theirs."""
    problem = build_problem(Workload(mode="decode", q_lens=(1, 2), kv_lens=(10, 40), page_size=16, seed=3))
    edit(problem)
    for impl in (TorchEager(), resolve("torch_eager_host_cache").load()):
        with pytest.raises(ValueError, match=message):
            impl.plan(problem)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.1, "0.1"])
def test_a_bad_softmax_scale_is_an_error_in_plan(mode, scale):
    """A NaN scale gave NaN everywhere, a negative or zero one a plausible wrong answer, a string a TypeError in
    run: each is refused in plan by name, as the reference and triton_decode refuse it."""
    problem = build_problem(Workload(mode=mode, q_lens=(1, 2), kv_lens=(10, 40), page_size=16, seed=3))
    problem.scale = scale
    impls = [TorchEager()] + ([TorchEagerHostCache()] if mode == "decode" else [])
    for impl in impls:
        with pytest.raises(ValueError, match="softmax scale must be a finite positive number"):
            impl.plan(problem)


@pytest.mark.parametrize("name, edit, message", [
    ("k_nope", lambda t: t[:, :1], r"got torch.bfloat16 \[50, 1, 128\]"),
    ("k_nope", lambda t: t.float(), r"got torch.float32 \[50, 4, 128\]"),
    ("k_pe", lambda t: t[:, :32], r"k_pe must be torch.bfloat16 \[50, 64\] .*got torch.bfloat16 \[50, 32\]"),
    ("v", lambda t: t[..., :64], r"v must be torch.bfloat16 \[50, 4, 128\] .*got torch.bfloat16 \[50, 4, 64\]"),
    ("v", lambda t: t[:-1], r"v must be .*got torch.bfloat16 \[49, 4, 128\]"),
    ("q", lambda t: t[..., :191], r"q must be torch.bfloat16 \[3, 4, 192\] .*got torch.bfloat16 \[3, 4, 191\]"),
])
def test_prefill_keys_and_queries_of_another_shape_or_dtype_are_errors_in_plan(name, edit, message):
    """Keys of another head count or width, or queries of another width, failed inside torch in run; keys of another
    dtype were rounded to the queries' silently."""
    problem = build_problem(Workload(mode="prefill", q_lens=(1, 2), kv_lens=(10, 40), seed=3))
    setattr(problem, name, edit(getattr(problem, name)))
    with pytest.raises(ValueError, match=message):
        TorchEager().plan(problem)


@pytest.mark.parametrize("impl, mode", [(TorchEager, "decode"), (TorchEager, "prefill"),
                                        (TorchEagerHostCache, "decode")])
def test_float16_queries_are_declared_and_pass_the_judge(impl, mode):
    """The baseline computes float16 as it does bfloat16 (float32 scores, probabilities rounded to the queries'
    dtype), yet declared only bfloat16 and float32: a float16 kernel had no baseline to compare with."""
    w = Workload(mode=mode, q_lens=(1, 4, 0, 2), kv_lens=(300, 17, 5, 2), page_size=16, dtype="float16",
                 num_heads=16)
    verdict = judge(impl(), build_problem(w))
    assert verdict.status == "passed", verdict.violations or verdict.message
