"""Sparse top-k MLA attention (DeepSeek V3.2 DSA): each query token attends only its selected positions.

Indices are positions inside the token's request; -1, negative and out-of-range (>= kv_len) entries are
invalid and skipped. A row with no valid index gives out 0, lse -inf. A repeated index counts each time, as
in the kernels.
"""

from __future__ import annotations

import torch

from mla_bench.layouts import LATENT_DIM, NOPE_DIM
from reference.checks import check_lengths, check_same_device, check_tensor
from reference.core import masked_softmax

_BLOCK_ELEMENTS = 1 << 24


def sparse_latent_mqa(q: torch.Tensor, kv: torch.Tensor, topk_indices: torch.Tensor, q_lens, kv_lens,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[T, H, 576]``, ragged latent ``kv`` ``[N, 576]``, ``topk_indices`` ``[T, topk]`` (request positions)."""
    check_tensor("q", q, 3, last=LATENT_DIM)
    check_tensor("kv", kv, 2, last=LATENT_DIM)
    check_same_device(q=q, kv=kv, topk_indices=topk_indices)
    check_lengths(q_lens, kv_lens)
    if topk_indices.dim() != 2 or topk_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_indices must be int32/int64 [T, topk], got {topk_indices.dtype} "
                         f"{list(topk_indices.shape)}")
    if topk_indices.shape[0] != q.shape[0] or q.shape[0] != sum(q_lens) or kv.shape[0] != sum(kv_lens):
        raise ValueError(f"topk_indices has {topk_indices.shape[0]} rows, q {q.shape[0]}, sum(q_lens) {sum(q_lens)}; "
                         f"kv has {kv.shape[0]} rows for sum(kv_lens) {sum(kv_lens)}")
    owner = torch.repeat_interleave(torch.arange(len(q_lens), device=q.device),
                                    torch.tensor(list(q_lens), device=q.device))
    kv_len = torch.tensor(list(kv_lens), device=q.device)[owner]
    kv_start = (torch.cumsum(torch.tensor([0] + list(kv_lens), device=q.device), 0))[owner]
    idx = topk_indices.to(q.device).long()
    valid = (idx >= 0) & (idx < kv_len[:, None])
    return indexed_latent_mqa(q, kv, torch.where(valid, idx + kv_start[:, None], -1), scale)


def indexed_latent_mqa(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token attends the rows of ``rows`` ``[R, 576]`` its ``indices`` ``[T, topk]`` name; -1 (any
    negative) and ``>= R`` are invalid. With RAGGED indices ``rows`` is the gathered K; with PAGED indices, the
    dequantized cache slots."""
    kv = rows.double()
    idx = indices.to(q.device).long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    safe = torch.where(valid, idx, 0)
    out = torch.zeros(q.shape[0], q.shape[1], NOPE_DIM, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    step = max(1, _BLOCK_ELEMENTS // max(1, idx.shape[1] * kv.shape[1]))
    for t0 in range(0, q.shape[0], step):
        t1 = min(q.shape[0], t0 + step)
        keys = torch.where(valid[t0:t1, :, None], kv[safe[t0:t1]], 0.0)  # [m, topk, 576]; 0 keeps poison out
        scores = torch.einsum("mhd,mkd->mhk", q[t0:t1].double(), keys) * scale
        scores = scores.masked_fill(~valid[t0:t1, None, :], float("-inf"))
        probs, lse[t0:t1] = masked_softmax(scores)
        out[t0:t1] = torch.einsum("mhk,mkd->mhd", probs, keys[..., :NOPE_DIM])
    return out, lse
