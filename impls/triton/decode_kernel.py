"""Triton kernels of paged MLA decode: split-KV partial attention, then an LSE merge of the splits.

The absorbed decode is multi-query attention: every query row (one head of one new token, 576 wide:
512 latent + 64 rope) attends the same key/value head, the latent cache (keys 576 wide, values the first
512 of them). ``_decode_split_kernel`` runs persistent programs, each a list of consecutive work items (see
decode_schedule). A work item is one request, a block of ``BLOCK_M`` query rows of it (rows are (token, head)
pairs, head fastest), and a range of its keys. It walks the range ``BLOCK_N`` keys at a time, like the
flash-attention tutorial, with the 512 latent values in four tiles of 128 (``t`` = 0..3; fp8_ds_mla scales
each such tile of a token by its own factor ``c_t``):

    S   = sum_t c_t * Q_t K_t^T + Q_rope K_rope^T     [BLOCK_M, BLOCK_N], mask, online softmax (base 2)
    O_t = O_t * alpha + (P * c_t) K_t                [BLOCK_M, 128] each: the key tiles double as value tiles

Keys come from the paged cache through the block table, one row per token, decoded in registers from the
cache layout's bytes (never a dequantized copy in memory); Triton's software pipeliner prefetches
``num_stages - 1`` tiles ahead (``_token_base`` says what that takes). An item that covers its rows' whole range
writes the final ``out`` / ``lse``; otherwise it writes a normalized partial and its log2-sum-exp to a
workspace slot, and ``_merge_splits_kernel`` combines a group's slots by their LSE.

``HEADS_AS_N`` computes the same products transposed (``S^T = K Q^T``, ``O^T = V^T P^T``): the keys then fill
the 64-row side of Hopper's wgmma, so 16 or 32 query rows need no padding.

``INTERPRET`` is set when the kernels run in Triton's interpreter, whose ``tl.dot`` multiplies bfloat16 bit
patterns (triton-lang/triton#11584) and whose float32 -> bfloat16 casts truncate. There the products take
float32 operands holding the same bfloat16 values, and roundings to bfloat16 are done in integer arithmetic
(to nearest even, as the GPU does), so the interpreter checks the GPU's arithmetic. The FP4 decode is the
exception: on the GPU it runs inline PTX on packed words (``_e2m1_scaled``), in the interpreter Triton arithmetic
that computes the same values; the GPU tests judge the PTX.

Row ``r`` of a request sees its first ``visible[r]`` keys (the causal frontier; a DCP shard's local
prefix). Rows that see nothing give out 0 and lse -inf; a row whose inputs hold a NaN or inf gives NaN in both
(never the -inf of a row that saw nothing).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from impls.triton.common import prefetch_l2

LOG2E = 1.4426950408889634  # host side: the softmax scale is passed premultiplied by log2(e)
LN2 = tl.constexpr(0.6931471805599453)
NOPE = tl.constexpr(512)  # latent (value) width of a cache entry
ROPE = tl.constexpr(64)   # rope width
TILE = tl.constexpr(128)  # latent values per tile (fp8_ds_mla's scale block)
# Block-table lines requested ahead, in tiles, for pages smaller than a tile (page 1, 16 heads, an H200: 2-4 tiles
# ahead measured alike, 6 worse; NOTES.md, round 7).
TABLE_PREFETCH_STEPS = tl.constexpr(2)
ITEM_FIELDS = tl.constexpr(8)  # int32 per work item row, 7 used (decode.ITEM_COLUMNS): 32-byte rows
# A 32-byte item row is one line: requested into L1 while the program's item count is read, it is no longer a second
# DRAM read after the first (H200, 16 heads bf16 b1 ctx8192: 12.8 -> 12.6-12.7 us; NOTES.md session 22).
PREFETCH_L1 = tl.constexpr("prefetch.global.L1 [$1]; mov.u32 $0, 0;")
# A bulk L2 prefetch of $2 bytes from $1, none where $2 is 0, by threads below $3: an element of a vector of $3
# elements lies with the threads t = element mod $3 (1-D blocked layouts), so each asks once.
FIRST_KEYS_PREFETCH = tl.constexpr(
    "{ .reg .pred p, q; .reg .b32 t; mov.u32 t, %tid.x; setp.lt.u32 p, t, $3; "
    "setp.ne.and.u32 q, $2, 0, p; @q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@triton.jit
def _to_bf16(x, INTERPRET: tl.constexpr):
    """float32 -> bfloat16, rounded to nearest even (the interpreter's own cast truncates)."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        x = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _operand(x, INTERPRET: tl.constexpr):
    """A bfloat16 matrix-product operand; float32 holding the same values in the interpreter."""
    if INTERPRET:
        x = x.to(tl.float32)
    return x


# ---- decoding the cache layouts (byte layouts: MLA_FACTS.md, codecs: mla_bench/layouts) ----------------------------

@triton.jit
def _e4m3_16bit(codes, AS_FLOAT16: tl.constexpr):
    """e4m3fn bytes -> float16 (exact, one conversion per two values) or bf16 (exact, three per value)."""
    codes = codes.to(tl.float8e4nv, bitcast=True)
    if AS_FLOAT16:
        values = codes.to(tl.float16)
    else:
        values = codes.to(tl.bfloat16)
    return values


@triton.jit
def _bf16_at(row, offset: tl.constexpr, WIDTH: tl.constexpr, n_ok, EVICT: tl.constexpr):
    """``WIDTH`` bfloat16 values at byte ``offset`` of each token row (0 where ``n_ok`` is False)."""
    words = (row + offset).to(tl.pointer_type(tl.bfloat16))
    return tl.load(words + tl.arange(0, WIDTH)[None, :], mask=n_ok[:, None], other=0.0, eviction_policy=EVICT)


@triton.jit
def _bytes_at(row, offset: tl.constexpr, WIDTH: tl.constexpr, n_ok, EVICT: tl.constexpr):
    """``WIDTH`` bytes at byte ``offset`` of each token row (0 where ``n_ok`` is False)."""
    return tl.load(row + offset + tl.arange(0, WIDTH)[None, :], mask=n_ok[:, None], other=0, eviction_policy=EVICT)


@triton.jit
def _scale_bytes_at(row, offset: tl.constexpr, COUNT: tl.constexpr, n_ok, EVICT: tl.constexpr):
    """``COUNT`` (a multiple of 4) bytes at byte ``offset`` of each token row, read as 32-bit words: fewer than 4
    bytes per thread cannot go through an asynchronous copy, and Triton would read them synchronously in every
    iteration of the key loop instead of prefetching them with the tiles."""
    words = (row + offset).to(tl.pointer_type(tl.uint32))
    words = tl.load(words + tl.arange(0, COUNT // 4)[None, :], mask=n_ok[:, None], other=0, eviction_policy=EVICT)
    shifts = 8 * tl.arange(0, 4)
    codes = (words[:, :, None] >> shifts[None, None, :]) & 0xFF  # little-endian: byte k of a word is bits 8k..8k+7
    return codes.reshape([words.shape[0], COUNT]).to(tl.uint8)


@triton.jit
def _keep_second(a, b):
    return b


@triton.jit
def _decoded_here(tile, INTERPRET: tl.constexpr):
    """``tile`` unchanged, pinned where it was computed: an identity scan, which Triton does not move. Unpinned,
    Triton moves a cache tile's decode past the tile's conversion to each product's operand layout, so that every
    product decodes it again from 8-bit values read one at a time out of shared memory (LDS.U8: the value
    operand's reduction dimension, the keys, is not contiguous). Pinned, the tile is decoded once, in the load's
    coalesced layout, and reaches both products as 16-bit values through shared memory (NOTES.md, round 3).
    The interpreter, which has no layouts to pin, skips the scan: it runs it one element at a time in Python, 97%
    of a quantized decode's time on the CPU."""
    if INTERPRET:
        return tile
    return tl.associative_scan(tile, 1, _keep_second)


@triton.jit
def _e4m3(codes):
    """e4m3fn bytes -> float32, exactly."""
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_over_64(packed):
    """Packed FP4 bytes ``[N, W]`` (even element in the low nibble) -> float32 ``[N, 2W]``: each e2m1 value / 64.

    A 4-bit code ``s ee m`` becomes the e4m3 byte ``s 00ee m00`` (exponent field ee, mantissa m00), whose value is
    the e2m1 value times 2^-6 for normal and subnormal codes alike; the hardware's e4m3 conversion does the rest.
    Callers fold the 64 into their block scale.
    """
    low = ((packed & 0x08) << 4) | ((packed & 0x07) << 2)
    high = (packed & 0x80) | ((packed & 0x70) >> 2)
    codes = tl.join(low, high).reshape([packed.shape[0], 2 * packed.shape[1]])
    return _e4m3(codes)


@triton.jit
def _ue8m0_times_64(codes):
    """Exponent-only scale bytes -> float32 ``2^(code - 127) * 64`` (the e2m1 decoder's 2^6); 0xFF is NaN.
    Codes above 248 (blocks beyond 2^121, past what bfloat16 keys can hold anyway) saturate."""
    bits = (tl.minimum(codes.to(tl.int32), 248) + 6) << 23
    return tl.where(codes == 0xFF, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _scale_blocks(values, scales, BLOCK: tl.constexpr):
    """``values`` ``[N, D]`` times ``scales`` ``[N, D / BLOCK]``, each scale covering ``BLOCK`` consecutive values."""
    n: tl.constexpr = values.shape[0]
    d: tl.constexpr = values.shape[1]
    blocks = values.reshape([n, d // BLOCK, BLOCK]) * scales[:, :, None]
    return blocks.reshape([n, d])


def e2m1_as_e4m3_ptx(word: str) -> str:
    """PTX: ``_e2m1_over_64``'s bit move on the 32-bit register ``word`` of four packed bytes, into ``lo`` (the low
    nibbles' e4m3 codes) and ``hi`` (the high nibbles'), through ``t0`` and ``t1`` (b32 registers the caller
    declares), for 8 values at once; shared with ``decode_ws``'s nvfp4 decoder."""
    return f"""
    shl.b32 t0, {word}, 4;
    shl.b32 t1, {word}, 2;
    and.b32 t1, t1, 0x1C1C1C1C;
    and.b32 t0, t0, 0x80808080;
    or.b32 lo, t0, t1;
    shr.b32 t0, {word}, 2;
    and.b32 t0, t0, 0x1C1C1C1C;
    and.b32 t1, {word}, 0x80808080;
    or.b32 hi, t0, t1;"""


# e2m1 codes to e4m3 bytes on a word of four packed bytes: the low nibbles' codes (lo) and the high nibbles' (hi),
# each pair of codes converted by the hardware (e4m3x2 -> f16x2), then scaled: the float16 pairs times a float16
# scale, or widened to float32, times a float32 scale, rounded to a bfloat16 pair (that form also decodes
# decode_ws's fp4_mx16 rope). $4 holds the packed word, $5 the first of the scale's registers (one scale covers the
# word's eight values). Outputs: $0-$1 the low nibbles' values, $2-$3 the high nibbles'.
_E2M1_CODES = """
    .reg .b32 t0, t1, lo, hi;
    .reg .b16 h<4>;""" + e2m1_as_e4m3_ptx("$4") + """
    mov.b32 {h0, h1}, lo;
    mov.b32 {h2, h3}, hi;
"""
_E2M1_TIMES_F16 = tl.constexpr("{" + _E2M1_CODES + "".join(f"""
    cvt.rn.f16x2.e4m3x2 ${i}, h{i};
    mul.rn.f16x2 ${i}, ${i}, $5;""" for i in range(4)) + "\n}")
E2M1_TIMES_F32 = tl.constexpr("{" + _E2M1_CODES + """
    .reg .b32 pair;
    .reg .b16 a, b;
    .reg .f32 fa, fb;""" + "".join(f"""
    cvt.rn.f16x2.e4m3x2 pair, h{i};
    mov.b32 {{a, b}}, pair;
    cvt.f32.f16 fa, a;
    cvt.f32.f16 fb, b;
    mul.rn.f32 fa, fa, $5;
    mul.rn.f32 fb, fb, $5;
    cvt.rn.bf16x2.f32 ${i}, fb, fa;""" for i in range(4)) + "\n}")


@triton.jit
def _e2m1_scaled(packed, scales, AS_FLOAT16: tl.constexpr):
    """Packed FP4 bytes ``[N, W]`` times one scale per byte ``[N, W]`` (float16 or float32, the 64 of
    ``_e2m1_over_64`` folded in, equal over each 4-byte word) -> ``[N, 2W]`` float16 or bfloat16 values, on the GPU
    (inline PTX on 32-bit words: Triton's byte arithmetic took twice the instructions per key, NOTES.md session 17)."""
    if AS_FLOAT16:  # outputs: 2 registers each; inputs: the packed word and a scale in 2 (float16) or 4 registers
        low, high = tl.inline_asm_elementwise(_E2M1_TIMES_F16, "=r,=r,=r,=r,r,r,r", [packed, scales],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        low, high = tl.inline_asm_elementwise(E2M1_TIMES_F32, "=r,=r,=r,=r,r,r,r,r,r", [packed, scales],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.join(low, high).reshape([packed.shape[0], 2 * packed.shape[1]])


@triton.jit
def _fp4_tile(row, packed_at: tl.constexpr, scales_at: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
              SCALE: tl.constexpr, n_ok, EVICT: tl.constexpr, AS_FLOAT16: tl.constexpr, INTERPRET: tl.constexpr):
    """``WIDTH`` e2m1 values from packed bytes at ``packed_at``, scaled per ``BLOCK`` values by the bytes at
    ``scales_at`` (``SCALE`` "ue8m0": exponent-only; "e4m3": an fp8 factor). As bfloat16 (exact), or with
    ``AS_FLOAT16`` (e4m3 scales only) as float16: an e2m1 value times an e4m3 scale has at most 6 significant
    bits and lies within [2^-16, 2688], which float16 holds exactly."""
    tl.static_assert(SCALE == "e4m3" or not AS_FLOAT16, "float16 cannot hold every power-of-two scale")
    codes = _scale_bytes_at(row, scales_at, WIDTH // BLOCK, n_ok, EVICT)
    if SCALE == "ue8m0":
        scales = _ue8m0_times_64(codes)
    else:
        scales = _e4m3(codes) * 64.0
    packed = _bytes_at(row, packed_at, WIDTH // 2, n_ok, EVICT)
    if INTERPRET:
        tile = _scale_blocks(_e2m1_over_64(packed), scales, BLOCK)
        tile = tile.to(tl.float16) if AS_FLOAT16 else tile.to(tl.bfloat16)
    else:  # the PTX multiplies in the values' precision: float16 scales for float16 values
        if AS_FLOAT16:
            scales = scales.to(tl.float16)
        per_byte = tl.broadcast_to(scales[:, :, None], [scales.shape[0], scales.shape[1], BLOCK // 2])
        tile = _e2m1_scaled(packed, per_byte.reshape([scales.shape[0], WIDTH // 2]), AS_FLOAT16)
    return tile


@triton.jit
def _latent_tile(row, t: tl.constexpr, n_ok, LAYOUT: tl.constexpr, EVICT: tl.constexpr, ONCE: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Latent values ``[128 t, 128 t + 128)`` of each token ``[BLOCK_N, 128]``, exactly as stored: without
    fp8_ds_mla's tile scale (``_tile_scale``) or a per-layer scale (folded into the scores and output). ``ONCE``:
    decoded once for both products (``_decoded_here``), fp8 as float16, which holds e4m3 exactly and takes one
    conversion per two values, and nvfp4 as float16 (``_fp4_tile``); otherwise decoded by each product, as bf16
    (three conversions per value).
    ``EVICT``: the load's L2 eviction policy."""
    if LAYOUT == "bf16":          # [512 bf16 | 64 bf16]
        tile = _bf16_at(row, 2 * TILE * t, TILE, n_ok, EVICT)
    elif LAYOUT == "fp8_e4m3" or LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2":  # 512 e4m3 first
        tile = _e4m3_16bit(_bytes_at(row, TILE * t, TILE, n_ok, EVICT), ONCE)
    elif LAYOUT == "fp4_mx16":    # [288 packed e2m1, all 576 | 36 ue8m0 per 16]
        tile = _fp4_tile(row, TILE // 2 * t, 288 + TILE // 16 * t, TILE, 16, "ue8m0", n_ok, EVICT, False, INTERPRET)
    elif LAYOUT == "mxfp4_nsa":   # [256 packed e2m1 | 16 ue8m0 per 32 | 64 bf16 rope]
        tile = _fp4_tile(row, TILE // 2 * t, 256 + TILE // 32 * t, TILE, 32, "ue8m0", n_ok, EVICT, False, INTERPRET)
    elif LAYOUT == "nvfp4":       # [256 packed e2m1 | 32 e4m3 per 16 | 64 bf16 rope] (x the layer's scale)
        tile = _fp4_tile(row, TILE // 2 * t, 256 + TILE // 16 * t, TILE, 16, "e4m3", n_ok, EVICT, ONCE, INTERPRET)
    else:
        tl.static_assert(False, "unknown cache layout")
    if LAYOUT != "bf16" and ONCE:
        tile = _decoded_here(tile, INTERPRET)
    return tile


@triton.jit
def _rope_tile(row, n_ok, LAYOUT: tl.constexpr, ONCE: tl.constexpr, INTERPRET: tl.constexpr):
    """The 64 rope values of each token ``[BLOCK_N, 64]`` (``ONCE``: as in ``_latent_tile``)."""
    if LAYOUT == "bf16":
        tile = _bf16_at(row, 2 * NOPE, ROPE, n_ok, "")
    elif LAYOUT == "fp8_e4m3":    # [576 e4m3] (x the layer's scale)
        tile = _e4m3_16bit(_bytes_at(row, NOPE, ROPE, n_ok, ""), ONCE)
    elif LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2":  # [512 e4m3 | 4 fp32 | 64 bf16]
        tile = _bf16_at(row, NOPE + 16, ROPE, n_ok, "")
    elif LAYOUT == "fp4_mx16":
        tile = _fp4_tile(row, NOPE // 2, 288 + NOPE // 16, ROPE, 16, "ue8m0", n_ok, "", False, INTERPRET)
    elif LAYOUT == "mxfp4_nsa":
        tile = _bf16_at(row, NOPE // 2 + NOPE // 32, ROPE, n_ok, "")
    elif LAYOUT == "nvfp4":
        tile = _bf16_at(row, NOPE // 2 + NOPE // 16, ROPE, n_ok, "")
    else:
        tl.static_assert(False, "unknown cache layout")
    if (LAYOUT == "fp8_e4m3" or LAYOUT == "fp4_mx16") and ONCE:
        tile = _decoded_here(tile, INTERPRET)
    return tile


@triton.jit
def _tile_scale(base, t: tl.constexpr, n_ok):
    """fp8_ds_mla: the float32 scale of latent tile ``t`` of each token ``[BLOCK_N]`` (``base``: token addresses)."""
    return tl.load((base + NOPE + 4 * t).to(tl.pointer_type(tl.float32)), mask=n_ok, other=0.0)


@triton.jit
def _pow2_scales(q0, q1, q2, q3, q_rope):
    """Powers of two ``(up, down)`` per query row, ``down = 1 / up``, that bring the row's largest magnitude into
    [2^14, 2^15): scaled by ``up``, float16 holds the bf16 query exactly (11 significant bits against 8) without
    overflow, and ``down`` scales the scores back. A row of zeros, NaN or Inf gets a finite pair (NaN and Inf
    still propagate through the products)."""
    amax = tl.maximum(tl.max(tl.abs(q0.to(tl.float32)), 1), tl.max(tl.abs(q1.to(tl.float32)), 1))
    amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(q2.to(tl.float32)), 1), tl.max(tl.abs(q3.to(tl.float32)), 1)))
    amax = tl.maximum(amax, tl.max(tl.abs(q_rope.to(tl.float32)), 1))
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.minimum(tl.maximum(exponent, -112), 113)
    up = ((127 + 14 - exponent) << 23).to(tl.float32, bitcast=True)
    down = ((127 - 14 + exponent) << 23).to(tl.float32, bitcast=True)
    return up, down


@triton.jit
def _token_base(cache, pages, start, offs_n, n_ok, kv_end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                BYTES_PER_TOKEN: tl.constexpr, INTERPRET: tl.constexpr):
    """Byte address of each key's cache row ``[BLOCK_N]``, through the request's block table ``pages``.

    Triton's software pipeliner counts a pipelinable load that feeds a cache tile's address as one more level of
    indirection and gives every load only ``(num_stages - 1) / (levels + 1)`` iterations of prefetch distance.
    Block-table entries read as two 16-bit halves (non-negative int32, little-endian) are too small for it to
    pipeline, so the tiles keep the full distance (``num_stages - 1``). A tile inside one page reads one entry.
    Pages smaller than a tile read an entry per key, at the point where the pipeliner issues a later tile's copy:
    each step waited there for a block-table line from DRAM, so the lines of the entries ``TABLE_PREFETCH_STEPS``
    tiles ahead are requested into L2 first.
    """
    if PAGE_SIZE % BLOCK_N == 0:  # tiles start at multiples of BLOCK_N: one page per tile, consecutive rows
        halves = pages.to(tl.pointer_type(tl.uint16)) + 2 * (start // PAGE_SIZE)
        page = tl.load(halves).to(tl.int64) | (tl.load(halves + 1).to(tl.int64) << 16)
        first = cache + (page * PAGE_SIZE + start % PAGE_SIZE) * BYTES_PER_TOKEN
        base = first + tl.arange(0, BLOCK_N) * BYTES_PER_TOKEN
    else:
        prefetch_l2(pages + tl.minimum(offs_n + TABLE_PREFETCH_STEPS * BLOCK_N, kv_end - 1) // PAGE_SIZE, INTERPRET)
        halves = pages.to(tl.pointer_type(tl.uint16)) + 2 * (offs_n // PAGE_SIZE)
        low = tl.load(halves, mask=n_ok, other=0).to(tl.int64)
        high = tl.load(halves + 1, mask=n_ok, other=0).to(tl.int64)
        base = cache + ((low | (high << 16)) * PAGE_SIZE + offs_n % PAGE_SIZE) * BYTES_PER_TOKEN
    return base


# ---- the products, in either orientation ---------------------------------------------------------------------------

@triton.jit
def _qk(q, k, s, HEADS_AS_N: tl.constexpr, INTERPRET: tl.constexpr):
    """``s + q k^T`` in the product's native orientation: ``[BLOCK_N, BLOCK_M]`` (as ``k q^T``) when ``HEADS_AS_N``."""
    if HEADS_AS_N:
        s = tl.dot(_operand(k, INTERPRET), tl.trans(_operand(q, INTERPRET)), s)
    else:
        s = tl.dot(_operand(q, INTERPRET), tl.trans(_operand(k, INTERPRET)), s)
    return s


@triton.jit
def _per_key(c, HEADS_AS_N: tl.constexpr):
    """A per-key vector ``[BLOCK_N]`` shaped to broadcast against native-orientation scores."""
    if HEADS_AS_N:
        c = c[:, None]
    else:
        c = c[None, :]
    return c


@triton.jit
def _pv(acc, alpha, p, v, HEADS_AS_N: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc * alpha + p v`` for one value tile; ``acc`` is ``O_t^T`` ``[128, BLOCK_M]`` when ``HEADS_AS_N``, else
    ``O_t`` ``[BLOCK_M, 128]``."""
    if HEADS_AS_N:
        acc = tl.dot(tl.trans(_operand(v, INTERPRET)), tl.trans(_operand(p, INTERPRET)), acc * alpha[None, :])
    else:
        acc = tl.dot(_operand(p, INTERPRET), _operand(v, INTERPRET), acc * alpha[:, None])
    return acc


@triton.jit
def _finish(acc, inv_l, HEADS_AS_N: tl.constexpr):
    """One output tile ``[BLOCK_M, 128]`` from its accumulator, divided by the softmax sum."""
    if HEADS_AS_N:
        acc = tl.trans(acc)
    return acc * inv_l[:, None]


@triton.jit
def _store_tile(o, t: tl.constexpr, out_row, part_row, row_ok, DIRECT: tl.constexpr, INTERPRET: tl.constexpr,
                EVICT: tl.constexpr):
    """Write output tile ``t``: to ``out`` (bf16) when ``DIRECT``, else to the float32 partial workspace with the
    L2 eviction policy ``EVICT``."""
    cols = TILE * t + tl.arange(0, TILE)
    if DIRECT:
        tl.store(out_row[:, None] + cols[None, :], _to_bf16(o, INTERPRET), mask=row_ok[:, None])
    else:
        tl.store(part_row[:, None] + cols[None, :], o, eviction_policy=EVICT)


# ---- kernels -------------------------------------------------------------------------------------------------------

@triton.jit
def _decode_split_kernel(
    q, stride_qt, stride_qh,            # [T, H, 576] queries
    cache,                              # uint8 base of the paged cache, BYTES_PER_TOKEN bytes per slot
    block_table, stride_bt,             # [B, max_blocks] int32
    visible,                            # [T] int32: keys of its request each query token may see
    work, items_stride,                 # [programs, max items, ITEM_FIELDS] int32: each program's work items
    item_counts,                        # [programs] int32: work items of each program
    out, stride_ot, stride_oh,          # [T, H, 512] final output
    lse, stride_lt,                     # [T, H] float32 natural-log lse
    part_out, part_lse,                 # [num_slots, BLOCK_M, 512] / [num_slots, BLOCK_M] float32
    qk_scale,                           # softmax scale * log2(e) (times fp8_e4m3's layer scale)
    nope_scale,                         # nvfp4's layer scale of the latent values (used when SCALE_NOPE)
    out_scale,                          # the layer scale of the values (1 where there is none)
    num_heads,
    LAYOUT: tl.constexpr, BYTES_PER_TOKEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TILE_SCALES: tl.constexpr, SCALE_NOPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_AS_N: tl.constexpr, INTERPRET: tl.constexpr,
    REREAD: tl.constexpr, EARLY_MERGE: tl.constexpr, KEEP_PARTIALS: tl.constexpr, WAIT_PRIOR: tl.constexpr,
    KEYS_AHEAD: tl.constexpr,
):
    """A persistent program: runs its work items one after the other (a balanced share of the batch's key blocks;
    see decode_schedule). An item's row holds all it needs before its queries and block-table row can be read.
    (Reading the next row ahead, carried across the key loop, miscompiles with Triton 3.6: wrong results on an
    H200 for programs of several items.) ``EARLY_MERGE``: let the merge kernel, launched as a programmatic
    dependent, start now and wait for this grid's results on the device (its launch latency hidden).
    ``KEEP_PARTIALS``: store the partials to stay in L2 (``evict_last``) for the merge, which reads them right after
    (``decode.PARTIALS_L2_SHARE`` says when). ``WAIT_PRIOR``: launched as a programmatic dependent of the stream's
    previous kernel, the program reads only the plan's work rows before that kernel's results are complete and
    visible; ``KEYS_AHEAD``, keys of its first item asked of L2 before that (``_prefetch_first_keys``)."""
    if EARLY_MERGE:
        gdc_launch_dependents()
    if KEYS_AHEAD > 0 and not INTERPRET:
        _prefetch_first_keys(work, items_stride, item_counts, cache, block_table, stride_bt, PAGE_SIZE,
                             BYTES_PER_TOKEN, KEYS_AHEAD)
    table, items = _program_items(work, items_stride, item_counts, INTERPRET, WAIT_PRIOR)
    for i in range(items):
        _attend_item(
            q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, _item_fields(table + i * ITEM_FIELDS),
            out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, nope_scale, out_scale, num_heads,
            LAYOUT, BYTES_PER_TOKEN, PAGE_SIZE, TILE_SCALES, SCALE_NOPE, BLOCK_M, BLOCK_N, HEADS_AS_N, INTERPRET,
            REREAD, KEEP_PARTIALS)


@triton.jit
def _program_items(work, items_stride, item_counts, INTERPRET: tl.constexpr, WAIT_PRIOR: tl.constexpr):
    """This program's work-item rows (``ITEM_FIELDS`` int32 each) and their count, the first row requested into L1
    beside the count (``PREFETCH_L1``; the interpreter has no inline assembly); then, under ``WAIT_PRIOR``, the wait
    for the stream's previous kernel: the plan's work rows are all a program reads before it."""
    program = tl.program_id(0)
    table = work + program.to(tl.int64) * items_stride
    if not INTERPRET:
        tl.inline_asm_elementwise(PREFETCH_L1, "=r,l", [table], dtype=tl.int32, is_pure=False, pack=1)
    items = tl.load(item_counts + program)
    if WAIT_PRIOR:
        gdc_wait()
    return table, items


@triton.constexpr_function
def _pages_ahead(keys_ahead, page_size):
    """The pages that ``keys_ahead`` keys from any start can touch, rounded up to a power of two (a vector's
    length)."""
    return triton.next_power_of_2(-(-(keys_ahead - 1) // page_size) + 1)


@triton.jit
def _prefetch_first_keys(work, items_stride, item_counts, cache, block_table, stride_bt, PAGE_SIZE: tl.constexpr,
                         ROW_BYTES: tl.constexpr, KEYS_AHEAD: tl.constexpr):
    """Ask L2 for the first ``KEYS_AHEAD`` keys of the program's first item (a bulk request per page), before the
    wait for the stream's previous kernel, whose end the first copy would otherwise wait for. That kernel may still
    write the block table and the cache: the request is a hint, its entries read past L1 (``.cg``) so that no line
    read before the wait is served after it, and a negative entry asks for nothing (a bulk prefetch of an address
    outside any allocation did not fault on an H100, NOTES.md session 45)."""
    program = tl.program_id(0)
    row = work + program.to(tl.int64) * items_stride
    request = tl.load(row)
    kv_start = tl.load(row + 2)
    kv_end = tl.load(row + 3)
    live = (tl.load(item_counts + program) > 0) & (kv_start < kv_end)
    PAGES: tl.constexpr = _pages_ahead(KEYS_AHEAD, PAGE_SIZE)
    page = tl.arange(0, PAGES)
    page_start = (kv_start // PAGE_SIZE + page) * PAGE_SIZE
    lo = tl.maximum(kv_start, page_start)
    hi = tl.minimum(tl.minimum(kv_end, page_start + PAGE_SIZE), kv_start + KEYS_AHEAD)
    ask = live & (lo < hi)
    entry = tl.load(block_table + request.to(tl.int64) * stride_bt + kv_start // PAGE_SIZE + page, mask=ask,
                    other=-1, cache_modifier=".cg")
    nbytes = (hi - lo) * ROW_BYTES * (ask & (entry >= 0)).to(tl.int32)
    first = cache + (entry.to(tl.int64) * PAGE_SIZE + lo % PAGE_SIZE) * ROW_BYTES
    asking = tl.full([PAGES], PAGES, tl.int32)  # the threads that ask: one per page
    tl.inline_asm_elementwise(FIRST_KEYS_PREFETCH, "=r,l,r,r", [first, nbytes, asking], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _item_fields(row):
    """A work item's row (``decode.ITEM_COLUMNS``) as a tuple of scalars: one load each, so that the compiler knows
    them uniform across the program (a vector load reduced to scalars is not, and costs registers)."""
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), tl.load(row + 5),
            tl.load(row + 6))


@triton.jit
def _attend_item(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, fields,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, nope_scale, out_scale, num_heads,
    LAYOUT: tl.constexpr, BYTES_PER_TOKEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TILE_SCALES: tl.constexpr, SCALE_NOPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_AS_N: tl.constexpr, INTERPRET: tl.constexpr,
    REREAD: tl.constexpr, KEEP_PARTIALS: tl.constexpr,
):
    """One work item: a block of query rows of one request over one range of its keys."""
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = fields

    # Query rows of this item: (token, head) pairs of the request, head fastest.
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * num_heads
    token = q_first + rows // num_heads
    head = rows % num_heads
    # Each row sees keys [kv_start, limit): its causal frontier, clipped to this item's range.
    limit = tl.minimum(tl.load(visible + token, mask=row_ok, other=0), kv_end)

    q_row = (q + token.to(tl.int64) * stride_qt + head * stride_qh)[:, None]
    q0 = tl.load(q_row + 0 * TILE + tl.arange(0, TILE)[None, :], mask=row_ok[:, None], other=0.0)
    q1 = tl.load(q_row + 1 * TILE + tl.arange(0, TILE)[None, :], mask=row_ok[:, None], other=0.0)
    q2 = tl.load(q_row + 2 * TILE + tl.arange(0, TILE)[None, :], mask=row_ok[:, None], other=0.0)
    q3 = tl.load(q_row + 3 * TILE + tl.arange(0, TILE)[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + NOPE + tl.arange(0, ROPE)[None, :], mask=row_ok[:, None], other=0.0)
    # fp8 layouts and nvfp4 decoded once: float16 products (see _latent_tile), the query scaled by a power of two
    # per row into float16's range (_pow2_scales), the scores scaled back with the softmax scale.
    ONCE: tl.constexpr = not REREAD
    F16: tl.constexpr = (LAYOUT == "fp8_e4m3" or LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2"
                         or LAYOUT == "nvfp4") and ONCE
    if F16:
        up, down = _pow2_scales(q0, q1, q2, q3, q_rope)
        row_scale = qk_scale * down
        q0 = (q0 * up[:, None]).to(tl.float16)
        q1 = (q1 * up[:, None]).to(tl.float16)
        q2 = (q2 * up[:, None]).to(tl.float16)
        q3 = (q3 * up[:, None]).to(tl.float16)
        if LAYOUT == "fp8_e4m3":
            q_rope = (q_rope * up[:, None]).to(tl.float16)
        else:  # fp8_ds_mla and nvfp4 keep a bf16 rope: scaled by a power of two, exactly
            q_rope = _to_bf16(q_rope * up[:, None], INTERPRET)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the log2-scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp2(score - m_i)
    if HEADS_AS_N:
        zero_s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc0 = tl.zeros([TILE, BLOCK_M], tl.float32)
    else:
        zero_s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc0 = tl.zeros([BLOCK_M, TILE], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    unit = tl.full([], 1.0, tl.float32)  # the accumulators' unit: fp8_ds_mla's grows from 0 (see the value products)
    if TILE_SCALES and F16:
        unit = tl.full([], 0.0, tl.float32)
    pages = block_table + request.to(tl.int64) * stride_bt
    # bf16 tiles serve both products from one shared-memory buffer, and so do quantized tiles decoded once (the
    # default). With REREAD, quantized tiles are read a second time for the values (an L2 hit: kept there by the
    # first read) and decoded again in the operand layout the product needs (fewer registers: 64-row fp8_ds_mla).
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        base = _token_base(cache, pages, start, offs_n, n_ok, kv_end, PAGE_SIZE, BLOCK_N, BYTES_PER_TOKEN, INTERPRET)
        row = base[:, None]
        keep: tl.constexpr = "evict_last" if REREAD else ""
        k0 = _latent_tile(row, 0, n_ok, LAYOUT, keep, ONCE, INTERPRET)
        k1 = _latent_tile(row, 1, n_ok, LAYOUT, keep, ONCE, INTERPRET)
        k2 = _latent_tile(row, 2, n_ok, LAYOUT, keep, ONCE, INTERPRET)
        k3 = _latent_tile(row, 3, n_ok, LAYOUT, keep, ONCE, INTERPRET)
        k_rope = _rope_tile(row, n_ok, LAYOUT, ONCE, INTERPRET)

        if TILE_SCALES:  # fp8_ds_mla: exact fp8 products, then each tile's fp32 scale per key
            c0 = _tile_scale(base, 0, n_ok)
            c1 = _tile_scale(base, 1, n_ok)
            c2 = _tile_scale(base, 2, n_ok)
            c3 = _tile_scale(base, 3, n_ok)
            s = _qk(q0, k0, zero_s, HEADS_AS_N, INTERPRET) * _per_key(c0, HEADS_AS_N)
            s += _qk(q1, k1, zero_s, HEADS_AS_N, INTERPRET) * _per_key(c1, HEADS_AS_N)
            s += _qk(q2, k2, zero_s, HEADS_AS_N, INTERPRET) * _per_key(c2, HEADS_AS_N)
            s += _qk(q3, k3, zero_s, HEADS_AS_N, INTERPRET) * _per_key(c3, HEADS_AS_N)
        else:
            s = _qk(q0, k0, zero_s, HEADS_AS_N, INTERPRET)
            s = _qk(q1, k1, s, HEADS_AS_N, INTERPRET)
            s = _qk(q2, k2, s, HEADS_AS_N, INTERPRET)
            s = _qk(q3, k3, s, HEADS_AS_N, INTERPRET)
        if SCALE_NOPE:  # nvfp4: the layer scale multiplies the latent values, not the rope
            s = s * nope_scale
        s = _qk(q_rope, k_rope, s, HEADS_AS_N, INTERPRET)
        if HEADS_AS_N:
            s = tl.trans(s)

        if F16:
            s = s * row_scale[:, None]
        else:  # a scalar: a per-row vector here cost 64-row page-1 blocks 25% (NOTES.md, round 5)
            s = s * qk_scale
        s = tl.where(offs_n[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if REREAD:
            k0 = _latent_tile(row, 0, n_ok, LAYOUT, "evict_first", ONCE, INTERPRET)
            k1 = _latent_tile(row, 1, n_ok, LAYOUT, "evict_first", ONCE, INTERPRET)
            k2 = _latent_tile(row, 2, n_ok, LAYOUT, "evict_first", ONCE, INTERPRET)
            k3 = _latent_tile(row, 3, n_ok, LAYOUT, "evict_first", ONCE, INTERPRET)
        if TILE_SCALES and F16:
            # float16 cannot hold every P * c (a scale may exceed its range): the accumulators are kept in units of
            # the largest scale seen so far, which only grows (like the running max of the scores), and P * c is
            # divided by it, into [-1, 1].
            c_step = tl.max(tl.maximum(tl.maximum(tl.abs(c0), tl.abs(c1)), tl.maximum(tl.abs(c2), tl.abs(c3))), 0)
            unit_new = tl.where(tl.maximum(unit, c_step) > 0.0, tl.maximum(unit, c_step), 1.0)
            alpha = alpha * (unit / unit_new)
            acc0 = _pv(acc0, alpha, (p * (c0 / unit_new)[None, :]).to(tl.float16), k0, HEADS_AS_N, INTERPRET)
            acc1 = _pv(acc1, alpha, (p * (c1 / unit_new)[None, :]).to(tl.float16), k1, HEADS_AS_N, INTERPRET)
            acc2 = _pv(acc2, alpha, (p * (c2 / unit_new)[None, :]).to(tl.float16), k2, HEADS_AS_N, INTERPRET)
            acc3 = _pv(acc3, alpha, (p * (c3 / unit_new)[None, :]).to(tl.float16), k3, HEADS_AS_N, INTERPRET)
            unit = unit_new
        elif TILE_SCALES:
            acc0 = _pv(acc0, alpha, _to_bf16(p * c0[None, :], INTERPRET), k0, HEADS_AS_N, INTERPRET)
            acc1 = _pv(acc1, alpha, _to_bf16(p * c1[None, :], INTERPRET), k1, HEADS_AS_N, INTERPRET)
            acc2 = _pv(acc2, alpha, _to_bf16(p * c2[None, :], INTERPRET), k2, HEADS_AS_N, INTERPRET)
            acc3 = _pv(acc3, alpha, _to_bf16(p * c3[None, :], INTERPRET), k3, HEADS_AS_N, INTERPRET)
        elif F16:
            p = p.to(tl.float16)
            acc0 = _pv(acc0, alpha, p, k0, HEADS_AS_N, INTERPRET)
            acc1 = _pv(acc1, alpha, p, k1, HEADS_AS_N, INTERPRET)
            acc2 = _pv(acc2, alpha, p, k2, HEADS_AS_N, INTERPRET)
            acc3 = _pv(acc3, alpha, p, k3, HEADS_AS_N, INTERPRET)
        else:
            p = _to_bf16(p, INTERPRET)
            acc0 = _pv(acc0, alpha, p, k0, HEADS_AS_N, INTERPRET)
            acc1 = _pv(acc1, alpha, p, k1, HEADS_AS_N, INTERPRET)
            acc2 = _pv(acc2, alpha, p, k2, HEADS_AS_N, INTERPRET)
            acc3 = _pv(acc3, alpha, p, k3, HEADS_AS_N, INTERPRET)

    seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    out_row = out + token.to(tl.int64) * stride_ot + head * stride_oh
    part = slot_out.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    part_row = part_out + part * NOPE
    if slot_out < 0:  # the item covers its rows' whole range: the final result
        inv_l = tl.where(seen, out_scale * unit / tl.where(seen, l_i, 1.0), 0.0)
        _store_tile(_finish(acc0, inv_l, HEADS_AS_N), 0, out_row, part_row, row_ok, True, INTERPRET, "")
        _store_tile(_finish(acc1, inv_l, HEADS_AS_N), 1, out_row, part_row, row_ok, True, INTERPRET, "")
        _store_tile(_finish(acc2, inv_l, HEADS_AS_N), 2, out_row, part_row, row_ok, True, INTERPRET, "")
        _store_tile(_finish(acc3, inv_l, HEADS_AS_N), 3, out_row, part_row, row_ok, True, INTERPRET, "")
        tl.store(lse + token.to(tl.int64) * stride_lt + head, lse2 * LN2, mask=row_ok)
    else:  # one split of several: normalized partial, merged by _merge_splits_kernel
        inv_l = tl.where(seen, unit / tl.where(seen, l_i, 1.0), 0.0)
        partial_policy: tl.constexpr = "evict_last" if KEEP_PARTIALS else ""
        _store_tile(_finish(acc0, inv_l, HEADS_AS_N), 0, out_row, part_row, row_ok, False, INTERPRET, partial_policy)
        _store_tile(_finish(acc1, inv_l, HEADS_AS_N), 1, out_row, part_row, row_ok, False, INTERPRET, partial_policy)
        _store_tile(_finish(acc2, inv_l, HEADS_AS_N), 2, out_row, part_row, row_ok, False, INTERPRET, partial_policy)
        _store_tile(_finish(acc3, inv_l, HEADS_AS_N), 3, out_row, part_row, row_ok, False, INTERPRET, partial_policy)
        tl.store(part_lse + part, lse2, eviction_policy=partial_policy)


@triton.jit
def _merged_partials(part_out, part_lse, first, count, local, cols, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr,
                     EVICT: tl.constexpr):
    """LSE merge of a group's partials (workspace slots ``first .. first + count``) for the rows ``local`` of its
    row block and the output columns ``cols``, ``SPLITS`` partials per step with independent loads (one step for
    up to ``SPLITS`` splits; a long list is not a chain of memory latencies). Returns ``(sum_i w_i o_i, sum_i w_i,
    m)`` with ``w_i = 2^(lse_i - m)`` and ``m`` the largest log2-sum-exp. ``EVICT``: the loads' L2 eviction policy."""
    rows: tl.constexpr = local.shape[0]
    m = tl.full([rows], float("-inf"), tl.float32)
    total = tl.zeros([rows], tl.float32)
    acc = tl.zeros([rows, cols.shape[0]], tl.float32)
    for i in range(0, count, SPLITS):
        split = i + tl.arange(0, SPLITS)
        ok = split < count
        at = (first + split).to(tl.int64)[:, None] * BLOCK_M + local[None, :]
        lse_i = tl.load(part_lse + at, mask=ok[:, None], other=float("-inf"), eviction_policy=EVICT)
        o = tl.load(part_out + (at * NOPE)[:, :, None] + cols[None, None, :], mask=ok[:, None, None], other=0.0,
                    eviction_policy=EVICT)
        m_new = tl.maximum(m, tl.max(lse_i, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split saw a key yet: weights stay 0
        alpha = tl.math.exp2(m - m_use)
        w = tl.math.exp2(lse_i - m_use[None, :])
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    return acc, total, m


@triton.jit
def _merge_splits_kernel(
    groups,                             # [num_groups, 5] int32: row block, first slot, slots, first token, tokens
    part_out, part_lse,                 # as written by _decode_split_kernel
    out, stride_ot, stride_oh,
    lse, stride_lt,
    out_scale, num_heads,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, SPLITS: tl.constexpr,
    INTERPRET: tl.constexpr, EARLY_MERGE: tl.constexpr, KEEP_PARTIALS: tl.constexpr, RELEASE_NEXT: tl.constexpr,
):
    """Merge one group's splits by their LSE for ``ROWS`` rows and ``COLS`` output columns (``_merged_partials``).
    ``EARLY_MERGE``: launched before the split kernel finished (programmatic dependent launch): the group's row is
    read first, then the program waits until the split kernel's writes are complete and visible. ``KEEP_PARTIALS``:
    the partials were kept in L2 for this read, their only one, after which their lines go first (``evict_first``).
    ``RELEASE_NEXT``: let the stream's next kernel, if a programmatic dependent, start now (it waits for this grid's
    results on the device)."""
    if RELEASE_NEXT:
        gdc_launch_dependents()
    group = tl.program_id(0)
    row_block = tl.load(groups + group * 5)
    first = tl.load(groups + group * 5 + 1)
    count = tl.load(groups + group * 5 + 2)
    q_first = tl.load(groups + group * 5 + 3)
    q_len = tl.load(groups + group * 5 + 4)
    local = tl.program_id(1) * ROWS + tl.arange(0, ROWS)      # rows within the row block
    cols = tl.program_id(2) * COLS + tl.arange(0, COLS)
    rows = row_block * BLOCK_M + local
    row_ok = rows < q_len * num_heads
    token = q_first + rows // num_heads
    head = rows % num_heads
    out_row = out + token.to(tl.int64) * stride_ot + head * stride_oh
    if EARLY_MERGE:
        gdc_wait()
    partial_evict: tl.constexpr = "evict_first" if KEEP_PARTIALS else ""
    acc, total, m = _merged_partials(part_out, part_lse, first, count, local, cols, BLOCK_M, SPLITS, partial_evict)
    seen = total != 0.0  # rows that saw nothing (a NaN stays NaN) get out 0 and lse -inf
    o = acc * tl.where(seen, out_scale / tl.where(seen, total, 1.0), 0.0)[:, None]
    tl.store(out_row[:, None] + cols[None, :], _to_bf16(o, INTERPRET), mask=row_ok[:, None])
    if tl.program_id(2) == 0:
        lse_row = tl.where(seen, m + tl.math.log2(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(lse + token.to(tl.int64) * stride_lt + head, lse_row * LN2, mask=row_ok)
