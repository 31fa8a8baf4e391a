"""Reference builders of paged metadata: plain loops over requests, obviously right.

Conventions (vLLM / FlashInfer): ``query_start_loc`` (``qo_indptr``) ``[B+1]``, ``seq_lens`` ``[B]``,
block table ``[B, max_blocks]`` int32, slot = ``block * page_size + offset``, token page table
``page_table_1[b, j] = block_table[b, j // ps] * ps + j % ps``.
"""

from __future__ import annotations

import torch


def cumulative(lengths: list[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: start offsets of ragged rows (query_start_loc, cu_seqlens_k)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def blocks_needed(kv_len: int, page_size: int) -> int:
    return -(-kv_len // page_size)


def allocate_block_table(kv_lens: list[int], page_size: int, generator: torch.Generator,
                         spare_blocks: int = 2) -> tuple[torch.Tensor, int]:
    """Give each request its pages from a randomly permuted pool; returns ``(block_table, num_blocks)``.

    The pool holds ``spare_blocks`` pages no request owns; block-table entries past a request's last page
    point at one of them, so a kernel that reads beyond ``seq_len`` reads poison, not another request's data.
    """
    if spare_blocks < 1:
        raise ValueError("spare_blocks must be >= 1: padding entries need a page no request owns")
    needed = [blocks_needed(n, page_size) for n in kv_lens]
    num_blocks = sum(needed) + spare_blocks
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    spare = pool[sum(needed):]
    width = max(max(needed), 1)
    rows, start = [], 0
    for b, n in enumerate(needed):
        rows.append(pool[start:start + n] + [spare[(b + j) % len(spare)] for j in range(n, width)])
        start += n
    return torch.tensor(rows, dtype=torch.int32), num_blocks


def request_token_slots(block_table: torch.Tensor, b: int, kv_len: int, page_size: int) -> torch.Tensor:
    """Physical slots of request ``b``'s tokens: ``page_table_1[b, :kv_len]`` (int64)."""
    positions = torch.arange(kv_len, dtype=torch.int64, device=block_table.device)
    return block_table[b].long()[positions // page_size] * page_size + positions % page_size


def flat_token_slots(block_table: torch.Tensor, kv_lens: list[int], page_size: int) -> torch.Tensor:
    """The flattened token page table: slots of all requests' tokens, request after request (int64)."""
    parts = [request_token_slots(block_table, b, n, page_size) for b, n in enumerate(kv_lens)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def max_qo_len(q_lens: list[int]) -> int:
    """The longest query of the batch (not the last request's: ATOM shipped that bug)."""
    return max(q_lens)


def transform_indices_paged(topk_indices: torch.Tensor, q_lens: list[int], kv_lens: list[int],
                            block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """PAGED transform: logical position -> physical slot ``page_table_1[req, idx]``; invalid -> -1."""
    out = torch.full_like(topk_indices, -1)
    starts = cumulative(q_lens)
    for b, kv_len in enumerate(kv_lens):
        rows = topk_indices[starts[b]:starts[b + 1]].long()
        valid = (rows >= 0) & (rows < kv_len)
        safe = torch.where(valid, rows, 0)
        blocks = block_table[b].long()[safe // page_size]
        slots = blocks * page_size + safe % page_size
        out[starts[b]:starts[b + 1]] = torch.where(valid, slots, -1).to(out.dtype)
    return out


def transform_indices_ragged(topk_indices: torch.Tensor, q_lens: list[int], kv_lens: list[int]) -> torch.Tensor:
    """RAGGED transform: logical position -> row of the request-after-request gathered K; invalid -> -1."""
    out = torch.full_like(topk_indices, -1)
    q_starts, kv_starts = cumulative(q_lens), cumulative(kv_lens)
    for b, kv_len in enumerate(kv_lens):
        rows = topk_indices[q_starts[b]:q_starts[b + 1]].long()
        valid = (rows >= 0) & (rows < kv_len)
        out[q_starts[b]:q_starts[b + 1]] = torch.where(valid, rows + kv_starts[b], -1).to(out.dtype)
    return out


def dcp_rank_of_position(position: int, world: int, interleave: int) -> int:
    """Decode context parallel: token ``t`` lives on rank ``(t // I) % W``."""
    return (position // interleave) % world


def dcp_local_len(kv_len: int, rank: int, world: int, interleave: int) -> int:
    """Tokens of a request of length ``kv_len`` held by ``rank`` (vLLM's ``get_dcp_local_seq_lens``)."""
    base = (kv_len // interleave // world) * interleave
    rem = kv_len - base * world
    return base + min(max(rem - rank * interleave, 0), interleave)
