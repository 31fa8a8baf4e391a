"""The interface every cache layout implements, and the paged cache that holds encoded tokens.

A layout turns one token's 576 latent values (``[kv_c 512 | k_pe 64]``) into ``bytes_per_token`` bytes and
back. ``quantize`` / ``dequantize`` are the float64-exact reference codec: kernels must produce and consume
exactly these bytes. Layouts with a per-layer scale take it as ``tensor_scale`` (fitted by
``fit_tensor_scale``); the others ignore it.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from mla_bench.errors import check_tensors, describe
from mla_bench.layouts.formats import FLT_MIN, all_finite
from mla_bench.lengths import check_page_size

LATENT_DIM = 576  # kv_c (512) + k_pe (64), the cache entry of every MLA model the bench targets
NOPE_DIM = 512
ROPE_DIM = 64
POISON_BYTE = 0xFF  # NaN in bf16, fp32, e4m3 and ue8m0: unused cache bytes read as NaN


class CacheLayout(ABC):
    """One byte layout of a cache entry, with its reference codec."""

    name: str
    bytes_per_token: int
    description: str
    needs_tensor_scale: bool = False
    # Columns that share a scale, in kv_c and in k_pe: a NaN/Inf input spreads over its block (1: per element).
    scale_blocks: tuple[int, int] = (1, 1)
    # The token's byte fields in order, (name, start, end), tiling [0, bytes_per_token): where a wrong byte is.
    fields: tuple[tuple[str, int, int], ...] = ()

    def fit_tensor_scale(self, x: torch.Tensor) -> float | None:
        """The per-layer scale for values ``x`` (None for layouts without one); refuses the shapes and dtypes
        ``quantize`` refuses."""
        self.check_shape(x)
        self.check_dtype(x)
        return self._fit_tensor_scale(x)

    def _fit_tensor_scale(self, x: torch.Tensor) -> float | None:
        """``fit_tensor_scale`` after validation."""
        return None

    def quantize(self, x: torch.Tensor, tensor_scale: float | None = None,
                 propagate_nonfinite: bool = False) -> torch.Tensor:
        """Encode ``x`` ``[N, 576]`` (float16, bfloat16, float32 or float64) into ``[N, bytes_per_token]`` uint8.

        NaN or Inf values are refused unless ``propagate_nonfinite``; then they decode as NaN/Inf (the whole
        scale block for block-scaled parts), never as a plausible finite number.
        """
        self.check_input(x, propagate_nonfinite)
        if self.needs_tensor_scale:
            check_tensor_scale(self.name, tensor_scale)
        raw = self._encode(x, tensor_scale)
        if raw.dtype != torch.uint8 or raw.shape != (x.shape[0], self.bytes_per_token):
            raise ValueError(f"layout {self.name}: its encoder wrote {describe(raw)}, expected uint8 "
                             f"[{x.shape[0]}, {self.bytes_per_token}] ({self.bytes_per_token} bytes per token)")
        return raw

    def dequantize(self, raw: torch.Tensor, tensor_scale: float | None = None) -> torch.Tensor:
        """Decode ``[N, bytes_per_token]`` uint8 into float64 ``[N, 576]``, exactly."""
        self.check_raw(raw)
        if self.needs_tensor_scale:
            check_tensor_scale(self.name, tensor_scale)
        return self._decode(raw, tensor_scale)

    def error_bound(self, x: torch.Tensor, tensor_scale: float | None = None) -> torch.Tensor:
        """The format's stated accuracy: the largest ``|x - dequantize(quantize(x))|`` allowed per element (float64
        ``[N, 576]``) for finite ``x``, derived from the values alone (never from the scales a codec stored, so a
        wrong scale cannot hide behind its own bound). Refuses the shapes, dtypes and scales ``quantize`` refuses
        (a narrower ``x`` got a narrower bound, or a reshape error)."""
        self.check_shape(x)
        self.check_dtype(x)
        if self.needs_tensor_scale:
            check_tensor_scale(self.name, tensor_scale)
        return self._error_bound(x, tensor_scale)

    @abstractmethod
    def _error_bound(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        """``error_bound`` after validation."""

    @abstractmethod
    def _encode(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        """``quantize`` after validation."""

    @abstractmethod
    def _decode(self, raw: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        """``dequantize`` after validation."""

    def check_input(self, x: torch.Tensor, propagate_nonfinite: bool = False) -> None:
        """Refuse what no layout can encode: wrong shape, a dtype other than float16 to float64, NaN/Inf unless asked to
        propagate, and finite values beyond float32's range even then (the codecs compute in float32, where they become
        Inf)."""
        self.check_shape(x)
        self.check_dtype(x)
        if not propagate_nonfinite and not all_finite(x):
            bad = ~torch.isfinite(x)
            token, column = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"layout {self.name}: {int(bad.sum())} NaN/Inf input values (first at token {token}, "
                             f"column {column}); pass propagate_nonfinite=True to encode them as NaN")
        if x.dtype == torch.float64 and not all_finite(x.float()):
            overflow = torch.isfinite(x) & ~torch.isfinite(x.float())
            if bool(overflow.any()):
                token, column = (int(i) for i in overflow.nonzero()[0])
                raise ValueError(f"layout {self.name}: {int(overflow.sum())} finite float64 input values overflow "
                                 f"float32, which the codecs compute in (first at token {token}, column {column}: "
                                 f"{float(x[token, column]):.6g}; float32's largest is "
                                 f"{torch.finfo(torch.float32).max:.6g})")

    def check_shape(self, x: torch.Tensor) -> None:
        """Refuse anything but a tensor of shape ``[N, 576]``: one token a row."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != LATENT_DIM:
            raise ValueError(f"layout {self.name}: expected values of shape [N, {LATENT_DIM}], got {describe(x)}")
        check_tensors(f"layout {self.name}", values=x)

    def check_dtype(self, x: torch.Tensor) -> None:
        """Refuse values other than float16 to float64: float8 / float4 are cache formats, not inputs."""
        if not x.dtype.is_floating_point or x.dtype.itemsize < 2:
            raise ValueError(f"layout {self.name}: expected floating-point values of 16 bits or more, got {x.dtype}")

    def check_raw(self, raw: torch.Tensor) -> None:
        if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 2 \
                or raw.shape[1] != self.bytes_per_token:
            raise ValueError(f"layout {self.name}: expected uint8 bytes of shape [N, {self.bytes_per_token}], "
                             f"got {describe(raw)}")
        check_tensors(f"layout {self.name}", raw=raw)

    def __repr__(self) -> str:
        return f"<layout {self.name}: {self.bytes_per_token} B/token>"


def check_tensor_scale(layout: str, tensor_scale: float | None) -> None:
    """A per-layer scale must be a number (not a bool, which Python counts as an int) whose float32 rounding, the
    value codecs and kernels use, is finite and at least the smallest normal float32 (the floor of every fitted
    scale): below it ``1 / scale`` overflows float32 and a kernel that flushes subnormals to zero reads 0."""
    number = isinstance(tensor_scale, numbers.Real) and not isinstance(tensor_scale, bool)  # numpy scalars too
    as_float32 = _float32(tensor_scale) if number else math.nan
    if not (math.isfinite(as_float32) and as_float32 >= FLT_MIN):
        rounded = "" if as_float32 == tensor_scale or math.isnan(as_float32) else f" ({as_float32!r} in float32)"
        raise ValueError(f"layout {layout}: tensor_scale must be a finite positive number, at least {FLT_MIN:.6g} "
                         f"(the smallest normal float32) once rounded to float32, got "
                         f"{reprlib.repr(tensor_scale)}{rounded}")


def _float32(number: int | float) -> float:
    """``number`` rounded to float32, +-Inf past its range (also past a Python float's)."""
    try:
        return float(torch.tensor(float(number), dtype=torch.float32))
    except OverflowError:
        return math.inf if number > 0 else -math.inf


@dataclass
class PagedCache:
    """Encoded tokens in pages: ``data`` is uint8 ``[num_blocks, page_size, bytes_per_token]``.

    A token at slot ``s`` lives at ``data[s // page_size, s % page_size]``. Bytes no token was written to hold
    ``POISON_BYTE`` so that a stray read surfaces as NaN.
    """

    layout: CacheLayout
    data: torch.Tensor
    tensor_scale: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8 or self.data.dim() != 3 \
                or self.data.shape[2] != self.layout.bytes_per_token:
            raise ValueError(f"PagedCache for {self.layout.name}: data must be uint8 "
                             f"[num_blocks, page_size, {self.layout.bytes_per_token}], got {describe(self.data)}")
        if self.data.shape[1] < 1:
            raise ValueError(f"PagedCache for {self.layout.name}: page size must be >= 1, got {self.data.shape[1]}")
        if not self.data.is_contiguous():
            raise ValueError(f"PagedCache for {self.layout.name}: data must be contiguous (slots are read as rows of "
                             f"one view), got strides {list(self.data.stride())}")
        if self.layout.needs_tensor_scale:
            check_tensor_scale(self.layout.name, self.tensor_scale)

    @classmethod
    def empty(cls, layout: CacheLayout, num_blocks: int, page_size: int, device: torch.device | str = "cpu",
              tensor_scale: float | None = None) -> "PagedCache":
        """A poisoned cache of ``num_blocks`` pages."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 0:
            raise ValueError(f"PagedCache.empty: num_blocks must be an int >= 0, got {num_blocks!r}")
        check_page_size(page_size)
        data = torch.full((int(num_blocks), int(page_size), layout.bytes_per_token), POISON_BYTE, dtype=torch.uint8,
                          device=device)
        return cls(layout, data, tensor_scale)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def page_size(self) -> int:
        return self.data.shape[1]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.page_size

    def rows(self) -> torch.Tensor:
        """All slots as ``[num_slots, bytes_per_token]`` (a view)."""
        return self.data.view(self.num_slots, self.layout.bytes_per_token)

    def to(self, device: torch.device | str) -> "PagedCache":
        return PagedCache(self.layout, self.data.to(device), self.tensor_scale)
