"""Fast builders of paged metadata: vectorized torch on the metadata's device, with no host synchronization.

Nothing here reads a device value on the host: no ``.item()``, ``.tolist()``, ``nonzero``, boolean-mask indexing
or output shape that depends on device data. Where an output's size depends on the lengths (new tokens, pages,
cached tokens, the widest request), the caller passes it from the lengths the scheduler already holds on the
host (``HostSizes``), as engines do. Each builder equals its namesake in ``mla_bench.metadata.reference`` (checked
by the metadata suite on thousands of random request mixes), and the tests run them on the ``meta`` device, where
any host read raises. ``impls/triton/kv_indices.py`` has a Triton kernel for ``kv_indices``.

Every request-indexed input is a 1-D int tensor on one device; ``block_table`` is ``[B, width]`` int32. Each public
builder checks what the host knows once (page size, dtypes, shapes, one batch size: ``check_inputs``) and calls the
unchecked ``_`` helpers; lengths beyond the block table are the caller's to refuse (``reference.check_table`` on the
host lengths), as reading them would synchronize. So are the block table's entries: a negative one gives negative
slots (read as -1 padding: tokens dropped), and one whose slots pass int32 wraps into valid slots where
``transform_indices_paged`` casts to int32 indices (``reference.check_entries`` refuses the first on the host table;
the reference builders refuse both). Sums past int32 (``cumulative``) wrap likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mla_bench.errors import describe
from mla_bench.lengths import check_int, check_lengths, check_page_size
from mla_bench.metadata.reference import blocks_needed, check_dcp, check_dcp_rank, table_width

_TWO_DIMENSIONAL = ("block_table", "topk_indices")
_NOT_PER_REQUEST = ("topk_indices", "pool")  # inputs whose first dimension is not the batch


@dataclass(frozen=True)
class HostSizes:
    """Sizes of a step's metadata, from the host-side lengths (what a scheduler knows without the device)."""

    num_tokens: int     # new tokens of the step (sum of q_lens)
    num_pages: int      # pages the requests own (length of FlashInfer's kv_indices)
    num_kv_tokens: int  # cached tokens (length of the flattened token page table)
    table_width: int    # block table columns: the longest request's pages + 1 spare (reference.table_width)
    max_kv_len: int     # width of the token page table

    def __post_init__(self) -> None:
        """Each size an int >= 0: a negative or float size failed deep in torch (IndexError, RuntimeError)."""
        for name in ("num_tokens", "num_pages", "num_kv_tokens", "table_width", "max_kv_len"):
            check_int(f"HostSizes.{name}", getattr(self, name), 0)

    @classmethod
    def of(cls, q_lens: list[int], kv_lens: list[int], page_size: int) -> "HostSizes":
        """The sizes of lengths checked as ``check_lengths`` does (a negative kv_len made a negative page count;
        queries may exceed a DCP shard's keys)."""
        q_lens, kv_lens = check_lengths(q_lens, kv_lens, queries_may_exceed_keys=True)
        check_page_size(page_size)
        pages = [blocks_needed(n, page_size) for n in kv_lens]
        return cls(num_tokens=sum(q_lens), num_pages=sum(pages), num_kv_tokens=sum(kv_lens),
                   table_width=table_width(kv_lens, page_size), max_kv_len=max(kv_lens, default=0))


def check_inputs(page_size: int | None = None, **inputs: torch.Tensor) -> None:
    """ValueError naming the input unless ``page_size`` (when given) is a positive int and every input is an int32 or
    int64 tensor of its rank (``block_table`` and ``topk_indices`` 2-D, the rest 1-D) whose first dimension counts
    the same requests (``B + 1`` for names ending in ``_loc`` or ``indptr``). Host metadata only: nothing is read."""
    if page_size is not None:
        check_page_size(page_size)
    batches = {}
    for name, value in inputs.items():
        dims = 2 if name in _TWO_DIMENSIONAL else 1
        if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64) or value.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D int32 or int64 tensor, got {describe(value)}")
        if name not in _NOT_PER_REQUEST:
            batches[name] = value.shape[0] - name.endswith(("_loc", "indptr"))
    if len(set(batches.values())) > 1:
        raise ValueError("inputs of different batch sizes: " + ", ".join(f"{name} holds {count} requests"
                                                                       for name, count in batches.items()))


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` (int32 ``[B+1]``): query_start_loc / qo_indptr, cu_seqlens_k, kv_indptr. The sum is
    written in place after the leading 0 (padding a cumsum would cost a device-to-device copy)."""
    check_inputs(lengths=lengths)
    return _cumulative(lengths)


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, dtype=torch.int32, out=out[1:])
    return out


def pages_per_request(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    check_inputs(page_size, seq_lens=seq_lens)
    return _pages_per_request(seq_lens, page_size)


def _pages_per_request(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return (seq_lens + page_size - 1) // page_size


def max_len(lengths: torch.Tensor) -> torch.Tensor:
    """The longest length of the batch as a 0-d device tensor (max_qo_len, max_kv_len); 0 for no request."""
    check_inputs(lengths=lengths)
    return _max_len(lengths)


def _max_len(lengths: torch.Tensor) -> torch.Tensor:
    return lengths.max() if lengths.shape[0] else lengths.new_zeros(())


def owners(starts: torch.Tensor, count: int) -> torch.Tensor:
    """The request (int64) of each of ``count`` ragged rows, given the rows' start offsets ``[B+1]``; empty requests
    own no row."""
    rows = torch.arange(count, dtype=starts.dtype, device=starts.device)
    return torch.searchsorted(starts[1:].contiguous(), rows, right=True)


def block_table_from_pool(seq_lens: torch.Tensor, page_size: int, pool: torch.Tensor, sizes: HostSizes) -> torch.Tensor:
    """``reference.assign_blocks``: request after request takes its pages from the front of ``pool``; entries past a
    request's pages point at spare pages. The host's ``sizes`` give the width (one spare column past the longest
    request) and the pages the requests own, which must leave ``pool`` a spare page: checked on the host, since on
    CUDA the spare entries' remainder by no spare page would be undefined, not an error."""
    check_inputs(page_size, seq_lens=seq_lens, pool=pool)
    if pool.shape[0] <= sizes.num_pages:
        raise ValueError(f"a pool of {pool.shape[0]} blocks leaves no spare page after the {sizes.num_pages} the "
                         f"requests need")
    needed = _pages_per_request(seq_lens.long(), page_size)
    starts = torch.cumsum(needed, 0) - needed
    total = needed.sum()
    column = torch.arange(sizes.table_width, device=pool.device)[None, :]
    request = torch.arange(seq_lens.shape[0], device=pool.device)[:, None]
    spare = total + (request + column) % (pool.shape[0] - total)
    return pool[torch.where(column < needed[:, None], starts[:, None] + column, spare)].to(torch.int32)


def _new_token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position in the request) of each new token; the position is < 0 for a padding request's queries."""
    request = owners(query_start_loc, num_tokens)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    index = torch.arange(num_tokens, device=request.device) - query_start_loc[request]
    return request, seq_lens[request].long() - q_lens[request] + index


def slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int,
                 num_tokens: int) -> torch.Tensor:
    """``reference.slot_mapping``: slots (int64) of the step's new tokens, -1 for a padding request's queries."""
    check_inputs(page_size, query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table)
    check_int("num_tokens", num_tokens, 0)
    return _slot_mapping(query_start_loc, seq_lens, block_table, page_size, num_tokens)


def _slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int,
                  num_tokens: int) -> torch.Tensor:
    request, position = _new_token_positions(query_start_loc, seq_lens, num_tokens)
    safe = position.clamp(min=0)
    slots = block_table[request, safe // page_size].long() * page_size + safe % page_size
    return torch.where(position >= 0, slots, -1)


def kv_indices(kv_indptr: torch.Tensor, block_table: torch.Tensor, num_pages: int) -> torch.Tensor:
    """FlashInfer's ``kv_indices`` (int32): each request's pages in order, ``num_pages`` of them in all."""
    check_inputs(kv_indptr=kv_indptr, block_table=block_table)
    check_int("num_pages", num_pages, 0)
    return _kv_indices(kv_indptr, block_table, num_pages)


def _kv_indices(kv_indptr: torch.Tensor, block_table: torch.Tensor, num_pages: int) -> torch.Tensor:
    request = owners(kv_indptr, num_pages)
    column = torch.arange(num_pages, device=kv_indptr.device) - kv_indptr[request]
    return block_table[request, column].to(torch.int32)


def flashinfer_csr(seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int, num_pages: int,
                   indices: Callable = _kv_indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.flashinfer_csr``: ``(kv_indptr, kv_indices, kv_last_page_len)`` (FlashInfer MLA's ``kv_len_arr`` is
    ``seq_lens`` itself); ``indices`` builds kv_indices (this module's, or the Triton kernel)."""
    check_inputs(page_size, seq_lens=seq_lens, block_table=block_table)
    check_int("num_pages", num_pages, 0)
    return _flashinfer_csr(seq_lens, block_table, page_size, num_pages, indices)


def _flashinfer_csr(seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int, num_pages: int,
                    indices: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pages = _pages_per_request(seq_lens, page_size)
    indptr = _cumulative(pages)
    last = torch.where(pages > 0, seq_lens - (pages - 1) * page_size, 0).to(torch.int32)
    return indptr, indices(indptr, block_table, num_pages), last


def token_page_table(seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int, width: int) -> torch.Tensor:
    """``reference.token_page_table``: ``page_table_1`` ``[B, width]`` (int64), -1 past each request's length."""
    check_inputs(page_size, seq_lens=seq_lens, block_table=block_table)
    if check_int("width", width, 0) > block_table.shape[1] * page_size:
        raise ValueError(f"token_page_table: width {width} exceeds the block table's capacity ({block_table.shape[1]} "
                         f"blocks x page size {page_size})")
    column = torch.arange(width, device=block_table.device)
    slots = block_table[:, column // page_size].long() * page_size + column % page_size
    return torch.where(column[None, :] < seq_lens[:, None], slots, -1)


def flat_token_slots(kv_start_loc: torch.Tensor, block_table: torch.Tensor, page_size: int,
                     num_kv_tokens: int) -> torch.Tensor:
    """``reference.flat_token_slots``: every request's token slots (int64), request after request."""
    check_inputs(page_size, kv_start_loc=kv_start_loc, block_table=block_table)
    check_int("num_kv_tokens", num_kv_tokens, 0)
    return _flat_token_slots(kv_start_loc, block_table, page_size, num_kv_tokens)


def _flat_token_slots(kv_start_loc: torch.Tensor, block_table: torch.Tensor, page_size: int,
                      num_kv_tokens: int) -> torch.Tensor:
    request = owners(kv_start_loc, num_kv_tokens)
    position = torch.arange(num_kv_tokens, device=kv_start_loc.device) - kv_start_loc[request]
    return block_table[request, position // page_size].long() * page_size + position % page_size


def dcp_local_lens(seq_lens: torch.Tensor, rank: int, world: int, interleave: int) -> torch.Tensor:
    """``reference.dcp_local_len`` for every request: the tokens ``rank`` holds."""
    check_dcp_rank(rank, world, interleave)
    check_inputs(seq_lens=seq_lens)
    base = seq_lens // interleave // world * interleave
    return base + (seq_lens - base * world - rank * interleave).clamp(0, interleave)


def dcp_slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     page_size: int, num_tokens: int, rank: int, world: int, interleave: int) -> torch.Tensor:
    """``reference.dcp_slot_mapping``, computed as vLLM does: block-table entry ``j`` covers the global positions of
    a virtual page of ``page_size * world`` tokens, of which ``rank`` holds ``page_size``."""
    check_dcp(page_size, world, interleave, rank)
    check_inputs(page_size, query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table)
    check_int("num_tokens", num_tokens, 0)
    request, position = _new_token_positions(query_start_loc, seq_lens, num_tokens)
    virtual = page_size * world
    safe = position.clamp(min=0)
    offset = safe % virtual
    mine = (position >= 0) & ((offset // interleave) % world == rank)
    local = offset // (world * interleave) * interleave + offset % interleave
    # Another rank's token may lie past the pages this rank's table holds: read column 0 for it, never past the row.
    slots = block_table[request, torch.where(mine, safe // virtual, 0)].long() * page_size + local
    return torch.where(mine, slots, -1)


def transform_indices_paged(topk_indices: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """PAGED: each query token's top-k positions -> cache slots of its request; invalid (< 0 or >= kv_len) -> -1.
    Slots are cast to the indices' dtype unchecked (see the module's docstring; the reference refuses overflow)."""
    check_inputs(page_size, topk_indices=topk_indices, query_start_loc=query_start_loc, seq_lens=seq_lens,
                 block_table=block_table)
    request = owners(query_start_loc, topk_indices.shape[0])
    index = topk_indices.long()
    valid = (index >= 0) & (index < seq_lens[request][:, None])
    safe = torch.where(valid, index, 0)
    slots = block_table[request[:, None], safe // page_size].long() * page_size + safe % page_size
    return torch.where(valid, slots, -1).to(topk_indices.dtype)


def transform_indices_ragged(topk_indices: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             kv_start_loc: torch.Tensor) -> torch.Tensor:
    """RAGGED: positions -> rows of the request-after-request gathered K (``idx + cu_seqlens_k[req]``); invalid
    -> -1."""
    check_inputs(topk_indices=topk_indices, query_start_loc=query_start_loc, seq_lens=seq_lens,
                 kv_start_loc=kv_start_loc)
    request = owners(query_start_loc, topk_indices.shape[0])
    index = topk_indices.long()
    valid = (index >= 0) & (index < seq_lens[request][:, None])
    return torch.where(valid, index + kv_start_loc[request][:, None], -1).to(topk_indices.dtype)


def build_step(lengths: torch.Tensor, block_table: torch.Tensor, page_size: int, sizes: HostSizes,
               indices: Callable = _kv_indices) -> dict[str, torch.Tensor]:
    """Everything a decode/prefill step needs, from ``lengths`` ``[2, B]`` int32 (q_lens; kv_lens) already on the
    device (one host-to-device copy) and the persistent device block table. Equals ``reference.build_step``."""
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 2 or lengths.shape[0] != 2:
        raise ValueError(f"lengths must be [2, B] (q_lens; kv_lens), got {describe(lengths)}")
    if lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 (the metadata's dtype), got {describe(lengths)}")
    q_lens, seq_lens = lengths[0], lengths[1]
    check_inputs(page_size, lengths=q_lens, block_table=block_table)
    query_start_loc, kv_start_loc = _cumulative(q_lens), _cumulative(seq_lens)
    kv_indptr, kv_indices_, last_page_len = _flashinfer_csr(seq_lens, block_table, page_size, sizes.num_pages, indices)
    return {
        "query_start_loc": query_start_loc,
        "kv_start_loc": kv_start_loc,
        "seq_lens": seq_lens,
        "slot_mapping": _slot_mapping(query_start_loc, seq_lens, block_table, page_size, sizes.num_tokens),
        "kv_indptr": kv_indptr,
        "kv_indices": kv_indices_,
        "kv_last_page_len": last_page_len,
        "token_slots": _flat_token_slots(kv_start_loc, block_table, page_size, sizes.num_kv_tokens),
        "max_qo_len": _max_len(q_lens),
        "max_kv_len": _max_len(seq_lens),
    }


def step_of(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int,
            q_lens: list[int], kv_lens: list[int]) -> dict[str, torch.Tensor]:
    """``build_step`` on device metadata: the lengths stacked on the device (q_lens from ``query_start_loc``), the
    sizes from the host lengths ``q_lens`` and ``kv_lens``."""
    lengths = torch.stack([query_start_loc.diff(), seq_lens]).to(torch.int32)
    return build_step(lengths, block_table, page_size, HostSizes.of(list(q_lens), list(kv_lens), page_size))
