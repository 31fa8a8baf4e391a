"""The 64-row ``fp8_ds_mla`` decode split step in Gluon, for Hopper: ``sparse_wgmma``'s step over the paged cache.

64 query rows (64 or 128 heads, 16 heads x 4 tokens) fill wgmma's M, so the rows are on M as in ``decode_wgmma``
(bf16), and a step of 64 keys is ``sparse_wgmma``'s (its helpers, shared):

- the keys' 656-byte rows come through the block table (``decode_wgmma_fp8._slots``) and are copied with
  ``cp.async`` (masked: keys past the item's range are zeros): the codes into one buffer, the tile scales and the
  rope into two stages; step ``j + 1``'s copies are issued once step ``j``'s codes are decoded and run behind its
  products, and its rows were requested into L2 a step before (one bulk request in pages of whole steps);
- the codes are decoded once, e4m3 -> float16 (exact), into the keys both products read; warpgroup ``w`` scores
  keys ``[32 w, 32 w + 32)``, each code tile's product scaled by its per-key float32 scale as it completes;
- ``P * scale_t / u`` goes to shared memory in float16 per value tile, and warpgroup ``w`` multiplies it by 64 of
  each tile's 128 columns; the accumulators are in units of ``u``, the largest tile scale seen so far.

Rows' causal frontiers mask the scores (``decode_wgmma._row_limits``); work items, partials and merge are those of
every decode split kernel. Measured against the Triton kernel's 64-row configuration: NOTES.md, session 28.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from impls.triton.decode_kernel import ITEM_FIELDS
from impls.triton.decode_wgmma import (COPY_LAYOUT, SCORE_LAYOUT, _cta_barrier, _item_fields,
                                       _launch_dependents, _program_items, _row_at, _row_limits, _store_item)
from impls.triton.decode_wgmma_fp8 import _prefetch_page_step, _slots
from impls.triton.sparse_wgmma import (CODE_LAYOUT, ROW_BYTES, SCALE_LAYOUT, _copy_rows_of_step, _initial_state,
                                       _scores, _softmax_and_values, _stage_query, _step_buffers, _wait_and_decode)

KEYS = gl.constexpr(64)  # keys per step


@gluon.jit
def _copy_step(cache, pages, start, kv_end, codes, scales, rope, stage, PAGE_SIZE: gl.constexpr):
    """Issue the copies of keys ``[start, start + 64)`` (through the block-table row ``pages``; none past
    ``kv_end``): codes into ``codes``, tile scales and rope into stage ``stage``."""
    code_at, code_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, CODE_LAYOUT), ROW_BYTES)
    scale_at, scale_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(0, SCALE_LAYOUT), ROW_BYTES)
    rope_at, rope_ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, COPY_LAYOUT), ROW_BYTES)
    _copy_rows_of_step(cache + code_at, code_ok, cache + scale_at, scale_ok, cache + rope_at, rope_ok, codes, scales,
                       rope, stage)


@gluon.jit
def _decode_split_kernel_fp8_rows(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, work, items_stride, item_counts,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
    ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of 64 query rows; ``cache``
    is the uint8 paged cache, ``ROW_BYTES`` per slot. ``EARLY_MERGE``: let the merge kernel, a programmatic
    dependent launch, start now (it waits for this grid's results on the device)."""
    gl.static_assert(ROWS == 64, "64 query rows: wgmma's M")
    if EARLY_MERGE:
        _launch_dependents()
    q_nope, q_rope, codes, scales, rope, keys, probs = _step_buffers(ROWS)
    table, items = _program_items(work, items_stride, item_counts)
    for i in range(items):
        _attend_item(_item_fields(table + i * ITEM_FIELDS), q, stride_qt, stride_qh, cache, block_table, stride_bt,
                     visible, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                     q_nope, q_rope, codes, scales, rope, keys, probs, ROWS, PAGE_SIZE, KEEP_PARTIALS)


@gluon.jit
def _attend_item(item, q, stride_qt, stride_qh, cache, block_table, stride_bt, visible,
                 out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                 q_nope, q_rope, codes, scales, rope, keys, probs, ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr,
                 KEEP_PARTIALS: gl.constexpr):
    """One work item (``_item_fields``): 64 query rows of one request over keys ``[kv_start, kv_end)``."""
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = item
    pages = block_table + request.to(gl.int64) * stride_bt
    _copy_step(cache, pages, kv_start, kv_end, codes, scales, rope, 0, PAGE_SIZE)
    async_copy.commit_group()
    _prefetch_page_step(cache, pages, kv_start + KEYS, kv_end, PAGE_SIZE, ROW_BYTES)
    rows_q = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, COPY_LAYOUT))
    q_base = _row_at(q, rows_q, q_first, num_heads, stride_qt, stride_qh)
    q_down = gl.convert_layout(  # staged behind the first copies
        _stage_query(q_base, rows_q < q_len * num_heads, q_nope, q_rope, COPY_LAYOUT), gl.SliceLayout(1, SCORE_LAYOUT))
    _, _, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS,
                              gl.SliceLayout(1, SCORE_LAYOUT))
    key_cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, SCORE_LAYOUT))

    m_i, l_part, unit, zero, acc0, acc1, acc2, acc3 = _initial_state(ROWS)
    for j in range(gl.cdiv(kv_end - kv_start, KEYS)):
        stage = j % 2
        start = kv_start + j * KEYS
        _prefetch_page_step(cache, pages, start + 2 * KEYS, kv_end, PAGE_SIZE, ROW_BYTES)
        s_rope = _wait_and_decode(q_rope, rope.index(stage), codes, keys, zero)
        if start + KEYS < kv_end:
            _copy_step(cache, pages, start + KEYS, kv_end, codes, scales, rope, 1 - stage, PAGE_SIZE)
        async_copy.commit_group()
        step_scales = scales.index(stage)
        s = gl.where((start + key_cols)[None, :] < limit[:, None],
                     _scores(s_rope, q_nope, keys, step_scales, q_down, qk_scale, zero), float("-inf"))
        m_i, l_part, unit, acc0, acc1, acc2, acc3 = _softmax_and_values(s, step_scales, probs, keys, m_i, l_part,
                                                                        unit, acc0, acc1, acc2, acc3)
    async_copy.wait_group(0)
    _cta_barrier()  # the next item's copies and query reuse the buffers
    _store_item(m_i, l_part, unit, acc0, acc1, acc2, acc3, row_block, slot_out, q_first, q_len, num_heads,
                out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, ROWS, KEEP_PARTIALS)
