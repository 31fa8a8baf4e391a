"""Stand-in for vLLM's Triton MLA decode, written from its signature and docs, in plain torch (CPU tests of
the adapter's plumbing). Like the real kernel, a request of length 0 divides by zero (NaN)."""

import torch


def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits,
                         sm_scale, page_size=1, logit_cap=0.0, k_scale=None):
    assert num_kv_splits == attn_logits.shape[2] and k_buffer.dim() == 4 and v_buffer.shape[-1] == o.shape[-1]
    # vLLM's TRITON_MLA backend passes k_scale only with an fp8 cache: given one, the real kernel takes its fp8
    # dequantize path (slower, and not what vLLM runs on a bf16 cache).
    assert (k_scale is not None) == (k_buffer.dtype == torch.float8_e4m3fn), "k_scale goes with an fp8 cache only"
    rows = k_buffer.reshape(-1, k_buffer.shape[-1]).float() * (1.0 if k_scale is None else float(k_scale))
    for b in range(q.shape[0]):
        n = int(b_seq_len[b])
        if n == 0:
            o[b], lse[b] = float("nan"), float("nan")
            continue
        pos = torch.arange(n, device=q.device)
        keys = rows[req_to_token[b].long()[pos // page_size] * page_size + pos % page_size]
        scores = q[b].float() @ keys.T * sm_scale
        lse[b] = torch.logsumexp(scores, -1)
        o[b] = (torch.softmax(scores, -1) @ keys[:, : v_buffer.shape[-1]]).to(o.dtype)
