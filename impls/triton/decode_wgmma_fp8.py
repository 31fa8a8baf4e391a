"""The 16- and 32-row ``fp8_ds_mla`` decode split step in Gluon, for Hopper: keys on wgmma's M side.

With 16 or 32 query rows (16 heads, one or two new tokens; 32 heads) the rows are too few for wgmma's M of 64, so
this kernel computes the products transposed: ``S^T = K Q^T`` with the step's 64 keys as M and the rows as N, and
``O^T += V^T P^T``. Per step of 64 keys, in one program of two warpgroups per multiprocessor:

- the step's codes, tile scales and rope were loaded into registers (as 32-bit words; the scales one a thread)
  during the previous step, whose rows had been requested into L2 a step before that;
- the codes are decoded once, e4m3 -> float16 (exact, two instructions per four codes), into shared memory that
  both products read, the scales stored beside them, and the next step's loads are issued;
- warpgroup w takes half of the rows: the rope product in bf16 and the four 128-column code products in float16,
  each scaled by its per-key float32 scale as it completes, then ``O^T_t += V_t^T (P^T scale_t / u)`` per
  128-column value tile.

Float16 needs the two units of ``sparse_wgmma``: each query row is scaled by a power of two (``_stage_query``), and
the accumulators are in units of ``u``, the largest tile scale seen so far. Same arguments, work items, partials
and merge as ``decode_kernel._decode_split_kernel``; ``cache`` is the paged cache's bytes (656 per slot).

Measured (NOTES.md, session 13): at 32 rows it takes 80.4 us where the Triton kernel takes 135.7 (H200, 16 heads,
two tokens, b32 ctx4096), and it is the default there; at 16 rows it was 8-11% slower than the Triton kernel (H100
131.6 against 121.7 us at b64, H200 137.3 against 123.4; the 16-row kernel is ``decode_ws`` now). Its step is bound
by its serial phases (decode, products, softmax; one program per multiprocessor at 255 registers), not by the bytes
or the tensor cores. Since session 21 it requests the step after next into L2 in one bulk request (b32 76.7 -> 70.0
us), and since session 22 loads the tile scales once a step, handed over through shared memory (b32 70.3 -> 67.5,
b64 127.0 -> 121.6), where each warp reads all of them for their maximum (b32 65.4, b64 116.9, page 1 b32 81.9 ->
75.2). Against the Triton kernel's 32-row configuration again (session 23): b32 65.5 against 134.1 us, b64 117.4
against 255.0.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper

from impls.triton.decode_kernel import ITEM_FIELDS, NOPE, ROPE, TILE
from impls.triton.decode_wgmma import (SWIZZLED, _cta_barrier, _item_fields, _launch_dependents, _program_items,
                                       _row_at, _row_limits, _step_page)
from impls.triton.decode_wgmma_narrow import _store_lse, _transposed_state
from impls.triton.sparse_wgmma import (LINES_LAYOUT, ROPE_AT, ROW_BYTES, SCALES_AT, _prefetch_row_lines,
                                       _stage_query, _tiles)

KEYS = gl.constexpr(64)  # keys per step: wgmma's M

# Query rows: 16 per layout tile (8 bf16 per thread).
QUERY_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[8, 1],
                                             order=[1, 0]))
# The cache's bytes are loaded as 32-bit words, 16 bytes per thread, 128 bytes a row: carried across a step as 4
# bytes a register (as bytes, each would take a register of its own).
WORD_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[8, 1],
                                            order=[1, 0]))
# e4m3 codes [64 keys, 32 words] a tile: 8 bytes a thread, so that each 16-byte float16 chunk a thread stores
# lies in another bank group than its quarter-warp's other seven (16 bytes a thread put two threads' chunks, 128
# bytes apart, in each bank group).
CODE_WORDS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[2, 16], warps_per_cta=[8, 1],
                                           order=[1, 0]))
# One element a thread of the 8 warps that load a step (this kernel's, decode_ws's decoder): the bulk prefetch's
# predicate picks one thread.
STEP_THREADS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[8],
                                             order=[0]))
# fp8_ds_mla's tile scales of a step, [64 keys, 4 tiles], one a thread of the 8 warps: one load a step, handed to the
# products' layout through shared memory (a load per tile along the keys, replicated over the warps that share a key,
# took 32 warp loads of 16-32 lines each a step; NOTES.md sessions 21 and 22).
STEP_SCALES = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4], warps_per_cta=[8, 1],
                                            order=[1, 0]))
SCALES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
WORDS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
HAS_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # Triton 3.6: _reinterpret


@gluon.jit
def _as_words(buffer):
    """A 16-bit swizzled buffer seen as 32-bit words (same bytes: the swizzle is defined on 16-byte chunks)."""
    shape: gl.constexpr = [buffer.shape[0], buffer.shape[1] // 2]
    return _seen_as(buffer, gl.int32, shape, WORDS_SMEM)


@gluon.jit
def _seen_as(buffer, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """A shared-memory buffer's bytes seen as another type, shape and layout (Triton 3.6 names it ``_reinterpret``)."""
    if HAS_REINTERPRET:
        return buffer.reinterpret(dtype, shape, layout)
    else:
        return buffer._reinterpret(dtype, shape, layout)


@gluon.jit
def _e4m3_words(words):
    """Four e4m3 codes per word -> two words of two float16 each (exact): codes 0-1 and codes 2-3, interleaved."""
    low, high = gl.inline_asm_elementwise(
        "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
        "=r,=r,r", [words], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    return gl.join(low, high).reshape([words.shape[0], 2 * words.shape[1]])


@gluon.jit
def _slots(pages, start, kv_end, PAGE_SIZE: gl.constexpr, KEY_LAYOUT: gl.constexpr, ROW_BYTES: gl.constexpr):
    """The byte offset of keys ``[start, start + 64)`` in a cache of ``ROW_BYTES`` per slot (through the block
    table, along ``KEY_LAYOUT``) and which are below ``kv_end``; keys past it point at slot 0 and are not read."""
    keys = start + gl.arange(0, KEYS, layout=KEY_LAYOUT)
    ok = keys < kv_end
    if PAGE_SIZE % KEYS == 0:  # one page per step: one block-table entry
        page = _step_page(pages, start, kv_end, PAGE_SIZE)
    else:
        page = gl.load(pages + keys // PAGE_SIZE, mask=ok, other=0).to(gl.int64)
    return gl.where(ok, page * PAGE_SIZE + keys % PAGE_SIZE, 0) * ROW_BYTES, ok


@gluon.jit
def _load_words(cache, pages, start, kv_end, offset: gl.constexpr, WORDS: gl.constexpr, PAGE_SIZE: gl.constexpr,
                ROW_BYTES: gl.constexpr, LAYOUT: gl.constexpr = WORD_LAYOUT):
    """``WORDS`` 32-bit words from byte ``offset`` of each ``ROW_BYTES``-byte row of keys ``[start, start + 64)``
    along ``LAYOUT`` (zeros past ``kv_end``)."""
    at, ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, LAYOUT), ROW_BYTES)
    ptrs = (cache + at + offset).to(gl.pointer_type(gl.int32))
    return gl.load(ptrs[:, None] + gl.arange(0, WORDS, layout=gl.SliceLayout(0, LAYOUT))[None, :],
                   mask=ok[:, None], other=0)


@gluon.jit
def _load_codes(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr):
    """The step's e4m3 codes: four tiles of ``[64, 32]`` words."""
    return (_load_words(cache, pages, start, kv_end, 0, TILE // 4, PAGE_SIZE, ROW_BYTES, CODE_WORDS),
            _load_words(cache, pages, start, kv_end, TILE, TILE // 4, PAGE_SIZE, ROW_BYTES, CODE_WORDS),
            _load_words(cache, pages, start, kv_end, 2 * TILE, TILE // 4, PAGE_SIZE, ROW_BYTES, CODE_WORDS),
            _load_words(cache, pages, start, kv_end, 3 * TILE, TILE // 4, PAGE_SIZE, ROW_BYTES, CODE_WORDS))


@gluon.jit
def _load_tile_scales(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr, ROW: gl.constexpr):
    """fp8_ds_mla's float32 tile scales of keys ``[start, start + 64)`` (``ROW`` bytes a slot), ``[64, 4]`` along
    ``STEP_SCALES``; zeros past ``kv_end``."""
    at, ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, STEP_SCALES), ROW)
    tiles = gl.arange(0, 4, layout=gl.SliceLayout(0, STEP_SCALES))
    first = (cache + at + SCALES_AT).to(gl.pointer_type(gl.float32))
    return gl.load(first[:, None] + tiles[None, :], mask=ok[:, None], other=0.0)


@gluon.jit
def _store_tile_scales(s0, s1, s2, s3, step_scales):
    """Loaded tile scales (``_load_tile_scales``) into the four ``[64]`` buffers ``s0``-``s3``, a tile's column each
    (taken by a sum over the four threads of a key, the other columns zeroed: NaN and infinities pass)."""
    tiles = gl.arange(0, 4, layout=gl.SliceLayout(0, STEP_SCALES))[None, :]
    s0.store(gl.sum(gl.where(tiles == 0, step_scales, 0.0), 1))
    s1.store(gl.sum(gl.where(tiles == 1, step_scales, 0.0), 1))
    s2.store(gl.sum(gl.where(tiles == 2, step_scales, 0.0), 1))
    s3.store(gl.sum(gl.where(tiles == 3, step_scales, 0.0), 1))


@gluon.jit
def _read_tile_scales(s0, s1, s2, s3, ACC_KEYS: gl.constexpr):
    """The four ``[64]`` per-key tile scales (``_store_tile_scales``) along the keys of the products' layout, and
    their maximum. Each warp reads all 256 for the maximum, so that it needs no exchange between warps (two barriers
    a step fewer; decode_ws b64 92.0 -> 88.4 us, NOTES.md session 19)."""
    EVERY_WARP: gl.constexpr = gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32],
                                                warps_per_cta=[gl.num_warps()], order=[0])
    largest = gl.maximum(gl.maximum(s0.load(EVERY_WARP), s1.load(EVERY_WARP)),
                         gl.maximum(s2.load(EVERY_WARP), s3.load(EVERY_WARP)))
    return s0.load(ACC_KEYS), s1.load(ACC_KEYS), s2.load(ACC_KEYS), s3.load(ACC_KEYS), gl.max(largest, 0)


@gluon.jit
def _prefetch_step(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr, ROW_BYTES: gl.constexpr):
    """Request the ``ROW_BYTES``-byte rows of keys ``[start, start + 64)`` into L2 (nothing waits for it)."""
    at, ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, LINES_LAYOUT), ROW_BYTES)
    _prefetch_row_lines(cache + at, ROW_BYTES)


@gluon.jit
def _prefetch_page_step(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr, ROW_BYTES: gl.constexpr):
    """``_prefetch_step``, in pages of whole steps as one request: the step's rows are contiguous there, so one thread
    asks the TMA unit for all of them (``cp.async.bulk.prefetch.L2``) instead of 512 line requests through L1 (H200,
    16 heads, fp8_ds_mla b64: decode_ws 87.4 -> 81.5 us, this kernel at 2 tokens b32 76.7 -> 70.0; the FP4 layouts
    measured 2-6% slower with it; NOTES.md session 21)."""
    if PAGE_SIZE % KEYS == 0:
        page = _step_page(pages, start, kv_end, PAGE_SIZE)
        thread = gl.arange(0, 256, layout=STEP_THREADS)
        first = cache + (page * PAGE_SIZE + start % PAGE_SIZE) * ROW_BYTES + thread * 0
        nbytes = gl.minimum(kv_end - start, KEYS) * ROW_BYTES + thread * 0  # whole rows: a multiple of 16 bytes
        asks = ((thread == 0) & (start < kv_end)).to(gl.int32)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [first, nbytes, asks], dtype=gl.int32, is_pure=False, pack=1)
    else:
        _prefetch_step(cache, pages, start, kv_end, PAGE_SIZE, ROW_BYTES)


@gluon.jit
def _decode_split_kernel_fp8(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, work, items_stride, item_counts,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
    ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr,
    WAIT_PRIOR: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of ``ROWS`` (16 or 32) query
    rows; ``cache`` is the uint8 paged cache, ``ROW_BYTES`` per slot. ``EARLY_MERGE``: let the merge kernel, a
    programmatic dependent launch, start now (it waits for this grid's results on the device)."""
    if EARLY_MERGE:
        _launch_dependents()
    PROBS_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * ROWS, element_bitwidth=16, rank=2)
    q_nope = _tiles(gl.float16, [ROWS, TILE], SWIZZLED)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [ROWS, ROPE], SWIZZLED)
    keys = _tiles(gl.float16, [KEYS, TILE], SWIZZLED)
    rope = gl.allocate_shared_memory(gl.bfloat16, [KEYS, ROPE], SWIZZLED)
    probs = _tiles(gl.float16, [KEYS, ROWS], PROBS_SMEM)
    scales = _tiles(gl.float32, [KEYS], SCALES_SMEM)
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    for i in range(items):
        _attend_item(_item_fields(table + i * ITEM_FIELDS), q, stride_qt, stride_qh, cache, block_table, stride_bt,
                     visible, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                     q_nope, q_rope, keys, rope, probs, scales, ROWS, PAGE_SIZE, KEEP_PARTIALS)


@gluon.jit
def _attend_item(item, q, stride_qt, stride_qh, cache, block_table, stride_bt, visible,
                 out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                 q_nope, q_rope, keys, rope, probs, scales, ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr,
                 KEEP_PARTIALS: gl.constexpr):
    """One work item (``_item_fields``): ``ROWS`` query rows of one request over keys ``[kv_start, kv_end)``."""
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = item
    # S^T [64 keys, ROWS] and O^T [128 columns, ROWS]: warpgroup w takes rows [w ROWS / 2, (w + 1) ROWS / 2).
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, ROWS // 2, 16])
    ACC_KEYS: gl.constexpr = gl.SliceLayout(1, ACC)
    ACC_ROWS: gl.constexpr = gl.SliceLayout(0, ACC)
    pages = block_table + request.to(gl.int64) * stride_bt
    c0, c1, c2, c3 = _load_codes(cache, pages, kv_start, kv_end, PAGE_SIZE)
    x = _load_tile_scales(cache, pages, kv_start, kv_end, PAGE_SIZE, ROW_BYTES)
    r = _load_words(cache, pages, kv_start, kv_end, ROPE_AT, ROPE // 2, PAGE_SIZE, ROW_BYTES)
    _prefetch_page_step(cache, pages, kv_start + KEYS, kv_end, PAGE_SIZE, ROW_BYTES)

    rows_q = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, QUERY_LAYOUT))
    ok_q = rows_q < q_len * num_heads
    q_base = _row_at(q, rows_q, q_first, num_heads, stride_qt, stride_qh)
    q_down = gl.convert_layout(_stage_query(q_base, ok_q, q_nope, q_rope, QUERY_LAYOUT), ACC_ROWS)

    rows_s, ok_s, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS, ACC_ROWS)
    key_ids = gl.arange(0, KEYS, layout=ACC_KEYS)
    m_i, l_part, zero, acc0, acc1, acc2, acc3 = _transposed_state(ROWS, ACC)
    unit = gl.to_tensor(2.0 ** -126)  # u, the accumulators' unit
    for j in range(gl.cdiv(kv_end - kv_start, KEYS)):
        start = kv_start + j * KEYS
        _prefetch_page_step(cache, pages, start + 2 * KEYS, kv_end, PAGE_SIZE, ROW_BYTES)
        _as_words(rope).store(r)
        _as_words(keys[0]).store(_e4m3_words(c0))
        _as_words(keys[1]).store(_e4m3_words(c1))
        _as_words(keys[2]).store(_e4m3_words(c2))
        _as_words(keys[3]).store(_e4m3_words(c3))
        _store_tile_scales(scales[0], scales[1], scales[2], scales[3], x)
        hopper.fence_async_shared()
        _cta_barrier()
        # The next step's rows (requested into L2 a step ago), in flight during this step's products.
        c0, c1, c2, c3 = _load_codes(cache, pages, start + KEYS, kv_end, PAGE_SIZE)
        r = _load_words(cache, pages, start + KEYS, kv_end, ROPE_AT, ROPE // 2, PAGE_SIZE, ROW_BYTES)
        x = _load_tile_scales(cache, pages, start + KEYS, kv_end, PAGE_SIZE, ROW_BYTES)

        x0, x1, x2, x3, step_max = _read_tile_scales(scales[0], scales[1], scales[2], scales[3], ACC_KEYS)
        m_i, l_part, unit, acc0, acc1, acc2, acc3 = _step_products(
            rope, keys, q_rope, q_nope, probs, x0, x1, x2, x3, step_max, q_down, qk_scale,
            (start + key_ids)[:, None] < limit[None, :], zero, m_i, l_part, unit, acc0, acc1, acc2, acc3)
        _cta_barrier()  # every warp is done with the decoded keys, the scales and P

    l_i = gl.sum(l_part, 0)
    seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
    lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    to_out = gl.where(seen, unit / gl.where(seen, l_i, 1.0), 0.0)[None, :]
    cols = gl.arange(0, TILE, layout=ACC_KEYS)[:, None]
    if slot_out < 0:  # the item covers its rows' whole range: the final result
        out_row = _row_at(out, rows_s, q_first, num_heads, stride_ot, stride_oh)
        out_at = out_row[None, :] + cols
        out_mask = ok_s[None, :]
        gl.store(out_at, (acc0 * to_out).to(gl.bfloat16), mask=out_mask)
        gl.store(out_at + TILE, (acc1 * to_out).to(gl.bfloat16), mask=out_mask)
        gl.store(out_at + 2 * TILE, (acc2 * to_out).to(gl.bfloat16), mask=out_mask)
        gl.store(out_at + 3 * TILE, (acc3 * to_out).to(gl.bfloat16), mask=out_mask)
    else:  # one split of several: a normalized partial for decode_kernel._merge_splits_kernel
        part_rows = slot_out.to(gl.int64) * ROWS + gl.arange(0, ROWS, layout=ACC_ROWS)
        policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        part_at = part_out + part_rows[None, :] * NOPE + cols
        gl.store(part_at, acc0 * to_out, eviction_policy=policy)
        gl.store(part_at + TILE, acc1 * to_out, eviction_policy=policy)
        gl.store(part_at + 2 * TILE, acc2 * to_out, eviction_policy=policy)
        gl.store(part_at + 3 * TILE, acc3 * to_out, eviction_policy=policy)
    _store_lse(lse2, rows_s, ok_s, lse, stride_lt, part_lse, row_block, slot_out, q_first, num_heads, ROWS,
               KEEP_PARTIALS)


@gluon.jit
def _step_products(rope, keys, q_rope, q_nope, probs, x0, x1, x2, x3, step_max, q_down, qk_scale, visible_keys, zero,
                   m_i, l_part, unit, acc0, acc1, acc2, acc3):
    """One 64-key step from its decoded tiles (``rope``, the four of ``keys``; per-key tile scales ``x0``-``x3``
    along the keys of the accumulators' layout, their maximum ``step_max``): ``S^T`` (``_issue_scores``), the online
    softmax into ``probs`` (``_scores_to_probs``) and ``O^T_t += V_t^T P_t^T`` (``_issue_values``), one after the
    other. Returns the running maximum, sums, unit and accumulators."""
    s_rope, p0, p1, p2, p3 = _issue_scores(rope, keys, q_rope, q_nope, zero)
    m_i, l_part, unit, alpha_o = _scores_to_probs(s_rope, p0, p1, p2, p3, 0, False, probs, x0, x1, x2, x3,
                                                  step_max, q_down, qk_scale, visible_keys, m_i, l_part, unit)
    acc0, acc1, acc2, acc3 = _issue_values(keys, probs, alpha_o, acc0, acc1, acc2, acc3)
    acc0, acc1, acc2, acc3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1, acc2, acc3])
    return m_i, l_part, unit, acc0, acc1, acc2, acc3


@gluon.jit
def _issue_scores(rope, keys, q_rope, q_nope, zero):
    """A step's five ``S^T`` products, issued (asynchronous, in this order): the rope in bf16, then each of the
    four code tiles ``keys`` in float16."""
    s_rope = hopper.warpgroup_mma(rope, q_rope.permute((1, 0)), zero, use_acc=False, is_async=True)
    p0 = hopper.warpgroup_mma(keys[0], q_nope[0].permute((1, 0)), zero, use_acc=False, is_async=True)
    p1 = hopper.warpgroup_mma(keys[1], q_nope[1].permute((1, 0)), zero, use_acc=False, is_async=True)
    p2 = hopper.warpgroup_mma(keys[2], q_nope[2].permute((1, 0)), zero, use_acc=False, is_async=True)
    p3 = hopper.warpgroup_mma(keys[3], q_nope[3].permute((1, 0)), zero, use_acc=False, is_async=True)
    return s_rope, p0, p1, p2, p3


@gluon.jit
def _scores_to_probs(s_rope, p0, p1, p2, p3, LATER: gl.constexpr, ONE_P: gl.constexpr, probs, x0, x1, x2, x3,
                     step_max, q_down, qk_scale, visible_keys, m_i, l_part, unit):
    """Waits for a step's issued scores (``LATER``: products issued after them, which may stay in flight), scales
    each code tile's by its per-key scale as it completes, and runs the online softmax over the ``visible_keys``:
    ``P^T * scale_t / u`` into ``probs``, visible to the tensor cores; ``u`` grows to ``step_max``, the step's
    largest tile scale (``_read_tile_scales``). ``ONE_P``: every tile scale is 1, so the four tiles of P are one,
    stored once into ``probs[0]``. Returns the running maximum, sums, the new unit ``u`` and the factor of the
    accumulators (``alpha_o``)."""
    s_rope, p0 = hopper.warpgroup_mma_wait(num_outstanding=3 + LATER, deps=[s_rope, p0])
    nope = p0 * x0[:, None]
    p1 = hopper.warpgroup_mma_wait(num_outstanding=2 + LATER, deps=[p1])
    nope += p1 * x1[:, None]
    p2 = hopper.warpgroup_mma_wait(num_outstanding=1 + LATER, deps=[p2])
    nope += p2 * x2[:, None]
    p3 = hopper.warpgroup_mma_wait(num_outstanding=LATER, deps=[p3])
    nope += p3 * x3[:, None]
    s = (s_rope + nope * q_down[None, :]) * qk_scale
    return _softmax_to_probs(gl.where(visible_keys, s, float("-inf")), ONE_P, probs, x0, x1, x2, x3, step_max, m_i,
                             l_part, unit)


@gluon.jit
def _softmax_to_probs(s, ONE_P: gl.constexpr, probs, x0, x1, x2, x3, step_max, m_i, l_part, unit, factors=None):
    """``_scores_to_probs`` from the step's finished scores ``s`` (base 2, masked keys at -inf); the accumulators'
    factor also goes into ``factors`` (a ``[ROWS]`` buffer) where given, under the same barrier as P."""
    m_new = gl.maximum(m_i, gl.max(s, 0))  # across the four warps (through shared memory)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[None, :])
    l_part = l_part * alpha[None, :] + p

    # Values: P^T * scale_t / u per tile, in float16; u grows to this step's largest scale.
    new_unit = gl.maximum(unit, step_max)
    per_unit = 1.0 / new_unit
    probs[0].store((p * (x0 * per_unit)[:, None]).to(gl.float16))
    if not ONE_P:
        probs[1].store((p * (x1 * per_unit)[:, None]).to(gl.float16))
        probs[2].store((p * (x2 * per_unit)[:, None]).to(gl.float16))
        probs[3].store((p * (x3 * per_unit)[:, None]).to(gl.float16))
    alpha_o = alpha * (unit * per_unit)
    if factors is not None:
        factors.store(alpha_o)
    hopper.fence_async_shared()
    _cta_barrier()
    return m_new, l_part, new_unit, alpha_o[None, :]


@gluon.jit
def _issue_values(keys, probs, alpha_o, acc0, acc1, acc2, acc3):
    """``O^T_t = alpha_o O^T_t + V_t^T P_t^T`` for the four value tiles ``keys``, issued (asynchronous)."""
    acc0 = hopper.warpgroup_mma(keys[0].permute((1, 0)), probs[0], acc0 * alpha_o, is_async=True)
    acc1 = hopper.warpgroup_mma(keys[1].permute((1, 0)), probs[1], acc1 * alpha_o, is_async=True)
    acc2 = hopper.warpgroup_mma(keys[2].permute((1, 0)), probs[2], acc2 * alpha_o, is_async=True)
    acc3 = hopper.warpgroup_mma(keys[3].permute((1, 0)), probs[3], acc3 * alpha_o, is_async=True)
    return acc0, acc1, acc2, acc3
