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


def e4m3_encode(values: torch.Tensor) -> torch.Tensor:
    """float32 values -> e4m3fn bytes, round to nearest even, saturating at +-448 (CUDA's SATFINITE); NaN stays
    NaN (0x7F / 0xFF) and +-Inf becomes NaN, since e4m3fn has no infinity."""
    values = values.float()
    encoded = values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    nan_code = torch.where(torch.signbit(values), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(torch.isfinite(values), encoded, nan_code)


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
    """Values -> bfloat16 (round to nearest even) -> ``[..., 2 * n]`` little-endian bytes."""
    return values.to(torch.bfloat16).contiguous().view(torch.uint8)


def bf16_from_bytes(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.bfloat16).double()


def f32_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.float().contiguous().view(torch.uint8)


def f32_from_bytes(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float32).double()
