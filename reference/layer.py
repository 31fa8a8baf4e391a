"""The whole MLA layer from hidden states, by both formulations, in float64.

Weights in the DeepSeek-V2 paper's notation (``W_UK`` / ``W_UV`` stored ``[H, Lkv, P]`` / ``[H, Lkv, V]`` so that
``k_nope = c_kv @ W_UK[h]``, the convention of ``Problem``):

- queries: ``c_q = RMSNorm(W_DQ x)`` (or ``x`` when queries are not compressed), ``q_nope = W_UQ c_q``,
  ``q_pe = RoPE(W_QR c_q)``;
- keys: ``c_kv = RMSNorm(W_DKV x)`` (the cached latent), ``k_pe = RoPE(W_KR x)`` (cached beside it),
  ``k_nope = c_kv W_UK``, ``v = c_kv W_UV``;
- output: ``W_O`` over the heads' attention outputs.

The compute-friendly path up-projects keys and values and runs MHA (qk 192, v 128); the absorbed path folds
``W_UK`` into the query and ``W_UV`` after the attention and runs MQA over the 576-wide latent. In float64
both agree to rounding. Request ``b`` contributes ``kv_lens[b]`` hidden states at positions ``0..kv_len-1``; its
last ``q_lens[b]`` tokens are the queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_bench.dims import MLADims
from mla_bench.lengths import check_lengths
from reference.absorbed import latent_mqa
from reference.mha import mha_attention


@dataclass
class MLAWeights:
    """Float64 weights of one MLA layer (``w_dq`` / ``q_norm`` are None where queries are not compressed)."""

    w_dq: torch.Tensor | None  # [Lq, hidden]
    q_norm: torch.Tensor | None  # [Lq]
    w_uq: torch.Tensor  # [H, P, Lq or hidden]
    w_qr: torch.Tensor  # [H, R, Lq or hidden]
    w_dkv: torch.Tensor  # [Lkv, hidden]
    kv_norm: torch.Tensor  # [Lkv]
    w_kr: torch.Tensor  # [R, hidden]
    w_uk: torch.Tensor  # [H, Lkv, P]
    w_uv: torch.Tensor  # [H, Lkv, V]
    w_o: torch.Tensor  # [hidden, H * V]

    @classmethod
    def random(cls, dims: MLADims, generator: torch.Generator, device: torch.device | str = "cpu") -> "MLAWeights":
        """Random weights scaled like trained ones (each projection roughly preserves the RMS)."""
        def w(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            scale = (fan_in or shape[-1]) ** -0.5
            return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(device)

        def norm_weight(n: int) -> torch.Tensor:
            return (1 + 0.1 * torch.randn(n, generator=generator, dtype=torch.float64)).to(device)

        h, q_in, lkv = dims.num_heads, dims.q_lora_rank or dims.hidden_size, dims.kv_lora_rank
        return cls(
            w_dq=w(dims.q_lora_rank, dims.hidden_size) if dims.q_lora_rank else None,
            q_norm=norm_weight(dims.q_lora_rank) if dims.q_lora_rank else None,
            w_uq=w(h, dims.qk_nope_head_dim, q_in),
            w_qr=w(h, dims.qk_rope_head_dim, q_in),
            w_dkv=w(lkv, dims.hidden_size),
            kv_norm=norm_weight(lkv),
            w_kr=w(dims.qk_rope_head_dim, dims.hidden_size),
            w_uk=w(h, lkv, dims.qk_nope_head_dim, fan_in=lkv),
            w_uv=w(h, lkv, dims.v_head_dim, fan_in=lkv),
            w_o=w(dims.hidden_size, h * dims.v_head_dim),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on interleaved pairs ``(x[2i], x[2i+1])`` (DeepSeek's complex form); ``x`` ``[N, ..., R]``."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / x.shape[-1])
    angles = positions.double()[:, None] * freqs[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def _positions(q_lens, kv_lens, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of every token, and the indices of the query tokens (each request's last q_len). The lengths
    follow ``check_lengths``, and one rule more: a layer's new tokens become keys, so no request has more queries
    than keys, not even one of kv_len 0 (which a cache-reading step takes as padding)."""
    q_lens, kv_lens = check_lengths(q_lens, kv_lens)
    positions, query_rows, start = [], [], 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len > kv_len:
            raise ValueError(f"mla_layer: request {i}: query longer than context (q_len={q_len} > kv_len={kv_len}): a "
                             "layer's new tokens are the last of its keys")
        positions.extend(range(kv_len))
        query_rows.extend(range(start + kv_len - q_len, start + kv_len))
        start += kv_len
    return (torch.tensor(positions, dtype=torch.int64, device=device),
            torch.tensor(query_rows, dtype=torch.int64, device=device))


def project(weights: MLAWeights, dims: MLADims, hidden: torch.Tensor, q_lens, kv_lens) -> dict[str, torch.Tensor]:
    """The per-head queries and the latent cache entries of a ragged batch of hidden states."""
    positions, query_rows = _positions(q_lens, kv_lens, hidden.device)
    if hidden.dim() != 2 or hidden.shape[0] != len(positions):
        raise ValueError(f"mla_layer: hidden is {list(hidden.shape)}; expected [sum(kv_lens) = {len(positions)}, "
                         "hidden size], a row per token of every request")
    x = hidden.double()
    xq = x[query_rows]
    c_q = rms_norm(xq @ weights.w_dq.T, weights.q_norm) if weights.w_dq is not None else xq
    q_nope = torch.einsum("tc,hpc->thp", c_q, weights.w_uq)
    q_pe = rope(torch.einsum("tc,hrc->thr", c_q, weights.w_qr), positions[query_rows], dims.rope_theta)
    c_kv = rms_norm(x @ weights.w_dkv.T, weights.kv_norm)
    k_pe = rope(x @ weights.w_kr.T, positions, dims.rope_theta)
    return {"q_nope": q_nope, "q_pe": q_pe, "c_kv": c_kv, "k_pe": k_pe}


def mla_layer_mha(weights: MLAWeights, dims: MLADims, hidden: torch.Tensor, q_lens,
                  kv_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute-friendly path: up-project keys and values, MHA with qk 192 and v 128. Returns (out, lse)."""
    p = project(weights, dims, hidden, q_lens, kv_lens)
    k_nope = torch.einsum("nc,hcp->nhp", p["c_kv"], weights.w_uk)
    v = torch.einsum("nc,hcd->nhd", p["c_kv"], weights.w_uv)
    q = torch.cat([p["q_nope"], p["q_pe"]], dim=-1)
    attn, lse = mha_attention(q, k_nope, p["k_pe"], v, q_lens, kv_lens, dims.softmax_scale)
    return attn.flatten(1) @ weights.w_o.T, lse


def mla_layer_absorbed(weights: MLAWeights, dims: MLADims, hidden: torch.Tensor, q_lens,
                       kv_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-movement-friendly path: absorb W_UK into q, MQA over the 576-wide latent, W_UV after."""
    p = project(weights, dims, hidden, q_lens, kv_lens)
    q = torch.cat([torch.einsum("thp,hcp->thc", p["q_nope"], weights.w_uk), p["q_pe"]], dim=-1)
    latent = torch.cat([p["c_kv"], p["k_pe"]], dim=-1)
    attn_latent, lse = latent_mqa(q, latent, q_lens, kv_lens, dims.softmax_scale)
    attn = torch.einsum("thc,hcd->thd", attn_latent, weights.w_uv)
    return attn.flatten(1) @ weights.w_o.T, lse
