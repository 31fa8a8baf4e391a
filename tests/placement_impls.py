"""Impls for the placement tests: a clean graph-safe decode, and planted bugs for each placement rule.

Each planted bug computes the right answer (the accuracy judge passes it): only the placement suite sees it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from impls.torch_eager import TorchEager, TorchEagerHostCache
from impls.torch_eager.impl import decode
from mla_bench.layouts import NOPE_DIM, PagedCache
from mla_bench.metadata.reference import request_token_slots
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode
from suites.placement import MetadataBuilder


@dataclass
class StaticPlan:
    """Every buffer ``run`` touches, allocated once in ``plan``."""

    problem: Problem
    slots: list[torch.Tensor]
    keys: torch.Tensor      # [max_kv, 576] bf16 gathered rows
    keys_f32: torch.Tensor  # [max_kv, 576]
    q_f32: torch.Tensor     # [H, 576]
    scale: torch.Tensor     # 0-dim, the softmax scale (no Python scalar in run: it would be wrapped in a tensor)
    scores: torch.Tensor    # [H, max_kv]
    probs: torch.Tensor     # [H, max_kv] bf16, the rounding a flash kernel applies
    row_max: torch.Tensor   # [H, 1]
    row_sum: torch.Tensor   # [H, 1]
    out_f32: torch.Tensor   # [H, 512]
    out: torch.Tensor       # [B, H, 512] bf16
    lse: torch.Tensor       # [B, H]
    minus_inf: torch.Tensor  # [H], the lse of a padding request


class StaticDecode(Impl):
    """Clean and CUDA-graph safe: single-query decode whose ``run`` writes only into buffers made by ``plan``."""

    name = "static_decode"
    description = "test double: graph-safe torch decode, every buffer preallocated"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), query_len_kinds=frozenset({"single"}),
                                graph_safe=True)

    def plan(self, p: Problem) -> StaticPlan:
        meta, heads, dev = p.meta, p.q.shape[1], p.device
        longest = max(max(meta.kv_lens), 1)

        def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=dev)

        slots = [request_token_slots(meta.block_table, b, n, meta.page_size) for b, n in enumerate(meta.kv_lens)]
        return StaticPlan(p, slots, empty(longest, p.q.shape[2], dtype=torch.bfloat16), empty(longest, p.q.shape[2]),
                          empty(heads, p.q.shape[2]), torch.tensor(p.scale, device=dev), empty(heads, longest),
                          empty(heads, longest, dtype=torch.bfloat16), empty(heads, 1), empty(heads, 1),
                          empty(heads, NOPE_DIM), empty(meta.batch, heads, NOPE_DIM, dtype=torch.bfloat16),
                          empty(meta.batch, heads), torch.full((heads,), float("-inf"), device=dev))

    def poison(self, s: StaticPlan) -> None:
        s.out.fill_(float("nan"))
        s.lse.fill_(float("nan"))

    def lengths(self, s: StaticPlan) -> tuple[int, ...]:
        """The context lengths ``run`` loops over: the host copy the scheduler holds."""
        return s.problem.meta.kv_lens

    def run(self, s: StaticPlan) -> tuple[torch.Tensor, torch.Tensor]:
        p = s.problem
        rows = p.cache.rows().view(torch.bfloat16)
        for b, n in enumerate(self.lengths(s)):
            if n == 0:
                s.out[b].zero_()
                s.lse[b].copy_(s.minus_inf)
                continue
            keys, keys_f32, scores, probs = s.keys[:n], s.keys_f32[:n], s.scores[:, :n], s.probs[:, :n]
            torch.index_select(rows, 0, s.slots[b], out=keys)
            keys_f32.copy_(keys)
            s.q_f32.copy_(p.q[b])
            torch.matmul(s.q_f32, keys_f32.t(), out=scores)
            scores.mul_(s.scale)
            torch.amax(scores, dim=-1, keepdim=True, out=s.row_max)
            scores.sub_(s.row_max).exp_()
            torch.sum(scores, dim=-1, keepdim=True, out=s.row_sum)
            scores.div_(s.row_sum)
            probs.copy_(scores)
            scores.copy_(probs)
            torch.matmul(scores, keys_f32[:, :NOPE_DIM], out=s.out_f32)
            s.out[b].copy_(s.out_f32)
            s.row_sum.log_().add_(s.row_max)
            s.lse[b].copy_(s.row_sum[:, 0])
        return s.out, s.lse


class SyncsInRun(StaticDecode):
    """Planted bug (graph_safe): reads the longest context back to the host with ``.item()`` every step."""

    name = "planted_item_in_run"

    def run(self, s: StaticPlan) -> tuple[torch.Tensor, torch.Tensor]:
        if s.problem.meta.seq_lens.max().item() > s.keys.shape[0]:
            raise ValueError("context longer than the planned workspace")
        return super().run(s)


class AllocatesInRun(StaticDecode):
    """Planted bug (graph_safe): allocates its output afresh every step instead of using the planned one."""

    name = "planted_alloc_in_run"

    def run(self, s: StaticPlan) -> tuple[torch.Tensor, torch.Tensor]:
        s.out = torch.empty_like(s.out)
        return super().run(s)


class TolistInRun(StaticDecode):
    """Planted bug (graph_safe): loops over the context lengths read back from the device with ``.tolist()`` instead
    of the host copy (no profiler operator shows it on the CPU; on a GPU it is a blocking device-to-host copy)."""

    name = "planted_tolist_in_run"

    def lengths(self, s: StaticPlan) -> list[int]:
        return s.problem.meta.seq_lens.tolist()


class CopiesCacheEveryStep(TorchEager):
    """Planted bug (cache_traffic, llama.cpp PR 13648): accepts a cache in host memory, then copies all of it to
    the queries' device every step and computes there."""

    name = "planted_cache_copy"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), cache_devices=frozenset({"cpu", "cuda"}))

    def run(self, plan):  # plan: TorchEagerPlan, slots already on the queries' device
        p = plan.problem
        on_device = PagedCache(p.cache.layout, p.cache.data.to(p.device, copy=True), p.cache.tensor_scale)
        return decode(dataclasses.replace(p, cache=on_device), p.q, plan.request_slots)


class CopiesLengthsToHostInRun(StaticDecode):
    """Planted bug (graph_safe): copies the context lengths to the host with ``.cpu()`` every step (a blocking
    device-to-host copy: the host waits for it, and a CUDA graph cannot capture it), though it never reads them."""

    name = "planted_cpu_copy_in_run"

    def run(self, s: StaticPlan) -> tuple[torch.Tensor, torch.Tensor]:
        s.host_lens = s.problem.meta.seq_lens.cpu()
        return super().run(s)


class HandsCacheToAsTensor(CopiesCacheEveryStep):
    """Planted bug (cache_traffic): the cache copied to the queries' device by ``torch.as_tensor(..., device=)``
    every step, which no ``to`` call shows."""

    name = "planted_cache_as_tensor"

    def run(self, plan):
        p = plan.problem
        on_device = PagedCache(p.cache.layout, torch.as_tensor(p.cache.data, device=p.device), p.cache.tensor_scale)
        return decode(dataclasses.replace(p, cache=on_device), p.q, plan.request_slots)


class MirrorsCacheOnce(CopiesCacheEveryStep):
    """Planted bug (cache_traffic): copies the host cache to the queries' device on its first step and reuses the
    copy, so later steps move nothing: stale once the engine writes a token, and holding the memory the host cache
    was to save. The bench's cache never changes, so the answer stays right."""

    name = "planted_cache_mirror"

    def run(self, plan):
        p = plan.problem
        if getattr(self, "mirror", (None,))[0] is not p.cache.data:
            self.mirror = (p.cache.data, p.cache.data.to(p.device, copy=True))
        on_device = PagedCache(p.cache.layout, self.mirror[1], p.cache.tensor_scale)
        return decode(dataclasses.replace(p, cache=on_device), p.q, plan.request_slots)


class CastsCacheIntoDeviceBuffer(CopiesCacheEveryStep):
    """Planted bug (cache_traffic, seen on a GPU only): casts the host cache's rows into a float32 workspace on the
    queries' device with a converting ``copy_`` every step (on the CPU a conversion is compute, not a copy)."""

    name = "planted_cache_cast_copy"

    def run(self, plan):
        p = plan.problem
        rows = p.cache.rows().view(torch.bfloat16)
        keys = torch.empty(rows.shape, dtype=torch.float32, device=p.device)
        keys.copy_(rows)
        q = p.q.float()
        out = torch.zeros(p.q.shape[0], p.q.shape[1], p.out_dim, device=p.device)
        lse = torch.full(p.q.shape[:2], float("-inf"), device=p.device)
        for b, slots in enumerate(plan.request_slots):
            if len(slots):
                scores = q[b] @ keys[slots].t() * p.scale
                lse[b] = torch.logsumexp(scores, dim=-1)
                probs = torch.exp(scores - lse[b][:, None]).to(p.q.dtype).float()
                out[b] = probs @ keys[slots, :NOPE_DIM]
        return out.to(p.q.dtype), lse


def _max_qo_len_on_device(p: Problem) -> int:
    """Planted bug (metadata_sync): derives max_qo_len from the device's query_start_loc, a host read per step."""
    return int((p.meta.query_start_loc[1:] - p.meta.query_start_loc[:-1]).max())


SYNCING_BUILDER = MetadataBuilder("planted_max_qo_len_on_device", _max_qo_len_on_device)


class LastMatmulOnQueryDevice(TorchEagerHostCache):
    """Planted bug (cache_traffic and attention_device, llama.cpp PR 13648): the scores are computed on the host
    beside the cache, but the last matmul (probabilities times values) runs on the queries' device, so each step
    the values of every context token cross the bus."""

    name = "planted_matmul_on_query_device"
    capabilities = dataclasses.replace(TorchEagerHostCache.capabilities, query_len_kinds=frozenset({"single"}))

    def run(self, plan):  # plan: TorchEagerPlan, slots on the cache's device
        p = plan.problem
        host = p.cache.data.device  # everything but the last matmul stays here: its kernels are the only GPU ones
        rows, q = p.cache.rows().view(torch.bfloat16), p.q.to(host)
        out = torch.zeros(p.q.shape[0], p.q.shape[1], p.out_dim, dtype=p.q.dtype, device=host)
        lse = torch.full(p.q.shape[:2], float("-inf"), device=host)
        for b, slots in enumerate(plan.request_slots):
            if not len(slots):
                continue
            keys = rows[slots].float()
            scores = q[b].float() @ keys.t() * p.scale
            lse[b] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[b][:, None]).to(p.q.dtype).float()
            out[b] = (probs.to(p.device) @ keys[:, :NOPE_DIM].to(p.device)).to(host)
        return out.to(p.device), lse.to(p.device)


def _distinct_pages(p: Problem) -> torch.Tensor:
    """Planted bug (metadata_sync): sizes a page-gather workspace by the distinct pages in use, ``torch.unique`` over
    the device's block table (a shared-prefix batch gathers each page once): an output size only the device knows."""
    pages = torch.unique(p.meta.block_table)
    return torch.empty(pages.shape[0], p.meta.page_size, dtype=torch.int64, device=p.device)


UNIQUE_PAGES_BUILDER = MetadataBuilder("planted_distinct_pages_on_device", _distinct_pages)
