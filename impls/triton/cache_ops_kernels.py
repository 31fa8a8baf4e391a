"""Triton kernels of the cache ops: write one token per program into its slot, gather one token per program.

Every kernel reproduces the reference codec of ``mla_bench.layouts`` bit for bit. The rules that make that
portable between the interpreter (numpy) and GPUs:

- each correctly rounded fp32 division the reference does is ``tl.math.div_rn`` (Triton's ``/`` is approximate
  on GPUs); products are plain fp32 products never followed by an addition (so no FMA contraction changes them);
- conversions to the stored formats (bf16, e4m3, ue8m0, e2m1) are integer operations on the fp32 bits, not
  Triton casts or float tricks, so rounding, saturation, subnormals and NaN codes depend on no device's cvt
  instructions or floating-point flags;
- absolute values, signs and NaN/Inf tests are integer operations too (immune to flush-to-zero; and Triton 3.6
  negates as ``0 - x``, which loses the sign of -0.0);
- every non-finite pattern written is the codecs' canonical one (e4m3 0x7F, bf16 0x7FC0, fp32 0x7FC00000,
  ue8m0 0xFF with zero codes).

Cache rows are addressed through three views of the same bytes (uint8, int16, int32): all field offsets of all
layouts are aligned for them. A slot < 0 is padding: the program stores nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

LATENT = tl.constexpr(576)
NOPE = tl.constexpr(512)
ROPE = tl.constexpr(64)
FLT_MIN = tl.constexpr(1.1754943508222875e-38)
E4M3_NAN = tl.constexpr(0x7F)
BF16_NAN = tl.constexpr(0x7FC0)
F32_NAN_BITS = tl.constexpr(0x7FC00000)


# ---- bit-level helpers --------------------------------------------------------------------------------------------
@triton.jit
def _bits(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def _from_bits(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _nonfinite(x):
    return (_bits(x) & 0x7F800000) == 0x7F800000


@triton.jit
def _magnitude(x):
    """``|x|`` by clearing the sign bit (exact for subnormals and NaN)."""
    return _from_bits(_bits(x) & 0x7FFFFFFF)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bfloat16 bits (int32 in [0, 65535]), round to nearest even, every NaN as 0x7FC0."""
    bits = _bits(x)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, BF16_NAN, rounded)


@triton.jit
def _bf16_value(bits16):
    """bfloat16 bits (loaded as int16) -> fp32, exactly."""
    return _from_bits((bits16.to(tl.int32) & 0xFFFF) << 16)


@triton.jit
def _e4m3_code(q):
    """fp32 -> e4m3fn code (int32 0..255) as CUDA's SATFINITE cvt: nearest even, |q| > 448 and Inf saturate to
    448, NaN -> 0x7F."""
    bits = _bits(q)
    sign = (bits >> 24) & 0x80
    mag = tl.minimum(bits & 0x7FFFFFFF, 0x43E00000)  # 448.0; integer order is float order for finite q >= 0
    # normal range (|q| >= 2^-6): keep 3 mantissa bits with round-to-nearest-even, rebias the exponent 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: |q| * 2^9 = significand * 2^(exponent - 141) rounded to the nearest even integer; shifts past
    # 25 leave less than a half, like 25 does
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - (mag >> 23), 25)
    kept = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    subnormal = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    code = tl.where(mag >= 0x3C800000, normal, subnormal) | sign
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, E4M3_NAN, code)


@triton.jit
def _e4m3_value(code):
    """e4m3fn code (int32 0..255) -> fp32, exactly (0x7F / 0xFF -> NaN)."""
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = _bits(mantissa.to(tl.float32) * 0.001953125)  # mantissa * 2^-9, exact
    mag = tl.where(exponent == 0, subnormal, normal)
    mag = tl.where((code & 0x7F) == 0x7F, F32_NAN_BITS, mag)
    return _from_bits(mag | ((code & 0x80) << 24))


@triton.jit
def _pow2_ceil(v):
    """``2^ceil(log2(v))`` of positive normal fp32 ``v``, exactly, from the exponent and mantissa bits."""
    bits = _bits(v)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return _from_bits(exponent << 23)


@triton.jit
def _ue8m0_value(byte):
    """Exponent-only scale byte -> fp32 ``2^(byte - 127)``; 0xFF is NaN, 0 the subnormal 2^-127."""
    value = tl.where(byte == 0, 0x00400000, byte << 23)
    return _from_bits(tl.where(byte == 0xFF, F32_NAN_BITS, value))


@triton.jit
def _e2m1_code_away(x, den):
    """|x| / den -> e2m1 code, midpoints away from zero (SGLang's MX codecs); sign bit for x < 0 (not -0.0)."""
    bits = _bits(x)
    mag = _magnitude(x)
    code = ((mag >= den * 0.25).to(tl.int32) + (mag >= den * 0.75).to(tl.int32) + (mag >= den * 1.25).to(tl.int32)
            + (mag >= den * 1.75).to(tl.int32) + (mag >= den * 2.5).to(tl.int32) + (mag >= den * 3.5).to(tl.int32)
            + (mag >= den * 5.0).to(tl.int32))
    negative = (bits < 0) & ((bits & 0x7FFFFFFF) != 0)
    return code | (negative.to(tl.int32) << 3)


@triton.jit
def _e2m1_code_even(x, den):
    """|x| / den -> e2m1 code, midpoints to the even code (nvfp4); sign bit from the sign; 0 where den <= 0."""
    mag = _magnitude(x)
    code = ((mag > den * 0.25).to(tl.int32) + (mag >= den * 0.75).to(tl.int32) + (mag > den * 1.25).to(tl.int32)
            + (mag >= den * 1.75).to(tl.int32) + (mag > den * 2.5).to(tl.int32) + (mag >= den * 3.5).to(tl.int32)
            + (mag > den * 5.0).to(tl.int32))
    code = code | ((_bits(x) < 0).to(tl.int32) << 3)
    return tl.where(den > 0, code, 0)


@triton.jit
def _e2m1_value(code):
    """e2m1 code (bit 3 the sign) -> fp32; code 8 is -0.0 (the sign is set on the bits: Triton 3.6 negates as
    ``0 - x``, which gives +0.0)."""
    c = code & 0x7
    mag = tl.where(c < 4, c.to(tl.float32) * 0.5,
                   tl.where(c == 4, 2.0, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0))))
    return _from_bits(_bits(mag) | ((code & 0x8) << 28))


# ---- shared pieces of a row ---------------------------------------------------------------------------------------
@triton.jit
def _load_values(ptrs, mask, IN_BF16: tl.constexpr):
    """Input values as fp32. bf16 inputs come as int16 bits and are widened exactly by a shift (the interpreter's
    bf16 cast loses subnormals)."""
    if IN_BF16:
        return _bf16_value(tl.load(ptrs, mask=mask, other=0))
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _write_bf16_part(src, dst_i16, N: tl.constexpr, slot, IN_BF16: tl.constexpr):
    offs = tl.arange(0, N)
    x = _load_values(src + offs, offs < N, IN_BF16)
    tl.store(dst_i16 + offs, _bf16_bits(x).to(tl.int16), mask=_written(offs, slot))


@triton.jit
def _out_value(value, OUT_BF16: tl.constexpr):
    """What a gather stores for fp32 ``value``: itself, or its bf16 bits (nearest even) for an int16 view of a bf16
    output."""
    if OUT_BF16:
        return _bf16_bits(value).to(tl.int16)
    else:
        return value


@triton.jit
def _gather_bf16_part(src_i16, dst, N: tl.constexpr, OUT_BF16: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst + offs, _out_value(_bf16_value(tl.load(src_i16 + offs)), OUT_BF16))


@triton.jit
def _slot(slots_ptr, pid):
    return tl.load(slots_ptr + pid).to(tl.int64)


@triton.jit
def _written(offs, slot):
    """Store mask over ``offs``: everything, unless the slot is padding (< 0). (A vector, not a broadcast scalar:
    the interpreter refuses scalar-and-vector masks.)"""
    return (offs * 0 + slot) >= 0


# ---- bf16: [kv_c 512 | k_pe 64] bfloat16 ------------------------------------------------------------------------
@triton.jit
def write_bf16_kernel(values_ptr, stride_v, slots_ptr, cache_i16_ptr, IN_BF16: tl.constexpr):
    pid = tl.program_id(0)
    slot = _slot(slots_ptr, pid)
    src = values_ptr + pid.to(tl.int64) * stride_v
    dst = cache_i16_ptr + slot * LATENT
    _write_bf16_part(src, dst, NOPE, slot, IN_BF16)
    _write_bf16_part(src + NOPE, dst + NOPE, ROPE, slot, IN_BF16)


@triton.jit
def gather_bf16_kernel(slots_ptr, cache_i16_ptr, out_ptr, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    src = cache_i16_ptr + _slot(slots_ptr, pid) * LATENT
    dst = out_ptr + pid.to(tl.int64) * LATENT
    _gather_bf16_part(src, dst, NOPE, OUT_BF16)
    _gather_bf16_part(src + NOPE, dst + NOPE, ROPE, OUT_BF16)


# ---- fp8_e4m3: 576 x e4m3 of x / scale, one fp32 scale per layer -----------------------------------------------
@triton.jit
def _write_fp8_part(src, dst_u8, scale, N: tl.constexpr, slot, IN_BF16: tl.constexpr):
    offs = tl.arange(0, N)
    x = _load_values(src + offs, offs < N, IN_BF16)
    code = tl.where(_nonfinite(x), E4M3_NAN, _e4m3_code(tl.math.div_rn(x, scale)))
    tl.store(dst_u8 + offs, code.to(tl.uint8), mask=_written(offs, slot))


@triton.jit
def write_fp8_tensor_kernel(values_ptr, stride_v, slots_ptr, cache_u8_ptr, scale, IN_BF16: tl.constexpr):
    pid = tl.program_id(0)
    slot = _slot(slots_ptr, pid)
    src = values_ptr + pid.to(tl.int64) * stride_v
    dst = cache_u8_ptr + slot * LATENT
    _write_fp8_part(src, dst, scale, NOPE, slot, IN_BF16)
    _write_fp8_part(src + NOPE, dst + NOPE, scale, ROPE, slot, IN_BF16)


@triton.jit
def _gather_fp8_part(src_u8, dst, scale, N: tl.constexpr, OUT_BF16: tl.constexpr):
    offs = tl.arange(0, N)
    value = _e4m3_value(tl.load(src_u8 + offs).to(tl.int32)) * scale
    tl.store(dst + offs, _out_value(value, OUT_BF16))


@triton.jit
def gather_fp8_tensor_kernel(slots_ptr, cache_u8_ptr, out_ptr, scale, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    src = cache_u8_ptr + _slot(slots_ptr, pid) * LATENT
    dst = out_ptr + pid.to(tl.int64) * LATENT
    _gather_fp8_part(src, dst, scale, NOPE, OUT_BF16)
    _gather_fp8_part(src + NOPE, dst + NOPE, scale, ROPE, OUT_BF16)


# ---- fp8_ds_mla: [512 e4m3 | 4 fp32 tile scales | 64 bf16 rope], 656 bytes ------------------------------------
@triton.jit
def write_fp8_ds_mla_kernel(values_ptr, stride_v, slots_ptr, cache_u8_ptr, cache_i16_ptr, cache_i32_ptr,
                            POW2: tl.constexpr, IN_BF16: tl.constexpr):
    pid = tl.program_id(0)
    slot = _slot(slots_ptr, pid)
    src = values_ptr + pid.to(tl.int64) * stride_v
    tile = tl.arange(0, 4)
    offs = tile[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = _load_values(src + offs, offs < NOPE, IN_BF16)
    amax = tl.max(_magnitude(x), axis=1)
    bad = tl.max(_nonfinite(x).to(tl.int32), axis=1) > 0
    ratio = tl.math.div_rn(amax, 448.0)
    if POW2:
        scale = _pow2_ceil(tl.maximum(ratio, 1e-4))
    else:
        scale = tl.maximum(ratio, FLT_MIN)
    scale_bits = tl.where(bad, F32_NAN_BITS, _bits(scale))
    code = _e4m3_code(tl.math.div_rn(x, _from_bits(scale_bits)[:, None]))
    tl.store(cache_u8_ptr + slot * 656 + offs, code.to(tl.uint8), mask=_written(offs, slot))
    tl.store(cache_i32_ptr + slot * 164 + 128 + tile, scale_bits, mask=_written(tile, slot))
    _write_bf16_part(src + NOPE, cache_i16_ptr + slot * 328 + 264, ROPE, slot, IN_BF16)


@triton.jit
def gather_fp8_ds_mla_kernel(slots_ptr, cache_u8_ptr, cache_i16_ptr, cache_i32_ptr, out_ptr, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    slot = _slot(slots_ptr, pid)
    dst = out_ptr + pid.to(tl.int64) * LATENT
    offs = tl.arange(0, 4)[:, None] * 128 + tl.arange(0, 128)[None, :]
    scale = _from_bits(tl.load(cache_i32_ptr + slot * 164 + 128 + tl.arange(0, 4)))
    value = _e4m3_value(tl.load(cache_u8_ptr + slot * 656 + offs).to(tl.int32)) * scale[:, None]
    tl.store(dst + offs, _out_value(value, OUT_BF16))
    _gather_bf16_part(cache_i16_ptr + slot * 328 + 264, dst + NOPE, ROPE, OUT_BF16)


# ---- MX fp4 (fp4_mx16, mxfp4_nsa): packed e2m1, low nibble = even element, ue8m0 block scales -----------------
@triton.jit
def write_mx_kernel(values_ptr, stride_v, slots_ptr, cache_u8_ptr, cache_i16_ptr, BPT: tl.constexpr,
                    DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_POW2: tl.constexpr,
                    FLOOR_AFTER_DIVIDE: tl.constexpr, ROPE_BF16: tl.constexpr, IN_BF16: tl.constexpr):
    """``DIM`` values in ``DIM // BLOCK`` blocks (padded to ``BLOCKS_POW2`` rows): ``[DIM/2 packed | DIM/BLOCK
    ue8m0]``, then 64 bf16 rope values when ``ROPE_BF16``. Scale ``2^ceil(log2(max(amax / 6, 1e-10)))`` when
    ``FLOOR_AFTER_DIVIDE``, else ``2^ceil(log2(max(amax, 1e-12) / 6))``."""
    pid = tl.program_id(0)
    slot = _slot(slots_ptr, pid)
    src = values_ptr + pid.to(tl.int64) * stride_v
    row = cache_u8_ptr + slot * BPT
    block = tl.arange(0, BLOCKS_POW2)
    pair = tl.arange(0, BLOCK // 2)
    in_row = (block[:, None] < DIM // BLOCK) & (pair[None, :] >= 0)
    even = block[:, None] * BLOCK + 2 * pair[None, :]
    x_even = _load_values(src + even, in_row, IN_BF16)
    x_odd = _load_values(src + even + 1, in_row, IN_BF16)
    amax = tl.maximum(tl.max(_magnitude(x_even), axis=1), tl.max(_magnitude(x_odd), axis=1))
    bad = tl.max((_nonfinite(x_even) | _nonfinite(x_odd)).to(tl.int32), axis=1) > 0
    if FLOOR_AFTER_DIVIDE:
        den = _pow2_ceil(tl.maximum(tl.math.div_rn(amax, 6.0), 1e-10))
    else:
        den = _pow2_ceil(tl.math.div_rn(tl.maximum(amax, 1e-12), 6.0))
    packed = _e2m1_code_away(x_even, den[:, None]) | (_e2m1_code_away(x_odd, den[:, None]) << 4)
    packed = tl.where(bad[:, None], 0, packed)
    tl.store(row + block[:, None] * (BLOCK // 2) + pair[None, :], packed.to(tl.uint8),
             mask=in_row & _written(even, slot))
    scale_byte = tl.where(bad, 0xFF, _bits(den) >> 23)
    tl.store(row + DIM // 2 + block, scale_byte.to(tl.uint8), mask=(block < DIM // BLOCK) & _written(block, slot))
    if ROPE_BF16:
        rope_at = (DIM // 2 + DIM // BLOCK) // 2
        _write_bf16_part(src + DIM, cache_i16_ptr + slot * (BPT // 2) + rope_at, ROPE, slot, IN_BF16)


@triton.jit
def gather_mx_kernel(slots_ptr, cache_u8_ptr, cache_i16_ptr, out_ptr, BPT: tl.constexpr, DIM: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCKS_POW2: tl.constexpr, ROPE_BF16: tl.constexpr,
                     OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    slot = _slot(slots_ptr, pid)
    row = cache_u8_ptr + slot * BPT
    dst = out_ptr + pid.to(tl.int64) * LATENT
    block = tl.arange(0, BLOCKS_POW2)
    pair = tl.arange(0, BLOCK // 2)
    in_row = (block[:, None] < DIM // BLOCK) & (pair[None, :] >= 0)
    packed = tl.load(row + block[:, None] * (BLOCK // 2) + pair[None, :], mask=in_row, other=0).to(tl.int32)
    scale = _ue8m0_value(tl.load(row + DIM // 2 + block, mask=block < DIM // BLOCK, other=0).to(tl.int32))
    even = block[:, None] * BLOCK + 2 * pair[None, :]
    tl.store(dst + even, _out_value(_e2m1_value(packed & 0xF) * scale[:, None], OUT_BF16), mask=in_row)
    tl.store(dst + even + 1, _out_value(_e2m1_value(packed >> 4) * scale[:, None], OUT_BF16), mask=in_row)
    if ROPE_BF16:
        rope_at = (DIM // 2 + DIM // BLOCK) // 2
        _gather_bf16_part(cache_i16_ptr + slot * (BPT // 2) + rope_at, dst + DIM, ROPE, OUT_BF16)


# ---- nvfp4: [256 packed e2m1 | 32 e4m3 scales per 16 | 64 bf16 rope] + fp32 global scale ----------------------
@triton.jit
def write_nvfp4_kernel(values_ptr, stride_v, slots_ptr, cache_u8_ptr, cache_i16_ptr, global_scale,
                       IN_BF16: tl.constexpr):
    pid = tl.program_id(0)
    slot = _slot(slots_ptr, pid)
    src = values_ptr + pid.to(tl.int64) * stride_v
    row = cache_u8_ptr + slot * 416
    block = tl.arange(0, 32)
    pair = tl.arange(0, 8)
    even = block[:, None] * 16 + 2 * pair[None, :]
    x_even = _load_values(src + even, even < NOPE, IN_BF16)
    x_odd = _load_values(src + even + 1, even < NOPE, IN_BF16)
    amax = tl.maximum(tl.max(_magnitude(x_even), axis=1), tl.max(_magnitude(x_odd), axis=1))
    bad = tl.max((_nonfinite(x_even) | _nonfinite(x_odd)).to(tl.int32), axis=1) > 0
    scale_code = tl.where(bad, E4M3_NAN, _e4m3_code(tl.math.div_rn(amax, global_scale * 6.0)))
    den = _e4m3_value(scale_code) * global_scale
    packed = _e2m1_code_even(x_even, den[:, None]) | (_e2m1_code_even(x_odd, den[:, None]) << 4)
    tl.store(row + block[:, None] * 8 + pair[None, :], packed.to(tl.uint8), mask=_written(even, slot))
    tl.store(row + 256 + block, scale_code.to(tl.uint8), mask=_written(block, slot))
    _write_bf16_part(src + NOPE, cache_i16_ptr + slot * 208 + 144, ROPE, slot, IN_BF16)


@triton.jit
def gather_nvfp4_kernel(slots_ptr, cache_u8_ptr, cache_i16_ptr, out_ptr, global_scale, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    slot = _slot(slots_ptr, pid)
    row = cache_u8_ptr + slot * 416
    dst = out_ptr + pid.to(tl.int64) * LATENT
    block = tl.arange(0, 32)
    pair = tl.arange(0, 8)
    packed = tl.load(row + block[:, None] * 8 + pair[None, :]).to(tl.int32)
    scale = _e4m3_value(tl.load(row + 256 + block).to(tl.int32))
    even = block[:, None] * 16 + 2 * pair[None, :]
    # e2m1 * e4m3 is exact in fp32; the one rounding is the product with the global scale, as in the reference
    tl.store(dst + even, _out_value((_e2m1_value(packed & 0xF) * scale[:, None]) * global_scale, OUT_BF16))
    tl.store(dst + even + 1, _out_value((_e2m1_value(packed >> 4) * scale[:, None]) * global_scale, OUT_BF16))
    _gather_bf16_part(cache_i16_ptr + slot * 208 + 144, dst + NOPE, ROPE, OUT_BF16)
