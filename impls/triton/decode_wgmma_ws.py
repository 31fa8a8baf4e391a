"""The 64-row bf16 decode split step in Gluon, warp-specialized: one warpgroup scores, one multiplies values, one loads.

``decode_wgmma`` splits each 64-key tile's scores over its two warpgroups (32 keys each, so each reads the whole
query block per tile: m64n32 products bound by shared memory, a third of its time at 128 heads) and runs the copy
wait, scores, the maximum's exchange, P and the value products one after another in both. Here the work is divided
as FlashInfer's Hopper MLA kernel divides it (``include/flashinfer/attention/mla_hopper.cuh``, read, not copied):

- the scoring warpgroup (the default partition) takes each tile's whole score product (m64n64: the query block read
  once per tile), its softmax (no exchange between warpgroups), writes P over the tile's rope (which only the scores
  read) and the rescale factor beside it, then multiplies P by the values of output columns 256-511;
- the value warpgroup multiplies each tile's P by the values of columns 0-255, rescaled by that factor, while the
  scoring warpgroup takes the next tile's scores;
- a loader warpgroup copies each item's query block (contiguous) by TMA and its key tiles into two stages: by TMA
  where pages hold whole tiles (``PAGE_SIZE`` a multiple of 64), else gathered key by key with cp.async, as
  ``decode_wgmma`` copies them (session 50, H100, against decode_wgmma, us: 128 heads page 1 b1 ctx8192 26.7 ->
  24.1, b8 38.6 -> 35.9, b32 105.1 -> 92.2, b128 382.4 -> 318.3, b64 ctx16384 741.3 -> 617.8; pages 16, 32 and 48
  b32 about 108.8 -> 91.8; 64 heads x 2 tokens page 1 b32 106.0 -> 92.8; 16 heads x 4 tokens 77.2 -> 75.4).

128 heads, page 64, with the schedule's row blocks side by side, us, best of three (NOTES.md, session 34),
``decode_wgmma`` -> this kernel: H100 b1 ctx8192 27.7 -> 26.2, b32 ctx4096 104.7 -> 99.0, b128 376.7 -> 345.7, b32
ctx16384 372.0 -> 343.6, b64 ctx16384 723.6 -> 648.7, b8 ctx4096 38.4 both; H200 b32 100.4 -> 92.9, b128 362.3 ->
327.4, b64 ctx16384 718.7 -> 636.0.

Its loop waits on its copies more than on its products (session 49, H100, 128 heads b128 ctx4096: the copies alone,
every product left out, 250 us of the kernel's 348; either warpgroup's value products left out, -1.1 and -1.4%; one
256-column product a step instead of two of 128, P from registers, or the value warpgroup taking 384 columns: within
+-1.4%). So the scoring warpgroup frees the previous tile's stage before it issues the next scores, not after they
finish, and the loader's next copy starts a score product earlier (session 50, best of five: b32 ctx4096 94.5 ->
93.4, b64 ctx16384 643.5 -> 618.5, 128 heads x 2 tokens b32 158.0 -> 153.0; no shape measured slower by more than
0.3%). Session 49's request to L2 for the tile after the one the loader waits to copy (3-6% then, where two programs
read each tile) lost from then on: b32 -1.1%, but b64 +4.4%, b96 +5.3%, b64 ctx16384 +6.1%, page 1 +6 to +17%.

Where every group is cut into 2-4 splits of one program each (``CLUSTER``), the splits run as a thread-block cluster
and merge their partials themselves, as ``decode_wgmma_narrow``'s do; the merge kernel's 64-row partials had cost
5.4-12.2 us (session 51, H100: 128 heads b32 ctx4096 6.6 us of 90.9). Its programs then release the stream's next
kernel at their start. H100, the merge kernel -> clusters, us, best of five (NOTES.md, session 51): 128 heads b32
ctx4096 90.9 -> 88.9, b33 92.6 -> 90.0 (-2.9%), page 1 b32 92.1 -> 88.9, 2 tokens b16 86.9 -> 84.8; 64 heads b64
130.2 -> 123.0 (-5.6%), b66 ctx2048 81.2 -> 73.3 (-9.7%); 16 heads x 4 tokens b64 130.3 -> 122.7. Batches whose
balanced cut straddles requests are cut into such clusters (``decode._cluster_cuts``): 64 heads b18-b60 ctx1024-8192
-6.7 to -21.6%, 16 heads x 4 tokens b36 -10.9%.

Same work items, partials and merge as ``decode_kernel._decode_split_kernel``, with the query and the cache as
``[rows, 576]`` bf16 TMA descriptors (``[64, 64]`` boxes) in place of their pointers and strides. Launch with
``LAUNCH_OPTIONS``.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from impls.triton.decode_kernel import ITEM_FIELDS, LN2, NOPE, ROPE, TILE
from impls.triton.decode_wgmma import (KEYS, ROWS, STAGES, SWIZZLED, WIDTH, _copy_key_tile, _cta_barrier,
                                       _item_fields, _key_rows, _launch_dependents, _prefetch_first_keys,
                                       _program_items, _row_at, _row_limits, _step_page)
from impls.triton.decode_wgmma_narrow import (_cluster_arrive, _cluster_barrier, _cluster_weights, _merge_tile,
                                              _store_for_others, _store_lse)

# Triton 3.6 (the GPU machine) names the TMA copy into shared memory as newer releases (CI) no longer do.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT))
ROW_O = gl.constexpr(gl.SliceLayout(1, O_LAYOUT))
TILE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0]))
FLAT = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
# The barriers (one allocation, by index):
KREADY = gl.constexpr(0)   # + stage: the tile is in (TMA)
PREADY = gl.constexpr(2)   # + stage: P and its rescale factor are in
KFREE = gl.constexpr(4)    # + stage: both multiplying warpgroups are done with it
QREADY = gl.constexpr(6)
QFREE = gl.constexpr(7)    # the scoring warpgroup is done with the query block
LREADY = gl.constexpr(8)   # the item's row sums are in (for the value warpgroup)
LFREE = gl.constexpr(9)    # the value warpgroup has read them
BARRIERS = gl.constexpr(10)
LOADER_WARPS = gl.constexpr(4)  # a gathered tile's barrier waits for each of their threads' copies
LAUNCH_OPTIONS = {"num_warps": 4, "maxnreg": 168}  # 12 warps: 240 registers for each multiplying warpgroup


@triton.constexpr_function
def _gathers(page_size):
    """Whether the loader gathers each key tile row by row (cp.async: pages smaller than a tile or not a multiple of
    it, where a tile's keys are not one TMA box) rather than copying it by TMA."""
    return page_size % KEYS.value != 0


@gluon.jit
def _decode_split_kernel_wgmma_ws(
    cache, q_desc, k_desc, block_table, stride_bt, visible, work, items_stride, item_counts, out, stride_ot, stride_oh,
    lse, stride_lt, part_out, part_lse, qk_scale, num_heads, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr,
    WAIT_PRIOR: gl.constexpr, KEYS_AHEAD: gl.constexpr, CLUSTER: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract); ``q_desc`` and ``k_desc``: the
    query and the cache as ``[rows, 576]`` bf16 in ``[64, 64]`` boxes (``cache``, its base: for ``KEYS_AHEAD``, and
    for the loader's gathers in pages under a tile, where ``k_desc`` goes unused). ``CLUSTER`` > 1: the grid runs in
    clusters of that many programs, each one item, the splits of one group in rank order, which merge their partials
    themselves (``_store_columns``), as ``decode_wgmma_narrow``'s do; with no merge kernel after it, the stream's next
    kernel, if a programmatic dependent, may start now (it waits for this grid's results on the device)."""
    if CLUSTER > 1:
        _launch_dependents()
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [4, ROWS, TILE], SWIZZLED)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [1, ROWS, ROPE], SWIZZLED)  # indexed by a run-time 0 (_score)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [4 * STAGES, KEYS, TILE], SWIZZLED)  # stage b, tile t: 4 b + t
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, KEYS, ROPE], SWIZZLED)  # then P [64 rows, 64 keys]
    factors = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], FLAT)  # each stage's P: the output's rescale
    sums = gl.allocate_shared_memory(gl.float32, [ROWS], FLAT)  # an item's row sums, for the value warpgroup
    bars = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(BARRIERS):  # a gathered tile: each loader thread arrives once its copies are in
        mbarrier.init(bars.index(b), count=2 if b >= KFREE and b < KFREE + STAGES else
                      (32 * LOADER_WARPS if _gathers(PAGE_SIZE) and b < KREADY + STAGES else 1))
    hopper.fence_async_shared()
    if KEYS_AHEAD > 0:  # before the partitions: the loader's registers are few
        _prefetch_first_keys(work, items_stride, item_counts, cache, block_table, stride_bt, PAGE_SIZE, 2 * WIDTH,
                             KEYS_AHEAD)
    gl.warp_specialize([
        (_score, (visible, work, items_stride, item_counts, out, stride_ot, stride_oh, lse, stride_lt, part_out,
                  part_lse, qk_scale, num_heads, q_lat, q_rope, k_lat, k_rope, factors, sums, bars, PAGE_SIZE,
                  KEEP_PARTIALS, WAIT_PRIOR, CLUSTER)),
        (_value, (work, items_stride, item_counts, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse,
                  num_heads, k_lat, k_rope, factors, sums, bars, PAGE_SIZE, KEEP_PARTIALS, WAIT_PRIOR, CLUSTER)),
        (_load, (cache, q_desc, k_desc, block_table, stride_bt, work, items_stride, item_counts, num_heads, q_lat,
                 q_rope, k_lat, k_rope, bars, PAGE_SIZE, WAIT_PRIOR, CLUSTER)),
    ], [4, LOADER_WARPS], [240, 24])


@gluon.jit
def _load(cache, q_desc, k_desc, block_table, stride_bt, work, items_stride, item_counts, num_heads, q_lat, q_rope,
          k_lat, k_rope, bars, PAGE_SIZE: gl.constexpr, WAIT_PRIOR: gl.constexpr, CLUSTER: gl.constexpr):
    """The loader: each item's query block, then its key tiles, the program's tile g into stage g % 2: by TMA in
    pages of whole tiles, else gathered key by key (cp.async, each thread arriving on the tile's barrier once its
    copies land). Under ``CLUSTER`` it arrives at the cluster's barrier when done (the merge waits for every
    thread that has not exited)."""
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    nq = 0
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        if tiles > 0:
            mbarrier.wait(bars.index(QFREE), (nq & 1) ^ 1)
            qbar = bars.index(QREADY)
            q_row = (q_first * num_heads + row_block * ROWS).to(gl.int32)
            mbarrier.expect(qbar, ROWS * WIDTH * 2)
            for t in gl.static_range(4):
                _tma_load(q_desc, [q_row, TILE * t], qbar, q_lat.index(t).slice(0, 64, 1))
                _tma_load(q_desc, [q_row, TILE * t + 64], qbar, q_lat.index(t).slice(64, 64, 1))
            _tma_load(q_desc, [q_row, NOPE], qbar, q_rope.index(0))
            nq += 1
            pages = block_table + request.to(gl.int64) * stride_bt
            for j in range(tiles):
                b = g % STAGES
                start = kv_start + j * KEYS
                bar = bars.index(KREADY + b)
                if _gathers(PAGE_SIZE):  # the tile's block-table entries read before the wait
                    rows, ok = _key_rows(cache.to(gl.pointer_type(gl.bfloat16)), pages, start, kv_end, PAGE_SIZE,
                                         TILE_LAYOUT)
                    mbarrier.wait(bars.index(KFREE + b), ((g // STAGES) & 1) ^ 1)
                    _copy_key_tile(k_lat, k_rope, b, rows, ok)
                    async_copy.mbarrier_arrive(bar, increment_count=False)
                else:
                    mbarrier.wait(bars.index(KFREE + b), ((g // STAGES) & 1) ^ 1)
                    row = (_step_page(pages, start, kv_end, PAGE_SIZE) * PAGE_SIZE + start % PAGE_SIZE).to(gl.int32)
                    mbarrier.expect(bar, KEYS * WIDTH * 2)
                    for t in gl.static_range(4):
                        _tma_load(k_desc, [row, TILE * t], bar, k_lat.index(4 * b + t).slice(0, 64, 1))
                        _tma_load(k_desc, [row, TILE * t + 64], bar, k_lat.index(4 * b + t).slice(64, 64, 1))
                    _tma_load(k_desc, [row, NOPE], bar, k_rope.index(b))
                g += 1
    if CLUSTER > 1:
        _cluster_arrive()


@gluon.jit
def _score(visible, work, items_stride, item_counts, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse,
           qk_scale, num_heads, q_lat, q_rope, k_lat, k_rope, factors, sums, bars, PAGE_SIZE: gl.constexpr,
           KEEP_PARTIALS: gl.constexpr, WAIT_PRIOR: gl.constexpr, CLUSTER: gl.constexpr):
    """The scoring warpgroup: each tile's scores and softmax, P over the tile's rope, then output columns 256-511."""
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    nq = 0
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        _, _, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS, ROW_S)
        key_cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, S_LAYOUT))
        m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([ROWS], gl.float32, ROW_S)
        acc0 = gl.zeros([ROWS, TILE], gl.float32, O_LAYOUT)
        acc1 = gl.zeros([ROWS, TILE], gl.float32, O_LAYOUT)
        if tiles > 0:
            mbarrier.wait(bars.index(QREADY), nq & 1)
            acc0 = hopper.warpgroup_mma_init(acc0)  # carried through the loop as in-flight products
            acc1 = hopper.warpgroup_mma_init(acc1)
            for j in range(tiles):
                b = g % STAGES
                start = kv_start + j * KEYS
                zero = start >> 30  # a run-time 0: operand addresses made in the loop, not held in registers
                # The previous tile's value products done: its stage is free before these scores are issued.
                acc0, acc1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1])
                if j > 0:
                    _cta_barrier()
                    mbarrier.arrive(bars.index(KFREE + (g + 1) % STAGES), count=1)
                mbarrier.wait(bars.index(KREADY + b), (g // STAGES) & 1)
                if _gathers(PAGE_SIZE):
                    hopper.fence_async_shared()  # the loader's cp.async writes, before wgmma reads them
                s = gl.zeros([ROWS, KEYS], gl.float32, S_LAYOUT)
                s = hopper.warpgroup_mma(q_rope.index(zero), k_rope.index(b).permute((1, 0)), s, is_async=True)
                for t in gl.static_range(4):
                    s = hopper.warpgroup_mma(q_lat.index(t + zero), k_lat.index(4 * b + t).permute((1, 0)), s,
                                             is_async=True)
                s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
                if j == tiles - 1:
                    _cta_barrier()
                    mbarrier.arrive(bars.index(QFREE), count=1)
                s = gl.where((start + key_cols)[None, :] < limit[:, None], s * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                u = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - u)
                p = gl.exp2(s - u[:, None]).to(gl.bfloat16)
                l_i = l_i * alpha + gl.sum(p.to(gl.float32), 1)
                m_i = m_new
                _cta_barrier()  # every warp's score products are done reading the rope P replaces
                k_rope.index(b).store(p)
                factors.index(b).store(alpha)
                if not _gathers(PAGE_SIZE) and start + KEYS > kv_end:  # a gathered tile has zeros there
                    _zero_past(k_lat, b, start, kv_end)
                hopper.fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(bars.index(PREADY + b), count=1)
                alpha_o = gl.convert_layout(alpha, ROW_O)[:, None]
                acc0 = hopper.warpgroup_mma(k_rope.index(b + zero), k_lat.index(4 * b + 2), acc0 * alpha_o,
                                            is_async=True)
                acc1 = hopper.warpgroup_mma(k_rope.index(b + zero), k_lat.index(4 * b + 3), acc1 * alpha_o,
                                            is_async=True)
                g += 1
            acc0, acc1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1])
            _cta_barrier()
            mbarrier.arrive(bars.index(KFREE + (g + 1) % STAGES), count=1)
            _send(sums, l_i, bars.index(LREADY), bars.index(LFREE), nq & 1)  # for the value warpgroup's normalization
            nq += 1
        seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
        rows = row_block * ROWS + gl.arange(0, ROWS, layout=ROW_S)
        _store_lse(gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf")), rows,
                   rows < q_len * num_heads, lse, stride_lt, part_lse, row_block, slot_out, q_first, num_heads, ROWS,
                   KEEP_PARTIALS)  # before the columns: under CLUSTER the other splits read it after the barrier
        _store_columns(1, l_i, acc0, acc1, row_block, slot_out, q_first, q_len, num_heads, out, stride_ot, stride_oh,
                       lse, stride_lt, part_out, part_lse, KEEP_PARTIALS, CLUSTER)


@gluon.jit
def _value(work, items_stride, item_counts, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, num_heads,
           k_lat, k_rope, factors, sums, bars, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr,
           WAIT_PRIOR: gl.constexpr, CLUSTER: gl.constexpr):
    """The value warpgroup: output columns 0-255 of every tile, from the P and factor the scoring warpgroup left."""
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    nq = 0
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        l_i = gl.zeros([ROWS], gl.float32, ROW_S)
        acc0 = gl.zeros([ROWS, TILE], gl.float32, O_LAYOUT)
        acc1 = gl.zeros([ROWS, TILE], gl.float32, O_LAYOUT)
        if tiles > 0:
            for j in range(tiles):
                b = g % STAGES
                zero = j >> 30
                mbarrier.wait(bars.index(PREADY + b), (g // STAGES) & 1)
                if _gathers(PAGE_SIZE):
                    hopper.fence_async_shared()  # the loader's cp.async writes, before wgmma reads them
                alpha_o = factors.index(b).load(ROW_O)[:, None]
                acc0 = hopper.warpgroup_mma(k_rope.index(b + zero), k_lat.index(4 * b), acc0 * alpha_o,
                                            is_async=True)
                acc1 = hopper.warpgroup_mma(k_rope.index(b + zero), k_lat.index(4 * b + 1), acc1 * alpha_o,
                                            is_async=True)
                acc0, acc1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1])
                _cta_barrier()
                mbarrier.arrive(bars.index(KFREE + b), count=1)
                g += 1
            l_i = _receive(sums, ROW_S, bars.index(LREADY), bars.index(LFREE), nq & 1)
            nq += 1
        _store_columns(0, l_i, acc0, acc1, row_block, slot_out, q_first, q_len, num_heads, out, stride_ot, stride_oh,
                       lse, stride_lt, part_out, part_lse, KEEP_PARTIALS, CLUSTER)


@gluon.jit
def _send(buffer, value, ready, free, phase):
    """A warpgroup's hand-off of ``value`` to another through ``buffer``, the counterpart of ``_receive`` with the
    same ``phase``: waits until the receiver has read the buffer's previous contents (``free``; a new barrier passes
    at once), stores, and once every warp has stored, arrives on ``ready``."""
    mbarrier.wait(free, phase ^ 1)
    buffer.store(value)
    _cta_barrier()
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _receive(buffer, layout: gl.constexpr, ready, free, phase):
    """A warpgroup's receipt of what another handed it in ``buffer``: waits for ``ready`` (in ``phase``), loads the
    buffer in ``layout``, and once every warp has it, arrives on ``free`` so that the sender may write it again."""
    mbarrier.wait(ready, phase)
    value = buffer.load(layout)
    _cta_barrier()
    mbarrier.arrive(free, count=1)
    return value


@gluon.jit
def _item_tiles(table, i):
    """The program's ``i``-th work item (``_item_fields``) and its number of key tiles, which every partition walks."""
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = _item_fields(table + i * ITEM_FIELDS)
    return request, row_block, kv_start, kv_end, slot_out, q_first, q_len, gl.cdiv(kv_end - kv_start, KEYS)


@gluon.jit
def _zero_past(k_lat, b, start, kv_end):
    """Zero the rows at or past ``kv_end`` of stage ``b``'s four value tiles (the TMA copied the page's whole rows: a
    slot no key was written to may hold NaN, and 0 x NaN is NaN)."""
    ok = (start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, TILE_LAYOUT))) < kv_end
    for t in gl.static_range(4):
        x = k_lat.index(4 * b + t).load(TILE_LAYOUT)
        k_lat.index(4 * b + t).store(gl.where(ok[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _store_columns(half: gl.constexpr, l_i, acc0, acc1, row_block, slot_out, q_first, q_len, num_heads, out, stride_ot,
                   stride_oh, lse, stride_lt, part_out, part_lse, KEEP_PARTIALS: gl.constexpr, CLUSTER: gl.constexpr):
    """Output columns ``[256 half, 256 half + 256)`` over the row sums ``l_i``: final bf16 rows where the item covers
    its rows' whole range (``slot_out < 0``), else a float32 partial for ``_merge_splits_kernel``; under ``CLUSTER``,
    merged with the cluster's other splits (``_merge_in_cluster``)."""
    seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
    inv_l = gl.convert_layout(gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0), ROW_O)[:, None]
    rows = row_block * ROWS + gl.arange(0, ROWS, layout=ROW_O)
    cols = 2 * half * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(0, O_LAYOUT))[None, :]
    if CLUSTER > 1:
        _merge_in_cluster(half, acc0 * inv_l, acc1 * inv_l, row_block, slot_out, q_first, q_len, num_heads, out,
                          stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, KEEP_PARTIALS, CLUSTER)
    elif slot_out < 0:
        o0 = (acc0 * inv_l).to(gl.bfloat16)
        o1 = (acc1 * inv_l).to(gl.bfloat16)
        out_at = _row_at(out, rows, q_first, num_heads, stride_ot, stride_oh)[:, None] + cols
        ok = (rows < q_len * num_heads)[:, None]
        gl.store(out_at, o0, mask=ok)
        gl.store(out_at + TILE, o1, mask=ok)
    else:
        policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        part_rows = slot_out.to(gl.int64) * ROWS + gl.arange(0, ROWS, layout=ROW_O)
        part_at = part_out + (part_rows * NOPE)[:, None] + cols
        gl.store(part_at, acc0 * inv_l, eviction_policy=policy)
        gl.store(part_at + TILE, acc1 * inv_l, eviction_policy=policy)


@gluon.jit
def _merge_in_cluster(half: gl.constexpr, o0, o1, row_block, slot_out, q_first, q_len, num_heads, out, stride_ot,
                      stride_oh, lse, stride_lt, part_out, part_lse, KEEP_PARTIALS: gl.constexpr,
                      CLUSTER: gl.constexpr):
    """A warpgroup's normalized output tiles ``2 half`` and ``2 half + 1`` (``o0``, ``o1``) where the group's splits
    are this cluster's programs (rank = split, every split's LSE stored in its slot before its scoring warpgroup
    arrives): the program of rank ``t % CLUSTER`` merges tile ``t`` (``decode_wgmma_narrow._merge_in_cluster``'s
    division). The tiles others merge go to this split's slot, the cluster's barrier orders them before the reads,
    then each kept tile is merged with the others' (``decode_wgmma_narrow._merge_tile``); rank 0's scoring warpgroup
    stores the merged LSE."""
    rank = gl.program_id(0) % CLUSTER
    local = gl.arange(0, ROWS, layout=ROW_O)
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, O_LAYOUT))[None, :]
    slot_at = (local * NOPE)[:, None] + cols
    policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
    own_at = part_out + slot_out.to(gl.int64) * (ROWS * NOPE) + slot_at
    _store_for_others(o0, own_at, 2 * half, rank, CLUSTER, policy)
    _store_for_others(o1, own_at, 2 * half + 1, rank, CLUSTER, policy)
    _cluster_barrier()
    first_slot = (slot_out - rank).to(gl.int64)
    merged, w0, w1, w2, w3 = _cluster_weights(part_lse, first_slot, local, 1.0, ROWS, KEEP_PARTIALS, CLUSTER)
    w0, w1, w2, w3 = w0[:, None], w1[:, None], w2[:, None], w3[:, None]
    rows = row_block * ROWS + local
    ok = rows < q_len * num_heads
    out_at = _row_at(out, rows, q_first, num_heads, stride_ot, stride_oh)[:, None] + cols
    _merge_tile(o0, 2 * half, w0, w1, w2, w3, part_out, first_slot, slot_at, out_at, ok[:, None], rank, ROWS,
                KEEP_PARTIALS, CLUSTER)
    _merge_tile(o1, 2 * half + 1, w0, w1, w2, w3, part_out, first_slot, slot_at, out_at, ok[:, None], rank, ROWS,
                KEEP_PARTIALS, CLUSTER)
    if half == 1 and rank == 0:
        gl.store(_row_at(lse, rows, q_first, num_heads, stride_lt, 1), merged * LN2, mask=ok)
