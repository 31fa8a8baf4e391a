"""``triton_chunked_prefill``: prefill with cached context, the context streamed through a bounded workspace.

The context tokens of every request (request after request, requests without queries skipped) form one
stream; chunk ``c`` is the stream's tokens ``[c * MCC, (c + 1) * MCC)`` with MCC = ``workload.chunk_size``, so a
chunk may hold the tail of one request and the head of the next. Per chunk: gather and dequantize the latent
from the paged cache into the workspace (per token, so chunks may start mid-page and MCC needs no rounding
to the page size), up-project it with ``[W_UK | W_UV]`` in one matmul, attend without a mask (ragged: each
request's queries see only its own keys of the chunk; a request with none gets out 0 / lse -inf), merge
into the running result by LSE. Last, causal attention over the new tokens is merged in.

Precision: the chunk's latent, its up-projected keys / values and the weights are float16, whatever the
compute dtype. Rounding derived keys to bfloat16 alone moves the lse by about 1e-2 (measured against the
float64 reference: twice the bf16 tolerance), float16's three extra mantissa bits cut that eightfold;
bf16 latents and weights convert to float16 exactly in their range, at no cost in speed.

Memory: every buffer is allocated by ``plan`` and reused by each chunk, so the run's extra memory is
``plan.workspace_bytes`` whatever the context length: MCC rows of latent and up-projected keys/values, plus
float32 partial and running outputs over the queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impls.triton.latent_io import LAYOUT_CODES, gather_latent, layout_code
from impls.triton.merge import merge_attn_states
from impls.triton.cache_ops import triton_unavailable
from impls.triton.common import check_e4m3, check_token_slots
from impls.triton.prefill import check_problem
from impls.triton.prefill_kernel import NOPE, VDIM, PrefillConfig, default_config, mha_prefill
from mla_bench.layouts import LATENT_DIM, NOPE_DIM
from mla_bench.metadata.reference import cumulative
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

UP_DTYPE = torch.float16  # the context path's dtype (see the module docstring)


@dataclass
class ContextChunk:
    """One workspace fill: the cache slots of its tokens and the requests they belong to.

    A chunk covers consecutive requests ``first_request ..`` (those with context in it), whose query rows
    ``q_rows`` are consecutive too; only those rows are attended and merged.
    """

    slots: torch.Tensor         # [n] int64 cache slots, request after request
    cu_seqlens_q: torch.Tensor  # [b+1] int32 absolute query offsets of the chunk's requests
    cu_seqlens_k: torch.Tensor  # [b+1] int32: request i's keys are rows cu[i]:cu[i+1] of the chunk
    q_rows: slice               # the chunk's requests' query rows
    max_q_len: int
    num_tokens: int


@dataclass
class ChunkWorkspace:
    """The buffers a chunked run reuses; their size depends on MCC, the queries and heads, never on context."""

    latent: torch.Tensor    # [rows, 576] float16: gathered, dequantized context
    kv_up: torch.Tensor     # [rows, H, 256] float16: k_nope | v of the chunk
    part_out: torch.Tensor  # [T, H, 128] float32: one chunk's (or the suffix's) attention
    part_lse: torch.Tensor  # [T, H] float32
    run_out: torch.Tensor   # [T, H, 128] float32: merged context so far
    run_lse: torch.Tensor   # [T, H] float32

    @property
    def rows(self) -> int:
        return self.latent.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


@dataclass
class ChunkedPlan:
    problem: Problem
    chunks: list[ContextChunk]
    workspace: ChunkWorkspace
    w_kv: torch.Tensor      # [512, H * 256] float16: [W_UK | W_UV] per head, the up-projection as one matmul
    out: torch.Tensor       # [T, H, 128] compute dtype
    lse: torch.Tensor       # [T, H] float32
    config: PrefillConfig

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.nbytes


def context_lens(q_lens, kv_lens) -> list[int]:
    """Cached tokens before this step, per request; requests without queries need none of theirs."""
    return [kv - q if kv and q else 0 for q, kv in zip(q_lens, kv_lens)]


def context_segments(ctx_lens, chunk_size: int) -> list[list[tuple[int, int, int]]]:
    """The context stream (request after request) cut into chunks of at most ``chunk_size`` tokens: per chunk,
    its pieces as ``(request, first position, end position)``, positions counted from the request's start."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    stream_starts = cumulative(list(ctx_lens))
    chunks = []
    for c0 in range(0, stream_starts[-1], chunk_size):
        c1 = c0 + chunk_size
        chunks.append([(b, max(c0, start) - start, min(c1, start + ctx) - start)
                       for b, (start, ctx) in enumerate(zip(stream_starts, ctx_lens))
                       if min(c1, start + ctx) > max(c0, start)])
    return chunks


def check_context_inputs(problem: Problem) -> None:
    """ValueError unless the context path's own inputs are what it reads: ``meta.token_slots`` and the cache as
    ``check_token_slots`` says (here the gather read a slot outside the cache as a row of zeros, a wrong key that no
    error shows) and ``[H, 512, 128]`` up-projections (one head's would be broadcast to every head)."""
    check_token_slots(problem)
    heads = problem.q.shape[1]
    for name, width in (("w_uk", NOPE), ("w_uv", VDIM)):
        shape = getattr(problem, name).shape
        if shape != (heads, NOPE_DIM, width):
            raise ValueError(f"{name} must be [{heads}, {NOPE_DIM}, {width}], got {list(shape)}")


def context_chunks(problem: Problem, chunk_size: int) -> list[ContextChunk]:
    """The context chunks of ``problem`` with their cache slots and per-request split."""
    meta = problem.meta
    q_starts, kv_starts = cumulative(list(meta.q_lens)), cumulative(list(meta.kv_lens))
    chunks = []
    for pieces in context_segments(context_lens(meta.q_lens, meta.kv_lens), chunk_size):
        b0, b1 = pieces[0][0], pieces[-1][0] + 1  # requests between them have no context: 0 keys here
        counts = [0] * (b1 - b0)
        for b, lo, hi in pieces:
            counts[b - b0] = hi - lo
        rows = torch.cat([torch.arange(kv_starts[b] + lo, kv_starts[b] + hi) for b, lo, hi in pieces])
        chunks.append(ContextChunk(
            slots=meta.token_slots[rows.to(meta.token_slots.device)],
            cu_seqlens_q=torch.tensor(q_starts[b0:b1 + 1], dtype=torch.int32, device=problem.device),
            cu_seqlens_k=torch.tensor(cumulative(counts), dtype=torch.int32, device=problem.device),
            q_rows=slice(q_starts[b0], q_starts[b1]),
            max_q_len=max(meta.q_lens[b0:b1]),
            num_tokens=sum(counts)))
    return chunks


class TritonChunkedPrefill(Impl):
    name = "triton_chunked_prefill"
    description = "context gathered from the paged cache in MCC-token chunks, up-projected, attended, LSE-merged"
    capabilities = Capabilities(
        modes=frozenset({Mode.CHUNKED_PREFILL}),
        layouts=frozenset(LAYOUT_CODES),
        dtypes=frozenset({"bfloat16", "float16"}),
        graph_safe=True,  # every buffer comes from plan; run only launches
    )

    def __init__(self, config: PrefillConfig | None = None) -> None:
        self.config = config

    def refusal(self, problem: Problem) -> str | None:
        return super().refusal(problem) or triton_unavailable(problem.device)

    def plan(self, problem: Problem) -> ChunkedPlan:
        layout_code(problem.cache.layout.name)  # refuses layouts the gather cannot decode
        check_e4m3(problem.device, problem.cache.layout.name, self.name)
        check_problem(problem, problem.meta.query_start_loc, problem.meta.q_lens)  # keys: the new tokens
        check_context_inputs(problem)
        w = problem.workload
        tokens, heads = problem.q.shape[:2]
        dtype, device = problem.q.dtype, problem.device
        chunks = context_chunks(problem, w.chunk_size)
        rows = max((c.num_tokens for c in chunks), default=0)
        workspace = ChunkWorkspace(
            latent=torch.empty(rows, LATENT_DIM, dtype=UP_DTYPE, device=device),
            kv_up=torch.empty(rows, heads, 2 * problem.dims.v_head_dim, dtype=UP_DTYPE, device=device),
            part_out=torch.empty(tokens, heads, problem.out_dim, dtype=torch.float32, device=device),
            part_lse=torch.empty(tokens, heads, dtype=torch.float32, device=device),
            run_out=torch.empty(tokens, heads, problem.out_dim, dtype=torch.float32, device=device),
            run_lse=torch.empty(tokens, heads, dtype=torch.float32, device=device),
        )
        nope = problem.dims.qk_nope_head_dim
        w_kv = torch.empty(NOPE_DIM, heads, 2 * nope, dtype=UP_DTYPE, device=device)  # filled in place: no temporaries
        w_kv[:, :, :nope].copy_(problem.w_uk.permute(1, 0, 2))
        w_kv[:, :, nope:].copy_(problem.w_uv.permute(1, 0, 2))
        out = torch.empty(tokens, heads, problem.out_dim, dtype=dtype, device=device)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=device)
        return ChunkedPlan(problem, chunks, workspace, w_kv.view(NOPE_DIM, -1), out, lse,
                           self.config or default_config(device))

    def poison(self, plan: ChunkedPlan) -> None:
        for t in (plan.out, plan.lse, *vars(plan.workspace).values()):
            t.fill_(float("nan"))

    def run(self, plan: ChunkedPlan) -> tuple[torch.Tensor, torch.Tensor]:
        p, ws = plan.problem, plan.workspace
        meta, nope = p.meta, p.dims.qk_nope_head_dim
        cu_q, max_q = meta.query_start_loc, meta.max_qo_len
        if not plan.chunks:
            return mha_prefill(p.q, p.k_nope, p.k_pe, p.v, cu_q, cu_q, max_q, p.scale, causal=True, out=plan.out,
                               lse=plan.lse, config=plan.config)
        ws.run_out.zero_()
        ws.run_lse.fill_(float("-inf"))
        for chunk in plan.chunks:
            n, rows = chunk.num_tokens, chunk.q_rows
            latent = gather_latent(p.cache, chunk.slots, ws.latent)
            kv_up = ws.kv_up[:n]
            torch.matmul(latent[:, :NOPE_DIM], plan.w_kv, out=kv_up.view(n, -1))
            mha_prefill(p.q, kv_up[:, :, :nope], latent[:, NOPE_DIM:], kv_up[:, :, nope:], chunk.cu_seqlens_q,
                        chunk.cu_seqlens_k, chunk.max_q_len, p.scale, causal=False, out=ws.part_out,
                        lse=ws.part_lse, config=plan.config)
            merge_attn_states(ws.run_out[rows], ws.run_lse[rows], ws.part_out[rows], ws.part_lse[rows],
                              ws.run_out[rows], ws.run_lse[rows])
        mha_prefill(p.q, p.k_nope, p.k_pe, p.v, cu_q, cu_q, max_q, p.scale, causal=True, out=ws.part_out,
                    lse=ws.part_lse, config=plan.config)
        return merge_attn_states(ws.run_out, ws.run_lse, ws.part_out, ws.part_lse, plan.out, plan.lse)
