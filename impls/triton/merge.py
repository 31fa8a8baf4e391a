"""Merging partial attentions by their LSE, in Triton: ``merge_attn_states`` (two parts), ``merge_parts`` (the
split-KV merge of ``S`` parts at once) and the DCP rescale.

Conventions (MLA_FACTS.md): lse is the natural log, ``[T, H]``; an lse of +inf (FlashMLA's empty row) counts
as -inf; a row whose parts are all empty gives out 0 and lse -inf, never NaN. A part whose weight is 0 adds
nothing even where its output holds garbage (the poisoned buffer of a row that saw no key).
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from impls.triton import common
from impls.triton.common import INTERPRETING, cast
from mla_bench.errors import check_tensors, given

LOG2E = 1.4426950408889634


@triton.jit
def _as_neginf_if_posinf(lse):
    return tl.where(lse == float("inf"), float("-inf"), lse)


@triton.jit
def _merged_lse(m_safe, total):
    """``(live, safe_total, lse)`` of a merge from its shifted maximum and its summed weights: a row whose weights are
    all 0 (no part saw a key) is not live, divides by 1 and gets lse -inf; a NaN total stays live (``!= 0``, not
    ``> 0``), so NaN reaches out and lse."""
    live = total != 0
    safe_total = tl.where(live, total, 1.0)
    return live, safe_total, tl.where(live, m_safe + tl.log(safe_total), float("-inf"))


@triton.jit
def _merge_kernel(out_ptr, lse_out_ptr, a_ptr, lse_a_ptr, b_ptr, lse_b_ptr, R, H, D,
                  s_ot, s_oh, s_lot, s_loh, s_at, s_ah, s_lat, s_lah, s_bt, s_bh, s_lbt, s_lbh,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) rows, head fastest
    h_ok = r < R
    t = (r // H).to(tl.int64)
    heads = r % H
    la = _as_neginf_if_posinf(tl.load(lse_a_ptr + t * s_lat + heads * s_lah, mask=h_ok, other=0.0).to(tl.float32))
    lb = _as_neginf_if_posinf(tl.load(lse_b_ptr + t * s_lbt + heads * s_lbh, mask=h_ok, other=0.0).to(tl.float32))
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    _, safe_total, lse = _merged_lse(m_safe, wa + wb)
    ca = (wa / safe_total)[:, None]
    cb = (wb / safe_total)[:, None]
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = h_ok[:, None] & (offs < D)[None, :]
        oa = tl.load(a_ptr + (t * s_at + heads * s_ah)[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        ob = tl.load(b_ptr + (t * s_bt + heads * s_bh)[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        merged = tl.where(ca > 0, ca * oa, 0.0) + tl.where(cb > 0, cb * ob, 0.0)
        tl.store(out_ptr + (t * s_ot + heads * s_oh)[:, None] + offs[None, :],
                 cast(merged, out_ptr.dtype.element_ty, INTERP), mask=mask)
    tl.store(lse_out_ptr + t * s_lot + heads * s_loh, lse.to(lse_out_ptr.dtype.element_ty), mask=h_ok)


def _tiles(dim: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): (token, head) rows per program, and values per step along a row. The interpreter
    pays per program, so it takes many rows at once."""
    return (128 if INTERPRETING else 16), min(128, triton.next_power_of_2(max(dim, 1)))  # D = 0: lse only


def _check_part(name: str, out: torch.Tensor, lse: torch.Tensor) -> None:
    if out.dim() != 3 or lse.shape != out.shape[:2]:
        raise ValueError(f"merge_attn_states: {name} must be out [T, H, D] with lse [T, H], got "
                         f"{list(out.shape)} and {list(lse.shape)}")
    if out.stride(-1) != 1:
        raise ValueError(f"merge_attn_states: {name} output must be contiguous in its last dim")
    _check_floats(f"merge_attn_states: {name} (out, lse)", out, lse)


def _check_floats(what: str, *tensors: torch.Tensor) -> None:
    """The kernels compute in float32: an integer input would be read as, or its result rounded to, other
    numbers in silence."""
    if not all(t.dtype.is_floating_point for t in tensors):
        raise ValueError(f"{what} must be floating point, got {', '.join(str(t.dtype) for t in tensors)}")


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                      out: torch.Tensor | None = None,
                      lse_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint key sets, from each part's ``(out [T,H,D], lse [T,H])``.

    ``out`` / ``lse_out`` may be given (and may alias part a: each element is read before it is written);
    otherwise they are allocated like part a's (out) and as float32 (lse).
    """
    check_tensors("merge_attn_states", meta_ok=True, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b,
                  **given(out=out, lse_out=lse_out))
    _check_part("part a", out_a, lse_a)
    _check_part("part b", out_b, lse_b)
    if out_a.shape != out_b.shape:
        raise ValueError(f"merge_attn_states: parts differ in shape: {list(out_a.shape)} vs {list(out_b.shape)}")
    out = torch.empty_like(out_a) if out is None else out
    lse_out = torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device) if lse_out is None else lse_out
    _check_part("result", out, lse_out)
    if out.shape != out_a.shape:
        raise ValueError(f"merge_attn_states: result shape {list(out.shape)} differs from {list(out_a.shape)}")
    if lse_out.dtype != torch.float32:  # the kernel writes the lse in float32: bf16 rounded it
        raise ValueError(f"merge_attn_states: lse_out must be float32, got {lse_out.dtype}")
    common.check_placed_outputs("merge_attn_states", "out_a", out_a.device,
                                dict(lse_a=lse_a, out_b=out_b, lse_b=lse_b), out=out, lse_out=lse_out)
    tokens, heads, dim = out_a.shape
    if tokens and heads:
        block_r, block_d = _tiles(dim)
        with common.on_device(out.device):
            _merge_kernel[(triton.cdiv(tokens * heads, block_r),)](
                out, lse_out, out_a, lse_a, out_b, lse_b, tokens * heads, heads, dim,
                out.stride(0), out.stride(1), lse_out.stride(0), lse_out.stride(1),
                out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
                out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
                BLOCK_R=block_r, BLOCK_D=block_d, INTERP=INTERPRETING)
    return out, lse_out


@triton.jit
def _merge_parts_kernel(out_ptr, lse_out_ptr, parts_ptr, part_lse_ptr, S, R, H, D, s_ot, s_oh, s_lt, s_lh,
                        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    """Rows ``r`` ((token, head) pairs, head fastest) and ``BLOCK_D`` columns of the merge of ``S`` contiguous parts
    ``[S, R, D]``, ``BLOCK_S`` parts per step with independent loads (a long list is not a chain of latencies)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = r < R
    t = (r // H).to(tl.int64)
    heads = r % H
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
        ok = (s < S)[:, None] & r_ok[None, :]
        lse = tl.load(part_lse_ptr + s[:, None] * R + r[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        lse = _as_neginf_if_posinf(lse)
        o = tl.load(parts_ptr + ((s[:, None] * R + r[None, :]) * D)[:, :, None] + cols[None, None, :],
                    mask=ok[:, :, None] & (cols < D)[None, None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no part saw a key yet: weights stay 0
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe[None, :])
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(tl.where(w[:, :, None] > 0, w[:, :, None] * o, 0.0), 0)
        m = m_new
    _, safe_total, merged_lse = _merged_lse(tl.where(m == float("-inf"), 0.0, m), total)
    merged = cast(acc / safe_total[:, None], out_ptr.dtype.element_ty, INTERP)
    tl.store(out_ptr + (t * s_ot + heads * s_oh)[:, None] + cols[None, :], merged,
             mask=r_ok[:, None] & (cols < D)[None, :])
    if tl.program_id(1) == 0:
        tl.store(lse_out_ptr + t * s_lt + heads * s_lh, merged_lse, mask=r_ok)


def merge_parts(parts: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse_out: torch.Tensor) -> None:
    """Write into ``out`` ``[T, H, D]`` and ``lse_out`` ``[T, H]`` (float32) the attention over the union of ``S``
    disjoint key sets, from each part's ``parts[s]`` ``[T, H, D]`` and ``part_lse[s]`` ``[T, H]`` (the split-KV
    merge: the parts contiguous, ``out`` contiguous in its last dim). A part of weight 0 adds nothing even where it
    holds garbage; all parts empty give out 0 and lse -inf; a NaN part gives NaN."""
    check_tensors("merge_parts", meta_ok=True, parts=parts, part_lse=part_lse, out=out, lse_out=lse_out)
    if parts.dim() != 4 or part_lse.shape != parts.shape[:3] or out.shape != parts.shape[1:] \
            or lse_out.shape != parts.shape[1:3]:
        raise ValueError(f"merge_parts: parts [S, T, H, D], part_lse [S, T, H], out [T, H, D] and lse_out [T, H] "
                         f"needed, got {list(parts.shape)}, {list(part_lse.shape)}, {list(out.shape)} and "
                         f"{list(lse_out.shape)}")
    if not (parts.is_contiguous() and part_lse.is_contiguous() and out.stride(-1) == 1):
        raise ValueError("merge_parts: parts and part_lse must be contiguous, out contiguous in its last dim")
    if lse_out.dtype != torch.float32:
        raise ValueError(f"merge_parts: lse_out must be float32, got {lse_out.dtype}")
    _check_floats("merge_parts: parts, part_lse and out", parts, part_lse, out)
    common.check_placed_outputs("merge_parts", "parts", parts.device, dict(part_lse=part_lse), out=out, lse_out=lse_out)
    splits, tokens, heads, dim = parts.shape
    rows = tokens * heads
    if not rows:
        return
    if not splits:
        out.zero_()
        lse_out.fill_(float("-inf"))
        return
    # the columns are a grid dimension: on a GPU 64 a program, so that few rows still make many programs
    block_r, block_d = _tiles(dim) if INTERPRETING else (16, 64)
    block_s = min(triton.next_power_of_2(splits), 8)
    with common.on_device(out.device):
        _merge_parts_kernel[(triton.cdiv(rows, block_r), max(1, triton.cdiv(dim, block_d)))](  # D = 0: the lse
            out, lse_out, parts, part_lse, splits, rows, heads, dim, out.stride(0), out.stride(1),
            lse_out.stride(0), lse_out.stride(1),
            BLOCK_S=block_s, BLOCK_R=block_r, BLOCK_D=block_d, INTERP=INTERPRETING)


@triton.jit
def _rescale_kernel(out_ptr, lse_total_ptr, part_ptr, all_lse_ptr, rank, world, R, H, D,
                    s_ot, s_oh, s_pt, s_ph, s_lw, s_lt, s_lh, s_tt, s_th,
                    BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) rows, head fastest
    h_ok = r < R
    t = (r // H).to(tl.int64)
    heads = r % H
    ranks = tl.arange(0, BLOCK_W)
    lses = tl.load(all_lse_ptr + ranks[:, None] * s_lw + (t * s_lt + heads * s_lh)[None, :],
                   mask=(ranks < world)[:, None] & h_ok[None, :], other=float("-inf")).to(tl.float32)
    lses = _as_neginf_if_posinf(lses)
    m = tl.max(lses, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    live, _, lse_total = _merged_lse(m_safe, tl.sum(tl.exp(lses - m_safe[None, :]), axis=0))
    own = tl.load(all_lse_ptr + rank * s_lw + t * s_lt + heads * s_lh, mask=h_ok, other=float("-inf"))
    own = _as_neginf_if_posinf(own.to(tl.float32))
    weight = tl.where(live, tl.exp(own - tl.where(live, lse_total, 0.0)), 0.0)[:, None]
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = h_ok[:, None] & (offs < D)[None, :]
        part = tl.load(part_ptr + (t * s_pt + heads * s_ph)[:, None] + offs[None, :], mask=mask, other=0.0)
        scaled = tl.where(weight > 0, weight * part.to(tl.float32), 0.0)
        tl.store(out_ptr + (t * s_ot + heads * s_oh)[:, None] + offs[None, :], scaled.to(out_ptr.dtype.element_ty),
                 mask=mask)
    tl.store(lse_total_ptr + t * s_tt + heads * s_th, lse_total, mask=h_ok)


def rescale_partial(part: torch.Tensor, all_lse: torch.Tensor, rank: int,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's share of an LSE combine over ``world`` parts (DCP, split-KV).

    ``part`` ``[T, H, D]`` is this rank's partial output, ``all_lse`` ``[W, T, H]`` every rank's lse (this rank's
    at index ``rank``). Returns ``(part * exp(lse_rank - L), L)`` with ``L = logsumexp_r lse_r`` (float32); summing
    the first over ranks gives the merged output. Empty parts weigh 0; an all-empty row gives 0 and -inf.
    """
    check_tensors("rescale_partial", meta_ok=True, part=part, all_lse=all_lse, **given(out=out))
    world = all_lse.shape[0]
    if part.dim() != 3 or all_lse.dim() != 3 or all_lse.shape[1:] != part.shape[:2]:
        raise ValueError(f"rescale_partial: part [T, H, D] and all_lse [W, T, H] needed, got {list(part.shape)} "
                         f"and {list(all_lse.shape)}")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world:
        raise ValueError(f"rescale_partial: rank must be an int in a world of {world}, got {rank!r}")
    if part.stride(-1) != 1:
        raise ValueError("rescale_partial: part must be contiguous in its last dim")
    out = torch.empty(part.shape, dtype=torch.float32, device=part.device) if out is None else out
    if out.shape != part.shape or out.stride(-1) != 1:
        raise ValueError(f"rescale_partial: out must be {list(part.shape)} like part, contiguous in its last dim, "
                         f"got {list(out.shape)} with strides {list(out.stride())}")
    _check_floats("rescale_partial: part, all_lse and out", part, all_lse, out)
    common.check_placed_outputs("rescale_partial", "part", part.device, dict(all_lse=all_lse), out=out)
    lse_total = torch.empty(part.shape[:2], dtype=torch.float32, device=part.device)
    tokens, heads, dim = part.shape
    if tokens and heads:
        block_r, block_d = _tiles(dim)
        with common.on_device(part.device):
            _rescale_kernel[(triton.cdiv(tokens * heads, block_r),)](
                out, lse_total, part, all_lse, int(rank), world, tokens * heads, heads, dim,
                out.stride(0), out.stride(1), part.stride(0), part.stride(1),
                all_lse.stride(0), all_lse.stride(1), all_lse.stride(2), lse_total.stride(0), lse_total.stride(1),
                BLOCK_W=max(2, triton.next_power_of_2(world)), BLOCK_R=block_r, BLOCK_D=block_d)
    return out, lse_total
