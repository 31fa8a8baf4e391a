"""FlashInfer's ``BatchMLAPagedAttentionWrapper`` (absorbed MLA decode over a paged cache, CSR metadata).

API (flashinfer/mla.py): ``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, 512, 64, page_size,
causal, sm_scale, q_dtype, kv_dtype)`` then ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=, lse=,
return_lse=True)``; ``ckv`` / ``kpe`` are ``[pages, page_size, 512 | 64]`` (views of our bf16 cache), lse is
``[tokens, heads]`` in base 2 (declared; the bench converts). Causal masking aligns queries to the end of the
request, as the bench's definition. The plan builds the CSR page list from the block table (host work,
timed as plan time).

A request with no keys gets out 0 from FlashInfer 0.2.5's sm90 kernel but a finite lse (-49998 in base 2 on an
H200: its running max starts at -5e4), where the bench's convention is -inf; in a merge both weigh nothing. When
the batch has such requests, ``run`` sets their rows' lse to -inf in place (one small fill; none otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impls.external import require
from mla_bench.layouts import NOPE_DIM
from mla_bench.metadata.reference import blocks_needed, cumulative
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

WORKSPACE_BYTES = 128 << 20


@dataclass
class FlashInferPlan:
    wrapper: object
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv: torch.Tensor
    kpe: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    empty_rows: torch.Tensor | None  # query rows of requests with no keys (their lse is set to -inf)


class FlashInferMLA(Impl):
    name = "flashinfer_mla"
    description = "FlashInfer BatchMLAPagedAttentionWrapper (backend auto)"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), layouts=frozenset({"bf16"}),
                                dtypes=frozenset({"bfloat16"}), devices=frozenset({"cuda"}), lse_base="2")
    backend = "auto"

    def __init__(self) -> None:
        self._mla = require("flashinfer.mla", names=("BatchMLAPagedAttentionWrapper",),
                            hint="FlashInfer is not installed (pip install flashinfer-python)")

    def plan(self, problem: Problem) -> FlashInferPlan:
        meta, cache, device = problem.meta, problem.cache, problem.device
        pages = [blocks_needed(n, meta.page_size) for n in meta.kv_lens]
        table = meta.block_table.cpu()
        kv_indices = torch.cat([table[b, :n] for b, n in enumerate(pages)]).to(torch.int32)
        kv_indptr = torch.tensor(cumulative(pages), dtype=torch.int32)
        wrapper = self._mla.BatchMLAPagedAttentionWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), backend=self.backend)
        heads = problem.q.shape[1]
        wrapper.plan(meta.query_start_loc.to(device), kv_indptr.to(device), kv_indices.to(device),
                     meta.seq_lens.to(device), heads, NOPE_DIM, problem.q.shape[2] - NOPE_DIM, meta.page_size, True,
                     problem.scale, problem.q.dtype, torch.bfloat16)
        kv = cache.data.view(torch.bfloat16)
        out = torch.empty(problem.q.shape[0], heads, NOPE_DIM, dtype=problem.q.dtype, device=device)
        lse = torch.empty(problem.q.shape[0], heads, dtype=torch.float32, device=device)
        empty = [t for start, q, n in zip(cumulative(list(meta.q_lens)), meta.q_lens, meta.kv_lens) if n == 0
                 for t in range(start, start + q)]
        return FlashInferPlan(wrapper, problem.q[..., :NOPE_DIM].contiguous(), problem.q[..., NOPE_DIM:].contiguous(),
                              kv[..., :NOPE_DIM], kv[..., NOPE_DIM:], out, lse,
                              torch.tensor(empty, dtype=torch.long, device=device) if empty else None)

    def poison(self, plan: FlashInferPlan) -> None:
        plan.out.fill_(float("nan"))
        plan.lse.fill_(float("nan"))

    def run(self, plan: FlashInferPlan) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = plan.wrapper.run(plan.q_nope, plan.q_pe, plan.ckv, plan.kpe, out=plan.out, lse=plan.lse,
                                    return_lse=True)
        if plan.empty_rows is not None:
            lse.index_fill_(0, plan.empty_rows, float("-inf"))
        return out, lse
