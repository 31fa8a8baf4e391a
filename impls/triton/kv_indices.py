"""FlashInfer's ``kv_indices`` from the block table, as a Triton kernel (one program per request).

The per-step index generation that ATOM moved into a Triton kernel: each program copies its request's page ids
``block_table[b, :pages_b]`` to ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``. Equals
``mla_bench.metadata.fast.kv_indices``; like it, takes the total page count from the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from impls.triton import common


@triton.jit
def _kv_indices_kernel(kv_indptr_ptr, block_table_ptr, table_stride, width, out_ptr, num_pages,
                       BLOCK: tl.constexpr):
    request = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + request)
    count = tl.load(kv_indptr_ptr + request + 1) - start
    row = block_table_ptr + request.to(tl.int64) * table_stride
    for first in range(0, count, BLOCK):
        column = first + tl.arange(0, BLOCK)
        # never past the row or the output, whatever kv_indptr says (the host does not read it)
        inside = (column < count) & (column < width) & (start + column < num_pages)
        tl.store(out_ptr + start + column, tl.load(row + column, mask=inside), mask=inside)


def kv_indices_triton(kv_indptr: torch.Tensor, block_table: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``kv_indices`` (int32 ``[num_pages]``) for ``kv_indptr`` ``[B+1]`` int32 and ``block_table`` ``[B, width]``
    int32 on one device; no host synchronization."""
    if kv_indptr.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise ValueError(f"kv_indices_triton: kv_indptr and block_table must be int32, got {kv_indptr.dtype} and "
                         f"{block_table.dtype}")
    if block_table.dim() != 2 or kv_indptr.shape != (block_table.shape[0] + 1,) or block_table.stride(1) != 1 \
            or not kv_indptr.is_contiguous():
        raise ValueError(f"kv_indices_triton: expected a contiguous kv_indptr [B+1] and a row-contiguous block_table "
                         f"[B, width], got {list(kv_indptr.shape)} and {list(block_table.shape)}")
    out = torch.empty(num_pages, dtype=torch.int32, device=block_table.device)
    if block_table.shape[0]:
        with common.on_device(block_table.device):
            _kv_indices_kernel[(block_table.shape[0],)](kv_indptr, block_table, block_table.stride(0),
                                                         block_table.shape[1], out, num_pages, BLOCK=128)
    return out
