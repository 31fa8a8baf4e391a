"""Run DCP for real: one process per rank, torch.distributed (gloo on CPU, NCCL with one GPU per rank).

``run_dcp`` sends a job to ``W`` rank processes (``ranks``: spawned once, kept for later runs). Each rank takes the
problem (rebuilt from the workload's seed, or loaded from the Problem it was given), cuts its shard, and runs
``dcp_step`` with the chosen shard attention; rank ``r`` returns its heads of the output and the combined lse.
Optionally each step is timed on the GPU (CUDA events, warm-up first, median) and the chunked-prefill context reorg
is checked against the unsharded cache.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from impls.triton.chunked import context_segments
from impls.triton.dcp.attention import shard_attention
from impls.triton.dcp.comm import HeadComm
from impls.triton.dcp.ranks import pool
from impls.triton.dcp.reorg import gather_context_chunk
from impls.triton.dcp.shard import build_shard, synthetic_shard
from impls.triton.dcp.step import dcp_step
from impls.triton.latent_io import gather_latent
from impls.triton.merge import rescale_partial
from mla_bench.layouts import LATENT_DIM
from mla_bench.metadata.reference import check_dcp, cumulative
from mla_bench.problem import TORCH_DTYPES, Problem, build_problem
from mla_bench.timing import SLEEP_CYCLES, capture_graphs, warm_up
from mla_bench.workload import Mode, Workload

@dataclass
class DcpSpec:
    """What every rank runs (picklable: it crosses into the spawned processes)."""

    world: int
    interleave: int
    attention: Any = "triton_decode"  # a name in SHARD_ATTENTIONS, or a picklable ShardAttention
    rescale: Any = rescale_partial
    time_iters: int = 0               # > 0: time that many CUDA-graph replays of a step on the GPU
    reorg_chunk: int | None = None    # check the context reorg with chunks of this many tokens
    synthetic: bool = False           # timing only: each rank draws its shard on the device (no global problem)


@dataclass
class DcpOutcome:
    out: torch.Tensor                 # [T, H, 512] in the problem's dtype, on the CPU
    lse: torch.Tensor                 # [T, H] float32, natural log
    step_ms: list[float] = field(default_factory=list)  # per rank: median step time
    attention_ms: list[float] = field(default_factory=list)  # per rank: median time of the shard attention alone
    reorg_max_diff: float | None = None  # largest |reorganized chunk - unsharded gather| over all chunks


def _problem_for(source: Workload | Problem | str, device: torch.device) -> Problem:
    if isinstance(source, Workload):
        return build_problem(source, device)
    problem = torch.load(source, weights_only=False)
    return _move(problem, device)


def _move(problem: Problem, device: torch.device) -> Problem:
    for name in ("kv", "w_uk", "w_uv", "q"):
        setattr(problem, name, getattr(problem, name).to(device))
    problem.meta = problem.meta.to(device)
    problem.cache = problem.cache.to(device)
    problem.device = device
    return problem


def _timed_steps(run, iters: int) -> float:
    """Median milliseconds of ``run`` captured in a CUDA graph and replayed ``iters`` times, the ranks aligned by a
    barrier before each replay: as a serving engine replays its decode step (the latency suite times every impl
    this way), without the host's launch time between the step's small kernels and collectives. Every rank
    captures and replays the same number of times, so the collectives inside stay matched. Each replay is queued
    behind a short GPU sleep, so that the start event does not fire while the host is still launching the graph
    (the GPU is idle after each sync; see ``mla_bench.timing``)."""
    warm_up([run], rounds=3)
    (replay,) = capture_graphs([run])
    times = []
    for _ in range(iters + 1):  # the first replay uploads the graph: not timed
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES[1])  # about 1 ms: the host queues the replay meanwhile
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def _check_reorg(problem: Problem, shard, comm: HeadComm, chunk: int) -> float:
    """Largest difference between each DCP-gathered context chunk and the unsharded gather of the same tokens."""
    meta = problem.meta
    starts = cumulative(list(meta.kv_lens))
    worst = 0.0
    for pieces in context_segments(list(meta.kv_lens), chunk):
        got = gather_context_chunk(shard, pieces, comm, torch.float32)
        rows = torch.cat([torch.arange(starts[b] + s, starts[b] + e) for b, s, e in pieces])
        slots = meta.token_slots[rows.to(meta.token_slots.device)]
        want = gather_latent(problem.cache, slots, torch.empty(len(rows), LATENT_DIM, device=problem.device))
        diff = (got - want).abs().nan_to_num(nan=float("inf"))
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst


def _rank_job(rank: int, device: torch.device, spec: DcpSpec, source: Workload | str) -> dict[str, Any]:
    """One rank's part of a run (``ranks.RankPool`` runs it on every rank): its shard's attention, combined over the
    ranks, then what ``spec`` asks besides."""
    if spec.synthetic:
        q, shard = synthetic_shard(source, rank, device)
        problem, scale = None, source.dims.softmax_scale
    else:
        problem = _problem_for(source, device)
        q, shard, scale = problem.q, build_shard(problem, rank, spec.world, spec.interleave), problem.scale
    attention = shard_attention(spec.attention)
    prepared = attention.prepare(shard, scale, q.shape[1])
    comm = HeadComm(q.shape[1], rank, spec.world)

    def step():
        return dcp_step(q, comm, attention, prepared, spec.rescale)

    out, lse = step()
    result: dict[str, Any] = {} if spec.synthetic else {"out": out.cpu(), "lse": lse.cpu()}
    if spec.time_iters and device.type == "cuda":
        result["step_ms"] = _timed_steps(step, spec.time_iters)
        result["attention_ms"] = _timed_steps(lambda: attention(q, prepared), spec.time_iters)
    if spec.reorg_chunk and problem is not None:
        result["reorg_max_diff"] = _check_reorg(problem, shard, comm, spec.reorg_chunk)
    return result


def default_backend(world: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def run_dcp(source: Workload | Problem, world: int | None = None, interleave: int | None = None,
            backend: str | None = None, attention: Any = "triton_decode", rescale: Any = rescale_partial,
            time_iters: int = 0, reorg_chunk: int | None = None, synthetic: bool = False,
            timeout_s: float = 600) -> DcpOutcome:
    """Decode context parallel over ``world`` processes (default: the workload's ``dcp_world`` / ``dcp_interleave``).

    ``source``: a DCP-mode Workload (each rank builds the problem from its seed) or a Problem (saved once and
    loaded by every rank). Returns the assembled output and lse, and what was asked besides. ``synthetic``
    (timing only; needs a Workload and ``time_iters``): each rank draws its own shard on its GPU and returns
    only timings.
    """
    workload = source if isinstance(source, Workload) else source.workload
    if workload.mode is not Mode.DCP:
        raise ValueError(f"run_dcp needs a workload of mode dcp, got {workload.mode.value}")
    world = world or workload.dcp_world
    interleave = interleave or workload.dcp_interleave
    check_dcp(workload.page_size, world, interleave)  # vLLM's rule, as the bench's DCP slot mappings keep it
    backend = backend or default_backend(world)
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"run_dcp: NCCL with W={world} needs {world} GPUs, {torch.cuda.device_count()} visible")
    if attention == "triton_decode" and workload.dtype != "bfloat16":  # its shard queries are a bf16 buffer
        raise ValueError(f"run_dcp: the triton_decode shard attention takes bfloat16 queries, the workload's are "
                         f"{workload.dtype} (they would be rounded silently; attention='torch' takes any)")
    reader = shard_attention(attention)
    if workload.layout not in reader.layouts:  # else every rank fails once it has built its shard
        raise ValueError(f"run_dcp: the {reader.name} shard attention reads layouts {sorted(reader.layouts)}, "
                         f"not {workload.layout!r}")
    if synthetic and not isinstance(source, Workload):
        raise ValueError("run_dcp: synthetic timing draws shards from a Workload, not a Problem")
    if world != workload.dcp_world or interleave != workload.dcp_interleave:
        workload = workload.replace(dcp_world=world, dcp_interleave=interleave)
        source = workload if isinstance(source, Workload) else source
    spec = DcpSpec(world, interleave, attention, rescale, time_iters, reorg_chunk, synthetic)
    ranks = pool(world, backend)
    if not isinstance(source, Problem):
        return _outcome(ranks.run(_rank_job, (spec, source), timeout_s), workload, synthetic)
    # in the pool's directory, so removed with a killed owner's, or by a failed run's close
    with tempfile.TemporaryDirectory(prefix="problem-", dir=ranks.workdir, ignore_cleanup_errors=True) as workdir:
        path = str(Path(workdir, "problem.pt"))  # saved once, loaded by every rank
        torch.save(_move(copy.copy(source), torch.device("cpu")), path)
        return _outcome(ranks.run(_rank_job, (spec, path), timeout_s), workload, synthetic)


def _outcome(results: list[dict[str, Any]], workload: Workload, synthetic: bool) -> DcpOutcome:
    """The ranks' results as one: heads concatenated in rank order, timings per rank."""
    reorg = [r["reorg_max_diff"] for r in results if "reorg_max_diff" in r]
    timings = {key: [r[key] for r in results if key in r] for key in ("step_ms", "attention_ms")}
    if synthetic:
        return DcpOutcome(torch.empty(0), torch.empty(0), **timings)
    out = torch.cat([r["out"] for r in results], dim=1).to(TORCH_DTYPES[workload.dtype])
    return DcpOutcome(out, results[0]["lse"], reorg_max_diff=max(reorg) if reorg else None, **timings)


