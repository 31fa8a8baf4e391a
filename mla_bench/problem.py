"""The tensors of a Workload on a device: queries, the paged cache, metadata, weights, indices.

Everything is drawn from one seeded CPU generator and then moved, so a workload gives the same values on
every device. The paged cache goes to the workload's ``cache_device`` when it names one (host memory while the
rest lives on the GPU), else with the rest. Values are fresh random numbers (never zeros), scaled so that scores
have a standard deviation near 2: softmax is neither uniform nor one-hot. Unused cache bytes and block-table
padding read as NaN.

Per mode:

- absorbed modes (decode, sparse, dcp): ``q`` is ``[T, H, 576]`` (``q_nope @ W_UK`` | ``q_pe``);
  the keys are the latent cache, the values its first 512 columns; the output is ``[T, H, 512]``.
- prefill: ``q`` is ``[T, H, 192]``; ``k_nope`` / ``v`` ``[N, H, 128]`` and ``k_pe`` ``[N, 64]`` hold every
  key of every request (ragged by ``meta.kv_start_loc``); no cache; the output is ``[T, H, 128]``.
- chunked_prefill: as prefill, but ``k_nope`` / ``k_pe`` / ``v`` hold only the new tokens (ragged like ``q``),
  and the context comes from the paged cache, up-projected with ``w_uk`` / ``w_uv``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from mla_bench.dims import MLADims
from mla_bench.layouts import NOPE_DIM, PagedCache, get_layout
from mla_bench.layouts.ops import write_cache
from mla_bench.metadata import PagedMetadata, reference
from mla_bench.workload import Mode, Workload

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Problem:
    """One workload's inputs on one device (see the module docstring for shapes per mode)."""

    workload: Workload
    dims: MLADims
    device: torch.device
    scale: float
    meta: PagedMetadata
    kv: torch.Tensor                    # [N, 576] original latent of every token, ragged by meta.kv_start_loc
    w_uk: torch.Tensor                  # [H, 512, 128]: k_nope = kv_c @ w_uk[h]
    w_uv: torch.Tensor                  # [H, 512, 128]: v = kv_c @ w_uv[h]
    q: torch.Tensor                     # [T, H, 576] absorbed, or [T, H, 192] MHA
    cache: PagedCache | None = None     # modes that read the paged cache
    k_nope: torch.Tensor | None = None  # MHA modes
    k_pe: torch.Tensor | None = None
    v: torch.Tensor | None = None
    topk_indices: torch.Tensor | None = None    # sparse: [T, topk] int32 positions in the request, -1 invalid
    sparse_indices: torch.Tensor | None = None  # sparse: topk_indices after the workload's index transform

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.workload.dtype]

    @property
    def out_dim(self) -> int:
        """Output width per head: 512 (latent) on absorbed paths, 128 (v) on MHA paths."""
        return self.dims.kv_lora_rank if self.workload.mode.absorbed else self.dims.v_head_dim

    def copy(self) -> "Problem":
        """The same inputs at new addresses: every tensor copied on its own device (views keep sharing their copied
        storage), the cache's layout object shared. The latency suite's input sets past the first: a launch must not
        find the previous set's bytes in L2, which takes other addresses, not other values."""
        layout = self.cache.layout if self.cache is not None else None
        return copy.deepcopy(self, {id(layout): layout} if layout is not None else None)


def build_problem(workload: Workload, device: torch.device | str = "cpu") -> Problem:
    """Draw the inputs of ``workload`` (deterministic in its seed) and place them on ``device``. The problem holds
    its own copy of ``workload``: an impl that rewrites that in place cannot change what the caller builds next."""
    device = _available(torch.device(device), "build_problem was asked to put the problem", workload)
    cache_device = _cache_device(workload, device)
    gen = torch.Generator().manual_seed(workload.seed)
    dims, mode, dtype = workload.dims, workload.mode, TORCH_DTYPES[workload.dtype]
    heads = dims.num_heads
    meta = PagedMetadata.build(workload.q_lens, workload.kv_lens, workload.page_size, gen)

    kv = _latent(workload.total_kv, dims, gen)
    w_uk = torch.randn(heads, dims.kv_lora_rank, dims.qk_nope_head_dim, generator=gen) / math.sqrt(dims.kv_lora_rank)
    w_uv = torch.randn(heads, dims.kv_lora_rank, dims.v_head_dim, generator=gen) / math.sqrt(dims.kv_lora_rank)
    q_nope = torch.randn(workload.total_q, heads, dims.qk_nope_head_dim, generator=gen)
    q_pe = torch.randn(workload.total_q, heads, dims.qk_rope_head_dim, generator=gen)
    kv, w_uk, w_uv = kv.to(dtype), w_uk.to(dtype), w_uv.to(dtype)

    problem = Problem(workload=copy.copy(workload), dims=dims, device=device, scale=dims.softmax_scale, meta=meta,
                      kv=kv, w_uk=w_uk, w_uv=w_uv, q=q_nope)
    if mode.absorbed:
        q_absorbed = torch.einsum("thp,hcp->thc", q_nope, w_uk.float())
        problem.q = torch.cat([q_absorbed, q_pe], dim=-1).to(dtype)
    else:
        problem.q = torch.cat([q_nope, q_pe], dim=-1).to(dtype)
        keys = kv if mode is Mode.PREFILL else _new_tokens(kv, workload)
        problem.k_nope = torch.einsum("nc,hcp->nhp", keys[:, :NOPE_DIM].float(), w_uk.float()).to(dtype)
        problem.v = torch.einsum("nc,hcd->nhd", keys[:, :NOPE_DIM].float(), w_uv.float()).to(dtype)
        problem.k_pe = keys[:, NOPE_DIM:].contiguous()
    if mode.uses_cache:
        layout = get_layout(workload.layout)
        cache = PagedCache.empty(layout, meta.num_blocks, workload.page_size,
                                 tensor_scale=layout.fit_tensor_scale(kv))
        write_cache(cache, kv, meta.token_slots)
        problem.cache = cache
    if mode.sparse:
        problem.topk_indices = _topk_indices(workload, gen)
        problem.sparse_indices = transform_indices(problem.topk_indices, workload, meta)
    return _to_device(problem, device, cache_device)


def transform_indices(topk_indices: torch.Tensor, workload: Workload, meta: PagedMetadata) -> torch.Tensor:
    """Apply the workload's index transform (PAGED: cache slots; RAGGED: rows of the gathered K)."""
    if workload.index_transform == "paged":
        return reference.transform_indices_paged(topk_indices, list(meta.q_lens), list(meta.kv_lens),
                                                 meta.block_table.cpu(), meta.page_size)
    return reference.transform_indices_ragged(topk_indices, list(meta.q_lens), list(meta.kv_lens))


def _latent(num_tokens: int, dims: MLADims, gen: torch.Generator) -> torch.Tensor:
    """Latent tokens ~ N(0, 1) with a per-token magnitude in [0.5, 2], so per-tile scales differ."""
    values = torch.randn(num_tokens, dims.latent_dim, generator=gen)
    magnitude = torch.exp((torch.rand(num_tokens, 1, generator=gen) * 2 - 1) * math.log(2))
    return values * magnitude


def _new_tokens(kv: torch.Tensor, workload: Workload) -> torch.Tensor:
    """The last ``q_len`` tokens of each request (the ones being prefilled), request after request."""
    starts = reference.cumulative(list(workload.kv_lens))
    parts = [kv[starts[b + 1] - q:starts[b + 1]] for b, q in enumerate(workload.q_lens) if q]
    return torch.cat(parts)


def _topk_indices(workload: Workload, gen: torch.Generator) -> torch.Tensor:
    """Per query token, up to ``topk`` distinct causally visible positions, -1 padded, in random order."""
    topk = workload.topk
    rows = []
    for q_len, kv_len in zip(workload.q_lens, workload.kv_lens):
        for i in range(q_len):
            visible = max(kv_len - q_len + i + 1, 0) if kv_len else 0
            chosen = torch.randperm(visible, generator=gen)[:topk]
            row = torch.cat([chosen, torch.full((topk - chosen.numel(),), -1, dtype=torch.int64)])
            rows.append(row[torch.randperm(topk, generator=gen)])
    return torch.stack(rows).to(torch.int32)


def _available(device: torch.device, what: str, workload: Workload) -> torch.device:
    """``device``, refused with a ValueError where it is CUDA and this machine has none (torch would raise
    ``AssertionError: Torch not compiled with CUDA enabled``, or fail later)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} on {device}, but CUDA is not available ({workload.label})")
    return device


def _cache_device(workload: Workload, device: torch.device) -> torch.device:
    """Where the paged cache goes: the workload's ``cache_device`` where it names another device type, else
    ``device`` (refused up front, before any drawing, where it is CUDA on a machine without)."""
    wanted = workload.cache_device or device.type
    if wanted == device.type:
        return device
    return _available(torch.device(wanted), "the workload puts the cache", workload)


def _to_device(problem: Problem, device: torch.device, cache_device: torch.device) -> Problem:
    for name in ("kv", "w_uk", "w_uv", "q", "k_nope", "k_pe", "v", "topk_indices", "sparse_indices"):
        value = getattr(problem, name)
        if value is not None:
            setattr(problem, name, value.to(device))
    problem.meta = problem.meta.to(device)
    if problem.cache is not None:
        problem.cache = problem.cache.to(cache_device)
    return problem
