"""Triton merge_attn_states and the DCP rescale against reference.merge, with the inf conventions.

Planted bugs: vLLM's Triton merge formula without the empty-row guard (NaN when both parts are empty) and a
rescale without it (NaN for a row no rank saw) must be caught by the same checks that pass ours.
"""

from __future__ import annotations

import pytest
import torch

import impls.triton  # noqa: F401  (sets TRITON_INTERPRET on CPU before any kernel module loads)
from impls.triton.merge import merge_attn_states, rescale_partial
from reference.merge import merge_attn_states as ref_merge
from reference.merge import merge_many

INF = float("inf")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def parts(tokens=7, heads=5, dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    out_a, out_b = (torch.randn(tokens, heads, dim, generator=g).to(DEVICE) for _ in range(2))
    lse_a, lse_b = (torch.randn(tokens, heads, generator=g).to(DEVICE) * 3 for _ in range(2))
    # the conventions: a part empty (-inf, or FlashMLA's +inf), both empty, and garbage behind an empty part
    lse_a[0, 0] = lse_b[0, 0] = -INF
    lse_a[1, 1] = INF
    lse_b[2, 2] = -INF
    lse_a[3, 3], lse_b[3, 3] = INF, -INF
    out_a[0, 0] = float("nan")
    out_b[2, 2] = float("nan")
    return out_a, lse_a, out_b, lse_b


def check_merge(merge) -> None:
    out_a, lse_a, out_b, lse_b = parts()
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    clean_a = torch.where(torch.isfinite(out_a), out_a, 0.0)
    clean_b = torch.where(torch.isfinite(out_b), out_b, 0.0)
    ref_out, ref_lse = ref_merge(clean_a, lse_a, clean_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "merge produced NaN"
    assert bool((out[0, 0] == 0).all()) and bool(torch.isneginf(lse[0, 0])), "both empty: out 0, lse -inf"
    assert bool(torch.isneginf(lse[3, 3])), "+inf counts as -inf"
    assert torch.allclose(out.double(), ref_out, atol=2e-6, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=2e-6)


def vllm_triton_style_merge(out_a, lse_a, out_b, lse_b):
    """Planted bug: the formula without the empty guard (vLLM's Triton kernel: NaN when both are -inf)."""
    lse_a = torch.where(torch.isposinf(lse_a), -INF, lse_a)
    lse_b = torch.where(torch.isposinf(lse_b), -INF, lse_b)
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    out = (wa[..., None] * torch.nan_to_num(out_a) + wb[..., None] * torch.nan_to_num(out_b)) / (wa + wb)[..., None]
    return out, m + torch.log(wa + wb)


def test_triton_merge_follows_the_reference_and_its_inf_conventions():
    check_merge(merge_attn_states)


def test_a_merge_that_nans_on_double_empty_is_caught():
    with pytest.raises(AssertionError, match="NaN"):
        check_merge(vllm_triton_style_merge)


def test_merge_in_place_into_part_a_and_into_strided_views():
    out_a, lse_a, out_b, lse_b = parts(seed=1)
    lse_a[torch.isposinf(lse_a)] = -INF
    expect_out, expect_lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    big_out = torch.full((9, 5, 128), float("nan"), device=DEVICE)
    big_lse = torch.full((9, 5), float("nan"), device=DEVICE)
    big_out[1:8], big_lse[1:8] = out_a, lse_a
    merge_attn_states(big_out[1:8], big_lse[1:8], out_b, lse_b, big_out[1:8], big_lse[1:8])
    assert torch.equal(big_out[1:8], expect_out) and torch.equal(big_lse[1:8], expect_lse)
    assert bool(torch.isnan(big_out[0]).all() and torch.isnan(big_out[8]).all()), "wrote outside the view"


def test_merge_refuses_mismatched_parts():
    out_a, lse_a, out_b, lse_b = parts()
    with pytest.raises(ValueError, match="shape"):
        merge_attn_states(out_a, lse_a, out_b[:, :4], lse_b[:, :4])
    with pytest.raises(ValueError, match="lse"):
        merge_attn_states(out_a, lse_a[:, :2], out_b, lse_b)


def naive_rescale(part, all_lse, rank):
    """Planted bug: the DCP combine without its guard: NaN for a row that no rank saw."""
    total = torch.logsumexp(all_lse, dim=0)
    return part * torch.exp(all_lse[rank] - total)[..., None], total


@pytest.mark.parametrize("rescale, ok", [(rescale_partial, True), (naive_rescale, False)])
def test_rescaled_parts_sum_to_merge_many_and_empty_rows_stay_clean(rescale, ok):
    g = torch.Generator().manual_seed(2)
    world = 3
    partials = [torch.randn(6, 4, 512, generator=g).to(DEVICE) for _ in range(world)]
    all_lse = torch.randn(world, 6, 4, generator=g).to(DEVICE)
    all_lse[:, 0, 0] = -INF      # no rank saw this row
    all_lse[1, 1, :] = -INF      # rank 1's shard is empty for token 1
    total = sum(rescale(partials[r], all_lse, r)[0] for r in range(world))
    lse = rescale(partials[0], all_lse, 0)[1]
    ref_out, ref_lse = merge_many([(partials[r], all_lse[r]) for r in range(world)])
    clean = not torch.isnan(total).any() and torch.allclose(total.double(), ref_out, atol=2e-6, rtol=1e-5)
    clean = clean and bool(torch.isneginf(lse[0, 0])) and not torch.isnan(lse).any()
    assert clean == ok


def test_rescale_refuses_an_out_it_would_write_wrongly():
    """``out`` was not checked: a narrower one was written past its rows, a strided one as if contiguous."""
    part, all_lse = torch.randn(3, 2, 16, device=DEVICE), torch.randn(2, 3, 2, device=DEVICE)
    with pytest.raises(ValueError, match=r"out must be \[3, 2, 16\] like part.*got \[3, 2, 8\]"):
        rescale_partial(part, all_lse, 0, out=torch.empty(3, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"contiguous in its last dim, got \[3, 2, 16\] with strides \[64, 32, 2\]"):
        rescale_partial(part, all_lse, 0, out=torch.empty(3, 2, 32, device=DEVICE)[..., ::2])
    with pytest.raises(ValueError, match="rank must be an int in a world of 2, got 1.5"):
        rescale_partial(part, all_lse, 1.5)  # crashed inside the kernel's launch


def test_merge_refuses_integer_tensors():
    """An int32 lse_out was written as truncated lse, integer inputs were read as numbers: both in silence."""
    out_a, lse_a, out_b, lse_b = parts()
    with pytest.raises(ValueError, match="result .* must be floating point, got torch.float32, torch.int32"):
        merge_attn_states(out_a, lse_a, out_b, lse_b, lse_out=torch.empty(lse_a.shape, dtype=torch.int32,
                                                                          device=DEVICE))
    with pytest.raises(ValueError, match="part b .* must be floating point"):
        merge_attn_states(out_a, lse_a, out_b, lse_b.long())
    with pytest.raises(ValueError, match="rescale_partial: part, all_lse and out must be floating point"):
        rescale_partial(out_a, torch.stack([lse_a, lse_b]).long(), 0)
