"""The reference codecs: exact formats, byte positions, scale rules, non-finite policy."""

from __future__ import annotations

import math
import random
import re

import numpy
import pytest
import torch

from mla_bench.layouts import LAYOUTS, LATENT_DIM, NOPE_DIM, PagedCache, get_layout
from mla_bench.layouts.ops import gather_cache, write_cache
from mla_bench.layouts.formats import (E2M1_MAGNITUDES, FLT_MIN, ceil_log2, e2m1_decode, e2m1_encode, e4m3_decode,
                                       e4m3_encode, all_finite, finite_amax, pack_nibbles,
                                       unpack_nibbles)

# The codecs run where their values live (``write_cache`` into a GPU cache, the bench scripts' caches drawn on the GPU);
# their non-finite handling rests on reductions whose NaN propagation is the device's own, so those tests run on each.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
EXPECTED_BYTES = {"bf16": 1152, "fp8_e4m3": 576, "fp8_ds_mla": 656, "fp8_ds_mla_pow2": 656, "fp4_mx16": 324,
                  "mxfp4_nsa": 400, "nvfp4": 416}


def random_latent(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.randn(n, 1, generator=gen))
    return (torch.randn(n, LATENT_DIM, generator=gen) * magnitude).to(torch.bfloat16)


def test_every_layout_has_its_documented_size():
    assert {name: layout.bytes_per_token for name, layout in LAYOUTS.items()} == EXPECTED_BYTES


def test_e4m3_encode_is_nearest_even_over_every_midpoint_and_saturates():
    codes = torch.arange(256, dtype=torch.uint8)
    grid = torch.unique(e4m3_decode(codes)[torch.isfinite(e4m3_decode(codes))])
    midpoints = (grid[1:] + grid[:-1]) / 2
    decoded = e4m3_decode(e4m3_encode(midpoints.float()))
    lower_codes = e4m3_encode(grid[:-1].float())
    # a midpoint goes to the neighbour whose code is even
    expect = torch.where(lower_codes % 2 == 0, grid[:-1], grid[1:])
    both_zero = (expect == 0) & (decoded == 0)
    assert bool(((decoded == expect) | both_zero).all())
    assert e4m3_decode(e4m3_encode(torch.tensor([1e6, -1e6]))).tolist() == [448.0, -448.0]
    # SATFINITE: Inf saturates like any large value; every NaN becomes the one canonical code
    assert e4m3_encode(torch.tensor([float("inf"), float("-inf")])).tolist() == [0x7E, 0xFE]
    assert e4m3_encode(torch.tensor([float("nan"), -float("nan")])).tolist() == [0x7F, 0x7F]


def test_ceil_log2_is_exact_next_to_powers_of_two():
    below, at, above = torch.tensor([2.0 ** 3 * (1 - 2 ** -24), 2.0 ** 3, 2.0 ** 3 * (1 + 2 ** -23)])
    assert ceil_log2(torch.stack([below, at, above])).tolist() == [3, 3, 4]
    values = torch.rand(10000) * 1e3 + 1e-30
    expect = [math.ceil(math.log2(v)) for v in values.double().tolist()]
    assert ceil_log2(values).tolist() == expect


@pytest.mark.parametrize("ties", ["away", "even"])
def test_e2m1_rounds_to_the_nearest_magnitude(ties):
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    values = (torch.rand(20000, dtype=torch.float64) * 14 - 7).float()
    codes = e2m1_encode(values, torch.ones(()), ties)
    decoded = e2m1_decode(codes)
    clipped = values.double().clamp(-6, 6)
    best = (clipped.abs()[:, None] - magnitudes[None, :]).abs().min(dim=1).values
    assert torch.allclose((decoded.abs() - clipped.abs()).abs(), best)
    assert bool((torch.sign(decoded) * torch.sign(clipped) >= 0).all())


def test_e2m1_midpoints_follow_the_tie_rule():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    away = e2m1_decode(e2m1_encode(midpoints, torch.ones(()), "away"))
    even = e2m1_decode(e2m1_encode(midpoints, torch.ones(()), "even"))
    assert away.tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert even.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_encode(torch.tensor([-0.0, -0.1]), torch.ones(()), "away").tolist() == [0, 8]
    assert e2m1_encode(torch.tensor([-0.0]), torch.ones(()), "even").tolist() == [8]


def test_nibbles_pack_even_element_low():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    assert torch.equal(unpack_nibbles(packed), codes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite_finds_one_nan_or_infinity_anywhere(dtype, device):
    """The codecs' refusal of NaN/Inf input rests on it: one bad value, wherever it lies in a large tensor."""
    x = random_latent(257, seed=12).to(device, dtype)
    assert all_finite(x) and all_finite(x[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for _ in range(3):
            y = x.clone()
            y[random.randrange(y.shape[0]), random.randrange(LATENT_DIM)] = bad
            assert not all_finite(y), (bad, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_finite_amax_is_the_largest_finite_magnitude_whatever_nan_or_infinity_lies_beside_it(dtype, device):
    """The per-layer scales start from it: a NaN or an infinity must neither become nor hide the maximum."""
    x = random_latent(64, seed=11).to(device, dtype)
    peak = float(x.float().abs().max())
    assert finite_amax(x) == peak and finite_amax(-x) == peak
    x[3, 7], x[9, 500], x[20, 570] = float("nan"), float("inf"), -float("inf")
    masked = x.float().abs()
    assert finite_amax(x) == float(masked[torch.isfinite(masked)].max()) > 0
    assert finite_amax(torch.full((2, 8), float("nan"), dtype=dtype, device=device)) == 0.0
    assert finite_amax(torch.empty(0, LATENT_DIM, dtype=dtype, device=device)) == 0.0


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_decode_of_encode_is_a_fixed_point_of_the_decoded_values(name):
    """Encoding the decoded values again decodes to the same numbers (a quantizer is idempotent on its grid)."""
    layout = get_layout(name)
    x = random_latent(300, seed=1)
    scale = layout.fit_tensor_scale(x)
    decoded = layout.dequantize(layout.quantize(x, scale), scale)
    again = layout.dequantize(layout.quantize(decoded.float(), scale), scale)
    assert torch.equal(decoded, again)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_all_zero_tiles_decode_to_zero_not_nan(name):
    layout = get_layout(name)
    x = random_latent(8, seed=2)
    x[0] = 0
    x[1, :128] = 0
    scale = layout.fit_tensor_scale(x)
    decoded = layout.dequantize(layout.quantize(x, scale), scale)
    assert torch.isfinite(decoded).all()
    assert bool((decoded[0] == 0).all()) and bool((decoded[1, :128] == 0).all())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_an_unwritten_slot_decodes_to_nan_in_every_value(name):
    """Unused pages are poisoned with one byte: in every layout it must read as NaN (codes, scales and rope alike),
    or a kernel reading a page it should not would read plausible numbers."""
    layout = get_layout(name)
    cache = PagedCache.empty(layout, 2, 3, tensor_scale=layout.fit_tensor_scale(random_latent(4, seed=3)))
    assert bool(torch.isnan(gather_cache(cache, torch.arange(cache.num_slots))).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_nonfinite_inputs_are_refused_by_default_and_propagate_on_request(name, device):
    layout = get_layout(name)
    x = random_latent(4, seed=3).to(device)
    scale = layout.fit_tensor_scale(x)
    x[2, 5] = float("nan")
    x[3, 530] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        layout.quantize(x, scale)
    decoded = layout.dequantize(layout.quantize(x, scale, propagate_nonfinite=True), scale)
    assert not torch.isfinite(decoded[2, 5]) and not torch.isfinite(decoded[3, 530])
    assert torch.isfinite(decoded[:2]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_nonfinite_inputs_encode_to_device_independent_bytes(name, device):
    """A NaN's sign and payload differ between devices; the codecs write one canonical pattern for each, the same
    bytes on every device as on the CPU."""
    layout = get_layout(name)
    positive = random_latent(2, seed=8).float()
    scale = layout.fit_tensor_scale(positive)
    positive[:, 3] = positive[:, 540] = float("nan")
    negative = positive.clone()
    negative[:, 3] = negative[:, 540] = -float("nan")
    on_cpu = layout.quantize(positive, scale, propagate_nonfinite=True)
    encoded = layout.quantize(positive.to(device), scale, propagate_nonfinite=True)
    assert encoded.device.type == device and torch.equal(encoded.cpu(), on_cpu)
    assert torch.equal(layout.quantize(negative.to(device), scale, propagate_nonfinite=True), encoded)
    assert torch.isnan(layout.dequantize(encoded, scale)[:, [3, 540]]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_codec_writes_the_same_bytes_on_the_gpu_as_on_the_cpu(name):
    """A cache written on the GPU (``write_cache`` there, the bench scripts' caches) must hold the format's bytes: a
    scale computed another way there (CUDA's torch multiplies by the reciprocal of a Python-number divisor) would
    differ from what the engines and our Triton writer produce, which are checked against the codecs on the CPU."""
    layout = get_layout(name)
    values = random_latent(512, seed=21).float() * torch.logspace(-6, 6, 512)[:, None]
    scale = layout.fit_tensor_scale(values)
    on_cpu = layout.quantize(values, scale)
    on_gpu = layout.quantize(values.cuda(), scale)
    assert on_gpu.is_cuda
    differ = (on_gpu.cpu() != on_cpu).any(dim=1)
    assert not differ.any(), f"{name}: {int(differ.sum())} of {len(values)} tokens encode differently on the GPU"


def test_overflowing_quotients_of_finite_values_saturate_instead_of_becoming_nan():
    layout = get_layout("fp8_e4m3")
    x = random_latent(2, seed=9).float()
    x[0, 7] = 3e38
    decoded = layout.dequantize(layout.quantize(x, 1e-30), 1e-30)
    assert decoded[0, 7] == 448 * float(torch.tensor(1e-30, dtype=torch.float32))


def test_fp8_ds_mla_bytes_sit_where_the_format_says():
    layout = get_layout("fp8_ds_mla")
    x = random_latent(3, seed=4)
    raw = layout.quantize(x)
    tiles = x[:, :NOPE_DIM].float().reshape(3, 4, 128)
    scales = raw[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales, torch.clamp(tiles.abs().amax(-1) / 448, min=torch.finfo(torch.float32).tiny))
    assert torch.equal(raw[:, 528:].contiguous().view(torch.bfloat16), x[:, NOPE_DIM:])
    assert torch.equal(raw[:, :512], e4m3_encode((tiles / scales[..., None]).reshape(3, 512)))


def test_pow2_scales_are_powers_of_two_at_least_amax_over_448():
    layout = get_layout("fp8_ds_mla_pow2")
    x = random_latent(50, seed=5)
    scales = layout.quantize(x)[:, 512:528].contiguous().view(torch.float32).double()
    amax = x[:, :NOPE_DIM].double().abs().reshape(50, 4, 128).amax(-1)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    assert bool((scales >= amax / 448).all()) and bool((scales < 2 * torch.clamp(amax / 448, min=1e-4)).all())


def test_mx_scales_cover_the_block_amax():
    x = random_latent(50, seed=6)
    raw = get_layout("fp4_mx16").quantize(x)
    exponents = raw[:, 288:].double() - 127
    amax = x.double().abs().reshape(50, 36, 16).amax(-1)
    assert bool((6 * torch.exp2(exponents) >= amax).all())
    assert bool((6 * torch.exp2(exponents - 1) < torch.clamp(amax, min=6e-10)).all())


def test_tensor_scale_is_required_and_validated():
    x = random_latent(2, seed=7)
    for name in ("fp8_e4m3", "nvfp4"):
        layout = get_layout(name)
        for bad in (None, 0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="tensor_scale"):
                layout.quantize(x, bad)


@pytest.mark.parametrize("bad, says", [
    (1e-50, "got 1e-50 (0.0 in float32)"),  # decoded NaN
    (1e-40, "got 1e-40 (9.99994610111476e-41 in float32)"),  # subnormal: 1 / scale overflows float32
    (1e39, "got 1e+39 (inf in float32)"),  # decoded NaN
    (10 ** 400, "(inf in float32)"),  # raised a bare OverflowError
], ids=["1e-50", "1e-40", "1e39", "10**400"])
def test_tensor_scales_are_judged_as_the_float32_the_codecs_use(bad, says):
    x = random_latent(2, seed=7)
    for name in ("fp8_e4m3", "nvfp4"):
        layout = get_layout(name)
        raw = layout.quantize(x, 1.0)
        for call in (lambda: layout.quantize(x, bad), lambda: layout.dequantize(raw, bad),
                     lambda: PagedCache.empty(layout, 1, 16, tensor_scale=bad)):
            with pytest.raises(ValueError, match=re.escape(f"layout {name}: tensor_scale must be a finite positive")) \
                    as refused:
                call()
            assert says in str(refused.value)
        for edge in (FLT_MIN, torch.finfo(torch.float32).max):
            layout.dequantize(layout.quantize(x, edge), edge)


@pytest.mark.parametrize("name", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("amax", [1e-36, 1e-40, 1e-44])
def test_per_layer_scales_fitted_to_tiny_values_are_floored_and_taken(name, amax):
    """nvfp4's ``amax / (6 * 448)`` was subnormal or 0 in float32 for tiny values; floored at FLT_MIN as fp8_e4m3's."""
    layout = get_layout(name)
    x = random_latent(4, seed=10).float()
    x = x / x.abs().max() * amax
    scale = layout.fit_tensor_scale(x)
    assert scale >= FLT_MIN
    decoded = layout.dequantize(layout.quantize(x, scale), scale)
    assert bool(((decoded - x.double()).abs() <= layout.error_bound(x, scale)).all())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_float64_values_beyond_float32_are_refused_even_when_propagating(name):
    """The codecs compute in float32, where a finite float64 1e39 became Inf and decoded as NaN/Inf (or was blamed on
    fp8_e4m3's fitted scale); a float64 NaN/Inf stays governed by ``propagate_nonfinite``."""
    layout = get_layout(name)
    x = random_latent(3, seed=11).double()
    scale = layout.fit_tensor_scale(x)
    x[1, 530] = torch.finfo(torch.float32).max
    layout.quantize(x, scale)
    x[1, 530] = -1e39
    says = f"layout {name}: 1 finite float64 input values overflow float32, which the codecs compute in (first at " \
           "token 1, column 530: -1e+39"
    for propagate in (False, True):
        with pytest.raises(ValueError, match=re.escape(says)):
            layout.quantize(x, scale, propagate_nonfinite=propagate)
    x[1, 530] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        layout.quantize(x, scale)
    assert not torch.isfinite(layout.dequantize(layout.quantize(x, scale, propagate_nonfinite=True), scale)[1, 530])


def test_bf16_fields_round_values_past_bfloat16_to_inf_as_documented():
    """Not past the bound's range (docstrings of ``bf16_error_bound`` and the bf16 layout): below 2^128 - 2^119 a
    value rounds to bfloat16's largest, from there on to Inf, as in the engines."""
    threshold = torch.tensor(2.0 ** 128 - 2.0 ** 119, dtype=torch.float32)
    below = torch.nextafter(threshold, torch.tensor(0.0))
    x = torch.ones(2, LATENT_DIM)
    x[0, 3] = x[0, 540] = below
    x[1, 3] = x[1, 540] = threshold
    decoded = get_layout("bf16").dequantize(get_layout("bf16").quantize(x))
    assert decoded[0, [3, 540]].tolist() == [torch.finfo(torch.bfloat16).max] * 2
    assert decoded[1, [3, 540]].tolist() == [math.inf] * 2


@pytest.mark.parametrize("shape", [(4, 575), (4, 576, 1), (576,)])
def test_wrong_shapes_are_refused(shape):
    with pytest.raises(ValueError, match="shape"):
        get_layout("fp8_ds_mla").quantize(torch.randn(shape))
    with pytest.raises(ValueError, match="uint8"):
        get_layout("fp8_ds_mla").dequantize(torch.zeros(4, 655, dtype=torch.uint8))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_byte_fields_tile_the_token(name):
    """The fields the roundtrip suite names a wrong byte by cover every byte once, in order."""
    layout = get_layout(name)
    ends = [0] + [end for _, _, end in layout.fields]
    assert [start for _, start, _ in layout.fields] == ends[:-1] and ends[-1] == layout.bytes_per_token


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_empty_and_strided_inputs_encode_like_contiguous_ones(name):
    """No token (an empty step) encodes to no byte; a transposed (column-major) view encodes as its contiguous copy:
    both crashed inside the codecs."""
    layout = get_layout(name)
    x = random_latent(6, seed=random.randrange(2 ** 32)).float()
    scale = layout.fit_tensor_scale(x)
    empty = layout.quantize(x[:0], scale)
    assert empty.shape == (0, layout.bytes_per_token) and layout.dequantize(empty, scale).shape == (0, LATENT_DIM)
    strided = x.t().contiguous().t()
    assert torch.equal(layout.quantize(strided, scale), layout.quantize(x, scale))


LAYOUT = get_layout("fp8_ds_mla")


def _cache() -> PagedCache:
    return PagedCache.empty(LAYOUT, 2, 4)


@pytest.mark.parametrize("call, says", [
    (lambda: PagedCache.empty(LAYOUT, 4, 0), "page_size must be a positive int, got 0"),
    (lambda: PagedCache(LAYOUT, torch.empty(4, 0, 656, dtype=torch.uint8)), "page size must be >= 1, got 0"),
    (lambda: PagedCache(LAYOUT, torch.zeros(2, 4, 656, dtype=torch.uint8).transpose(0, 1)),  # a write crashed in view
     "data must be contiguous (slots are read as rows of one view), got strides [656, 2624, 1]"),
    (lambda: PagedCache.empty(LAYOUT, -1, 16), "num_blocks must be an int >= 0, got -1"),
    (lambda: write_cache(_cache(), random_latent(3, 1), torch.tensor([0.5, 1.7, 2.2])),  # was truncated to 0, 1, 2
     "slot_mapping must be a contiguous int32 or int64 tensor [3], got torch.float32 [3]"),
    (lambda: write_cache(_cache(), random_latent(3, 1), torch.tensor([True, False, True])), "got torch.bool [3]"),
    (lambda: write_cache(_cache(), random_latent(3, 1), torch.tensor([1, 5, 1])), "writes 2 tokens to slot 1"),
    (lambda: write_cache(_cache(), random_latent(1, 1)[0], torch.tensor([1])), "values must be a tensor [N, 576]"),
    (lambda: gather_cache(_cache(), torch.tensor([[0, 1]])),
     "token_slots must be a contiguous int32 or int64 tensor [N]"),
    (lambda: gather_cache(_cache(), torch.tensor([0.5])), "got torch.float32 [1]"),  # was slot 0
    (lambda: gather_cache(_cache(), [0, 1]), "got list"),
    (lambda: get_layout("fp8_e4m3").quantize(random_latent(2, 1), True), "tensor_scale must be a finite positive"),
])
def test_caches_and_cache_ops_refuse_bad_input_naming_it(call, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        call()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_eight_bit_float_values_are_refused_by_name(name, dtype):
    """float8 values (a cache format, e.g. a cache view passed as values) were encoded from e5m2 and crashed with a
    NotImplementedError from e4m3fn; refused as other non-float dtypes are, before anything is written."""
    layout = get_layout(name)
    x = random_latent(3, seed=random.randrange(2 ** 32)).float()
    scale = layout.fit_tensor_scale(x)
    says = f"layout {name}: expected floating-point values of 16 bits or more, got {dtype}"
    with pytest.raises(ValueError, match=re.escape(says)):
        layout.quantize(x.to(dtype), scale)
    cache = PagedCache.empty(layout, 1, 4, tensor_scale=scale)
    with pytest.raises(ValueError, match=re.escape(says)):
        write_cache(cache, x.to(dtype), torch.tensor([2, -1, 0]))
    assert bool((cache.data == 0xFF).all())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_eight_bit_float_values_are_refused_by_name_when_fitting_a_scale(name, dtype):
    """fit_tensor_scale crashed with a NotImplementedError on e4m3fn values (fp8_e4m3) or fitted a scale to float8
    values (e5m2, and nvfp4 from either) that quantize then refuses; it refuses them as quantize does."""
    x = random_latent(3, seed=random.randrange(2 ** 32)).to(dtype)
    says = f"layout {name}: expected floating-point values of 16 bits or more, got {dtype}"
    with pytest.raises(ValueError, match=re.escape(says)):
        get_layout(name).fit_tensor_scale(x)


@pytest.mark.parametrize("name", ["fp8_e4m3", "nvfp4"])
def test_numpy_float_tensor_scales_are_taken_as_their_value(name):
    """A per-layer scale computed with numpy (np.float32) was refused as 'not a finite positive number, got 0.5'."""
    layout = get_layout(name)
    x = random_latent(3, seed=random.randrange(2 ** 32)).float()
    scale = layout.fit_tensor_scale(x)
    for as_numpy in (numpy.float32(scale), numpy.float64(scale)):
        cache = PagedCache.empty(layout, 1, 4, tensor_scale=as_numpy)
        write_cache(cache, x, torch.tensor([3, 0, 1]))
        assert torch.equal(cache.rows()[[3, 0, 1]], layout.quantize(x, float(numpy.float32(scale))))
        assert torch.equal(gather_cache(cache, torch.tensor([0])), layout.dequantize(cache.rows()[[0]], scale))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_write_cache_names_a_bad_value_by_its_token_not_its_rank_among_written_rows(name):
    """Padding rows were dropped before the codec checked the values, so a NaN at token 3 behind two padding rows was
    reported 'at token 1' (the Triton write names token 3); likewise a float64 value past float32."""
    layout = get_layout(name)
    gen = torch.Generator().manual_seed(random.randrange(2 ** 32))
    x = random_latent(5, seed=random.randrange(2 ** 32)).double()
    scale = layout.fit_tensor_scale(x)
    column = int(torch.randint(0, LATENT_DIM, (1,), generator=gen))
    slots = torch.tensor([-1, 4, -1, 6, 2])
    for bad, says in ((float("nan"), f"1 NaN/Inf input values (first at token 3, column {column})"),
                      (1e39, f"1 finite float64 input values overflow float32, which the codecs compute in (first at "
                             f"token 3, column {column}")):
        values = x.clone()
        values[3, column] = bad
        values[0, :] = float("inf")  # a padding row: never checked, never written
        cache = PagedCache.empty(layout, 2, 4, tensor_scale=scale)
        with pytest.raises(ValueError, match=re.escape(says)):
            write_cache(cache, values, slots)
        assert bool((cache.data == 0xFF).all())
    values[3, column] = x[3, column]
    write_cache(cache, values, slots)
    assert torch.equal(cache.rows()[[4, 6, 2]], layout.quantize(x[[1, 3, 4]], scale))


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("shape", [(3, 500), (3, 600), (LATENT_DIM,)])
def test_error_bounds_and_fitted_scales_refuse_values_of_another_shape(name, shape):
    """bf16's error_bound(x[:, :500]) returned a [3, 500] bound, the block layouts a reshape RuntimeError; a 1-D or
    [N, 100] input got a fitted scale."""
    layout = get_layout(name)
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"layout {name}: expected values of shape \[N, 576\], got torch.float32"):
        layout.error_bound(x, 1.0)
    with pytest.raises(ValueError, match=rf"layout {name}: expected values of shape \[N, 576\]"):
        layout.fit_tensor_scale(x)


@pytest.mark.parametrize("name", [name for name, layout in LAYOUTS.items() if layout.needs_tensor_scale])
@pytest.mark.parametrize("scale", [None, float("nan"), -1.0])
def test_error_bounds_of_per_layer_scaled_layouts_need_a_valid_scale(name, scale):
    """Without a scale error_bound failed with a TypeError on None (a NaN scale gave a NaN bound, which nothing
    passes, a negative one a negative bound)."""
    with pytest.raises(ValueError, match=f"layout {name}: tensor_scale must be a finite positive number"):
        get_layout(name).error_bound(torch.randn(2, LATENT_DIM), scale)


@pytest.mark.parametrize("call", [
    lambda: get_layout(["bf16"]),
    lambda: get_layout(None),
])
def test_a_layout_name_that_is_not_a_string_is_refused_naming_the_known_layouts(call):
    """get_layout(["bf16"]) failed with TypeError: unhashable type, not the unknown-layout error."""
    with pytest.raises(ValueError, match="a layout is named by a string; known layouts: bf16, "):
        call()


def test_write_cache_names_the_dtype_it_was_given():
    """torch.where(..., values, 0) ran before the dtype check: a bool input was reported as torch.int64."""
    cache = PagedCache.empty(get_layout("bf16"), 2, 4)
    values = torch.randn(3, LATENT_DIM) > 0
    with pytest.raises(ValueError, match="expected floating-point values of 16 bits or more, got torch.bool$"):
        write_cache(cache, values, torch.randperm(8)[:3])


@pytest.mark.parametrize("name", ["bf16", "nvfp4"])
def test_dequantize_refuses_a_list_naming_it(name):
    """A list of bytes failed with AttributeError ('list' object has no attribute 'dtype')."""
    layout = get_layout(name)
    with pytest.raises(ValueError, match=rf"layout {name}: expected uint8 bytes of shape \[N, \d+\], got list"):
        layout.dequantize(torch.randint(0, 255, (2, layout.bytes_per_token)).tolist(), 1.0)


def _meta_calls(name: str) -> dict:
    """Each codec and cache op given one meta tensor (fresh random values elsewhere): the call, and what it names."""
    layout = get_layout(name)
    x = random_latent(3, seed=random.randrange(2 ** 32)).float()
    scale = layout.fit_tensor_scale(x)
    cache = PagedCache.empty(layout, 2, 4, tensor_scale=scale)
    on_meta = PagedCache(layout, cache.data.to("meta"), scale)
    slots = torch.randperm(8)[:3]
    return {
        "quantize": (lambda: layout.quantize(x.to("meta"), scale), f"layout {name}: values"),
        "fit_tensor_scale": (lambda: layout.fit_tensor_scale(x.to("meta")), f"layout {name}: values"),
        "dequantize": (lambda: layout.dequantize(layout.quantize(x, scale).to("meta"), scale), f"layout {name}: raw"),
        "write values": (lambda: write_cache(cache, x.to("meta"), slots), "write_cache: values"),
        "write slots": (lambda: write_cache(cache, x, slots.to("meta")), "write_cache: slot_mapping"),
        "write cache": (lambda: write_cache(on_meta, x, slots), "write_cache: cache.data"),
        "gather slots": (lambda: gather_cache(cache, slots.to("meta")), "gather_cache: token_slots"),
        "gather cache": (lambda: gather_cache(on_meta, slots), "gather_cache: cache.data"),
    }


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("case", list(_meta_calls("bf16")))
def test_codecs_and_cache_ops_refuse_meta_tensors_naming_them(name, case):
    """A meta tensor passed the structural checks and failed deep inside ('Tensor.item() cannot be called on meta
    tensors', 'Cannot copy out of meta tensor'), or decoded to a meta tensor of no values."""
    call, says = _meta_calls(name)[case]
    with pytest.raises(ValueError, match=f"^{re.escape(says)} is on the meta device, which holds no values$"):
        call()


@pytest.mark.parametrize("call, says", [
    (lambda cache, x, slots: write_cache(cache.data, x, slots), "write_cache: cache must be a PagedCache, got torch"),
    (lambda cache, x, slots: gather_cache(cache.data, slots), "gather_cache: cache must be a PagedCache, got torch"),
    (lambda cache, x, slots: PagedCache(cache.layout, cache.data.tolist()), "data must be uint8 [num_blocks, "
                                                                             "page_size, 656], got list"),
])
def test_a_tensor_or_a_list_where_a_paged_cache_or_its_data_belongs_is_named(call, says):
    """``write_cache(cache.data, ...)`` failed with "'torch.layout' object has no attribute 'check_dtype'" (a tensor's
    ``layout`` is torch's), gather_cache with "no attribute 'num_slots'", a list as data with AttributeError."""
    with pytest.raises(ValueError, match=re.escape(says)):
        call(_cache(), random_latent(3, seed=random.randrange(2 ** 32)), torch.randperm(8)[:3])
