"""Reference cache operations: write tokens into a paged cache, gather (and dequantize) them back.

``write_cache`` follows vLLM's ``concat_and_cache_mla``: token ``i`` goes to slot ``slot_mapping[i]``
(``block * page_size + offset``) and a negative slot is padding, skipped. ``gather_cache`` follows
``dequantize_k_cache_paged``: it reads the slots of a flattened token page table and decodes them.
"""

from __future__ import annotations

import torch

from mla_bench.errors import check_tensors, describe
from mla_bench.layouts.base import PagedCache


def write_cache(cache: PagedCache, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Encode ``values`` ``[N, 576]`` and store row ``i`` at slot ``slot_mapping[i]`` (skipped when < 0). Two tokens
    for one slot are refused: which one a kernel keeps is a race."""
    check_cache("write_cache", cache, values=values, slot_mapping=slot_mapping)
    if not isinstance(values, torch.Tensor) or values.dim() != 2:
        raise ValueError(f"values must be a tensor [N, 576], got {describe(values)}")
    cache.layout.check_dtype(values)  # before the padding rows are zeroed: torch.where promoted a bool to int64
    check_slots("slot_mapping", slot_mapping, values.shape[0])
    slots = slot_mapping.to(device=cache.data.device, dtype=torch.int64)
    keep = slots >= 0
    kept = slots[keep]
    if bool((kept >= cache.num_slots).any()):
        raise ValueError(f"slot_mapping points past the cache ({cache.num_slots} slots)")
    check_distinct_slots(kept)
    # padding rows may hold anything (never checked, never written): zeroed rather than dropped, so that a refusal
    # names a bad value by its token, as ``write_cache_triton`` does
    written = keep.to(values.device)
    encoded = cache.layout.quantize(torch.where(written[:, None], values, 0), cache.tensor_scale)[written]
    cache.rows()[kept] = encoded.to(cache.data.device)


def gather_cache(cache: PagedCache, token_slots: torch.Tensor) -> torch.Tensor:
    """Decode the tokens at ``token_slots`` ``[M]`` into float64 ``[M, 576]``."""
    check_cache("gather_cache", cache, token_slots=token_slots)
    check_slots("token_slots", token_slots)
    slots = token_slots.to(device=cache.data.device, dtype=torch.int64)
    check_slots_in_cache("token slots", slots, cache.num_slots)
    return cache.layout.dequantize(cache.rows()[slots], cache.tensor_scale)


def check_cache(who: str, cache: PagedCache, **tensors: torch.Tensor) -> None:
    """ValueError, prefixed ``who``, unless ``cache`` is a PagedCache and its data and each of ``tensors`` a tensor
    off the meta device (``check_tensors``)."""
    if not isinstance(cache, PagedCache):
        raise ValueError(f"{who}: cache must be a PagedCache, got {describe(cache)}")
    check_tensors(who, **{"cache.data": cache.data}, **tensors)


def check_slots(name: str, slots: torch.Tensor, count: int | None = None) -> None:
    """ValueError unless ``slots`` is a contiguous int32 or int64 ``[count]`` tensor (a float slot would be
    truncated to another slot, a bool taken as 0 / 1; a kernel reads a strided view's memory as if contiguous, so
    the slots checked would not be the slots written). Reads no value."""
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1 \
            or (count is not None and slots.shape[0] != count) or not slots.is_contiguous():
        strides = f" with strides {list(slots.stride())}" if isinstance(slots, torch.Tensor) else ""
        raise ValueError(f"{name} must be a contiguous int32 or int64 tensor [{'N' if count is None else count}], "
                         f"got {describe(slots)}{strides}")


def check_slots_in_cache(name: str, slots: torch.Tensor, num_slots: int) -> None:
    """ValueError unless every one of ``slots`` lies in the cache's ``[0, num_slots)``: a kernel reads a slot outside
    it as another token's row, or past the cache. Reads the slots' range on the host."""
    if slots.numel():
        lo, hi = (int(v) for v in torch.stack([slots.min(), slots.max()]).tolist())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"{name} must lie in the cache's [0, {num_slots}), got [{lo}, {hi}]")


def check_distinct_slots(slots: torch.Tensor) -> None:
    """ValueError if two of the (non-negative) ``slots`` a write keeps are one slot: which token a kernel keeps is a
    race. Reads the slots on the host."""
    unique, counts = slots.unique(return_counts=True)
    shared = (counts > 1).nonzero().flatten()
    if shared.numel():
        raise ValueError(f"slot_mapping writes {int(counts[shared[0]])} tokens to slot {int(unique[shared[0]])}")
