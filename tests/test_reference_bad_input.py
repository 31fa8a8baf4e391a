"""The reference refuses bad input with an error naming the problem, before any work."""

from __future__ import annotations

import pytest
import torch

from reference.absorbed import latent_mqa
from reference.chunked import chunked_prefill
from reference.core import attend
from reference.dcp import dcp_latent_mqa
from reference.merge import merge_attn_states
from reference.mha import mha_attention
from reference.sparse import sparse_latent_mqa

Q = torch.randn(3, 2, 576, dtype=torch.float64)
KV = torch.randn(10, 576, dtype=torch.float64)


@pytest.mark.parametrize("call, message", [
    (lambda: latent_mqa(Q[..., :575], KV, (3,), (10,), 0.1), "q must have last dimension 576"),
    (lambda: latent_mqa(Q, KV[:, None], (3,), (10,), 0.1), "kv must have 2 dimensions"),
    (lambda: latent_mqa(Q.long(), KV, (3,), (10,), 0.1), "q must be floating point"),
    (lambda: latent_mqa(Q, KV, (3,), (9,), 0.1), "sum\\(kv_lens\\)=9"),
    (lambda: latent_mqa(Q, KV, (3, 0), (10,), 0.1), "q_lens has 2 requests"),
    (lambda: latent_mqa(Q, KV, (-3,), (10,), 0.1), "must be >= 0"),
    (lambda: latent_mqa(Q, KV[:2], (3,), (2,), 0.1), "query longer than context"),
    (lambda: attend(Q, KV[:, None].to("meta"), KV[:, None, :512], None, 0.1), "different devices"),
    (lambda: attend(Q, KV[:, None], KV[:5, None, :512], None, 0.1), "matching N"),
    (lambda: mha_attention(torch.randn(3, 2, 192), torch.randn(10, 3, 128), torch.randn(10, 64),
                           torch.randn(10, 3, 128), (3,), (10,), 0.1), "query heads"),
    (lambda: sparse_latent_mqa(Q, KV, torch.zeros(3, 4), (3,), (10,), 0.1), "int32/int64"),
    (lambda: sparse_latent_mqa(Q, KV, torch.zeros(2, 4, dtype=torch.int32), (3,), (10,), 0.1), "2 rows"),
    (lambda: dcp_latent_mqa(Q, KV, (3,), (10,), 0.1, 0, 1), "world must be a positive int"),
    (lambda: dcp_latent_mqa(Q, KV, (3,), (10,), 0.1, 2, 0), "interleave must be a positive int"),
    (lambda: chunked_prefill(torch.randn(1, 2, 192), torch.randn(1, 2, 128), torch.randn(1, 64),
                             torch.randn(1, 2, 128), torch.randn(4, 576), torch.randn(2, 512, 128),
                             torch.randn(2, 512, 128), (1,), (5,), 0.1, 0), "chunk_size must be a positive int"),
    (lambda: merge_attn_states(torch.randn(3, 2, 8), torch.randn(3, 2), torch.randn(3, 2, 4), torch.randn(3, 2)),
     "shapes differ"),
])
def test_bad_reference_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
