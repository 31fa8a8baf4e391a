"""Each rank's attention over its shard, behind one small interface so kernels drop in.

A ``ShardAttention`` turns ``(q [T, H, 576], shard)`` into the rank's partial ``(out [T, H, 512], lse [T, H]
float32)``: rows see the rank's first ``shard.visible_lens[row]`` keys of their request; a row that sees none
gives out 0, lse -inf. ``prepare`` is the per-step host work (kept out of timings); ``layouts`` names the cache
layouts it reads, so a run over another is refused before any rank starts.

- ``triton_decode`` (the default): the Triton split-KV paged decode (issue 5) over the shard's own pages, with
  ``visible_lens`` as its per-row causal frontier; every layout the decode kernel reads (FP4 ones included);
- ``triton_sparse``: the Triton sparse kernel fed every visible local slot of each row (-1 past the row's
  frontier): a second Triton path (few rows' lists cut into pieces merged by LSE, as any sparse problem's; its
  workspace allocated per call); the Triton latent readers' layouts (bf16 and FP8, no FP4);
- ``torch``: eager gather-and-softmax per request in float32, any layout (decoded by the layout's own codec).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from impls.triton.dcp.shard import DcpShard
from impls.triton.decode import KERNEL_LAYOUTS, DecodePlan, plan_decode, run_decode
from impls.triton.latent_io import LAYOUT_CODES, cache_tensor_scale, layout_code
from impls.triton.sparse_kernel import sparse_mqa
from mla_bench.layouts import LATENT_DIM, LAYOUTS, NOPE_DIM
from mla_bench.metadata.reference import cumulative


class ShardAttention(Protocol):
    name: str
    layouts: frozenset[str]  # the cache layouts it reads

    def prepare(self, shard: DcpShard, scale: float, heads: int) -> Any:
        """Per-step host work (metadata, buffers) for ``heads`` query heads; the result goes to ``__call__``."""

    def __call__(self, q: torch.Tensor, prepared: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank's partial attention of all heads over its shard."""


class TorchShardAttention:
    name = "torch"
    layouts = frozenset(LAYOUTS)  # each decoded by its own codec

    def prepare(self, shard: DcpShard, scale: float, heads: int) -> tuple[DcpShard, float]:
        return shard, scale

    def __call__(self, q: torch.Tensor, prepared: tuple[DcpShard, float]) -> tuple[torch.Tensor, torch.Tensor]:
        shard, scale = prepared
        tokens, heads = q.shape[:2]
        out = torch.zeros(tokens, heads, NOPE_DIM, dtype=torch.float32, device=q.device)
        lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q.device)
        q_starts, local_starts = cumulative(list(shard.q_lens)), shard.local_starts
        layout = shard.cache.layout
        for b, q_len in enumerate(shard.q_lens):
            n = shard.local_lens[b]
            if not q_len or not n:
                continue
            slots = shard.token_slots[local_starts[b]:local_starts[b + 1]]
            # float32 keys: rounding dequantized FP8 keys to bf16 would add error no kernel needs to make
            keys = layout.dequantize(shard.cache.rows()[slots], shard.cache.tensor_scale).float()
            rows = slice(q_starts[b], q_starts[b + 1])
            scores = torch.einsum("thd,nd->thn", q[rows].float(), keys) * scale
            hidden = torch.arange(n, device=q.device)[None, :] >= shard.visible_lens[rows, None]
            scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)
            empty = torch.isneginf(row_lse)
            probs = torch.exp(scores - torch.where(empty, 0.0, row_lse)[..., None])
            out[rows] = torch.einsum("thn,nd->thd", probs.to(q.dtype).float(), keys[:, :NOPE_DIM])
            lse[rows] = row_lse
        return out, lse


class TritonSparseShardAttention:
    name = "triton_sparse"
    layouts = frozenset(LAYOUT_CODES)

    def prepare(self, shard: DcpShard, scale: float, heads: int) -> dict[str, Any]:
        tokens = shard.visible_lens.shape[0]
        width = max(max(shard.local_lens, default=0), 1)
        indices = torch.full((tokens, width), -1, dtype=torch.int32, device=shard.token_slots.device)
        q_starts, local_starts = cumulative(list(shard.q_lens)), shard.local_starts
        columns = torch.arange(width, device=indices.device)
        for b, q_len in enumerate(shard.q_lens):
            n = shard.local_lens[b]
            if not q_len or not n:
                continue
            rows = slice(q_starts[b], q_starts[b + 1])
            slots = shard.token_slots[local_starts[b]:local_starts[b + 1]].to(torch.int32)
            row_idx = torch.full((q_len, width), -1, dtype=torch.int32, device=indices.device)
            row_idx[:, :n] = slots
            indices[rows] = torch.where(columns[None, :] < shard.visible_lens[rows, None], row_idx, -1)
        return {"indices": indices, "shard": shard, "scale": scale, "layout": layout_code(shard.cache.layout.name)}

    def __call__(self, q: torch.Tensor, prepared: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        shard = prepared["shard"]
        out = torch.empty(q.shape[0], q.shape[1], NOPE_DIM, dtype=torch.float32, device=q.device)
        return sparse_mqa(q, prepared["indices"], shard.cache.rows(), prepared["layout"], prepared["scale"],
                          cache_tensor_scale(shard.cache), out=out)


class TritonDecodeShardAttention:
    name = "triton_decode"
    layouts = frozenset(KERNEL_LAYOUTS)

    def prepare(self, shard: DcpShard, scale: float, heads: int) -> tuple[DecodePlan, torch.Tensor]:
        tokens = shard.visible_lens.shape[0]
        q = torch.zeros(tokens, heads, LATENT_DIM, dtype=torch.bfloat16, device=shard.token_slots.device)
        plan = plan_decode(q, shard.cache, shard.block_table, shard.q_lens, shard.local_lens, scale,
                           visible_lens=shard.visible_lens)
        return plan, q  # the plan reads its queries from q: each step copies the gathered queries in

    def __call__(self, q: torch.Tensor, prepared: tuple[DecodePlan, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        plan, buffer = prepared
        buffer.copy_(q)
        return run_decode(plan)


SHARD_ATTENTIONS: dict[str, type] = {cls.name: cls for cls in (TritonDecodeShardAttention, TritonSparseShardAttention,
                                                               TorchShardAttention)}


def shard_attention(name_or_obj: Any) -> ShardAttention:
    """A ShardAttention by name (``torch``, ``triton_sparse``), or the object itself."""
    if isinstance(name_or_obj, str):
        try:
            return SHARD_ATTENTIONS[name_or_obj]()
        except KeyError:
            raise ValueError(f"unknown shard attention {name_or_obj!r}; known: {sorted(SHARD_ATTENTIONS)}") from None
    missing = [attr for attr in ("name", "layouts", "prepare") if not hasattr(name_or_obj, attr)]
    if missing:
        raise ValueError(f"a shard attention needs {', '.join(missing)} (see ShardAttention), got {name_or_obj!r}")
    return name_or_obj
