"""The 64-row FP8 decode split step in Gluon, for Hopper: ``sparse_wgmma``'s step over the paged cache.

64 query rows (64 or 128 heads, 16 heads x 4 tokens) fill wgmma's M, so the rows are on M as in ``decode_wgmma``
(bf16), and a step of 64 keys is ``sparse_wgmma``'s (its helpers, shared):

- the keys' rows come through the block table (``decode_wgmma_fp8._slots``) and are copied with ``cp.async``
  (masked: keys past the item's range are zeros): the 512 e4m3 codes into one buffer; fp8_ds_mla's tile scales and
  bf16 rope into two stages, fp8_e4m3's 64 e4m3 rope codes into one buffer. Step ``j + 1``'s copies are issued once
  step ``j``'s codes are decoded and run behind its products; its rows were requested into L2 a step before (one
  bulk request in pages of whole steps);
- the codes are decoded once, e4m3 -> float16 (exact), into the keys both products read (fp8_e4m3's rope e4m3 ->
  bf16, exact); warpgroup ``w`` scores keys ``[32 w, 32 w + 32)``, fp8_ds_mla's code tiles each scaled by its
  per-key float32 scale as it completes;
- ``P`` goes to shared memory in float16 (fp8_ds_mla: ``P * scale_t / u`` per value tile, the accumulators in
  units of ``u``, the largest tile scale seen so far), and warpgroup ``w`` multiplies it by 64 of each tile's 128
  columns. fp8_e4m3's layer scale is in ``qk_scale`` and ``out_scale`` (the plan's).

Rows' causal frontiers mask the scores (``decode_wgmma._row_limits``); work items, partials and merge are those of
every decode split kernel. Measured against the Triton kernel's 64-row configuration: NOTES.md, session 28.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from impls.triton.decode_kernel import ITEM_FIELDS, NOPE, ROPE, TILE
from impls.triton.decode_wgmma import (COPY_LAYOUT, SCORE_LAYOUT, SWIZZLED, _async_load, _cta_barrier, _item_fields,
                                       _launch_dependents, _program_items, _row_at, _row_limits, _store_item)
from impls.triton.decode_wgmma_fp8 import _prefetch_page_step, _slots
from impls.triton.sparse_wgmma import (CODE_LAYOUT, PLAIN, ROW_BYTES, SCALE_LAYOUT, _copy_rows_of_step,
                                       _decode_tile, _initial_state, _scores, _softmax_and_values, _stage_query,
                                       _step_buffers, _tiles, _wait_and_decode)

KEYS = gl.constexpr(64)  # keys per step
E4M3_ROW = gl.constexpr(576)  # fp8_e4m3: 512 latent | 64 rope codes
# fp8_e4m3's rope codes [64 keys, 64 bytes]: copied 16 bytes a thread, decoded 8 (16 bytes of bf16) a thread.
ROPE_CODE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                                 warps_per_cta=[8, 1], order=[1, 0]))
ROPE_DECODE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                   warps_per_cta=[8, 1], order=[1, 0]))


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
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, CODE_LAYOUT))[None, :]
    for t in gl.static_range(4):
        _async_load(codes[t], (cache + code_at)[:, None] + t * TILE + cols, mask=code_ok[:, None])
    rope_at, rope_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, ROPE_CODE_LAYOUT), E4M3_ROW)
    rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_CODE_LAYOUT))[None, :]
    _async_load(rope_codes, (cache + rope_at + NOPE)[:, None] + rope_cols, mask=rope_ok[:, None])


@gluon.jit
def _wait_and_decode_e4m3(q_rope, rope_codes, rope, codes, keys, zero):
    """``sparse_wgmma._wait_and_decode`` for fp8_e4m3: the rope codes are decoded too (e4m3 -> bf16, exact), so the
    rope product is issued after the decode."""
    async_copy.wait_group(0)
    hopper.fence_async_shared()
    _cta_barrier()
    rope.store(rope_codes.load(ROPE_DECODE_LAYOUT).to(gl.float8e4nv, bitcast=True).to(gl.bfloat16))
    for t in gl.static_range(4):
        _decode_tile(codes, keys, t)
    hopper.fence_async_shared()
    _cta_barrier()
    return hopper.warpgroup_mma(q_rope, rope.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _decode_split_kernel_fp8_rows(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, work, items_stride, item_counts,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads, out_scale,
    ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr,
    LAYOUT: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of 64 query rows; ``cache``
    is the uint8 paged cache of ``LAYOUT`` (fp8_ds_mla, its pow2 variant, or fp8_e4m3, whose layer scale
    ``out_scale`` multiplies the final outputs). ``EARLY_MERGE``: let the merge kernel, a programmatic dependent
    launch, start now (it waits for this grid's results on the device)."""
    gl.static_assert(ROWS == 64, "64 query rows: wgmma's M")
    if EARLY_MERGE:
        _launch_dependents()
    if LAYOUT == "fp8_e4m3":  # one buffer of rope codes and of P; no tile scales
        q_nope = _tiles(gl.float16, [ROWS, TILE], SWIZZLED)
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [ROWS, ROPE], SWIZZLED)
        codes = _tiles(gl.uint8, [KEYS, TILE], PLAIN)
        scales = gl.allocate_shared_memory(gl.uint8, [KEYS, ROPE], PLAIN)  # the rope codes
        rope = gl.allocate_shared_memory(gl.bfloat16, [KEYS, ROPE], SWIZZLED)
        keys = _tiles(gl.float16, [KEYS, TILE], SWIZZLED)
        probs = gl.allocate_shared_memory(gl.float16, [ROWS, KEYS], SWIZZLED)
    else:
        q_nope, q_rope, codes, scales, rope, keys, probs = _step_buffers(ROWS)
    table, items = _program_items(work, items_stride, item_counts)
    for i in range(items):
        _attend_item(_item_fields(table + i * ITEM_FIELDS), q, stride_qt, stride_qh, cache, block_table, stride_bt,
                     visible, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                     out_scale, q_nope, q_rope, codes, scales, rope, keys, probs, ROWS, PAGE_SIZE, KEEP_PARTIALS,
                     LAYOUT)


@gluon.jit
def _attend_item(item, q, stride_qt, stride_qh, cache, block_table, stride_bt, visible,
                 out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads, out_scale,
                 q_nope, q_rope, codes, scales, rope, keys, probs, ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr,
                 KEEP_PARTIALS: gl.constexpr, LAYOUT: gl.constexpr):
    """One work item (``_item_fields``): 64 query rows of one request over keys ``[kv_start, kv_end)``. For
    fp8_e4m3, ``scales`` holds the rope codes."""
    E4M3: gl.constexpr = LAYOUT == "fp8_e4m3"
    ROW: gl.constexpr = E4M3_ROW if E4M3 else ROW_BYTES
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = item
    pages = block_table + request.to(gl.int64) * stride_bt
    if E4M3:
        _copy_e4m3_step(cache, pages, kv_start, kv_end, codes, scales, PAGE_SIZE)
    else:
        _copy_step(cache, pages, kv_start, kv_end, codes, scales, rope, 0, PAGE_SIZE)
    async_copy.commit_group()
    _prefetch_page_step(cache, pages, kv_start + KEYS, kv_end, PAGE_SIZE, ROW)
    rows_q = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, COPY_LAYOUT))
    q_base = _row_at(q, rows_q, q_first, num_heads, stride_qt, stride_qh)
    q_down = gl.convert_layout(  # staged behind the first copies
        _stage_query(q_base, rows_q < q_len * num_heads, q_nope, q_rope, COPY_LAYOUT), gl.SliceLayout(1, SCORE_LAYOUT))
    _, _, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS,
                              gl.SliceLayout(1, SCORE_LAYOUT))
    key_cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, SCORE_LAYOUT))

    m_i, l_part, unit, zero, acc0, acc1, acc2, acc3 = _initial_state(ROWS)
    if E4M3:
        unit = gl.to_tensor(1.0)  # no tile scales: the accumulators in plain units
    for j in range(gl.cdiv(kv_end - kv_start, KEYS)):
        start = kv_start + j * KEYS
        _prefetch_page_step(cache, pages, start + 2 * KEYS, kv_end, PAGE_SIZE, ROW)
        if E4M3:
            s_rope = _wait_and_decode_e4m3(q_rope, scales, rope, codes, keys, zero)
            if start + KEYS < kv_end:
                _copy_e4m3_step(cache, pages, start + KEYS, kv_end, codes, scales, PAGE_SIZE)
            step_scales = None
        else:
            stage = j % 2
            s_rope = _wait_and_decode(q_rope, rope.index(stage), codes, keys, zero)
            if start + KEYS < kv_end:
                _copy_step(cache, pages, start + KEYS, kv_end, codes, scales, rope, 1 - stage, PAGE_SIZE)
            step_scales = scales.index(stage)
        async_copy.commit_group()
        s = gl.where((start + key_cols)[None, :] < limit[:, None],
                     _scores(s_rope, q_nope, keys, step_scales, q_down, qk_scale, zero), float("-inf"))
        m_i, l_part, unit, acc0, acc1, acc2, acc3 = _softmax_and_values(s, step_scales, probs, keys, m_i, l_part,
                                                                        unit, acc0, acc1, acc2, acc3)
    async_copy.wait_group(0)
    _cta_barrier()  # the next item's copies and query reuse the buffers
    _store_item(m_i, l_part, unit, out_scale, acc0, acc1, acc2, acc3, row_block, slot_out, q_first, q_len, num_heads,
                out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, ROWS, KEEP_PARTIALS)
