"""Reference cache operations: write tokens into a paged cache, gather (and dequantize) them back.

``write_cache`` follows vLLM's ``concat_and_cache_mla``: token ``i`` goes to slot ``slot_mapping[i]``
(``block * page_size + offset``) and a negative slot is padding, skipped. ``gather_cache`` follows
``dequantize_k_cache_paged``: it reads the slots of a flattened token page table and decodes them.
"""

from __future__ import annotations

import torch

from mla_bench.layouts.base import PagedCache


def write_cache(cache: PagedCache, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Encode ``values`` ``[N, 576]`` and store row ``i`` at slot ``slot_mapping[i]`` (skipped when < 0)."""
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != values.shape[0]:
        raise ValueError(f"slot_mapping must be [N] for {values.shape[0]} tokens, got {list(slot_mapping.shape)}")
    slots = slot_mapping.to(device=cache.data.device, dtype=torch.int64)
    keep = slots >= 0
    if bool((slots[keep] >= cache.num_slots).any()):
        raise ValueError(f"slot_mapping points past the cache ({cache.num_slots} slots)")
    encoded = cache.layout.quantize(values[keep.to(values.device)], cache.tensor_scale).to(cache.data.device)
    cache.rows()[slots[keep]] = encoded


def gather_cache(cache: PagedCache, token_slots: torch.Tensor) -> torch.Tensor:
    """Decode the tokens at ``token_slots`` ``[M]`` into float64 ``[M, 576]``."""
    slots = token_slots.to(device=cache.data.device, dtype=torch.int64)
    if slots.numel() and (bool((slots < 0).any()) or bool((slots >= cache.num_slots).any())):
        raise ValueError(f"token slots must lie in [0, {cache.num_slots})")
    return cache.layout.dequantize(cache.rows()[slots], cache.tensor_scale)
