"""What a workload costs: bytes it must move and FLOPs it must do (the numerators of GB/s and TFLOP/s).

Bytes = cache bytes of the tokens each request really reads (``bytes_per_token`` of the layout; none for a
request without query tokens; sparse: the distinct valid positions its query tokens' top-k lists select, counted
in the problem's indices: query tokens of one request share keys; prefill: the q/k/v tensors) + the queries that
see a key (a row that sees none need not be read) + the outputs (out in the compute dtype, lse in float32; every
row). Not counted: block tables, top-k indices and other metadata. FLOPs count only the keys each query token sees:
absorbed paths ``2 * visible * (576 + 512)`` per head per query token (QK^T over 576, PV over 512), MHA paths
``2 * visible * (192 + 128)``. Chunked prefill counts its attention only: neither the up-projection of the context
(FLOPs) nor its weights (bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_bench.layouts import get_layout
from mla_bench.workload import Mode, Workload

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
LSE_BYTES = 4


@dataclass(frozen=True)
class Cost:
    bytes: int
    flops: int

    def gbps(self, ms: float) -> float:
        return self.bytes / (ms * 1e-3) / 1e9

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12


def visible_keys(w: Workload) -> list[int]:
    """Keys each query token sees, request after request (causal: query i of a request sees
    ``kv_len - q_len + i + 1``; sparse: the valid top-k entries, ``min(topk, causally visible)``)."""
    visible = []
    for q_len, kv_len in zip(w.q_lens, w.kv_lens):
        for i in range(q_len):
            seen = max(kv_len - q_len + i + 1, 0) if kv_len else 0
            visible.append(min(seen, w.topk) if w.mode.sparse else seen)
    return visible


def sparse_tokens_read(w: Workload, topk_indices: torch.Tensor) -> int:
    """Distinct cache tokens a sparse step must read: per request, the distinct valid (>= 0) positions of its query
    tokens' rows of ``topk_indices`` (``[total_q, topk]``, positions in the request)."""
    if tuple(topk_indices.shape[:1]) != (w.total_q,):
        raise ValueError(f"topk_indices needs a row per query token ({w.total_q}), got {tuple(topk_indices.shape)}")
    owner = torch.repeat_interleave(torch.arange(w.batch), torch.tensor(w.q_lens)).to(topk_indices.device)
    keys = owner[:, None] * (max(w.kv_lens) + 1) + topk_indices.long()
    return int(torch.unique(keys[topk_indices >= 0]).numel())


def cost(w: Workload, topk_indices: torch.Tensor | None = None) -> Cost:
    """Bytes and FLOPs of one step of ``w`` (see the module docstring); a sparse mode needs its problem's
    ``topk_indices``, whose distinct positions are the tokens it reads."""
    if w.mode.sparse and topk_indices is None:
        raise ValueError(f"the bytes of {w.mode.value} are the tokens its top-k indices select: pass topk_indices")
    dims, heads, elem = w.dims, w.dims.num_heads, DTYPE_BYTES[w.dtype]
    visible = visible_keys(w)
    seeing = sum(1 for keys in visible if keys)
    queried_kv = sum(kv for q, kv in zip(w.q_lens, w.kv_lens) if q)
    if w.mode.absorbed:
        head_flops = 2 * (dims.latent_dim + dims.kv_lora_rank)
        q_bytes = seeing * heads * dims.latent_dim * elem
        out_bytes = w.total_q * heads * (dims.kv_lora_rank * elem + LSE_BYTES)
        bpt = get_layout(w.layout).bytes_per_token
        kv_bytes = (sparse_tokens_read(w, topk_indices) if w.mode.sparse else queried_kv) * bpt
    else:
        head_flops = 2 * (dims.qk_head_dim + dims.v_head_dim)
        q_bytes = seeing * heads * dims.qk_head_dim * elem
        out_bytes = w.total_q * heads * (dims.v_head_dim * elem + LSE_BYTES)
        new_tokens = queried_kv if w.mode is Mode.PREFILL else w.total_q
        per_token = heads * (dims.qk_nope_head_dim + dims.v_head_dim) * elem + dims.qk_rope_head_dim * elem
        kv_bytes = new_tokens * per_token
        if w.mode is Mode.CHUNKED_PREFILL:
            kv_bytes += (queried_kv - w.total_q) * get_layout(w.layout).bytes_per_token
    return Cost(bytes=kv_bytes + q_bytes + out_bytes, flops=sum(visible) * heads * head_flops)
