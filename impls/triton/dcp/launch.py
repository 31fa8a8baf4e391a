"""Run DCP for real: one process per rank, torch.distributed (gloo on CPU, NCCL with one GPU per rank).

``run_dcp`` starts ``W`` spawned processes. Each takes the problem (rebuilt from the workload's seed, or loaded
from the Problem it was given), cuts its shard, and runs ``dcp_step`` with the chosen shard attention; rank
``r`` returns its heads of the output and the combined lse. Optionally each step is timed on the GPU (CUDA
events, warm-up first, median) and the chunked-prefill context reorg is checked against the unsharded cache.
NVLink multicast stays off in NCCL and PyTorch (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from impls.triton.chunked import context_segments
from impls.triton.dcp.attention import shard_attention
from impls.triton.dcp.comm import HeadComm
from impls.triton.dcp.reorg import gather_context_chunk
from impls.triton.dcp.shard import build_shard, synthetic_shard
from impls.triton.dcp.step import dcp_step
from impls.triton.latent_io import gather_latent
from impls.triton.merge import rescale_partial
from mla_bench.layouts import LATENT_DIM
from mla_bench.lifetime import die_with_parent
from mla_bench.metadata.reference import check_dcp, cumulative
from mla_bench.problem import TORCH_DTYPES, Problem, build_problem
from mla_bench.timing import SLEEP_CYCLES, capture_graphs, warm_up
from mla_bench.workload import Mode, Workload

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class DcpSpec:
    """What every rank runs (picklable: it crosses into the spawned processes)."""

    world: int
    interleave: int
    backend: str
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


def _worker(rank: int, spec: DcpSpec, source: Workload | str, workdir: str, parent: int) -> None:
    die_with_parent(parent)  # a rank outlives no worker, however the worker ends
    for key, value in SAFE_ENV.items():
        os.environ[key] = value
    torch.set_num_threads(1)
    try:
        device = torch.device("cuda", rank) if spec.backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(spec.backend, init_method=f"file://{workdir}/store", rank=rank,
                                world_size=spec.world)
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
        torch.save(result, Path(workdir, f"result_{rank}.pt"))
        dist.barrier()
    except BaseException:
        Path(workdir, f"error_{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables while processes start (they inherit them), then restore ours."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def default_backend(world: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


FAILED_RANK_GRACE_S = 10.0  # after one rank fails, how long the others get to finish or fail on their own


def _wait(procs: list, workdir: Path, timeout_s: float) -> list:
    """Wait for the ranks until ``timeout_s``, or until ``FAILED_RANK_GRACE_S`` after one of them failed (an exit
    code other than 0, or an error file): its peers may wait in a collective for ever, as NCCL does not notice a dead
    rank. Stops (terminates, then kills) those still running and returns them."""
    deadline, failed_at = time.monotonic() + timeout_s, None
    while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
        if failed_at is None and (any(proc.exitcode not in (None, 0) for proc in procs)
                                  or any(workdir.glob("error_*.txt"))):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
            break
        time.sleep(0.05)
    hung = [proc for proc in procs if proc.is_alive()]
    for proc in hung:
        proc.terminate()
    for proc in hung:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return hung


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
    spec = DcpSpec(world, interleave, backend, attention, rescale, time_iters, reorg_chunk, synthetic)
    for key, value in SAFE_ENV.items():
        os.environ[key] = value  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory(prefix="mla-dcp-") as workdir:
        if isinstance(source, Problem):
            arg: Workload | str = str(Path(workdir, "problem.pt"))
            torch.save(_move(copy.copy(source), torch.device("cpu")), arg)
        else:
            arg = source
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(rank, spec, arg, workdir, os.getpid()), daemon=True)
                 for rank in range(world)]
        # gloo ranks compute on the CPU: Triton's interpreter there, even on a GPU host
        with _environment({"TRITON_INTERPRET": "1"} if backend == "gloo" else {}):
            for proc in procs:
                proc.start()
        hung = _wait(procs, Path(workdir), timeout_s)
        codes = [proc.exitcode for proc in procs]
        errors = sorted(Path(workdir).glob("error_*.txt"), key=lambda path: path.stat().st_mtime)
        if errors:  # the first to fail is the likely cause: the others mostly lost their peer
            later = "".join(f"\n--- then {e.stem}: {e.read_text().strip().splitlines()[-1]}" for e in errors[1:])
            raise RuntimeError(f"DCP rank failed ({errors[0].stem}, the first of {len(errors)} to report; exit codes "
                               f"{codes}):\n{errors[0].read_text()}{later}")
        if hung or any(code != 0 for code in codes):
            raise RuntimeError(f"DCP ranks did not finish (exit codes {codes}; {len(hung)} still running were "
                               f"stopped, {timeout_s:.0f} s allowed)")
        results = [torch.load(Path(workdir, f"result_{rank}.pt")) for rank in range(world)]
    reorg = [r["reorg_max_diff"] for r in results if "reorg_max_diff" in r]
    timings = {key: [r[key] for r in results if key in r] for key in ("step_ms", "attention_ms")}
    if synthetic:
        return DcpOutcome(torch.empty(0), torch.empty(0), **timings)
    out = torch.cat([r["out"] for r in results], dim=1).to(TORCH_DTYPES[workload.dtype])
    return DcpOutcome(out, results[0]["lse"], reorg_max_diff=max(reorg) if reorg else None, **timings)


