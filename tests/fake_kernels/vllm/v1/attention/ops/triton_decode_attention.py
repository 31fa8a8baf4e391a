"""Stand-in for vLLM's Triton MLA decode (vLLM 0.33's signature, with ``is_mla``), written from its signature and
docs, in plain torch (CPU tests of the adapter's plumbing). Like the real kernel, a row of length 0 divides by zero
(NaN), and the layer scales apply only to an fp8 cache."""

import torch


def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits,
                         sm_scale, page_size=1, logit_cap=0.0, k_scale=None, v_scale=None, is_mla=False):
    assert num_kv_splits == attn_logits.shape[2] and k_buffer.dim() == 4 and v_buffer.shape[-1] == o.shape[-1]
    # Without is_mla the real kernel pads the 576 dims to a 1024-wide tile: right, and not what vLLM's MLA backend
    # runs (slower).
    assert is_mla, "vLLM's MLA backend calls the kernel with is_mla=True"
    assert k_scale is not None and v_scale is not None, "vLLM's MLA backend passes the layer's scales"
    fp8 = k_buffer.dtype == torch.float8_e4m3fn
    rows = k_buffer.reshape(-1, k_buffer.shape[-1]).float() * (float(k_scale) if fp8 else 1.0)
    for b in range(q.shape[0]):
        n = int(b_seq_len[b])
        if n == 0:
            o[b], lse[b] = float("nan"), float("nan")
            continue
        pos = torch.arange(n, device=q.device)
        keys = rows[req_to_token[b].long()[pos // page_size] * page_size + pos % page_size]
        scores = q[b].float() @ keys.T * sm_scale
        lse[b] = torch.logsumexp(scores, -1)
        values = keys[:, : v_buffer.shape[-1]] * (float(v_scale) / float(k_scale) if fp8 else 1.0)
        o[b] = (torch.softmax(scores, -1) @ values).to(o.dtype)
