"""Bit-level number formats the cache layouts are built from: e4m3, e2m1 (FP4), ue8m0, bf16.

All arithmetic is float32 where the engines do it in float32 (scaling before rounding), and decoding is to
float64, where every decoded value (an 8-bit float times a float32 scale) is exact. A Triton kernel that
writes these formats must round the same way (RNE conversions, correctly rounded ``div_rn``) to produce the
same bytes.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FLT_MIN = torch.finfo(torch.float32).tiny  # smallest normal float32; vLLM's floor for fp8 scales
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive e2m1 magnitudes: a value at or past bound i rounds to magnitude i + 1.
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
UE8M0_NAN = 0xFF
E4M3_NAN = 0x7F  # the one NaN code the codecs write (a NaN's sign is not portable across devices)
BF16_NAN = 0x7FC0  # likewise for bfloat16 (torch on CPU writes 0x7FC0, CUDA's cvt 0x7FFF)


def _ends_if_finite(values: torch.Tensor) -> torch.Tensor | None:
    """``[min, max]`` of non-empty ``values`` when none is NaN or infinite, else None: one ``aminmax`` pass, which
    carries a NaN or an infinity to its ends (3 ms on a 75M-value bf16 cache on this CPU, where
    ``isfinite(...).all()`` took 170 ms)."""
    ends = torch.stack(torch.aminmax(values))
    return ends if bool(torch.isfinite(ends).all()) else None


def all_finite(values: torch.Tensor) -> bool:
    """No NaN and no infinity among ``values`` (True when empty)."""
    return not values.numel() or _ends_if_finite(values) is not None


def finite_amax(values: torch.Tensor) -> float:
    """The largest ``|value|`` over the values finite in float32 (0.0 when none is), as a float32 number: from the
    ends of ``values`` when every value is finite, else through a mask. Selecting the finite values copied the whole
    cache."""
    if values.dtype == torch.float64:
        values = values.float()  # a float64 value beyond float32's range counts as an infinity, as the codecs see it
    if not values.numel():
        return 0.0
    ends = _ends_if_finite(values)
    if ends is not None:
        return float(ends.abs().amax().float())
    magnitude = values.float().abs()
    return float(torch.where(torch.isfinite(magnitude), magnitude, 0.0).amax())


def div_rn(values: torch.Tensor, divisor: float) -> torch.Tensor:
    """``values / divisor`` correctly rounded on every device. Divided by a Python number, CUDA's torch multiplies by
    its reciprocal instead, which misses the quotient by one bit for about half of all float32 values when the
    reciprocal is not exact (1/448, 1/6): the codecs' scales, and so their bytes, would depend on the device."""
    return values / torch.tensor(divisor, dtype=values.dtype, device=values.device)


def e4m3_encode(values: torch.Tensor) -> torch.Tensor:
    """float32 values -> e4m3fn bytes as CUDA's SATFINITE conversion: round to nearest even, anything beyond
    +-448 (+-Inf too) saturates to +-448, NaN becomes ``E4M3_NAN``. Codecs that must propagate an Inf *input*
    mark it NaN themselves (an overflowing quotient of finite inputs saturates, as in the engines)."""
    values = values.float()
    encoded = values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return encoded if all_finite(values) else torch.where(torch.isnan(values), E4M3_NAN, encoded).to(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    return codes.contiguous().view(torch.float8_e4m3fn).double()


def ceil_log2(values: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(v))`` of positive float32 values (int32), from the exponent and mantissa bits.

    ``torch.log2`` in float32 can round ``log2(2^k * (1 + 2^-23))`` down to ``k``; this cannot.
    """
    mantissa, exponent = torch.frexp(values.float())  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def ue8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """Exponent-only scale bytes -> float64 ``2^(code - 127)``; 0xFF is NaN."""
    scale = torch.exp2(codes.double() - 127.0)
    return torch.where(codes == UE8M0_NAN, float("nan"), scale)


def e2m1_encode(values: torch.Tensor, denominator: torch.Tensor, ties: str) -> torch.Tensor:
    """float32 ``values`` over their block's ``denominator`` -> 4-bit codes (uint8 0..15), saturating at 6.

    Compares ``|value|`` with ``denominator * bound`` (float32 products) rather than dividing, as SGLang's
    NVFP4 writer does; for power-of-two denominators (the MX codecs) both are the same. ``ties="away"``:
    SGLang's MX codecs: a midpoint rounds up in magnitude and the sign bit is ``value < 0`` (so -0.0 encodes
    as +0). ``ties="even"``: round to the nearest even code, sign from the sign bit. A zero denominator
    encodes 0.
    """
    magnitude = values.float().abs()
    denominator = denominator.float()
    if ties == "away":
        code = sum((magnitude >= denominator * bound).to(torch.uint8) for bound in E2M1_BOUNDS)
        sign = values < 0
    elif ties == "even":
        code = sum(((magnitude >= denominator * bound) if i % 2 else (magnitude > denominator * bound))
                   .to(torch.uint8) for i, bound in enumerate(E2M1_BOUNDS))
        sign = torch.signbit(values)
    else:
        raise ValueError(f"ties must be 'away' or 'even', got {ties!r}")
    code = code | (sign.to(torch.uint8) << 3)
    return torch.where(denominator > 0, code, torch.zeros_like(code))


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> float64 values (bit 3 is the sign)."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` 4-bit codes -> ``[..., n]`` bytes; the even element goes in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return codes.flatten(-2)


def bf16_bytes(values: torch.Tensor) -> torch.Tensor:
    """Values -> bfloat16 (round to nearest even; every NaN as ``BF16_NAN``) -> ``[..., 2 * n]`` little-endian
    bytes."""
    bits = values.to(torch.bfloat16).contiguous().view(torch.int16)
    bits = torch.where(torch.isnan(values), BF16_NAN, bits).to(torch.int16)
    return bits.contiguous().view(torch.uint8)  # where() keeps a strided input's layout, which view() refuses


def bf16_from_bytes(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.bfloat16).double()


def f32_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.float().contiguous().view(torch.uint8)


def f32_from_bytes(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float32).double()


# ---- stated accuracy: the largest |x - decode(encode(x))| each format allows, in float64 -----------------------
# A factor 1 + 2^-20 absorbs the fp32 roundings of the quotients and products the codecs compute.
SLACK = 1 + 2.0 ** -20


def bf16_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Rounding to bfloat16: 0 where ``x`` is a bfloat16 number, else half an ulp (2^-8 relative, 2^-134 absolute
    below the normal range). Not past bfloat16's range: finite float32 values of magnitude >= 2^128 - 2^119
    (~3.3962e38, half an ulp above bfloat16's largest 3.3895e38) round to Inf, as in the engines' bf16 fields."""
    x = x.double()
    representable = x == x.to(torch.bfloat16).double()
    return torch.where(representable, 0.0, x.abs() * 2.0 ** -8 * SLACK + 2.0 ** -134)


def e4m3_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(x / scale) * scale`` for a scale at most ``scale``: half an e4m3 step (2^-4 relative, 2^-10 scale in
    the subnormal range), plus the saturation error past ``448 * scale``."""
    magnitude, limit = x.double().abs(), E4M3_MAX * scale
    return (2.0 ** -4 * torch.minimum(magnitude, limit) + 2.0 ** -10 * scale) * SLACK + (magnitude - limit).clamp(min=0)


def e2m1_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e2m1(x / s) * s`` for a block scale ``s <= scale`` with ``|x| <= 6 s``: half the grid spacing, at most
    ``0.25 * max(s, |x|)`` (spacing s/2 below 2s, s up to 4s, 2s up to 6s)."""
    return 0.25 * torch.maximum(scale, x.double().abs()) * SLACK
