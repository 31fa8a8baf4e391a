"""FP4 (e2m1) cache layouts: two nibbles per byte, the even element in the low nibble.

- ``fp4_mx16`` (SGLang ``MLATokenToKVPoolFP4``): all 576 values, rope too, in blocks of 16 with an exponent-only
  (ue8m0) scale ``2^ceil(log2(max(amax / 6, 1e-10)))``: ``[288 packed | 36 ue8m0]``.
- ``mxfp4_nsa`` (SGLang NSA fp4): the 512 nope values in blocks of 32, scale ``2^ceil(log2(max(amax, 1e-12) / 6))``,
  rope kept in bf16: ``[256 packed | 16 ue8m0 | 128 bf16 rope]``.
- ``nvfp4`` (SGLang GLM DSA): the 512 nope values in blocks of 16 with e4m3 block scales and a per-layer fp32
  global scale ``g``: value = e2m1 * scale * g; ``[256 packed | 32 e4m3 | 128 bf16 rope]``. Block scale: the
  e4m3 rounding of ``amax / (6 g)`` (SGLang's writer instead searches five nearby scales for the least squared
  error; the bytes decode the same way).

MX codecs round midpoints away from zero; nvfp4 rounds to nearest even. A block holding a NaN/Inf input gets
the NaN scale (ue8m0 0xFF, e4m3 0x7F) and all-zero codes, so it decodes as NaN and its bytes do not depend on
the device.
"""

from __future__ import annotations

import torch

from mla_bench.layouts.base import LATENT_DIM, NOPE_DIM, ROPE_DIM, CacheLayout
from mla_bench.layouts.formats import (E2M1_MAX, E4M3_MAX, E4M3_NAN, FLT_MIN, SLACK, UE8M0_NAN, bf16_bytes,
                                       bf16_error_bound, bf16_from_bytes, ceil_log2, e2m1_decode, e2m1_encode,
                                       div_rn, e2m1_error_bound, e4m3_decode, e4m3_encode, finite_amax,
                                       pack_nibbles, ue8m0_decode, unpack_nibbles)


def mx_encode(values: torch.Tensor, block: int, floor_after_divide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[N, D]`` -> (packed ``[N, D/2]``, ue8m0 scale bytes ``[N, D/block]``), SGLang's MX rules.

    ``floor_after_divide``: ``max(amax / 6, 1e-10)`` (block-16 codec) versus ``max(amax, 1e-12) / 6`` (NSA).
    """
    blocks = values.float().reshape(values.shape[0], values.shape[1] // block, block)  # no -1 anywhere: N may be 0
    amax = blocks.abs().amax(dim=-1)
    if floor_after_divide:
        target = torch.clamp(div_rn(amax, E2M1_MAX), min=1e-10)
    else:
        target = div_rn(torch.clamp(amax, min=1e-12), E2M1_MAX)
    exponent = ceil_log2(target)
    finite = torch.isfinite(amax)
    codes = e2m1_encode(blocks, torch.exp2(exponent.float())[..., None], ties="away")
    codes = torch.where(finite[..., None], codes, 0)
    scale_bytes = torch.where(finite, exponent + 127, UE8M0_NAN).to(torch.uint8)
    return pack_nibbles(codes.flatten(1)), scale_bytes


def mx_error_bound(values: torch.Tensor, block: int, floor_after_divide: bool) -> torch.Tensor:
    """The MX scale is the power of two at or above its target, so at most twice the target."""
    blocks = values.double().reshape(values.shape[0], values.shape[1] // block, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    target = (amax / E2M1_MAX).clamp(min=1e-10) if floor_after_divide else amax.clamp(min=1e-12) / E2M1_MAX
    return e2m1_error_bound(blocks, 2 * target * SLACK).flatten(1)


def mx_decode(packed: torch.Tensor, scale_bytes: torch.Tensor, block: int) -> torch.Tensor:
    codes = unpack_nibbles(packed).reshape(packed.shape[0], 2 * packed.shape[1] // block, block)
    return (e2m1_decode(codes) * ue8m0_decode(scale_bytes)[..., None]).flatten(1)


class FP4MX16Layout(CacheLayout):
    name = "fp4_mx16"
    bytes_per_token = LATENT_DIM // 2 + LATENT_DIM // 16
    description = "[288 packed e2m1 (all 576, rope too) | 36 ue8m0 scales per 16] (SGLang MLATokenToKVPoolFP4)"
    scale_blocks = (16, 16)
    fields = (("e2m1 codes", 0, LATENT_DIM // 2), ("ue8m0 scales", LATENT_DIM // 2, LATENT_DIM // 2 + LATENT_DIM // 16))

    def _error_bound(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        return mx_error_bound(x, 16, floor_after_divide=True)

    def _encode(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        packed, scales = mx_encode(x, 16, floor_after_divide=True)
        return torch.cat([packed, scales], dim=1)

    def _decode(self, raw: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        return mx_decode(raw[:, :LATENT_DIM // 2], raw[:, LATENT_DIM // 2:], 16)


class MXFP4NSALayout(CacheLayout):
    name = "mxfp4_nsa"
    bytes_per_token = NOPE_DIM // 2 + NOPE_DIM // 32 + 2 * ROPE_DIM
    description = "[256 packed e2m1 nope | 16 ue8m0 scales per 32 | 64 bf16 rope] (SGLang NSA fp4)"
    scale_blocks = (32, 1)
    fields = (("nope e2m1", 0, NOPE_DIM // 2), ("ue8m0 scales", NOPE_DIM // 2, NOPE_DIM // 2 + NOPE_DIM // 32),
              ("rope bf16", NOPE_DIM // 2 + NOPE_DIM // 32, NOPE_DIM // 2 + NOPE_DIM // 32 + 2 * ROPE_DIM))

    def _error_bound(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        nope = mx_error_bound(x[:, :NOPE_DIM], 32, floor_after_divide=False)
        return torch.cat([nope, bf16_error_bound(x[:, NOPE_DIM:])], dim=1)

    def _encode(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        packed, scales = mx_encode(x[:, :NOPE_DIM], 32, floor_after_divide=False)
        return torch.cat([packed, scales, bf16_bytes(x[:, NOPE_DIM:])], dim=1)

    def _decode(self, raw: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        scales_end = NOPE_DIM // 2 + NOPE_DIM // 32
        nope = mx_decode(raw[:, :NOPE_DIM // 2], raw[:, NOPE_DIM // 2:scales_end], 32)
        return torch.cat([nope, bf16_from_bytes(raw[:, scales_end:])], dim=1)


class NVFP4Layout(CacheLayout):
    name = "nvfp4"
    bytes_per_token = NOPE_DIM // 2 + NOPE_DIM // 16 + 2 * ROPE_DIM
    description = ("[256 packed e2m1 nope | 32 e4m3 scales per 16 | 64 bf16 rope] + fp32 global scale per layer "
                   "(SGLang GLM DSA)")
    needs_tensor_scale = True
    scale_blocks = (16, 1)
    fields = (("nope e2m1", 0, NOPE_DIM // 2), ("e4m3 scales", NOPE_DIM // 2, NOPE_DIM // 2 + NOPE_DIM // 16),
              ("rope bf16", NOPE_DIM // 2 + NOPE_DIM // 16, NOPE_DIM // 2 + NOPE_DIM // 16 + 2 * ROPE_DIM))

    def _error_bound(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        """Block scale ``s = e4m3(amax / 6g) * g``: at most ``amax / 6 * (1 + 2^-4) + 2^-10 g`` (e4m3 rounding), and
        when it rounds down the largest values saturate by up to ``2^-4 |x|`` more; past ``6 * 448 * g`` the
        saturation error."""
        g = float(torch.tensor(tensor_scale, dtype=torch.float32))
        blocks = x[:, :NOPE_DIM].double().reshape(-1, NOPE_DIM // 16, 16)
        magnitude = blocks.abs()
        scale = magnitude.amax(dim=-1, keepdim=True) / E2M1_MAX * (1 + 2.0 ** -4) + 2.0 ** -10 * g
        limit = E2M1_MAX * E4M3_MAX * g
        bound = (e2m1_error_bound(blocks.clamp(-limit, limit), scale.clamp(max=E4M3_MAX * g))
                 + (2.0 ** -4 * magnitude + E2M1_MAX * 2.0 ** -10 * g) * SLACK + (magnitude - limit).clamp(min=0))
        return torch.cat([bound.reshape(-1, NOPE_DIM), bf16_error_bound(x[:, NOPE_DIM:])], dim=1)

    def _fit_tensor_scale(self, x: torch.Tensor) -> float:
        """``amax / (6 * 448)`` over the nope values, so the largest block scale is e4m3's largest value; floored at
        FLT_MIN like ``fp8_e4m3``'s: below amax ~3.2e-35 it is subnormal in float32 (0 below ~1.9e-42), a scale the
        layout refuses."""
        amax = finite_amax(x[:, :NOPE_DIM])
        return max(float(torch.tensor(amax, dtype=torch.float32) / (E2M1_MAX * E4M3_MAX)), FLT_MIN) if amax > 0 else 1.0

    def _encode(self, x: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        g = torch.tensor(tensor_scale, dtype=torch.float32, device=x.device)
        blocks = x[:, :NOPE_DIM].float().reshape(-1, NOPE_DIM // 16, 16)
        amax = blocks.abs().amax(dim=-1)
        scale_codes = torch.where(torch.isfinite(amax), e4m3_encode(amax / (E2M1_MAX * g)), E4M3_NAN).to(torch.uint8)
        denominator = scale_codes.view(torch.float8_e4m3fn).float() * g
        codes = e2m1_encode(blocks, denominator[..., None], ties="even").reshape(-1, NOPE_DIM)
        return torch.cat([pack_nibbles(codes), scale_codes, bf16_bytes(x[:, NOPE_DIM:])], dim=1)

    def _decode(self, raw: torch.Tensor, tensor_scale: float | None) -> torch.Tensor:
        scales_end = NOPE_DIM // 2 + NOPE_DIM // 16
        codes = unpack_nibbles(raw[:, :NOPE_DIM // 2]).reshape(-1, NOPE_DIM // 16, 16)
        scales = e4m3_decode(raw[:, NOPE_DIM // 2:scales_end]) * float(torch.tensor(tensor_scale, dtype=torch.float32))
        nope = (e2m1_decode(codes) * scales[..., None]).reshape(-1, NOPE_DIM)
        return torch.cat([nope, bf16_from_bytes(raw[:, scales_end:])], dim=1)
