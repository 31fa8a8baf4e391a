"""The kept DCP rank processes (``impls.triton.dcp.ranks``): later jobs reuse them; a job finds them as fresh
processes would be; a job that fails, hangs or is interrupted ends them, and the next job starts new ones."""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from impls.triton.dcp import ranks
from impls.triton.dcp.ranks import RankFailure, RankPool, pool


def whoami(rank, device):
    """Each rank's process, and a collective over the group (a rank that left it would hang the job)."""
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {"pid": os.getpid(), "sum": float(total), "dtype": str(torch.get_default_dtype()),
            "interpret": os.environ.get("TRITON_INTERPRET"), "nvls": os.environ.get("NCCL_NVLS_ENABLE")}


def whatever_a_job_set(rank, device):
    return {"dtype": str(torch.get_default_dtype()), "threads": torch.get_num_threads(), "draw": float(torch.rand(1)),
            "variable": os.environ.get("MLA_BENCH_TEST_VARIABLE")}


def sets_everything(rank, device):
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(3)
    torch.manual_seed(1234)
    os.environ["MLA_BENCH_TEST_VARIABLE"] = "set by a job"
    return whatever_a_job_set(rank, device)


def leaves_a_collective_unmatched(rank, device):
    if rank == 0:
        dist.all_reduce(torch.tensor([100, -100]), async_op=True)  # rank 1 never joins it
    return {}


def destroys_the_group(rank, device):
    dist.destroy_process_group()
    return {}


def breaks_its_ranks_restore(rank, device):
    """Planted: rank 1's settings cannot be put back after the job (a sticky CUDA error, say)."""
    if rank == 1:
        torch.set_rng_state = None
    return whoami(rank, device)


def exits(rank, device):
    os._exit(3)


def fails_after_the_last_collective(rank, device):
    whoami(rank, device)
    if rank == 1:
        raise ValueError("planted: rank 1 fails once its peer is done")
    return {}


def sleeps(rank, device):
    time.sleep(600)


def fails_on_rank_1(rank, device):
    if rank == 1:
        raise ValueError("planted: rank 1 fails")
    return whoami(rank, device)


@pytest.fixture
def gloo_pair():
    ranks.close_pool()
    yield pool(2, "gloo")
    ranks.close_pool()


def test_later_jobs_run_on_the_same_ranks_in_one_group(monkeypatch):
    ranks.close_pool()
    # as on a GPU host, where the pool alone gives it to gloo ranks (on a CPU host, impls.triton's import does too)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gloo_pair = pool(2, "gloo")
    monkeypatch.undo()
    first = gloo_pair.run(whoami, (), timeout_s=120)
    second = pool(2, "gloo").run(whoami, (), timeout_s=120)
    assert [r["sum"] for r in first + second] == [3.0] * 4
    assert [r["pid"] for r in first] == [r["pid"] for r in second] == [p.pid for p in gloo_pair.procs]
    assert len({r["pid"] for r in first}) == 2 and os.getpid() not in {r["pid"] for r in first}
    assert {r["interpret"] for r in first} == {"1"} and {r["nvls"] for r in first} == {"0"}  # gloo ranks: on the CPU
    ranks.close_pool()


def test_a_job_finds_the_process_settings_a_fresh_rank_has(gloo_pair):
    fresh = gloo_pair.run(whatever_a_job_set, (), timeout_s=120)
    changed = gloo_pair.run(sets_everything, (), timeout_s=120)
    assert [r["threads"] for r in changed] == [3, 3] and {r["dtype"] for r in changed} == {"torch.float64"}
    assert gloo_pair.run(whatever_a_job_set, (), timeout_s=120) == fresh  # the random draws included
    assert [r["threads"] for r in fresh] == [1, 1] and {r["variable"] for r in fresh} == {None}


@pytest.mark.parametrize("job, message", [(leaves_a_collective_unmatched, "out of step after job 1"),
                                          (destroys_the_group, "the job destroyed the process group")])
def test_a_job_that_leaves_the_group_out_of_step_fails_itself_not_the_next(gloo_pair, job, message):
    with pytest.raises(RankFailure, match=message):
        gloo_pair.run(job, (), timeout_s=60)
    assert [r["sum"] for r in pool(2, "gloo").run(whoami, (), timeout_s=60)] == [3.0, 3.0]


def test_a_rank_that_cannot_put_its_settings_back_fails_the_job_that_broke_them_not_the_next(gloo_pair):
    with pytest.raises(RankFailure, match=r"error_1(.|\n)*set_rng_state"):
        gloo_pair.run(breaks_its_ranks_restore, (), timeout_s=60)
    assert [r["sum"] for r in pool(2, "gloo").run(whoami, (), timeout_s=60)] == [3.0, 3.0]


def test_ranks_that_end_with_neither_a_result_nor_an_error_are_reported_so(gloo_pair):
    with pytest.raises(RankFailure, match=re.escape("DCP ranks ended with neither a result nor an error (exit codes "
                                                    "[3, 3])")):
        gloo_pair.run(exits, (), timeout_s=60)


def test_a_failure_once_the_peers_are_done_is_reported_without_waiting_for_them(gloo_pair):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="planted: rank 1 fails once its peer is done"):
        gloo_pair.run(fails_after_the_last_collective, (), timeout_s=120)
    assert time.monotonic() - start < ranks.FAILED_RANK_GRACE_S  # rank 0 waits idle: nothing more can come


def test_a_rank_that_fails_to_start_names_its_cause(monkeypatch):
    ranks.close_pool()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")  # the ranks inherit it and cannot join
    broken = pool(2, "gloo")
    monkeypatch.undo()
    with pytest.raises(RankFailure, match=r"DCP rank failed \(error_\d[^\n]*\n(.|\n)*init_process_group(.|\n)*"
                                          r"no-such-interface0"):
        broken.run(whoami, (), timeout_s=120)
    ranks.close_pool()


def test_the_files_of_pools_whose_owner_was_killed_are_removed_by_the_next_pool(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = Path(tempfile.gettempdir(), f"{ranks.WORKDIR_PREFIX}{int(ended.stdout)}-test")
    mine = Path(tempfile.gettempdir(), f"{ranks.WORKDIR_PREFIX}{os.getpid()}-test")
    # names no process can have: left alone (they raised in os.kill or int, and no pool could start)
    odd = [Path(tempfile.gettempdir(), f"{ranks.WORKDIR_PREFIX}{owner}-test") for owner in ("99999999999", "²")]
    kept = [mine, *odd]
    for path in (orphan, *kept):
        path.mkdir()
        (path / "store").write_text("")
    try:
        ranks.close_pool()
        pool(2, "gloo")
        assert not orphan.exists() and all(path.exists() for path in kept)
    finally:
        ranks.close_pool()
        for path in (orphan, *kept):
            shutil.rmtree(path, ignore_errors=True)


def test_a_forked_child_that_exits_leaves_the_owners_ranks_running(gloo_pair):
    child = os.fork()
    if child == 0:  # the exit handlers a normal exit runs, each on its own as atexit does: multiprocessing's ended
        for handler in (ranks.close_pool, multiprocessing.util._exit_function):  # the daemon ranks it inherited
            with contextlib.suppress(BaseException):
                handler()
        os._exit(0)
    os.waitpid(child, 0)
    assert gloo_pair.alive and pool(2, "gloo") is gloo_pair
    assert [r["sum"] for r in gloo_pair.run(whoami, (), timeout_s=60)] == [3.0, 3.0]


def test_a_failed_job_names_its_rank_and_ends_the_ranks_and_the_next_job_starts_new_ones(gloo_pair):
    before = [p.pid for p in gloo_pair.procs]
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"DCP rank failed \(error_1, the first of [12] to report") as failure:
        gloo_pair.run(fails_on_rank_1, (), timeout_s=300)
    assert "planted: rank 1 fails" in str(failure.value) and time.monotonic() - start < 60
    assert not any(p.is_alive() for p in gloo_pair.procs) and not gloo_pair.workdir.exists()
    again = pool(2, "gloo")
    assert again is not gloo_pair and [r["sum"] for r in again.run(whoami, (), timeout_s=120)] == [3.0, 3.0]
    assert not {p.pid for p in again.procs} & set(before)


def test_a_job_past_its_time_is_stopped(gloo_pair):
    with pytest.raises(RankFailure, match=re.escape("DCP ranks did not finish (exit codes [-15, -15]; ranks [0, 1] "
                                                    "were stopped; 3 s allowed)")):
        gloo_pair.run(sleeps, (), timeout_s=3)
    assert not any(p.is_alive() for p in gloo_pair.procs)


def test_an_interrupted_wait_ends_the_ranks_so_no_later_job_finds_them_in_this_one(gloo_pair, monkeypatch):
    def interrupted(jobdir, timeout_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(gloo_pair, "_wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gloo_pair.run(sleeps, (), timeout_s=60)
    assert not any(p.is_alive() for p in gloo_pair.procs)


def test_a_job_that_cannot_cross_to_the_ranks_is_refused_and_the_ranks_stay(gloo_pair):
    with pytest.raises(Exception, match="pickle|lambda"):
        gloo_pair.run(lambda rank, device: {}, (), timeout_s=60)
    assert gloo_pair.alive and [r["sum"] for r in gloo_pair.run(whoami, (), timeout_s=120)] == [3.0, 3.0]


def test_another_shape_closes_the_kept_pool(gloo_pair):
    three = pool(3, "gloo")
    assert three is not gloo_pair and not any(p.is_alive() for p in gloo_pair.procs)
    assert [r["sum"] for r in three.run(whoami, (), timeout_s=120)] == [6.0] * 3
    assert isinstance(three, RankPool) and pool(3, "gloo") is three
