"""Sparse top-k MLA attention (DeepSeek V3.2 DSA) in Triton: absorbed MQA over per-token index lists.

Query token ``t`` attends the rows ``indices[t, :]`` of a row source: the paged cache itself (PAGED transform:
an index is a physical slot ``block * page_size + offset``) or a gathered, dequantized ``[N, 576]`` buffer
(RAGGED transform: an index is a row of the request-after-request concatenation). An index is valid iff
``0 <= idx < num_rows`` (FlashMLA's rule: -1 padding, any negative and anything past the source are skipped);
a row with no valid index gives out 0 and lse -inf, as in the reference (every row of a top-k of 0 too: ``sparse_mqa``
writes those itself and launches no kernel). Keys are the 576 latent values, values their first 512.

Per program: ``BLOCK_H`` heads of one token (they share the token's index list, so each gathered key tile
serves them all), ``BLOCK_N`` indices at a time, online softmax in base 2. Decode and prefill are the same
kernel: prefill only has more tokens. The 512 latent columns go in four tiles of 128, so that quantized
layouts enter the products as their exact codes and each tile's per-token scale is applied in float32
(after the score product; folded into the probabilities for the value product): the kernel reads an FP8
cache exactly, whatever its scales, instead of rounding dequantized keys to bf16. Power-of-two scales
(``fp8_ds_mla_pow2``) dequantize exactly into bf16, so that layout takes the unscaled products like bf16.

Few tokens would leave most of the GPU idle (one program per token and head block, each walking its whole list: at
16 heads, batch 1, top-k 2048 that is one program for 99 us on an H100). So each list is cut into pieces, one
program each, that write normalized partials and their lse into a workspace the plan allocates; ``merge_parts``
combines them by LSE (flash-decoding over the top-k list; ``index_splits`` chooses the pieces, for the Gluon kernel
too: NOTES.md, session 65).

On Hopper, 64-head blocks of ``fp8_ds_mla`` and ``fp8_ds_mla_pow2`` with bf16 queries run ``sparse_wgmma``'s Gluon
kernel instead (``SparseConfig.wgmma``): same arguments and results, the serial chain of this kernel's step shortened
(power-of-two scales through one scale per key, exact).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from impls.triton import common
from impls.triton.common import INTERPRETING, cast, check_e4m3, check_power_of_two, mma, prefetch_l2
from impls.triton.latent_io import LAYOUT_CODES, SCALED_CODES, load_nope_tile, load_rope_tile
from impls.triton.merge import LOG2E, merge_parts
from impls.triton.sparse_wgmma import _sparse_kernel_wgmma
from mla_bench.dims import softmax_scale_problem
from mla_bench.errors import UnsupportedConfig, check_tensors, given
from mla_bench.layouts import LATENT_DIM, LAYOUTS, NOPE_DIM
from mla_bench.layouts.base import check_tensor_scale

WGMMA_LAYOUTS = (LAYOUT_CODES["fp8_ds_mla"], LAYOUT_CODES["fp8_ds_mla_pow2"])  # what sparse_wgmma decodes
WGMMA_TILE = (64, 64, 8)  # sparse_wgmma's heads per program, indices per step, warps
# sparse_wgmma's tokens per launch: its grid's second dimension, which CUDA caps at 65535, rounded down to a multiple
# of 4 so that every launch's int32 index rows start 16-byte aligned as the first launch's do
TOKENS_PER_LAUNCH = 65532
MAX_SPLITS = 65535  # pieces a list may be cut into: both kernels' grids' third dimension, which CUDA caps
LAYOUT_NAMES = {code: name for name, code in LAYOUT_CODES.items()}


@dataclass(frozen=True)
class SparseConfig:
    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    prefetch: bool = False  # request the next step's rows into L2 while this step computes
    wgmma: bool = False     # the Gluon kernel (sparse_wgmma): Hopper, fp8_ds_mla layouts, bf16 queries
    # pieces each token's index list is cut into, one program each, merged by LSE (None: ``index_splits`` chooses)
    num_splits: int | None = None
    programs_per_sm: int = 1  # programs a multiprocessor is given in one wave of pieces (``index_splits``)

    def __post_init__(self) -> None:
        """Tiles Triton cannot build fail only at the first launch, and some only on a GPU (the interpreter runs a
        block_n of 8, which a 16-bit ``tl.dot`` refuses as K, and 3 warps): refuse them here."""
        for name, least in (("block_h", 1), ("block_n", 16), ("num_warps", 1)):
            check_power_of_two(self, name, least)
        if isinstance(self.programs_per_sm, bool) or not isinstance(self.programs_per_sm, int) \
                or self.programs_per_sm < 1:
            raise ValueError(f"SparseConfig.programs_per_sm must be an int >= 1, got {self.programs_per_sm!r}")
        splits = self.num_splits
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
            raise ValueError(f"SparseConfig.num_splits must be None or an int >= 1, got {splits!r}")
        if splits is not None and splits > MAX_SPLITS:
            raise ValueError(f"SparseConfig.num_splits is a grid dimension, which CUDA caps at {MAX_SPLITS}, "
                             f"got {splits}")
        if self.wgmma and (self.block_h, self.block_n, self.num_warps) != WGMMA_TILE:
            raise ValueError(f"SparseConfig.wgmma runs (block_h, block_n, num_warps) = {WGMMA_TILE}, got "
                             f"{(self.block_h, self.block_n, self.num_warps)}")


WGMMA_CONFIG = SparseConfig(*WGMMA_TILE, num_stages=2, wgmma=True)
INTERPRETER_CONFIG = SparseConfig(block_h=16, block_n=32, num_warps=4, num_stages=1)  # the interpreter pays per op
# Split-KV over the index lists: the fewest indices worth a program of their own (a piece's fixed cost: its query
# tiles, its partial's store and read back by the merge). H100, 16 heads, top-k 2048, b1: 128 -> 20.7 us, 64 -> 24.7.
MIN_SPLIT_INDICES = 128


def default_config(device: torch.device, heads: int, layout_code: int = 0,
                   query_dtype: torch.dtype = torch.bfloat16, hopper: bool | None = None) -> SparseConfig:
    """Tiles measured best on an H200 at 128 heads, batch 128, top-k 2048 (NOTES.md, part 2), capped by the heads;
    ``hopper``: whether the device runs wgmma (asked of it when None)."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    hopper = common.has_wgmma(device) if hopper is None else hopper
    if hopper and layout_code in WGMMA_LAYOUTS and heads >= 64 and query_dtype == torch.bfloat16:
        # 64-head blocks (fewer heads would pad them); H200, 128 heads b128 top-k 2048: 0.505 -> 0.334 ms. Power-of-
        # two scales since their one scale per key (H100: 0.341 -> 0.305 ms; NOTES.md, part 2, session 30).
        return WGMMA_CONFIG
    # programs_per_sm, 16 heads, top-k 2048, pieces in whole waves (NOTES.md, session 65): two for bf16 (H100 b64 4 /
    # 3 pieces 74 / 75 us, b128 2 / 1 122 / 133), one for the scaled layouts (H200 fp8_ds_mla b32 4 / 8 pieces 65 /
    # 72 us, b64 2 / 4 115 / 125, b128 1 / 2 214 / 223); pow2 with the scaled ones (not measured apart).
    if layout_code in SCALED_CODES:  # one program per token reads each key once; 64-key steps: fewer loop trips
        best = SparseConfig(128, 64, 8, 1)
    elif layout_code == 0:
        best = SparseConfig(32, 64, 4, 2, programs_per_sm=2)
    else:  # power-of-two fp8 dequantized in registers: wide head blocks amortize the decode (BH32 was 4.6x slower);
        # one stage of 128 keys with the next step's rows prefetched: 404 (BN64 s2) -> 331 us (NOTES.md, round 7)
        best = SparseConfig(64, 128, 8, 1, prefetch=True)
    return replace(best, block_h=min(best.block_h, max(16, triton.next_power_of_2(heads))))


@triton.jit
def _scores(s, q, codes, scale, SCALED: tl.constexpr, UPCAST: tl.constexpr):
    """``s + (q @ codes^T) * scale`` per key column: the scale is applied in float32 after the product."""
    if SCALED:
        zero = tl.zeros(s.shape, dtype=tl.float32)
        return s + mma(q, tl.trans(codes), zero, UPCAST) * scale[None, :]
    return mma(q, tl.trans(codes), s, UPCAST)


@triton.jit
def _values(acc, p, codes, scale, alpha, SCALED: tl.constexpr, UPCAST: tl.constexpr):
    """``acc * alpha + (p * scale) @ codes``: the key's scale folds into the probabilities before rounding."""
    if SCALED:
        p = p * scale[None, :]
    return mma(cast(p, codes.dtype, UPCAST), codes, acc * alpha[:, None], UPCAST)


@triton.jit
def _index_rows(idx_row, first, topk, num_rows, BLOCK_N: tl.constexpr):
    """Source rows of indices ``first .. first + BLOCK_N`` of a token's list, and which are valid (in top-k and
    ``0 <= idx < num_rows``); invalid ones read row 0."""
    offs = first + tl.arange(0, BLOCK_N)
    idx = tl.load(idx_row + offs, mask=offs < topk, other=-1).to(tl.int64)
    valid = (idx >= 0) & (idx < num_rows)
    return tl.where(valid, idx, 0), valid


@triton.jit
def _prefetch_rows(idx_row, first, topk, SRC, num_rows, row_bytes, LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr):
    """Request into L2 every 128-byte line of the source rows that indices ``first .. first + BLOCK_N`` name."""
    rows, _ = _index_rows(idx_row, first, topk, num_rows, BLOCK_N)
    LINES: tl.constexpr = 16 if LAYOUT == 0 else 8  # bf16 rows are 1152 bytes, fp8 rows 576 or 656
    lines = tl.minimum(tl.arange(0, LINES) * 128, row_bytes - 1)
    prefetch_l2(SRC + rows[:, None] * row_bytes + lines[None, :], UPCAST)


@triton.jit
def _sparse_kernel(Q, IDX, SRC, OUT, LSE, PARTS, PART_LSE, H, topk, chunk, num_rows, row_bytes, tensor_scale,
                   qk_scale, s_qt, s_qh, s_it, s_ot, s_oh, s_lt, s_lh,
                   LAYOUT: tl.constexpr, SCALED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   PREFETCH: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """One program: ``BLOCK_H`` heads of token ``program_id(0)`` over indices ``[piece * chunk, piece * chunk +
    chunk)`` of its list, ``piece = program_id(2)``. ``SPLIT`` (the lists are cut): write the normalized partial and
    its lse into the contiguous ``PARTS`` ``[S, T, H, 512]`` float32 and ``PART_LSE`` ``[S, T, H]`` for
    ``merge_parts``; else the output into ``OUT`` and ``LSE``."""
    t = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs = tl.arange(0, 128)
    q_rows = Q + t * s_qt + heads[:, None] * s_qh
    q0 = tl.load(q_rows + offs[None, :], mask=h_ok[:, None], other=0.0)
    q1 = tl.load(q_rows + 128 + offs[None, :], mask=h_ok[:, None], other=0.0)
    q2 = tl.load(q_rows + 256 + offs[None, :], mask=h_ok[:, None], other=0.0)
    q3 = tl.load(q_rows + 384 + offs[None, :], mask=h_ok[:, None], other=0.0)
    q_r = tl.load(q_rows + 512 + tl.arange(0, 64)[None, :], mask=h_ok[:, None], other=0.0)
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n0 in range(piece * chunk, tl.minimum(topk, piece * chunk + chunk), BLOCK_N):
        rows, valid = _index_rows(IDX + t * s_it, n0, topk, num_rows, BLOCK_N)
        k0, c0 = load_nope_tile(SRC, rows, valid, row_bytes, tensor_scale, 0, LAYOUT, q0.dtype)
        k1, c1 = load_nope_tile(SRC, rows, valid, row_bytes, tensor_scale, 1, LAYOUT, q0.dtype)
        k2, c2 = load_nope_tile(SRC, rows, valid, row_bytes, tensor_scale, 2, LAYOUT, q0.dtype)
        k3, c3 = load_nope_tile(SRC, rows, valid, row_bytes, tensor_scale, 3, LAYOUT, q0.dtype)
        k_r, c_r = load_rope_tile(SRC, rows, valid, row_bytes, tensor_scale, LAYOUT, q_r.dtype)
        if PREFETCH:  # after this step's loads are issued, before its products
            _prefetch_rows(IDX + t * s_it, n0 + BLOCK_N, topk, SRC, num_rows, row_bytes, LAYOUT, BLOCK_N, UPCAST)
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        s = _scores(s, q0, k0, c0, SCALED, UPCAST)
        s = _scores(s, q1, k1, c1, SCALED, UPCAST)
        s = _scores(s, q2, k2, c2, SCALED, UPCAST)
        s = _scores(s, q3, k3, c3, SCALED, UPCAST)
        s = _scores(s, q_r, k_r, c_r, SCALED, UPCAST)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = _values(acc0, p, k0, c0, alpha, SCALED, UPCAST)
        acc1 = _values(acc1, p, k1, c1, alpha, SCALED, UPCAST)
        acc2 = _values(acc2, p, k2, c2, alpha, SCALED, UPCAST)
        acc3 = _values(acc3, p, k3, c3, alpha, SCALED, UPCAST)
        m_i = m_new
    live = l_i != 0  # not > 0: a NaN row is not an empty one
    inv_l = (1.0 / tl.where(live, l_i, 1.0))[:, None]
    lse = tl.where(live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if SPLIT:
        part = (piece * tl.num_programs(0) + t) * H + heads  # (piece, token, head) of the contiguous workspace
        o_rows = PARTS + part[:, None] * 512 + offs[None, :]
        lse_at = PART_LSE + part
        o_dt = tl.float32
    else:
        o_rows = OUT + t * s_ot + heads[:, None] * s_oh + offs[None, :]
        lse_at = LSE + t * s_lt + heads * s_lh
        o_dt = OUT.dtype.element_ty
    tl.store(o_rows, cast(acc0 * inv_l, o_dt, UPCAST), mask=h_ok[:, None])
    tl.store(o_rows + 128, cast(acc1 * inv_l, o_dt, UPCAST), mask=h_ok[:, None])
    tl.store(o_rows + 256, cast(acc2 * inv_l, o_dt, UPCAST), mask=h_ok[:, None])
    tl.store(o_rows + 384, cast(acc3 * inv_l, o_dt, UPCAST), mask=h_ok[:, None])
    tl.store(lse_at, lse, mask=h_ok)


def index_splits(tokens: int, heads: int, topk: int, config: SparseConfig, sms: int) -> tuple[int, int]:
    """``(splits, chunk)``: each token's index list is cut into ``splits`` pieces of ``chunk`` indices (a multiple of
    the step), one program each, merged by LSE (flash-decoding over the top-k list), so that a few tokens still fill
    the GPU: the most pieces that keep every program in one wave of ``config.programs_per_sm`` per multiprocessor,
    at most one per ``MIN_SPLIT_INDICES`` of the list. One piece wherever the tokens fill that wave alone;
    ``config.num_splits`` forces the count (pieces past the list's end are then empty).

    A count that spills into a second wave costs a whole piece's time, so the count is rounded down to whole waves:
    H100, 128 heads (the Gluon kernel), fp8_ds_mla, top-k 2048, b32: 1 / 2 / 3 pieces 154 / 91 / 135 us (NOTES.md,
    session 65)."""
    if config.num_splits is not None:
        splits = config.num_splits
    elif not tokens or not heads or not topk:
        splits = 1
    else:
        programs = tokens * triton.cdiv(heads, config.block_h)
        splits = max(1, min(config.programs_per_sm * sms // programs, triton.cdiv(topk, MIN_SPLIT_INDICES)))
    chunk = triton.cdiv(triton.cdiv(max(topk, 1), splits), config.block_n) * config.block_n
    if config.num_splits is None:
        splits = triton.cdiv(max(topk, 1), chunk)  # no piece left empty by rounding the chunk up
    return splits, chunk


def split_workspace(q: torch.Tensor, indices: torch.Tensor,
                    config: SparseConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pieces' partials ``sparse_mqa`` writes and merges, ``([S, T, H, 512], [S, T, H])`` float32; None where the
    lists are not cut. A plan allocates it so that its run allocates nothing (CUDA graphs)."""
    splits, _ = index_splits(q.shape[0], q.shape[1], indices.shape[1], config, common.sm_count(q.device))
    return _allocate_parts((splits, q.shape[0], q.shape[1]), q.device) if splits > 1 else None


def _allocate_parts(shape: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 partials ``[S, T, H, 512]`` and their lse ``[S, T, H]`` for pieces ``shape`` = ``(S, T, H)``."""
    return (torch.empty(*shape, NOPE_DIM, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device))


def check_wgmma(config: SparseConfig, device: torch.device, layout_code: int, query_dtype: torch.dtype) -> None:
    """What the Gluon kernel needs beyond its tile (``SparseConfig`` checks that): UnsupportedConfig otherwise."""
    if not config.wgmma:
        return
    if layout_code not in WGMMA_LAYOUTS:
        raise UnsupportedConfig(f"the sparse wgmma kernel reads fp8_ds_mla caches, not {LAYOUT_NAMES[layout_code]!r}")
    if query_dtype != torch.bfloat16:
        raise UnsupportedConfig(f"the sparse wgmma kernel takes bf16 queries, not {query_dtype}")
    if not common.has_wgmma(device):
        raise UnsupportedConfig(f"the sparse wgmma kernel needs a Hopper GPU (compute capability 9), not {device}")


def check_inputs(q: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor, layout_code: int, scale: float,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None, name: str = "sparse_mqa",
                 tensor_scale: float | None = None) -> None:
    """ValueError naming every input ``sparse_mqa`` would read or write wrongly: shapes, dtypes, strides, devices,
    the layout's row width, the softmax scale, and the per-layer scale of a layout that has one (``fp8_e4m3``; the
    other layouts ignore ``tensor_scale``, as their codecs do). Host-only, so that a plan refuses what its run
    would."""
    check_tensors(name, q=q, indices=indices, rows=rows, **given(out=out, lse=lse))
    problems = []
    if q.dim() != 3 or q.shape[2] != LATENT_DIM or q.stride(-1) != 1 or q.dtype not in (torch.bfloat16,
                                                                                           torch.float16):
        problems.append(f"q must be bf16/fp16 [T, H, {LATENT_DIM}] (last dim contiguous), got {q.dtype} "
                        f"{list(q.shape)}")
    tokens, heads = q.shape[0] if q.dim() else -1, q.shape[1] if q.dim() == 3 else -1
    if indices.dim() != 2 or indices.shape[0] != tokens or indices.dtype != torch.int32 or indices.stride(1) != 1:
        problems.append(f"indices must be int32 [{tokens}, topk] with contiguous rows (torch.topk gives int64: "
                        f"convert them), got {indices.dtype} {list(indices.shape)}")
    if layout_code not in LAYOUT_NAMES:
        problems.append(f"layout_code must be one of {LAYOUT_CODES}, got {layout_code!r}")
    else:
        width = LAYOUTS[LAYOUT_NAMES[layout_code]].bytes_per_token
        if rows.dim() != 2 or rows.dtype != torch.uint8 or not rows.is_contiguous() or rows.shape[1] != width:
            problems.append(f"rows must be a contiguous uint8 [N, {width}] source of {LAYOUT_NAMES[layout_code]} "
                            f"tokens, got {rows.dtype} {list(rows.shape)}")
    # merge_parts, where the lists are cut, takes no other dtypes: refused here whether or not they are
    problems += common.output_problems(out, lse, tokens, heads, NOPE_DIM)
    devices = {t.device for t in (q, indices, rows, out, lse) if t is not None}  # a tensor's: cuda:0, not cuda
    if len(devices) > 1:
        problems.append(f"q, indices, rows, out and lse must be on one device, got {sorted(map(str, devices))}")
    if (scale_problem := softmax_scale_problem(scale)) is not None:
        problems.append(scale_problem)
    if layout_code in LAYOUT_NAMES and LAYOUTS[LAYOUT_NAMES[layout_code]].needs_tensor_scale:
        try:  # no default: a missing scale read as 1.0 gave plausible wrong numbers
            check_tensor_scale(LAYOUT_NAMES[layout_code], tensor_scale)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))


def sparse_mqa(q: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor, layout_code: int, scale: float,
               tensor_scale: float | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
               config: SparseConfig | None = None,
               workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[T, H, 576]`` attends ``rows[indices[t]]``; ``rows`` is the uint8 ``[num_rows, bytes_per_token]``
    source (``PagedCache.rows()``, or a gathered bf16 buffer viewed as bytes) in the layout ``layout_code``.
    ``tensor_scale``: the cache's per-layer scale, required by ``fp8_e4m3`` and ignored by the other layouts.
    ``workspace``: ``split_workspace``'s, where the lists are cut into pieces (allocated here when not given).

    Returns ``out`` ``[T, H, 512]`` (q's dtype unless given) and ``lse`` ``[T, H]`` float32, natural log.
    """
    check_inputs(q, indices, rows, layout_code, scale, out, lse, tensor_scale=tensor_scale)
    tokens, heads, _ = q.shape
    out = torch.empty(tokens, heads, NOPE_DIM, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device) if lse is None else lse
    config = config or default_config(q.device, heads, layout_code, q.dtype)
    splits, chunk = index_splits(tokens, heads, indices.shape[1], config, common.sm_count(q.device))
    if splits > 1:
        workspace = _allocate_parts((splits, tokens, heads), q.device) if workspace is None else workspace
        _check_workspace(workspace, (splits, tokens, heads), q.device)
    check_e4m3(q.device, LAYOUT_NAMES[layout_code], "sparse_mqa")
    check_wgmma(config, q.device, layout_code, q.dtype)
    qk_scale = float(scale) * LOG2E  # a numpy float32 passes the check, and no launcher takes it
    layer_scale = float(tensor_scale) if LAYOUTS[LAYOUT_NAMES[layout_code]].needs_tensor_scale else 1.0  # else unread
    if not indices.shape[1]:  # top-k 0: every row is empty; the Gluon kernel indexes lists up to topk - 1
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    with common.on_device(q.device):
        parts, part_lse = workspace if splits > 1 else (out, lse)  # unread where the lists are whole
        if config.wgmma:
            # a piece's out and lse: the workspace's next [T, H, 512] and [T, H] (one piece: out and lse themselves)
            piece_strides = (parts.stride(0), part_lse.stride(0)) if splits > 1 else (0, 0)
            for t0 in range(0, tokens, TOKENS_PER_LAUNCH):
                t = slice(t0, min(tokens, t0 + TOKENS_PER_LAUNCH))
                o, l = (parts[:, t], part_lse[:, t]) if splits > 1 else (out[t].unsqueeze(0), lse[t].unsqueeze(0))
                _sparse_kernel_wgmma[(triton.cdiv(heads, config.block_h), t.stop - t0, splits)](
                    q[t], q.stride(0), q.stride(1), indices[t], indices.stride(0), rows, rows.shape[0],
                    indices.shape[1], o, o.stride(1), o.stride(2), l, l.stride(1), l.stride(2), qk_scale, heads,
                    chunk, *piece_strides, PER_KEY=layout_code == LAYOUT_CODES["fp8_ds_mla_pow2"],
                    num_warps=config.num_warps)
        elif tokens:
            grid = (tokens, triton.cdiv(heads, config.block_h), splits)
            _sparse_kernel[grid](q, indices, rows, out, lse, parts, part_lse, heads, indices.shape[1], chunk,
                                 rows.shape[0], rows.shape[1], layer_scale, qk_scale, q.stride(0), q.stride(1),
                                 indices.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                                 LAYOUT=layout_code, SCALED=layout_code in SCALED_CODES,
                                 BLOCK_H=config.block_h, BLOCK_N=config.block_n, PREFETCH=config.prefetch,
                                 SPLIT=splits > 1, UPCAST=INTERPRETING, num_warps=config.num_warps,
                                 num_stages=config.num_stages)
        if splits > 1 and tokens:
            merge_parts(parts, part_lse, out, lse)
    return out, lse


def _check_workspace(workspace: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int, int],
                     device: torch.device) -> None:
    """ValueError unless ``workspace`` is what ``split_workspace`` allocates for this launch."""
    want = ((*shape, NOPE_DIM), shape)
    tensors = isinstance(workspace, tuple) and all(isinstance(w, torch.Tensor) for w in workspace)
    if not (tensors and len(workspace) == 2 and all(
            tuple(w.shape) == s and w.dtype == torch.float32 and w.is_contiguous() and w.device == device
            for w, s in zip(workspace, want))):
        got = [(w.dtype, list(w.shape), str(w.device)) for w in workspace] if tensors else type(workspace).__name__
        raise ValueError(f"sparse_mqa: the workspace must be contiguous float32 {list(want[0])} and {list(want[1])} "
                         f"on {device} (split_workspace), got {got}")


def sparse_flops(indices_valid: int, heads: int) -> int:
    """Useful FLOPs: 2 * (576 + 512) per valid (token, index) pair and head."""
    return 2 * (LATENT_DIM + NOPE_DIM) * heads * indices_valid
