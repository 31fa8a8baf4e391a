"""Paged metadata: the block table and length arrays every MLA kernel reads.

``reference`` holds the plain builders (the ground truth), ``fast`` the vectorized device builders with no host
synchronization (checked against them by the metadata suite); ``PagedMetadata`` bundles what a Problem carries.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mla_bench.lengths import check_int, check_lengths, check_page_size
from mla_bench.metadata import reference


@dataclass
class PagedMetadata:
    """Per-batch metadata, host lengths plus device tensors.

    ``token_slots`` is the flattened token page table: the cache slot of every request's tokens, request
    after request (the slot mapping with which the cache was written).
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int
    num_blocks: int
    query_start_loc: torch.Tensor  # [B+1] int32 (qo_indptr)
    kv_start_loc: torch.Tensor     # [B+1] int32 (cu_seqlens_k)
    seq_lens: torch.Tensor         # [B] int32
    block_table: torch.Tensor      # [B, max pages + 1] int32, padding entries point at spare poisoned pages
    token_slots: torch.Tensor      # [sum(kv_lens)] int64

    def __post_init__(self) -> None:
        """The host fields checked as the builders check them (a negative kv_len or a page size of 0 constructed, for
        kernels to read); the lengths stored as tuples of Python ints. Queries may exceed a DCP shard's keys."""
        q_lens, kv_lens = check_lengths(self.q_lens, self.kv_lens, queries_may_exceed_keys=True)
        self.q_lens, self.kv_lens = q_lens, kv_lens
        check_page_size(self.page_size)
        check_int("PagedMetadata.num_blocks", self.num_blocks, 0)
        for name in ("query_start_loc", "kv_start_loc", "seq_lens", "block_table", "token_slots"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"PagedMetadata.{name} must be a tensor, got {type(getattr(self, name)).__name__}")

    @classmethod
    def build(cls, q_lens: tuple[int, ...], kv_lens: tuple[int, ...], page_size: int,
              generator: torch.Generator) -> "PagedMetadata":
        """Reference-built metadata with randomly permuted blocks, on the CPU; ValueError for lengths that break
        ``check_lengths`` (a query longer than its context, a negative length, counts of requests that differ)."""
        q_lens, kv_lens = check_lengths(q_lens, kv_lens)
        block_table, num_blocks = reference.allocate_block_table(list(kv_lens), page_size, generator)
        return cls(
            q_lens=q_lens, kv_lens=kv_lens, page_size=page_size, num_blocks=num_blocks,
            query_start_loc=torch.tensor(reference.cumulative(list(q_lens)), dtype=torch.int32),
            kv_start_loc=torch.tensor(reference.cumulative(list(kv_lens)), dtype=torch.int32),
            seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
            block_table=block_table,
            token_slots=reference.flat_token_slots(block_table, list(kv_lens), page_size),
        )

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def max_qo_len(self) -> int:
        return reference.max_qo_len(list(self.q_lens))

    @property
    def max_kv_len(self) -> int:
        return reference.max_kv_len(list(self.kv_lens))

    def to(self, device: torch.device | str) -> "PagedMetadata":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return PagedMetadata(**moved)


__all__ = ["PagedMetadata", "reference"]
