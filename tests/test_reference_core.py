"""The attention core against a written-out softmax, and properties over random shapes (hypothesis)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_bench.workload import Mode, Workload
from mla_bench.problem import build_problem
from reference.absorbed import latent_mqa, paged_latent_mqa
from reference.core import attend, ragged_attention


def written_out_attention(q, k, v, q_lens, kv_lens, scale):
    """Attention by hand: Python loops, math.exp, causal rule spelled out. Small cases only."""
    out = [[[0.0] * v.shape[-1] for _ in range(q.shape[1])] for _ in range(q.shape[0])]
    lse = [[-math.inf] * q.shape[1] for _ in range(q.shape[0])]
    q0 = k0 = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        for i in range(q_len):
            for h in range(q.shape[1]):
                kh = h if k.shape[1] > 1 else 0
                keys = [j for j in range(kv_len) if j <= kv_len - q_len + i]
                scores = [scale * sum(float(q[q0 + i, h, d]) * float(k[k0 + j, kh, d]) for d in range(q.shape[-1]))
                          for j in keys]
                if not scores:
                    continue
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                lse[q0 + i][h] = top + math.log(total)
                for d in range(v.shape[-1]):
                    out[q0 + i][h][d] = sum(w * float(v[k0 + j, kh, d]) for w, j in zip(weights, keys)) / total
        q0, k0 = q0 + q_len, k0 + kv_len
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


def test_core_matches_a_written_out_softmax():
    g = torch.Generator().manual_seed(0)
    q_lens, kv_lens = (1, 3, 2, 0), (5, 4, 0, 3)
    for kv_heads in (1, 2):
        q = torch.randn(sum(q_lens), 2, 8, generator=g, dtype=torch.float64)
        k = torch.randn(sum(kv_lens), kv_heads, 8, generator=g, dtype=torch.float64)
        v = torch.randn(sum(kv_lens), kv_heads, 6, generator=g, dtype=torch.float64)
        out, lse = ragged_attention(q, k, v, q_lens, kv_lens, 0.7)
        expect_out, expect_lse = written_out_attention(q, k, v, q_lens, kv_lens, 0.7)
        assert torch.allclose(out, expect_out, rtol=1e-12, atol=1e-13)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(expect_lse))
        finite = torch.isfinite(expect_lse)
        assert torch.allclose(lse[finite], expect_lse[finite], rtol=1e-12, atol=1e-13)


def test_empty_rows_give_zero_and_minus_inf():
    q = torch.randn(2, 3, 8, dtype=torch.float64)
    out, lse = attend(q, torch.randn(4, 1, 8), torch.randn(4, 1, 5), torch.zeros(2, 4, dtype=torch.bool), 1.0)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


lengths = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 70)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(requests=lengths, page_size=st.sampled_from([1, 3, 16, 32]), seed=st.integers(0, 2 ** 16))
def test_paged_reference_equals_the_ragged_one_and_is_causal(requests, page_size, seed):
    """Over random mixes (empty requests and page-boundary lengths included): paging is transparent,
    empty rows are 0 / -inf, and a row does not depend on keys past its causal frontier."""
    q_lens = tuple(min(q, kv) if kv else q for q, kv in requests)
    kv_lens = tuple(kv for _, kv in requests)
    if sum(q_lens) == 0:
        q_lens = (1,) + q_lens[1:]
        kv_lens = (max(kv_lens[0], 1),) + kv_lens[1:]
    workload = Workload(mode=Mode.DECODE, q_lens=q_lens, kv_lens=kv_lens, page_size=page_size, seed=seed)
    p = build_problem(workload)
    out, lse = paged_latent_mqa(p.q, p.cache, p.meta, p.scale)
    direct_out, direct_lse = latent_mqa(p.q, p.kv, q_lens, kv_lens, p.scale)
    assert torch.equal(out, direct_out) and torch.equal(lse, direct_lse)

    starts = [0]
    for kv in kv_lens:
        starts.append(starts[-1] + kv)
    row = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(row, row + q_len)
        if kv_len == 0:
            assert bool((out[rows] == 0).all()) and bool(torch.isneginf(lse[rows]).all())
        else:
            assert torch.isfinite(lse[rows]).all()
        row += q_len
    # perturb every key after the first request's first query frontier: that row must not change
    if q_lens[0] and kv_lens[0]:
        frontier = kv_lens[0] - q_lens[0]
        changed = p.kv.double().clone()
        changed[frontier + 1:kv_lens[0]] += 1.0
        moved_out, _ = latent_mqa(p.q, changed, q_lens, kv_lens, p.scale)
        assert torch.equal(moved_out[0], out[0])
        if q_lens[0] > 1:
            assert not torch.equal(moved_out[q_lens[0] - 1], out[q_lens[0] - 1])
