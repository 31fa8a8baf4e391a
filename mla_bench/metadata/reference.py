"""Reference builders of paged metadata: plain loops over requests, obviously right.

Conventions (vLLM / FlashInfer): ``query_start_loc`` (``qo_indptr``) ``[B+1]``, ``seq_lens`` ``[B]``,
block table ``[B, width]`` int32 (any width with room for every request: engines pad theirs, and the bench's
have a spare column), slot = ``block * page_size + offset``, token page table
``page_table_1[b, j] = block_table[b, j // ps] * ps + j % ps``. The new tokens of a step are the last ``q_len``
positions of each request (``kv_len - q_len + i``). Slots are int64; a slot of -1 means "no token" (padding, or
a token another DCP rank holds).

``mla_bench.metadata.fast`` builds the same tensors on the device without host synchronization; these are the
ground truth it is checked against.
"""

from __future__ import annotations

import torch

from mla_bench.errors import describe
from mla_bench.lengths import check_int, check_kv_lens, check_lengths, check_page_size


def cumulative(lengths: list[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: start offsets of ragged rows (query_start_loc, cu_seqlens_k)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def blocks_needed(kv_len: int, page_size: int) -> int:
    check_page_size(page_size)
    return -(-kv_len // page_size)


SPARE_BLOCKS = 2  # the pool's pages no request owns (``allocate_block_table``)


def allocate_block_table(kv_lens: list[int], page_size: int, generator: torch.Generator,
                         spare_blocks: int = SPARE_BLOCKS) -> tuple[torch.Tensor, int]:
    """Give each request its pages from a randomly permuted pool; returns ``(block_table, num_blocks)``.

    The pool holds ``spare_blocks`` pages no request owns; block-table entries past a request's last page
    point at one of them, so a kernel that reads beyond ``seq_len`` reads poison, not another request's data.
    The table is ``table_width`` wide, one spare column past the longest request's pages: a kernel that reads
    one block past any request's last page reads poison, not past its row (engines pad their tables too).
    Whatever the draw, pages 0 and ``num_blocks - 1`` are spares (a kernel that reads page ``j`` for block ``j``, a
    zeroed entry, or slot -1 as the cache's last slot reads poison) and no request's pages are consecutive
    ascending (a kernel that reads ``block_table[b, 0] + j`` fails).
    """
    if spare_blocks < 1:
        raise ValueError("spare_blocks must be >= 1: padding entries need a page no request owns")
    kv_lens = check_kv_lens(kv_lens)
    needed = [blocks_needed(n, page_size) for n in kv_lens]
    owned = sum(needed)
    num_blocks = owned + spare_blocks
    pool = torch.randperm(num_blocks, generator=generator)
    for i, page in enumerate((0, num_blocks - 1)[:spare_blocks]):
        at = int((pool == page).nonzero())
        pool[[at, owned + i]] = pool[[owned + i, at]]
    start = 0
    for n in needed:
        if n > 1 and bool((pool[start:start + n].diff() == 1).all()):
            pool[start:start + n] = pool[start:start + n].flip(0)
        start += n
    return assign_blocks(kv_lens, page_size, pool), num_blocks


def table_width(kv_lens: list[int], page_size: int) -> int:
    """Columns of the bench's block tables: the most pages any request needs, plus one spare column (so that even
    the longest request has an entry past its last page, pointing at a spare page)."""
    return max((blocks_needed(n, page_size) for n in kv_lens), default=0) + 1


def assign_blocks(kv_lens: list[int], page_size: int, pool: torch.Tensor) -> torch.Tensor:
    """The block table when request after request takes its pages from the front of ``pool`` (a permutation of
    the block ids); entry ``j`` past request ``b``'s last page is spare page ``(b + j) % spares`` of the pages
    left over. Width: ``table_width``, the most pages any request needs plus one, so that a kernel reading one
    block past the longest request's last page reads a spare (poisoned) page, not past the row: the next row's
    first page, or out of the table's bounds for the last row."""
    needed = [blocks_needed(n, page_size) for n in check_kv_lens(kv_lens)]
    pool = pool.tolist()
    if len(pool) <= sum(needed):
        raise ValueError(f"a pool of {len(pool)} blocks leaves no spare page after the {sum(needed)} the requests need")
    spare = pool[sum(needed):]
    width = table_width(kv_lens, page_size)
    rows, start = [], 0
    for b, n in enumerate(needed):
        rows.append(pool[start:start + n] + [spare[(b + j) % len(spare)] for j in range(n, width)])
        start += n
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)


def check_table(block_table: torch.Tensor, kv_lens: list[int], page_size: int,
                dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64)) -> None:
    """ValueError unless the page size is positive, ``kv_lens`` are lengths and ``block_table`` is a ``[B, width]``
    tensor of ``dtypes`` with room for every request's ``kv_len``: past its width a builder would index out of
    range, or read another row."""
    kv_lens = check_kv_lens(kv_lens)
    check_page_size(page_size)
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in dtypes or block_table.dim() != 2 \
            or block_table.shape[0] != len(kv_lens):
        raise ValueError(f"block_table must be {' or '.join(str(d) for d in dtypes)} [{len(kv_lens)}, max_blocks], "
                         f"got {describe(block_table)}")
    capacity = block_table.shape[1] * page_size
    too_long = [b for b, n in enumerate(kv_lens) if n > capacity]
    if too_long:
        b = too_long[0]
        raise ValueError(f"request {b}: kv_len {kv_lens[b]} exceeds the block table's capacity "
                         f"({block_table.shape[1]} blocks x page size {page_size} = {capacity} tokens)")


def check_block_table(block_table: torch.Tensor, kv_lens: list[int], page_size: int, num_blocks: int) -> None:
    """``check_table`` for an int32 table, and each entry a request reads (its first ``ceil(kv_len / page_size)``)
    names one of the cache's ``num_blocks`` pages: a kernel given a bad entry reads another request's page or
    faults, so ``plan`` refuses it."""
    check_table(block_table, kv_lens, page_size, dtypes=(torch.int32,))
    check_entries(block_table, kv_lens, page_size, num_blocks)


def check_entries(block_table: torch.Tensor, kv_lens: list[int], page_size: int,
                  num_blocks: int | None = None) -> None:
    """ValueError naming the first entry a request reads (its first ``ceil(kv_len / page_size)``) that is negative
    (its slots would be negative: -1 is the padding slot, whose tokens are dropped) or, given ``num_blocks``, past
    the cache's pages. Reads the table on the host (one copy out, nothing in); entries past a request's pages are
    not read, so may be anything. For a table ``check_table`` took."""
    table = block_table.cpu()
    used = torch.tensor([blocks_needed(n, page_size) for n in kv_lens], dtype=torch.int64)
    in_use = torch.arange(table.shape[1])[None, :] < used[:, None]
    outside = table < 0 if num_blocks is None else (table < 0) | (table >= num_blocks)
    bad = in_use & outside
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        where = f"points outside the cache ({num_blocks} blocks)" if num_blocks is not None else \
            "is negative: a request's pages must be block ids >= 0"
        raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} {where}")


def _check_read_table(block_table: torch.Tensor, kv_lens: list[int], page_size: int) -> None:
    """``check_table`` and ``check_entries``: what the builders below check before they read the table."""
    check_table(block_table, kv_lens, page_size)
    check_entries(block_table, kv_lens, page_size)


def check_topk(topk_indices: torch.Tensor, q_lens: list[int]) -> None:
    """ValueError unless the top-k indices are an integer ``[sum(q_lens), topk]`` tensor (one row a query token)."""
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dtype not in (torch.int32, torch.int64) \
            or topk_indices.dim() != 2 or topk_indices.shape[0] != sum(q_lens):
        raise ValueError(f"topk_indices must be int32 or int64 [{sum(q_lens)} query tokens, topk], got "
                         f"{describe(topk_indices)}")


def request_token_slots(block_table: torch.Tensor, b: int, kv_len: int, page_size: int) -> torch.Tensor:
    """Physical slots of request ``b``'s tokens: ``page_table_1[b, :kv_len]`` (int64, on the block table's device)."""
    positions = torch.arange(kv_len, dtype=torch.int64, device=block_table.device)
    return block_table[b].long()[positions // page_size] * page_size + positions % page_size


def flat_token_slots(block_table: torch.Tensor, kv_lens: list[int], page_size: int) -> torch.Tensor:
    """The flattened token page table: slots of all requests' tokens, request after request (int64)."""
    _check_read_table(block_table, kv_lens, page_size)
    parts = [request_token_slots(block_table, b, n, page_size) for b, n in enumerate(kv_lens)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def token_page_table(block_table: torch.Tensor, kv_lens: list[int], page_size: int) -> torch.Tensor:
    """``page_table_1`` ``[B, max kv_len]`` (int64): the slot of each request's token ``j``, -1 past its length."""
    _check_read_table(block_table, kv_lens, page_size)
    table = torch.full((len(kv_lens), max(kv_lens, default=0)), -1, dtype=torch.int64)
    for b, n in enumerate(kv_lens):
        table[b, :n] = request_token_slots(block_table, b, n, page_size)
    return table


def slot_mapping(q_lens: list[int], kv_lens: list[int], block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slots of the step's new tokens (the last ``q_len`` positions of each request), request after request; -1 for
    the queries of a padding request (``kv_len == 0``), which store nothing."""
    q_lens, kv_lens = check_lengths(q_lens, kv_lens)
    _check_read_table(block_table, kv_lens, page_size)
    slots = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        row = block_table[b].tolist()
        positions = range(kv_len - q_len, kv_len) if kv_len else [-1] * q_len  # a padding request stores nothing
        slots += [row[p // page_size] * page_size + p % page_size if p >= 0 else -1 for p in positions]
    return torch.tensor(slots, dtype=torch.int64)


def flashinfer_csr(kv_lens: list[int], block_table: torch.Tensor,
                   page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged KV as CSR, int32: ``kv_indptr`` ``[B+1]`` (page offsets), ``kv_indices`` (each request's
    pages in order) and ``kv_last_page_len`` ``[B]`` (tokens in the last page; 0 for a request with no page)."""
    _check_read_table(block_table, kv_lens, page_size)
    pages = [blocks_needed(n, page_size) for n in kv_lens]
    rows = block_table.tolist()
    indices = [page for row, n in zip(rows, pages) for page in row[:n]]
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)]
    return (torch.tensor(cumulative(pages), dtype=torch.int32), torch.tensor(indices, dtype=torch.int32),
            torch.tensor(last, dtype=torch.int32))


def block_table_from_csr(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, width: int) -> torch.Tensor:
    """The owned part of a block table back from FlashInfer's CSR; entries past a request's pages are -1."""
    rows = []
    for b in range(kv_indptr.numel() - 1):
        pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].tolist()
        rows.append(pages + [-1] * (width - len(pages)))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)


def block_table_from_token_table(table: torch.Tensor, kv_lens: list[int], page_size: int, width: int) -> torch.Tensor:
    """The owned part of a block table back from ``page_table_1``: page ``j`` is the slot of token ``j * ps`` over
    ``ps``; entries past a request's pages are -1."""
    out = torch.full((len(kv_lens), width), -1, dtype=torch.int32)
    for b, n in enumerate(kv_lens):
        for j in range(blocks_needed(n, page_size)):
            out[b, j] = int(table[b, j * page_size]) // page_size
    return out


def max_qo_len(q_lens: list[int]) -> int:
    """The longest query of the batch (not the last request's: ATOM shipped that bug); 0 for no request."""
    return max(q_lens, default=0)


def max_kv_len(kv_lens: list[int]) -> int:
    return max(kv_lens, default=0)


def transform_indices_paged(topk_indices: torch.Tensor, q_lens: list[int], kv_lens: list[int],
                            block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """PAGED transform: logical position -> physical slot ``page_table_1[req, idx]``; invalid -> -1."""
    q_lens, kv_lens = check_lengths(q_lens, kv_lens)
    _check_read_table(block_table, kv_lens, page_size)
    check_topk(topk_indices, q_lens)
    out = torch.full_like(topk_indices, -1)
    starts = cumulative(q_lens)
    for b, kv_len in enumerate(kv_lens):
        rows = topk_indices[starts[b]:starts[b + 1]].long()
        valid = (rows >= 0) & (rows < kv_len)
        safe = torch.where(valid, rows, 0)
        blocks = block_table[b].long()[safe // page_size]
        slots = torch.where(valid, blocks * page_size + safe % page_size, -1)
        _check_slots_fit(slots, out.dtype, b, rows, starts[b], page_size)
        out[starts[b]:starts[b + 1]] = slots.to(out.dtype)
    return out


def _check_slots_fit(slots: torch.Tensor, dtype: torch.dtype, b: int, rows: torch.Tensor, first_token: int,
                     page_size: int) -> None:
    """ValueError naming the block-table entry of request ``b`` whose slot (``slots``, int64, of the top-k positions
    ``rows`` of tokens from ``first_token``) exceeds ``dtype``'s range: the cast to it would wrap it into another,
    valid slot."""
    top = torch.iinfo(dtype).max
    over = slots > top
    if bool(over.any()):
        t, k = (int(i) for i in over.nonzero()[0])
        raise ValueError(f"token {first_token + t}, top-k index {k}: position {int(rows[t, k])} is in "
                         f"block_table[{b}, {int(rows[t, k]) // page_size}], whose slot {int(slots[t, k])} exceeds "
                         f"{dtype}'s largest value {top} (the indices' dtype, which the slot would wrap in)")


def transform_indices_ragged(topk_indices: torch.Tensor, q_lens: list[int], kv_lens: list[int]) -> torch.Tensor:
    """RAGGED transform: logical position -> row of the request-after-request gathered K; invalid -> -1."""
    q_lens, kv_lens = check_lengths(q_lens, kv_lens)
    check_topk(topk_indices, q_lens)
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
    check_dcp_rank(rank, world, interleave)
    return _dcp_local_len(kv_len, rank, world, interleave)


def _dcp_local_len(kv_len: int, rank: int, world: int, interleave: int) -> int:
    """``dcp_local_len`` of a rank already checked."""
    base = (kv_len // interleave // world) * interleave
    rem = kv_len - base * world
    return base + min(max(rem - rank * interleave, 0), interleave)


def dcp_local_position(position: int, world: int, interleave: int) -> int:
    """Where global token ``position`` sits among the tokens its rank holds (they keep their global order)."""
    return (position // (interleave * world)) * interleave + position % interleave


def check_dcp_rank(rank: int, world: int, interleave: int) -> None:
    """ValueError unless ``rank``, ``world`` and ``interleave`` are ints (Python or numpy, not bools: a float made
    float lengths, a string a bare TypeError), ``world >= 1``, ``interleave >= 1`` and ``0 <= rank < world``."""
    for name, value in (("rank", rank), ("world", world), ("interleave", interleave)):
        check_int(f"DCP {name}", value)
    if world < 1 or interleave < 1 or not 0 <= rank < world:
        raise ValueError(f"DCP needs world >= 1, interleave >= 1 and 0 <= rank < world; got rank={rank}, "
                         f"world={world}, interleave={interleave}")


def check_dcp(page_size: int, world: int, interleave: int, rank: int = 0) -> None:
    """DCP layouts this bench (and vLLM) support: a valid rank (``check_dcp_rank``) and an interleave that divides
    the page size."""
    check_dcp_rank(rank, world, interleave)
    check_page_size(page_size)
    if page_size % interleave:
        raise ValueError(f"DCP needs an interleave that divides the page size; got interleave={interleave}, "
                         f"page_size={page_size}")


def dcp_slot_mapping(q_lens: list[int], kv_lens: list[int], block_table: torch.Tensor, page_size: int, rank: int,
                     world: int, interleave: int) -> torch.Tensor:
    """Slots on ``rank`` of the step's new tokens: a token the rank holds goes to its local position in the
    request's pages (every rank uses the same block table); tokens other ranks hold get -1."""
    q_lens, kv_lens = check_lengths(q_lens, kv_lens)
    check_dcp(page_size, world, interleave, rank)
    try:
        _check_read_table(block_table, [_dcp_local_len(n, rank, world, interleave) for n in kv_lens], page_size)
    except ValueError as exc:
        raise ValueError(f"DCP rank {rank} of {world} (kv_len: the tokens this rank holds): {exc}") from None
    slots = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        positions = range(kv_len - q_len, kv_len) if kv_len else [-1] * q_len  # a padding request stores nothing
        for position in positions:
            if position < 0 or dcp_rank_of_position(position, world, interleave) != rank:
                slots.append(-1)
                continue
            local = dcp_local_position(position, world, interleave)
            slots.append(int(block_table[b, local // page_size]) * page_size + local % page_size)
    return torch.tensor(slots, dtype=torch.int64)


def build_step(q_lens: list[int], kv_lens: list[int], block_table: torch.Tensor,
               page_size: int) -> dict[str, torch.Tensor]:
    """Everything a decode/prefill step needs, built on the host (the ground truth of ``fast.build_step``)."""
    kv_indptr, kv_indices, last_page_len = flashinfer_csr(kv_lens, block_table, page_size)
    return {
        "query_start_loc": torch.tensor(cumulative(q_lens), dtype=torch.int32),
        "kv_start_loc": torch.tensor(cumulative(kv_lens), dtype=torch.int32),
        "seq_lens": torch.tensor(kv_lens, dtype=torch.int32),
        "slot_mapping": slot_mapping(q_lens, kv_lens, block_table, page_size),
        "kv_indptr": kv_indptr,
        "kv_indices": kv_indices,
        "kv_last_page_len": last_page_len,
        "token_slots": flat_token_slots(block_table, kv_lens, page_size),
        "max_qo_len": torch.tensor(max_qo_len(q_lens), dtype=torch.int32),
        "max_kv_len": torch.tensor(max_kv_len(kv_lens), dtype=torch.int32),
    }
