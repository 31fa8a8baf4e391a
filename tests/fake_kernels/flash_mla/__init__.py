"""Stand-in for FlashMLA's interface, written from flash_mla_interface.py's docstrings, in plain torch:
q [B, s_q, H, 576], out [B, s_q, H, 512], lse [B, H, s_q], +inf lse for a row with no key; sparse prefill
over kv rows with [T, 1, topk] indices (-1 or >= rows invalid)."""

import torch


def get_mla_metadata(*args, **kwargs):
    return object(), None


def _attend(q, keys, scale):
    scores = q.float() @ keys.float().T * scale
    return torch.softmax(scores, -1) @ keys[:, :512].float(), torch.logsumexp(scores, -1)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None):
    assert num_splits is None and indices is None and not is_fp8_kvcache, "fake: dense bf16 decode only"
    batch, s_q, heads, _ = q.shape
    page = k_cache.shape[1]
    rows = k_cache.reshape(-1, k_cache.shape[-1])
    out = torch.zeros(batch, s_q, heads, head_dim_v, dtype=q.dtype)
    lse = torch.full((batch, heads, s_q), float("inf"))
    for b in range(batch):
        n = int(cache_seqlens[b])
        pos = torch.arange(n)
        keys = rows[block_table[b].long()[pos // page] * page + pos % page]
        for i in range(s_q):
            seen = n - s_q + i + 1 if causal else n
            if seen > 0:
                o, l = _attend(q[b, i], keys[:seen], softmax_scale)
                out[b, i], lse[b, :, i] = o.to(q.dtype), l
    return out, lse


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512):
    out = torch.zeros(q.shape[0], q.shape[1], d_v, dtype=q.dtype)
    lse = torch.full(q.shape[:2], float("inf"))
    for t in range(q.shape[0]):
        idx = indices[t, 0].long()
        idx = idx[(idx >= 0) & (idx < kv.shape[0])]
        if idx.numel():
            o, l = _attend(q[t], kv[idx, 0], sm_scale)
            out[t], lse[t] = o.to(q.dtype), l
    return out, lse.clone(), lse
