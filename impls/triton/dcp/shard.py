"""One rank's share of a DCP problem: the tokens it holds, in its own paged cache.

Token ``t`` of a request lives on rank ``(t // I) % W``. A rank's cache holds only its tokens, in pages of its
own (randomly permuted block table, unused bytes poisoned like the global cache), written byte for byte from
the global cache so every layout shards alike. ``visible_lens[row]`` is the number of the rank's tokens that
query ``row`` sees under the causal rule (the rank's tokens at global positions ``<= kv_len - q_len + i``):
the per-row override a decode kernel needs to run on a shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_bench.layouts import LATENT_DIM, PagedCache, get_layout
from mla_bench.metadata.reference import allocate_block_table, cumulative, flat_token_slots
from mla_bench.problem import Problem
from mla_bench.workload import Workload, derive_seed


def local_count(positions: torch.Tensor, rank: int, world: int, interleave: int) -> torch.Tensor:
    """Tokens among global positions ``[0, p)`` that ``rank`` holds, for each ``p`` of ``positions``
    (vectorized ``dcp_local_len``)."""
    block = interleave * world
    return (positions // block) * interleave + (positions % block - rank * interleave).clamp(0, interleave)


def rank_of(positions: torch.Tensor, world: int, interleave: int) -> torch.Tensor:
    return (positions // interleave) % world


def _page_generator(seed: int, rank: int) -> torch.Generator:
    """The generator of rank ``rank``'s page permutation under workload seed ``seed``: a seed of its own per rank
    (``seed * 1009 + rank + 1``, wrapped into the generator's range)."""
    return torch.Generator().manual_seed(derive_seed(seed, rank + 1, stride=1009))


@dataclass
class DcpShard:
    rank: int
    world: int
    interleave: int
    cache: PagedCache           # this rank's tokens only
    block_table: torch.Tensor   # [B, max_blocks] int32, local pages
    local_lens: tuple[int, ...]
    token_slots: torch.Tensor   # [sum(local_lens)] int64: local slots, request after request, in position order
    visible_lens: torch.Tensor  # [T] int32: local keys each query row sees
    query_start_loc: torch.Tensor  # [B+1] int32, as the global problem's
    q_lens: tuple[int, ...]

    @property
    def local_starts(self) -> list[int]:
        return cumulative(list(self.local_lens))


def build_shard(problem: Problem, rank: int, world: int, interleave: int) -> DcpShard:
    """Rank ``rank``'s shard of ``problem`` (on the problem's device)."""
    if not 0 <= rank < world or interleave < 1:
        raise ValueError(f"build_shard: need 0 <= rank < world and interleave >= 1, got rank {rank}, "
                         f"world {world}, interleave {interleave}")
    meta, device = problem.meta, problem.device
    kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int64)
    local_lens = local_count(kv_lens, rank, world, interleave).tolist()
    gen = _page_generator(problem.workload.seed, rank)
    block_table, num_blocks = allocate_block_table(local_lens, meta.page_size, gen)
    local_slots = flat_token_slots(block_table, local_lens, meta.page_size).to(device)
    rows = []
    for b, (start, kv_len) in enumerate(zip(cumulative(list(meta.kv_lens)), meta.kv_lens)):
        positions = torch.arange(kv_len)
        rows.append(start + positions[rank_of(positions, world, interleave) == rank])
    global_slots = meta.token_slots[torch.cat(rows).to(meta.token_slots.device)] if rows else meta.token_slots[:0]
    cache = PagedCache.empty(problem.cache.layout, num_blocks, meta.page_size, device=device,
                             tensor_scale=problem.cache.tensor_scale)
    cache.rows()[local_slots] = problem.cache.rows()[global_slots.to(device)]
    visible = []
    for q_len, kv_len in zip(meta.q_lens, meta.kv_lens):
        seen = kv_len - q_len + 1 + torch.arange(q_len) if kv_len else torch.zeros(q_len, dtype=torch.int64)
        visible.append(local_count(seen.clamp(min=0), rank, world, interleave))
    return DcpShard(rank, world, interleave, cache, block_table.to(device), tuple(local_lens), local_slots,
                    torch.cat(visible).to(torch.int32).to(device), meta.query_start_loc, tuple(meta.q_lens))


def synthetic_shard(workload: Workload, rank: int, device: torch.device) -> tuple[torch.Tensor, DcpShard]:
    """Rank ``rank``'s queries ``[T, H, 576]`` and shard for timing long contexts, drawn on the device: random bf16
    latents (N(0, 1), never zeros) straight into the rank's pages, without building the global problem first.
    Every rank draws the same queries (seeded)."""
    if workload.layout != "bf16":
        raise ValueError(f"synthetic_shard draws bf16 caches only, not {workload.layout}")
    world, interleave, page = workload.dcp_world, workload.dcp_interleave, workload.page_size
    local_lens = local_count(torch.tensor(workload.kv_lens), rank, world, interleave).tolist()
    gen = _page_generator(workload.seed, rank)
    block_table, num_blocks = allocate_block_table(local_lens, page, gen)
    data = torch.randn(num_blocks * page, LATENT_DIM, device=device, dtype=torch.bfloat16)
    cache = PagedCache(get_layout("bf16"), data.view(torch.uint8).view(num_blocks, page, -1))
    torch.manual_seed(workload.seed)
    q = (0.5 * torch.randn(workload.total_q, workload.dims.num_heads, LATENT_DIM, device=device)).to(torch.bfloat16)
    visible = [local_count(kv - q_len + 1 + torch.arange(q_len), rank, world, interleave) if kv
               else torch.zeros(q_len, dtype=torch.int64) for q_len, kv in zip(workload.q_lens, workload.kv_lens)]
    query_start = torch.tensor(cumulative(list(workload.q_lens)), dtype=torch.int32, device=device)
    slots = flat_token_slots(block_table, local_lens, page).to(device)
    return q, DcpShard(rank, world, interleave, cache, block_table.to(device), tuple(local_lens), slots,
                       torch.cat(visible).to(torch.int32).to(device), query_start, tuple(workload.q_lens))
