"""The DCP context reorg for chunked prefill: local gather, all-gather, back into sequence order.

For a chunk (pieces ``(request, start, end)`` of global positions), each rank gathers the tokens it holds of
each piece (local positions ``[local_count(start), local_count(end))``: a contiguous range of its own cache, which
may start mid-page), pads its part to the longest rank's, and all-gathers. Row ``i`` of the reorganized chunk
is position ``p`` of its piece, found at
``rank(p) * padded + offset(rank, piece) + local_count(p) - local_count(start)``.

vLLM's ``reorg_kvcache`` only regroups rows per request, rank after rank (enough for attention without a mask);
here the rows come back in exact sequence order, so the chunk equals the unsharded gather row for row.
"""

from __future__ import annotations

import torch

from impls.triton.dcp.comm import HeadComm
from impls.triton.dcp.shard import DcpShard, local_count, rank_of
from impls.triton.latent_io import gather_latent
from mla_bench.layouts import LATENT_DIM


def piece_counts(pieces: list[tuple[int, int, int]], world: int, interleave: int) -> torch.Tensor:
    """``[W, pieces]``: tokens each rank holds of each piece."""
    ranks = torch.arange(world)[:, None]
    starts = torch.tensor([s for _, s, _ in pieces])[None, :]
    ends = torch.tensor([e for _, _, e in pieces])[None, :]
    return local_count(ends, ranks, world, interleave) - local_count(starts, ranks, world, interleave)


def local_part_slots(shard: DcpShard, pieces: list[tuple[int, int, int]]) -> torch.Tensor:
    """Local cache slots of the chunk's tokens this rank holds, piece after piece, in position order."""
    starts = shard.local_starts
    rows = []
    for b, start, end in pieces:
        lo, hi = (int(local_count(torch.tensor(x), shard.rank, shard.world, shard.interleave)) for x in (start, end))
        rows.append(torch.arange(starts[b] + lo, starts[b] + hi))
    return shard.token_slots[torch.cat(rows).to(shard.token_slots.device)]


def reorg_source_rows(pieces: list[tuple[int, int, int]], world: int, interleave: int,
                      padded: int) -> torch.Tensor:
    """For each row of the chunk in sequence order, its row in the all-gathered ``[W * padded, ...]`` buffer."""
    counts = piece_counts(pieces, world, interleave)
    offsets = torch.cumsum(counts, dim=1) - counts  # [W, pieces]: where each piece starts in each rank's part
    sources = []
    for i, (_, start, end) in enumerate(pieces):
        positions = torch.arange(start, end)
        ranks = rank_of(positions, world, interleave)
        within = local_count(positions, ranks, world, interleave) - local_count(torch.tensor(start), ranks, world,
                                                                                interleave)
        sources.append(ranks * padded + offsets[ranks, i] + within)
    return torch.cat(sources)


def padded_part_len(pieces: list[tuple[int, int, int]], world: int, interleave: int) -> int:
    return int(piece_counts(pieces, world, interleave).sum(dim=1).max())


def gather_context_chunk(shard: DcpShard, pieces: list[tuple[int, int, int]], comm: HeadComm,
                         dtype: torch.dtype) -> torch.Tensor:
    """The chunk's latent rows ``[n, 576]`` in sequence order, decoded to ``dtype``, through a real all-gather."""
    padded = padded_part_len(pieces, shard.world, shard.interleave)
    device = shard.token_slots.device
    part = torch.zeros(padded, LATENT_DIM, dtype=dtype, device=device)
    gather_latent(shard.cache, local_part_slots(shard, pieces), part)
    everything = comm.all_gather(part).view(shard.world * padded, LATENT_DIM)
    return everything.index_select(0, reorg_source_rows(pieces, shard.world, shard.interleave, padded).to(device))
