"""Sparse top-k attention over an ``fp8_ds_mla`` cache in Gluon, for Hopper: 64 heads of one token per program,
over its whole index list or one piece of it (``sparse_kernel.index_splits``; ``merge_parts`` merges the pieces).

The Triton kernel (``sparse_kernel``) reads these layouts exactly but spends its step in a serial chain Triton
does not let it shorten (NOTES.md, part 2): every product waited for, the score tile computed by both warpgroups,
each FP8 tile passed through float32. Here, per step of 64 indices:

- the rows' bytes are copied with ``cp.async`` (masked: invalid indices become zeros): the 512 e4m3 codes into
  one buffer, the four float32 scales and the 64 bf16 rope values into two stages; the copies of step ``j + 1``
  are issued as soon as step ``j``'s codes are decoded, and run behind its products, and its rows were requested
  into L2 at the start of step ``j`` (the program's indices at its start);
- the codes are decoded once, e4m3 -> float16 (one instruction per two values, exact), into a swizzled buffer
  both products read;
- warpgroup ``w`` computes the scores of keys ``[32 w, 32 w + 32)``: the rope product in bf16 and the four
  128-column code products in float16, each code product scaled by its tile's per-key scale in float32 as it
  completes (the scale is never rounded into a key);
- the probabilities of each value tile, ``P * scale_t / u``, go to shared memory in float16, and warpgroup ``w``
  multiplies them by its 64 of each 128 value columns.

Power-of-two scales (``fp8_ds_mla_pow2``, ``PER_KEY``) take one scale per key instead, as exactly: each key's
largest tile scale, the codes decoded times each tile's ratio to it (a power of two: exact in float16 for tiles
within 2^15 of the key's largest), the code products summed before that scale multiplies them, and one P buffer
(``P * scale / u``) for the four value tiles. Non-power-of-two ratios would round the keys to float16: on the bench's
problems that cost up to 2.6e-3 of the 5e-3 lse bound (NOTES.md, session 30), so ``fp8_ds_mla`` keeps its tiles.

Float16 needs two units (NOTES.md, round 3): each query row is scaled by a power of two into ``[2^13, 2^14)``
(exact), and the value accumulators are in units of ``u``, the largest tile scale seen so far (it only grows,
like the running maximum of the scores).

The grid runs a token's head blocks next to each other, so the second block's copies find the rows in L2.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from impls.triton.decode_kernel import LN2, ROPE, TILE
from impls.triton.decode_wgmma import (COPY_LAYOUT, OUT_LAYOUT, SCORE_LAYOUT, SWIZZLED, _async_load, _cta_barrier,
                                       _store_out)

HEADS = gl.constexpr(64)       # heads per program
KEYS = gl.constexpr(64)        # indices per step
ROW_BYTES = gl.constexpr(656)  # fp8_ds_mla: 512 e4m3 | 4 float32 scales | 64 bf16 rope
SCALES_AT = gl.constexpr(512)
ROPE_AT = gl.constexpr(528)

# Codes: 16 bytes per thread, a warp covers 4 rows of a 128-column tile. Scales: one per thread, [4 tiles, 64 keys].
CODE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[8, 1],
                                            order=[1, 0]))
# Decoding a code tile: 8 bytes per thread, so that each 16-byte float16 chunk a thread stores lies in another bank
# group than its quarter-warp's other seven (from 16 bytes, two chunks 128 bytes apart shared each group).
DECODE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[8, 1],
                                              order=[1, 0]))
SCALE_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 8],
                                             order=[1, 0]))
# Every warp holds all of a step's scales, so their maximum needs no exchange between warps.
ALL_SCALES_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                  warps_per_cta=[1, 8], order=[1, 0]))
# L2 prefetch of a step's rows: 8 byte offsets per row cover every 128-byte line a 656-byte row touches.
LINES_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4], warps_per_cta=[8, 1],
                                             order=[1, 0]))
PLAIN = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))

QUERY_TOP = gl.constexpr(13)  # query rows are scaled into [2^QUERY_TOP, 2^(QUERY_TOP + 1)): float16 holds them exactly


@gluon.jit
def _pow2(biased_exponent):
    """2^(e - 127) for an int32 biased exponent e in [1, 254], exactly."""
    return (biased_exponent << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _stage_query(base, ok, q_nope, q_rope, LAYOUT: gl.constexpr, OPERAND_ORDER: gl.constexpr = False,
                 FIRST: gl.constexpr = 0, LAST: gl.constexpr = 4, WORD_ORDER: gl.constexpr = False):
    """Store query rows to shared memory (``base``: each row's first element along ``SliceLayout(1, LAYOUT)``; rows
    not ``ok`` become zeros), the 512 latent columns in float16 scaled per row by a power of two and the rope
    columns as they are; returns the factor that undoes the scaling, per row. ``OPERAND_ORDER``: the columns in the
    contraction order of ``decode_rs_fp8``'s register operands (``_operand_order``: e4m3 latent, bf16 rope).
    ``FIRST``, ``LAST``: only latent tiles ``[FIRST, LAST)`` (scaled as all four are), and the rope only where
    ``q_rope`` is given (``decode_rs_fp8``'s two scoring warpgroups stage their own tiles). ``WORD_ORDER``: the
    latent columns of each group of eight first in ``_word_order`` (decode_rs_fp8's nvfp4 operands)."""
    rows = base[:, None]
    mask = ok[:, None]
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, LAYOUT))[None, :]
    amax = gl.full([base.shape[0]], 2.0 ** -100, gl.float32, gl.SliceLayout(1, LAYOUT))  # padded rows stay finite
    for t in gl.static_range(4):
        x = gl.load(rows + t * TILE + cols, mask=mask, other=0.0).to(gl.float32)
        amax = gl.maximum(amax, gl.max(gl.abs(x), 1))
    exponent = (amax.to(gl.int32, bitcast=True) >> 23) & 255  # biased: amax in [2^(e-127), 2^(e-126))
    up = _pow2(127 + QUERY_TOP + 127 - exponent)[:, None]
    for t in gl.static_range(FIRST, LAST):
        x = gl.load(rows + t * TILE + cols, mask=mask, other=0.0).to(gl.float32)
        x = (x * up).to(gl.float16)
        if WORD_ORDER:
            x = _word_order(x)
        q_nope[t].store(_operand_order(x, 16) if OPERAND_ORDER else x)
    if q_rope is not None:
        rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LAYOUT))[None, :]
        r = gl.load(rows + 4 * TILE + rope_cols, mask=mask, other=0.0)
        q_rope.store(_operand_order(r, 8) if OPERAND_ORDER else r)
    return _pow2(exponent - QUERY_TOP)


@gluon.jit
def _operand_order(x, CHUNK: gl.constexpr):
    """Rows of cache-ordered columns -> the contraction order in which a thread's ``CHUNK`` contiguous columns (16
    bytes of the cache, loaded at once) are exactly its wgmma register-operand fragment: a quad's four threads
    hold consecutive chunks, the operand wants column pairs spread over the quad (``decode_rs_fp8``)."""
    n: gl.constexpr = x.shape[1]
    x = x.reshape([x.shape[0], n // (4 * CHUNK), 4, CHUNK // 2, 2]).permute((0, 1, 3, 2, 4))
    return x.reshape([x.shape[0], n])


@gluon.jit
def _word_order(x):
    """Rows of columns -> each group of eight (a packed word of e2m1 codes) as its even columns, then its odd ones:
    the order in which decode_rs_fp8 decodes an nvfp4 word (low nibbles, then high) with no byte permute."""
    n: gl.constexpr = x.shape[1]
    return x.reshape([x.shape[0], n // 8, 4, 2]).permute((0, 1, 3, 2)).reshape([x.shape[0], n])


@gluon.jit
def _indices(idx_row, first, topk, LAYOUT: gl.constexpr):
    """Indices ``first .. first + 64`` of the program's list (-1 past its ``topk``), along the keys of ``LAYOUT``."""
    offs = first + gl.arange(0, KEYS, layout=LAYOUT)
    return gl.load(idx_row + offs, mask=offs < topk, other=-1)


@gluon.jit
def _valid(idx, num_rows):
    """FlashMLA's rule: an index is valid iff ``0 <= idx < num_rows``."""
    return (idx >= 0) & (idx < num_rows)


@gluon.jit
def _row_bytes(rows, idx, num_rows):
    """The first byte of each index's row, and whether the index is valid; invalid indices point at row 0 and are
    copied as zeros."""
    ok = _valid(idx, num_rows)
    return rows + gl.where(ok, idx, 0).to(gl.int64) * ROW_BYTES, ok


@gluon.jit
def _prefetch_l2(ptrs):
    """Request the lines holding ``ptrs`` into L2 (a hint: nothing waits for it)."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _prefetch_row_lines(first_bytes, ROW_BYTES: gl.constexpr):
    """Request into L2 every line of the ``ROW_BYTES``-byte rows starting at ``first_bytes`` (along the rows of a
    layout like ``LINES_LAYOUT``: up to eight lines of a row across its second dimension)."""
    LINES: gl.constexpr = gl.SliceLayout(0, first_bytes.type.layout.parent)
    lines = gl.minimum(gl.arange(0, 8, layout=LINES) * 128, ROW_BYTES - 1)
    _prefetch_l2(first_bytes[:, None] + lines[None, :])


@gluon.jit
def _prefetch_rows(rows, idx, num_rows):
    """Request into L2 every line of the rows that ``idx`` (``_indices`` along ``LINES_LAYOUT``'s rows) name."""
    base, ok = _row_bytes(rows, idx, num_rows)
    _prefetch_row_lines(base, ROW_BYTES)


@gluon.jit
def _copy_step(rows, num_rows, idx_codes, idx_scales, idx_rope, codes, scales, rope, stage):
    """Issue the copies of a step's rows named by indices (``_indices`` along each copy's keys)."""
    code_rows, code_ok = _row_bytes(rows, idx_codes, num_rows)
    scale_rows, scale_ok = _row_bytes(rows, idx_scales, num_rows)
    rope_rows, rope_ok = _row_bytes(rows, idx_rope, num_rows)
    _copy_rows_of_step(code_rows, code_ok, scale_rows, scale_ok, rope_rows, rope_ok, codes, scales, rope, stage)


@gluon.jit
def _copy_rows_of_step(code_rows, code_ok, scale_rows, scale_ok, rope_rows, rope_ok, codes, scales, rope, stage):
    """Issue the copies of a step's 656-byte rows (each row's first byte along the keys of ``CODE_LAYOUT``,
    ``SCALE_LAYOUT`` and ``COPY_LAYOUT``; rows not ok become zeros): codes into ``codes``, scales and rope into
    stage ``stage``."""
    _copy_codes(code_rows, code_ok, codes)
    tiles = gl.arange(0, 4, layout=gl.SliceLayout(1, SCALE_LAYOUT))[:, None]
    _async_load(scales.index(stage), (scale_rows + SCALES_AT).to(gl.pointer_type(gl.float32))[None, :] + tiles,
                mask=scale_ok[None, :])
    _copy_bf16_rope(rope_rows + ROPE_AT, rope_ok, rope.index(stage))


@gluon.jit
def _copy_codes(code_rows, code_ok, codes):
    """Issue the copies of a step's 512 e4m3 codes (each row's first code along the keys of ``CODE_LAYOUT``; rows not
    ok become zeros) into the four tile buffers ``codes``."""
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, CODE_LAYOUT))[None, :]
    for t in gl.static_range(4):
        _async_load(codes[t], code_rows[:, None] + t * TILE + cols, mask=code_ok[:, None])


@gluon.jit
def _copy_bf16_rope(rope_first, rope_ok, buffer):
    """Issue the copies of a step's 64 bf16 rope values (each row's first rope byte along the keys of
    ``COPY_LAYOUT``; rows not ok become zeros) into ``buffer``."""
    rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, COPY_LAYOUT))[None, :]
    _async_load(buffer, rope_first.to(gl.pointer_type(gl.bfloat16))[:, None] + rope_cols, mask=rope_ok[:, None])


@gluon.jit
def _tiles(dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """Four shared buffers of ``shape``: one per 128-column tile."""
    return (gl.allocate_shared_memory(dtype, shape, layout), gl.allocate_shared_memory(dtype, shape, layout),
            gl.allocate_shared_memory(dtype, shape, layout), gl.allocate_shared_memory(dtype, shape, layout))


@gluon.jit
def _decode_tile(codes, keys, t: gl.constexpr):
    """Tile ``t`` of the step's codes, e4m3 -> float16 (exact), into the keys both products read."""
    c = codes[t].load(DECODE_LAYOUT)
    keys[t].store(c.to(gl.float8e4nv, bitcast=True).to(gl.float16))


@gluon.jit
def _decode_scaled_tile(codes, keys, t: gl.constexpr, ratio):
    """``_decode_tile`` times each key's ``ratio`` (float16 ``[64, 1]`` along ``DECODE_LAYOUT``: the tile's scale
    over the key's, a power of two), exact for ratios down to 2^-15."""
    c = codes[t].load(DECODE_LAYOUT)
    keys[t].store(c.to(gl.float8e4nv, bitcast=True).to(gl.float16) * ratio)


@gluon.jit
def _key_scales(step_scales, key_scales):
    """Power-of-two per-key tile scales of a step (``[4, 64]``, as copied) -> each key's largest into
    ``key_scales`` (``[1, 64]``, the scale the products apply) and the four tiles' ratios to it in float16
    (``[64, 1]`` along ``DECODE_LAYOUT``; 0 where the largest is not positive: masked keys). A NaN tile scale makes
    its ratio NaN and stays in its key's values, as it stays in its product with ``_decode_tile``."""
    by_key = step_scales.permute((1, 0))
    s0 = by_key.slice(0, 1, 1).load(DECODE_LAYOUT)
    s1 = by_key.slice(1, 1, 1).load(DECODE_LAYOUT)
    s2 = by_key.slice(2, 1, 1).load(DECODE_LAYOUT)
    s3 = by_key.slice(3, 1, 1).load(DECODE_LAYOUT)
    largest = gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3))
    key_scales.permute((1, 0)).store(largest)
    per = gl.where(largest > 0.0, 1.0 / gl.where(largest > 0.0, largest, 1.0), 0.0)
    return (s0 * per).to(gl.float16), (s1 * per).to(gl.float16), (s2 * per).to(gl.float16), (s3 * per).to(gl.float16)


@gluon.jit
def _step_buffers(ROWS: gl.constexpr, PER_KEY: gl.constexpr):
    """The shared memory of the step for ``ROWS`` query rows: the query (float16 latent tiles, bf16 rope), the codes,
    two stages of tile scales and rope, the key scales (``PER_KEY``), the decoded keys and P (``PER_KEY``: one buffer
    for the four value tiles). One buffer per 128-column tile, not one buffer of four: Triton orders every two
    accesses to one buffer with a barrier, so four tiles in one buffer cost a barrier between each tile's copy, decode
    and store."""
    q_nope = _tiles(gl.float16, [ROWS, TILE], SWIZZLED)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [ROWS, ROPE], SWIZZLED)
    codes = _tiles(gl.uint8, [KEYS, TILE], PLAIN)
    scales = gl.allocate_shared_memory(gl.float32, [2, 4, KEYS], PLAIN)
    rope = gl.allocate_shared_memory(gl.bfloat16, [2, KEYS, ROPE], SWIZZLED)
    keys = _tiles(gl.float16, [KEYS, TILE], SWIZZLED)
    # The key scales either way (a returned tuple holds no None); unused, the compiler drops them.
    key_scales = gl.allocate_shared_memory(gl.float32, [1, KEYS], PLAIN)
    if PER_KEY:
        probs = gl.allocate_shared_memory(gl.float16, [ROWS, KEYS], SWIZZLED)
    else:
        probs = _tiles(gl.float16, [ROWS, KEYS], SWIZZLED)
    return q_nope, q_rope, codes, scales, key_scales, rope, keys, probs


@gluon.jit
def _initial_state(ROWS: gl.constexpr):
    """The running state of ``ROWS`` query rows before any key: maximum, each warpgroup's sums, the unit ``u`` (the
    smallest normal float32, below any scale), a zero score tile and the four value accumulators."""
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, SCORE_LAYOUT))
    zero = gl.zeros([ROWS, KEYS], gl.float32, SCORE_LAYOUT)
    acc = gl.zeros([ROWS, TILE], gl.float32, OUT_LAYOUT)
    return m_i, zero, gl.to_tensor(2.0 ** -126), zero, acc, acc, acc, acc


@gluon.jit
def _wait_and_decode(q_rope, step_rope, codes, step_scales, key_scales, keys, zero, PER_KEY: gl.constexpr):
    """Wait for a step's copies, issue its rope scores (bf16; they run during the decode) and decode its codes into
    ``keys`` (``PER_KEY``: relative to each key's largest tile scale, ``_key_scales``, stored into ``key_scales``),
    visible to the tensor cores and the codes buffer free once this returns; returns the rope product."""
    async_copy.wait_group(0)
    hopper.fence_async_shared()
    _cta_barrier()
    s_rope = hopper.warpgroup_mma(q_rope, step_rope.permute((1, 0)), zero, use_acc=False, is_async=True)
    if PER_KEY:
        r0, r1, r2, r3 = _key_scales(step_scales, key_scales)
        _decode_scaled_tile(codes, keys, 0, r0)
        _decode_scaled_tile(codes, keys, 1, r1)
        _decode_scaled_tile(codes, keys, 2, r2)
        _decode_scaled_tile(codes, keys, 3, r3)
    else:
        for t in gl.static_range(4):  # decode once: e4m3 -> float16 is exact
            _decode_tile(codes, keys, t)
    hopper.fence_async_shared()
    _cta_barrier()
    return s_rope


@gluon.jit
def _scores(s_rope, q_nope, keys, step_scales, q_down, qk_scale, zero):
    """A step's scores in log2 units: the rope product ``s_rope`` (issued) plus the four code tiles' products, each
    scaled by its per-key float32 scale as it completes (``step_scales`` ``[4, 64]``; ``[1, 64]``: one scale per key,
    on their sum; None: codes without scales), the query rows' factor ``q_down`` undone."""
    PER_TILE: gl.constexpr = step_scales is not None and step_scales.shape[0] == 4
    part = hopper.warpgroup_mma(q_nope[0], keys[0].permute((1, 0)), zero, use_acc=False, is_async=True)
    s_rope = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[s_rope])
    nope = zero
    for t in gl.static_range(4):
        if t < 3:
            following = hopper.warpgroup_mma(q_nope[t + 1], keys[t + 1].permute((1, 0)), zero,
                                             use_acc=False, is_async=True)
            part = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[part])
        else:
            part = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[part])
        if PER_TILE:
            nope = nope + part * step_scales.slice(t, 1).load(SCORE_LAYOUT)
        else:
            nope = nope + part
        if t < 3:
            part = following
    if step_scales is not None and not PER_TILE:
        nope = nope * step_scales.load(SCORE_LAYOUT)
    return (s_rope + nope * q_down[:, None]) * qk_scale


@gluon.jit
def _softmax_and_values(s, step_scales, probs, keys, m_i, l_part, unit, acc0, acc1, acc2, acc3):
    """The online softmax of a step's masked scores ``s`` and its value products: ``P * scale_t / u`` per tile in
    float16 (``u`` grows to the step's largest tile scale), warpgroup ``w`` taking 64 of each tile's 128 columns;
    ``step_scales`` ``[1, 64]`` (one scale per key): ``P * scale / u`` in one buffer ``probs`` for all four tiles;
    None (codes without scales): ``P`` there, ``u`` unchanged. Returns the running maximum, sums, unit and
    accumulators; every warp is done with ``keys`` and ``probs``."""
    m_new = gl.maximum(m_i, gl.max(s, 1))  # across both warpgroups (through shared memory)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    l_part = l_part * alpha[:, None] + p

    if step_scales is None:
        new_unit = unit
        p0, p1, p2, p3 = probs, probs, probs, probs
        probs.store(p.to(gl.float16))
    else:
        new_unit = gl.maximum(unit, gl.max(gl.max(step_scales.load(ALL_SCALES_LAYOUT), 1), 0))
        per_unit = 1.0 / new_unit
        if step_scales.shape[0] == 1:
            p0, p1, p2, p3 = probs, probs, probs, probs
            probs.store((p * (step_scales.load(SCORE_LAYOUT) * per_unit)).to(gl.float16))
        else:
            p0, p1, p2, p3 = probs
            for t in gl.static_range(4):
                weight = step_scales.slice(t, 1).load(SCORE_LAYOUT) * per_unit
                probs[t].store((p * weight).to(gl.float16))
        alpha = alpha * (unit * per_unit)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, OUT_LAYOUT))[:, None]
    hopper.fence_async_shared()
    _cta_barrier()
    acc0 = hopper.warpgroup_mma(p0, keys[0], acc0 * alpha_o, is_async=True)
    acc1 = hopper.warpgroup_mma(p1, keys[1], acc1 * alpha_o, is_async=True)
    acc2 = hopper.warpgroup_mma(p2, keys[2], acc2 * alpha_o, is_async=True)
    acc3 = hopper.warpgroup_mma(p3, keys[3], acc3 * alpha_o, is_async=True)
    acc0, acc1, acc2, acc3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1, acc2, acc3])
    _cta_barrier()  # both warpgroups are done with the decoded keys and P
    return m_new, l_part, new_unit, acc0, acc1, acc2, acc3


@gluon.jit
def _sparse_kernel_wgmma(q, stride_qt, stride_qh, idx, stride_it, rows, num_rows, topk,
                         out, stride_ot, stride_oh, lse, stride_lt, stride_lh, qk_scale, num_heads,
                         chunk, stride_os, stride_ls, PER_KEY: gl.constexpr):
    """Program (64-head block, token, piece): ``out``/``lse`` of those heads over the token's indices ``[piece *
    chunk, piece * chunk + chunk)`` (of ``topk``) into ``rows`` (uint8 ``[num_rows, 656]``); ``qk_scale`` is the
    softmax scale times log2(e); ``PER_KEY``: the scales are powers of two (``fp8_ds_mla_pow2``), one per key. A
    piece's out and lse lie ``stride_os`` and ``stride_ls`` past the one before (cut lists: float32 partials for
    ``merge_parts``; a whole list is the one piece, ``chunk`` >= ``topk``). ``topk`` >= 1: ``sparse_mqa`` writes a
    top-k of 0 itself; a piece past the list's end sees no key (out 0, lse -inf)."""
    q_nope, q_rope, codes, scales, key_scales, rope, keys, probs = _step_buffers(HEADS, PER_KEY)

    token = gl.program_id(1).to(gl.int64)  # a token's head blocks run side by side: the second reads its rows from L2
    head0 = gl.program_id(0) * HEADS
    piece = gl.program_id(2)
    idx_row = idx + token * stride_it + piece * chunk  # the piece's indices: a list of their own from here on
    topk = gl.maximum(gl.minimum(chunk, topk - piece * chunk), 0)
    out += piece.to(gl.int64) * stride_os
    lse += piece.to(gl.int64) * stride_ls
    for first in range(0, topk, 32 * 256):  # the piece's index list into L2: every later read of it is short
        at = gl.minimum(first + gl.arange(0, 256, layout=gl.BlockedLayout([1], [32], [8], [0])) * 32, topk - 1)
        _prefetch_l2(idx_row + at)

    CODE_KEYS: gl.constexpr = gl.SliceLayout(1, CODE_LAYOUT)
    SCALE_KEYS: gl.constexpr = gl.SliceLayout(0, SCALE_LAYOUT)
    ROPE_KEYS: gl.constexpr = gl.SliceLayout(1, COPY_LAYOUT)
    SCORE_KEYS: gl.constexpr = gl.SliceLayout(0, SCORE_LAYOUT)
    _copy_step(rows, num_rows, _indices(idx_row, 0, topk, CODE_KEYS), _indices(idx_row, 0, topk, SCALE_KEYS),
               _indices(idx_row, 0, topk, ROPE_KEYS), codes, scales, rope, 0)
    async_copy.commit_group()
    heads = head0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, COPY_LAYOUT))
    q_down = gl.convert_layout(  # staged behind the copies
        _stage_query(q + token * stride_qt + heads.to(gl.int64) * stride_qh, heads < num_heads, q_nope, q_rope,
                     COPY_LAYOUT), gl.SliceLayout(1, SCORE_LAYOUT))

    m_i, l_part, unit, zero, acc0, acc1, acc2, acc3 = _initial_state(HEADS)
    ahead = _indices(idx_row, KEYS, topk, gl.SliceLayout(1, LINES_LAYOUT))
    for j in range(gl.cdiv(topk, KEYS)):
        stage = j % 2
        first = j * KEYS
        # The next step's indices are read now; their latency hides behind this step.
        next_codes = _indices(idx_row, first + KEYS, topk, CODE_KEYS)
        next_scales = _indices(idx_row, first + KEYS, topk, SCALE_KEYS)
        next_rope = _indices(idx_row, first + KEYS, topk, ROPE_KEYS)
        # The rows of the next step into L2 (their copies are issued after this step's decode), through indices
        # read one step earlier: nothing waits for a load here.
        _prefetch_rows(rows, ahead, num_rows)
        ahead = _indices(idx_row, first + 2 * KEYS, topk, gl.SliceLayout(1, LINES_LAYOUT))
        valid = _valid(_indices(idx_row, first, topk, SCORE_KEYS), num_rows)
        s_rope = _wait_and_decode(q_rope, rope.index(stage), codes, scales.index(stage), key_scales, keys, zero,
                                  PER_KEY)
        if first + KEYS < topk:
            _copy_step(rows, num_rows, next_codes, next_scales, next_rope, codes, scales, rope, 1 - stage)
        async_copy.commit_group()
        if PER_KEY:
            step_scales = key_scales
        else:
            step_scales = scales.index(stage)
        s = gl.where(valid[None, :], _scores(s_rope, q_nope, keys, step_scales, q_down, qk_scale, zero),
                     float("-inf"))
        m_i, l_part, unit, acc0, acc1, acc2, acc3 = _softmax_and_values(s, step_scales, probs, keys, m_i, l_part,
                                                                        unit, acc0, acc1, acc2, acc3)
    async_copy.wait_group(0)

    l_i = gl.sum(l_part, 1)
    seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
    lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    rows_s = head0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, SCORE_LAYOUT))
    gl.store(lse + token * stride_lt + rows_s * stride_lh, lse2 * LN2, mask=rows_s < num_heads)
    to_out = gl.where(seen, unit / gl.where(seen, l_i, 1.0), 0.0)
    rows_o = head0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, OUT_LAYOUT))
    _store_out(out + token * stride_ot + rows_o.to(gl.int64) * stride_oh,
               gl.arange(0, TILE, layout=gl.SliceLayout(0, OUT_LAYOUT)), rows_o < num_heads, acc0, acc1, acc2, acc3,
               gl.convert_layout(to_out, gl.SliceLayout(1, OUT_LAYOUT)))
