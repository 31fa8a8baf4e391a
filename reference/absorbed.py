"""Absorbed (data-movement-friendly) MLA attention: MQA of 576-wide queries over the latent cache.

Keys are the 576 latent values of each token, values its first 512 (kv_c); one key/value head is shared by
all query heads. Output ``[T, H, 512]`` stays in latent space (``W_UV`` is applied after).
"""

from __future__ import annotations

import torch

from mla_bench.layouts import LATENT_DIM, NOPE_DIM, PagedCache
from mla_bench.layouts.ops import gather_cache
from mla_bench.metadata import PagedMetadata
from reference.checks import check_ragged_rows, check_same_device, check_tensor, check_values
from reference.core import ragged_attention_prechecked


def latent_mqa(q: torch.Tensor, kv: torch.Tensor, q_lens, kv_lens, scale: float,
               causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA of ``q`` ``[T, H, 576]`` over ragged latent tokens ``kv`` ``[N, 576]``."""
    q_lens, kv_lens = check_latent_inputs(q, kv, q_lens, kv_lens, scale, causal)
    kv = kv.double()
    return ragged_attention_prechecked(q, kv[:, None, :], kv[:, None, :NOPE_DIM], q_lens, kv_lens, scale, causal)


def check_latent_inputs(q: torch.Tensor, kv: torch.Tensor, q_lens, kv_lens, scale: float,
                        causal: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """All checks of an absorbed call (``latent_mqa``, the DCP path): ``q`` ``[sum(q_lens), H, 576]``, ``kv``
    ``[sum(kv_lens), 576]`` on one device, then the values. Returns the lengths as tuples."""
    check_tensor("q", q, 3, last=LATENT_DIM)
    check_tensor("kv", kv, 2, last=LATENT_DIM)
    check_same_device(q=q, kv=kv)
    lengths = check_ragged_rows(q_lens, kv_lens, q, "kv", kv, causal)
    check_values(scale, q=q, kv=kv)
    return lengths


def paged_latent_mqa(q: torch.Tensor, cache: PagedCache, meta: PagedMetadata,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over the paged cache: gather (and dequantize) each request's tokens, then MQA."""
    kv = gather_cache(cache, meta.token_slots)
    return latent_mqa(q, kv, meta.q_lens, meta.kv_lens, scale)
