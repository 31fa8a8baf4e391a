"""FP8 (e4m3) cache layouts: one per-layer scale (``fp8_e4m3``) or per-128 tile scales (``fp8_ds_mla``)."""

from __future__ import annotations

import torch

from mla_bench.layouts.base import LATENT_DIM, NOPE_DIM, ROPE_DIM, CacheLayout
from mla_bench.layouts.formats import (E4M3_MAX, E4M3_NAN, FLT_MIN, SLACK, bf16_bytes, bf16_error_bound,
                                       bf16_from_bytes, ceil_log2, e4m3_decode, e4m3_encode, e4m3_error_bound,
                                       f32_bytes, f32_from_bytes, div_rn, finite_amax)

DS_MLA_TILE = 128
DS_MLA_TILES = NOPE_DIM // DS_MLA_TILE
POW2_SCALE_FLOOR = 1e-4  # FlashMLA's test quantizer floor before rounding the scale up to a power of two


class FP8PerTensorLayout(CacheLayout):
    """vLLM's ``kv_cache_dtype=fp8``: all 576 values as e4m3 of ``x / scale``; read ``fp8 * scale``.

    Values beyond ``448 * scale`` saturate; a NaN/Inf input (when propagated) is stored as NaN."""

    name = "fp8_e4m3"
    bytes_per_token = LATENT_DIM
    description = "576 x e4m3 of x/scale with one fp32 scale per layer (amax/448); rope quantized too (vLLM fp8)"
    needs_tensor_scale = True
    fields = (("kv_c e4m3", 0, NOPE_DIM), ("k_pe e4m3", NOPE_DIM, LATENT_DIM))

    def _fit_tensor_scale(self, x: torch.Tensor) -> float:
        amax = finite_amax(x)
        return max(float(torch.tensor(amax, dtype=torch.float32) / E4M3_MAX), FLT_MIN)

    def _error_bound(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        scale = float(torch.tensor(tensor_scale, dtype=torch.float32))
        return e4m3_error_bound(x, torch.tensor(scale, dtype=torch.float64, device=x.device))

    def _encode(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        scale = torch.tensor(tensor_scale, dtype=torch.float32, device=x.device)
        return torch.where(torch.isfinite(x), e4m3_encode(x.float() / scale), E4M3_NAN).to(torch.uint8)

    def _decode(self, raw: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        return e4m3_decode(raw) * float(torch.tensor(tensor_scale, dtype=torch.float32))


class FP8DSMLALayout(CacheLayout):
    """DeepSeek V3.2's 656-byte entry: ``[512 e4m3 | 4 fp32 tile scales | 64 bf16 rope]``.

    Tile scale ``amax / 448`` floored at FLT_MIN (vLLM; an all-zero tile never gives NaN), or with
    ``pow2`` that value (floored at 1e-4) rounded up to a power of two (FlashMLA's quantizer: its Hopper
    kernel rounds each scale to bf16, exact only for powers of two).
    """

    bytes_per_token = NOPE_DIM + 4 * DS_MLA_TILES + 2 * ROPE_DIM
    scale_blocks = (DS_MLA_TILE, 1)
    fields = (("nope e4m3", 0, NOPE_DIM), ("tile scales fp32", NOPE_DIM, NOPE_DIM + 4 * DS_MLA_TILES),
              ("rope bf16", NOPE_DIM + 4 * DS_MLA_TILES, NOPE_DIM + 4 * DS_MLA_TILES + 2 * ROPE_DIM))

    def __init__(self, pow2: bool) -> None:
        self.pow2 = pow2
        self.name = "fp8_ds_mla_pow2" if pow2 else "fp8_ds_mla"
        policy = "power-of-two tile scales (FlashMLA)" if pow2 else "tile scale amax/448 (vLLM, SGLang)"
        self.description = f"[512 e4m3 | 4 fp32 scales per 128 | 64 bf16 rope], {policy}"

    def _error_bound(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        """e4m3 steps of the tile scale: at most ``amax / 448`` (rounded up to fp32), or for ``pow2`` at most twice
        ``max(amax / 448, 1e-4)``."""
        tiles = x[:, :NOPE_DIM].double().reshape(-1, DS_MLA_TILES, DS_MLA_TILE)
        ratio = tiles.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
        scale = 2 * ratio.clamp(min=POW2_SCALE_FLOOR) if self.pow2 else ratio.clamp(min=FLT_MIN) * SLACK
        nope = e4m3_error_bound(tiles, scale).reshape(-1, NOPE_DIM)
        return torch.cat([nope, bf16_error_bound(x[:, NOPE_DIM:])], dim=1)

    def _encode(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        tiles = x[:, :NOPE_DIM].float().reshape(-1, DS_MLA_TILES, DS_MLA_TILE)
        amax = tiles.abs().amax(dim=-1)
        if self.pow2:
            scale = torch.exp2(ceil_log2(torch.clamp(div_rn(amax, E4M3_MAX), min=POW2_SCALE_FLOOR)).float())
        else:
            scale = torch.clamp(div_rn(amax, E4M3_MAX), min=FLT_MIN)
        scale = torch.where(torch.isfinite(amax), scale, float("nan"))
        codes = e4m3_encode(tiles / scale[..., None]).reshape(-1, NOPE_DIM)
        return torch.cat([codes, f32_bytes(scale), bf16_bytes(x[:, NOPE_DIM:])], dim=1)

    def _decode(self, raw: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        values = e4m3_decode(raw[:, :NOPE_DIM]).reshape(-1, DS_MLA_TILES, DS_MLA_TILE)
        scale = f32_from_bytes(raw[:, NOPE_DIM:NOPE_DIM + 4 * DS_MLA_TILES])
        nope = (values * scale[..., None]).reshape(-1, NOPE_DIM)
        return torch.cat([nope, bf16_from_bytes(raw[:, NOPE_DIM + 4 * DS_MLA_TILES:])], dim=1)
