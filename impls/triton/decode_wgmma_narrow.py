"""The 16- and 32-row bf16 decode split step in Gluon, for Hopper: keys on wgmma's M side, tiles copied straight in.

With 16 or 32 query rows (16 heads of one or two new tokens, 32 heads) the rows are too few for wgmma's M of 64,
so the products run transposed, as in ``decode_wgmma_fp8``: ``S^T = K Q^T`` with the step's 64 keys as M and the
rows as N, and ``O^T += V^T P^T``. A bf16 cache needs no decode: each key tile is copied with ``cp.async`` into the
swizzled buffers the products read (two stages, ``decode_wgmma``'s copies), so one warpgroup per multiprocessor
only waits, multiplies and runs the softmax. A step's copies go key by key through the block table, so page 1
costs what page 64 does, less the table's reads.

Against the Triton kernel (``decode_kernel``, mma.sync from shared memory, three stages) on an H200, 16 heads
ctx4096 (NOTES.md, session 15): 32 rows (two tokens) b32 67.1 -> 50.2 us, b128 215.7 -> 146.2; 16 rows in pages
smaller than a step, page 1 b32 51.8 -> 49.2, b128 158.1 -> 149.2, page 16 b64 89.5 -> 81.8. In whole 64-key pages
the two tie (within 0.7% at b32-b128), and the Triton kernel, which the CPU tests run too, stays the default there.

Same arguments, work items, partials and merge as ``decode_kernel._decode_split_kernel``; ``cache`` is the paged
cache's bytes (bf16 rows of ``WIDTH`` values). With ``CLUSTER`` > 1 the plan has cut every group into that many
splits, one program each, and launches the grid in clusters of a group's splits: each program stores its partial,
the cluster's barrier orders the stores before the reads, and each program merges a share of the output columns from
the group's partials, so no merge kernel runs (``decode._cluster_size``). The merge kernel's 3.6 us at b64 (NOTES.md
session 43) was a grid-wide wait, a launch and a chain of L2 reads; a cluster waits only for its own splits, and its
merge is one round of L2 reads (H100, 16 heads b64 ctx4096: 111.8 -> 109.8 us, NOTES.md session 46).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from impls.triton.decode_kernel import ITEM_FIELDS, LN2, NOPE, ROPE, TILE
from impls.triton.decode_wgmma import (KEYS, STAGES, SWIZZLED, WIDTH, _cta_barrier, _item_fields, _key_rows,
                                       _launch_dependents, _prefetch_first_keys, _program_items, _refill_stage,
                                       _row_at, _row_limits, _start_copies, _wait_tile)

# Copies: 16 bytes per thread, a warp covers 4 rows of 64 columns (decode_wgmma's, for one warpgroup).
COPY_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0]))
# Outputs [128 columns, rows] stored 4 contiguous columns a thread.
STORE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[32, 1], warps_per_cta=[1, 4],
                                             order=[0, 1]))
STORED_ROWS = gl.constexpr(gl.SliceLayout(0, STORE_LAYOUT))  # a [rows] vector beside stored outputs


@gluon.jit
def _decode_split_kernel_narrow(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, work, items_stride, item_counts,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
    ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr,
    WAIT_PRIOR: gl.constexpr, KEYS_AHEAD: gl.constexpr, CLUSTER: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of ``ROWS`` (16 or 32) query
    rows. ``EARLY_MERGE``: let the merge kernel, a programmatic dependent launch, start now (it waits for this
    grid's results on the device); under ``CLUSTER`` there is no merge kernel, and the stream's next kernel, if a
    programmatic dependent, may start. ``CLUSTER`` > 1: the grid runs in clusters of that many programs, each one
    item, the splits of one group in rank order, which merge their partials themselves (``_merge_in_cluster``)."""
    if EARLY_MERGE:
        _launch_dependents()
    PROBS_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * ROWS, element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [4, ROWS, TILE], SWIZZLED)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [ROWS, ROPE], SWIZZLED)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 4, KEYS, TILE], SWIZZLED)
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, KEYS, ROPE], SWIZZLED)
    probs = gl.allocate_shared_memory(gl.bfloat16, [KEYS, ROWS], PROBS_SMEM)  # P^T
    if KEYS_AHEAD > 0:
        _prefetch_first_keys(work, items_stride, item_counts, cache, block_table, stride_bt, PAGE_SIZE, 2 * WIDTH,
                             KEYS_AHEAD)
    cache = cache.to(gl.pointer_type(gl.bfloat16))
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    for i in range(items):
        _attend_item(_item_fields(table + i * ITEM_FIELDS), q, stride_qt, stride_qh, cache, block_table, stride_bt,
                     visible, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                     q_lat, q_rope, k_lat, k_rope, probs, ROWS, PAGE_SIZE, KEEP_PARTIALS, CLUSTER)


@gluon.jit
def _transposed_state(ROWS: gl.constexpr, ACC: gl.constexpr):
    """A transposed item's fresh state in the products' layout ``ACC``: the running max per row, running sums per
    key slot (summed over the keys at the end), a zero ``S^T`` tile and the four ``O^T`` tiles (128 columns each)."""
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(0, ACC))
    l_part = gl.zeros([KEYS, ROWS], gl.float32, ACC)
    zero = gl.zeros([KEYS, ROWS], gl.float32, ACC)
    acc = gl.zeros([TILE, ROWS], gl.float32, ACC)
    return m_i, l_part, zero, acc, acc, acc, acc


@gluon.jit
def _attend_item(item, q, stride_qt, stride_qh, cache, block_table, stride_bt, visible,
                 out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
                 q_lat, q_rope, k_lat, k_rope, probs, ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr,
                 KEEP_PARTIALS: gl.constexpr, CLUSTER: gl.constexpr):
    """One work item (``_item_fields``): ``ROWS`` query rows of one request over keys ``[kv_start, kv_end)``."""
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = item
    # S^T [64 keys, ROWS] and O^T [128 columns, ROWS] per value tile.
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    ACC_KEYS: gl.constexpr = gl.SliceLayout(1, ACC)
    ACC_ROWS: gl.constexpr = gl.SliceLayout(0, ACC)
    pages, tiles = _start_copies(q, stride_qt, stride_qh, cache, block_table, stride_bt, request, row_block,
                                 kv_start, kv_end, q_first, q_len, num_heads, q_lat, q_rope, k_lat, k_rope, ROWS,
                                 PAGE_SIZE, COPY_LAYOUT)
    rows_s, ok_s, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS, ACC_ROWS)
    key_ids = gl.arange(0, KEYS, layout=ACC_KEYS)
    m_i, l_part, zero, acc0, acc1, acc2, acc3 = _transposed_state(ROWS, ACC)
    for j in range(tiles):
        stage = j % STAGES
        start = kv_start + j * KEYS
        # The block-table entries of the tile copied after this one's products, read now (see decode_wgmma).
        next_rows, next_ok = _key_rows(cache, pages, start + STAGES * KEYS, kv_end, PAGE_SIZE, COPY_LAYOUT)
        _wait_tile()

        s = hopper.warpgroup_mma(k_rope.index(stage), q_rope.permute((1, 0)), zero, use_acc=False, is_async=True)
        for t in gl.static_range(4):
            s = hopper.warpgroup_mma(k_lat.index(stage * 4 + t), q_lat.index(t).permute((1, 0)), s, is_async=True)
        s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
        s = gl.where((start + key_ids)[:, None] < limit[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))  # across the four warps (through shared memory)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_part = l_part * alpha[None, :] + p
        m_i = m_new
        probs.store(p.to(gl.bfloat16))
        hopper.fence_async_shared()
        _cta_barrier()

        alpha_o = alpha[None, :]
        acc0 = hopper.warpgroup_mma(k_lat.index(stage * 4 + 0).permute((1, 0)), probs, acc0 * alpha_o, is_async=True)
        acc1 = hopper.warpgroup_mma(k_lat.index(stage * 4 + 1).permute((1, 0)), probs, acc1 * alpha_o, is_async=True)
        acc2 = hopper.warpgroup_mma(k_lat.index(stage * 4 + 2).permute((1, 0)), probs, acc2 * alpha_o, is_async=True)
        acc3 = hopper.warpgroup_mma(k_lat.index(stage * 4 + 3).permute((1, 0)), probs, acc3 * alpha_o, is_async=True)
        acc0, acc1, acc2, acc3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1, acc2, acc3])
        _cta_barrier()  # every warp is done with this stage and with P
        _refill_stage(k_lat, k_rope, stage, next_rows, next_ok, j + STAGES < tiles)
    async_copy.wait_group(0)
    _cta_barrier()  # the next item's copies reuse the buffers

    l_i = gl.sum(l_part, 0)
    seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
    lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    inv_l = gl.convert_layout(inv_l, STORED_ROWS)
    _store_lse(lse2, rows_s, ok_s, lse, stride_lt, part_lse, row_block, slot_out, q_first, num_heads, ROWS,
               KEEP_PARTIALS)  # into the split's slot where it merges in its cluster
    if CLUSTER > 1:
        _merge_in_cluster(acc0, acc1, acc2, acc3, inv_l, out, stride_ot, stride_oh, lse, stride_lt, part_out,
                          part_lse, row_block, slot_out, q_first, q_len, num_heads, ROWS, KEEP_PARTIALS, CLUSTER)
    else:
        _store_item(acc0, acc1, acc2, acc3, inv_l, out, stride_ot, stride_oh, part_out, row_block, slot_out, q_first,
                    q_len, num_heads, ROWS, KEEP_PARTIALS)


@gluon.jit
def _normalized(acc0, acc1, acc2, acc3, inv_l):
    """The four ``O^T`` tiles over the row sums (``inv_l``: their inverses along ``STORED_ROWS``), in
    ``STORE_LAYOUT``."""
    o0 = gl.convert_layout(acc0, STORE_LAYOUT) * inv_l[None, :]
    o1 = gl.convert_layout(acc1, STORE_LAYOUT) * inv_l[None, :]
    o2 = gl.convert_layout(acc2, STORE_LAYOUT) * inv_l[None, :]
    o3 = gl.convert_layout(acc3, STORE_LAYOUT) * inv_l[None, :]
    return o0, o1, o2, o3


@gluon.jit
def _store_item(acc0, acc1, acc2, acc3, inv_l, out, stride_ot, stride_oh, part_out, row_block, slot_out, q_first,
                q_len, num_heads, ROWS: gl.constexpr, KEEP_PARTIALS: gl.constexpr):
    """The item's normalized output ``O^T_t / l``, columns contiguous: the final bf16 rows where the item covers
    its rows' whole range (``slot_out < 0``), else a float32 partial for ``_merge_splits_kernel``."""
    rows = gl.arange(0, ROWS, layout=STORED_ROWS)
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(1, STORE_LAYOUT))[:, None]
    o0, o1, o2, o3 = _normalized(acc0, acc1, acc2, acc3, inv_l)
    if slot_out < 0:
        rows = row_block * ROWS + rows
        out_at = _row_at(out, rows, q_first, num_heads, stride_ot, stride_oh)[None, :] + cols
        mask = (rows < q_len * num_heads)[None, :]
        gl.store(out_at, o0.to(gl.bfloat16), mask=mask)
        gl.store(out_at + TILE, o1.to(gl.bfloat16), mask=mask)
        gl.store(out_at + 2 * TILE, o2.to(gl.bfloat16), mask=mask)
        gl.store(out_at + 3 * TILE, o3.to(gl.bfloat16), mask=mask)
    else:
        policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        part_at = part_out + (slot_out.to(gl.int64) * ROWS + rows)[None, :] * NOPE + cols
        gl.store(part_at, o0, eviction_policy=policy)
        gl.store(part_at + TILE, o1, eviction_policy=policy)
        gl.store(part_at + 2 * TILE, o2, eviction_policy=policy)
        gl.store(part_at + 3 * TILE, o3, eviction_policy=policy)


@gluon.jit
def _store_lse(lse2, rows, ok, lse, stride_lt, part_lse, row_block, slot_out, q_first, num_heads,
               ROWS: gl.constexpr, KEEP_PARTIALS: gl.constexpr):
    """The item's base-2 log-sum-exp of query rows ``rows`` (absolute, ``ok`` where real): natural-log into ``lse``
    where the item covers its rows' whole range, else into its partial's slot."""
    if slot_out < 0:
        gl.store(_row_at(lse, rows, q_first, num_heads, stride_lt, 1), lse2 * LN2, mask=ok)
    else:
        policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        gl.store(part_lse + slot_out.to(gl.int64) * ROWS + (rows - row_block * ROWS), lse2, eviction_policy=policy)


@gluon.jit
def _cluster_barrier():
    """Wait until every program of this cluster arrives here; the writes each made before arriving (release) are
    then visible to the others (acquire)."""
    _cluster_arrive()
    _cluster_wait()


@gluon.jit
def _cluster_arrive():
    """This thread's arrival at the cluster barrier, releasing its writes; a warp-specialized partition with nothing
    to merge arrives and goes on (the barrier waits for every thread of the cluster that has not exited)."""
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; mov.u32 $0, $1;", "=r,r", [gl.program_id(0)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _cluster_wait():
    """Wait until every thread of this cluster has arrived (``_cluster_arrive``); their released writes are then
    visible (acquire)."""
    gl.inline_asm_elementwise("barrier.cluster.wait.acquire.aligned; mov.u32 $0, $1;", "=r,r", [gl.program_id(0)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _merge_in_cluster(acc0, acc1, acc2, acc3, inv_l, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse,
                      row_block, slot_out, q_first, q_len, num_heads, ROWS: gl.constexpr, KEEP_PARTIALS: gl.constexpr,
                      CLUSTER: gl.constexpr):
    """The item's result where its group's splits are this cluster's programs (rank = split, slot ``slot_out``, its
    LSE already stored there): the program of rank ``t % CLUSTER`` merges output tile ``t`` (128 columns). Each
    program stores the tiles the others merge, passes the cluster barrier, then merges its own tiles from its
    registers and the others' partials (``_merge_stored_splits``)."""
    rank = gl.program_id(0) % CLUSTER
    local = gl.arange(0, ROWS, layout=STORED_ROWS)
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(1, STORE_LAYOUT))[:, None]
    o0, o1, o2, o3 = _normalized(acc0, acc1, acc2, acc3, inv_l)
    store_policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
    own_at = part_out + (slot_out.to(gl.int64) * ROWS + local)[None, :] * NOPE + cols
    _store_for_others(o0, own_at, 0, rank, CLUSTER, store_policy)
    _store_for_others(o1, own_at, 1, rank, CLUSTER, store_policy)
    _store_for_others(o2, own_at, 2, rank, CLUSTER, store_policy)
    _store_for_others(o3, own_at, 3, rank, CLUSTER, store_policy)
    _cluster_barrier()
    _merge_stored_splits(o0, o1, o2, o3, 1.0, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, row_block,
                         slot_out, q_first, q_len, num_heads, ROWS, KEEP_PARTIALS, CLUSTER)


@gluon.jit
def _merge_stored_splits(o0, o1, o2, o3, out_scale, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse,
                         row_block, slot_out, q_first, q_len, num_heads, ROWS: gl.constexpr,
                         KEEP_PARTIALS: gl.constexpr, CLUSTER: gl.constexpr):
    """After the cluster barrier, with every split's base-2 LSE and the tiles others merge in its slot: the program
    of rank ``t % CLUSTER`` merges output tile ``t`` from its own normalized tile (``o0``-``o3``, ``STORE_LAYOUT``;
    None: read from its slot too, where decode_rs_fp8 stores every tile) and the others' stored ones, each weighed by
    its split's share of the merged LSE (every split's LSE read once), times ``out_scale``; rank 0 stores the LSE."""
    rank = gl.program_id(0) % CLUSTER
    first_slot = (slot_out - rank).to(gl.int64)
    local = gl.arange(0, ROWS, layout=STORED_ROWS)
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(1, STORE_LAYOUT))[:, None]
    rows = row_block * ROWS + local
    ok = rows < q_len * num_heads
    out_at = _row_at(out, rows, q_first, num_heads, stride_ot, stride_oh)[None, :] + cols
    merged, w0, w1, w2, w3 = _cluster_weights(part_lse, first_slot, local, out_scale, ROWS, KEEP_PARTIALS, CLUSTER)
    w0, w1, w2, w3, ok2 = w0[None, :], w1[None, :], w2[None, :], w3[None, :], ok[None, :]
    slot_at = (local * NOPE)[None, :] + cols
    _merge_tile(o0, 0, w0, w1, w2, w3, part_out, first_slot, slot_at, out_at, ok2, rank, ROWS, KEEP_PARTIALS, CLUSTER)
    _merge_tile(o1, 1, w0, w1, w2, w3, part_out, first_slot, slot_at, out_at, ok2, rank, ROWS, KEEP_PARTIALS, CLUSTER)
    _merge_tile(o2, 2, w0, w1, w2, w3, part_out, first_slot, slot_at, out_at, ok2, rank, ROWS, KEEP_PARTIALS, CLUSTER)
    _merge_tile(o3, 3, w0, w1, w2, w3, part_out, first_slot, slot_at, out_at, ok2, rank, ROWS, KEEP_PARTIALS, CLUSTER)
    if rank == 0:
        gl.store(_row_at(lse, rows, q_first, num_heads, stride_lt, 1), merged * LN2, mask=ok)


@gluon.jit
def _cluster_weights(part_lse, first_slot, local, out_scale, ROWS: gl.constexpr, KEEP_PARTIALS: gl.constexpr,
                     CLUSTER: gl.constexpr):
    """For the rows ``local`` (in their layout) of a group whose splits are slots ``first_slot ..`` (every split's
    base-2 LSE stored there, read once): the merged base-2 LSE and each split's weight ``2^(lse_k - lse)`` times
    ``out_scale``, four of them (0 past ``CLUSTER``)."""
    split0 = _split_lse(part_lse, first_slot, 0, local, ROWS, KEEP_PARTIALS, CLUSTER)
    split1 = _split_lse(part_lse, first_slot, 1, local, ROWS, KEEP_PARTIALS, CLUSTER)
    split2 = _split_lse(part_lse, first_slot, 2, local, ROWS, KEEP_PARTIALS, CLUSTER)
    split3 = _split_lse(part_lse, first_slot, 3, local, ROWS, KEEP_PARTIALS, CLUSTER)
    m = gl.maximum(gl.maximum(split0, split1), gl.maximum(split2, split3))
    m = gl.where(m == float("-inf"), 0.0, m)  # no split saw a key: every weight stays 0
    total = gl.exp2(split0 - m) + gl.exp2(split1 - m) + gl.exp2(split2 - m) + gl.exp2(split3 - m)
    seen = total != 0.0  # rows that saw nothing (a NaN stays NaN) get lse -inf
    merged = gl.where(seen, m + gl.log2(gl.where(seen, total, 1.0)), float("-inf"))
    w0 = gl.where(seen, gl.exp2(split0 - merged), 0.0) * out_scale
    w1 = gl.where(seen, gl.exp2(split1 - merged), 0.0) * out_scale
    w2 = gl.where(seen, gl.exp2(split2 - merged), 0.0) * out_scale
    w3 = gl.where(seen, gl.exp2(split3 - merged), 0.0) * out_scale
    return merged, w0, w1, w2, w3


@gluon.jit
def _store_for_others(o, own_at, t: gl.constexpr, rank, CLUSTER: gl.constexpr, policy: gl.constexpr):
    """Store this program's normalized tile ``t`` into its slot (``own_at``: the slot's tile 0) where another rank
    merges it."""
    if t % CLUSTER != rank:
        gl.store(own_at + t * TILE, o, eviction_policy=policy)


@gluon.jit
def _split_lse(part_lse, first_slot, k: gl.constexpr, local, ROWS: gl.constexpr, KEEP_PARTIALS: gl.constexpr,
               CLUSTER: gl.constexpr):
    """The base-2 LSE the group's split ``k`` stored (one read per split and program), -inf for ``k`` past
    ``CLUSTER``, so that the merge can always weigh four splits."""
    if k < CLUSTER:
        policy: gl.constexpr = "evict_first" if KEEP_PARTIALS else ""
        return gl.load(part_lse + (first_slot + k) * ROWS + local, eviction_policy=policy)
    else:
        return gl.full_like(local, float("-inf"), dtype=gl.float32)


@gluon.jit
def _merge_tile(own, t: gl.constexpr, w0, w1, w2, w3, part_out, first_slot, slot_at, out_at, ok, rank,
                ROWS: gl.constexpr, KEEP_PARTIALS: gl.constexpr, CLUSTER: gl.constexpr):
    """Where this program merges output tile ``t`` (rank ``t % CLUSTER``): its own normalized tile ``own`` (None:
    from its slot) and the other splits' (read from their slots), each times its split's weight
    ``w_k = 2^(lse_k - lse)``, stored as the final bf16 columns. Any orientation: ``slot_at`` (a slot's tile 0,
    offsets from the slot's start), ``out_at`` (the output's tile 0), the weights and the rows' mask ``ok`` come
    broadcast to the tile's shape and layout."""
    if t % CLUSTER == rank:
        policy: gl.constexpr = "evict_first" if KEEP_PARTIALS else ""
        if own is None:  # this split's tile is in its slot too
            acc = gl.zeros_like(out_at, dtype=gl.float32)
        else:
            acc = own * _pick(t % CLUSTER, w0, w1, w2, w3)
        for k in gl.static_range(CLUSTER):
            if own is None or k != t % CLUSTER:
                o_k = gl.load(part_out + (first_slot + k) * (ROWS * NOPE) + slot_at + t * TILE,
                              eviction_policy=policy)
                acc += _pick(k, w0, w1, w2, w3) * o_k
        gl.store(out_at + t * TILE, acc.to(gl.bfloat16), mask=ok)


@gluon.jit
def _pick(k: gl.constexpr, w0, w1, w2, w3):
    """The ``k``-th of four values, chosen when compiling."""
    if k == 0:
        return w0
    elif k == 1:
        return w1
    elif k == 2:
        return w2
    else:
        return w3
