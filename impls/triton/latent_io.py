"""Reading latent tokens out of a paged cache in Triton: per-layout decoders and a gather kernel.

``load_latent`` decodes a tile of cache rows into ``(kv_c [BLOCK, 512], k_pe [BLOCK, 64])`` in the compute
dtype; kernels that attend straight from the cache (sparse PAGED) and ``gather_latent`` (chunked prefill's
context, sparse RAGGED's dequantized buffer) share it, so a layout is taught to every path in one place.
Layouts it decodes: ``bf16`` and ``fp8_ds_mla`` (656 B: 512 e4m3 | 4 float32 scales, one per 128 values |
64 bf16 rope; value = e4m3 * scale). Other layouts are refused with ``UnsupportedConfig``.

Interim module: issue 3 owns the generic Triton cache ops (write and gather for every layout, in
``impls/triton/cache_ops.py``); once they land, ``gather_latent`` should defer to them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import LATENT_DIM, PagedCache

LAYOUT_CODES = {"bf16": 0, "fp8_ds_mla": 1}


def layout_code(layout_name: str) -> int:
    """The kernels' constexpr for a layout; ``UnsupportedConfig`` for layouts they cannot decode."""
    try:
        return LAYOUT_CODES[layout_name]
    except KeyError:
        raise UnsupportedConfig(f"the Triton latent readers decode layouts {sorted(LAYOUT_CODES)}, "
                                f"not {layout_name!r}") from None


@triton.jit
def load_latent(cache_ptr, rows, valid, row_bytes, LAYOUT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Decode cache rows ``rows`` (int64 [BLOCK]; rows where ``valid`` is False read as 0) of a uint8 cache."""
    offs_c = tl.arange(0, 512)
    offs_r = tl.arange(0, 64)
    base = cache_ptr + rows * row_bytes
    if LAYOUT == 0:  # bf16: [kv_c 512 | k_pe 64] bfloat16
        row16 = base.to(tl.pointer_type(tl.bfloat16))
        kv_c = tl.load(row16[:, None] + offs_c[None, :], mask=valid[:, None], other=0.0)
        k_pe = tl.load(row16[:, None] + 512 + offs_r[None, :], mask=valid[:, None], other=0.0)
    else:  # fp8_ds_mla: 512 e4m3 | 4 float32 scales | 64 bf16 rope
        raw = tl.load(base[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
        scales = tl.load(((base + 512).to(tl.pointer_type(tl.float32)))[:, None] + (offs_c // 128)[None, :],
                         mask=valid[:, None], other=0.0)
        kv_c = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scales
        k_pe = tl.load(((base + 528).to(tl.pointer_type(tl.bfloat16)))[:, None] + offs_r[None, :],
                       mask=valid[:, None], other=0.0)
    return kv_c.to(OUT_DTYPE), k_pe.to(OUT_DTYPE)


@triton.jit
def _gather_kernel(cache_ptr, slots_ptr, out_ptr, n, num_slots, row_bytes, s_out,
                   LAYOUT: tl.constexpr, BLOCK_T: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = offs_t < n
    slots = tl.load(slots_ptr + offs_t, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slots >= 0) & (slots < num_slots)
    kv_c, k_pe = load_latent(cache_ptr, tl.where(valid, slots, 0), valid, row_bytes, LAYOUT,
                             out_ptr.dtype.element_ty)
    rows = out_ptr + offs_t.to(tl.int64)[:, None] * s_out
    tl.store(rows + tl.arange(0, 512)[None, :], kv_c, mask=in_range[:, None])
    tl.store(rows + 512 + tl.arange(0, 64)[None, :], k_pe, mask=in_range[:, None])


def gather_latent(cache: PagedCache, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode the tokens at cache ``slots`` ``[n]`` into ``out[:n]`` (``[>= n, 576]``, bf16/fp16/fp32).

    A slot outside the cache (or negative) yields a row of zeros: callers pass real token slots only.
    """
    code = layout_code(cache.layout.name)
    n = slots.shape[0]
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gather_latent: slots must be int32/int64 [n], got {slots.dtype} {list(slots.shape)}")
    if out.dim() != 2 or out.shape[1] != LATENT_DIM or out.shape[0] < n or out.stride(1) != 1:
        raise ValueError(f"gather_latent: out must be [>= {n}, {LATENT_DIM}] contiguous rows, got {list(out.shape)}")
    if n:
        block_t = 16
        _gather_kernel[(triton.cdiv(n, block_t),)](
            cache.rows(), slots, out, n, cache.num_slots, cache.layout.bytes_per_token, out.stride(0),
            LAYOUT=code, BLOCK_T=block_t)
    return out[:n]
