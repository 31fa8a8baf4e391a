"""Stand-in for FlashInfer's BatchMLAPagedAttentionWrapper, written from its docstring, in plain torch:
CSR pages, causal aligned to the end of each request, lse in base 2. A request with no keys gets out 0 and the
finite lse -49998.0 that FlashInfer 0.2.5's sm90 kernel wrote for it on an H200 (its running max starts at
-5e4, not -inf); other rows that see nothing get lse -inf."""

import math

import torch

EMPTY_REQUEST_LSE = -49998.0


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto"):
        self.device = float_workspace_buffer.device

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        self._meta = [t.cpu().long() for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr)]
        self._page, self._causal, self._scale = page_size, causal, sm_scale

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        qo, kv_ptr, kv_idx, kv_len = self._meta
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype) if out is None else out
        lse = torch.empty(q_nope.shape[:2], dtype=torch.float32) if lse is None else lse
        out.zero_()
        lse.fill_(float("-inf"))
        for b in range(len(kv_len)):
            pages = kv_idx[kv_ptr[b]:kv_ptr[b + 1]]
            n, q0, q1 = int(kv_len[b]), int(qo[b]), int(qo[b + 1])
            keys = torch.cat([ckv_cache[pages].reshape(-1, ckv_cache.shape[-1]),
                              kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])], -1)[:n].float()
            for i, t in enumerate(range(q0, q1)):
                seen = n - (q1 - q0) + i + 1 if self._causal else n
                if n == 0:
                    lse[t] = EMPTY_REQUEST_LSE
                if seen <= 0:
                    continue
                q = torch.cat([q_nope[t], q_pe[t]], -1).float()
                scores = q @ keys[:seen].T * self._scale
                lse[t] = torch.logsumexp(scores, -1) / math.log(2)
                out[t] = (torch.softmax(scores, -1) @ keys[:seen, : ckv_cache.shape[-1]]).to(out.dtype)
        return (out, lse) if return_lse else out
