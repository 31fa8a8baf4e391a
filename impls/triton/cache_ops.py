"""Cache ops as Triton kernels, for every cache layout: write tokens into a paged cache, gather them back.

- ``write_cache_triton(cache, values, slot_mapping)``: vLLM's ``concat_and_cache_mla``. Row ``i`` of ``values``
  ``[N, 576]`` (``[kv_c | k_pe]``, fp32 / bf16 / fp16, rows may be strided) is encoded and stored at slot
  ``slot_mapping[i]`` (``block * page_size + offset``); a negative slot is padding and is skipped. The bytes equal
  ``cache.layout.quantize`` exactly.
- ``gather_cache_triton(cache, token_slots, out_dtype)``: SGLang's ``dequantize_k_cache_paged``. Reads the slots
  of a flattened token page table and returns ``[M, 576]`` in ``out_dtype``: the reference dequantization rounded
  to fp32 (exact wherever fp32 can hold it), and for bf16 that fp32 value rounded to bf16 (what an engine that
  dequantizes in fp32 returns).

NaN/Inf inputs are refused by default, like the reference codec, before anything is written; with
``propagate_nonfinite=True`` they are written as the codec writes them (NaN that decodes as NaN). The flag never
reaches the kernels: they always encode non-finite values the codec's way, and the flag only decides whether the
host-side check refuses them first. That check, the slot range check and the refusal of two tokens for one slot
(as ``write_cache``) share one host synchronization; ``validate=False`` skips them (for timing or graph capture):
non-finite values are then written as if propagated, and out-of-range or shared slots are the caller's bug.

On CPU the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before this module is imported.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy
import torch
from triton.runtime.interpreter import InterpretedFunction

from impls.triton import cache_ops_kernels as kernels
from impls.triton import common
from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import LATENT_DIM, LAYOUTS, NOPE_DIM, CacheLayout, PagedCache
from mla_bench.layouts.base import check_tensor_scale
from mla_bench.layouts.ops import check_distinct_slots, check_slots, check_slots_in_cache

WRITE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GATHER_DTYPES = (torch.float32, torch.bfloat16)
INTERPRETED = isinstance(kernels.write_bf16_kernel, InterpretedFunction)

# Kernel parameters of the two MX layouts (bytes per token, values packed, block size, blocks padded to a power of 2)
_MX = {
    "fp4_mx16": dict(BPT=324, DIM=LATENT_DIM, BLOCK=16, BLOCKS_POW2=64),
    "mxfp4_nsa": dict(BPT=400, DIM=NOPE_DIM, BLOCK=32, BLOCKS_POW2=16),
}


def triton_unavailable(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can."""
    device = torch.device(device)
    if device.type == "cpu" and not INTERPRETED:
        return "Triton kernels on CPU need TRITON_INTERPRET=1 set before the kernels are imported"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton backend for device {device.type}"
    return common.stale_kernels()


def has_kernel(layout: CacheLayout) -> bool:
    """Whether the kernels implement ``layout`` (a registered layout, not a look-alike of another class)."""
    registered = LAYOUTS.get(layout.name)
    return registered is not None and type(layout) is type(registered) and layout.name in _WRITERS


def write_cache_triton(cache: PagedCache, values: torch.Tensor, slot_mapping: torch.Tensor, *,
                       propagate_nonfinite: bool = False, validate: bool = True) -> None:
    """Encode ``values`` ``[N, 576]`` into ``cache`` at ``slot_mapping`` ``[N]`` (slots < 0 skipped)."""
    writer = _kernel_for(cache, _WRITERS)
    _check_cache(cache)
    if values.dim() != 2 or values.shape[1] != LATENT_DIM or values.stride(1) != 1:
        raise ValueError(f"write_cache_triton: values must be [N, {LATENT_DIM}] with contiguous rows, got "
                         f"{list(values.shape)} with strides {list(values.stride())}")
    if values.dtype not in WRITE_DTYPES:
        raise ValueError(f"write_cache_triton: values must be one of {WRITE_DTYPES}, got {values.dtype}")
    check_slots("slot_mapping", slot_mapping, values.shape[0])
    _check_device(cache, values, slot_mapping)
    if values.shape[0] == 0:
        return
    if validate:
        _validate_write(cache, values, slot_mapping, propagate_nonfinite)
    # bf16 inputs travel as their int16 bits (see the kernels' _load_values); the stride is in elements either way
    in_bf16 = values.dtype == torch.bfloat16
    with _quiet_interpreter(), common.on_device(cache.data.device):
        writer(cache, values.view(torch.int16) if in_bf16 else values, slot_mapping, in_bf16)


def gather_cache_triton(cache: PagedCache, token_slots: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                        validate: bool = True) -> torch.Tensor:
    """Decode the tokens at ``token_slots`` ``[M]`` into ``[M, 576]`` of ``out_dtype`` (bf16 or fp32)."""
    gatherer = _kernel_for(cache, _GATHERERS)
    _check_cache(cache)
    if out_dtype not in GATHER_DTYPES:
        raise ValueError(f"gather_cache_triton: out_dtype must be one of {GATHER_DTYPES}, got {out_dtype}")
    check_slots("token_slots", token_slots)
    _check_device(cache, token_slots)
    out = torch.empty(token_slots.shape[0], LATENT_DIM, dtype=out_dtype, device=cache.data.device)
    if token_slots.numel() == 0:
        return out
    if validate:
        check_slots_in_cache("gather_cache_triton: token slots", token_slots, cache.num_slots)
    with _quiet_interpreter(), common.on_device(cache.data.device):
        gatherer(cache, token_slots, out.view(torch.int16) if out_dtype == torch.bfloat16 else out)
    return out


def _quiet_interpreter():
    """The interpreter computes with numpy, which warns where the kernels overflow to Inf or make NaN on purpose."""
    return numpy.errstate(over="ignore", invalid="ignore") if INTERPRETED else contextlib.nullcontext()


# ---- validation ---------------------------------------------------------------------------------------------------
def _kernel_for(cache: PagedCache, table: dict[str, Callable]) -> Callable:
    if not isinstance(cache, PagedCache):
        raise TypeError(f"expected a PagedCache, got {type(cache).__name__}")
    if not has_kernel(cache.layout):
        raise UnsupportedConfig(f"triton cache ops: no kernel for layout {cache.layout.name!r} "
                                f"(kernels: {', '.join(table)})")
    launch = table[cache.layout.name]
    reason = triton_unavailable(cache.data.device)
    if reason:
        raise UnsupportedConfig(f"triton cache ops: {reason}")
    return launch


def _check_cache(cache: PagedCache) -> None:
    """Contiguous data, and the per-layer scale checked again (``PagedCache`` checks it when built, but the field may
    be reassigned since: a NaN scale wrote NaN codes, None failed inside ``float``)."""
    if not cache.data.is_contiguous():
        raise ValueError("triton cache ops: the cache's data must be contiguous")
    if cache.layout.needs_tensor_scale:
        check_tensor_scale(cache.layout.name, cache.tensor_scale)


def _check_device(cache: PagedCache, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device != cache.data.device:
            raise ValueError(f"triton cache ops: every tensor must be on the cache's device {cache.data.device}, "
                             f"got one on {t.device}")


def _validate_write(cache: PagedCache, values: torch.Tensor, slots: torch.Tensor, propagate_nonfinite: bool) -> None:
    """Slot range, distinct slots and (unless propagating) finiteness of the rows that are written, in one host
    sync (a second only to name a shared slot)."""
    kept = slots >= 0
    nonfinite = ~torch.isfinite(values) & kept[:, None]
    ordered = torch.sort(slots.long()).values
    shared = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    top, repeats, count = torch.stack([
        torch.where(kept, slots.long(), -1).max(), shared.sum(),
        nonfinite.sum() if not propagate_nonfinite else slots.new_zeros((), dtype=torch.long)]).tolist()
    if top >= cache.num_slots:
        raise ValueError(f"slot_mapping points past the cache: slot {top} of {cache.num_slots}")
    if repeats:
        check_distinct_slots(slots[kept])
    if count:
        token, column = nonfinite.nonzero()[0].tolist()
        raise ValueError(f"layout {cache.layout.name}: {count} NaN/Inf input values (first at token {token}, "
                         f"column {column}); pass propagate_nonfinite=True to encode them as NaN")


# ---- launches -----------------------------------------------------------------------------------------------------
def _views(cache: PagedCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cache's bytes as uint8, int16 and int32 (every layout's fields are aligned for these)."""
    data = cache.data
    return data, data.view(torch.int16), data.view(torch.int32)


def _write_bf16(cache, values, slots, in_bf16):
    _, i16, _ = _views(cache)
    kernels.write_bf16_kernel[(values.shape[0],)](values, values.stride(0), slots, i16, IN_BF16=in_bf16)


def _write_fp8_tensor(cache, values, slots, in_bf16):
    kernels.write_fp8_tensor_kernel[(values.shape[0],)](values, values.stride(0), slots, cache.data,
                                                        float(cache.tensor_scale), IN_BF16=in_bf16)


def _write_fp8_ds_mla(pow2: bool):
    def launch(cache, values, slots, in_bf16):
        u8, i16, i32 = _views(cache)
        kernels.write_fp8_ds_mla_kernel[(values.shape[0],)](values, values.stride(0), slots, u8, i16, i32, POW2=pow2,
                                                            IN_BF16=in_bf16)
    return launch


def _write_mx(name: str):
    params = _MX[name]

    def launch(cache, values, slots, in_bf16):
        u8, i16, _ = _views(cache)
        kernels.write_mx_kernel[(values.shape[0],)](values, values.stride(0), slots, u8, i16,
                                                    FLOOR_AFTER_DIVIDE=name == "fp4_mx16",
                                                    ROPE_BF16=name == "mxfp4_nsa", IN_BF16=in_bf16, **params)
    return launch


def _write_nvfp4(cache, values, slots, in_bf16):
    u8, i16, _ = _views(cache)
    kernels.write_nvfp4_kernel[(values.shape[0],)](values, values.stride(0), slots, u8, i16,
                                                   float(cache.tensor_scale), IN_BF16=in_bf16)


def _gather_bf16(cache, slots, out):
    _, i16, _ = _views(cache)
    kernels.gather_bf16_kernel[(slots.shape[0],)](slots, i16, out, OUT_BF16=out.dtype == torch.int16)


def _gather_fp8_tensor(cache, slots, out):
    kernels.gather_fp8_tensor_kernel[(slots.shape[0],)](slots, cache.data, out, float(cache.tensor_scale),
                                                        OUT_BF16=out.dtype == torch.int16)


def _gather_fp8_ds_mla(cache, slots, out):
    u8, i16, i32 = _views(cache)
    kernels.gather_fp8_ds_mla_kernel[(slots.shape[0],)](slots, u8, i16, i32, out, OUT_BF16=out.dtype == torch.int16)


def _gather_mx(name: str):
    params = _MX[name]

    def launch(cache, slots, out):
        u8, i16, _ = _views(cache)
        kernels.gather_mx_kernel[(slots.shape[0],)](slots, u8, i16, out, ROPE_BF16=name == "mxfp4_nsa",
                                                    OUT_BF16=out.dtype == torch.int16, **params)
    return launch


def _gather_nvfp4(cache, slots, out):
    u8, i16, _ = _views(cache)
    kernels.gather_nvfp4_kernel[(slots.shape[0],)](slots, u8, i16, out, float(cache.tensor_scale),
                                                   OUT_BF16=out.dtype == torch.int16)


_WRITERS: dict[str, Callable] = {
    "bf16": _write_bf16,
    "fp8_e4m3": _write_fp8_tensor,
    "fp8_ds_mla": _write_fp8_ds_mla(pow2=False),
    "fp8_ds_mla_pow2": _write_fp8_ds_mla(pow2=True),
    "fp4_mx16": _write_mx("fp4_mx16"),
    "mxfp4_nsa": _write_mx("mxfp4_nsa"),
    "nvfp4": _write_nvfp4,
}
_GATHERERS: dict[str, Callable] = {
    "bf16": _gather_bf16,
    "fp8_e4m3": _gather_fp8_tensor,
    "fp8_ds_mla": _gather_fp8_ds_mla,
    "fp8_ds_mla_pow2": _gather_fp8_ds_mla,
    "fp4_mx16": _gather_mx("fp4_mx16"),
    "mxfp4_nsa": _gather_mx("mxfp4_nsa"),
    "nvfp4": _gather_nvfp4,
}
