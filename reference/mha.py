"""Compute-friendly (MHA) MLA attention: per-head keys of width 192 (nope 128 | rope 64), values of 128."""

from __future__ import annotations

import torch

from reference.checks import check_ragged_rows, check_same_device, check_tensor, check_values
from reference.core import ragged_attention_prechecked


def mha_keys(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``[N, H, 192]`` keys: each head's nope part with the shared rope part broadcast."""
    heads = k_nope.shape[1]
    return torch.cat([k_nope.double(), k_pe.double()[:, None, :].expand(-1, heads, -1)], dim=-1)


def up_project(latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Latent tokens ``[N, 576]`` -> ``(k_nope [N, H, 128], k_pe [N, 64], v [N, H, 128])`` in float64."""
    latent = latent.double()
    kv_c, nope = latent[:, :w_uk.shape[1]], w_uk.shape[1]
    k_nope = torch.einsum("nc,hcp->nhp", kv_c, w_uk.double())
    v = torch.einsum("nc,hcd->nhd", kv_c, w_uv.double())
    return k_nope, latent[:, nope:], v


def mha_attention(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor, q_lens, kv_lens,
                  scale: float, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged MHA of ``q`` ``[T, H, 192]`` over ``k_nope`` ``[N, H, 128]``, ``k_pe`` ``[N, 64]``,
    ``v`` ``[N, H, 128]``."""
    check_tensor("q", q, 3)
    check_tensor("k_nope", k_nope, 3)
    check_tensor("k_pe", k_pe, 2, last=q.shape[-1] - k_nope.shape[-1])
    check_tensor("v", v, 3)
    if k_nope.shape[:2] != (k_pe.shape[0], q.shape[1]) or v.shape[:2] != k_nope.shape[:2]:
        raise ValueError(f"k_nope {list(k_nope.shape)}, k_pe {list(k_pe.shape)} and v {list(v.shape)} must share "
                         f"N tokens and the {q.shape[1]} query heads")
    check_same_device(q=q, k_nope=k_nope, k_pe=k_pe, v=v)
    q_lens, kv_lens = check_ragged_rows(q_lens, kv_lens, q, "k_nope", k_nope, causal)
    check_values(scale, q=q, k_nope=k_nope, k_pe=k_pe, v=v)
    return ragged_attention_prechecked(q, mha_keys(k_nope, k_pe), v, q_lens, kv_lens, scale, causal)
