"""One DCP decode step on one rank: gather queries over heads, attend the shard, combine by LSE, scatter heads.

The combine follows vLLM's ``cp_lse_ag_out_rs``: all-gather every rank's lse, rescale the local partial by
``exp(lse_r - L)`` with ``L = logsumexp_r lse_r`` (0 for an empty shard, and 0 / -inf for a row no rank saw:
never NaN), then reduce-scatter over heads.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from impls.triton.dcp.attention import ShardAttention
from impls.triton.dcp.comm import HeadComm
from impls.triton.merge import rescale_partial

Rescale = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def dcp_step(q: torch.Tensor, comm: HeadComm, attention: ShardAttention, prepared: Any,
             rescale: Rescale = rescale_partial) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[T, H, 576]`` holds every head; this rank starts from its own heads only (as after a tensor-parallel
    projection). Returns ``(out [T, own heads, 512] float32, lse [T, H] float32)``."""
    gathered_q = comm.all_gather_heads(q[:, comm.my_heads].contiguous())
    out, lse = attention(gathered_q, prepared)
    all_lse = comm.all_gather(lse)
    scaled, total = rescale(out, all_lse, comm.rank)
    return comm.reduce_scatter_heads(scaled), total
