"""The 16-row ``fp8_ds_mla`` decode split step in Gluon: codes decoded straight into mma.sync operand registers.

At 16 query rows (16 heads, one new token) the kernels that decode a tile into shared memory and multiply from
there (the Triton kernel, ``decode_wgmma_fp8``) spend their step on the round trip and its barriers (NOTES.md,
rounds 8 and session 13). Here nothing of a key tile passes through shared memory. One program of four warps, two
per multiprocessor; warp ``t`` owns the cache's 128-column tile ``t`` (its codes and its per-key scale):

- ``S_t = Q_t K_t^T`` (mma.sync m16n8k16, float16): the codes are loaded 16 bytes at a time straight into the
  operand registers and converted there. The contraction order is free, so the operand's columns are a fixed
  permutation of the cache's in which each thread's 16 bytes are contiguous (``CODES_S``); the query tile is
  permuted alike once per item. Then ``S_t * scale_t`` plus the warp's 16 rope columns (bf16);
- the four partials are summed through shared memory (``_sum_tiles``: one barrier per step), so every warp holds
  all of ``S`` and runs the same softmax, with no exchange of row maxima;
- ``O_t += (P * scale_t / u_t) V_t``: the value operand (keys x columns) is the same bytes loaded again (L1 hits)
  in another permutation (``CODES_V``), and ``P`` goes from the score accumulator to the operand in registers.

The layouts that load contiguous bytes are linear layouts whose relabelling (a reshape, permute, reshape of the
tensor's indices) is the operand layout itself, so ``convert_layout(..., assert_trivial=True)`` costs nothing and
fails to compile if the two ever differ. Keys past the item's end read its last key instead (finite bytes; the
scores mask them), so the step's loads need no mask.

Float16 needs the units of ``sparse_wgmma``: query rows scaled by a power of two, and each tile's accumulator in
units of ``u_t``, the largest scale of that tile seen so far. Same arguments, work items, partials and merge as
``decode_kernel._decode_split_kernel``; ``cache`` is the paged cache's bytes (656 per slot).

Measured (NOTES.md, session 14, H200, 16 heads ctx4096): b64 122.5 -> 113.2 us, b128 228.8 -> 211.6, b32 69.0 ->
65.7 against the Triton kernel it replaces.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from impls.triton.decode_kernel import ITEM_FIELDS, LN2, NOPE, TILE
from impls.triton.decode_wgmma import (_cta_barrier, _item_fields, _launch_dependents, _program_items, _row_at,
                                       _row_limits)
from impls.triton.sparse_wgmma import QUERY_TOP, ROPE_AT, ROW_BYTES, SCALES_AT, _pow2, _prefetch_row_lines

ROWS = gl.constexpr(16)          # query rows per item: mma.sync's M
KEYS = gl.constexpr(64)          # keys per step
TILES = gl.constexpr(4)          # 128-column code tiles, one per warp
ROPE_PER_WARP = gl.constexpr(16)  # rope columns each warp multiplies

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
DOT_A = gl.constexpr(gl.DotOperandLayout(0, MMA, 2))
DOT_B = gl.constexpr(gl.DotOperandLayout(1, MMA, 2))
SCORES = gl.constexpr(gl.SliceLayout(0, MMA))  # [rows, keys], the same in every warp
ROW_SLICE = gl.constexpr(gl.SliceLayout(1, SCORES))
TILE_KEYS = gl.constexpr(gl.SliceLayout(1, MMA))  # [tiles, keys]: warp t holds tile t's scales
ROWS_3D = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(2, MMA)))  # a per-row factor of [tiles, rows, keys]

# Loads in cache order whose indices, relabelled, give the operand layouts (bases: [tile, dim 1, dim 2]).
# Score codes [tile, 128 columns, 64 keys]: a thread's registers hold columns c0-c3 (16 bytes) and c6; its lane
# holds c4-c5. As the operand's contraction index k: k0 = c0, k3-k5 = c1-c3, k1-k2 = c4-c5, k6 = c6.
CODES_S = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 64, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
    lane_bases=[[0, 16, 0], [0, 32, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[], shape=[4, 128, 64]))
# Value codes [tile, 64 keys, 128 columns]: 16 contiguous columns a register run; as the operand's output index n:
# n3-n6 = c0-c3, n0-n2 = c4-c6.
CODES_V = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]], warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[], shape=[4, 64, 128]))
# Rope keys [tile, 16 columns, 64 keys] (bf16, 8 bytes a thread): k0 = d0, k3 = d1, k1-k2 = d2-d3.
ROPE_KEYS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
    lane_bases=[[0, 4, 0], [0, 8, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[], shape=[4, 16, 64]))
# Query tiles [tile, 16 rows, 128 columns] and rope [tile, 16 rows, 16 columns], permuted as the score codes.
QUERY = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 64], [0, 8, 0]],
    lane_bases=[[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[], shape=[4, 16, 128]))
QUERY_ROPE = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0]],
    lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[], shape=[4, 16, 16]))
# Outputs [tile, 16 rows, 128 columns] back in cache order, 16 contiguous float32 a thread.
OUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 8, 0]],
    lane_bases=[[0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[[1, 0, 0], [2, 0, 0]],
    block_bases=[], shape=[4, 16, 128]))
# The four score partials read back by every warp: the accumulator layout with the tiles in registers.
ALL_TILES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 8, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32], [1, 0, 0], [2, 0, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[[0, 0, 0], [0, 0, 0]],
    block_bases=[], shape=[4, 16, 64]))
EXCHANGE_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]))
# L2 prefetch of a step's rows (sparse_wgmma._prefetch_row_lines), for four warps.
LINES = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                      order=[1, 0]))


@gluon.jit
def _indices(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, LAYOUT: gl.constexpr):
    """Broadcastable index tensors of a ``[n0, n1, n2]`` tensor along ``LAYOUT``."""
    i = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, LAYOUT)))[:, None, None]
    j = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))[None, :, None]
    k = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT)))[None, None, :]
    return i, j, k


@gluon.jit
def _rows(cache, pages, start, n, kv_end, PAGE_SIZE: gl.constexpr):
    """Pointers to the rows of keys ``start + n``; keys at or past ``kv_end`` read the item's last key instead (its
    bytes are finite and the scores mask it), so the step's loads need no mask."""
    n = gl.minimum(n, kv_end - 1 - start)
    if PAGE_SIZE % KEYS == 0:  # one page per step: one block-table entry
        page = gl.load(pages + start // PAGE_SIZE).to(gl.int64)
        return cache + (page * PAGE_SIZE + start % PAGE_SIZE) * ROW_BYTES + n * ROW_BYTES
    keys = start + n
    page = gl.load(pages + keys // PAGE_SIZE).to(gl.int64)
    return cache + (page * PAGE_SIZE + keys % PAGE_SIZE) * ROW_BYTES


@gluon.jit
def _score_codes(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr):
    """The step's codes as the score product's operand: ``[tile, 128 columns (permuted), 64 keys]`` float16."""
    t, c, n = _indices(TILES, TILE, KEYS, CODES_S)
    x = gl.load((_rows(cache, pages, start, n, kv_end, PAGE_SIZE) + t * TILE + c).to(gl.pointer_type(gl.float8e4nv)))
    x = x.to(gl.float16).reshape([4, 2, 4, 8, 2, 64]).permute((0, 1, 3, 2, 4, 5)).reshape([4, 128, 64])
    return gl.convert_layout(x, DOT_B, assert_trivial=True)


@gluon.jit
def _value_codes(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr):
    """The step's codes as the value product's operand: ``[tile, 64 keys, 128 columns (permuted)]`` float16."""
    t, k, c = _indices(TILES, KEYS, TILE, CODES_V)
    x = gl.load((_rows(cache, pages, start, k, kv_end, PAGE_SIZE) + t * TILE + c).to(gl.pointer_type(gl.float8e4nv)))
    x = x.to(gl.float16).reshape([4, 64, 8, 16]).permute((0, 1, 3, 2)).reshape([4, 64, 128])
    return gl.convert_layout(x, DOT_B, assert_trivial=True)


@gluon.jit
def _rope_keys(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr):
    """The step's rope as the score product's operand: warp t's 16 columns, ``[tile, 16 (permuted), 64 keys]``."""
    t, d, n = _indices(TILES, ROPE_PER_WARP, KEYS, ROPE_KEYS)
    rows = (_rows(cache, pages, start, n, kv_end, PAGE_SIZE) + ROPE_AT).to(gl.pointer_type(gl.bfloat16))
    x = gl.load(rows + t * ROPE_PER_WARP + d).reshape([4, 4, 2, 2, 64]).permute((0, 2, 1, 3, 4)).reshape([4, 16, 64])
    return gl.convert_layout(x, DOT_B, assert_trivial=True)


@gluon.jit
def _scales(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr):
    """The step's float32 tile scales, ``[tile, 64 keys]``."""
    t = gl.arange(0, TILES, layout=gl.SliceLayout(1, TILE_KEYS))[:, None]
    n = gl.arange(0, KEYS, layout=gl.SliceLayout(0, TILE_KEYS))[None, :]
    return gl.load((_rows(cache, pages, start, n, kv_end, PAGE_SIZE) + SCALES_AT).to(gl.pointer_type(gl.float32)) + t)


@gluon.jit
def _prefetch(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr):
    """Request the rows of keys ``[start, start + 64)`` into L2 (nothing waits for it)."""
    if start < kv_end:
        _prefetch_row_lines(_rows(cache, pages, start, gl.arange(0, KEYS, layout=gl.SliceLayout(1, LINES)), kv_end,
                                  PAGE_SIZE), ROW_BYTES)


@gluon.jit
def _sum_tiles(partials, buffer):
    """The four warps' score partials (warp t holds ``partials[t]``) summed into every warp, ``[rows, keys]``."""
    buffer.store(partials)
    _cta_barrier()
    return gl.convert_layout(gl.sum(buffer.load(ALL_TILES), 0), SCORES, assert_trivial=True)


@gluon.jit
def _decode_split_kernel_mma_fp8(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, work, items_stride, item_counts,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
    PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr, WAIT_PRIOR: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of 16 query rows; ``cache``
    is the uint8 paged cache, ``ROW_BYTES`` per slot. ``EARLY_MERGE``: let the merge kernel, a programmatic
    dependent launch, start now (it waits for this grid's results on the device)."""
    if EARLY_MERGE:
        _launch_dependents()
    exchange = gl.allocate_shared_memory(gl.float32, [2, TILES, ROWS, KEYS], EXCHANGE_SMEM)  # two steps' partials
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    for i in range(items):
        _attend_item(_item_fields(table + i * ITEM_FIELDS), q, stride_qt, stride_qh, cache, block_table, stride_bt,
                     visible, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                     exchange, PAGE_SIZE, KEEP_PARTIALS)


@gluon.jit
def _query_operands(q, stride_qt, stride_qh, row_block, q_first, q_len, num_heads):
    """The item's query rows as operands: the 128-column tiles in float16, each row scaled by a power of two into
    ``[2^13, 2^14)``, and the rope in bf16, both permuted as the keys; and the factor that undoes the scaling."""
    t, r, c = _indices(TILES, ROWS, TILE, QUERY)
    rows = row_block * ROWS + r
    x = gl.load(_row_at(q, rows, q_first, num_heads, stride_qt, stride_qh) + t * TILE + c,
                mask=rows < q_len * num_heads, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.max(gl.abs(x), 2), 0), 2.0 ** -100)  # padded rows stay finite
    exponent = (amax.to(gl.int32, bitcast=True) >> 23) & 255  # biased: amax in [2^(e-127), 2^(e-126))
    x = (x * _pow2(127 + QUERY_TOP + 127 - exponent)[None, :, None]).to(gl.float16)
    x = x.reshape([4, 16, 2, 4, 8, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([4, 16, 128])
    t, r, d = _indices(TILES, ROWS, ROPE_PER_WARP, QUERY_ROPE)
    rows = row_block * ROWS + r
    xr = gl.load(_row_at(q, rows, q_first, num_heads, stride_qt, stride_qh) + NOPE + t * ROPE_PER_WARP + d,
                 mask=rows < q_len * num_heads, other=0.0)
    xr = xr.reshape([4, 16, 4, 2, 2]).permute((0, 1, 3, 2, 4)).reshape([4, 16, 16])
    down = gl.convert_layout(_pow2(exponent - QUERY_TOP), ROWS_3D)[None, :, None]
    return gl.convert_layout(x, DOT_A, assert_trivial=True), gl.convert_layout(xr, DOT_A, assert_trivial=True), down


@gluon.jit
def _attend_item(item, q, stride_qt, stride_qh, cache, block_table, stride_bt, visible,
                 out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                 exchange, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr):
    """One work item (``_item_fields``): 16 query rows of one request over keys ``[kv_start, kv_end)``."""
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = item
    pages = block_table + request.to(gl.int64) * stride_bt
    _prefetch(cache, pages, kv_start, kv_end, PAGE_SIZE)
    _prefetch(cache, pages, kv_start + KEYS, kv_end, PAGE_SIZE)
    q_nope, q_rope, q_down = _query_operands(q, stride_qt, stride_qh, row_block, q_first, q_len, num_heads)

    rows_s, ok_s, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS, ROW_SLICE)
    key_ids = gl.arange(0, KEYS, layout=gl.SliceLayout(0, SCORES))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW_SLICE)
    l_i = gl.zeros([ROWS], gl.float32, ROW_SLICE)
    unit = gl.full([TILES], 2.0 ** -126, gl.float32, gl.SliceLayout(1, TILE_KEYS))  # u_t, per tile
    acc = gl.zeros([TILES, ROWS, TILE], gl.float32, MMA)  # O_t in units of u_t, columns permuted
    zero = gl.zeros([TILES, ROWS, KEYS], gl.float32, MMA)
    for j in range(gl.cdiv(kv_end - kv_start, KEYS)):
        start = kv_start + j * KEYS
        _prefetch(cache, pages, start + 2 * KEYS, kv_end, PAGE_SIZE)
        scale = _scales(cache, pages, start, kv_end, PAGE_SIZE)
        s = mma_v2(q_nope, _score_codes(cache, pages, start, kv_end, PAGE_SIZE), zero)
        s = mma_v2(q_rope, _rope_keys(cache, pages, start, kv_end, PAGE_SIZE), s * (scale[:, None, :] * q_down))
        s = _sum_tiles(s, exchange.index(j % 2)) * qk_scale
        s = gl.where((start + key_ids)[None, :] < limit[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        new_unit = gl.maximum(unit, gl.max(scale, 1))
        p_t = (p[None, :, :] * (scale / new_unit[:, None])[:, None, :]).to(gl.float16)
        acc = acc * (alpha[:, None][None, :, :] * (unit / new_unit)[:, None][:, None, :])
        acc = mma_v2(gl.convert_layout(p_t, DOT_A, assert_trivial=True),
                     _value_codes(cache, pages, start, kv_end, PAGE_SIZE), acc)
        unit = new_unit

    seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
    lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    to_out = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)[:, None][None, :, :] * unit[:, None][:, None, :]
    o = (acc * to_out).reshape([4, 16, 16, 8]).permute((0, 1, 3, 2)).reshape([4, 16, 128])  # back in cache order
    o = gl.convert_layout(o, OUT, assert_trivial=True)
    t, r, c = _indices(TILES, ROWS, TILE, OUT)
    rows_o = row_block * ROWS + r
    cols = t * TILE + c
    if slot_out < 0:  # the item covers its rows' whole range: the final result
        gl.store(_row_at(out, rows_o, q_first, num_heads, stride_ot, stride_oh) + cols, o.to(gl.bfloat16),
                 mask=rows_o < q_len * num_heads)
        gl.store(_row_at(lse, rows_s, q_first, num_heads, stride_lt, 1), lse2 * LN2, mask=ok_s)
    else:  # one split of several: a normalized partial for decode_kernel._merge_splits_kernel
        policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        gl.store(part_out + (slot_out.to(gl.int64) * ROWS + r) * NOPE + cols, o, eviction_policy=policy)
        gl.store(part_lse + slot_out.to(gl.int64) * ROWS + gl.arange(0, ROWS, layout=ROW_SLICE), lse2,
                 eviction_policy=policy)
