"""Triton merge_attn_states, the split-KV merge_parts and the DCP rescale against reference.merge, with the inf
conventions.

Planted bugs: vLLM's Triton merge formula without the empty-row guard (NaN when both parts are empty), a rescale
without it (NaN for a row no rank saw), and a merge_parts that averages its parts unweighted or leaves the guard
out must be caught by the same checks that pass ours.
"""

from __future__ import annotations

import pytest
import torch

import impls.triton  # noqa: F401  (sets TRITON_INTERPRET on CPU before any kernel module loads)
from impls.triton.merge import merge_attn_states, merge_parts, rescale_partial
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


# merge_parts: S parts [S, T, H, D] at once (the split-KV merge of the sparse decode). T*H = 7 * 19 = 133 rows is
# no multiple of a row block (128 in the interpreter, 16 on a GPU); 17 parts take three steps of 8.
TOKENS, HEADS = 7, 19


def random_parts(splits, tokens=TOKENS, heads=HEADS, dim=512, seed=0, scale=3.0):
    """Fresh random float32 ``part_out [S, T, H, D]`` and ``part_lse [S, T, H]`` (no zeros, no ties)."""
    g = torch.Generator().manual_seed(seed)
    part_out = torch.randn(splits, tokens, heads, dim, generator=g).to(DEVICE)
    part_lse = (torch.randn(splits, tokens, heads, generator=g) * scale).to(DEVICE)
    return part_out, part_lse


def ref_merge_parts(part_out, part_lse):
    """The float64 reference: L = logsumexp_s lse_s, out = sum_s exp(lse_s - L) * parts_s (empty parts ignored)."""
    return merge_many(list(zip(part_out.unbind(0), part_lse.unbind(0))))


def nan_outputs(tokens, heads, dim, dtype, strided):
    """NaN-filled ``out [T, H, D]`` and ``lse_out [T, H]``, and the NaN margin a strided view leaves around them.

    Strided: out is a [H, T, D + 24] tensor, transposed and sliced to D columns from 8 (last dim contiguous, the
    others not); lse_out every other row of a transposed [H, 2T]. Any element left unwritten stays NaN."""
    if not strided:
        return (torch.full((tokens, heads, dim), float("nan"), dtype=dtype, device=DEVICE),
                torch.full((tokens, heads), float("nan"), device=DEVICE), [])
    wide = torch.full((heads, tokens, dim + 24), float("nan"), dtype=dtype, device=DEVICE)
    wide_lse = torch.full((heads, 2 * tokens), float("nan"), device=DEVICE)
    margin = [wide[..., :8], wide[..., 8 + dim:], wide_lse[:, 1::2]]
    return wide.transpose(0, 1)[..., 8:8 + dim], wide_lse.t()[::2], margin


def check_merge_parts(merge, splits, dim, dtype, strided, seed=0) -> None:
    """``merge`` against the float64 reference on fresh parts: every element written, nothing outside the view."""
    part_out, part_lse = random_parts(splits, dim=dim, seed=seed)
    out, lse, margin = nan_outputs(TOKENS, HEADS, dim, dtype, strided)
    merge(part_out, part_lse, out, lse)
    ref_out, ref_lse = ref_merge_parts(part_out, part_lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "left unwritten or NaN"
    assert all(bool(torch.isnan(m).all()) for m in margin), "wrote outside the view"
    assert torch.allclose(lse.double(), ref_lse, atol=2e-6, rtol=1e-6)
    if dtype == torch.float32:
        assert torch.allclose(out.double(), ref_out, atol=2e-6, rtol=1e-5)
    else:  # float32 math, then one rounding to nearest: half a bf16 ulp, at most 2**-8 of the value
        assert bool(((out.double() - ref_out).abs() <= ref_out.abs() * 2 ** -8 * 1.001 + 2e-6).all())


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [512, 100])
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 9, 17])
def test_merge_parts_follows_the_float64_reference(splits, dim, dtype, strided):
    """S of one part to three steps of 8, D of 512 and one no power of two, 133 rows: each row's logsumexp and
    weighted sum, into bf16 or float32, into a contiguous out or a strided view (its margin untouched)."""
    check_merge_parts(merge_parts, splits, dim, dtype, strided, seed=splits * 1000 + dim)


def test_merge_parts_rescales_across_steps_without_overflow():
    """lse near +1000 rising over 17 parts (a later step holds a new max: the running sums must be rescaled) and
    near -1000 falling (the max in the first step): unshifted exps would overflow or underflow to 0."""
    part_out, part_lse = random_parts(17, tokens=4, heads=8, dim=100, seed=5, scale=0.3)
    ramp = torch.arange(17, device=DEVICE)[:, None, None] * 0.7
    rising = (torch.arange(4, device=DEVICE) % 2 == 0)[None, :, None]
    part_lse = part_lse + torch.where(rising, 1000 + ramp, -1000 - ramp)
    out, lse = torch.empty(4, 8, 100, device=DEVICE), torch.empty(4, 8, device=DEVICE)
    merge_parts(part_out, part_lse, out, lse)
    ref_out, ref_lse = ref_merge_parts(part_out, part_lse)
    assert torch.allclose(out.double(), ref_out, atol=2e-6, rtol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=0, rtol=1e-7)


def poisoned_parts(splits=9, tokens=6, heads=3, dim=100, seed=11):
    """Random parts over two steps of 8 with the conventions planted, and where out must be NaN.

    Rows (token, head): (0, 0) parts 3 and 8 empty (-inf) holding NaN; (0, 1) parts 0 and 8 at +inf holding NaN;
    (1, 0) all -inf, (1, 1) all +inf, (1, 2) all -inf or +inf, each holding NaN; (2, 0), (2, 1) a NaN lse in the
    first step and in the second; (2, 2) a NaN lse beside only empty parts; (3, 0) one NaN value (column 7) and
    (3, 1) a row of NaN values, both of a part with a finite lse. The other rows are clean."""
    part_out, part_lse = random_parts(splits, tokens, heads, dim, seed=seed)
    nan = float("nan")
    clean_parts, clean_lse = part_out.clone(), part_lse.clone()  # what the reference merges (it refuses NaN)
    part_lse[[3, 8], 0, 0], part_out[[3, 8], 0, 0] = -INF, nan
    part_lse[[0, 8], 0, 1], part_out[[0, 8], 0, 1] = INF, nan
    part_lse[:, 1, 0], part_lse[:, 1, 1] = -INF, INF
    part_lse[:, 1, 2] = torch.where(torch.arange(splits, device=DEVICE) % 2 == 0, INF, -INF)
    part_out[:, 1] = nan
    part_lse[2, 2, 0] = part_lse[8, 2, 1] = nan
    part_lse[:, 2, 2], part_lse[4, 2, 2] = -INF, nan
    part_out[8, 3, 0, 7] = part_out[1, 3, 1] = nan
    clean_lse[[3, 8], 0, 0], clean_lse[[0, 8], 0, 1], clean_lse[:, 1] = -INF, INF, -INF
    expect_nan = torch.zeros(tokens, heads, dim, dtype=torch.bool, device=DEVICE)
    expect_nan[2, :], expect_nan[3, 0, 7], expect_nan[3, 1] = True, True, True
    return part_out, part_lse, (clean_parts, clean_lse), expect_nan


def check_poisoned(merge, dtype=torch.float32) -> None:
    """``merge`` on ``poisoned_parts``: NaN exactly where expected, elsewhere the reference of the clean parts."""
    part_out, part_lse, clean, expect_nan = poisoned_parts()
    out, lse, _ = nan_outputs(*part_out.shape[1:], dtype, strided=False)
    merge(part_out, part_lse, out, lse)
    ref_out, ref_lse = ref_merge_parts(*clean)
    assert torch.equal(torch.isnan(out), expect_nan), "NaN where a part is empty, or a NaN part merged to a number"
    assert bool(torch.isnan(lse[2]).all()), "a NaN lse must give lse NaN"
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all()), "all empty: out 0, lse -inf"
    rows = [0, 1, 3, 4, 5]  # the tokens without a NaN lse
    assert not torch.isnan(lse[rows]).any()
    keep = ~expect_nan
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=2 ** -8)
    assert torch.allclose(out.double()[keep], ref_out[keep], **tol)
    assert torch.equal(torch.isneginf(lse[rows]), torch.isneginf(ref_lse[rows]))
    finite = torch.isfinite(ref_lse[rows])
    assert torch.allclose(lse[rows].double()[finite], ref_lse[rows][finite], atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_merge_parts_keeps_the_empty_and_nan_conventions(dtype):
    """An empty part (-inf, or +inf) adds nothing whatever it holds; an all-empty row gives out 0 and lse -inf,
    not NaN; a NaN lse gives NaN out and lse, a NaN value under a nonzero weight NaN out: never a plausible number."""
    check_poisoned(merge_parts, dtype)


def mean_of_parts(part_out, part_lse, out, lse_out):
    """Planted bug: the plain mean of the live parts (their lse ignored), with the right lse."""
    lse = torch.where(torch.isposinf(part_lse), -INF, part_lse)
    live = (~torch.isneginf(lse))[..., None]
    count = live.sum(0).clamp(min=1)
    out.copy_(torch.where(live, part_out, 0.0).sum(0) / count)
    lse_out.copy_(torch.logsumexp(lse, 0))


def unguarded_merge_parts(part_out, part_lse, out, lse_out):
    """Planted bug: the weighted merge without the empty guard (vLLM's formula: NaN for an all-empty row)."""
    lse = torch.where(torch.isposinf(part_lse), -INF, part_lse)
    m = lse.max(0).values
    w = torch.exp(lse - m)[..., None]
    out.copy_(torch.where(w > 0, w * part_out, 0.0).sum(0) / w.sum(0))
    lse_out.copy_(m + torch.log(w.sum(0)[..., 0]))


def test_planted_merge_parts_bugs_are_caught():
    """The same checks that pass merge_parts fail an unweighted mean and a merge without the empty guard."""
    with pytest.raises(AssertionError):
        check_merge_parts(mean_of_parts, 9, 100, torch.float32, strided=False)
    with pytest.raises(AssertionError, match="all empty|NaN"):
        check_poisoned(unguarded_merge_parts)
    check_merge_parts(unguarded_merge_parts, 9, 100, torch.float32, strided=True)  # right where no row is empty


SHAPES = r"merge_parts: parts \[S, T, H, D\], part_lse \[S, T, H\], out \[T, H, D\] and lse_out \[T, H\] needed, got "
CONTIGUOUS = "merge_parts: parts and part_lse must be contiguous, out contiguous in its last dim"
FLOATS = "merge_parts: parts, part_lse and out must be floating point, got "


def not_contiguous(x):
    """The same values, same shape, laid out head-major: strides a kernel reading [S, T, H, D] would misread."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("bad, message", [
    (lambda p, pl, o, lo: (p[0], pl, o, lo), SHAPES + r"\[4, 2, 16\], \[3, 4, 2\]"),
    (lambda p, pl, o, lo: (p[None], pl, o, lo), SHAPES + r"\[1, 3, 4, 2, 16\]"),
    (lambda p, pl, o, lo: (p, pl[:, :3], o, lo), SHAPES + r"\[3, 4, 2, 16\], \[3, 3, 2\]"),
    (lambda p, pl, o, lo: (p, pl[:2], o, lo), SHAPES + r"\[3, 4, 2, 16\], \[2, 4, 2\]"),
    (lambda p, pl, o, lo: (p, pl, o[:, :, :8], lo), r", \[4, 2, 8\] and \[4, 2\]"),
    (lambda p, pl, o, lo: (p, pl, o[None], lo), r", \[1, 4, 2, 16\] and \[4, 2\]"),
    (lambda p, pl, o, lo: (p, pl, o, lo[:3]), r", \[4, 2, 16\] and \[3, 2\]"),
    (lambda p, pl, o, lo: (p, pl, o, lo.double()), "merge_parts: lse_out must be float32, got torch.float64"),
    (lambda p, pl, o, lo: (p, pl, o, lo.bfloat16()), "merge_parts: lse_out must be float32, got torch.bfloat16"),
    (lambda p, pl, o, lo: (p, pl, o, lo.int()), "merge_parts: lse_out must be float32, got torch.int32"),
    (lambda p, pl, o, lo: (not_contiguous(p), pl, o, lo), CONTIGUOUS),
    (lambda p, pl, o, lo: (torch.cat([p, p], -1)[..., :16], pl, o, lo), CONTIGUOUS),
    (lambda p, pl, o, lo: (p, not_contiguous(pl), o, lo), CONTIGUOUS),
    (lambda p, pl, o, lo: (p, pl, torch.cat([o, o], -1)[..., ::2], lo), CONTIGUOUS),
    (lambda p, pl, o, lo: (p.int(), pl, o, lo), FLOATS + "torch.int32, torch.float32, torch.float32"),
    (lambda p, pl, o, lo: (p, pl.long(), o, lo), FLOATS + "torch.float32, torch.int64, torch.float32"),
    (lambda p, pl, o, lo: (p, pl, o.to(torch.int16), lo), FLOATS + "torch.float32, torch.float32, torch.int16"),
])
def test_merge_parts_refuses_bad_input(bad, message):
    """Wrong ranks or shapes, an lse_out not float32, non-contiguous parts or out, integer tensors: each was read or
    written in the wrong place, or as other numbers. Refused before anything is written."""
    part_out, part_lse = random_parts(3, tokens=4, heads=2, dim=16)
    out, lse_out, _ = nan_outputs(4, 2, 16, torch.float32, strided=False)
    args = bad(part_out, part_lse, out, lse_out)
    with pytest.raises(ValueError, match=message):
        merge_parts(*args)
    assert bool(torch.isnan(out).all() and torch.isnan(lse_out).all()), "wrote before refusing"


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_merge_parts_of_no_parts_gives_empty_rows(strided):
    """S = 0: no row saw a key, so out 0 and lse -inf, not whatever out held before."""
    part_out, part_lse = random_parts(0, dim=100)
    out, lse, margin = nan_outputs(TOKENS, HEADS, 100, torch.bfloat16, strided)
    out.copy_(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).abs() + 1)  # garbage, not only NaN
    merge_parts(part_out, part_lse, out, lse)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    assert all(bool(torch.isnan(m).all()) for m in margin), "wrote outside the view"


@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("tokens, heads", [(0, 4), (4, 0), (0, 0)])
def test_merge_parts_of_no_rows_returns_without_a_launch(monkeypatch, splits, tokens, heads):
    """T*H = 0: nothing to merge or write; must return, not launch an empty grid or raise."""
    monkeypatch.setattr("impls.triton.merge._merge_parts_kernel", None)  # launching it fails
    part_out, part_lse = random_parts(splits, tokens=tokens, heads=heads, dim=64)
    out, lse = torch.empty(tokens, heads, 64, device=DEVICE), torch.empty(tokens, heads, device=DEVICE)
    merge_parts(part_out, part_lse, out, lse)


def test_merge_of_rows_without_values_gives_the_references_lse():
    """D = 0 failed in the interpreter (a step of 0 along the row) and merge_parts launched no program, leaving
    lse_out unwritten; the reference merges the lse alone."""
    seed = torch.randint(0, 2 ** 31, ()).item()
    out_a, lse_a, out_b, lse_b = parts(dim=0, seed=seed)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = ref_merge(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    assert out.shape == ref_out.shape
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    part_out, part_lse = random_parts(3, tokens=4, heads=2, dim=0, seed=seed)
    out, lse_out, _ = nan_outputs(4, 2, 0, torch.float32, strided=False)
    merge_parts(part_out, part_lse, out, lse_out)
    torch.testing.assert_close(lse_out, torch.logsumexp(part_lse, 0), atol=1e-5, rtol=1e-5)


def test_merge_refuses_a_bfloat16_lse_out():
    """The lse was written rounded to bf16 (merge_parts refuses it)."""
    out_a, lse_a, out_b, lse_b = parts(seed=torch.randint(0, 2 ** 31, ()).item())
    with pytest.raises(ValueError, match="merge_attn_states: lse_out must be float32, got torch.bfloat16"):
        merge_attn_states(out_a, lse_a, out_b, lse_b, lse_out=lse_a.bfloat16())


@pytest.mark.parametrize("call", ["merge_attn_states", "merge_parts", "rescale_partial"])
def test_merge_entry_points_refuse_an_out_that_overlaps_itself(call):
    """An out expanded along its heads (stride 0) was written by every head's program in turn, keeping one."""
    tokens, heads, dim = 5, 4, 16
    out = torch.randn(tokens, 1, dim, device=DEVICE).expand(tokens, heads, dim)
    message = rf"^{call}: out must not overlap itself \(strides \[16, 0, 1\] for shape \[5, 4, 16\]\)$"
    with pytest.raises(ValueError, match=message):
        if call == "merge_attn_states":
            out_a, lse_a, out_b, lse_b = parts(tokens, heads, dim)
            merge_attn_states(out_a, lse_a, out_b, lse_b, out=out)
        elif call == "merge_parts":
            part_out, part_lse = random_parts(2, tokens, heads, dim)
            merge_parts(part_out, part_lse, out, torch.randn(tokens, heads, device=DEVICE))
        else:
            rescale_partial(torch.randn(tokens, heads, dim, device=DEVICE), torch.randn(2, tokens, heads,
                                                                                        device=DEVICE), 0, out=out)


def test_merge_entry_points_refuse_tensors_on_another_device():
    """Another device's tensor was read as an address on the kernel's (meta: the launch failed inside Triton)."""
    out_a, lse_a, out_b, lse_b = parts(seed=torch.randint(0, 2 ** 31, ()).item())
    with pytest.raises(ValueError, match=f"^merge_attn_states: lse_b is on meta but out_a is on {DEVICE}"):
        merge_attn_states(out_a, lse_a, out_b, lse_b.to("meta"))
    part_out, part_lse = random_parts(2, tokens=4, heads=2, dim=16)
    out, lse_out, _ = nan_outputs(4, 2, 16, torch.float32, strided=False)
    with pytest.raises(ValueError, match=f"^merge_parts: lse_out is on meta but parts is on {DEVICE}"):
        merge_parts(part_out, part_lse, out, lse_out.to("meta"))
    with pytest.raises(ValueError, match=f"^rescale_partial: all_lse is on meta but part is on {DEVICE}"):
        rescale_partial(part_out[0], part_lse.to("meta"), 0)


def _entry_calls(tokens=4, heads=3, dim=16) -> dict:
    """Each Triton merge entry point on fresh random inputs: a call taking overrides of its named tensors."""
    out_a, lse_a, out_b, lse_b = (torch.randn(tokens, heads, *d, device=DEVICE) for d in ((dim,), (), (dim,), ()))
    part_out, part_lse = random_parts(2, tokens, heads, dim, seed=torch.randint(0, 2 ** 31, ()).item())
    out, lse_out, _ = nan_outputs(tokens, heads, dim, torch.float32, strided=False)
    return {
        "merge_attn_states": lambda **x: merge_attn_states(**{**dict(out_a=out_a, lse_a=lse_a, out_b=out_b,
                                                                      lse_b=lse_b), **x}),
        "merge_parts": lambda **x: merge_parts(**{**dict(parts=part_out, part_lse=part_lse, out=out,
                                                         lse_out=lse_out), **x}),
        "rescale_partial": lambda **x: rescale_partial(**{**dict(part=part_out[0], all_lse=part_lse, rank=0), **x}),
    }


@pytest.mark.parametrize("call, name", [("merge_attn_states", "out_a"), ("merge_attn_states", "lse_b"),
                                        ("merge_attn_states", "out"), ("merge_parts", "parts"),
                                        ("merge_parts", "lse_out"), ("rescale_partial", "part"),
                                        ("rescale_partial", "all_lse"), ("rescale_partial", "out")])
def test_merge_entry_points_refuse_a_list_naming_it(call, name):
    """A list failed with AttributeError ("'list' object has no attribute 'dim'")."""
    tensor = torch.randn(4, 3, 16).tolist()
    with pytest.raises(ValueError, match=f"^{call}: {name} must be a torch.Tensor, got list$"):
        _entry_calls()[call](**{name: tensor})


def test_merge_entry_points_refuse_inputs_all_on_the_meta_device():
    """All on meta passed every check (one device) and failed in the launch: 'Cannot copy out of meta tensor'."""
    out_a, lse_a, out_b, lse_b = (t.to("meta") for t in parts(seed=torch.randint(0, 2 ** 31, ()).item()))
    with pytest.raises(ValueError, match="^merge_attn_states: out_a is on the meta device, which holds no values$"):
        merge_attn_states(out_a, lse_a, out_b, lse_b)
    part_out, part_lse = (t.to("meta") for t in random_parts(2, 4, 3, 16, seed=torch.randint(0, 2 ** 31, ()).item()))
    with pytest.raises(ValueError, match="^merge_parts: parts is on the meta device, which holds no values$"):
        merge_parts(part_out, part_lse, torch.empty(4, 3, 16, device="meta"), torch.empty(4, 3, device="meta"))
    with pytest.raises(ValueError, match="^rescale_partial: part is on the meta device, which holds no values$"):
        rescale_partial(part_out[0], part_lse, 0)
