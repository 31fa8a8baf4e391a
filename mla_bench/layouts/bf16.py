"""The ``bf16`` layout: ``[kv_c 512 | k_pe 64]`` as bfloat16, 1152 bytes per token (every engine)."""

from __future__ import annotations

import torch

from mla_bench.layouts.base import LATENT_DIM, NOPE_DIM, CacheLayout
from mla_bench.layouts.formats import bf16_bytes, bf16_error_bound, bf16_from_bytes


class BF16Layout(CacheLayout):
    """Values rounded to bfloat16 (nearest even). Finite float32 values of magnitude >= ~3.3962e38 (2^128 - 2^119)
    become Inf, as in every engine's bf16 cache: past the stated bound (``bf16_error_bound``)."""

    name = "bf16"
    bytes_per_token = 2 * LATENT_DIM
    description = "[kv_c 512 | k_pe 64] bfloat16; exact for bfloat16 inputs (all engines)"
    fields = (("kv_c bf16", 0, 2 * NOPE_DIM), ("k_pe bf16", 2 * NOPE_DIM, 2 * LATENT_DIM))

    def _error_bound(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        return bf16_error_bound(x)

    def _encode(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        return bf16_bytes(x)

    def _decode(self, raw: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        return bf16_from_bytes(raw)
