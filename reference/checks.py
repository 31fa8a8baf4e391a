"""Input checks shared by the reference functions: refuse bad input with a clear error before any work.

Every public entry point checks the structure of its inputs first (types, shapes, devices: cheap), then their
values once with ``check_values`` (a pass over each input); what it calls internally does not check again.
"""

from __future__ import annotations

import torch

from mla_bench.dims import check_softmax_scale
from mla_bench.errors import check_tensors, given
from mla_bench.lengths import check_int, check_lengths  # also imported from here by the reference modules


def check_tensor(name: str, tensor: torch.Tensor, dims: int, last: int | None = None) -> None:
    """``tensor`` is a floating-point tensor with ``dims`` dimensions (and last dimension ``last``)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {list(tensor.shape)}")
    if last is not None and tensor.shape[-1] != last:
        raise ValueError(f"{name} must have last dimension {last}, got shape {list(tensor.shape)}")
    if not tensor.dtype.is_floating_point or tensor.dtype.itemsize == 1:
        raise ValueError(f"{name} must be a float16, bfloat16, float32 or float64 tensor (decode a float8 payload "
                         f"through its layout first), got {tensor.dtype}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """``tensor`` is a floating-point tensor of exactly ``shape`` (the error gives both shapes)."""
    check_tensor(name, tensor, len(shape))
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")


def check_rows(name: str, tensor: torch.Tensor, rows: int, what: str) -> None:
    """``tensor`` has ``rows`` rows, the count ``what`` gives (a ragged batch's ``sum(q_lens)``, say)."""
    if tensor.shape[0] != rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows for {what}={rows}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """The given ``tensors`` (None: absent) share one device, and it is not the meta device (no values to read)."""
    devices = {name: t.device for name, t in given(**tensors).items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"inputs are on different devices: {', '.join(f'{n}={d}' for n, d in devices.items())}")
    check_tensors("", **given(**tensors))


def check_ragged_rows(q_lens, kv_lens, q: torch.Tensor, keys_name: str, keys: torch.Tensor,
                      causal: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Valid lengths, ``sum(q_lens)`` rows of ``q`` and ``sum(kv_lens)`` rows of the keys. Returns the lengths as
    tuples, which the caller loops over (an iterator it was given is spent by the check). Without a causal mask a
    request may have more queries than keys (new tokens over one chunk of context); ``causal`` must be a bool (None
    meant non-causal in silence)."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    q_lens, kv_lens = check_lengths(q_lens, kv_lens, queries_may_exceed_keys=not causal)
    check_rows("q", q, sum(q_lens), "sum(q_lens)")
    check_rows(keys_name, keys, sum(kv_lens), "sum(kv_lens)")
    return q_lens, kv_lens


def check_values(scale: float, **tensors: torch.Tensor) -> None:
    """The value check of every public entry point: a finite positive scale and no NaN / inf in any input.

    The reference is the anchor every impl is judged against: a non-finite input must be refused, not turned
    into a NaN (or a plausible) answer. Call it after the structural checks (it reads every element)."""
    check_softmax_scale(scale)
    for name, tensor in tensors.items():
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            raise ValueError(f"{name} holds NaN or inf ({finite.numel() - int(finite.sum())} of {finite.numel()} "
                             f"values); the reference needs finite inputs")
