"""Decode context parallel, simulated in one process with the steps of the distributed algorithm.

KV tokens are sharded over ``world`` ranks with interleave ``I`` (token ``t`` on rank ``(t // I) % W``); each rank
holds the queries of its heads, the queries are all-gathered over heads, each rank attends its shard with
all heads (causal by global position), the LSEs are all-gathered, each rank rescales its partial output by
``exp(lse_r - L)`` with ``L = logsumexp_r lse_r`` (0 where its shard is empty, never NaN), and a
reduce-scatter over heads returns each rank its heads. Heads split as evenly as ``tensor_split`` does, so
``world`` need not divide the head count.
"""

from __future__ import annotations

import torch

from mla_bench.layouts import NOPE_DIM
from mla_bench.metadata.reference import dcp_rank_of_position
from reference.absorbed import check_latent_inputs
from reference.checks import check_int
from reference.core import attend_prechecked

INT64_MAX = torch.iinfo(torch.int64).max


def shard_positions(kv_len: int, rank: int, world: int, interleave: int) -> torch.Tensor:
    """Global positions of a request's tokens that ``rank`` holds, in order."""
    positions = torch.arange(kv_len)
    return positions[dcp_rank_of_position(positions, world, interleave) == rank]


def rank_partial(q: torch.Tensor, kv: torch.Tensor, q_lens, kv_lens, scale: float, rank: int, world: int,
                 interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's attention of all heads over its shard: ``(out [T, H, 512], lse [T, H])`` (inputs checked by the
    caller, ``dcp_latent_mqa``)."""
    out = torch.zeros(q.shape[0], q.shape[1], NOPE_DIM, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    q0 = k0 = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        positions = shard_positions(kv_len, rank, world, interleave).to(q.device)
        local = kv[k0 + positions].double()
        frontier = kv_len - q_len + torch.arange(q_len, device=q.device)
        visible = positions[None, :] <= frontier[:, None]
        rows = slice(q0, q0 + q_len)
        out[rows], lse[rows] = attend_prechecked(q[rows], local[:, None, :], local[:, None, :NOPE_DIM], visible,
                                                 scale)
        q0, k0 = q0 + q_len, k0 + kv_len
    return out, lse


def dcp_latent_mqa(q: torch.Tensor, kv: torch.Tensor, q_lens, kv_lens, scale: float, world: int,
                   interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed decode over ragged latent ``kv`` ``[N, 576]`` computed as ``world`` DCP ranks would."""
    for name, value in (("world", world), ("interleave", interleave)):
        if check_int(name, value, 1) > INT64_MAX:  # torch failed on it deep inside (OverflowError and others)
            raise ValueError(f"{name} must be at most {INT64_MAX}, as token positions and ranks are int64, "
                             f"got {value}")
    q_lens, kv_lens = check_latent_inputs(q, kv, q_lens, kv_lens, scale)
    head_groups = torch.arange(q.shape[1], device=q.device).tensor_split(world)
    local_q = [q[:, heads] for heads in head_groups]            # each rank starts with its own heads
    gathered_q = torch.cat(local_q, dim=1)                       # all-gather over heads
    partials = [rank_partial(gathered_q, kv, q_lens, kv_lens, scale, r, world, interleave) for r in range(world)]
    all_lse = torch.stack([lse for _, lse in partials])          # all-gather of lse: [W, T, H]
    total = torch.logsumexp(all_lse, dim=0)
    safe_total = torch.where(torch.isneginf(total), 0.0, total)
    rescaled = []
    for out_r, lse_r in partials:
        weight = torch.exp(lse_r - safe_total)
        rescaled.append(torch.where(weight[..., None] > 0, out_r * weight[..., None], 0.0))
    summed = torch.stack(rescaled).sum(dim=0)                    # reduce ...
    pieces = [summed[:, heads] for heads in head_groups]         # ... scatter over heads: rank r keeps its heads
    return torch.cat(pieces, dim=1), total
