"""The rank processes of DCP runs: ``W`` spawned processes in one torch.distributed group (gloo on CPU, NCCL with one
GPU per rank), started once and kept for the jobs that follow.

Starting them is most of a small run's time: each rank imports torch, sets up CUDA and joins the group (about 8 s
a call on 2 x H200, and the judge calls every DCP plan twice), so a run of many DCP problems keeps one ``RankPool``
(``pool``) and sends it jobs: a picklable ``fn(rank, device, *args) -> dict`` that every rank runs, its dict saved
for the caller. A job that fails in any rank, or outlives its time, ends the pool (its peers may wait in a
collective for ever, as NCCL does not notice a dead rank); the next job starts a new one. A job must leave the
group in step: each rank ends it with a collective of the job's number, so a job that left a collective unmatched
or the group destroyed fails itself, not the next. Between jobs a rank puts back the settings the bench guards in
its own process (``ProcessState``), its whole environment, thread count and torch's random generators, and frees
its cached GPU memory: in all that a job finds the ranks as the first job did (``sys.path`` only grows, by the
owner's entries). NVLink multicast stays off in NCCL and PyTorch (``SAFE_ENV``, set before a rank starts).

The ranks die with the thread that started them (``die_with_parent``: Linux ties it to the thread); ``pool`` then
starts new ones. A process forked from the owner neither uses nor ends the owner's ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.process
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
WORKDIR_PREFIX = "mla-dcp-"  # then the owner's pid: the next pool removes the files of an owner killed meanwhile
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


class _RankState:
    """What a job could change in a rank that a fresh rank would not have: ``restore`` puts it back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.process = ProcessState.now()
        self.environment = dict(os.environ)
        self.threads = torch.get_num_threads()
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        self.process.restore()
        if dict(os.environ) != self.environment:
            os.environ.clear()
            os.environ.update(self.environment)
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng)
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
            torch.cuda.empty_cache()  # the job's tensors: idle ranks hold as little of their GPUs as they can


def _check_in_step(job: int, device: torch.device) -> None:
    """End a job with a collective of its number: a rank that left a collective unmatched, or the group destroyed,
    fails this job here instead of the next one."""
    if not dist.is_initialized():
        raise RuntimeError("the job destroyed the process group")
    numbers = torch.tensor([job, -job], dtype=torch.int64, device=device)
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
    if numbers.tolist() != [job, -job]:
        raise RuntimeError(f"the process group is out of step after job {job}: its check collective gave "
                           f"{numbers.tolist()}, not {[job, -job]} (a collective left unmatched)")


def _next_job(inbox) -> tuple[str, list[str]] | None:
    """The next job's directory and the owner's ``sys.path``; None to leave (asked, or the owner gone)."""
    try:
        return inbox.recv()
    except EOFError:  # the owner closed its end without a word
        return None


def _rank_main(rank: int, world: int, backend: str, workdir: str, inbox, parent: int) -> None:
    """One rank: join the group, then run each job sent until ``None`` comes; a failure (at start or in a job) is
    written where the owner looks for it and ends the rank."""
    die_with_parent(parent)  # a rank outlives no worker, however the worker ends
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    errors = Path(workdir)  # start-up failures; a job's go to its own directory
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank, world_size=world)
        job = 0
        while (message := _next_job(inbox)) is not None:
            jobdir, path = message
            errors = Path(jobdir)
            state, job = _RankState(device), job + 1
            sys.path.extend(entry for entry in path if entry not in sys.path)  # modules the caller loaded since
            fn, args = pickle.loads(Path(jobdir, "job.pkl").read_bytes())
            result = fn(rank, device, *args)
            _check_in_step(job, device)
            state.restore()  # before the result: a rank that cannot is this job's failure, not the next one's
            _save(result, Path(jobdir, f"result_{rank}.pt"), torch.save)
    except BaseException:
        _save(traceback.format_exc(), errors / f"error_{rank}.txt", _write_text)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _written(path: Path) -> float:
    return path.stat().st_mtime


class RankPool:
    """``world`` ranks over ``backend``, kept until ``close`` (or this process's exit)."""

    def __init__(self, world: int, backend: str) -> None:
        self.world, self.backend = world, backend
        _remove_orphans()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
        self.stopped: list[int] = []  # ranks close() had to stop
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(world)]  # no lock or feeder thread, unlike the queues
        self.inboxes = [send for _, send in pipes]
        self.procs = [ctx.Process(target=_rank_main, args=(rank, world, backend, str(self.workdir), receive,
                                                           os.getpid()), daemon=True)
                      for rank, (receive, _) in enumerate(pipes)]
        # gloo ranks compute on the CPU: Triton's interpreter there, even on a GPU host
        with _environment({**SAFE_ENV, **({"TRITON_INTERPRET": "1"} if backend == "gloo" else {})}):
            for proc in self.procs:
                proc.start()
        for receive, _ in pipes:
            receive.close()  # the ranks hold their ends

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable[..., dict], args: tuple, timeout_s: float) -> list[dict]:
        """Every rank's ``fn(rank, device, *args)``, in rank order (tensors, numbers, strings and lists or dicts of
        them: ``torch.load`` reads them weights-only); ``RankFailure`` where a rank failed or the job ran past
        ``timeout_s``. Whatever ends a job early (a failure, an interrupt) closes the pool: no later job may
        find its ranks still in this one."""
        payload = pickle.dumps((fn, args))  # what cannot cross fails here, the ranks untouched
        jobdir = Path(tempfile.mkdtemp(prefix="job-", dir=self.workdir))
        try:
            # a file, not the pipe: a message larger than the pipe holds would block on a rank that never reads it
            (jobdir / "job.pkl").write_bytes(payload)
            for inbox in self.inboxes:
                inbox.send((str(jobdir), list(sys.path)))
            if self._wait(jobdir, timeout_s):
                return [torch.load(jobdir / f"result_{rank}.pt") for rank in range(self.world)]
            errors = [(e.stem, e.read_text()) for e in self._errors(jobdir)]
        except BaseException:
            self.close(wait_s=0)
            raise
        finally:
            shutil.rmtree(jobdir, ignore_errors=True)
        self.close(wait_s=0)  # its ranks are gone, or stuck in the job; their exit codes then name which
        raise RankFailure(self._failure(errors, timeout_s))

    def _errors(self, jobdir: Path) -> list[Path]:
        """The ranks' error files, at start-up or in this job, first written first."""
        return sorted([*self.workdir.glob("error_*.txt"), *jobdir.glob("error_*.txt")], key=_written)

    def _wait(self, jobdir: Path, timeout_s: float) -> bool:
        """Whether every rank saved its result before ``timeout_s``. Gives up once every rank has a result, an error
        or is gone, or ``FAILED_RANK_GRACE_S`` after the first failure (the others may wait for it for ever)."""
        deadline, failed_at = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            results = [(jobdir / f"result_{rank}.pt").exists() for rank in range(self.world)]
            if all(results):
                return True
            failed = {int(e.stem.rpartition("_")[2]) for e in self._errors(jobdir)} | \
                {rank for rank, proc in enumerate(self.procs) if not proc.is_alive()}
            if failed and all(done or rank in failed for rank, done in enumerate(results)):
                return False
            if failed_at is None and failed:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
                return False
            time.sleep(0.02)
        return False

    def _failure(self, errors: list[tuple[str, str]], timeout_s: float) -> str:
        """What went wrong: the first error a rank reported (the others mostly lost their peer), else the ranks'
        exit codes and which had to be stopped."""
        codes = [proc.exitcode for proc in self.procs]
        stopped = f"; ranks {self.stopped} were stopped" if self.stopped else ""
        if errors:
            (first, text), later = errors[0], "".join(f"\n--- then {name}: {text.strip().splitlines()[-1]}"
                                                      for name, text in errors[1:])
            return (f"DCP rank failed ({first}, the first of {len(errors)} to report; exit codes {codes}{stopped}):\n"
                    f"{text}{later}")
        if self.stopped:
            return f"DCP ranks did not finish (exit codes {codes}{stopped}; {timeout_s:.0f} s allowed)"
        return f"DCP ranks ended with neither a result nor an error (exit codes {codes})"

    def close(self, wait_s: float = CLOSE_S) -> None:
        """Ask the ranks to leave, stop those still there after ``wait_s``, remove the pool's files."""
        for inbox, proc in zip(self.inboxes, self.procs):
            if proc.is_alive():
                with contextlib.suppress(OSError):  # a rank gone meanwhile
                    inbox.send(None)
            inbox.close()
        deadline = time.monotonic() + wait_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for rank, proc in enumerate(self.procs):
            if proc.is_alive():
                self.stopped.append(rank)
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _remove_orphans() -> None:
    """Remove the files of pools whose owner is gone (killed, so its exit could not): ``mla-dcp-<owner pid>-*``."""
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        owner = path.name[len(WORKDIR_PREFIX):].partition("-")[0]
        if owner.isascii() and owner.isdigit() and not _running(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether ``pid`` may be a live process (another user's, or a number no process can have, counts as one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


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


def _forget_pool_in_child() -> None:
    """In a child forked from the owner: the owner's ranks are not this process's to use, wait for or end (at its exit
    multiprocessing would terminate the daemon processes it thinks are its own)."""
    global _POOL
    if _POOL is not None:
        multiprocessing.process._children.difference_update(_POOL.procs)
        _POOL = None


os.register_at_fork(after_in_child=_forget_pool_in_child)


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
