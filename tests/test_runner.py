"""The runner: in-process, isolated and sharded runs; crashes, planted bugs and absent suites are results."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import torch

import planted_impls as planted
from mla_bench.process_state import ProcessState
from mla_bench.registry import ImplNotInstalled, discover
from mla_bench.results import Device, Result, Run, load_run, save_run
from mla_bench import environment, runner
from mla_bench.runner import Progress, RunOptions, _one_gpu_a_worker_notes, execute, select_run, untested_impls
from suites.accuracy import AccuracySuite
from suites.registry import SUITES, load_suite

CORRECT = ["planted_impls:PlainDecode", "planted_impls:PlainSparse"]
BUGS = [f"planted_impls:{cls.__name__}" for cls in planted.PLANTED_BUGS]


def _statuses(run) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for r in run.results:
        out.setdefault(r.impl, Counter())[r.status] += 1
    return out


class Recorder(Progress):
    def __init__(self):
        self.total, self.labels = None, []

    def start(self, total):
        self.total = total

    def advance(self, label):
        self.labels.append(label)


def test_every_planted_bug_fails_and_the_correct_twins_pass():
    progress = Recorder()
    run = execute(RunOptions(impls=CORRECT + BUGS + ["torch_eager"], device="cpu", preset="tiny"), progress)
    statuses = _statuses(run)
    for name in ("plain_decode", "plain_sparse", "torch_eager"):
        assert statuses[name]["passed"] >= 2 and not statuses[name]["failed"] and not statuses[name]["error"], name
    for cls in planted.PLANTED_BUGS:
        assert statuses[cls.name]["failed"] >= 1, f"{cls.name} was not flagged: {statuses[cls.name]}"
    assert not run.ok
    assert progress.total == len(progress.labels) > 10  # one step per workload of the sweep


def test_a_raising_impl_is_an_error_with_its_traceback_and_the_others_still_run():
    run = execute(RunOptions(impls=["planted_impls:RaisesInRun", "torch_eager"], device="cpu", preset="tiny"))
    statuses = _statuses(run)
    errors = [r for r in run.results if r.impl == "planted_raises" and r.status == "error"]
    assert errors and "Traceback" in errors[0].message and "planted failure inside run" in errors[0].message
    assert statuses["torch_eager"]["passed"] >= 5 and not statuses["torch_eager"]["error"]


def test_an_impl_writing_into_its_inputs_fails_naming_them_and_the_next_impl_gets_the_inputs_back():
    """The impls of a run share each workload's problem: one that overwrites the queries must not pass, nor make the
    correct impl judged after it fail."""
    run = execute(RunOptions(impls=["planted_impls:WritesOutputIntoQuery", "planted_impls:PlainDecode"], device="cpu",
                             preset="tiny", modes=["decode"], seed=random.randint(1, 10 ** 6)))
    statuses = _statuses(run)
    assert statuses["plain_decode"]["passed"] >= 5 and set(statuses["plain_decode"]) <= {"passed", "unsupported"}
    planted_results = [r for r in run.results if r.impl == planted.WritesOutputIntoQuery.name]
    assert all(r.status in ("failed", "unsupported") for r in planted_results)
    assert statuses[planted.WritesOutputIntoQuery.name]["failed"] == statuses["plain_decode"]["passed"]
    assert all("wrote into its inputs: q (" in r.message for r in planted_results if r.status == "failed")


def test_isolate_turns_a_hard_crash_into_an_error_result():
    run = execute(RunOptions(impls=["planted_impls:AbortsInRun", "torch_eager"], device="cpu", preset="tiny",
                             modes=["decode"], isolate=True))
    crashed = [r for r in run.results if r.impl == "planted_aborts"]
    assert [r.status for r in crashed] == ["error"]
    assert "SIGABRT" in crashed[0].message and "decode tiny" in crashed[0].message  # which workload it died on
    statuses = _statuses(run)
    assert statuses["torch_eager"]["passed"] >= 5 and not statuses["torch_eager"]["error"]


def test_a_worker_printing_bytes_that_are_no_utf8_keeps_its_results_and_the_next_jobs(monkeypatch):
    """The runner read a worker's stderr as strict UTF-8: one latin-1 byte ended the thread, every later job of the
    shard was lost with the worker's results, and the run passed with nothing in it."""
    run = execute(RunOptions(impls=["planted_impls:PrintsLatin1", "torch_eager"], device="cpu", preset="tiny",
                             modes=["decode"], isolate=True))
    statuses = _statuses(run)
    assert statuses["prints_latin1"]["passed"] >= 5 and statuses["torch_eager"]["passed"] >= 5, statuses


def test_a_worker_that_finishes_but_does_not_exit_keeps_its_results_and_is_killed(monkeypatch):
    """The runner waited for such a worker for ever (or blamed a finished workload on --stall-timeout)."""
    monkeypatch.setattr(runner, "EXIT_GRACE_S", 2.0)
    start = time.monotonic()
    run = execute(RunOptions(impls=["planted_impls:LingersAtExit"], device="cpu", preset="tiny", modes=["decode"],
                             isolate=True))
    assert time.monotonic() - start < 60
    statuses = _statuses(run)
    assert statuses["lingers_at_exit"]["passed"] >= 5 and statuses["lingers_at_exit"]["error"] == 1, statuses
    (late,) = [r for r in run.results if r.status == "error"]
    assert late.label == "(at exit)" and "then did not exit within 2 s and was killed" in late.message


def test_isolated_workers_make_the_checks_of_no_impl_once():
    """Each --isolate worker ran the metadata builders and the round trip's codec and cache-op checks: every one of
    those results came once per impl, duplicates the gate refuses."""
    options = dict(impls=["torch_eager", "planted_impls:PlainDecode"], device="cpu", preset="tiny",
                   suites=["metadata", "roundtrip"], layouts=["bf16"], page_sizes=[16])
    alone, isolated = execute(RunOptions(**options)), execute(RunOptions(**options, isolate=True))

    def keys(run):  # the capability matrix's summary: one a worker, each filed under its impl
        return sorted((r.suite, r.check, r.impl or "", r.label) for r in run.results if r.check != "capability matrix")
    assert keys(isolated) == keys(alone) and len(set(keys(isolated))) == len(keys(isolated))
    assert sorted(r.impl for r in isolated.results if r.check == "capability matrix") == ["plain_decode",
                                                                                           "torch_eager"]


def test_a_gpu_index_past_the_visible_ones_is_refused_before_the_run(monkeypatch):
    """--device cuda:5 on a host of two GPUs made every result fail, then the run file was never written."""
    from mla_bench.device import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="device 'cuda:5' asked for, but 2 GPU\\(s\\) are visible"):
        pick_device("cuda:5")


@pytest.mark.parametrize("planted_name", ["ExitsInRun", "RaisesGeneratorExitInRun", "RaisesOwnBaseExceptionInRun",
                                          "RaisesOwnBaseExceptionWhenMade", "RaisesGeneratorExitInRefusal"])
def test_an_impl_raising_a_base_exception_in_process_is_an_error_result_of_every_suite(planted_name):
    """In-process, sys.exit(0) in run ended the whole run with status 0 and no run file (in the placement suite after
    the others were fixed); GeneratorExit, or an impl's own BaseException subclass, ended it with a traceback."""
    impl = getattr(planted, planted_name)
    run = execute(RunOptions(impls=[f"planted_impls:{planted_name}", "torch_eager"], device="cpu", preset="tiny",
                             modes=["decode"], layouts=["bf16"], suites=["accuracy", "placement", "roundtrip"]))
    for suite in ("accuracy", "placement", "roundtrip"):
        ours = Counter(r.status for r in run.results if r.suite == suite and r.impl == impl.name)
        theirs = Counter(r.status for r in run.results if r.suite == suite and r.impl == "torch_eager")
        assert ours["error"] >= 1 and not ours["passed"] and theirs["passed"] >= 1 and not theirs["error"], \
            (suite, ours, theirs)
    assert not run.ok


class _RaisesAfterOne:
    """A suite whose run yields one result, then lets an impl's GeneratorExit through."""

    def run(self, ctx):
        yield Result("fake", "fake", "passed", label="one")
        raise GeneratorExit("an impl's")


def test_a_suite_that_lets_a_generator_exit_through_ends_in_an_error_result_and_closing_it_still_works():
    """run_suite re-raised every GeneratorExit, as it could not tell one raised inside from one close() throws in."""
    results = list(runner.run_suite("fake", _RaisesAfterOne(), None))
    assert [r.status for r in results] == ["passed", "error"] and "GeneratorExit: an impl's" in results[1].message
    opened = runner.run_suite("fake", _RaisesAfterOne(), None)
    assert next(opened).label == "one"
    opened.close()  # a GeneratorExit thrown in at the yield ends it, with no "generator ignored GeneratorExit"


@pytest.mark.parametrize("planted_class, says", [
    ("SetsTheDefaultDtype", "torch's default dtype (now torch.float64, was torch.float32)"),
    ("AllowsTF32", "torch.backends.cuda.matmul.fp32_precision (now 'tf32', was "),
])
def test_an_impl_that_changes_the_processs_settings_fails_and_the_next_impls_see_them_as_they_were(planted_class,
                                                                                                   says):
    """An impl that set the default dtype to float64 made torch_eager's next problems error, unnamed; one that allowed
    TF32 would have torch_eager's float32 problems on a GPU fail their tolerance."""
    before = ProcessState.now()
    run = execute(RunOptions(impls=[f"planted_impls:{planted_class}", "torch_eager"], device="cpu", preset="tiny",
                             modes=["decode"], layouts=["bf16"], suites=["accuracy", "placement"]))
    statuses = _statuses(run)
    name = getattr(planted, planted_class).name
    assert set(statuses[name]) == {"failed"} and set(statuses["torch_eager"]) == {"passed"}, statuses
    assert all(f"changed the process's settings: {says}" in r.message for r in run.results if r.impl == name)
    assert ProcessState.now() == before


def test_a_worker_that_stalls_past_the_stall_timeout_is_killed_with_its_children_and_the_others_run_on(
        tmp_path, monkeypatch):
    """A worker starts up (imports torch, sends its first message) in about 1 s on this CPU and 4-5 s on the GPU
    machine (torch's CUDA build), and the stall clock counts it: 15 s leaves room on both (5 s left under a second
    there). The hung impl's child process (a DCP rank, say) is killed with it."""
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("PLANTED_HANG_CHILD_PIDFILE", str(pidfile))
    threads = threading.active_count()
    start = time.monotonic()
    run = execute(RunOptions(impls=["planted_impls:HangsInRun", "planted_impls:PlainDecode"], device="cpu",
                             preset="tiny", modes=["decode"], isolate=True, stall_timeout=15))
    assert time.monotonic() - start < 60
    child = int(pidfile.read_text())
    try:
        assert _ends_within(child, seconds=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)  # a regression must not leave it behind on CI
    hung = [r for r in run.results if r.impl == "planted_hangs"]
    assert [r.status for r in hung] == ["error"] and hung[0].label.startswith("decode tiny")
    assert f"made no progress for 15 s (--stall-timeout) and was killed during '{hung[0].label}'" in hung[0].message
    statuses = _statuses(run)
    assert statuses["plain_decode"]["passed"] >= 5 and set(statuses["plain_decode"]) <= {"passed", "unsupported"}
    assert threading.active_count() == threads  # the watchdogs are gone


def _ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone, or a zombie no one reaped, within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_sharding_over_workers_gives_the_same_results_as_one_process():
    options = dict(impls=["torch_eager"], device="cpu", preset="tiny", modes=["prefill", "dcp"])
    single = execute(RunOptions(**options))
    sharded = execute(RunOptions(**options, devices=[0, 1]))
    key = lambda r: (r.impl, r.label, r.status)  # noqa: E731
    assert sorted(map(key, sharded.results)) == sorted(map(key, single.results))
    assert len(single.results) == len({r.label for r in single.results}) == 4
    for run in (single, sharded):  # CPU workers share the one CPU
        assert run.devices == [Device("cpu")] and {r.device for r in run.results} == {"cpu"}
        assert run.environment["gpu"] is None


# A worker on a host of an H100 (GPU 0) and an H200 (GPU 1): it describes the GPU it was given, sends that GPU's
# ceilings and a latency result measured on it, as the latency suite does; FAKE_WORKER_DIES names a GPU whose
# worker dies before saying anything.
FAKE_GPU_WORKER = """
import json, os, sys
job, gpu = json.loads(sys.stdin.read()), os.environ["CUDA_VISIBLE_DEVICES"]
if gpu == os.environ.get("FAKE_WORKER_DIES"):
    sys.exit(3)
name, copy = {"0": ("NVIDIA H100 80GB HBM3", 3000.0), "1": ("NVIDIA H200", 4400.0)}[gpu]
for message in [{"device": {"id": job.get("device_id"), "name": name, "compute_capability": "9.0"}},
                {"result": {"suite": "latency", "check": "ceilings", "status": "passed", "label": name,
                            "metrics": {"copy_gbps": copy, "matmul_tflops": 700.0}}},
                {"result": {"suite": "latency", "check": "latency", "status": "passed", "impl": "torch_eager",
                            "label": f"shard {job['shard']}", "metrics": {"run_ms": 0.01},
                            "details": {"device": name}}},
                {"done": True}]:
    print(json.dumps(message), flush=True)
"""
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _two_gpu_host(monkeypatch) -> None:
    """This process sees CUDA with GPU 0 an H100 and GPU 1 an H200; the workers it starts are ``FAKE_GPU_WORKER``."""
    names = {0: H100, 1: H200}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: names[index])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    popen = subprocess.Popen

    def start(argv, **kwargs):
        worker = argv[1:] == ["-m", "mla_bench.runner"]
        return popen([sys.executable, "-c", FAKE_GPU_WORKER] if worker else argv, **kwargs)
    monkeypatch.setattr(subprocess, "Popen", start)


def test_a_run_over_gpus_of_two_models_records_each_device_and_the_device_of_each_result(monkeypatch, tmp_path):
    """``--devices 0,1`` recorded GPU 0's name as the run's GPU, though GPU 1 (another model) ran half of it, and no
    result said which GPU ran it."""
    _two_gpu_host(monkeypatch)
    run = execute(RunOptions(impls=["torch_eager"], suites=["latency"], device="cuda", preset="tiny", devices=[0, 1]))
    assert run.environment["gpu"] == f"{H100} + {H200}" and run.environment["compute_capability"] == "9.0"
    assert run.devices == [Device("cuda:0", H100, "9.0"), Device("cuda:1", H200, "9.0")]
    assert {r.label: r.device for r in run.results} == {"shard 0": "cuda:0", "shard 1": "cuda:1"}
    assert run.ceilings == {H100: {"copy_gbps": 3000.0, "matmul_tflops": 700.0},
                            H200: {"copy_gbps": 4400.0, "matmul_tflops": 700.0}}
    assert load_run(save_run(run, tmp_path / "run.json")) == run


def test_a_gpu_whose_worker_died_before_describing_it_is_listed_by_its_index(monkeypatch):
    _two_gpu_host(monkeypatch)
    monkeypatch.setenv("FAKE_WORKER_DIES", "1")
    run = execute(RunOptions(impls=["torch_eager"], suites=["latency"], device="cuda", preset="tiny", devices=[0, 1]))
    assert run.devices == [Device("cuda:0", H100, "9.0"), Device("cuda:1")]
    assert run.environment["gpu"] == H100
    assert [(r.status, r.device) for r in run.results] == [("passed", "cuda:0"), ("error", "cuda:1")]
    assert "exited with code 3" in run.results[1].message


def test_a_device_is_described_by_the_process_that_uses_it(monkeypatch):
    """A worker's ``cuda`` is the GPU it was given: it names its model; the run's id says which of the host's it is."""
    _two_gpu_host(monkeypatch)
    assert environment.describe(torch.device("cuda", 1), "cuda:1") == Device("cuda:1", H200, "9.0")
    assert environment.describe(torch.device("cpu"), "cpu") == Device("cpu")
    env = environment.collect(torch.device("cuda"), [Device("cuda:1", H200, "9.0"), Device("cuda:0", H100, "9.0"),
                                                      Device("cuda:2", H200, "9.0")])
    assert (env["device"], env["gpu"], env["compute_capability"]) == ("cuda", f"{H100} + {H200}", "9.0")


def test_latency_on_cpu_is_unsupported_with_the_reason():
    run = execute(RunOptions(impls=["torch_eager"], suites=["latency"], device="cpu", preset="tiny"))
    assert [(r.status, r.impl) for r in run.results] == [("unsupported", "torch_eager")]
    assert "CUDA" in run.results[0].message and run.ok


def test_a_suite_that_does_not_exist_yet_is_reported_not_a_crash(monkeypatch):
    monkeypatch.setattr("suites.registry.SUITES", {"accuracy": SUITES["accuracy"], "latency": SUITES["latency"],
                                                   "roundtrip": "suites.not_written_yet:Suite"})
    notes = []
    named = execute(RunOptions(impls=["torch_eager"], suites=["roundtrip"], device="cpu", preset="tiny"))
    assert [(r.suite, r.status) for r in named.results] == [("roundtrip", "error")]
    assert "not available" in named.results[0].message
    everything = execute(RunOptions(impls=["torch_eager"], suites=["all"], device="cpu", preset="tiny",
                                    modes=["prefill"]), notes=notes)
    assert any("roundtrip" in note and "not available" in note for note in notes)
    assert {r.suite for r in everything.results} >= {"accuracy", "latency"}


def test_unknown_impl_or_suite_is_a_value_error():
    with pytest.raises(ValueError, match="unknown impl"):
        execute(RunOptions(impls=["nope"], device="cpu"))
    with pytest.raises(ValueError, match="unknown suite"):
        execute(RunOptions(impls=["torch_eager"], suites=["nope"], device="cpu"))


def test_a_bad_filter_is_refused_before_anything_runs():
    progress = Recorder()
    with pytest.raises(ValueError, match="unknown preset 'tinyy'"):
        execute(RunOptions(impls=["torch_eager"], device="cpu", preset="tinyy"), progress)
    assert progress.total is None and not progress.labels


@pytest.mark.parametrize("options, message", [
    (dict(impls=[]), "no impl given"),
    (dict(suites=[]), "no suite given"),
    (dict(impls=["torch_eager", "torch_eager"]), "impl name 'torch_eager' is given more than once"),
    (dict(impls=["torch_eager", "planted_impls:SlowerTorchEager"]), "impl name 'torch_eager' is given more than once"),
    (dict(modes=["prefill"], dcp_world=2), "nothing to run: --mode prefill with --dcp 2 selects no workload of the "
                                           "tiny sweep (suites accuracy)"),
    (dict(suites=["accuracy", "latency"], modes=["prefill"], dcp_world=2), "tiny sweep (suites accuracy)"),
    (dict(suites=["placement"], modes=["dcp"]), "nothing to run: --mode dcp selects no workload of suites placement"),
    (dict(suites=["placement"], modes=["sparse_prefill", "chunked_prefill"], dcp_world=2),
     "nothing to run: --mode sparse_prefill,chunked_prefill selects no workload of suites placement"),
    (dict(suites=["accuracy", "placement"], modes=["chunked_prefill"], dcp_world=2),
     "--mode chunked_prefill with --dcp 2 selects no workload of the tiny sweep (suites accuracy) nor of suites "
     "placement"),
    (dict(suites=["equivalence"], impls=["planted_impls:PlainDecode"], modes=["decode"]),
     "nothing to run: --impl planted_impls:PlainDecode selects no workload of suites equivalence"),
    (dict(stall_timeout=5), "--stall-timeout needs --isolate or --devices: a hang in this process cannot be"),
    (dict(stall_timeout=0, isolate=True), "--stall-timeout must be a number of seconds > 0, got 0"),
    (dict(stall_timeout=float("nan"), devices=[0]), "--stall-timeout must be a number of seconds > 0, got nan"),
])
def test_selections_that_cannot_run_are_value_errors(options, message):
    with pytest.raises(ValueError) as info:
        select_run(RunOptions(**{"impls": ["torch_eager"], "device": "cpu", "preset": "tiny", **options}))
    assert message in str(info.value)


@pytest.mark.parametrize("options, message", [
    (dict(device="tpu"), "--device: unknown device 'tpu'"),
    (dict(impls=["nope"]), "--impl: unknown impl 'nope'; known: "),
    (dict(suites=["accuracy", "nope"]), "--suite: unknown suite 'nope'; suites: "),
    (dict(preset="tinyy"), "--preset: unknown preset 'tinyy'; known presets: "),
    (dict(seed=2 ** 32), "--seed: seed must be an int >= 0 and < 2**32"),
    (dict(sweep="x"), "--sweep: unknown sweep 'x'; sweeps: "),
    (dict(sweep="gpu"), "--sweep: sweep gpu takes the presets deepseek-v3"),  # with the preset tiny
    (dict(modes=["decode", "decod"]), "--mode: unknown mode 'decod'; modes: "),
    (dict(layouts=["bf16", "nope"]), "--layout: unknown cache layout 'nope'; known layouts: "),
    (dict(page_sizes=[16, 0]), "--page-size: page_size must be a positive int, got 0"),
    (dict(dcp_interleave=2), "--dcp-interleave applies to decode context parallel runs only"),  # named it already
])
def test_a_bad_option_value_names_its_flag(options, message):
    """The registries that refuse a value name it, not the flag it came from ("unknown preset 'x'")."""
    with pytest.raises(ValueError) as info:
        select_run(RunOptions(**{"impls": ["torch_eager"], "device": "cpu", "preset": "tiny", **options}))
    assert str(info.value).startswith(message)


def test_an_impl_whose_module_is_absent_names_its_flag_and_stays_not_installed():
    with pytest.raises(ImplNotInstalled, match="^--impl: nosuchmod:MyMLA: cannot import nosuchmod"):
        select_run(RunOptions(impls=["all", "nosuchmod:MyMLA"], device="cpu", preset="tiny"))


def test_a_suite_with_no_workloads_on_this_device_or_one_that_ignores_modes_keeps_a_run_going():
    """Latency lists no workload on a CPU even unfiltered (it reports that in a result); metadata ignores --mode,
    placement --dcp."""
    for suites in (["latency"], ["accuracy", "metadata"], ["placement"]):
        selection = select_run(RunOptions(impls=["torch_eager"], suites=suites, device="cpu", preset="tiny",
                                          modes=["prefill"], dcp_world=2))
        assert [name for name, _ in selection.suites] == suites


@pytest.mark.parametrize("suite, options", [("placement", dict(modes=["prefill"])),
                                            ("equivalence", dict(impls=["triton_sparse"]))])
def test_placement_and_equivalence_list_the_steps_they_run(suite, options):
    progress = Recorder()
    run = execute(RunOptions(**{"impls": ["torch_eager"], "suites": [suite], "device": "cpu", "preset": "tiny",
                                **options}), progress)
    assert progress.total == len(progress.labels) > 0 and run.results


def test_the_notes_read_the_filters_each_suite_declares_it_does_not_apply(monkeypatch):
    monkeypatch.setattr(AccuracySuite, "unapplied_filters", ("page_sizes",), raising=False)
    notes = select_run(RunOptions(impls=["torch_eager"], device="cpu", preset="tiny", modes=["decode"],
                                  page_sizes=[random.randint(1, 64)])).notes
    assert notes == ["note: --page-size is not applied by suite(s) accuracy"]


def test_untested_impls_are_the_named_ones_whose_every_result_is_unsupported():
    rng = random.Random()
    reasons = {f"plain_decode: unsupported mode m{rng.randint(1, 10 ** 6)}-{i}": rng.randint(1, 5) for i in range(4)}
    results = [Result("accuracy", "accuracy", "unsupported", impl="plain_decode", label=f"w{k}",
                      message=f"{reason}\nthe rest of the message") for reason, n in reasons.items() for k in range(n)]
    results += [Result("accuracy", "accuracy", status, impl="torch_eager", label=status, message="m")
                for status in ("unsupported", "passed")]
    results.append(Result("metadata", "max_qo_len", "passed", label="ps16"))  # no impl: our own builders
    run = Run(environment={}, results=rng.sample(results, len(results)))
    named = select_run(RunOptions(impls=["torch_eager", "planted_impls:PlainDecode", "planted_impls:PlainSparse"],
                                  device="cpu", preset="tiny"))
    untested = untested_impls(named, run)
    assert untested == {"plain_decode": Counter(reasons)}  # plain_sparse has no result at all: not counted
    assert untested_impls(select_run(RunOptions(impls=["all"], device="cpu", preset="tiny")), run) == {}


def test_impls_given_beside_all_are_added_and_an_untested_one_is_reported():
    """``--impl all,mypkg:MyMLA`` tests the user's impl with every discoverable one (it was silently dropped)."""
    selection = select_run(RunOptions(impls=["all", "planted_impls:PlainDecode", "torch_eager"], device="cpu",
                                      preset="tiny"))
    names = [entry.name for entry in selection.entries]
    assert sorted(names) == sorted([*discover(), "plain_decode"])
    results = [Result("accuracy", "accuracy", "unsupported", impl=name, label=f"w{random.random()}", message="m")
               for name in names]
    assert set(untested_impls(selection, Run(environment={}, results=results))) == {"plain_decode", "torch_eager"}
    with pytest.raises(ImplNotInstalled, match="cannot import nosuchmod"):
        select_run(RunOptions(impls=["all", "nosuchmod:MyMLA"], device="cpu", preset="tiny"))


def test_devices_on_cuda_refuse_dcp_and_note_the_equivalence_suites_dcp_checks(monkeypatch):
    """Each --devices worker sees one GPU: --dcp 4 tested nothing and exited 0, the DCP checks were unsupported."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cuda, equivalence = torch.device("cuda"), [("equivalence", load_suite("equivalence"))]
    with pytest.raises(ValueError, match=r"--devices 4,7 asked for, but 4 GPU\(s\) are visible"):  # was a worker
        _one_gpu_a_worker_notes(RunOptions(impls=["all"], devices=[0, 4, 7]), cuda, [])  # error per job
    with pytest.raises(ValueError, match="--dcp 4 runs 4 ranks on as many GPUs of one worker"):
        _one_gpu_a_worker_notes(RunOptions(impls=["all"], devices=[0, 1, 2, 3], dcp_world=4), cuda, [])
    assert _one_gpu_a_worker_notes(RunOptions(impls=["all"], devices=[0, 1]), cuda, equivalence) == [
        "note: --devices gives each worker one GPU: the equivalence suite's DCP checks are unsupported"]
    assert _one_gpu_a_worker_notes(RunOptions(impls=["all"], devices=[0, 1], dcp_world=2), torch.device("cpu"),
                                   equivalence) == []  # CPU workers run DCP over gloo


def test_a_devices_index_is_mapped_through_the_runners_own_visible_gpus(monkeypatch):
    """Started with CUDA_VISIBLE_DEVICES=4,6, --devices 1 is the host's GPU 6 (a worker was given GPU 1)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert [runner._host_gpu(slot) for slot in (0, 1)] == ["4", "6"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-7a1e,GPU-09fd")  # UUIDs too
    assert runner._host_gpu(1) == "GPU-09fd"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert runner._host_gpu(3) == "3"


def test_filters_a_suite_does_not_apply_get_one_note_each():
    notes = select_run(RunOptions(impls=["torch_eager"], suites=["accuracy", "equivalence", "metadata"],
                                  device="cpu", preset="tiny", modes=["prefill"], layouts=["fp8_ds_mla"])).notes
    assert notes == ["note: --impl is not applied by suite(s) metadata",  # equivalence: it picks the checks
                     "note: --mode is not applied by suite(s) equivalence, metadata",
                     "note: --layout is not applied by suite(s) equivalence, metadata",
                     "note: --layout is not applied to the workloads of --mode prefill: they read no cache"]
    assert select_run(RunOptions(impls=["torch_eager"], device="cpu", preset="tiny", modes=["decode"])).notes == []


def test_a_gpu_named_by_index_is_made_current_where_kernels_launch(monkeypatch):
    """Triton launches on the current GPU whatever its tensors' device: --device cuda:1 ran GPU 0's kernels over GPU
    1's memory. The CLI and pytest (``prepare``), an in-process run and a worker each make it current."""
    from mla_bench import device as devices

    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    assert devices.prepare("cuda:1") == torch.device("cuda:1") and made == [torch.device("cuda:1")]
    devices.prepare("cuda")  # the current one already
    devices.make_current(torch.device("cpu"))
    assert made == [torch.device("cuda:1")]
    monkeypatch.setattr(environment, "describe", lambda device, id: Device(id))
    monkeypatch.setattr(runner, "_context", lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("stop here")))
    with pytest.raises(RuntimeError, match="stop here"):
        runner.run_selection(runner.Selection(RunOptions(impls=["torch_eager"], device="cuda:1"),
                                              torch.device("cuda:1"), [], [], [], [], []))
    assert made == [torch.device("cuda:1")] * 2


class ExitsWhenMade(planted.PlainDecode):
    """Its constructor calls ``sys.exit`` (a driver check)."""

    name = "exits_when_made"

    def __init__(self):
        sys.exit("no GPU driver")


class DeletesTheScale(planted.PlainDecode):
    """Deletes a field of the shared problem (the judge names it and restores it)."""

    name = "deletes_the_scale"

    def run(self, plan):
        answer = super().run(plan)
        del plan.scale
        return answer


def test_an_impl_that_exits_when_made_or_breaks_the_judge_is_an_error_and_the_others_are_judged(monkeypatch):
    """The first ended the whole run with no result; a judge that raised over an impl (it once did over a deleted
    field) ended the accuracy suite, and the next impls and workloads got nothing."""
    from mla_bench.registry import ImplEntry
    from mla_bench.workload import Workload
    from suites import accuracy
    from suites.accuracy import judge_workload
    from suites.base import RunContext, load_impls

    ctx = RunContext([ImplEntry(ExitsWhenMade.name, "tests:ExitsWhenMade", "path", ExitsWhenMade),
                      ImplEntry("plain_decode", "planted_impls:PlainDecode", "path", planted.PlainDecode)],
                     torch.device("cpu"))
    impls, failures = load_impls(ctx, "accuracy")
    assert [type(impl) for impl in impls] == [planted.PlainDecode] and len(failures) == 1
    assert (failures[0].impl, failures[0].status) == (ExitsWhenMade.name, "error")
    assert "no GPU driver" in failures[0].message
    workload = Workload(mode="decode", q_lens=(1, 2), kv_lens=(37, 50), page_size=16, seed=random.randint(1, 10 ** 6))
    results = list(judge_workload(workload, [DeletesTheScale(), planted.PlainDecode()], torch.device("cpu")))
    assert [(r.impl, r.status) for r in results] == [(DeletesTheScale.name, "failed"), ("plain_decode", "passed")]
    assert "scale (deleted)" in results[0].message
    judge = accuracy.judge

    def judge_that_breaks(impl, problem, refs):  # leaves the problem damaged, as the old restore did
        if impl.name != DeletesTheScale.name:
            return judge(impl, problem, refs)
        del problem.scale
        raise RuntimeError("the judge broke")

    monkeypatch.setattr(accuracy, "judge", judge_that_breaks)
    results = list(judge_workload(workload, [DeletesTheScale(), planted.PlainDecode()], torch.device("cpu")))
    assert [(r.impl, r.status) for r in results] == [(DeletesTheScale.name, "error"), ("plain_decode", "passed")]
    assert "the judge broke" in results[0].message
