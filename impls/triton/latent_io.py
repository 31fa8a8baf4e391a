"""Reading latent tokens out of a paged cache in Triton: per-layout decoders and a gather kernel.

``load_nope_tile`` / ``load_rope_tile`` decode 128 (or the 64 rope) columns of a tile of cache rows as
exact codes plus a float32 scale per row; kernels that attend straight from the cache (sparse) and
``gather_latent`` (chunked prefill's context) share them, so a layout is taught to every path in one place.
Layouts it decodes: ``bf16``; ``fp8_ds_mla`` and ``fp8_ds_mla_pow2`` (656 B: 512 e4m3 | 4 float32 scales, one
per 128 values | 64 bf16 rope; value = e4m3 * scale; with power-of-two scales the product is exact in bf16, so
that layout is dequantized in registers); and ``fp8_e4m3`` (576 e4m3 times the per-layer scale). Others (the
FP4 layouts) are refused with ``UnsupportedConfig``.

Relation to ``impls/triton/cache_ops.py`` (issue 3: write and gather kernels for every layout, FP4 included):
``gather_latent`` stays separate because the attention paths need what that API does not offer: decoding into a
caller's preallocated workspace (chunked prefill's memory bound, and no allocation in ``run``), float16 output,
no host synchronization (``gather_cache_triton`` validates slots with one), and the same tile decoders as the
sparse kernel. FP4 layouts are refused here; giving ``gather_cache_triton`` an ``out=`` and a float16 output would
let the chunked path take them from there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from impls.triton import common
from impls.triton.common import INTERPRETING, cast
from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import LATENT_DIM, PagedCache
from mla_bench.layouts.base import check_tensor_scale

LAYOUT_CODES = {"bf16": 0, "fp8_ds_mla": 1, "fp8_e4m3": 2, "fp8_ds_mla_pow2": 3}
LATENT_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what gather_latent writes
SCALED_CODES = (1, 2)  # layouts whose tiles come as codes plus a scale the kernels apply after their products


def layout_code(layout_name: str) -> int:
    """The kernels' constexpr for a layout; ``UnsupportedConfig`` for layouts they cannot decode."""
    try:
        return LAYOUT_CODES[layout_name]
    except KeyError:
        raise UnsupportedConfig(f"the Triton latent readers decode layouts {sorted(LAYOUT_CODES)}, "
                                f"not {layout_name!r}") from None


@triton.jit
def load_nope_tile(cache_ptr, rows, valid, row_bytes, tensor_scale, K: tl.constexpr, LAYOUT: tl.constexpr,
                   OUT_DTYPE: tl.constexpr):
    """Columns ``[128 K, 128 K + 128)`` of kv_c for cache rows ``rows`` (int64 [BLOCK]; rows where ``valid`` is
    False read as 0), split as ``(codes [BLOCK, 128] OUT_DTYPE, scale [BLOCK] float32)`` with value = codes * scale.
    The codes are exact in bf16/fp16 (bf16 values, e4m3 codes, or e4m3 times a power of two), so a kernel that
    applies the scale in float32 after its products reads the layout exactly, whatever the scale."""
    offs = K * 128 + tl.arange(0, 128)
    base = cache_ptr + rows * row_bytes
    ones = tl.full([rows.shape[0]], 1.0, tl.float32)
    if LAYOUT == 0:  # bf16: [kv_c 512 | k_pe 64] bfloat16
        codes = tl.load(base.to(tl.pointer_type(tl.bfloat16))[:, None] + offs[None, :], mask=valid[:, None],
                        other=0.0)
        scale = ones
    elif LAYOUT == 2:  # fp8_e4m3: 576 e4m3 of x / tensor_scale
        codes = tl.load(base[:, None] + offs[None, :], mask=valid[:, None], other=0)
        codes = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = ones * tensor_scale
    else:  # fp8_ds_mla(_pow2): 512 e4m3 | 4 float32 scales (one per 128) | 64 bf16 rope
        codes = tl.load(base[:, None] + offs[None, :], mask=valid[:, None], other=0)
        codes = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load((base + 512).to(tl.pointer_type(tl.float32)) + K, mask=valid, other=0.0)
        if LAYOUT == 3:  # power-of-two scales: code * scale is exact in bf16, so fold it in here
            codes = codes * scale[:, None]
            scale = ones
    return codes.to(OUT_DTYPE), scale


@triton.jit
def load_rope_tile(cache_ptr, rows, valid, row_bytes, tensor_scale, LAYOUT: tl.constexpr,
                   OUT_DTYPE: tl.constexpr):
    """k_pe of cache rows ``rows`` as ``(codes [BLOCK, 64] OUT_DTYPE, scale [BLOCK] float32)``, like
    ``load_nope_tile``."""
    offs = tl.arange(0, 64)
    base = cache_ptr + rows * row_bytes
    ones = tl.full([rows.shape[0]], 1.0, tl.float32)
    if LAYOUT == 0:
        codes = tl.load(base.to(tl.pointer_type(tl.bfloat16))[:, None] + 512 + offs[None, :], mask=valid[:, None],
                        other=0.0)
        scale = ones
    elif LAYOUT == 2:
        codes = tl.load(base[:, None] + 512 + offs[None, :], mask=valid[:, None], other=0)
        codes = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = ones * tensor_scale
    else:
        codes = tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + offs[None, :],
                        mask=valid[:, None], other=0.0)
        scale = ones
    return codes.to(OUT_DTYPE), scale


@triton.jit
def _store_dequantized(out_rows, col0, codes, scale, mask_rows, WIDTH: tl.constexpr, INTERP: tl.constexpr):
    values = codes.to(tl.float32) * scale[:, None]
    tl.store(out_rows[:, None] + col0 + tl.arange(0, WIDTH)[None, :], cast(values, out_rows.dtype.element_ty, INTERP),
             mask=mask_rows[:, None])


def cache_tensor_scale(cache: PagedCache) -> float:
    """The per-layer scale the kernels multiply by (1.0 for layouts without one, which never read it), checked again
    here: ``PagedCache`` checks it when built, but the field may be reassigned since (to NaN, or None)."""
    if not cache.layout.needs_tensor_scale:
        return 1.0
    check_tensor_scale(cache.layout.name, cache.tensor_scale)
    return float(cache.tensor_scale)


@triton.jit
def _gather_kernel(cache_ptr, slots_ptr, out_ptr, n, num_slots, row_bytes, tensor_scale, s_out,
                   LAYOUT: tl.constexpr, BLOCK_T: tl.constexpr, INTERP: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = offs_t < n
    slots = tl.load(slots_ptr + offs_t, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slots >= 0) & (slots < num_slots)
    rows = tl.where(valid, slots, 0)
    out_rows = out_ptr + offs_t.to(tl.int64) * s_out
    for k in tl.static_range(4):
        codes, scale = load_nope_tile(cache_ptr, rows, valid, row_bytes, tensor_scale, k, LAYOUT, tl.float32)
        _store_dequantized(out_rows, k * 128, codes, scale, in_range, 128, INTERP)
    codes, scale = load_rope_tile(cache_ptr, rows, valid, row_bytes, tensor_scale, LAYOUT, tl.float32)
    _store_dequantized(out_rows, 512, codes, scale, in_range, 64, INTERP)


def gather_latent(cache: PagedCache, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode the tokens at cache ``slots`` ``[n]`` into ``out[:n]`` (``[>= n, 576]``, bf16/fp16/fp32).

    A slot outside the cache (or negative) yields a row of zeros: callers pass real token slots only.
    """
    code = layout_code(cache.layout.name)
    n = slots.shape[0]
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64) or not slots.is_contiguous():
        raise ValueError(f"gather_latent: slots must be contiguous int32/int64 [n], got {slots.dtype} "
                         f"{list(slots.shape)} with strides {slots.stride()}")
    if out.dim() != 2 or out.shape[1] != LATENT_DIM or out.shape[0] < n or out.stride(1) != 1:
        raise ValueError(f"gather_latent: out must be [>= {n}, {LATENT_DIM}] contiguous rows, got {list(out.shape)}")
    if out.dtype not in LATENT_OUT_DTYPES:  # an int32 or uint8 out was written truncated
        raise ValueError(f"gather_latent: out must be one of {LATENT_OUT_DTYPES}, got {out.dtype}")
    if n:
        block_t = 64 if INTERPRETING else 16  # the interpreter pays per program and op, not per element
        with common.on_device(out.device):
            _gather_kernel[(triton.cdiv(n, block_t),)](
                cache.rows(), slots, out, n, cache.num_slots, cache.layout.bytes_per_token, cache_tensor_scale(cache),
                out.stride(0),
                LAYOUT=code, BLOCK_T=block_t, INTERP=INTERPRETING)
    return out[:n]
