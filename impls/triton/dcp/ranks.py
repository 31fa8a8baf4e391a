"""The rank processes of DCP runs: ``W`` spawned processes in one torch.distributed group (gloo on CPU, NCCL with one
GPU per rank), started once and kept for the jobs that follow.

Starting them is most of a small run's time: each rank imports torch, sets up CUDA and joins the group (about 8 s
a call on 2 x H200, and the judge calls every DCP plan twice), so a run of many DCP problems keeps one ``RankPool``
(``pool``) and sends it jobs: a picklable ``fn(rank, device, *args) -> dict`` that every rank runs, its dict saved
for the caller. A job that fails in any rank, or outlives its time, ends the pool (its peers may wait in a
collective for ever, as NCCL does not notice a dead rank); the next job starts a new one. Between jobs a rank puts
back its process settings (``ProcessState``) and frees its cached GPU memory, so a job finds the ranks as fresh
processes would be. NVLink multicast stays off in NCCL and PyTorch (``SAFE_ENV``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mla_bench.lifetime import die_with_parent
from mla_bench.process_state import ProcessState

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FAILED_RANK_GRACE_S = 10.0  # after one rank fails, how long the others get to finish or fail on their own
CLOSE_S = 5.0  # how long ranks get to leave the group on their own when a pool closes, before they are stopped


class RankFailure(RuntimeError):
    """A job that did not finish on every rank; the pool has been closed."""


def _save(obj: Any, path: Path, write: Callable[[Any, Path], None]) -> None:
    """Write beside ``path`` and rename: the caller, polling, never reads half a file."""
    part = path.with_name(f".{path.name}")
    write(obj, part)
    os.replace(part, path)


def _write_text(text: str, path: Path) -> None:
    path.write_text(text)


def _rank_main(rank: int, world: int, backend: str, workdir: str, inbox, parent: int) -> None:
    """One rank: join the group, then run each job sent until ``None`` comes; a job that fails ends the rank."""
    die_with_parent(parent)  # a rank outlives no worker, however the worker ends
    os.environ.update(SAFE_ENV)
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank, world_size=world)
        while (message := inbox.get()) is not None:
            jobdir, path = message
            state = ProcessState.now()
            try:
                sys.path.extend(entry for entry in path if entry not in sys.path)  # modules the caller loaded since
                fn, args = pickle.loads(Path(jobdir, "job.pkl").read_bytes())
                _save(fn(rank, device, *args), Path(jobdir, f"result_{rank}.pt"), torch.save)
            except BaseException:
                _save(traceback.format_exc(), Path(jobdir, f"error_{rank}.txt"), _write_text)
                raise
            finally:
                state.restore()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _written(path: Path) -> float:
    return path.stat().st_mtime


class RankPool:
    """``world`` ranks over ``backend``, kept until ``close`` (or this process's exit)."""

    def __init__(self, world: int, backend: str) -> None:
        self.world, self.backend = world, backend
        self.workdir = Path(tempfile.mkdtemp(prefix="mla-dcp-"))
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.SimpleQueue() for _ in range(world)]  # no feeder thread, unlike Queue
        self.procs = [ctx.Process(target=_rank_main, args=(rank, world, backend, str(self.workdir), inbox,
                                                           os.getpid()), daemon=True)
                      for rank, inbox in enumerate(self.inboxes)]
        # gloo ranks compute on the CPU: Triton's interpreter there, even on a GPU host
        with _environment({"TRITON_INTERPRET": "1"} if backend == "gloo" else {}):
            for proc in self.procs:
                proc.start()

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable[..., dict], args: tuple, timeout_s: float) -> list[dict]:
        """Every rank's ``fn(rank, device, *args)``, in rank order; ``RankFailure`` where a rank failed or the job
        ran past ``timeout_s``. Whatever ends a job early (a failure, an interrupt) closes the pool: no later job may
        find its ranks still in this one."""
        payload = pickle.dumps((fn, args))  # what cannot cross fails here, the ranks untouched
        jobdir = Path(tempfile.mkdtemp(prefix="job-", dir=self.workdir))
        try:
            # a file, not the pipe: a message larger than the pipe holds would block on a rank that never reads it
            (jobdir / "job.pkl").write_bytes(payload)
            for inbox in self.inboxes:
                inbox.put((str(jobdir), list(sys.path)))
            if not self._wait(jobdir, timeout_s):
                errors = [(e.stem, e.read_text()) for e in sorted(jobdir.glob("error_*.txt"), key=_written)]
                self.close(wait_s=0)  # its ranks are gone, or stuck in the job
                raise RankFailure(self._failure(errors, timeout_s))
            return [torch.load(jobdir / f"result_{rank}.pt") for rank in range(self.world)]
        except BaseException:
            self.close(wait_s=0)
            raise
        finally:
            shutil.rmtree(jobdir, ignore_errors=True)

    def _wait(self, jobdir: Path, timeout_s: float) -> bool:
        """Whether every rank saved its result before ``timeout_s``. Gives up ``FAILED_RANK_GRACE_S`` after a rank
        failed (an error file, or a rank gone) or once every rank is gone."""
        deadline, failed_at = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            if all((jobdir / f"result_{rank}.pt").exists() for rank in range(self.world)):
                return True
            if not any(proc.is_alive() for proc in self.procs):
                return False
            if failed_at is None and (not self.alive or any(jobdir.glob("error_*.txt"))):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
                return False
            time.sleep(0.02)
        return False

    def _failure(self, errors: list[tuple[str, str]], timeout_s: float) -> str:
        """What went wrong: the first error a rank reported (the others mostly lost their peer), else the ranks'
        exit codes (each stopped, where still running)."""
        codes = [proc.exitcode for proc in self.procs]
        if errors:
            (first, text), later = errors[0], "".join(f"\n--- then {name}: {text.strip().splitlines()[-1]}"
                                                      for name, text in errors[1:])
            return (f"DCP rank failed ({first}, the first of {len(errors)} to report; exit codes {codes}):\n"
                    f"{text}{later}")
        return (f"DCP ranks did not finish (exit codes {codes}; those still running were stopped, {timeout_s:.0f} s "
                f"allowed)")

    def close(self, wait_s: float = CLOSE_S) -> None:
        """Ask the ranks to leave, stop those still there after ``wait_s``, remove the pool's files."""
        for inbox, proc in zip(self.inboxes, self.procs):
            if proc.is_alive():
                inbox.put(None)
        deadline = time.monotonic() + wait_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        shutil.rmtree(self.workdir, ignore_errors=True)


_POOL: RankPool | None = None


def pool(world: int, backend: str) -> RankPool:
    """The kept pool of ``world`` ranks over ``backend``; a new one where there is none, its ranks are gone, or it
    has another shape (closing that one: idle ranks hold their GPUs' memory)."""
    global _POOL
    if _POOL is not None and (_POOL.world, _POOL.backend) == (world, backend) and _POOL.alive:
        return _POOL
    close_pool()
    _POOL = RankPool(world, backend)
    return _POOL


@atexit.register
def close_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables while processes start (they inherit them), then put ours back."""
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
