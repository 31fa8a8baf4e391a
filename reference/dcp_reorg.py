"""Float64 reference of the DCP context reorg (vLLM's ``reorg_kvcache``), by plain loops over positions.

Chunked prefill under DCP: each rank gathers the tokens it holds of a context chunk, the parts are
all-gathered, and the rows are put back into sequence order, so that the chunk reads as the unsharded cache
would give it. A chunk is a list of pieces ``(request, start, end)`` of global positions; rank ``r``'s part
lists its positions of the first piece, then of the next, each in increasing order.
"""

from __future__ import annotations

import torch

from mla_bench.metadata.reference import dcp_rank_of_position
from reference.checks import check_int


def part_positions(pieces: list[tuple[int, int, int]], rank: int, world: int,
                   interleave: int) -> list[tuple[int, int]]:
    """``(request, position)`` of the chunk's tokens that ``rank`` holds, in the order of its part."""
    _check_chunk(pieces, world, interleave)
    return [(b, p) for b, start, end in pieces for p in range(start, end)
            if dcp_rank_of_position(p, world, interleave) == rank]


def local_index(position: int, rank: int, world: int, interleave: int) -> int:
    """Index of global ``position`` among the tokens ``rank`` holds of its request (position must be ``rank``'s)."""
    _check_chunk([], world, interleave)
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return sum(1 for p in range(position) if dcp_rank_of_position(p, world, interleave) == rank)


def reorg(parts: list[torch.Tensor], pieces: list[tuple[int, int, int]], world: int,
          interleave: int) -> torch.Tensor:
    """The chunk's rows in sequence order from every rank's part (``parts[r]``: ``[n_r, D]``, no padding)."""
    _check_chunk(pieces, world, interleave)
    if len(parts) != world:
        raise ValueError(f"reorg: {len(parts)} parts for a world of {world}")
    owners = [dcp_rank_of_position(p, world, interleave) for _, start, end in pieces for p in range(start, end)]
    uses = [owners.count(r) for r in range(world)]
    if uses != [part.shape[0] for part in parts]:
        raise ValueError(f"reorg: parts hold {[part.shape[0] for part in parts]} rows, the chunk uses {uses}")
    cursors = [0] * world
    rows = []
    for r in owners:
        rows.append(parts[r][cursors[r]].double())
        cursors[r] += 1
    width = parts[0].shape[1] if parts else 0
    return torch.stack(rows) if rows else torch.zeros(0, width, dtype=torch.float64)


def _check_chunk(pieces: list[tuple[int, int, int]], world: int, interleave: int) -> None:
    """ValueError unless ``world`` and ``interleave`` are positive ints (0 divided by zero) and every piece has
    ``0 <= start <= end`` (a negative position was given a rank, as if it were a token)."""
    check_int("world", world, 1)
    check_int("interleave", interleave, 1)
    for i, (request, start, end) in enumerate(pieces):
        if not 0 <= start <= end:
            raise ValueError(f"piece {i} (request {request}) must have 0 <= start <= end, got start={start}, "
                             f"end={end}")
