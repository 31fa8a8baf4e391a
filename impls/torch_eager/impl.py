"""Plain torch decode (absorbed MQA over the paged bf16 cache) and prefill (MHA), request by request.

Compute follows a flash kernel's precision: scores and softmax in float32 from the input dtype, the
probabilities rounded to the input dtype for the second matmul, float32 accumulation, output in the input
dtype. ``plan`` turns the block table into per-request slot lists on the device; ``run`` only gathers and
multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_bench.dims import check_softmax_scale
from mla_bench.errors import describe
from mla_bench.layouts import LATENT_DIM, NOPE_DIM
from mla_bench.lengths import check_lengths
from mla_bench.metadata.reference import check_block_table, cumulative, request_token_slots
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

# Score elements per block of query rows: bounds memory on long prefills.
_BLOCK_ELEMENTS = 1 << 26


@dataclass
class TorchEagerPlan:
    problem: Problem
    request_slots: list[torch.Tensor]  # decode: cache slots of each request's tokens


class TorchEager(Impl):
    name = "torch_eager"
    description = "plain torch, one request at a time (the baseline a user writes first)"
    capabilities = Capabilities(
        modes=frozenset({Mode.DECODE, Mode.PREFILL}),
        layouts=frozenset({"bf16"}),
        dtypes=frozenset({"bfloat16", "float16", "float32"}),
        devices=frozenset({"cpu", "cuda"}),
    )

    def plan(self, problem: Problem) -> TorchEagerPlan:
        check_inputs(problem)
        slots = []
        if problem.workload.mode is Mode.DECODE:
            meta = problem.meta
            slots = [request_token_slots(meta.block_table, b, n, meta.page_size).to(problem.device)
                     for b, n in enumerate(meta.kv_lens)]
        return TorchEagerPlan(problem, slots)

    def run(self, plan: TorchEagerPlan) -> tuple[torch.Tensor, torch.Tensor]:
        p = plan.problem
        if p.workload.mode is Mode.DECODE:
            return decode(p, p.q, plan.request_slots)
        starts = cumulative(list(p.meta.kv_lens))
        heads = p.q.shape[1]
        keys, values = [], []
        for b in range(p.meta.batch):
            rows = slice(starts[b], starts[b + 1])
            k_pe = p.k_pe[rows][:, None, :].expand(-1, heads, -1)
            keys.append(torch.cat([p.k_nope[rows], k_pe], dim=-1))
            values.append(p.v[rows])
        return _attention(p, p.q, keys, values)


def check_inputs(p: Problem, block_table: torch.Tensor | None = None) -> None:
    """ValueError, in plan, for what run would read wrongly or fail on: the scale (a NaN one gave NaN everywhere),
    the lengths (a negative or missing one was read silently, a query longer than its context gave NaN rows), the
    queries (and a prefill's keys) of other shapes or dtypes than the problem's (torch failed in run, or out came
    back in the queries' dtype), and a decode's block table: a bad slot would read another request's keys silently
    (a negative one wraps around) or fail deep inside torch. ``block_table``: a host copy of the problem's to check
    instead (read there without another copy)."""
    meta, dims, decode = p.meta, p.dims, p.workload.mode is Mode.DECODE
    check_softmax_scale(p.scale)
    q_lens, kv_lens = check_lengths(meta.q_lens, meta.kv_lens)
    heads, keys = dims.num_heads, sum(kv_lens)
    expected = {"q": (sum(q_lens), heads, LATENT_DIM if decode else dims.qk_head_dim)}
    if not decode:
        expected.update(k_nope=(keys, heads, dims.qk_nope_head_dim), k_pe=(keys, dims.qk_rope_head_dim),
                        v=(keys, heads, p.out_dim))
    for name, shape in expected.items():
        tensor = getattr(p, name)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != p.dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {p.dtype} {list(shape)} (the lengths and the problem's dims and "
                             f"dtype), got {describe(tensor)}")
    if decode:
        check_block_table(meta.block_table if block_table is None else block_table, list(kv_lens), meta.page_size,
                          p.cache.num_blocks)


def decode(p: Problem, q: torch.Tensor, request_slots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed decode of queries ``q`` over the cache slots of each request, on the device of ``q`` (which must
    hold the cache and the slots)."""
    cache_rows = p.cache.rows().view(torch.bfloat16)
    keys = [cache_rows[slots] for slots in request_slots]
    return _attention(p, q, keys, [k[:, :NOPE_DIM] for k in keys])


def _attention(p: Problem, q_all: torch.Tensor, keys: list[torch.Tensor],
               values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention request by request, on the device of ``q_all``. ``keys[b]`` / ``values[b]`` are ``[N, D]``
    (one head shared by all query heads: MQA) or ``[N, H, D]`` (MHA)."""
    dtype = q_all.dtype
    heads = q_all.shape[1]
    out = torch.zeros(q_all.shape[0], heads, p.out_dim, dtype=dtype, device=q_all.device)
    lse = torch.full((q_all.shape[0], heads), float("-inf"), dtype=torch.float32, device=q_all.device)
    q_starts = cumulative(list(p.meta.q_lens))
    for b, (q_len, kv_len) in enumerate(zip(p.meta.q_lens, p.meta.kv_lens)):
        if q_len == 0 or kv_len == 0:
            continue
        shared = keys[b].dim() == 2
        k = keys[b].float()  # exact: the cache's bf16, or a prefill's keys in the queries' dtype
        v = values[b].float()
        step = max(1, _BLOCK_ELEMENTS // (heads * kv_len))
        for r0 in range(0, q_len, step):
            rows = slice(q_starts[b] + r0, q_starts[b] + min(q_len, r0 + step))
            q = q_all[rows].float()
            scores = (torch.einsum("mhd,nd->hmn", q, k) if shared else torch.einsum("mhd,nhd->hmn", q, k)) * p.scale
            frontier = kv_len - q_len + torch.arange(r0, r0 + q.shape[0], device=q.device)
            masked = torch.arange(kv_len, device=q.device)[None, :] > frontier[:, None]
            scores.masked_fill_(masked[None], float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - row_lse[..., None]).to(dtype).float()
            o = torch.einsum("hmn,nd->mhd", probs, v) if shared else torch.einsum("hmn,nhd->mhd", probs, v)
            out[rows] = o.to(dtype)
            lse[rows] = row_lse.transpose(0, 1)
    return out, lse
