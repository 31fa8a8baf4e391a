"""The 16-row quantized decode split step in Gluon, for Hopper, warp-specialized: decoding beside the products.

``decode_wgmma_fp8`` and ``decode_mma_fp8`` run every phase of a 64-key step in the same warps, one after the
other (wait for the codes, decode, products, softmax, products), and measured bound by that chain, not by the bytes
or the tensor cores (NOTES.md, sessions 13-14). Here the phases run in two partitions (``gl.warp_specialize``):

- the decoder, 8 warps: loads a step's codes, rope and scales into registers one step ahead (the step after is
  requested into L2: in pages of whole steps, the fp8 layouts' rows in one bulk request), decodes the codes to float16
  (exact) and stores the step into one of two shared-memory stages, then signals the stage ``ready``. ``fp8_ds_mla``:
  e4m3 -> float16, the per-key tile scales stored beside; ``nvfp4``: inline PTX on packed words, each e2m1 value times
  its block's e4m3 scale (float16 holds the product exactly, as in ``decode_kernel._fp4_tile``); ``mxfp4_nsa``: the
  same PTX, each block's power-of-two scale split into the key's tile scale ``2^kmax`` (float32, stored beside as
  fp8_ds_mla's) and a float16 factor ``2^(k - kmax)`` (exact for blocks down to 2^-23 below the largest);
  ``fp4_mx16``: as mxfp4_nsa with two blocks a thread, and its FP4 rope decoded to bf16 (exact: float32 products
  rounded, ``decode_kernel``'s PTX); ``fp8_e4m3``: as fp8_ds_mla without tile scales, its e4m3 rope decoded to bf16
  (exact). Each tile has buffers of its own (no barrier between the tiles' stores) and a load layout whose float16
  stores are free of bank conflicts;
- the default partition, one warpgroup: for each ready stage, ``decode_wgmma_fp8``'s transposed products (``S^T =
  K Q^T`` with the 64 keys as wgmma's M, ``O^T += V^T P^T`` per 128-column value tile, in its float16 units), then
  signals the stage ``free``. A step's value products are issued after the next step's scores, so the tensor
  cores run them during that step's softmax; each warp reads all of a step's tile scales for their maximum (no
  exchange between warps). nvfp4's layer scale multiplies the query's unit and the final output.

Measured on an H200, 16 heads ctx4096 (NOTES.md, sessions 16, 18, 19 and 21), us. fp8_ds_mla against
``decode_mma_fp8`` (the default before): b32 65.7 -> 54.0, b64 112.5 -> 88.4, b128 209.1 -> 153.7, b64 ctx16384
404.3 -> 291.1; since session 21 it beats it at every batch and is the default at every size (``WS_MIN_KEYS_PER_SM``
is 0 for the fp8 layouts). The FP4 layouts against the Triton kernel: nvfp4 b64 91.9 ->
78.5, b128 170.8 -> 138.5; mxfp4_nsa b32 57.0 -> 50.2, b64 98.8 -> 83.8, b128 183.1 -> 148.6; fp4_mx16 b32 64.5 ->
51.7, b64 116.0 -> 91.6, b128 218.4 -> 162.0, b64 ctx16384 413.5 -> 308.2, page 1 b32 78.5 -> 53.7, b1 ctx8192
22.8 -> 19.6; fp8_e4m3 b32 55.5 -> 46.8, b64 98.8 -> 76.0, b128 182.4 -> 131.5, b64 ctx16384 350.0 -> 247.5, page 1
b32 69.8 -> 52.5. Session 19's steps at b64 (fp8_ds_mla / nvfp4 / mxfp4_nsa): conflict-free stores 102.5 -> 91.8 /
83.6 -> 80.5 / -, the products overlapped across steps - / 86.4 -> 83.6 / -, the scales' maximum without an
exchange between warps 92.0 -> 88.4 / 80.6 -> 78.5 / 89.7 -> 83.8 (ncu before the stores: the products waited for
the decoder at 78% of the steps, and the float16 stores took twice their ideal shared-memory wavefronts). Session
21's (fp8_ds_mla / fp8_e4m3): the bulk L2 prefetch and fp8_ds_mla's tile scales in one load a step, b32 52.3 ->
44.4 / 44.4 -> 41.0, b64 87.2 -> 77.0 / 74.5 -> 71.5, b128 154.2 -> 141.4 / -, b64 ctx16384 293.0 -> 270.5 / -. 32 rows
pass the same checks but are slower than ``decode_wgmma_fp8`` (110 against 80 us at 16 heads x 2 tokens b32,
session 18), which stays their kernel.

Same arguments, work items, partials and merge as ``decode_kernel._decode_split_kernel``; ``cache`` is the paged
cache's bytes (656 per slot for fp8_ds_mla, 576 for fp8_e4m3, 416 for nvfp4, 400 for mxfp4_nsa, 324 for
fp4_mx16). Launch with ``LAUNCH_OPTIONS`` (the default partition's warps, and the register cap that lets 12 warps
fit one multiprocessor).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from impls.triton.decode_kernel import E2M1_TIMES_F32, ITEM_FIELDS, NOPE, ROPE, TILE, e2m1_as_e4m3_ptx
from impls.triton.decode_wgmma import (SWIZZLED, _cta_barrier, _item_fields, _launch_dependents, _program_items,
                                       _row_at, _row_limits)
from impls.triton.decode_wgmma_fp8 import (CODE_WORDS, KEYS, SCALES_SMEM, _as_words, _e4m3_words, _issue_scores,
                                           _issue_values, _load_tile_scales, _load_words, _prefetch_page_step,
                                           _prefetch_step, _read_tile_scales, _scores_to_probs, _slots,
                                           _store_tile_scales)
from impls.triton.decode_wgmma_narrow import COPY_LAYOUT, STORE_LAYOUT, _store_item, _store_lse, _transposed_state
from impls.triton.sparse_wgmma import ROPE_AT, ROW_BYTES, _stage_query, _tiles

STAGES = gl.constexpr(2)          # decoded steps in shared memory: 2 x (64 KB codes + 8 KB rope + 1 KB scales)
DECODER_WARPS = gl.constexpr(8)   # decode_wgmma_fp8's load layouts are for 8 warps
DECODER_REGS = gl.constexpr(128)  # per decoding thread; the products' warpgroup gets the rest (248)
WARPS = 12                        # DecodeConfig.num_warps of this kernel: 4 multiplying and 8 decoding
# 12 warps x 32 threads x 168 registers fit the 64K of a multiprocessor; a lower cap spills (H200 b64: 160 -> 116
# us, 152 -> 124, against 102).
LAUNCH_OPTIONS = {"num_warps": 4, "maxnreg": 168}
# The cache layouts this kernel decodes.
LAYOUTS = ("fp8_ds_mla", "fp8_ds_mla_pow2", "fp8_e4m3", "nvfp4", "mxfp4_nsa", "fp4_mx16")
# fp8_e4m3: [576 e4m3], times the layer's scale (in the scores' scale and the output's).
E4M3_ROW_BYTES = gl.constexpr(576)
# fp8_e4m3's rope codes [64 keys, 64 bytes], 8 a thread.
E4M3_ROPE = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1],
                                          order=[1, 0]))
# nvfp4: [256 packed e2m1 | 32 e4m3 block scales, one per 16 values | 64 bf16 rope], times the layer's scale.
NVFP4_ROW_BYTES = gl.constexpr(416)
NVFP4_SCALES_AT = gl.constexpr(256)
NVFP4_ROPE_AT = gl.constexpr(288)
# mxfp4_nsa: [256 packed e2m1 | 16 ue8m0 block scales, one per 32 values | 64 bf16 rope].
MXFP4_ROW_BYTES = gl.constexpr(400)
MXFP4_SCALES_AT = gl.constexpr(256)
MXFP4_ROPE_AT = gl.constexpr(272)
# fp4_mx16: [288 packed e2m1, latent then rope | 36 ue8m0 block scales, one per 16 values, latent then rope].
MX16_ROW_BYTES = gl.constexpr(324)
MX16_SCALES_AT = gl.constexpr(288)
MX16_ROPE_AT = gl.constexpr(256)
MX16_ROPE_SCALES_AT = gl.constexpr(320)
# fp4_mx16's rope codes [64 keys, 32 bytes], 4 bytes (8 values of one block) a thread.
ROPE_BYTES = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[8, 1],
                                           order=[1, 0]))
# An nvfp4 code tile [64 keys, 16 words] as [64, 4, 4]: a thread's four words (16 bytes, 32 values) lie under two
# block scales, the byte pair the thread loads beside them. Lanes run over the keys first: the eight threads of a
# quarter-warp store the same float16 chunks of eight keys, in eight bank groups (the swizzle), not two chunks each
# of two keys in four.
FP4_WORDS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[8, 4, 1],
                                          warps_per_cta=[8, 1, 1], order=[2, 0, 1]))
FP4_KEYS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, FP4_WORDS)))


def e2m1_word_ptx(word: str, outs: tuple[str, str, str, str], scale: str, first: str | None = "0x5140",
                  second: str = "0x7362") -> str:
    """PTX for the 32-bit register ``word`` of eight packed e2m1 values: as e4m3 bytes (``lo``: the low nibbles',
    ``hi``: the high nibbles'), two byte permutes (selectors ``first`` and ``second``; none where ``first`` is None:
    ``lo``'s two pairs, then ``hi``'s) into four byte pairs, each converted to a float16 pair and multiplied by the
    float16 pair ``scale``, into ``outs``. The default selectors put the word's value pairs 0-1, 2-3, 4-5, 6-7 in
    ``outs`` (value order: even values are low nibbles)."""
    products = "".join(f"""
    cvt.rn.f16x2.e4m3x2 {out}, h{i};
    mul.rn.f16x2 {out}, {out}, {scale};""" for i, out in enumerate(outs))
    pairs = "" if first is None else f"""
    prmt.b32 a, lo, hi, {first};
    prmt.b32 b, lo, hi, {second};"""
    return ("{\n    .reg .b32 t0, t1, lo, hi, a, b;\n    .reg .b16 h<4>;" + e2m1_as_e4m3_ptx(word) + pairs + f"""
    mov.b32 {{h0, h1}}, {"lo" if first is None else "a"};
    mov.b32 {{h2, h3}}, {"hi" if first is None else "b"};""" + products + "\n}")


def _e2m1_words_times_halves(halves: str) -> str:
    """PTX for four packed words of one thread (``$16``-``$19``) under two float16 factors, the halves of the 32-bit
    register ``halves``: the first covers words 0-1, the second words 2-3 (declared by the caller: ``f0``, ``f1``
    16-bit, ``first``, ``second`` 32-bit)."""
    return (f"""
    mov.b32 {{f0, f1}}, {halves};
    mov.b32 first, {{f0, f0}};
    mov.b32 second, {{f1, f1}};""" + "".join(
        e2m1_word_ptx(f"${16 + k}", tuple(f"${4 * i + k}" for i in range(4)), "first" if k < 2 else "second")
        for k in range(4)))


# nvfp4: the two block scales' e4m3 bytes are the low 16 bits of ``$20``, each converted to float16 and multiplied by
# 64 (the e2m1 -> e4m3 bit move divides by 64; both exact).
_E2M1_WORDS_TIMES_SCALES = gl.constexpr("""{
    .reg .b16 s0, s1, f0, f1;
    .reg .b32 both, times64, first, second;
    mov.b32 {s0, s1}, $20;
    cvt.rn.f16x2.e4m3x2 both, s0;
    mov.b32 times64, 0x54005400;
    mul.rn.f16x2 both, both, times64;""" + _e2m1_words_times_halves("both") + "\n}")
# The ue8m0 layouts: the two float16 factors are ``$20`` (fp4_mx16's two blocks; mxfp4_nsa's one block has the
# same factor in both halves).
_E2M1_WORDS_TIMES_FACTORS = gl.constexpr("{\n    .reg .b16 f0, f1;\n    .reg .b32 first, second;"
                                         + _e2m1_words_times_halves("$20") + "\n}")


@gluon.jit
def _decode_split_kernel_ws(
    q, stride_qt, stride_qh, cache, block_table, stride_bt, visible, work, items_stride, item_counts,
    out, stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads, nope_scale, out_scale,
    ROWS: gl.constexpr, PAGE_SIZE: gl.constexpr, KEEP_PARTIALS: gl.constexpr, EARLY_MERGE: gl.constexpr,
    LAYOUT: gl.constexpr, WAIT_PRIOR: gl.constexpr,
):
    """A persistent program over its work items (``_decode_split_kernel``'s contract) of ``ROWS`` query rows of a
    ``LAYOUT`` cache (one of ``LAYOUTS``); both partitions walk the same items and steps, the ``g``-th step of the
    program in stage ``g % STAGES``. ``nope_scale``: nvfp4's layer scale of the latent keys; ``out_scale``: the layer
    scale of the values (nvfp4's and fp8_e4m3's; 1 for the others). ``EARLY_MERGE``: let the merge kernel, a
    programmatic dependent launch, start now."""
    if EARLY_MERGE:
        _launch_dependents()
    PROBS_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * ROWS, element_bitwidth=16, rank=2)
    q_nope = _tiles(gl.float16, [ROWS, TILE], SWIZZLED)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [ROWS, ROPE], SWIZZLED)
    # One allocation per tile: stores to different allocations need no barrier between them (to parts of one,
    # chosen at run time, Triton puts one after each).
    keys = _tiles(gl.float16, [STAGES, KEYS, TILE], SWIZZLED)
    rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, KEYS, ROPE], SWIZZLED)
    scales = _tiles(gl.float32, [STAGES, KEYS], SCALES_SMEM)
    probs = _tiles(gl.float16, [2, KEYS, ROWS], PROBS_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=1)
    gl.warp_specialize([
        (_multiply, (q, stride_qt, stride_qh, visible, work, items_stride, item_counts, out, stride_ot, stride_oh,
                     lse, stride_lt, part_out, part_lse, qk_scale, num_heads, nope_scale, out_scale, q_nope, q_rope,
                     keys, rope, scales, probs, ready, free, ROWS, KEEP_PARTIALS, LAYOUT, WAIT_PRIOR)),
        (_decode, (cache, block_table, stride_bt, work, items_stride, item_counts, keys, rope, scales, ready, free,
                   PAGE_SIZE, LAYOUT, WAIT_PRIOR)),
    ], [DECODER_WARPS], [DECODER_REGS])


@gluon.jit
def _decode(cache, block_table, stride_bt, work, items_stride, item_counts, keys, rope, scales, ready, free,
            PAGE_SIZE: gl.constexpr, LAYOUT: gl.constexpr, WAIT_PRIOR: gl.constexpr):
    """The decoder partition: every step of the program's items into the stages, each once ``free``; a step's
    bytes are loaded into registers while the step before is stored (a tile's load moved after its store leaves
    those loads' latency in the step: same time or slower, NOTES.md session 19)."""
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    # The layout's bytes per slot, which every load below takes.
    ROW: gl.constexpr = (NVFP4_ROW_BYTES if LAYOUT == "nvfp4" else MXFP4_ROW_BYTES if LAYOUT == "mxfp4_nsa"
                         else MX16_ROW_BYTES if LAYOUT == "fp4_mx16" else E4M3_ROW_BYTES if LAYOUT == "fp8_e4m3"
                         else ROW_BYTES)
    g = 0
    for i in range(items):
        request, row_block, kv_start, kv_end, slot_out, q_first, q_len = _item_fields(table + i * ITEM_FIELDS)
        pages = block_table + request.to(gl.int64) * stride_bt
        step = _load_step(cache, pages, kv_start, kv_end, PAGE_SIZE, ROW, LAYOUT)
        _prefetch_rows(cache, pages, kv_start + KEYS, kv_end, PAGE_SIZE, ROW, LAYOUT)
        for j in range(gl.cdiv(kv_end - kv_start, KEYS)):
            nxt = kv_start + (j + 1) * KEYS
            # The next step's rows (requested into L2 a step ago) are in flight while this one is stored.
            _prefetch_rows(cache, pages, nxt + KEYS, kv_end, PAGE_SIZE, ROW, LAYOUT)
            stage = g % STAGES
            next_step = _load_step(cache, pages, nxt, kv_end, PAGE_SIZE, ROW, LAYOUT)
            mbarrier.wait(free.index(stage), ((g // STAGES) & 1) ^ 1)  # a new barrier passes phase 1 at once
            _store_step(keys, rope, scales, stage, step, LAYOUT)
            step = next_step
            hopper.fence_async_shared()  # the products read the stage through the async proxy
            mbarrier.arrive(ready.index(stage), count=1)
            g += 1


@gluon.jit
def _load_step(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr, ROW: gl.constexpr, LAYOUT: gl.constexpr):
    """Keys ``[start, start + 64)`` into registers (``ROW`` bytes a slot), as ``_store_step`` takes them: the four
    latent tiles (``_load_tile``), the rope (``_load_rope``) and fp8_ds_mla's tile scales (``_load_step_scales``)."""
    c0, x0 = _load_tile(cache, pages, start, kv_end, 0, PAGE_SIZE, ROW, LAYOUT)
    c1, x1 = _load_tile(cache, pages, start, kv_end, 1, PAGE_SIZE, ROW, LAYOUT)
    c2, x2 = _load_tile(cache, pages, start, kv_end, 2, PAGE_SIZE, ROW, LAYOUT)
    c3, x3 = _load_tile(cache, pages, start, kv_end, 3, PAGE_SIZE, ROW, LAYOUT)
    r, rs = _load_rope(cache, pages, start, kv_end, PAGE_SIZE, ROW, LAYOUT)
    return c0, x0, c1, x1, c2, x2, c3, x3, r, rs, _load_step_scales(cache, pages, start, kv_end, PAGE_SIZE, ROW, LAYOUT)


@gluon.jit
def _store_step(keys, rope, scales, stage, step, LAYOUT: gl.constexpr):
    """A loaded step (``_load_step``) decoded into stage ``stage``'s buffers, the rope first: fp8_e4m3 and fp4_mx16
    decode theirs, and that overlaps the tiles' stores (2-3% faster; the other layouts within 0.4%, NOTES.md
    session 32)."""
    c0, x0, c1, x1, c2, x2, c3, x3, r, rs, step_scales = step
    _store_rope(rope.index(stage), r, rs, LAYOUT)
    _store_step_scales(scales, stage, step_scales, LAYOUT)
    _store_tile(keys[0].index(stage), scales[0].index(stage), c0, x0, LAYOUT)
    _store_tile(keys[1].index(stage), scales[1].index(stage), c1, x1, LAYOUT)
    _store_tile(keys[2].index(stage), scales[2].index(stage), c2, x2, LAYOUT)
    _store_tile(keys[3].index(stage), scales[3].index(stage), c3, x3, LAYOUT)


@gluon.jit
def _load_tile(cache, pages, start, kv_end, t: gl.constexpr, PAGE_SIZE: gl.constexpr, ROW: gl.constexpr,
               LAYOUT: gl.constexpr):
    """Latent tile ``t`` of keys ``[start, start + 64)`` (``ROW`` bytes a slot) into registers: its codes and scales
    (nvfp4 and fp4_mx16: the e4m3 or ue8m0 block scales, two per thread; mxfp4_nsa: the ue8m0 block scale, one per
    thread; the fp8 layouts: 0, fp8_ds_mla's tile scales come with ``_load_step_scales``); zeros past ``kv_end``."""
    if LAYOUT == "nvfp4" or LAYOUT == "mxfp4_nsa" or LAYOUT == "fp4_mx16":
        at, ok = _slots(pages, start, kv_end, PAGE_SIZE, FP4_KEYS, ROW)
        if LAYOUT == "nvfp4":
            blocks = (cache + at + NVFP4_SCALES_AT + TILE // 16 * t).to(gl.pointer_type(gl.int16))
        elif LAYOUT == "fp4_mx16":
            blocks = (cache + at + MX16_SCALES_AT + TILE // 16 * t).to(gl.pointer_type(gl.int16))
        else:
            blocks = cache + at + MXFP4_SCALES_AT + TILE // 32 * t
        return _load_fp4_tile(cache, at, ok, t, blocks)
    else:
        return _load_words(cache, pages, start, kv_end, t * TILE, TILE // 4, PAGE_SIZE, ROW, CODE_WORDS), 0


@gluon.jit
def _load_step_scales(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr, ROW: gl.constexpr,
                      LAYOUT: gl.constexpr):
    """fp8_ds_mla's float32 tile scales of keys ``[start, start + 64)``, ``[64, 4]`` (zeros past ``kv_end``); 0 for
    the other layouts (the ue8m0 ones make theirs from their block scales, ``_store_tile``)."""
    if LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2":
        return _load_tile_scales(cache, pages, start, kv_end, PAGE_SIZE, ROW)
    else:
        return 0


@gluon.jit
def _store_step_scales(scales, stage, step_scales, LAYOUT: gl.constexpr):
    """A step's loaded tile scales (``_load_step_scales``) into the stage's four scale buffers
    (``_store_tile_scales``)."""
    if LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2":
        _store_tile_scales(scales[0].index(stage), scales[1].index(stage), scales[2].index(stage),
                           scales[3].index(stage), step_scales)


@gluon.jit
def _prefetch_rows(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr, ROW: gl.constexpr,
                   LAYOUT: gl.constexpr):
    """Request the ``ROW``-byte rows of keys ``[start, start + 64)`` into L2 (nothing waits for it): the fp8 layouts' in
    one bulk request where pages hold whole steps (``_prefetch_page_step``: fp8_ds_mla b64 -7%, fp8_e4m3 -4%), the FP4
    layouts' line by line (the bulk request measured 2-6% slower for them, NOTES.md session 21)."""
    if LAYOUT == "fp8_ds_mla" or LAYOUT == "fp8_ds_mla_pow2" or LAYOUT == "fp8_e4m3":
        _prefetch_page_step(cache, pages, start, kv_end, PAGE_SIZE, ROW)
    else:
        _prefetch_step(cache, pages, start, kv_end, PAGE_SIZE, ROW)


@gluon.jit
def _load_rope(cache, pages, start, kv_end, PAGE_SIZE: gl.constexpr, ROW: gl.constexpr,
               LAYOUT: gl.constexpr):
    """The rope of keys ``[start, start + 64)`` (``ROW`` bytes a slot; zeros past ``kv_end``): bf16 as ``[64, 32]``
    words, and 0; fp4_mx16's packed codes ``[64, 32]`` bytes and each byte's float32 factor ``2^k * 64``
    (``decode_kernel._ue8m0_times_64``); fp8_e4m3's codes ``[64, 64]`` bytes, and 0."""
    if LAYOUT == "fp8_e4m3":
        at, ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, E4M3_ROPE), ROW)
        column = gl.arange(0, ROPE, layout=gl.SliceLayout(0, E4M3_ROPE))[None, :]
        return gl.load(cache + at[:, None] + NOPE + column, mask=ok[:, None], other=0), 0
    elif LAYOUT == "fp4_mx16":
        at, ok = _slots(pages, start, kv_end, PAGE_SIZE, gl.SliceLayout(1, ROPE_BYTES), ROW)
        column = gl.arange(0, ROPE // 2, layout=gl.SliceLayout(0, ROPE_BYTES))[None, :]
        codes = gl.load(cache + at[:, None] + MX16_ROPE_AT + column, mask=ok[:, None], other=0)
        block = gl.load(cache + at[:, None] + MX16_ROPE_SCALES_AT + column // 8, mask=ok[:, None], other=0)
        bits = (gl.minimum(block.to(gl.int32), 248) + 6) << 23
        return codes, gl.where(block == 0xFF, float("nan"), bits.to(gl.float32, bitcast=True))
    elif LAYOUT == "nvfp4":
        return _load_words(cache, pages, start, kv_end, NVFP4_ROPE_AT, ROPE // 2, PAGE_SIZE, ROW), 0
    elif LAYOUT == "mxfp4_nsa":
        return _load_words(cache, pages, start, kv_end, MXFP4_ROPE_AT, ROPE // 2, PAGE_SIZE, ROW), 0
    else:
        return _load_words(cache, pages, start, kv_end, ROPE_AT, ROPE // 2, PAGE_SIZE, ROW), 0


@gluon.jit
def _store_rope(rope, r, factors, LAYOUT: gl.constexpr):
    """A loaded rope (``_load_rope``) into its stage's bf16 buffer: fp4_mx16's decoded (exact in bfloat16 below
    blocks of 2^121), fp8_e4m3's decoded (exact), the others' as they are."""
    if LAYOUT == "fp8_e4m3":
        rope.store(r.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16))
    elif LAYOUT == "fp4_mx16":
        low, high = gl.inline_asm_elementwise(E2M1_TIMES_F32, "=r,=r,=r,=r,r,r,r,r,r", [r, factors],
                                              dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        rope.store(gl.join(low, high).reshape([r.shape[0], 2 * r.shape[1]]))
    else:
        _as_words(rope).store(r)


@gluon.jit
def _load_fp4_tile(cache, at, ok, t: gl.constexpr, scales):
    """FP4 latent tile ``t`` of the keys at byte offsets ``at`` (``ok``: real; the packed codes are an FP4 row's
    first 256 bytes) as ``[64, 4, 4]`` words, a thread's four words 32 values, and the scales of those 32 values
    (``[64, 4]``: one per chunk from each key's ``scales``, a pointer to the tile's first); zeros where not ``ok``."""
    WORDS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, FP4_WORDS))
    chunks = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, FP4_WORDS)))
    words = (cache + at + TILE // 2 * t).to(gl.pointer_type(gl.int32))
    codes = gl.load(words[:, None, None] + 4 * chunks[None, :, None] + gl.arange(0, 4, layout=WORDS)[None, None, :],
                    mask=ok[:, None, None], other=0)
    return codes, gl.load(scales[:, None] + chunks[None, :], mask=ok[:, None], other=0)


@gluon.jit
def _store_tile(keys, scales, codes, x, LAYOUT: gl.constexpr):
    """A loaded tile (``_load_tile``) decoded into its stage's buffers: float16 codes (exact, up to the tile scale)
    and, for the ue8m0 layouts, the per-key tile scale the products apply (fp8_ds_mla's: ``_store_step_scales``)."""
    if LAYOUT == "nvfp4":
        _as_words(keys).store(_e2m1_words(codes, x[:, :, None], _E2M1_WORDS_TIMES_SCALES, "r,r"))
    elif LAYOUT == "mxfp4_nsa" or LAYOUT == "fp4_mx16":
        if LAYOUT == "mxfp4_nsa":  # one block a thread
            tile_scale, factors = _ue8m0_split(x.to(gl.int32), x.to(gl.int32))
        else:  # two, the bytes of an int16
            pair = x.to(gl.int32)
            tile_scale, factors = _ue8m0_split(pair & 0xFF, (pair >> 8) & 0xFF)
        _as_words(keys).store(_e2m1_words(codes, factors[:, :, None], _E2M1_WORDS_TIMES_FACTORS, "r,r,r,r"))
        scales.store(tile_scale)
    else:
        _as_words(keys).store(_e4m3_words(codes))


@gluon.jit
def _ue8m0_split(first, second):
    """A key's ue8m0 block exponents of one tile, each thread's first and second (``[64, 4]``; the same for a
    thread with one block) -> its float32 tile scale ``2^kmax`` (NaN if a block is NaN, 0xFF) and each thread's
    float16 factors ``2^(k - kmax) * 64`` (the e2m1 -> e4m3 bit move divides by 64) in the halves of a 32-bit word.
    Blocks more than 2^-23 below the largest lose bits in float16: their values lie below 2^-22 of the tile's
    largest (a block's scale is set by its own largest value)."""
    kmax = gl.max(gl.maximum(first, second), 1)
    return _ue8m0_scale(kmax), _factor_bits(first, kmax[:, None]) | (_factor_bits(second, kmax[:, None]) << 16)


@gluon.jit
def _ue8m0_scale(exponent):
    """A ue8m0 exponent (int32) as its float32 scale ``2^(e - 127)``: 2^-127 as a subnormal, 0xFF as NaN."""
    bits = gl.where(exponent == 0, 0x400000, exponent << 23)
    return gl.where(exponent == 255, 0x7FC00000, bits).to(gl.float32, bitcast=True)


@gluon.jit
def _factor_bits(blocks, kmax):
    """The float16 bits of ``2^(k - kmax + 6)`` per block (``kmax`` broadcast to ``blocks``' shape), as int32; at
    most 2^-25 flushes to 0."""
    exponent = blocks - kmax + 133  # a float32 exponent field
    factor = gl.where(exponent > 0, exponent << 23, 0).to(gl.float32, bitcast=True).to(gl.float16)
    return factor.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF


@gluon.jit
def _e2m1_words(codes, scales, ASM: gl.constexpr, SCALE_REGS: gl.constexpr):
    """FP4 codes ``[64, 4, 4]`` words and their scales (``[64, 4, 1]``, one entry per thread's 32 values, as
    ``ASM`` reads them: ``_E2M1_WORDS_TIMES_SCALES`` or ``_E2M1_WORDS_TIMES_FACTORS``; ``SCALE_REGS``: their
    constraints, four packed entries) -> ``[64, 64]`` words of two float16 values each, in value order: each e2m1
    value times its block's scale, exact in float16 (nvfp4: at most 6 significant bits, within [2^-10, 2688])."""
    v01, v23, v45, v67 = gl.inline_asm_elementwise(
        ASM, "=r," * 16 + "r,r,r,r," + SCALE_REGS, [codes, scales], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True, pack=4)
    return gl.join(gl.join(v01, v45), gl.join(v23, v67)).reshape([codes.shape[0], 16 * codes.shape[1]])


@gluon.jit
def _multiply(q, stride_qt, stride_qh, visible, work, items_stride, item_counts, out, stride_ot, stride_oh,
              lse, stride_lt, part_out, part_lse, qk_scale, num_heads, nope_scale, out_scale, q_nope, q_rope, keys,
              rope, scales, probs, ready, free, ROWS: gl.constexpr, KEEP_PARTIALS: gl.constexpr,
              LAYOUT: gl.constexpr, WAIT_PRIOR: gl.constexpr):
    """The default partition: each of the program's items from the decoded stages."""
    table, items = _program_items(work, items_stride, item_counts, WAIT_PRIOR)
    g = 0
    for i in range(items):
        g = _attend_item(_item_fields(table + i * ITEM_FIELDS), g, q, stride_qt, stride_qh, visible, out,
                         stride_ot, stride_oh, lse, stride_lt, part_out, part_lse, qk_scale, num_heads, nope_scale,
                         out_scale, q_nope, q_rope, keys, rope, scales, probs, ready, free, ROWS, KEEP_PARTIALS,
                         LAYOUT)


@gluon.jit
def _attend_item(item, g, q, stride_qt, stride_qh, visible, out, stride_ot, stride_oh, lse, stride_lt, part_out,
                 part_lse, qk_scale, num_heads, nope_scale, out_scale, q_nope, q_rope, keys, rope, scales, probs, ready,
                 free, ROWS: gl.constexpr, KEEP_PARTIALS: gl.constexpr, LAYOUT: gl.constexpr):
    """One work item (``_item_fields``) from the program's step ``g`` on; returns the step after its last. The
    layer scale of the latent keys multiplies the query's unit (``q_down``); that of the values, the final output
    (the merge applies it to split partials)."""
    request, row_block, kv_start, kv_end, slot_out, q_first, q_len = item
    # S^T [64 keys, ROWS] and O^T [128 columns, ROWS] per value tile.
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    ACC_KEYS: gl.constexpr = gl.SliceLayout(1, ACC)
    ACC_ROWS: gl.constexpr = gl.SliceLayout(0, ACC)
    rows_q = row_block * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, COPY_LAYOUT))
    _cta_barrier()  # the previous item's products are done with the query
    q_base = _row_at(q, rows_q, q_first, num_heads, stride_qt, stride_qh)
    q_down = gl.convert_layout(_stage_query(q_base, rows_q < q_len * num_heads, q_nope, q_rope, COPY_LAYOUT),
                               ACC_ROWS)
    if LAYOUT == "nvfp4":  # its layer scale covers the latent keys only (fp8_e4m3's is in qk_scale)
        q_down = q_down * nope_scale
    hopper.fence_async_shared()
    _cta_barrier()

    rows_s, ok_s, limit = _row_limits(row_block, q_first, q_len, kv_end, visible, num_heads, ROWS, ACC_ROWS)
    key_ids = gl.arange(0, KEYS, layout=ACC_KEYS)
    # nvfp4's block scales are in its decoded values and fp8_e4m3 has none: their tile scales are all 1, so P is one
    # tile for the four value products.
    UNIT_SCALES: gl.constexpr = LAYOUT == "nvfp4" or LAYOUT == "fp8_e4m3"
    m_i, l_part, zero, acc0, acc1, acc2, acc3 = _transposed_state(ROWS, ACC)
    unit = gl.to_tensor(2.0 ** -126)  # u, the accumulators' unit (decode_wgmma_fp8)
    steps = gl.cdiv(kv_end - kv_start, KEYS)
    if steps > 0:
        # Step j's values are issued after step j + 1's scores, so that the tensor cores multiply them while the
        # warps take step j + 1's softmax; P alternates between two buffers.
        stage = g % STAGES
        mbarrier.wait(ready.index(stage), (g // STAGES) & 1)
        x0, x1, x2, x3, step_max = _tile_scales(scales, stage, ACC_KEYS, UNIT_SCALES)
        s_rope, p0, p1, p2, p3 = _issue_scores(rope.index(stage), _each_at(keys, stage), q_rope, q_nope, zero)
        m_i, l_part, unit, alpha_o = _scores_to_probs(
            s_rope, p0, p1, p2, p3, 0, UNIT_SCALES, _probs_at(probs, 0, UNIT_SCALES), x0, x1, x2, x3, step_max,
            q_down, qk_scale, (kv_start + key_ids)[:, None] < limit[None, :], m_i, l_part, unit)
        for j in range(steps - 1):
            stage = (g + j) % STAGES
            after = (g + j + 1) % STAGES
            mbarrier.wait(ready.index(after), ((g + j + 1) // STAGES) & 1)
            x0, x1, x2, x3, step_max = _tile_scales(scales, after, ACC_KEYS, UNIT_SCALES)
            s_rope, p0, p1, p2, p3 = _issue_scores(rope.index(after), _each_at(keys, after), q_rope, q_nope, zero)
            acc0, acc1, acc2, acc3 = _issue_values(_each_at(keys, stage), _probs_at(probs, j % 2, UNIT_SCALES),
                                                   alpha_o, acc0, acc1, acc2, acc3)
            m_i, l_part, unit, alpha_o = _scores_to_probs(
                s_rope, p0, p1, p2, p3, 4, UNIT_SCALES, _probs_at(probs, (j + 1) % 2, UNIT_SCALES), x0, x1, x2, x3,
                step_max, q_down, qk_scale,
                (kv_start + (j + 1) * KEYS + key_ids)[:, None] < limit[None, :], m_i, l_part, unit)
            acc0, acc1, acc2, acc3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1, acc2, acc3])
            _cta_barrier()  # every warp is done with this stage
            mbarrier.arrive(free.index(stage), count=1)
        stage = (g + steps - 1) % STAGES
        acc0, acc1, acc2, acc3 = _issue_values(_each_at(keys, stage), _probs_at(probs, (steps - 1) % 2, UNIT_SCALES),
                                               alpha_o, acc0, acc1, acc2, acc3)
        acc0, acc1, acc2, acc3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1, acc2, acc3])
        _cta_barrier()  # every warp is done with this stage and with P
        mbarrier.arrive(free.index(stage), count=1)
        g += steps

    l_i = gl.sum(l_part, 0)
    seen = l_i != 0.0  # not > 0: a NaN row is not an empty one
    lse2 = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    to_out = gl.where(seen, unit / gl.where(seen, l_i, 1.0), 0.0)
    if slot_out < 0:
        to_out = to_out * out_scale
    _store_item(acc0, acc1, acc2, acc3, gl.convert_layout(to_out, gl.SliceLayout(0, STORE_LAYOUT)), out, stride_ot,
                stride_oh, part_out, row_block, slot_out, q_first, q_len, num_heads, ROWS, KEEP_PARTIALS)
    _store_lse(lse2, rows_s, ok_s, lse, stride_lt, part_lse, row_block, slot_out, q_first, num_heads, ROWS,
               KEEP_PARTIALS)
    return g


@gluon.jit
def _tile_scales(scales, stage, ACC_KEYS: gl.constexpr, UNIT_SCALES: gl.constexpr):
    """The four per-key tile scales of ``stage`` along the keys of the products' layout, and their maximum (ones
    where ``UNIT_SCALES``). Each warp reads all 256 for the maximum, so that it needs no exchange between warps."""
    if UNIT_SCALES:
        ones = gl.full([KEYS], 1.0, gl.float32, ACC_KEYS)
        return ones, ones, ones, ones, gl.to_tensor(1.0)
    else:
        return _read_tile_scales(scales[0].index(stage), scales[1].index(stage), scales[2].index(stage),
                                 scales[3].index(stage), ACC_KEYS)


@gluon.jit
def _probs_at(probs, index, ONE_P: gl.constexpr):
    """P's four tiles in buffer ``index`` (``_each_at``), or its first four times where they are one (``ONE_P``)."""
    if ONE_P:
        return probs[0].index(index), probs[0].index(index), probs[0].index(index), probs[0].index(index)
    else:
        return _each_at(probs, index)


@gluon.jit
def _each_at(buffers, index):
    """Entry ``index`` of each of four buffers (``_tiles``): a stage's four key tiles, or P's four tiles of one of
    its two buffers."""
    return buffers[0].index(index), buffers[1].index(index), buffers[2].index(index), buffers[3].index(index)
