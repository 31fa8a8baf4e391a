"""The 16-row ``fp8_ds_mla``, ``fp8_e4m3``, ``nvfp4`` and ``mxfp4_nsa`` decode split step in Gluon, warp-specialized,
the codes decoded into wgmma's register operand: no decoded copy of a tile in shared memory.

``decode_ws`` decodes each 64-key step into float16 tiles in shared memory and multiplies from there; with 16 query
rows on wgmma's N side every m64n16k16 product reads its 2 KB key operand from shared memory, and a step moves ~337
KB through it, which bounds the kernel (NOTES.md, session 32). Here wgmma takes the keys from registers (its "RS"
form), decoded there from the e4m3 codes the TMA copied in; a step moves ~150 KB: the copy (41 KB), each product's
read of the codes (32 KB each), the rope (8 KB), the query (18 KB), P (16 KB) and half the scores (8 KB).

- the loader warpgroup copies each 64-key step by TMA (four ``[64, 128]`` code boxes, the rope and the four tile
  scales of each key) into one of ``stages(LAYOUT)`` stages; pages hold whole steps (``PAGE_SIZE`` a multiple of
  64). Two fp8 stages, not four: with fewer bytes in flight the kernel ran faster at every size measured (below);
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

nvfp4 (session 41) runs the same partitions on its 416-byte rows: two ``[64, 128]`` boxes of packed e2m1 codes (a
"chunk" of 256 columns each), each chunk's ``[64, 16]`` e4m3 block scales, the bf16 rope. Each scoring warpgroup
scores one chunk (both of its tiles): a thread loads its words of the chunk and the block scales of its 16-column
groups, decodes each word to eight float16 values times their block scale (``decode_ws``'s PTX, exact) in the
layout the e4m3 tiles load in, so the score operands are the fp8 kernel's but for the order within each word (low
nibbles, then high: no byte permute), in which the query is staged too. The value warpgroup loads each chunk
transposed as 16-bit quads of columns (``ldmatrix.trans`` as for fp8's pairs), and each 32-bit register (two keys'
quads) becomes the float16 pairs of the quad's four columns, times the two keys' block scales: each key's scales of a
thread lie in one 32-bit word of the scale tile (one load a key, the bytes picked by a permute), so the eight
accumulators hold the columns by their place in a quad. No tile scales (one P), the layer scale of the latent keys
in the query rows' factor (``nope_scale``) and in ``out_scale``, three stages (``stages``). The decoding bounds it:
without the value warpgroup's, b64 ran 14% faster, without the scorers' 11%, without both 21%; one byte permute and
one multiply fewer per register took 7%. Against decode_ws (H100, 16 heads, page 64, us; NOTES.md, session 41):
b8 21.6 -> 18.7, b32 44.3 -> 37.4, b64 75.3 -> 63.4, b128 134.4 -> 116.0, b64 ctx16384 252.7 -> 221.0.

mxfp4_nsa (session 52) runs nvfp4's step on its 400-byte rows (the same two chunks of codes, bf16 rope), with its 16
ue8m0 block exponents a key copied in one ``[64, 16]`` box. A float16 factor cannot hold ``2^(e - 127)``, so the
loader, once a step is in (one step behind its copies), makes of them each key's scale ``2^(kmax - 127)`` (``kmax``
its largest exponent) and each block's float16 factor ``2^(e - kmax)`` times 64 (``_make_factors``; exact for blocks
down to 2^-23 below the key's largest, as ``decode_ws``'s tiles), which both scoring warpgroups and the value
warpgroup read where nvfp4 reads its e4m3 block scales; the first scorer multiplies each key's score by its scale
and folds the scales into P as fp8_ds_mla's tile scales (one P). Against decode_ws (H100, 16 heads, page 64, us;
NOTES.md, session 52): b8 20.9 -> 17.6, b32 46.3 -> 36.9, b64 79.7 -> 64.2, b128 144.8 -> 118.2, b64 ctx16384 274.9
-> 227.9.

Same work items, partials and merge as ``decode_kernel._decode_split_kernel``, with the cache as TMA descriptors
(``decode._tma_descriptors``): codes ``[slots, 656]`` e4m3 in ``[64, 128]`` boxes, rope ``[slots, 328]`` bf16 in
``[64, 64]`` boxes, scales ``[slots, 164]`` float32 in ``[64, 4]`` boxes; fp8_e4m3's codes and rope both from
``[slots, 576]`` e4m3, in ``[64, 128]`` and ``[64, 64]`` boxes, and no scales; nvfp4's codes ``[slots, 416]`` e4m3
(as bytes) in ``[64, 128]`` boxes, its block scales from the same view in ``[64, 16]`` boxes, its rope ``[slots,
208]`` bf16 in ``[64, 64]`` boxes. Launch with ``LAUNCH_OPTIONS``; ``LAYOUT`` is fp8_ds_mla (fp8_ds_mla_pow2 runs
as it), fp8_e4m3, nvfp4 or mxfp4_nsa (its codes and exponents from ``[slots, 400]`` e4m3 bytes in ``[64, 128]`` and
``[64, 16]`` boxes, its rope ``[slots, 200]`` bf16 in ``[64, 64]`` boxes).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from impls.triton.decode_kernel import NOPE, ROPE, TILE
from impls.triton.decode_wgmma import (SWIZZLED, _cta_barrier, _launch_dependents, _program_items, _row_at,
                                       _row_limits, _step_page)
from impls.triton.decode_wgmma_fp8 import KEYS, WORDS_SMEM, _seen_as, _softmax_to_probs
from impls.triton.decode_wgmma_narrow import (COPY_LAYOUT, _cluster_arrive, _cluster_barrier, _merge_stored_splits,
                                              _store_lse, _transposed_state)
from impls.triton.decode_wgmma_ws import FLAT, _item_tiles, _receive, _send, _tma_load
from impls.triton.decode_ws import (MXFP4_ROPE_AT, MXFP4_ROW_BYTES, MXFP4_SCALES_AT, NVFP4_ROPE_AT, NVFP4_ROW_BYTES,
                                   NVFP4_SCALES_AT, _factor_bits, _ue8m0_scale, e2m1_word_ptx)
from impls.triton.sparse_wgmma import ROPE_AT, SCALES_AT, _operand_order, _stage_query

ROWS = gl.constexpr(16)
STEP_BYTES = gl.constexpr(KEYS * (NOPE + 2 * ROPE + 16))  # codes, bf16 rope, four float32 scales
STEP_BYTES_E4M3 = gl.constexpr(KEYS * (NOPE + ROPE))  # fp8_e4m3: codes and rope, all e4m3
STEP_BYTES_NVFP4 = gl.constexpr(KEYS * NVFP4_ROW_BYTES)  # packed e2m1 codes, e4m3 block scales, bf16 rope
STEP_BYTES_MXFP4 = gl.constexpr(KEYS * MXFP4_ROW_BYTES)  # packed e2m1 codes, ue8m0 block exponents, bf16 rope
BLOCKS = gl.constexpr(NOPE // 32)  # nvfp4's block scales of one 128-byte chunk of codes (256 columns)
MX_BLOCKS = gl.constexpr(NOPE // 64)  # mxfp4_nsa's blocks (32 columns) of one chunk
CODES_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
ROPE_E4M3_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
PAIRS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
SCALES_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
BLOCKS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
FACTORS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
HALVES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
PLAIN_3D = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
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
# nvfp4's code chunk [64 keys, 32 words] (256 columns, eight to a word), each word taken eight times, once per
# column: reshaped to [64, 256] it is CODES_LOAD's layout for both of the chunk's tiles (the tile the last register
# bit), and so is a chunk's block scales [64 keys, 16 blocks] taken sixteen times (BLOCKS_SIXTEEN).
WORDS_EIGHT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 8, 0], [8, 0, 0], [0, 16, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[[16, 0, 0], [32, 0, 0]],
    block_bases=[], shape=[64, 32, 8]))
BLOCKS_SIXTEEN = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 4, 0], [8, 0, 0], [0, 8, 0]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[[16, 0, 0], [32, 0, 0]],
    block_bases=[], shape=[64, 16, 16]))
# mxfp4_nsa's factors of a chunk's eight 32-column blocks [64 keys, 8, 32 columns] taken 32 times: reshaped to
# [64, 256], BLOCKS_SIXTEEN's layout (the same columns on the same registers and lanes).
BLOCKS_THIRTYTWO = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 2, 0], [8, 0, 0], [0, 4, 0]],
    lane_bases=[[0, 0, 16], [0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[[16, 0, 0], [32, 0, 0]],
    block_bases=[], shape=[64, 8, 32]))
# mxfp4_nsa, the loader: a step's ue8m0 exponents [64 keys, 2 chunks, 8 blocks], a chunk's eight a thread.
EXPONENTS_LOAD = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[16, 2, 1],
                                               warps_per_cta=[4, 1, 1], order=[2, 1, 0]))
# mxfp4_nsa, the first scorer: a step's key scales [64], whole in every warp (their maximum needs no exchange).
KEY_SCALES_EVERY = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[32]], lane_bases=[[1], [2], [4], [8], [16]], warp_bases=[[0], [0]], block_bases=[], shape=[64]))
# A chunk's block scales for the value operand, as 32-bit words of four ([64 keys, 4 words]), each word taken for the
# 16 quads of columns its blocks cover ([64, 4, 4, 4]: key, word, block in the word, quad in the block): permuted
# and reshaped to [64 quads, 64 keys] it is OPERAND's layout.
KEY_WORD_QUADS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0, 0, 0], [0, 0, 2, 0], [8, 0, 0, 0], [16, 0, 0, 0], [32, 0, 0, 0]],
    lane_bases=[[2, 0, 0, 0], [4, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0]],
    warp_bases=[[0, 1, 0, 0], [0, 2, 0, 0]], block_bases=[], shape=[64, 4, 4, 4]))
KEY_WORDS = gl.constexpr(gl.SliceLayout(2, gl.SliceLayout(3, KEY_WORD_QUADS)))
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
# nvfp4, scores: eight columns of one word of packed e2m1 codes ($4; the eight inputs $4-$11 are the same word) times
# their block's float16 scale times 64 ($12) -> four float16 pairs in the word's order (``sparse_wgmma._word_order``:
# columns 0 and 2, 4 and 6, 1 and 3, 5 and 7; $0-$3), with no byte permute.
E2M1_COLUMNS = gl.constexpr(e2m1_word_ptx("$4", ("$0", "$1", "$2", "$3"), "$12", first=None))
# nvfp4, values: a 32-bit register of two 16-bit quads of columns (keys a, b; columns 4p .. 4p + 3), its bytes
# permuted to (a, b) of columns 4p and 4p + 1, then of 4p + 2 and 4p + 3, times the keys' block scales (a float16
# pair, $5) -> the float16 pairs (a, b) of columns 4p, 4p + 1, 4p + 2 and 4p + 3, 64 times too small (the e2m1 ->
# e4m3 bit move divides by 64; the output factor makes it up).
E2M1_QUADS = gl.constexpr("{\n    .reg .b32 w;\n    prmt.b32 w, $4, 0, 0x3120;"
                          + e2m1_word_ptx("w", ("$0", "$2", "$1", "$3"), "$5", first=None) + "\n}")
# nvfp4, values: the block scales of keys a and b, bytes of their words $1 and $2 picked by the selector $3 (a byte
# permute's), as a float16 pair.
BLOCK_SCALE_PAIR = gl.constexpr("""{
    .reg .b32 t;
    .reg .b16 lo, hi;
    prmt.b32 t, $1, $2, $3;
    mov.b32 {lo, hi}, t;
    cvt.rn.f16x2.e4m3x2 $0, lo;
}""")
# mxfp4_nsa, values: the float16 block factors of keys a and b, halves of their words $1 and $2 picked by the
# selector $3, as a float16 pair.
BLOCK_FACTOR_PAIR = gl.constexpr("prmt.b32 $0, $1, $2, $3;")


@triton.constexpr_function
def packed_fp4(layout):
    """Whether ``layout`` packs e2m1 codes in two 128-byte chunks a key (nvfp4, mxfp4_nsa): the same partitions,
    scale handling apart."""
    return layout in ("nvfp4", "mxfp4_nsa")


@triton.constexpr_function
def stages(layout):
    """How many steps of a ``layout`` cache are in flight (shared-memory stages): two of fp8's 41 KB (or 36): with
    fewer bytes in flight that kernel ran faster at every size measured (NOTES.md, session 39); three of nvfp4's 26
    KB (H100 16 heads, against two: b32 40.7 -> 39.3 us, b64 71.2 -> 68.1, b128 130.2 -> 124.4, b64 ctx16384 252.7
    -> 239.0; four: 40.4, 70.7, 127.6, 249.4; four again once its decoding got cheaper: +0.9 to +1.8%; NOTES.md,
    session 41)."""
    return 3 if packed_fp4(layout) else 2


# The barriers (one allocation, by index; room for the most stages of any layout):
MOST_STAGES = gl.constexpr(max(stages(layout) for layout in ("fp8_ds_mla", "fp8_e4m3", "nvfp4", "mxfp4_nsa")))
KREADY = gl.constexpr(0)                    # + stage: the step is in (TMA)
KFREE = gl.constexpr(KREADY + MOST_STAGES)  # + stage: the three multiplying warpgroups have it in registers
PREADY = gl.constexpr(KFREE + MOST_STAGES)  # + buffer (2): P and its rescale factor are in
PFREE = gl.constexpr(PREADY + 2)            # + buffer: the value warpgroup is done with them
LREADY = gl.constexpr(PFREE + 2)            # the item's output factor is in (for the value warpgroup)
LFREE = gl.constexpr(LREADY + 1)            # the value warpgroup has read it
HREADY = gl.constexpr(LFREE + 1)            # + buffer (2): the second scoring warpgroup's half of the scores is in
HFREE = gl.constexpr(HREADY + 2)            # + buffer: the first has read it
FREADY = gl.constexpr(HFREE + 2)            # + stage: mxfp4_nsa's factors of the step are in (the loader)
BARRIERS = gl.constexpr(FREADY + MOST_STAGES)
# 16 warps: 152 registers for the first scoring warpgroup, 224 for the values, 112 for the second, 24 for the loader.
# With 96 the second cannot keep its products' operands in flight and ptxas serializes every wgmma of the kernel
# (C7512; ``impls.triton.compile_check`` fails on it); the values then need 224 (216: serialized again), and the
# first waits for its rope product before issuing its tiles' so that its step loop does not spill at 152.
LAUNCH_OPTIONS = {"num_warps": 4, "maxnreg": 128}


@gluon.jit
def _decode_split_kernel_rs_fp8(
    q, stride_qt, stride_qh, codes_desc, rope_desc, scales_desc, block_table, stride_bt, visible, work,
    items_stride, item_counts, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads,
    nope_scale, out_scale, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr,
    LAYOUT: gl.constexpr, WAIT_PRIOR: gl.constexpr, CLUSTER: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of 16 query rows of a
    ``LAYOUT`` cache (fp8_ds_mla, fp8_e4m3, nvfp4 or mxfp4_nsa). ``EARLY_MERGE``: let the merge kernel, a
    programmatic dependent launch, start now. ``WAIT_PRIOR``: launched as a programmatic dependent of the stream's
    previous kernel, each partition reads only the plan's work rows before that kernel's results are complete and
    visible (``decode_wgmma._program_items``). fp8_e4m3, nvfp4 and mxfp4_nsa have no tile scales (one P for every
    tile; mxfp4_nsa's key scales in it); fp8_e4m3's layer
    scale is in ``qk_scale``, nvfp4's (latent keys only) in ``nope_scale``, and both, for outputs stored here rather
    than merged, in ``out_scale``. ``CLUSTER`` > 1: the grid runs in clusters of that many programs, each one item,
    the splits of one group in rank order: every partition arrives at the cluster barrier once its part of the item
    is stored, and the value warpgroup then merges its share of the group's output from their slots
    (``decode_wgmma_narrow._merge_stored_splits``), so no merge kernel runs."""
    STAGES: gl.constexpr = stages(LAYOUT)
    if EARLY_MERGE:
        _launch_dependents()
    q_nope = gl.allocate_shared_memory(gl.float16, [4, ROWS, TILE], SWIZZLED)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [1, ROWS, ROPE], SWIZZLED)  # indexed by a run-time 0 (_score)
    if packed_fp4(LAYOUT):  # stage b, chunk h of 256 columns: 2b + h; each chunk's block scales likewise
        codes = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, KEYS, TILE], CODES_SMEM)
        if LAYOUT == "nvfp4":
            scales = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, KEYS, BLOCKS], BLOCKS_SMEM)
        else:  # the loader's float16 factors from the copied exponents, and each key's scale (_make_factors)
            scales = gl.allocate_shared_memory(gl.float16, [2 * STAGES, KEYS, MX_BLOCKS], FACTORS_SMEM)
            exponents = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, KEYS, 2 * MX_BLOCKS], BLOCKS_SMEM)
            key_scales = gl.allocate_shared_memory(gl.float32, [STAGES, KEYS], FLAT)
    else:  # stage b, tile t: 4b + t
        codes = gl.allocate_shared_memory(gl.float8e4nv, [4 * STAGES, KEYS, TILE], CODES_SMEM)
        scales = gl.allocate_shared_memory(gl.float32, [STAGES, KEYS, 4], SCALES_SMEM)
    if LAYOUT != "mxfp4_nsa":  # no exponents or key scales: placeholders, never read
        exponents = scales
        key_scales = scales
    if LAYOUT == "fp8_e4m3":
        rope = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, KEYS, ROPE], ROPE_E4M3_SMEM)
    else:
        rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, KEYS, ROPE], SWIZZLED)
    if LAYOUT == "fp8_ds_mla":
        # One allocation per tile scale (stores to one allocation at run-time indices get a barrier after each).
        probs = (gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM),
                 gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM),
                 gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM),
                 gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM))
    else:
        p_all = gl.allocate_shared_memory(gl.float16, [2, KEYS, ROWS], PROBS_SMEM)
        probs = (p_all, p_all, p_all, p_all)  # no tile scales: one P serves the four tiles
    factors = gl.allocate_shared_memory(gl.float32, [2, ROWS], FLAT)  # each P buffer's rescale of the outputs
    to_out = gl.allocate_shared_memory(gl.float32, [ROWS], FLAT)  # an item's output factor, for the value warpgroup
    halves = gl.allocate_shared_memory(gl.float32, [2, KEYS, ROWS], HALVES_SMEM)  # tiles 2 and 3's scores
    bars = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(BARRIERS):
        mbarrier.init(bars.index(b), count=3 if (b >= KFREE and b < KFREE + MOST_STAGES) else 1)
    hopper.fence_async_shared()
    gl.warp_specialize([
        (_score, (q, stride_qt, stride_qh, visible, work, items_stride, item_counts, lse, stride_lt, part_lse,
                  qk_scale, num_heads, nope_scale, q_nope, q_rope, codes, rope, scales, key_scales, probs, factors,
                  to_out, halves, bars, KEEP_PARTIALS, LAYOUT, WAIT_PRIOR, CLUSTER)),
        (_value, (work, items_stride, item_counts, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse,
                  out_scale, num_heads, codes, scales, probs, factors, to_out, bars, KEEP_PARTIALS, LAYOUT, WAIT_PRIOR,
                  CLUSTER)),
        (_score_half, (q, stride_qt, stride_qh, work, items_stride, item_counts, num_heads, q_nope, codes, scales,
                       halves, bars, LAYOUT, WAIT_PRIOR, CLUSTER)),
        (_load, (codes_desc, rope_desc, scales_desc, block_table, stride_bt, work, items_stride, item_counts, codes,
                 rope, scales, exponents, key_scales, bars, PAGE_SIZE, LAYOUT, WAIT_PRIOR, CLUSTER)),
    ], [4, 4, 4], [224, 112, 24])


@gluon.jit
def _load(codes_desc, rope_desc, scales_desc, block_table, stride_bt, work, items_stride, item_counts, codes, rope,
          scales, exponents, key_scales, bars, PAGE_SIZE: gl.constexpr, LAYOUT: gl.constexpr,
          WAIT_PRIOR: gl.constexpr, CLUSTER: gl.constexpr):
    """The loader: the program's step g into stage g % STAGES once the three multiplying warpgroups have freed it;
    mxfp4_nsa: then step g - 1's factors (``_make_factors``), one step behind so that the copies stay in flight."""
    STAGES: gl.constexpr = stages(LAYOUT)
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
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
            if LAYOUT == "nvfp4":
                mbarrier.expect(bar, STEP_BYTES_NVFP4)
                for h in gl.static_range(2):
                    _tma_load(codes_desc, [row, TILE * h], bar, codes.index(2 * b + h))
                    _tma_load(scales_desc, [row, NVFP4_SCALES_AT + BLOCKS * h], bar, scales.index(2 * b + h))
                _tma_load(rope_desc, [row, NVFP4_ROPE_AT // 2], bar, rope.index(b))
            elif LAYOUT == "mxfp4_nsa":
                mbarrier.expect(bar, STEP_BYTES_MXFP4)
                for h in gl.static_range(2):
                    _tma_load(codes_desc, [row, TILE * h], bar, codes.index(2 * b + h))
                _tma_load(scales_desc, [row, MXFP4_SCALES_AT], bar, exponents.index(b))
                _tma_load(rope_desc, [row, MXFP4_ROPE_AT // 2], bar, rope.index(b))
                if g > 0:
                    _make_factors(exponents, scales, key_scales, bars, g - 1, STAGES)
            else:
                mbarrier.expect(bar, STEP_BYTES_E4M3 if LAYOUT == "fp8_e4m3" else STEP_BYTES)
                for t in gl.static_range(4):
                    _tma_load(codes_desc, [row, TILE * t], bar, codes.index(4 * b + t))
                if LAYOUT == "fp8_e4m3":
                    _tma_load(rope_desc, [row, NOPE], bar, rope.index(b))
                else:
                    _tma_load(rope_desc, [row, ROPE_AT // 2], bar, rope.index(b))
                    _tma_load(scales_desc, [row, SCALES_AT // 4], bar, scales.index(b))
            g += 1
    if LAYOUT == "mxfp4_nsa" and g > 0:
        _make_factors(exponents, scales, key_scales, bars, g - 1, STAGES)
    if CLUSTER > 1:
        _cluster_arrive()


@gluon.jit
def _make_factors(exponents, factors, key_scales, bars, k, STAGES: gl.constexpr):
    """mxfp4_nsa, the loader, once step ``k`` is in: each key's scale ``2^(kmax - 127)`` (``kmax`` its largest ue8m0
    block exponent; for the first scorer's softmax, as fp8_ds_mla's tile scales) and each block's float16 factor
    ``2^(e - kmax + 6)`` (``decode_ws._factor_bits``; the e2m1 -> e4m3 bit move divides by 64), which both scoring
    warpgroups and the value warpgroup take as nvfp4's block scales, made once here rather than in each. Exact for
    blocks down to 2^-23 below the key's largest (``decode_ws._ue8m0_split``)."""
    b = k % STAGES
    mbarrier.wait(bars.index(KREADY + b), (k // STAGES) & 1)
    step = _seen_as(exponents.index(b), gl.uint8, [KEYS, 2, MX_BLOCKS], PLAIN_3D)
    e = step.load(EXPONENTS_LOAD).to(gl.int32)
    kmax = gl.max(gl.max(e, 2), 1)
    bits = _factor_bits(e, kmax[:, None, None])
    chunks = _seen_as(factors, gl.int16, [STAGES, 2, KEYS, MX_BLOCKS], PLAIN_3D).index(b)
    chunks.store(bits.to(gl.int16).permute((1, 0, 2)))
    key_scales.index(b).store(_ue8m0_scale(kmax))
    _cta_barrier()  # every warp's factors are stored
    mbarrier.arrive(bars.index(FREADY + b), count=1)


@gluon.jit
def _wait_step(bars, b, phase, LAYOUT: gl.constexpr):
    """A multiplying warpgroup's wait for stage ``b``'s step (and mxfp4_nsa's factors of it) in ``phase``."""
    mbarrier.wait(bars.index(KREADY + b), phase)
    if LAYOUT == "mxfp4_nsa":
        mbarrier.wait(bars.index(FREADY + b), phase)


@gluon.jit
def _score(q, stride_qt, stride_qh, visible, work, items_stride, item_counts, lse, stride_lt, part_lse, qk_scale,
           num_heads, nope_scale, q_nope, q_rope, codes, rope, scales, key_scales, probs, factors, to_out, halves,
           bars, KEEP_PARTIALS: gl.constexpr, LAYOUT: gl.constexpr, WAIT_PRIOR: gl.constexpr,
           CLUSTER: gl.constexpr):
    """The first scoring warpgroup: each item's query (rope and tiles 0, 1), each step's scores of those, plus the
    second warpgroup's half, the softmax and P per tile scale for the value warpgroup; at the item's end its lse,
    and the output factor for the value warpgroup."""
    STAGES: gl.constexpr = stages(LAYOUT)
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    nq = 0
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        q_down = _stage_item_query(q, stride_qt, stride_qh, row_block, q_first, q_len, num_heads, q_nope,
                                   q_rope.index(0), 0, 2, LAYOUT)
        if LAYOUT == "nvfp4":  # the layer scale of the latent keys
            q_down = q_down * nope_scale
        rows_s, ok_s, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS, ACC_ROWS)
        key_ids = gl.arange(0, KEYS, layout=ACC_KEYS)
        m_i, l_part, zero, _, _, _, _ = _transposed_state(ROWS, ACC)
        unit = gl.to_tensor(2.0 ** -126)  # u, the value accumulators' unit (decode_wgmma_fp8)
        for j in range(tiles):
            b = g % STAGES
            pb = g % 2
            start = kv_start + j * KEYS
            _wait_step(bars, b, (g // STAGES) & 1, LAYOUT)
            # The stage's part in registers and freed before anything is made of it (H100 16 heads b64 76.1 -> 75.3
            # us with _score_half and _value alike; NOTES.md, session 37).
            rope_raw = rope.index(b).load(ROPE_LOAD)
            part = _load_part(codes, scales, b, 0, LAYOUT)
            scales_every, scales_keys = _load_scales(scales, key_scales, b, LAYOUT)
            _cta_barrier()  # every warp has the stage in registers
            mbarrier.arrive(bars.index(KFREE + b), count=1)
            if LAYOUT == "fp8_e4m3":  # e4m3 -> bfloat16 is exact
                rope_raw = rope_raw.to(gl.float32).to(gl.bfloat16)
            r = gl.convert_layout(_operand_order(rope_raw, 8), OPERAND)  # see _issue_tile_scores
            s_rope = hopper.warpgroup_mma(r, q_rope.index(start >> 30).permute((1, 0)), zero, use_acc=False,
                                          is_async=True)
            s_rope, r = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s_rope, r])  # LAUNCH_OPTIONS' comment
            p0, p1, k0, k1 = _issue_part_scores(part, 0, start, q_nope, zero, LAYOUT)
            if LAYOUT == "mxfp4_nsa":  # while they run
                x0, x1, x2, x3, step_max = _key_scales(scales_every, scales_keys, start, kv_end)
            else:
                x0, x1, x2, x3, step_max = _step_scales(scales_every, scales_keys, start, kv_end, LAYOUT)
            p0, p1, k0, k1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[p0, p1, k0, k1])
            half = _receive(halves.index(pb), ACC, bars.index(HREADY + pb), bars.index(HFREE + pb), (g // 2) & 1)
            if LAYOUT == "mxfp4_nsa":  # one scale a key (x0) for all four tiles
                nope = (p0 + p1 + half) * x0[:, None]
            else:
                nope = p0 * x0[:, None] + p1 * x1[:, None] + half
            s = (s_rope + nope * q_down[None, :]) * qk_scale
            s = gl.where((start + key_ids)[:, None] < limit[None, :], s, float("-inf"))
            mbarrier.wait(bars.index(PFREE + pb), ((g // 2) & 1) ^ 1)
            m_i, l_part, unit, _alpha = _softmax_to_probs(
                s, LAYOUT != "fp8_ds_mla", (probs[0].index(pb), probs[1].index(pb), probs[2].index(pb),
                                            probs[3].index(pb)), x0, x1, x2, x3, step_max, m_i, l_part, unit,
                factors.index(pb))
            mbarrier.arrive(bars.index(PREADY + pb), count=1)
            g += 1
        l_i = gl.sum(l_part, 0)
        seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
        if tiles > 0:
            _send(to_out, gl.where(seen, unit / gl.where(seen, l_i, 1.0), 0.0), bars.index(LREADY), bars.index(LFREE),
                  nq & 1)
            nq += 1
        _store_lse(gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf")), rows_s, ok_s, lse,
                   stride_lt, part_lse, row_block, slot_out, q_first, num_heads, ROWS, KEEP_PARTIALS)
    if CLUSTER > 1:  # the item's LSE is in its slot
        _cluster_arrive()


@gluon.jit
def _score_half(q, stride_qt, stride_qh, work, items_stride, item_counts, num_heads, q_nope, codes, scales, halves,
                bars, LAYOUT: gl.constexpr, WAIT_PRIOR: gl.constexpr, CLUSTER: gl.constexpr):
    """The second scoring warpgroup: each item's query tiles 2 and 3, each step's scores of those (each by its tile
    scale) for the first."""
    STAGES: gl.constexpr = stages(LAYOUT)
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len, tiles = _item_tiles(table, i)
        _stage_item_query(q, stride_qt, stride_qh, row_block, q_first, q_len, num_heads, q_nope, None, 2, 4, LAYOUT)
        zero = gl.zeros([KEYS, ROWS], gl.float32, ACC)
        for j in range(tiles):
            b = g % STAGES
            pb = g % 2
            start = kv_start + j * KEYS
            _wait_step(bars, b, (g // STAGES) & 1, LAYOUT)
            part = _load_part(codes, scales, b, 1, LAYOUT)
            scales_every, scales_keys = _load_scales(scales, None, b, LAYOUT)
            _cta_barrier()  # every warp has the stage in registers
            mbarrier.arrive(bars.index(KFREE + b), count=1)
            p2, p3, k2, k3 = _issue_part_scores(part, 2, start, q_nope, zero, LAYOUT)
            _, _, x2, x3, _ = _step_scales(scales_every, scales_keys, start, kv_end, LAYOUT)  # while the products run
            p2, p3, k2, k3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[p2, p3, k2, k3])
            if LAYOUT == "mxfp4_nsa":  # the first scorer applies the key scales to the sum
                half = p2 + p3
            else:
                half = p2 * x2[:, None] + p3 * x3[:, None]
            _send(halves.index(pb), half, bars.index(HREADY + pb), bars.index(HFREE + pb), (g // 2) & 1)
            g += 1
    if CLUSTER > 1:
        _cluster_arrive()


@gluon.jit
def _load_part(codes, scales, b, half: gl.constexpr, LAYOUT: gl.constexpr):
    """A scoring warpgroup's ``half`` (tiles ``2 half`` and ``2 half + 1``) of stage ``b``, loaded for
    ``_issue_part_scores``: nvfp4's chunk (``_load_chunk``), else the two e4m3 code tiles (``CODES_LOAD``)."""
    if packed_fp4(LAYOUT):
        return _load_chunk(codes.index(2 * b + half), scales.index(2 * b + half), LAYOUT)
    else:
        return codes.index(4 * b + 2 * half).load(CODES_LOAD), codes.index(4 * b + 2 * half + 1).load(CODES_LOAD)


@gluon.jit
def _issue_part_scores(part, t: gl.constexpr, start, q_nope, acc, LAYOUT: gl.constexpr):
    """The score products of tiles ``t`` and ``t + 1`` from their loaded ``part`` (``_load_part``), issued; returns
    both products, then both operands (``_issue_tile_scores``)."""
    if packed_fp4(LAYOUT):
        first, second = _chunk_operands(part[0], part[1], LAYOUT)
        p0, k0 = _issue_tile_scores(first, t, start, q_nope, acc)
        p1, k1 = _issue_tile_scores(second, t + 1, start, q_nope, acc)
    else:
        p0, k0 = _issue_tile_scores(_code_operand(part[0]), t, start, q_nope, acc)
        p1, k1 = _issue_tile_scores(_code_operand(part[1]), t + 1, start, q_nope, acc)
    return p0, p1, k0, k1


@gluon.jit
def _issue_tile_scores(k, t: gl.constexpr, start, q_nope, acc):
    """Code tile ``t``'s register operand ``k`` (``_code_operand``, ``_chunk_operands``) and its ``S^T`` product,
    issued; returns both (the wait must keep the operand: ptxas serializes the products where it may reuse an
    operand's registers). The query's index carries a run-time 0 (``start >> 30``), so that its operand descriptor is
    made in the loop, not held in registers."""
    p = hopper.warpgroup_mma(k, q_nope.index(t + (start >> 30)).permute((1, 0)), acc, use_acc=False, is_async=True)
    return p, k


@gluon.jit
def _stage_item_query(q, stride_qt, stride_qh, row_block, q_first, q_len, num_heads, q_nope, q_rope,
                      FIRST: gl.constexpr, LAST: gl.constexpr, LAYOUT: gl.constexpr):
    """A scoring warpgroup's part of an item's query into shared memory, in its products' operand order (nvfp4's
    latent columns in each word's order first): latent tiles ``[FIRST, LAST)``, and the rope where ``q_rope`` is
    given, once this warpgroup's products of the previous item are done with them; returns the factor that undoes
    the query's scaling, per row along ACC's rows."""
    rows_q = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, COPY_LAYOUT))
    _cta_barrier()  # the previous item's products are done with the query
    q_base = _row_at(q, rows_q, q_first, num_heads, stride_qt, stride_qh)
    q_down = _stage_query(q_base, rows_q < q_len * num_heads,
                          (q_nope.index(0), q_nope.index(1), q_nope.index(2), q_nope.index(3)), q_rope, COPY_LAYOUT,
                          OPERAND_ORDER=True, FIRST=FIRST, LAST=LAST, WORD_ORDER=packed_fp4(LAYOUT))
    hopper.fence_async_shared()
    _cta_barrier()
    return gl.convert_layout(q_down, ACC_ROWS)


@gluon.jit
def _code_operand(tile_codes):
    """A ``[64 keys, 128]`` tile, loaded in ``CODES_LOAD`` (e4m3 codes, or nvfp4's decoded float16 values), as the
    score product's float16 register operand (columns in operand order)."""
    return gl.convert_layout(_operand_order(tile_codes.to(gl.float16), 16), OPERAND, assert_trivial=True)


@gluon.jit
def _load_chunk(chunk, blocks, LAYOUT: gl.constexpr):
    """A packed FP4 chunk's codes (``[64 keys, 32 words]``) and block scales (nvfp4: ``[64 keys, 16]`` e4m3;
    mxfp4_nsa: ``[64 keys, 8]`` float16 factors, ``_make_factors``), loaded for ``_chunk_operands``."""
    words = _seen_as(chunk, gl.int32, [KEYS, TILE // 4], WORDS_SMEM).load(gl.SliceLayout(2, WORDS_EIGHT))
    if LAYOUT == "nvfp4":
        return words, blocks.load(gl.SliceLayout(2, BLOCKS_SIXTEEN))
    else:
        return words, blocks.load(gl.SliceLayout(2, BLOCKS_THIRTYTWO))


@gluon.jit
def _chunk_operands(words, blocks, LAYOUT: gl.constexpr):
    """A loaded packed FP4 chunk (``_load_chunk``) as its two tiles' score operands (``_code_operand``): each e2m1
    value times its block's e4m3 scale (nvfp4) or factor (mxfp4_nsa), exact in float16 (``decode_ws._e2m1_words``),
    eight columns a word in the word's order (``E2M1_COLUMNS``; the query is staged alike)."""
    words = words[:, :, None].broadcast_to([KEYS, TILE // 4, 8]).reshape([KEYS, 2 * TILE])
    if LAYOUT == "nvfp4":
        times64 = blocks.to(gl.float16) * 64.0  # the e2m1 -> e4m3 bit move divides by 64
        times64 = times64[:, :, None].broadcast_to([KEYS, BLOCKS, 16]).reshape([KEYS, 2 * TILE])
    else:  # the factors carry the 64
        times64 = blocks[:, :, None].broadcast_to([KEYS, MX_BLOCKS, 32]).reshape([KEYS, 2 * TILE])
    values = gl.inline_asm_elementwise(E2M1_COLUMNS, "=r," * 4 + "r," * 8 + "r,r,r,r", [words, times64],
                                       dtype=gl.float16, is_pure=True, pack=8)
    first, second = gl.split(values.reshape([KEYS, 2, TILE]).permute((0, 2, 1)))
    return _code_operand(first), _code_operand(second)


@gluon.jit
def _load_scales(scales, key_scales, b, LAYOUT: gl.constexpr):
    """Stage ``b``'s scales in the two layouts ``_step_scales`` takes: fp8_ds_mla's ``[64 keys, 4]`` tile scales;
    mxfp4_nsa's ``[64]`` key scales where ``key_scales`` is given (the first scorer's; ``_make_factors``); else
    none, ones."""
    if LAYOUT == "fp8_ds_mla":
        return scales.index(b).load(SCALES_EVERY), scales.index(b).load(SCALES_KEYS)
    elif LAYOUT == "mxfp4_nsa" and key_scales is not None:
        return key_scales.index(b).load(KEY_SCALES_EVERY), key_scales.index(b).load(ACC_KEYS)
    else:
        return gl.full([KEYS, 4], 1.0, gl.float32, SCALES_EVERY), gl.full([KEYS, 4], 1.0, gl.float32, SCALES_KEYS)


@gluon.jit
def _key_scales(every, x, start, kv_end):
    """mxfp4_nsa's key scales of a step (``_load_scales``) along ACC's keys, as ``_step_scales``' first of four
    (the others ones), and their maximum; zero for keys at or past ``kv_end`` (their slots may hold anything)."""
    seen = (start + gl.arange(0, KEYS, layout=KEY_SCALES_EVERY)) < kv_end
    x = gl.where(start + gl.arange(0, KEYS, layout=ACC_KEYS) < kv_end, x, 0.0)
    one = gl.full([KEYS], 1.0, gl.float32, ACC_KEYS)
    return x, one, one, one, gl.max(gl.where(seen, every, 0.0), 0)


@gluon.jit
def _step_scales(every, x, start, kv_end, LAYOUT: gl.constexpr):
    """A step's four per-key tile scales (``_load_scales``) along ACC's keys and their maximum, zero for keys at or
    past ``kv_end`` (their slots may hold anything); fp8_e4m3, nvfp4, mxfp4_nsa: ones (masked keys get -inf scores;
    the first scorer takes mxfp4_nsa's key scales from ``_key_scales``)."""
    if LAYOUT != "fp8_ds_mla":
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
def _value(work, items_stride, item_counts, out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, out_scale,
           num_heads, codes, scales, probs, factors, to_out, bars, KEEP_PARTIALS: gl.constexpr, LAYOUT: gl.constexpr,
           WAIT_PRIOR: gl.constexpr, CLUSTER: gl.constexpr):
    """The value warpgroup: every step's ``O^T += V^T P^T``, the even and odd output columns of each fp8 tile apart,
    the FP4 layouts' columns by their position in a quad of four (fp8_e4m3, nvfp4: outputs stored here, not merged,
    and outputs merged in the cluster, times the layer's ``out_scale``)."""
    STAGES: gl.constexpr = stages(LAYOUT)
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
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
            _wait_step(bars, b, (g // STAGES) & 1, LAYOUT)
            if packed_fp4(LAYOUT):  # e, o 0-1: chunk 0's columns 4p, 4p + 1, 4p + 2, 4p + 3; e, o 2-3: chunk 1's
                w0 = _value_pairs(codes.index(2 * b), start, kv_end)
                w1 = _value_pairs(codes.index(2 * b + 1), start, kv_end)
                f0 = _quad_scales(scales.index(2 * b), start, kv_end, LAYOUT)
                f1 = _quad_scales(scales.index(2 * b + 1), start, kv_end, LAYOUT)
                _cta_barrier()  # every warp has the stage in registers
                mbarrier.arrive(bars.index(KFREE + b), count=1)
                ve0, vo0, ve1, vo1 = gl.inline_asm_elementwise(E2M1_QUADS, "=r,=r,=r,=r,r,r", [w0, f0],
                                                               dtype=(gl.float16,) * 4, is_pure=True, pack=2)
                ve2, vo2, ve3, vo3 = gl.inline_asm_elementwise(E2M1_QUADS, "=r,=r,=r,=r,r,r", [w1, f1],
                                                               dtype=(gl.float16,) * 4, is_pure=True, pack=2)
            else:
                # All four tiles' operands first: issued tile by tile, ptxas reused one tile's operand registers for
                # the next and waited for each tile's products before loading the next.
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
            if LAYOUT != "fp8_ds_mla" and slot_out < 0:
                factor = factor * out_scale
            if LAYOUT == "nvfp4":  # E2M1_QUADS' values are 64 times too small
                factor = factor * 64.0
        _store_item(e0, o0, e1, o1, e2, o2, e3, o3, factor, out, stride_ot, stride_oh, part_out, row_block,
                    slot_out, q_first, q_len, num_heads, KEEP_PARTIALS, LAYOUT)
        if CLUSTER > 1:  # the other partitions arrive once their part is stored: the first scorer's LSE
            _cluster_barrier()
            _merge_stored_splits(None, None, None, None, out_scale, out, stride_ot, stride_oh, lse, stride_lt,
                                 part_out, part_lse, row_block, slot_out, q_first, q_len, num_heads, ROWS,
                                 KEEP_PARTIALS, CLUSTER)


@gluon.jit
def _store_item(e0, o0, e1, o1, e2, o2, e3, o3, factor, out, stride_ot, stride_oh, part_out, row_block, slot_out,
                q_first, q_len, num_heads, KEEP_PARTIALS: gl.constexpr, LAYOUT: gl.constexpr):
    """The item's output columns (``_store_columns``): final rows, or a partial in its slot for the merge kernel or
    for the cluster's merge."""
    if packed_fp4(LAYOUT):
        _store_columns(_quads_as_rows(e0, o0, e1, o1, factor), 0, out, stride_ot, stride_oh, part_out, row_block,
                       slot_out, q_first, q_len, num_heads, KEEP_PARTIALS)
        _store_columns(_quads_as_rows(e2, o2, e3, o3, factor), 2 * TILE, out, stride_ot, stride_oh, part_out,
                       row_block, slot_out, q_first, q_len, num_heads, KEEP_PARTIALS)
    else:
        _store_columns(_pairs_as_rows(e0, o0, factor), 0, out, stride_ot, stride_oh, part_out, row_block, slot_out,
                       q_first, q_len, num_heads, KEEP_PARTIALS)
        _store_columns(_pairs_as_rows(e1, o1, factor), TILE, out, stride_ot, stride_oh, part_out, row_block,
                       slot_out, q_first, q_len, num_heads, KEEP_PARTIALS)
        _store_columns(_pairs_as_rows(e2, o2, factor), 2 * TILE, out, stride_ot, stride_oh, part_out, row_block,
                       slot_out, q_first, q_len, num_heads, KEEP_PARTIALS)
        _store_columns(_pairs_as_rows(e3, o3, factor), 3 * TILE, out, stride_ot, stride_oh, part_out, row_block,
                       slot_out, q_first, q_len, num_heads, KEEP_PARTIALS)


@gluon.jit
def _value_pairs(tile, start, kv_end):
    """A ``[64 keys, 128 bytes]`` code tile loaded transposed as 16-bit words (fp8: pairs of columns; nvfp4: quads),
    ``[64 words, 64 keys]`` in the value products' operand layout; keys at or past ``kv_end`` zeroed (0 x NaN is
    NaN)."""
    w = _seen_as(tile, gl.int16, [KEYS, TILE // 2], PAIRS_SMEM).permute((1, 0)).load(OPERAND)
    if start + KEYS > kv_end:
        keys = start + gl.arange(0, KEYS, layout=gl.SliceLayout(0, OPERAND))
        w = gl.where(keys[None, :] < kv_end, w, gl.zeros_like(w))
    return w


@gluon.jit
def _quad_scales(blocks, start, kv_end, LAYOUT: gl.constexpr):
    """A packed FP4 chunk's block scales as float16 along ``_value_pairs``' words of the chunk, ``[64 quads, 64
    keys]``, one 32-bit load a key (each thread's blocks of a key lie in one word): nvfp4's (``[64 keys, 16]`` e4m3),
    each block's for its four quads, picked from the key's word of four, keys at or past ``kv_end`` zeroed (their
    slots may hold NaN); mxfp4_nsa's float16 factors (``[64 keys, 8]``, always finite), each block's for its eight
    quads, picked from the key's word of two."""
    words = _seen_as(blocks, gl.int32, [KEYS, BLOCKS // 4], SCALES_SMEM).load(KEY_WORDS)
    if LAYOUT == "nvfp4" and start + KEYS > kv_end:
        keys = start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, KEY_WORDS))
        words = gl.where(keys[:, None] < kv_end, words, gl.zeros_like(words))
    words = words[:, :, None, None].broadcast_to([KEYS, 4, 4, 4]).permute((1, 2, 3, 0)).reshape([4 * BLOCKS, KEYS])
    words = gl.convert_layout(words, OPERAND, assert_trivial=True)
    quad = gl.arange(0, 4 * BLOCKS, layout=gl.SliceLayout(1, OPERAND))
    if LAYOUT == "nvfp4":
        block = (quad >> 2) & 3  # the block's byte in its word
        picks = gl.zeros_like(words) + (block | ((block + 4) << 4))[:, None]  # bytes (a, b) of words (a, b)
        return gl.inline_asm_elementwise(BLOCK_SCALE_PAIR, "=r,r,r,r,r", [words, picks], dtype=gl.float16,
                                         is_pure=True, pack=2)
    else:
        picks = gl.zeros_like(words) + (0x5410 + ((quad >> 3) & 1) * 0x2222)[:, None]  # halves (a, b) of words (a, b)
        return gl.inline_asm_elementwise(BLOCK_FACTOR_PAIR, "=r,r,r,r,r", [words, picks], dtype=gl.float16,
                                         is_pure=True, pack=2)


@gluon.jit
def _value_operands(w):
    """Loaded pairs (``_value_pairs``) as the value products' float16 register operands: ``V^T`` of the tile's even
    columns and of its odd ones."""
    return gl.inline_asm_elementwise(SPLIT_PAIRS, "=r,=r,r", [w], dtype=(gl.float16, gl.float16), is_pure=True,
                                     pack=2)


@gluon.jit
def _pairs_as_rows(even, odd, factor):
    """An fp8 tile's even and odd output columns (``O^T`` halves) times ``factor`` (per row): ``[16 rows, 128]``."""
    f = factor[None, :]
    return gl.join(even * f, odd * f).permute((1, 0, 2)).reshape([ROWS, TILE])


@gluon.jit
def _quads_as_rows(c0, c1, c2, c3, factor):
    """An nvfp4 chunk's output columns by position in their quad (``O^T`` quarters) times ``factor`` (per row):
    ``[16 rows, 256]``."""
    f = factor[None, :]
    o = gl.join(gl.join(c0 * f, c1 * f), gl.join(c2 * f, c3 * f))
    return o.permute((1, 0, 3, 2)).reshape([ROWS, 2 * TILE])


@gluon.jit
def _store_columns(o, first, out, stride_ot, stride_oh, part_out, row_block, slot_out, q_first, q_len, num_heads,
                   KEEP_PARTIALS: gl.constexpr):
    """Output columns ``[first, first + width)`` of the rows ``o``: final bf16 rows where the item covers its rows'
    whole range (``slot_out < 0``), else a float32 partial for the merge."""
    width: gl.constexpr = o.shape[1]
    o = gl.convert_layout(o, OUT_LAYOUT)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT_LAYOUT))
    cols = first + gl.arange(0, width, layout=gl.SliceLayout(0, OUT_LAYOUT))[None, :]
    if slot_out < 0:
        rows = row_block * ROWS + rows
        out_at = _row_at(out, rows, q_first, num_heads, stride_ot, stride_oh)[:, None] + cols
        gl.store(out_at, o.to(gl.bfloat16), mask=(rows < q_len * num_heads)[:, None])
    else:
        policy: gl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        gl.store(part_out + (slot_out.to(gl.int64) * ROWS + rows)[:, None] * NOPE + cols, o, eviction_policy=policy)
