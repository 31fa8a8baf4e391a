"""Sparse top-k MLA attention (DeepSeek V3.2 DSA): each query token attends only its selected positions.

Indices are positions inside the token's request; -1, negative and out-of-range (>= kv_len) entries are
invalid and skipped. A row with no valid index gives out 0, lse -inf. A repeated index counts each time, as
in the kernels.
"""

from __future__ import annotations

import torch

from mla_bench.errors import describe
from mla_bench.layouts import LATENT_DIM, NOPE_DIM
from reference.checks import check_ragged_rows, check_rows, check_same_device, check_tensor, check_values
from reference.core import masked_softmax

_BLOCK_ELEMENTS = 1 << 24


def sparse_latent_mqa(q: torch.Tensor, kv: torch.Tensor, topk_indices: torch.Tensor, q_lens, kv_lens,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[T, H, 576]``, ragged latent ``kv`` ``[N, 576]``, ``topk_indices`` ``[T, topk]`` (request positions)."""
    check_indexed_inputs(q, "kv", kv, "topk_indices", topk_indices)
    q_lens, kv_lens = check_ragged_rows(q_lens, kv_lens, q, "kv", kv)
    lengths = dict(dtype=torch.int64, device=q.device)
    owner = torch.repeat_interleave(torch.arange(len(q_lens), **lengths), torch.tensor(q_lens, **lengths))
    kv_len = torch.tensor(kv_lens, **lengths)[owner]
    kv_start = torch.cumsum(torch.tensor((0,) + kv_lens, **lengths), 0)[owner]
    idx = topk_indices.long()
    valid = (idx >= 0) & (idx < kv_len[:, None])
    return _indexed_attention(q, "kv", kv, torch.where(valid, idx + kv_start[:, None], -1), scale)


def indexed_latent_mqa(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token attends the rows of ``rows`` ``[R, 576]`` its ``indices`` ``[T, topk]`` name; -1 (any
    negative) and ``>= R`` are invalid. With RAGGED indices ``rows`` is the gathered K; with PAGED indices, the
    dequantized cache slots."""
    check_indexed_inputs(q, "rows", rows, "indices", indices)
    return _indexed_attention(q, "rows", rows, indices.long(), scale)


def check_indexed_inputs(q: torch.Tensor, rows_name: str, rows: torch.Tensor, indices_name: str,
                         indices: torch.Tensor) -> None:
    """The structure of a sparse call: ``q`` ``[T, H, 576]``, latent ``rows`` ``[R, 576]`` and integer indices
    ``[T, topk]`` (a float index would be truncated into a wrong valid one), all on one device."""
    check_tensor("q", q, 3, last=LATENT_DIM)
    check_tensor(rows_name, rows, 2, last=LATENT_DIM)
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{indices_name} must be int32/int64 [T, topk], got {describe(indices)}")
    check_same_device(q=q, **{rows_name: rows, indices_name: indices})
    check_rows(indices_name, indices, q.shape[0], "q.shape[0]")


def _indexed_attention(q: torch.Tensor, rows_name: str, rows: torch.Tensor, idx: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query token over the rows its int64 ``idx`` name (inputs structurally checked). The value
    check reads ``q`` and only the rows a valid index names: PAGED indices address every cache slot, poisoned
    (NaN) unused ones too, and those never reach the answer."""
    valid = (idx >= 0) & (idx < rows.shape[0])
    selected = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    selected[idx[valid]] = True
    check_values(scale, q=q, **{f"{rows_name} (the rows the indices select)": rows[selected]})
    out = torch.zeros(q.shape[0], q.shape[1], NOPE_DIM, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    if rows.shape[0] == 0:  # no row to name, every index is invalid (and row 0, the stand-in below, is absent)
        return out, lse
    kv = rows.double()
    safe = torch.where(valid, idx, 0)
    step = max(1, _BLOCK_ELEMENTS // max(1, idx.shape[1] * kv.shape[1]))
    for t0 in range(0, q.shape[0], step):
        t1 = min(q.shape[0], t0 + step)
        keys = torch.where(valid[t0:t1, :, None], kv[safe[t0:t1]], 0.0)  # [m, topk, 576]; 0 keeps poison out
        scores = torch.einsum("mhd,mkd->mhk", q[t0:t1].double(), keys) * float(scale)  # a Fraction passes the check
        scores = scores.masked_fill(~valid[t0:t1, None, :], float("-inf"))
        probs, lse[t0:t1] = masked_softmax(scores)
        out[t0:t1] = torch.einsum("mhk,mkd->mhd", probs, keys[..., :NOPE_DIM])
    return out, lse
