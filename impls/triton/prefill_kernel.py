"""Flash attention for MLA's compute-friendly path: ragged MHA with qk 192 (nope 128 | rope 64) and v 128.

Each head has its own 128-wide nope keys and values; the 64-wide rope key is one per token, shared by all
heads (broadcast, never expanded in memory). Requests are ragged by ``cu_seqlens_q`` / ``cu_seqlens_k``.
With ``causal`` the queries align to the end of the keys: query ``i`` of a request sees key ``j`` iff
``j <= k_len - q_len + i``; without it every key is visible (a chunk of cached context). lse is the natural
log; a row that sees no key (a request with no keys in this call) gives out 0 and lse -inf.

Per program: ``BLOCK_M`` query rows of one head of one request, streaming ``BLOCK_N`` keys at a time with the
online softmax in base 2 (scores pre-multiplied by ``scale * log2 e``). Key blocks wholly visible to every row
of the block skip the mask; the few on the causal diagonal apply it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from impls.triton import common
from impls.triton.common import INTERPRETING, cast, check_power_of_two, mma
from impls.triton.merge import LOG2E
from mla_bench.dims import softmax_scale_problem
from mla_bench.errors import given
from mla_bench.lengths import check_int

NOPE, ROPE, VDIM = 128, 64, 128


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and launch parameters of the prefill kernel."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3  # best of six tile shapes on an H200 at 8k tokens, 16 and 128 heads (NOTES.md, part 2)

    def __post_init__(self) -> None:
        """Tiles that are not powers of two fail inside Triton at the first launch (``tl.arange``): refuse them here."""
        for name in ("block_m", "block_n"):
            check_power_of_two(self, name)


# the interpreter pays per op, not per element
INTERPRETER_CONFIG = PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)


def default_config(device: torch.device) -> PrefillConfig:
    return PrefillConfig() if device.type == "cuda" else INTERPRETER_CONFIG


@triton.jit
def _attend_block(acc, m_i, l_i, q_nope, q_pe, kn_base, kp_base, v_base, k_start, n0, k_len, frontier,
                  qk_scale, offs_n, offs_dn, offs_dr, offs_dv, s_knt, s_kpt, s_vt, MASKED: tl.constexpr,
                  BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """One key block of the online softmax. ``frontier`` [BLOCK_M]: the last key index each row sees."""
    keys = n0 + offs_n
    rows = (k_start + keys).to(tl.int64)
    kn_ptrs = kn_base + rows[:, None] * s_knt + offs_dn[None, :]
    kp_ptrs = kp_base + rows[:, None] * s_kpt + offs_dr[None, :]
    v_ptrs = v_base + rows[:, None] * s_vt + offs_dv[None, :]
    if MASKED:
        in_range = keys < k_len
        k_nope = tl.load(kn_ptrs, mask=in_range[:, None], other=0.0)
        k_pe = tl.load(kp_ptrs, mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
    else:
        k_nope = tl.load(kn_ptrs)
        k_pe = tl.load(kp_ptrs)
        v = tl.load(v_ptrs)
    s = mma(q_nope, tl.trans(k_nope), tl.zeros([q_nope.shape[0], BLOCK_N], dtype=tl.float32), UPCAST)
    s = mma(q_pe, tl.trans(k_pe), s, UPCAST)
    s = s * qk_scale
    if MASKED:
        visible = (keys[None, :] <= frontier[:, None]) & (keys[None, :] < k_len)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = mma(cast(p, v.dtype, UPCAST), v, acc, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(Q, K_NOPE, K_PE, V, OUT, LSE, CU_Q, CU_K, qk_scale,
                    s_qt, s_qh, s_knt, s_knh, s_kpt, s_vt, s_vh, s_ot, s_oh, s_lt, s_lh,
                    num_m_blocks,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, D_V: tl.constexpr, UPCAST: tl.constexpr):
    # Heavy (late, long-causal) query blocks first: they bound the launch's tail.
    pid_m = num_m_blocks - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    m0 = pid_m * BLOCK_M
    if m0 < q_len:
        k_start = tl.load(CU_K + b)
        k_len = tl.load(CU_K + b + 1) - k_start
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_dn = tl.arange(0, D_NOPE)
        offs_dr = tl.arange(0, D_ROPE)
        offs_dv = tl.arange(0, D_V)
        row_ok = offs_m < q_len
        q_rows = Q + (q_start + offs_m).to(tl.int64)[:, None] * s_qt + h * s_qh
        # each query part meets its keys in the keys' dtype (context keys may be fp16 with bf16 queries)
        q_nope = tl.load(q_rows + offs_dn[None, :], mask=row_ok[:, None], other=0.0).to(K_NOPE.dtype.element_ty)
        q_pe = tl.load(q_rows + D_NOPE + offs_dr[None, :], mask=row_ok[:, None], other=0.0).to(K_PE.dtype.element_ty)

        if CAUSAL:
            frontier = k_len - q_len + offs_m
            # keys below the first row's frontier are visible to every row of the block
            full_end = tl.minimum(tl.maximum(k_len - q_len + m0 + 1, 0), k_len)
            hi = tl.minimum(tl.maximum(k_len - q_len + m0 + BLOCK_M, 0), k_len)
        else:
            frontier = tl.zeros([BLOCK_M], dtype=tl.int32) + k_len
            full_end = k_len
            hi = k_len
        full_end = (full_end // BLOCK_N) * BLOCK_N

        acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        kn_base = K_NOPE + h * s_knh
        v_base = V + h * s_vh
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q_nope, q_pe, kn_base, K_PE, v_base, k_start, n0, k_len,
                                          frontier, qk_scale, offs_n, offs_dn, offs_dr, offs_dv, s_knt, s_kpt, s_vt,
                                          False, BLOCK_N, UPCAST)
        for n0 in range(full_end, hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q_nope, q_pe, kn_base, K_PE, v_base, k_start, n0, k_len,
                                          frontier, qk_scale, offs_n, offs_dn, offs_dr, offs_dv, s_knt, s_kpt, s_vt,
                                          True, BLOCK_N, UPCAST)

        live = l_i != 0  # not > 0: a NaN row is not an empty one
        safe_l = tl.where(live, l_i, 1.0)
        out = acc / safe_l[:, None]
        lse = tl.where(live, (m_i + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))
        o_rows = OUT + (q_start + offs_m).to(tl.int64)[:, None] * s_ot + h * s_oh
        tl.store(o_rows + offs_dv[None, :], cast(out, OUT.dtype.element_ty, UPCAST), mask=row_ok[:, None])
        tl.store(LSE + (q_start + offs_m).to(tl.int64) * s_lt + h * s_lh, lse, mask=row_ok)


def check_mha_inputs(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                     cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float) -> None:
    """ValueError naming every input ``mha_prefill`` would read wrongly: shapes, dtypes, strides, devices, the
    offsets (read as contiguous int32) and the scale. Host-only, so a plan calls it to refuse what its run would."""
    heads = q.shape[1] if q.dim() == 3 else -1
    problems = []
    if q.dim() != 3 or q.shape[2] != NOPE + ROPE:
        problems.append(f"q must be [T, H, {NOPE + ROPE}], got {list(q.shape)}")
    if k_nope.dim() != 3 or k_nope.shape[1:] != (heads, NOPE):
        problems.append(f"k_nope must be [N, {heads}, {NOPE}], got {list(k_nope.shape)}")
    if v.dim() != 3 or v.shape[1:] != (heads, VDIM) or v.shape[0] != k_nope.shape[0]:
        problems.append(f"v must be [N, {heads}, {VDIM}] like k_nope, got {list(v.shape)}")
    if k_pe.dim() != 2 or k_pe.shape[1] != ROPE or k_pe.shape[0] != k_nope.shape[0]:
        problems.append(f"k_pe must be [N, {ROPE}] like k_nope, got {list(k_pe.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k_nope, k_pe, v)):
        problems.append("q, k_nope, k_pe and v must be contiguous in their last dim")
    half = (torch.bfloat16, torch.float16)
    if any(t.dtype not in half for t in (q, k_nope, k_pe, v)) or k_nope.dtype != v.dtype:
        problems.append(f"q, k_nope, k_pe, v must be bfloat16 or float16 (k_nope and v alike); got {q.dtype}, "
                        f"{k_nope.dtype}, {k_pe.dtype}, {v.dtype}")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32 or cu_q.shape != cu_k.shape or cu_q.dim() != 1 \
            or not (cu_q.is_contiguous() and cu_k.is_contiguous()):
        problems.append(f"cu_seqlens_q / cu_seqlens_k must be contiguous int32 [B+1] of one shape, got "
                        f"{cu_q.dtype} {list(cu_q.shape)} strides {cu_q.stride()} and "
                        f"{cu_k.dtype} {list(cu_k.shape)} strides {cu_k.stride()}")
    problems += common.misplaced(q.device, "q", k_nope=k_nope, k_pe=k_pe, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if (scale_problem := softmax_scale_problem(scale)) is not None:
        problems.append(scale_problem)
    if problems:
        raise ValueError("mha_prefill: " + "; ".join(problems))


def check_max_q_len(max_q_len: int, tokens: int, batch: int) -> None:
    """ValueError unless ``max_q_len`` is an int (Python or numpy, not a bool) and, where there are tokens and
    requests, within ``[1, tokens]``: it sizes the grid, so rows past it were never written (0 returned the
    uninitialized outputs), and a float or a tensor failed inside Triton.

    That it covers the longest request's queries needs the offsets on the host, which ``mha_prefill`` does not read
    (its run is captured in CUDA graphs): the plans check the offsets against their host lengths and take it from
    those. Nor is it held to ``ceil(tokens / batch)``: a context chunk's offsets name some of ``q``'s requests only.
    An upper bound is enough (1 where the named requests have no queries)."""
    check_int("mha_prefill: max_q_len", max_q_len)
    if tokens and batch and not 1 <= max_q_len <= tokens:
        raise ValueError(f"mha_prefill: max_q_len must be the longest request's query count, in [1, {tokens}] "
                         f"(q's rows), got {max_q_len}")


def _check_outputs(out: torch.Tensor | None, lse: torch.Tensor | None, tokens: int, heads: int,
                   device: torch.device) -> None:
    """ValueError naming a given ``out`` that is not floating point ``[tokens, heads, 128]`` contiguous in its last
    dim, or ``lse`` not float32 ``[tokens, heads]``, or either off ``device`` or overlapping itself: the kernel writes
    them as such (an int out and an int or bf16 lse were truncated)."""
    problems = (common.output_problems(out, lse, tokens, heads, VDIM)
                + common.misplaced(device, "q", **given(out=out, lse=lse)))
    if problems:
        raise ValueError("mha_prefill: " + "; ".join(problems))


def mha_prefill(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_q_len: int, scale: float,
                causal: bool = True, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                config: PrefillConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged MHA: ``q`` ``[T, H, 192]``, ``k_nope`` ``[N, H, 128]``, ``k_pe`` ``[N, 64]``, ``v`` ``[N, H, 128]``.

    Returns ``out`` ``[T, H, 128]`` (dtype of q unless ``out`` is given, e.g. float32 partials) and ``lse``
    ``[T, H]`` float32 (natural log). ``max_q_len`` sizes the grid: the longest request's query count (or more;
    ``check_max_q_len`` says what is checked).
    Keys and values may be float16 with bfloat16 queries: each query part is converted to its keys' dtype
    and the probabilities to the values' dtype before the tensor-core products.
    """
    check_mha_inputs(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale)
    tokens, heads, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    check_max_q_len(max_q_len, tokens, batch)
    _check_outputs(out, lse, tokens, heads, q.device)
    out = torch.empty(tokens, heads, VDIM, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device) if lse is None else lse
    config = config or default_config(q.device)
    if tokens == 0 or batch == 0:
        return out, lse
    num_m_blocks = triton.cdiv(max_q_len, config.block_m)
    with common.on_device(q.device):
        _prefill_kernel[(num_m_blocks, heads, batch)](
            q, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k, float(scale) * LOG2E,
            q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), num_m_blocks,
            CAUSAL=causal, BLOCK_M=config.block_m, BLOCK_N=config.block_n, D_NOPE=NOPE, D_ROPE=ROPE, D_V=VDIM,
            UPCAST=INTERPRETING, num_warps=config.num_warps, num_stages=config.num_stages)
    return out, lse


def causal_pairs(q_lens, kv_lens) -> int:
    """(query, key) pairs a causal prefill really computes: sum over requests and rows of visible keys."""
    total = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        # row i sees kv_len - q_len + i + 1 keys (rows are the last q_len positions)
        total += q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2 if kv_len else 0
    return total


def prefill_flops(q_lens, kv_lens, heads: int) -> int:
    """Useful FLOPs of a causal MLA prefill: 2 * (192 + 128) per visible (query, key) pair and head."""
    return 2 * (NOPE + ROPE + VDIM) * heads * causal_pairs(q_lens, kv_lens)


__all__ = ["INTERPRETER_CONFIG", "PrefillConfig", "causal_pairs", "check_max_q_len", "check_mha_inputs",
           "default_config", "mha_prefill", "prefill_flops"]
