"""The 64-row quantized decode split step in Gluon, for Hopper: ``sparse_wgmma``'s step over the paged cache.

64 query rows (64 or 128 heads, 16 heads x 4 tokens) fill wgmma's M, so the rows are on M as in ``decode_wgmma``
(bf16), and a step of 64 keys is ``sparse_wgmma``'s (its helpers, shared), for five cache layouts (``LAYOUTS``;
fp4_mx16, tried on the branch ``rows64-mx16``, ran slower than the Triton kernel: NOTES.md, session 29):

- the keys' rows come through the block table (``decode_wgmma_fp8._slots``) and are copied with ``cp.async``
  (masked: keys past the item's range are zeros) into buffers the decode reads once: the latent codes (fp8: 512
  e4m3 codes; FP4: 256 bytes of packed e2m1), fp8_e4m3's 64 rope codes, the FP4 layouts' block scales; the bf16
  rope and fp8_ds_mla's tile scales, read by the products, into two stages. Step ``j + 1``'s copies are issued once
  step ``j``'s codes are decoded and run behind its products; its rows were requested into L2 a step before (one
  bulk request in pages of whole steps);
- the codes are decoded once into the float16 keys both products read: e4m3 -> float16 (exact; fp8_ds_mla_pow2's
  times each tile's ratio to its key's largest tile scale, a power of two: ``sparse_wgmma._key_scales``); FP4 through
  ``decode_ws``'s PTX on packed words, nvfp4's values times their e4m3 block scales (exact), mxfp4_nsa's times
  ``2^(k - kmax)``, ``kmax`` the largest of the key's 16 block exponents, its scale ``2^kmax`` stored beside
  (float32; blocks more than 2^-23 below the key's largest lose bits, as ``decode_ws``'s below their tile's);
  fp8_e4m3's rope e4m3 -> bf16 (exact). Warpgroup ``w`` scores keys ``[32 w, 32 w + 32)``, fp8_ds_mla's code tiles
  each scaled by its per-key tile scale as it completes, fp8_ds_mla_pow2's and mxfp4_nsa's sum by the key scale;
- ``P`` goes to shared memory in float16 (with scales: ``P * scale / u``, per value tile for fp8_ds_mla, once for
  the key-scaled layouts, the accumulators in units of ``u``, the largest scale seen so far; without: ``P``), and
  warpgroup ``w`` multiplies it by 64 of each tile's 128 columns. Layer scales: fp8_e4m3's in ``qk_scale`` and
  ``out_scale``, nvfp4's (latent keys only) in the query rows' factor and ``out_scale`` (the plan's).

Rows' causal frontiers mask the scores (``decode_wgmma._row_limits``); work items, partials and merge are those of
every decode split kernel. Measured against the Triton kernel's 64-row configuration: NOTES.md, sessions 28-29.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from impls.triton.decode_kernel import ITEM_FIELDS, NOPE, ROPE, TILE
from impls.triton.decode_wgmma import (COPY_LAYOUT, SCORE_LAYOUT, SWIZZLED, _async_load, _cta_barrier, _item_fields,
                                       _launch_dependents, _program_items, _row_at, _row_limits, _store_item)
from impls.triton.decode_wgmma_fp8 import _as_words, _prefetch_page_step, _slots
from impls.triton.decode_ws import (_E2M1_WORDS_TIMES_FACTORS, _E2M1_WORDS_TIMES_SCALES, FP4_KEYS, FP4_WORDS,
                                    MXFP4_ROPE_AT, MXFP4_ROW_BYTES, MXFP4_SCALES_AT, NVFP4_ROPE_AT, NVFP4_ROW_BYTES,
                                    NVFP4_SCALES_AT, _e2m1_words, _factor_bits, _ue8m0_scale)
from impls.triton.sparse_wgmma import (CODE_LAYOUT, PLAIN, ROW_BYTES, SCALE_LAYOUT, _copy_bf16_rope, _copy_codes,
                                       _copy_rows_of_step, _decode_tile, _initial_state, _scores, _softmax_and_values,
                                       _stage_query, _step_buffers, _tiles, _wait_and_decode)

KEYS = gl.constexpr(64)  # keys per step
E4M3_ROW = gl.constexpr(576)  # fp8_e4m3: 512 latent | 64 rope codes
# fp8_e4m3's rope codes [64 keys, 64 bytes]: copied 16 bytes a thread, decoded 8 (16 bytes of bf16) a thread.
ROPE_CODE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                                 warps_per_cta=[8, 1], order=[1, 0]))
ROPE_DECODE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                   warps_per_cta=[8, 1], order=[1, 0]))
# FP4 packed codes, a tile [64 keys, 4 chunks, 4 words] (decode_ws.FP4_WORDS: a thread's 16 bytes, 32 values), laid
# out chunk by chunk: the eight keys of a quarter-warp's loads are 128 contiguous bytes (rows of 64 bytes would put
# four of them in each bank group).
PACKED_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 0, 1]))
# Block scales [64 keys, 16], copied 8 bytes (nvfp4's e4m3 pairs) or 4 bytes (mxfp4_nsa's ue8m0) a thread.
BLOCKS_COPY = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[8, 1],
                                            order=[1, 0]))
# mxfp4_nsa's block exponents [64 keys, 16], a key's 16 in each of the four threads that decode its tiles' chunks
# (FP4_WORDS' lanes: eight keys, then four chunks): its largest needs no exchange between threads.
KEY_BLOCKS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4], warps_per_cta=[8, 1],
                                           order=[0, 1]))
# The cache layouts this kernel reads.
LAYOUTS = ("fp8_ds_mla", "fp8_ds_mla_pow2", "fp8_e4m3", "nvfp4", "mxfp4_nsa")


@gluon.jit
def _copy_step(cache, pages, start, kv_end, codes, scales, rope, stage, PAGE_SIZE: gl.constexpr):
    """Issue the fp8_ds_mla copies of keys ``[start, start + 64)`` (through the block-table row ``pages``; none
    past ``kv_end``): codes into ``codes``, tile scales and rope into stage ``stage``."""
    code_at, code_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, CODE_LAYOUT), ROW_BYTES)
    scale_at, scale_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(0, SCALE_LAYOUT), ROW_BYTES)
    rope_at, rope_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, COPY_LAYOUT), ROW_BYTES)
    _copy_rows_of_step(cache + code_at, code_ok, cache + scale_at, scale_ok, cache + rope_at, rope_ok, codes, scales,
                       rope, stage)


@gluon.jit
def _copy_e4m3_step(cache, pages, start, kv_end, codes, rope_codes, PAGE_SIZE: gl.constexpr):
    """Issue the fp8_e4m3 copies of keys ``[start, start + 64)``: the latent codes into ``codes``, the rope codes
    into ``rope_codes``."""
    code_at, code_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, CODE_LAYOUT), E4M3_ROW)
    _copy_codes(cache + code_at, code_ok, codes)
    rope_at, rope_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, ROPE_CODE_LAYOUT), E4M3_ROW)
    rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_CODE_LAYOUT))[None, :]
    _async_load(rope_codes, (cache + rope_at + NOPE)[:, None] + rope_cols, mask=rope_ok[:, None])


@gluon.jit
def _copy_fp4_step(cache, pages, start, kv_end, packed, blocks, rope, stage, PAGE_SIZE: gl.constexpr,
                   LAYOUT: gl.constexpr):
    """Issue the copies of keys ``[start, start + 64)`` of an FP4 layout with bf16 rope (nvfp4, mxfp4_nsa): each
    tile's 64 bytes of packed codes into ``packed`` (16 bytes a thread), the block scales into ``blocks``, the rope
    into stage ``stage``."""
    NV: gl.constexpr = LAYOUT == "nvfp4"
    ROW: gl.constexpr = NVFP4_ROW_BYTES if NV else MXFP4_ROW_BYTES
    at, ok = _slots(pages, start, kv_end, PAGE_SIZE, FP4_KEYS, ROW)
    chunks = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, FP4_WORDS)))[None, :, None]
    words = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, FP4_WORDS)))[None, None, :]
    for t in gl.static_range(4):
        first = (cache + at + TILE // 2 * t).to(gl.pointer_type(gl.int32))
        _async_load(packed[t], first[:, None, None] + 4 * chunks + words, mask=ok[:, None, None])
    block_at, block_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, BLOCKS_COPY), ROW)
    block_cols = gl.arange(0, 16, layout=gl.SliceLayout(0, BLOCKS_COPY))[None, :]
    if NV:  # 32 e4m3 scales as 16 int16 pairs
        block_first = (cache + block_at + NVFP4_SCALES_AT).to(gl.pointer_type(gl.int16))
    else:
        block_first = cache + block_at + MXFP4_SCALES_AT
    _async_load(blocks, block_first[:, None] + block_cols, mask=block_ok[:, None])
    rope_at, rope_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, COPY_LAYOUT), ROW)
    _copy_bf16_rope(cache + rope_at + (NVFP4_ROPE_AT if NV else MXFP4_ROPE_AT), rope_ok, rope.index(stage))


@gluon.jit
def _copy(cache, pages, start, kv_end, codes, side, scales, rope, stage, PAGE_SIZE: gl.constexpr,
          LAYOUT: gl.constexpr):
    """Issue the copies of keys ``[start, start + 64)`` of ``LAYOUT`` into the step's buffers (the kernel's)."""
    if LAYOUT == "fp8_e4m3":
        _copy_e4m3_step(cache, pages, start, kv_end, codes, side, PAGE_SIZE)
    elif LAYOUT == "nvfp4" or LAYOUT == "mxfp4_nsa":
        _copy_fp4_step(cache, pages, start, kv_end, codes, side, rope, stage, PAGE_SIZE, LAYOUT)
    else:
        _copy_step(cache, pages, start, kv_end, codes, scales, rope, stage, PAGE_SIZE)


@gluon.jit
def _key_exponents(blocks, key_scales):
    """mxfp4_nsa: each key's largest block exponent ``kmax`` over its 16 blocks, along ``FP4_KEYS``; its scale
    ``2^kmax`` (float32) into ``key_scales`` ``[1, 64]``."""
    kmax = gl.max(blocks.load(KEY_BLOCKS).to(gl.int32), 1)
    key_scales.permute((1, 0)).store(_ue8m0_scale(kmax)[:, None])
    return gl.convert_layout(kmax, FP4_KEYS)  # the same threads hold each key: no data moves


@gluon.jit
def _decode_fp4_tile(packed, blocks, kmax, keys, t: gl.constexpr, LAYOUT: gl.constexpr):
    """FP4 tile ``t`` of the step into the keys both products read, float16 (``decode_ws``'s PTX): nvfp4's values
    times their e4m3 block scales (exact); mxfp4_nsa's times ``2^(k - kmax)``, ``kmax`` the key's largest block
    exponent (``_key_exponents``)."""
    codes = packed[t].load(FP4_WORDS)
    if LAYOUT == "nvfp4":
        pairs = blocks.slice(4 * t, 4, 1).load(gl.SliceLayout(2, FP4_WORDS))
        words = _e2m1_words(codes, pairs[:, :, None], _E2M1_WORDS_TIMES_SCALES, "r,r")
    else:
        exponents = blocks.slice(4 * t, 4, 1).load(gl.SliceLayout(2, FP4_WORDS)).to(gl.int32)
        factor = _factor_bits(exponents, kmax[:, None])
        words = _e2m1_words(codes, (factor | (factor << 16))[:, :, None], _E2M1_WORDS_TIMES_FACTORS, "r,r,r,r")
    _as_words(keys[t]).store(words)


@gluon.jit
def _wait_and_decode_step(q_rope, codes, side, step_scales, key_scales, rope, keys, zero, LAYOUT: gl.constexpr):
    """``sparse_wgmma._wait_and_decode`` for every layout: wait for the step's copies, issue the rope product (bf16
    rope: before the decode, which it runs behind; fp8_e4m3's rope codes are decoded first, e4m3 -> bf16, exact)
    and decode the latent codes into ``keys`` (fp8_ds_mla_pow2's and mxfp4_nsa's relative to each key's scale,
    stored into ``key_scales``: from the copied tile scales ``step_scales``, from the block exponents); returns the
    rope product."""
    if LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2":
        s_rope = _wait_and_decode(q_rope, rope, codes, step_scales, key_scales, keys, zero,
                                  LAYOUT == "fp8_ds_mla_pow2")
    else:
        async_copy.wait_group(0)
        hopper.fence_async_shared()
        _cta_barrier()
        if LAYOUT == "fp8_e4m3":
            rope.store(side.load(ROPE_DECODE_LAYOUT).to(gl.float8e4nv, bitcast=True).to(gl.bfloat16))
            for t in gl.static_range(4):
                _decode_tile(codes, keys, t)
        else:
            s_rope = hopper.warpgroup_mma(q_rope, rope.permute((1, 0)), zero, use_acc=False, is_async=True)
            kmax = _key_exponents(side, key_scales) if LAYOUT == "mxfp4_nsa" else 0
            for t in gl.static_range(4):
                _decode_fp4_tile(codes, side, kmax, keys, t, LAYOUT)
        hopper.fence_async_shared()
        _cta_barrier()
        if LAYOUT == "fp8_e4m3":
            s_rope = hopper.warpgroup_mma(q_rope, rope.permute((1, 0)), zero, use_acc=False, is_async=True)
    return s_rope


@gluon.jit
def _decode_split_kernel_quantized(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, work, items_stride, item_counts,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads, nope_scale, out_scale,
    ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr,
    LAYOUT: gl.constexpr, WAIT_PRIOR: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of 64 query rows; ``cache``
    is the uint8 paged cache of ``LAYOUT`` (``LAYOUTS``). ``nope_scale``: nvfp4's layer scale of the latent keys;
    ``out_scale``: the layer scale of the values (nvfp4's and fp8_e4m3's; 1 for the others), on the final outputs.
    ``EARLY_MERGE``: let the merge kernel, a programmatic dependent launch, start now (it waits for this grid's
    results on the device)."""
    gl.static_assert(ROWS == 64, "64 query rows: wgmma's M")
    if EARLY_MERGE:
        _launch_dependents()
    # The step's shared memory (sparse_wgmma._step_buffers' for fp8_ds_mla): the query, the latent codes (four
    # tiles), the side bytes (fp8_e4m3's rope codes, the FP4 layouts' block scales), fp8_ds_mla's tile scales in two
    # stages as copied, the key scales (fp8_ds_mla_pow2's and mxfp4_nsa's as decoded), the bf16 rope (two stages
    # where it is copied, one where decoded), the decoded keys and P (one buffer for all four value tiles but
    # fp8_ds_mla's).
    if LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2":
        q_nope, q_rope, codes, scales, key_scales, rope, keys, probs = _step_buffers(ROWS, LAYOUT == "fp8_ds_mla_pow2")
        side = None
    else:
        q_nope = _tiles(gl.float16, [ROWS, TILE], SWIZZLED)
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [ROWS, ROPE], SWIZZLED)
        keys = _tiles(gl.float16, [KEYS, TILE], SWIZZLED)
        scales = None
        key_scales = None
        probs = gl.allocate_shared_memory(gl.float16, [ROWS, KEYS], SWIZZLED)
        if LAYOUT == "fp8_e4m3":
            codes = _tiles(gl.uint8, [KEYS, TILE], PLAIN)
            side = gl.allocate_shared_memory(gl.uint8, [KEYS, ROPE], PLAIN)
            rope = gl.allocate_shared_memory(gl.bfloat16, [KEYS, ROPE], SWIZZLED)
        else:
            codes = _tiles(gl.int32, [KEYS, 4, 4], PACKED_SMEM)
            rope = gl.allocate_shared_memory(gl.bfloat16, [2, KEYS, ROPE], SWIZZLED)
            if LAYOUT == "nvfp4":
                side = gl.allocate_shared_memory(gl.int16, [KEYS, 16], PLAIN)
            else:
                side = gl.allocate_shared_memory(gl.uint8, [KEYS, 16], PLAIN)
                key_scales = gl.allocate_shared_memory(gl.float32, [1, KEYS], PLAIN)
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    for i in range(items):
        _attend_item(_item_fields(table + i * ITEM_FIELDS), q, stride_qt, stride_qh, cache, block_table, stride_bt,
                     visible, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                     nope_scale, out_scale, q_nope, q_rope, codes, side, scales, key_scales, rope, keys, probs, ROWS,
                     PAGE_SIZE, KEEP_PARTIALS, LAYOUT)


@gluon.jit
def _attend_item(item, q, stride_qt, stride_qh, cache, block_table, stride_bt, visible,
                 out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads, nope_scale,
                 out_scale, q_nope, q_rope, codes, side, scales, key_scales, rope, keys, probs, ROWS: gl.constexpr,
                 PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, LAYOUT: gl.constexpr):
    """One work item (``_item_fields``): 64 query rows of one request over keys ``[kv_start, kv_end)``."""
    ROW: gl.constexpr = (E4M3_ROW if LAYOUT == "fp8_e4m3" else NVFP4_ROW_BYTES if LAYOUT == "nvfp4"
                         else MXFP4_ROW_BYTES if LAYOUT == "mxfp4_nsa" else ROW_BYTES)
    STAGED_ROPE: gl.constexpr = LAYOUT != "fp8_e4m3"  # copied bf16 rope: two stages (its product runs past the copy)
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = item
    pages = block_table + request.to(gl.int64) * stride_bt
    _copy(cache, pages, kv_start, kv_end, codes, side, scales, rope, 0, PAGE_SIZE, LAYOUT)
    async_copy.commit_group()
    _prefetch_page_step(cache, pages, kv_start + KEYS, kv_end, PAGE_SIZE, ROW)
    rows_q = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, COPY_LAYOUT))
    q_base = _row_at(q, rows_q, q_first, num_heads, stride_qt, stride_qh)
    q_down = gl.convert_layout(  # staged behind the first copies
        _stage_query(q_base, rows_q < q_len * num_heads, q_nope, q_rope, COPY_LAYOUT), gl.SliceLayout(1, SCORE_LAYOUT))
    if LAYOUT == "nvfp4":  # its layer scale covers the latent keys only (fp8_e4m3's is in qk_scale)
        q_down = q_down * nope_scale
    _, _, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS,
                              gl.SliceLayout(1, SCORE_LAYOUT))
    key_cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, SCORE_LAYOUT))

    m_i, l_part, unit, zero, acc0, acc1, acc2, acc3 = _initial_state(ROWS)
    if scales is None and key_scales is None:
        unit = gl.to_tensor(1.0)  # no scales: the accumulators in plain units
    for j in range(gl.cdiv(kv_end - kv_start, KEYS)):
        start = kv_start + j * KEYS
        stage = j % 2
        _prefetch_page_step(cache, pages, start + 2 * KEYS, kv_end, PAGE_SIZE, ROW)
        if STAGED_ROPE:
            step_rope = rope.index(stage)
        else:
            step_rope = rope
        if LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2":
            copied_scales = scales.index(stage)
        else:
            copied_scales = scales
        s_rope = _wait_and_decode_step(q_rope, codes, side, copied_scales, key_scales, step_rope, keys, zero, LAYOUT)
        if start + KEYS < kv_end:
            _copy(cache, pages, start + KEYS, kv_end, codes, side, scales, rope, 1 - stage, PAGE_SIZE, LAYOUT)
        async_copy.commit_group()
        if LAYOUT == "fp8_ds_mla":  # per tile; per key where the decode folded them (key_scales), or none
            step_scales = copied_scales
        else:
            step_scales = key_scales
        s = gl.where((start + key_cols)[None, :] < limit[:, None],
                     _scores(s_rope, q_nope, keys, step_scales, q_down, qk_scale, zero), float("-inf"))
        m_i, l_part, unit, acc0, acc1, acc2, acc3 = _softmax_and_values(s, step_scales, probs, keys, m_i, l_part,
                                                                        unit, acc0, acc1, acc2, acc3)
    async_copy.wait_group(0)
    _cta_barrier()  # the next item's copies and query reuse the buffers
    _store_item(m_i, l_part, unit, out_scale, acc0, acc1, acc2, acc3, row_block, slot_out, q_first, q_len, num_heads,
                out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, ROWS, KEEP_PARTIALS)
