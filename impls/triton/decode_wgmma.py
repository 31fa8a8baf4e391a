"""The 64-row bf16 decode split kernel in Gluon: the score product computed once, by both warpgroups together.

``decode_kernel._decode_split_kernel`` in Triton gives a dot that feeds another dot every warp along M, so with 64
query rows and two warpgroups (the 64 x 512 float32 output needs both) each warpgroup computes the whole score tile
``S = Q K^T``: 2 x 576 + 512 multiply-adds per (row, key) instead of 1088 (NOTES.md, rounds 1 and 7). Gluon lets
the layouts be chosen: here warpgroup ``w`` computes the scores of keys ``[32 w, 32 w + 32)`` of each 64-key tile,
the row maximum is exchanged through shared memory, ``P`` is written to shared memory once, and each warpgroup
multiplies all of ``P`` by its half of the value columns (output columns ``[64 w, 64 w + 64)`` of each 128-wide
tile). The row sums stay per warpgroup until the end.

Same arguments, work items and outputs as ``_decode_split_kernel`` (bf16 cache, ``BLOCK_M`` 64, ``BLOCK_N`` 64,
8 warps); the merge is shared. Key tiles are copied with ``cp.async`` (masked: keys past the range are zeros, so
poisoned slots never reach a product) into two stages: the next tile's copy runs during the current tile's
products. Gluon has no interpreter: this kernel runs on Hopper GPUs only; the CPU tests cover the Triton kernel,
and ``make compile-check`` compiles this one for sm_90.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from impls.triton.decode_kernel import (FIRST_KEYS_PREFETCH, ITEM_FIELDS, LN2, NOPE, PREFETCH_L1, ROPE, TILE,
                                       _pages_ahead)
from mla_bench.layouts import LATENT_DIM

# Triton 3.6 (the GPU machine) and newer releases (CI) name two of the operations differently.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

ROWS = gl.constexpr(64)        # query rows per item (BLOCK_M)
KEYS = gl.constexpr(64)        # keys per tile (BLOCK_N)
STAGES = gl.constexpr(2)       # key tiles in shared memory: 2 x 72 KB, with the 72 KB query block and P
WIDTH = gl.constexpr(LATENT_DIM)  # bf16 per cache row and query row: 512 latent + 64 rope

# Scores [64 rows, 64 keys]: warpgroup w takes keys [32 w, 32 w + 32). Outputs [64 rows, 128 columns] per tile:
# warpgroup w takes columns [64 w, 64 w + 64) (one 128-byte swizzle atom of the value tile).
SCORE_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
OUT_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16]))
# Copies: 16 bytes per thread, a warp covers 4 rows of 64 columns.
COPY_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1],
                                            order=[1, 0]))
SWIZZLED = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


@gluon.jit
def _copy_rows(smem, rows_base, ok, first_col: gl.constexpr, COLS: gl.constexpr):
    """cp.async of ``COLS`` bf16 columns from ``first_col`` of rows ``rows_base`` (each row's first element, along
    the rows of a layout like ``COPY_LAYOUT``) into ``smem``; rows not ``ok`` become zeros."""
    cols = first_col + gl.arange(0, COLS, layout=gl.SliceLayout(0, rows_base.type.layout.parent))
    _async_load(smem, rows_base[:, None] + cols[None, :], mask=ok[:, None])


@gluon.jit
def _step_page(pages, start, kv_end, PAGE_SIZE: gl.constexpr):
    """The block-table entry of the step of keys from ``start``, in pages that hold whole steps (0 past ``kv_end``)."""
    return gl.load(pages + start // PAGE_SIZE, mask=start < kv_end, other=0).to(gl.int64)


@gluon.jit
def _key_rows(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr, LAYOUT: gl.constexpr):
    """The cache rows of keys ``[start, start + 64)`` through the block table, along the rows of ``LAYOUT`` (a copy
    layout), and which are below ``kv_end`` (none past the range: nothing is read then)."""
    keys = start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, LAYOUT))
    ok = keys < kv_end
    if PAGE_SIZE % KEYS == 0:  # one page per tile: one block-table entry
        page = _step_page(pages, start, kv_end, PAGE_SIZE)
    else:
        page = gl.load(pages + keys // PAGE_SIZE, mask=ok, other=0).to(gl.int64)
    return cache + (page * PAGE_SIZE + keys % PAGE_SIZE) * WIDTH, ok


@gluon.jit
def _copy_key_tile(lat_smem, rope_smem, stage, rows, ok):
    """Issue the copies of a key tile (``_key_rows``) into stage ``stage``."""
    for t in gl.static_range(4):
        _copy_rows(lat_smem.index(stage * 4 + t), rows, ok, TILE * t, TILE)
    _copy_rows(rope_smem.index(stage), rows, ok, NOPE, ROPE)


@gluon.jit
def _start_copies(q, stride_qt, stride_qh, cache, block_table, stride_bt, request, row_block, kv_start, kv_end,
                  q_first, q_len, num_heads, q_lat, q_rope, k_lat, k_rope, ROWS: gl.constexpr,
                  PAGE_SIZE: gl.constexpr, LAYOUT: gl.constexpr):
    """Issue an item's first copies along the copy layout ``LAYOUT``: its ``ROWS`` query rows, in the first copy
    group with the first key tile, then the second tile's group (empty past the range); returns the request's
    block-table row and the item's key tiles. Both tiles' block-table entries are read before any copy waits for
    them: one round trip, not two, before an item's first product (pages under a tile read one entry per key)."""
    gl.static_assert(STAGES == 2, "the start copies two tiles")
    pages = block_table + request.to(gl.int64) * stride_bt
    tiles = gl.cdiv(kv_end - kv_start, KEYS)
    rows0, ok0 = _key_rows(cache, pages, kv_start, kv_end, PAGE_SIZE, LAYOUT)
    rows1, ok1 = _key_rows(cache, pages, kv_start + KEYS, kv_end, PAGE_SIZE, LAYOUT)
    rows_c = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    ok_c = rows_c < q_len * num_heads
    q_base = _row_at(q, rows_c, q_first, num_heads, stride_qt, stride_qh)
    for t in gl.static_range(4):
        _copy_rows(q_lat.index(t), q_base, ok_c, TILE * t, TILE)
    _copy_rows(q_rope, q_base, ok_c, NOPE, ROPE)
    if tiles > 0:
        _copy_key_tile(k_lat, k_rope, 0, rows0, ok0)
    async_copy.commit_group()
    if tiles > 1:
        _copy_key_tile(k_lat, k_rope, 1, rows1, ok1)
    async_copy.commit_group()
    return pages, tiles


@gluon.jit
def _wait_tile():
    """Wait for the oldest key tile in flight (an item's first also brings its query block): this thread's copies,
    then made visible to wgmma's asynchronous reads, then every thread's (one copy group per tile, empty or not)."""
    async_copy.wait_group(STAGES - 1)
    hopper.fence_async_shared()
    _cta_barrier()


@gluon.jit
def _refill_stage(k_lat, k_rope, stage, rows, ok, refill):
    """Once every warp is done with stage ``stage``: copy the key tile of ``rows`` into it where ``refill`` (the
    item has that tile), and close its copy group either way (``_wait_tile`` counts groups)."""
    if refill:
        _copy_key_tile(k_lat, k_rope, stage, rows, ok)
    async_copy.commit_group()


@gluon.jit
def _launch_dependents():
    """Let this grid's programmatic dependent launch (the merge kernel) start now: it waits on the device for this
    grid's results."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, $1;", "=r,r", [gl.program_id(0)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_prior():
    """Wait until the stream's previous kernel (this grid's programmatic launch prerequisite) is complete and its
    writes are visible; at once where the grid was launched without one."""
    gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, $1;", "=r,r", [gl.program_id(0)], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _row_at(base, rows, q_first, num_heads, stride_token, stride_head):
    """Where query row ``rows`` of an item lives in a ``[token, head, ...]`` tensor: the item's token ``q_first +
    rows // num_heads``, head ``rows % num_heads`` (rows run over the heads of each new token)."""
    return base + (q_first + rows // num_heads).to(gl.int64) * stride_token + (rows % num_heads) * stride_head


@gluon.jit
def _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS: gl.constexpr, LAYOUT: gl.constexpr):
    """An item's ``ROWS`` query rows along the 1-D ``LAYOUT``: their ids, which exist, and each row's causal frontier
    clipped to the item's range (the row sees the keys below ``limit``)."""
    rows = row_block * ROWS + gl.arange(0, ROWS, layout=LAYOUT)
    ok = rows < q_len * num_heads
    limit = gl.minimum(gl.load(visible + q_first + rows // num_heads, mask=ok, other=0), kv_end)
    return rows, ok, limit


@gluon.jit
def _program_items(work, items_stride, item_counts, WAIT_PRIOR: gl.constexpr):
    """This program's work-item rows and their count, the first row requested into L1 beside the count; then,
    under ``WAIT_PRIOR``, the wait for the stream's previous kernel (``decode_kernel._program_items``)."""
    program = gl.program_id(0)
    table = work + program.to(gl.int64) * items_stride
    gl.inline_asm_elementwise(PREFETCH_L1, "=r,l", [table], dtype=gl.int32, is_pure=False, pack=1)
    items = gl.load(item_counts + program)
    if WAIT_PRIOR:
        _wait_prior()
    return table, items


@gluon.jit
def _prefetch_first_keys(work, items_stride, item_counts, cache, block_table, stride_bt, PAGE_SIZE: gl.constexpr,
                         ROW_BYTES: gl.constexpr, KEYS_AHEAD: gl.constexpr):
    """``decode_kernel._prefetch_first_keys`` in Gluon (a Gluon kernel cannot call the Triton-language function,
    which the compile check's recording run also defines for the interpreter): before the wait, L2 asked for the
    first item's first ``KEYS_AHEAD`` keys (``cache``: the paged cache, any pointer type)."""
    cache = cache.to(gl.pointer_type(gl.uint8))
    program = gl.program_id(0)
    row = work + program.to(gl.int64) * items_stride
    request = gl.load(row)
    kv_start = gl.load(row + 2)
    kv_end = gl.load(row + 3)
    live = (gl.load(item_counts + program) > 0) & (kv_start < kv_end)
    PAGES: gl.constexpr = _pages_ahead(KEYS_AHEAD, PAGE_SIZE)
    LANES: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    page = gl.arange(0, PAGES, layout=LANES)
    page_start = (kv_start // PAGE_SIZE + page) * PAGE_SIZE
    lo = gl.maximum(kv_start, page_start)
    hi = gl.minimum(gl.minimum(kv_end, page_start + PAGE_SIZE), kv_start + KEYS_AHEAD)
    ask = live & (lo < hi)
    entry = gl.load(block_table + request.to(gl.int64) * stride_bt + kv_start // PAGE_SIZE + page, mask=ask,
                    other=-1, cache_modifier=".cg")
    nbytes = (hi - lo) * ROW_BYTES * (ask & (entry >= 0)).to(gl.int32)
    first = cache + (entry.to(gl.int64) * PAGE_SIZE + lo % PAGE_SIZE) * ROW_BYTES
    asking = gl.full([PAGES], PAGES, gl.int32, LANES)  # the threads that ask: one per page
    gl.inline_asm_elementwise(FIRST_KEYS_PREFETCH, "=r,l,r,r", [first, nbytes, asking], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _item_fields(row):
    """A work item's row (``decode.ITEM_COLUMNS``) as scalars, one load each (known uniform across the program)."""
    return (gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4), gl.load(row + 5),
            gl.load(row + 6))


@gluon.jit
def _decode_split_kernel_wgmma(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, work, items_stride, item_counts,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
    PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, WAIT_PRIOR: gl.constexpr, KEYS_AHEAD: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract, ``WAIT_PRIOR`` and
    ``KEYS_AHEAD`` included); ``cache`` is the bf16 view of the paged cache, ``WIDTH`` values per slot."""
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [4, ROWS, TILE], SWIZZLED)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [ROWS, ROPE], SWIZZLED)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 4, KEYS, TILE], SWIZZLED)
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, KEYS, ROPE], SWIZZLED)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS, KEYS], SWIZZLED)
    if KEYS_AHEAD > 0:
        _prefetch_first_keys(work, items_stride, item_counts, cache, block_table, stride_bt, PAGE_SIZE, 2 * WIDTH,
                             KEYS_AHEAD)
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len = _item_fields(table + i * ITEM_FIELDS)
        _attend_item(q, stride_qt, stride_qh, cache, block_table, stride_bt, visible,
                     request, row_block, kv_start, kv_end, slot_out, q_first, q_len,
                     out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                     q_lat, q_rope, k_lat, k_rope, p_smem, PAGE_SIZE, KEEP_PARTIALS)


@gluon.jit
def _attend_item(q, stride_qt, stride_qh, cache, block_table, stride_bt, visible,
                 request, row_block, kv_start, kv_end, slot_out, q_first, q_len,
                 out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                 q_lat, q_rope, k_lat, k_rope, p_smem, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr):
    """One work item: 64 query rows of one request over keys ``[kv_start, kv_end)``."""
    pages, tiles = _start_copies(q, stride_qt, stride_qh, cache, block_table, stride_bt, request, row_block,
                                 kv_start, kv_end, q_first, q_len, num_heads, q_lat, q_rope, k_lat, k_rope, ROWS,
                                 PAGE_SIZE, COPY_LAYOUT)

    # Rows in the score layout: the causal frontier of each row, clipped to the item's range.
    _, _, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS,
                              gl.SliceLayout(1, SCORE_LAYOUT))
    key_cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, SCORE_LAYOUT))

    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, SCORE_LAYOUT))
    l_part = gl.zeros([ROWS, KEYS], gl.float32, SCORE_LAYOUT)  # each warpgroup's running sums, summed at the end
    acc0 = gl.zeros([ROWS, TILE], gl.float32, OUT_LAYOUT)
    acc1 = gl.zeros([ROWS, TILE], gl.float32, OUT_LAYOUT)
    acc2 = gl.zeros([ROWS, TILE], gl.float32, OUT_LAYOUT)
    acc3 = gl.zeros([ROWS, TILE], gl.float32, OUT_LAYOUT)
    for j in range(tiles):
        stage = j % STAGES
        start = kv_start + j * KEYS
        # The block-table entries of the tile copied after this one's products are read now: their latency
        # (a DRAM round trip per tile in pages smaller than it) hides behind the products.
        next_rows, next_ok = _key_rows(cache, pages, start + STAGES * KEYS, kv_end, PAGE_SIZE, COPY_LAYOUT)
        _wait_tile()

        s = gl.zeros([ROWS, KEYS], gl.float32, SCORE_LAYOUT)
        for t in gl.static_range(4):
            s = hopper.warpgroup_mma(q_lat.index(t), k_lat.index(stage * 4 + t).permute((1, 0)), s, is_async=True)
        s = hopper.warpgroup_mma(q_rope, k_rope.index(stage).permute((1, 0)), s, is_async=True)
        s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])

        s = gl.where((start + key_cols)[None, :] < limit[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))  # across both warpgroups (through shared memory)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_part = l_part * alpha[:, None] + p
        m_i = m_new
        p_smem.store(p.to(gl.bfloat16))
        hopper.fence_async_shared()
        _cta_barrier()

        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, OUT_LAYOUT))[:, None]
        acc0 = hopper.warpgroup_mma(p_smem, k_lat.index(stage * 4 + 0), acc0 * alpha_o, is_async=True)
        acc1 = hopper.warpgroup_mma(p_smem, k_lat.index(stage * 4 + 1), acc1 * alpha_o, is_async=True)
        acc2 = hopper.warpgroup_mma(p_smem, k_lat.index(stage * 4 + 2), acc2 * alpha_o, is_async=True)
        acc3 = hopper.warpgroup_mma(p_smem, k_lat.index(stage * 4 + 3), acc3 * alpha_o, is_async=True)
        acc0, acc1, acc2, acc3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1, acc2, acc3])
        _cta_barrier()  # both warpgroups are done with this stage and with P
        _refill_stage(k_lat, k_rope, stage, next_rows, next_ok, j + STAGES < tiles)
    async_copy.wait_group(0)
    _cta_barrier()  # the next item's copies reuse the buffers

    _store_item(m_i, l_part, 1.0, 1.0, acc0, acc1, acc2, acc3, row_block, slot_out, q_first, q_len, num_heads,
                out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, ROWS, KEEP_PARTIALS)


@gluon.jit
def _store_item(m_i, l_part, unit, out_scale, acc0, acc1, acc2, acc3, row_block, slot_out, q_first, q_len, num_heads,
                out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, ROWS: gl.constexpr,
                KEEP_PARTIALS: gl.constexpr):
    """An item's result from its running maximum and sums (rows along ``SCORE_LAYOUT``) and its accumulators
    (``OUT_LAYOUT``, in units of ``unit``): the final output, times the layer scale ``out_scale``, and lse where the
    item covers its rows' whole range (``slot_out < 0``), else a normalized partial for
    ``decode_kernel._merge_splits_kernel`` (which applies the layer scale)."""
    l_i = gl.sum(l_part, 1)
    seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
    lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    factor = gl.convert_layout(gl.where(seen, unit / gl.where(seen, l_i, 1.0), 0.0), gl.SliceLayout(1, OUT_LAYOUT))
    rows_s = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, SCORE_LAYOUT))
    rows_o = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT_LAYOUT))
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, OUT_LAYOUT))
    if slot_out < 0:
        out_row = _row_at(out, rows_o, q_first, num_heads, stride_ot, stride_oh)
        _store_out(out_row, cols, rows_o < q_len * num_heads, acc0, acc1, acc2, acc3, factor * out_scale)
        gl.store(_row_at(lse, rows_s, q_first, num_heads, stride_lt, 1), lse2 * LN2, mask=rows_s < q_len * num_heads)
    else:
        part_rows = slot_out.to(gl.int64) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT_LAYOUT))
        policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        _store_partial(part_out + part_rows * NOPE, cols, acc0, acc1, acc2, acc3, factor, policy)
        lse_at = part_lse + slot_out.to(gl.int64) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, SCORE_LAYOUT))
        gl.store(lse_at, lse2, eviction_policy=policy)


@gluon.jit
def _store_out(out_row, cols, ok, acc0, acc1, acc2, acc3, inv_l):
    """The output rows ``ok`` in ``out_row``'s element type (bf16 outputs; float32 split partials)."""
    scale = inv_l[:, None]
    mask = ok[:, None]
    dtype: gl.constexpr = out_row.dtype.element_ty
    gl.store(out_row[:, None] + (0 * TILE + cols)[None, :], (acc0 * scale).to(dtype), mask=mask)
    gl.store(out_row[:, None] + (1 * TILE + cols)[None, :], (acc1 * scale).to(dtype), mask=mask)
    gl.store(out_row[:, None] + (2 * TILE + cols)[None, :], (acc2 * scale).to(dtype), mask=mask)
    gl.store(out_row[:, None] + (3 * TILE + cols)[None, :], (acc3 * scale).to(dtype), mask=mask)


@gluon.jit
def _store_partial(part_row, cols, acc0, acc1, acc2, acc3, inv_l, EVICT: gl.constexpr):
    """A split's normalized partial, float32, with the L2 eviction policy ``EVICT`` ("evict_last": kept there for
    the merge)."""
    scale = inv_l[:, None]
    gl.store(part_row[:, None] + (0 * TILE + cols)[None, :], acc0 * scale, eviction_policy=EVICT)
    gl.store(part_row[:, None] + (1 * TILE + cols)[None, :], acc1 * scale, eviction_policy=EVICT)
    gl.store(part_row[:, None] + (2 * TILE + cols)[None, :], acc2 * scale, eviction_policy=EVICT)
    gl.store(part_row[:, None] + (3 * TILE + cols)[None, :], acc3 * scale, eviction_policy=EVICT)
