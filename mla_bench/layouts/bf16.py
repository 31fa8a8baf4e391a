"""The ``bf16`` layout: ``[kv_c 512 | k_pe 64]`` as bfloat16, 1152 bytes per token (every engine)."""

from __future__ import annotations

import torch

from mla_bench.layouts.base import LATENT_DIM, CacheLayout


class BF16Layout(CacheLayout):
    name = "bf16"
    bytes_per_token = 2 * LATENT_DIM
    description = "[kv_c 512 | k_pe 64] bfloat16; exact for bfloat16 inputs (all engines)"

    def quantize(self, x: torch.Tensor, tensor_scale: float | None = None) -> torch.Tensor:
        self.check_input(x)
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)

    def dequantize(self, raw: torch.Tensor, tensor_scale: float | None = None) -> torch.Tensor:
        self.check_raw(raw)
        return raw.contiguous().view(torch.bfloat16).to(torch.float64)
