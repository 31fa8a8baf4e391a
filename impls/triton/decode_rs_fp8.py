"""The 16-row ``fp8_ds_mla`` and ``fp8_e4m3`` decode split step in Gluon, warp-specialized, the codes decoded into
wgmma's register operand: no decoded copy of a tile in shared memory.

``decode_ws`` decodes each 64-key step into float16 tiles in shared memory and multiplies from there; with 16 query
rows on wgmma's N side every m64n16k16 product reads its 2 KB key operand from shared memory, and a step moves ~337
KB through it, which bounds the kernel (NOTES.md, session 32). Here wgmma takes the keys from registers (its "RS"
form), decoded there from the e4m3 codes the TMA copied in; a step moves ~150 KB: the copy (41 KB), each product's
read of the codes (32 KB each), the rope (8 KB), the query (18 KB), P (16 KB) and half the scores (8 KB).

- the loader warpgroup copies each 64-key step by TMA (four ``[64, 128]`` code boxes, the rope and the four tile
  scales of each key) into one of ``STAGES`` stages; pages hold whole steps (``PAGE_SIZE`` a multiple of 64). Two
  stages, not four: with fewer bytes in flight the kernel ran faster at every size measured (below);
- two scoring warpgroups take ``S^T = K Q^T`` (keys on wgmma's M side), the first (the default partition) of the
  rope and latent tiles 0 and 1, the second of tiles 2 and 3, which it hands to the first through shared memory
  (``_score_half``): each thread loads 16 contiguous code bytes of a key, converts them to float16 and hands them
  to wgmma as its operand fragment of a permuted contraction order (``sparse_wgmma._operand_order``; each
  warpgroup stores its tiles of the query in that order), one product per tile scale. The first then runs
  ``decode_wgmma_fp8``'s softmax and stores P per tile scale into shared memory;
- the value warpgroup takes ``O^T += V^T P^T``: a tile's codes loaded transposed as 16-bit pairs of columns
  (``ldmatrix.trans``), each pair split by a byte permute into the two columns' float16 operands, so the even and
  odd output columns are two products of their own (``_value_operands``), made as soon as the step is in, before
  its P;
- each multiplying warpgroup loads its part of a step into registers and frees the stage before it converts or
  multiplies any of it.

Measured (NOTES.md, session 35; 16 heads, page 64, us, decode_ws -> this kernel): H200 b1 ctx8192 13.7 -> 13.3,
b32 ctx4096 44.4 -> 40.1, b64 77.4 -> 65.8, b128 142.4 -> 114.9, b64 ctx16384 274.3 -> 228.7; H100 b1 14.1 -> 13.4,
b32 46.3 -> 46.5, b64 79.0 -> 77.9, b128 144.4 -> 139.1, b64 ctx16384 277.5 -> 268.4, with one scoring warpgroup.
That one was the slower partition (alone at b64 on the H100, 75.4 against the copies alone 67.1): its step was
one chain of loads, conversions, products, a softmax with an exchange between warps and P's stores, in one warp
per scheduler. Halving its loads and conversions (session 36, H100, one scoring warpgroup -> two): b64 76.8 ->
76.1, b128 140.3 -> 135.7, b64 ctx16384 270.9 -> 258.8, b32 45.4 -> 45.7. Each warpgroup alone (session 37, H100
b64): the first scoring one 75.7, as long as the kernel, the second 70.7, the values 70.7, the copies 67.5. The
scores on e4m3 tensor cores (branch ``rs-e4m3-scores``) took the H100's b64 to 70-73, but their sums raised the lse
error from 2.3e-6 to 2.3e-3, which the gate flags (NOTES.md, session 35). Until session 39 ptxas serialized every
wgmma of the kernel (C7512: the second scoring warpgroup's 96 registers could not keep its products' operands in
flight), with four stages. Products in flight with four stages ran faster only where memory was idle; with two,
everywhere (H100, session 38's kernel -> this one, one call): b1 ctx8192 14.2 -> 13.1, b8 22.3 -> 19.3, b16 30.6 ->
26.8, b32 45.8 -> 42.8, b64 76.0 -> 74.4, b128 135.9 -> 133.7, b64 ctx16384 262.8 -> 256.5, page 128 b64 76.3 ->
73.8, b1 ctx65536 32.9 -> 29.2 (NOTES.md, session 39).

Rows of the last step past the item's end are whatever the page holds (NaN in a poisoned cache): the scores mask
them, their scales are zeroed before use and their values are zeroed in registers.

fp8_e4m3 (``E4M3``) runs the same step: its rope is e4m3 beside the codes (converted to bfloat16, exactly, for the
rope product), it has no tile scales (every factor 1, so one P serves the four value tiles) and its layer scale is
in the plan's ``qk_scale`` and ``out_scale``. Against decode_ws (H100, 16 heads, page 64, us; NOTES.md, session 40):
b1 ctx8192 13.3 -> 12.7, b8 20.5 -> 18.3, b32 42.3 -> 38.0, b64 72.7 -> 64.7, b128 131.0 -> 116.3, b64 ctx16384
251.5 -> 219.6.

Same work items, partials and merge as ``decode_kernel._decode_split_kernel``, with the cache as TMA descriptors
(``decode._tma_descriptors``): codes ``[slots, 656]`` e4m3 in ``[64, 128]`` boxes, rope ``[slots, 328]`` bf16 in
``[64, 64]`` boxes, scales ``[slots, 164]`` float32 in ``[64, 4]`` boxes; fp8_e4m3's codes and rope both from
``[slots, 576]`` e4m3, in ``[64, 128]`` and ``[64, 64]`` boxes, and no scales. Launch with ``LAUNCH_OPTIONS``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from impls.triton.decode_kernel import NOPE, ROPE, TILE
from impls.triton.decode_wgmma import (SWIZZLED, _cta_barrier, _launch_dependents, _program_items, _row_at, _row_limits,
                                       _step_page)
from impls.triton.decode_wgmma_fp8 import HAS_REINTERPRET, KEYS, _softmax_to_probs
from impls.triton.decode_wgmma_narrow import COPY_LAYOUT, _store_lse, _transposed_state
from impls.triton.decode_wgmma_ws import FLAT, _item_tiles, _receive, _send, _tma_load
from impls.triton.sparse_wgmma import ROPE_AT, SCALES_AT, _operand_order, _stage_query

ROWS = gl.constexpr(16)
STAGES = gl.constexpr(2)  # 41 KB each
STEP_BYTES = gl.constexpr(KEYS * (NOPE + 2 * ROPE + 16))  # codes, bf16 rope, four float32 scales
STEP_BYTES_E4M3 = gl.constexpr(KEYS * (NOPE + ROPE))  # fp8_e4m3: codes and rope, all e4m3
CODES_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
ROPE_E4M3_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
PAIRS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
SCALES_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
HALVES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
PROBS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=2 * ROWS, element_bitwidth=16, rank=2))
# S^T [64 keys, 16 rows] and each O^T half-tile [64 column pairs, 16 rows].
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
ACC_KEYS = gl.constexpr(gl.SliceLayout(1, ACC))
ACC_ROWS = gl.constexpr(gl.SliceLayout(0, ACC))
OPERAND = gl.constexpr(gl.DotOperandLayout(0, ACC, 2))
# A code tile [64 keys, 128 columns], 16 contiguous bytes a thread: relabelled by _operand_order, OPERAND's.
CODES_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 64], [8, 0]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[64, 128]))
# The rope [64 keys, 64 columns] bf16, 8 contiguous a thread, likewise.
ROPE_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [8, 0]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[64, 64]))
# A step's scales [64 keys, 4 tiles]: along ACC's keys with the tiles in registers, and whole in every warp (their
# maximum needs no exchange between warps).
SCALES_KEYS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4]))
SCALES_EVERY = gl.constexpr(gl.BlockedLayout(size_per_thread=[2, 4], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                             order=[1, 0]))
OUT_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[4, 1],
                                           order=[1, 0]))
# A 32-bit register of two 16-bit pairs (keys a, b; columns 2p, 2p + 1) -> column 2p's float16 pair (a, b) and
# column 2p + 1's.
SPLIT_PAIRS = gl.constexpr("""{
    .reg .b32 t;
    .reg .b16 even, odd;
    prmt.b32 t, $2, 0, 0x3120;
    mov.b32 {even, odd}, t;
    cvt.rn.f16x2.e4m3x2 $0, even;
    cvt.rn.f16x2.e4m3x2 $1, odd;
}""")
# The barriers (one allocation, by index):
KREADY = gl.constexpr(0)                  # + stage: the step is in (TMA)
KFREE = gl.constexpr(KREADY + STAGES)     # + stage: the three multiplying warpgroups have it in registers
PREADY = gl.constexpr(KFREE + STAGES)     # + buffer (2): P and its rescale factor are in
PFREE = gl.constexpr(PREADY + 2)          # + buffer: the value warpgroup is done with them
LREADY = gl.constexpr(PFREE + 2)          # the item's output factor is in (for the value warpgroup)
LFREE = gl.constexpr(LREADY + 1)          # the value warpgroup has read it
HREADY = gl.constexpr(LFREE + 1)          # + buffer (2): the second scoring warpgroup's half of the scores is in
HFREE = gl.constexpr(HREADY + 2)          # + buffer: the first has read it
BARRIERS = gl.constexpr(HFREE + 2)
# 16 warps: 152 registers for the first scoring warpgroup, 224 for the values, 112 for the second, 24 for the loader.
# With 96 the second cannot keep its products' operands in flight and ptxas serializes every wgmma of the kernel
# (C7512; ``impls.triton.compile_check`` fails on it); the values then need 224 (216: serialized again), and the
# first waits for its rope product before issuing its tiles' so that its step loop does not spill at 152.
LAUNCH_OPTIONS = {"num_warps": 4, "maxnreg": 128}


@gluon.jit
def _decode_split_kernel_rs_fp8(
    q, stride_qt, stride_qh, codes_desc, rope_desc, scales_desc, block_table, stride_bt, visible, work,
    items_stride, item_counts, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
    out_scale, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr,
    E4M3: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of 16 query rows.
    ``EARLY_MERGE``: let the merge kernel, a programmatic dependent launch, start now. ``E4M3``: the cache is
    fp8_e4m3 (rope in e4m3 too, no tile scales: one P for every tile; no ``scales_desc``), whose layer scale is in
    ``qk_scale`` and, for outputs stored here rather than merged, ``out_scale``."""
    if EARLY_MERGE:
        _launch_dependents()
    q_nope = gl.allocate_shared_memory(gl.float16, [4, ROWS, TILE], SWIZZLED)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [1, ROWS, ROPE], SWIZZLED)  # indexed by a run-time 0 (_score)
    codes = gl.allocate_shared_memory(gl.float8e4nv, [4 * STAGES, KEYS, TILE], CODES_SMEM)  # stage b, tile t: 4b + t
    scales = gl.allocate_shared_memory(gl.float32, [STAGES, KEYS, 4], SCALES_SMEM)
    if E4M3:
        rope = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, KEYS, ROPE], ROPE_E4M3_SMEM)
        p_all = gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM)
        probs = (p_all, p_all, p_all, p_all)  # no tile scales: one P serves the four tiles
    else:
        rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, KEYS, ROPE], SWIZZLED)
        # One allocation per tile scale (stores to one allocation at run-time indices get a barrier after each).
        probs = (gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM),
                 gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM),
                 gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM),
                 gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM))
    factors = gl.allocate_shared_memory(gl.float32, [2, ROWS], FLAT)  # each P buffer's rescale of the outputs
    to_out = gl.allocate_shared_memory(gl.float32, [ROWS], FLAT)  # an item's output factor, for the value warpgroup
    halves = gl.allocate_shared_memory(gl.float32, [2, KEYS, ROWS], HALVES_SMEM)  # tiles 2 and 3's scores
    bars = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(BARRIERS):
        mbarrier.init(bars.index(b), count=3 if (b >= KFREE and b < KFREE + STAGES) else 1)
    hopper.fence_async_shared()
    gl.warp_specialize([
        (_score, (q, stride_qt, stride_qh, visible, work, items_stride, item_counts, lse, stride_lt, part_lse,
                  qk_scale, num_heads, q_nope, q_rope, codes, rope, scales, probs, factors, to_out, halves, bars,
                  KEEP_PARTIALS, E4M3)),
        (_value, (work, items_stride, item_counts, out, stride_ot, stride_oh, part_out, out_scale, num_heads, codes,
                  probs, factors, to_out, bars, KEEP_PARTIALS, E4M3)),
        (_score_half, (q, stride_qt, stride_qh, work, items_stride, item_counts, num_heads, q_nope, codes, scales,
                       halves, bars, E4M3)),
        (_load, (codes_desc, rope_desc, scales_desc, block_table, stride_bt, work, items_stride, item_counts, codes,
                 rope, scales, bars, PAGE_SIZE, E4M3)),
    ], [4, 4, 4], [224, 112, 24])


@gluon.jit
def _load(codes_desc, rope_desc, scales_desc, block_table, stride_bt, work, items_stride, item_counts, codes, rope,
          scales, bars, PAGE_SIZE: gl.constexpr, E4M3: gl.constexpr):
    """The loader: the program's step g into stage g % STAGES once the three multiplying warpgroups have freed it."""
    table, items = _program_items(work, items_stride, item_counts)
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        pages = block_table + request.to(gl.int64) * stride_bt
        for j in range(tiles):
            b = g % STAGES
            mbarrier.wait(bars.index(KFREE + b), ((g // STAGES) & 1) ^ 1)  # a new barrier passes phase 1 at once
            bar = bars.index(KREADY + b)
            start = kv_start + j * KEYS
            row = (_step_page(pages, start, kv_end, PAGE_SIZE) * PAGE_SIZE + start % PAGE_SIZE).to(gl.int32)
            mbarrier.expect(bar, STEP_BYTES_E4M3 if E4M3 else STEP_BYTES)
            for t in gl.static_range(4):
                _tma_load(codes_desc, [row, TILE * t], bar, codes.index(4 * b + t))
            if E4M3:
                _tma_load(rope_desc, [row, NOPE], bar, rope.index(b))
            else:
                _tma_load(rope_desc, [row, ROPE_AT // 2], bar, rope.index(b))
                _tma_load(scales_desc, [row, SCALES_AT // 4], bar, scales.index(b))
            g += 1


@gluon.jit
def _score(q, stride_qt, stride_qh, visible, work, items_stride, item_counts, lse, stride_lt, part_lse, qk_scale,
           num_heads, q_nope, q_rope, codes, rope, scales, probs, factors, to_out, halves, bars,
           KEEP_PARTIALS: gl.constexpr, E4M3: gl.constexpr):
    """The first scoring warpgroup: each item's query (rope and tiles 0, 1), each step's scores of those, plus the
    second warpgroup's half, the softmax and P per tile scale for the value warpgroup; at the item's end its lse,
    and the output factor for the value warpgroup."""
    table, items = _program_items(work, items_stride, item_counts)
    nq = 0
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        q_down = _stage_item_query(q, stride_qt, stride_qh, row_block, q_first, q_len, num_heads, q_nope,
                                   q_rope.index(0), 0, 2)
        rows_s, ok_s, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS, ACC_ROWS)
        key_ids = gl.arange(0, KEYS, layout=ACC_KEYS)
        m_i, l_part, zero, _, _, _, _ = _transposed_state(ROWS, ACC)
        unit = gl.to_tensor(2.0 ** -126)  # u, the value accumulators' unit (decode_wgmma_fp8)
        for j in range(tiles):
            b = g % STAGES
            pb = g % 2
            start = kv_start + j * KEYS
            mbarrier.wait(bars.index(KREADY + b), (g // STAGES) & 1)
            # The stage's part in registers and freed before anything is made of it (H100 16 heads b64 76.1 -> 75.3
            # us with _score_half and _value alike; NOTES.md, session 37).
            rope_raw = rope.index(b).load(ROPE_LOAD)
            c0 = codes.index(4 * b).load(CODES_LOAD)
            c1 = codes.index(4 * b + 1).load(CODES_LOAD)
            scales_every, scales_keys = _load_scales(scales.index(b), E4M3)
            _cta_barrier()  # every warp has the stage in registers
            mbarrier.arrive(bars.index(KFREE + b), count=1)
            if E4M3:  # e4m3 -> bfloat16 is exact
                rope_raw = rope_raw.to(gl.float32).to(gl.bfloat16)
            r = gl.convert_layout(_operand_order(rope_raw, 8), OPERAND)  # see _issue_tile_scores
            s_rope = hopper.warpgroup_mma(r, q_rope.index(start >> 30).permute((1, 0)), zero, use_acc=False,
                                          is_async=True)
            s_rope, r = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s_rope, r])  # LAUNCH_OPTIONS' comment
            p0, k0 = _issue_tile_scores(c0, 0, start, q_nope, zero)
            p1, k1 = _issue_tile_scores(c1, 1, start, q_nope, zero)
            x0, x1, x2, x3, step_max = _step_scales(scales_every, scales_keys, start, kv_end, E4M3)  # while they run
            p0, p1, k0, k1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[p0, p1, k0, k1])
            nope = p0 * x0[:, None] + p1 * x1[:, None]
            nope += _receive(halves.index(pb), ACC, bars.index(HREADY + pb), bars.index(HFREE + pb), (g // 2) & 1)
            s = (s_rope + nope * q_down[None, :]) * qk_scale
            s = gl.where((start + key_ids)[:, None] < limit[None, :], s, float("-inf"))
            mbarrier.wait(bars.index(PFREE + pb), ((g // 2) & 1) ^ 1)
            m_i, l_part, unit, _alpha = _softmax_to_probs(
                s, E4M3, (probs[0].index(pb), probs[1].index(pb), probs[2].index(pb), probs[3].index(pb)), x0, x1,
                x2, x3, step_max, m_i, l_part, unit, factors.index(pb))
            mbarrier.arrive(bars.index(PREADY + pb), count=1)
            g += 1
        l_i = gl.sum(l_part, 0)
        seen = l_i > 0.0
        if tiles > 0:
            _send(to_out, gl.where(seen, unit / gl.where(seen, l_i, 1.0), 0.0), bars.index(LREADY), bars.index(LFREE),
                  nq & 1)
            nq += 1
        _store_lse(gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf")), rows_s, ok_s, lse,
                   stride_lt, part_lse, row_block, slot_out, q_first, num_heads, ROWS, KEEP_PARTIALS)


@gluon.jit
def _score_half(q, stride_qt, stride_qh, work, items_stride, item_counts, num_heads, q_nope, codes, scales, halves,
                bars, E4M3: gl.constexpr):
    """The second scoring warpgroup: each item's query tiles 2 and 3, each step's scores of those (each by its tile
    scale) for the first."""
    table, items = _program_items(work, items_stride, item_counts)
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        _stage_item_query(q, stride_qt, stride_qh, row_block, q_first, q_len, num_heads, q_nope, None, 2, 4)
        zero = gl.zeros([KEYS, ROWS], gl.float32, ACC)
        for j in range(tiles):
            b = g % STAGES
            pb = g % 2
            start = kv_start + j * KEYS
            mbarrier.wait(bars.index(KREADY + b), (g // STAGES) & 1)
            c2 = codes.index(4 * b + 2).load(CODES_LOAD)
            c3 = codes.index(4 * b + 3).load(CODES_LOAD)
            scales_every, scales_keys = _load_scales(scales.index(b), E4M3)
            _cta_barrier()  # every warp has the stage in registers
            mbarrier.arrive(bars.index(KFREE + b), count=1)
            p2, k2 = _issue_tile_scores(c2, 2, start, q_nope, zero)
            p3, k3 = _issue_tile_scores(c3, 3, start, q_nope, zero)
            _, _, x2, x3, _ = _step_scales(scales_every, scales_keys, start, kv_end, E4M3)  # while the products run
            p2, p3, k2, k3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[p2, p3, k2, k3])
            half = p2 * x2[:, None] + p3 * x3[:, None]
            _send(halves.index(pb), half, bars.index(HREADY + pb), bars.index(HFREE + pb), (g // 2) & 1)
            g += 1


@gluon.jit
def _issue_tile_scores(tile_codes, t: gl.constexpr, start, q_nope, acc):
    """Code tile ``t``'s loaded codes (``CODES_LOAD``) as its product's register operand and that ``S^T`` product,
    issued; returns both (the wait must keep the operand: ptxas serializes the products where it may reuse an
    operand's registers). The query's index carries a run-time 0 (``start >> 30``), so that its operand descriptor is
    made in the loop, not held in registers."""
    k = _code_operand(tile_codes)
    p = hopper.warpgroup_mma(k, q_nope.index(t + (start >> 30)).permute((1, 0)), acc, use_acc=False, is_async=True)
    return p, k


@gluon.jit
def _stage_item_query(q, stride_qt, stride_qh, row_block, q_first, q_len, num_heads, q_nope, q_rope,
                      FIRST: gl.constexpr, LAST: gl.constexpr):
    """A scoring warpgroup's part of an item's query into shared memory, in its products' operand order: latent
    tiles ``[FIRST, LAST)``, and the rope where ``q_rope`` is given, once this warpgroup's products of the previous
    item are done with them; returns the factor that undoes the query's scaling, per row along ACC's rows."""
    rows_q = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, COPY_LAYOUT))
    _cta_barrier()  # the previous item's products are done with the query
    q_base = _row_at(q, rows_q, q_first, num_heads, stride_qt, stride_qh)
    q_down = _stage_query(q_base, rows_q < q_len * num_heads,
                          (q_nope.index(0), q_nope.index(1), q_nope.index(2), q_nope.index(3)), q_rope, COPY_LAYOUT,
                          OPERAND_ORDER=True, FIRST=FIRST, LAST=LAST)
    hopper.fence_async_shared()
    _cta_barrier()
    return gl.convert_layout(q_down, ACC_ROWS)


@gluon.jit
def _code_operand(tile_codes):
    """A ``[64 keys, 128]`` code tile, loaded in ``CODES_LOAD``, as the score product's float16 register operand
    (columns in operand order)."""
    return gl.convert_layout(_operand_order(tile_codes.to(gl.float16), 16), OPERAND)


@gluon.jit
def _load_scales(tile, E4M3: gl.constexpr):
    """A step's ``[64 keys, 4]`` tile scales from its stage, in the two layouts ``_step_scales`` takes (``E4M3``:
    none, ones)."""
    if E4M3:
        return gl.full([KEYS, 4], 1.0, gl.float32, SCALES_EVERY), gl.full([KEYS, 4], 1.0, gl.float32, SCALES_KEYS)
    return tile.load(SCALES_EVERY), tile.load(SCALES_KEYS)


@gluon.jit
def _step_scales(every, x, start, kv_end, E4M3: gl.constexpr):
    """A step's four per-key tile scales (``_load_scales``) along ACC's keys and their maximum, zero for keys at or
    past ``kv_end`` (their slots may hold anything); ``E4M3``: ones (masked keys get -inf scores)."""
    if E4M3:
        one = gl.full([KEYS], 1.0, gl.float32, ACC_KEYS)
        return one, one, one, one, gl.to_tensor(1.0)
    seen = (start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, SCALES_EVERY)))[:, None] < kv_end
    largest = gl.max(gl.max(gl.where(seen, every, 0.0), 1), 0)
    x = gl.where((start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, SCALES_KEYS)))[:, None] < kv_end, x, 0.0)
    x02, x13 = gl.split(x.reshape([KEYS, 2, 2]))
    x0, x2 = gl.split(x02)
    x1, x3 = gl.split(x13)
    return (gl.convert_layout(x0, ACC_KEYS), gl.convert_layout(x1, ACC_KEYS), gl.convert_layout(x2, ACC_KEYS),
            gl.convert_layout(x3, ACC_KEYS), largest)


@gluon.jit
def _value(work, items_stride, item_counts, out, stride_ot, stride_oh, part_out, out_scale, num_heads, codes, probs,
           factors, to_out, bars, KEEP_PARTIALS: gl.constexpr, E4M3: gl.constexpr):
    """The value warpgroup: every step's ``O^T += V^T P^T``, the even and odd output columns of each tile apart
    (``E4M3``: outputs stored here, not merged, times the layer's ``out_scale``)."""
    table, items = _program_items(work, items_stride, item_counts)
    nq = 0
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        e0 = gl.zeros([KEYS, ROWS], gl.float32, ACC)
        o0 = e0
        e1 = e0
        o1 = e0
        e2 = e0
        o2 = e0
        e3 = e0
        o3 = e0
        factor = gl.zeros([ROWS], gl.float32, ACC_ROWS)
        for j in range(tiles):
            b = g % STAGES
            pb = g % 2
            start = kv_start + j * KEYS
            # The step's operands before its P: their conversions run under the scorer's softmax and the stage is
            # freed a softmax sooner (H100 16 heads b32 46.6 -> 45.4 us, b64 79.1 -> 78.0; NOTES.md, session 36).
            mbarrier.wait(bars.index(KREADY + b), (g // STAGES) & 1)
            # All four tiles' operands first: issued tile by tile, ptxas reused one tile's operand registers for the
            # next and waited for each tile's products before loading the next.
            w0 = _value_pairs(codes.index(4 * b), start, kv_end)
            w1 = _value_pairs(codes.index(4 * b + 1), start, kv_end)
            w2 = _value_pairs(codes.index(4 * b + 2), start, kv_end)
            w3 = _value_pairs(codes.index(4 * b + 3), start, kv_end)
            _cta_barrier()  # every warp has the stage in registers
            mbarrier.arrive(bars.index(KFREE + b), count=1)
            ve0, vo0 = _value_operands(w0)
            ve1, vo1 = _value_operands(w1)
            ve2, vo2 = _value_operands(w2)
            ve3, vo3 = _value_operands(w3)
            mbarrier.wait(bars.index(PREADY + pb), (g // 2) & 1)
            alpha = factors.index(pb).load(ACC_ROWS)[None, :]
            # Every accumulator rescaled before the first product is issued: a multiply between two issues makes
            # ptxas wait for the products in flight. Skipping the rescale in steps where every row's factor is 1
            # (session 37's lazy rescale) was 0.4-1.7% slower at every size once the products were in flight
            # (NOTES.md, session 39).
            e0, o0, e1, o1, e2, o2, e3, o3 = (e0 * alpha, o0 * alpha, e1 * alpha, o1 * alpha, e2 * alpha, o2 * alpha,
                                              e3 * alpha, o3 * alpha)
            e0 = hopper.warpgroup_mma(ve0, probs[0].index(pb), e0, is_async=True)
            o0 = hopper.warpgroup_mma(vo0, probs[0].index(pb), o0, is_async=True)
            e1 = hopper.warpgroup_mma(ve1, probs[1].index(pb), e1, is_async=True)
            o1 = hopper.warpgroup_mma(vo1, probs[1].index(pb), o1, is_async=True)
            e2 = hopper.warpgroup_mma(ve2, probs[2].index(pb), e2, is_async=True)
            o2 = hopper.warpgroup_mma(vo2, probs[2].index(pb), o2, is_async=True)
            e3 = hopper.warpgroup_mma(ve3, probs[3].index(pb), e3, is_async=True)
            o3 = hopper.warpgroup_mma(vo3, probs[3].index(pb), o3, is_async=True)
            e0, o0, e1, o1, e2, o2, e3, o3, ve0, vo0, ve1, vo1, ve2, vo2, ve3, vo3 = hopper.warpgroup_mma_wait(
                num_outstanding=0, deps=[e0, o0, e1, o1, e2, o2, e3, o3, ve0, vo0, ve1, vo1, ve2, vo2, ve3, vo3])
            _cta_barrier()
            mbarrier.arrive(bars.index(PFREE + pb), count=1)
            g += 1
        if tiles > 0:
            factor = _receive(to_out, ACC_ROWS, bars.index(LREADY), bars.index(LFREE), nq & 1)
            nq += 1
            if E4M3 and slot_out < 0:
                factor = factor * out_scale
        _store_tile(0, e0, o0, factor, out, stride_ot, stride_oh, part_out, row_block, slot_out, q_first, q_len,
                    num_heads, KEEP_PARTIALS)
        _store_tile(1, e1, o1, factor, out, stride_ot, stride_oh, part_out, row_block, slot_out, q_first, q_len,
                    num_heads, KEEP_PARTIALS)
        _store_tile(2, e2, o2, factor, out, stride_ot, stride_oh, part_out, row_block, slot_out, q_first, q_len,
                    num_heads, KEEP_PARTIALS)
        _store_tile(3, e3, o3, factor, out, stride_ot, stride_oh, part_out, row_block, slot_out, q_first, q_len,
                    num_heads, KEEP_PARTIALS)


@gluon.jit
def _value_pairs(tile, start, kv_end):
    """A ``[64 keys, 128]`` code tile loaded transposed as 16-bit pairs of columns, ``[64 column pairs, 64 keys]`` in
    the value products' operand layout; keys at or past ``kv_end`` zeroed (0 x NaN is NaN)."""
    if HAS_REINTERPRET:
        pairs = tile.reinterpret(gl.int16, [KEYS, TILE // 2], PAIRS_SMEM)
    else:
        pairs = tile._reinterpret(gl.int16, [KEYS, TILE // 2], PAIRS_SMEM)
    w = pairs.permute((1, 0)).load(OPERAND)
    if start + KEYS > kv_end:
        keys = start + gl.arange(0, KEYS, layout=gl.SliceLayout(0, OPERAND))
        w = gl.where(keys[None, :] < kv_end, w, gl.zeros_like(w))
    return w


@gluon.jit
def _value_operands(w):
    """Loaded pairs (``_value_pairs``) as the value products' float16 register operands: ``V^T`` of the tile's even
    columns and of its odd ones."""
    return gl.inline_asm_elementwise(SPLIT_PAIRS, "=r,=r,r", [w], dtype=(gl.float16, gl.float16), is_pure=True,
                                     pack=2)


@gluon.jit
def _store_tile(t: gl.constexpr, even, odd, factor, out, stride_ot, stride_oh, part_out, row_block, slot_out, q_first,
                q_len, num_heads, KEEP_PARTIALS: gl.constexpr):
    """Output columns ``[128 t, 128 t + 128)`` from their even and odd halves times ``factor`` (per row): final bf16
    rows where the item covers its rows' whole range (``slot_out < 0``), else a float32 partial for the merge."""
    o = gl.join(even * factor[None, :], odd * factor[None, :]).permute((1, 0, 2)).reshape([ROWS, TILE])
    o = gl.convert_layout(o, OUT_LAYOUT)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT_LAYOUT))
    cols = TILE * t + gl.arange(0, TILE, layout=gl.SliceLayout(0, OUT_LAYOUT))[None, :]
    if slot_out < 0:
        rows = row_block * ROWS + rows
        out_at = _row_at(out, rows, q_first, num_heads, stride_ot, stride_oh)[:, None] + cols
        gl.store(out_at, o.to(gl.bfloat16), mask=(rows < q_len * num_heads)[:, None])
    else:
        policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        gl.store(part_out + (slot_out.to(gl.int64) * ROWS + rows)[:, None] * NOPE + cols, o, eviction_policy=policy)
