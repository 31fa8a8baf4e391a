"""The command line end to end: run, report, compare, gate (pass on a rerun, fail on a planted regression),
exit codes, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from rich.console import Console

from mla_bench.cli import main
from mla_bench.results import Device, Result, Run, load_run, save_run
from reports.console import untested_text

TESTS = Path(__file__).parent


def _run(tmp_path, name: str, *args: str) -> tuple[int, Path]:
    return _run_on(tmp_path, name, "cpu", *args)


def _run_on(tmp_path, name: str, device: str, *args: str) -> tuple[int, Path]:
    out = tmp_path / name
    code = main(["run", "--device", device, "--out", str(out), *args])
    return code, out / "run.json"


def test_run_rerun_gate_compare_and_report(tmp_path, capsys):
    code, base = _run(tmp_path, "a", "--impl", "torch_eager", "--mode", "decode,prefill")
    assert code == 0 and (base.parent / "report.html").exists() and list(base.parent.glob("report-*.png"))
    code, again = _run(tmp_path, "b", "--impl", "torch_eager", "--mode", "decode,prefill", "--no-report")
    assert code == 0 and not (again.parent / "report.html").exists()
    assert main(["gate", "--baseline", str(base), str(again)]) == 0
    assert "gate: passed" in capsys.readouterr().out
    assert main(["compare", str(base), str(again)]) == 0
    table = capsys.readouterr().out
    assert "torch_eager" in table and "kernel.rel_l2" in table
    assert main(["report", str(again), "-o", str(tmp_path / "r" / "x.html")]) == 0
    assert (tmp_path / "r" / "x.html").exists() and (tmp_path / "r" / "x-errors-0.png").exists()
    run = load_run(again)
    assert {r.status for r in run.results} <= {"passed", "unsupported"} and run.environment["torch"]


def test_a_run_logged_to_a_file_prints_a_line_per_step_as_it_begins(tmp_path, capsys, monkeypatch):
    """Where stderr is no terminal (CI, a log) rich draws its bar only when the run ends: a line per step shows a long
    run moving and names the step a hung run is in."""
    code, path = _run(tmp_path, "a", "--impl", "torch_eager", "--mode", "decode", "--no-report")
    steps = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    counts = [re.match(r"\[(\d+)/(\d+) \d+:\d\d\] ", line) for line in steps]
    assert code == 0 and all(counts) and len(steps) > 3
    assert [int(m[1]) for m in counts] == list(range(1, len(steps) + 1)) and {int(m[2]) for m in counts} == {len(steps)}
    labels = {line[m.end():] for line, m in zip(steps, counts)}
    assert {r.label for r in load_run(path).results if r.suite == "accuracy"} <= labels
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))  # a terminal gets the bar instead
    assert _run(tmp_path, "b", "--impl", "torch_eager", "--mode", "decode", "--no-report")[0] == 0
    assert not re.search(r"^\[\d+/\d+ ", capsys.readouterr().err, re.M)


def test_gate_fails_on_a_less_accurate_impl_and_on_a_new_failure(tmp_path, capsys):
    code, base = _run(tmp_path, "base", "--impl", "planted_impls:PlainDecode", "--mode", "decode", "--no-report")
    assert code == 0
    # Same name, same results except the error: most workloads still pass, but worse than the baseline.
    code, worse = _run(tmp_path, "worse", "--impl", "planted_impls:LessAccurate", "--mode", "decode", "--no-report")
    capsys.readouterr()
    assert main(["gate", "--baseline", str(base), str(worse)]) == 1
    out = capsys.readouterr().out
    assert "gate: FAILED" in out and "accuracy" in out and "new failure" in out


@pytest.mark.gpu
def test_gate_passes_a_rerun_and_fails_the_torch_baseline_made_twice_as_slow(tmp_path, capsys):
    """The latency suite times on CUDA only; the planted impl keeps torch_eager's name and results. Four serving
    shapes (~15 s a run): the tiny sweep's workloads take 256 rotating input sets each and minutes."""
    sweep = ("--suite", "latency", "--preset", "deepseek-v3-tp8", "--sweep", "gpu-quick", "--mode", "decode",
             "--layout", "bf16", "--no-report")
    code, base = _run_on(tmp_path, "base", "cuda", "--impl", "torch_eager", *sweep)
    assert code == 0
    code, again = _run_on(tmp_path, "again", "cuda", "--impl", "torch_eager", *sweep)
    capsys.readouterr()
    assert code == 0 and main(["gate", "--baseline", str(base), str(again)]) == 0  # a rerun is within the noise
    code, slower = _run_on(tmp_path, "slower", "cuda", "--impl", "planted_impls:SlowerTorchEager", *sweep)
    assert code == 0 and len([r for r in load_run(slower).results if r.check == "latency"]) == 4
    capsys.readouterr()
    assert main(["gate", "--baseline", str(base), str(slower)]) == 1
    out = capsys.readouterr().out
    assert "gate: FAILED" in out and "latency" in out


def test_bad_input_gets_clear_errors_and_exit_code_2(tmp_path, capsys):
    assert main(["run", "--impl", "no_such_impl", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "error: --impl: unknown impl 'no_such_impl'" in capsys.readouterr().out
    assert main(["run", "--impl", "torch_eager", "--suite", "nope", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "error: --suite: unknown suite 'nope'" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    assert main(["gate", "--baseline", str(bad), str(bad)]) == 2
    assert main(["report", str(bad)]) == 2
    assert "not an mla-bench run file" in capsys.readouterr().out


def test_list_and_list_layouts(capsys):
    assert main(["list", "--layouts"]) == 0
    out = capsys.readouterr().out
    assert "bf16" in out and "1152" in out and "[kv_c 512 | k_pe 64]" in out
    assert main(["list"]) == 0
    assert "torch_eager" in capsys.readouterr().out


def test_list_shows_a_broken_impl_as_such_and_exits_1(monkeypatch, capsys):
    from mla_bench import registry

    broken = registry.ImplEntry("my_broken", "planted_impls:NoSuchClass", "entry point (mypkg)")
    known = registry.discover()
    monkeypatch.setattr(registry, "discover", lambda: {**known, "my_broken": broken})
    assert main(["list"]) == 1
    out = capsys.readouterr().out
    assert "cannot load" in out and "NoSuchClass" in out and "torch_eager" in out
    silent = registry.ImplEntry("raises_without_message", "planted_impls:RaisesWithoutMessage", "entry point (mypkg)")
    monkeypatch.setattr(registry, "discover", lambda: {**known, silent.name: silent})
    assert main(["list"]) == 1  # an exception with no message made the listing itself fail (IndexError)
    out = capsys.readouterr().out
    assert "cannot load" in out and "AssertionError" in out
    exits = registry.ImplEntry("exits_when_made", "planted_impls:ExitsWhenMade", "entry point (mypkg)")
    monkeypatch.setattr(registry, "discover", lambda: {**known, exits.name: exits})
    assert main(["list"]) == 1  # sys.exit(0) in its constructor ended the listing with status 0, nothing printed
    out = capsys.readouterr().out
    assert "cannot load" in out and "exits_when_made" in out and "torch_eager" in out


def test_the_command_exits_though_an_impl_left_a_thread_running(tmp_path):
    """In-process, a thread an impl left running (each run of this one sleeps 600 s in one) kept the command from
    exiting after it wrote its results."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "mla_bench.cli", "run", "--impl", "planted_impls:LingersAtExit",
                           "--suite", "accuracy", "--mode", "decode", "--layout", "bf16", "--out", str(tmp_path),
                           "--no-report", "--device", "cpu"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and load_run(tmp_path / "run.json").ok, done.stdout + done.stderr
    assert "note: not waiting for " in done.stderr and "thread(s) an impl left running" in done.stderr, done.stderr


def test_console_script_flags_every_planted_bug_with_exit_code_1(tmp_path):
    """The installed ``mla-bench`` in a fresh process (TRITON_INTERPRET set there, impls from PYTHONPATH)."""
    import planted_impls

    twins = [planted_impls.PlainDecode, planted_impls.PlainFP8Decode, planted_impls.PlainSparse]
    bugs = ",".join(f"planted_impls:{cls.__name__}" for cls in planted_impls.PLANTED_BUGS + twins)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-m", "mla_bench.cli", "run", "--impl", bugs, "--out", str(tmp_path),
                           "--no-report", "--device", "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    run = load_run(tmp_path / "run.json")
    assert run.environment["triton_interpret"] == "1"
    failed = {r.impl for r in run.results if r.status == "failed"}
    assert failed == {cls.name for cls in planted_impls.PLANTED_BUGS}
    # Each bug's correct twin passes the same workloads: the bugs are flagged for themselves, not the harness.
    assert {r.impl for r in run.results if r.status == "passed"} >= {cls.name for cls in twins}


@pytest.mark.parametrize("argv", [["run", "--help"], ["gate", "--help"]])
def test_help_lists_the_options(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert ("--isolate" in out and "--devices" in out and "--stall-timeout" in out) if argv[0] == "run" \
        else "--baseline" in out


@pytest.mark.parametrize("flag", [["--dcp", "0"], ["--dcp", "2", "--dcp-interleave", "-1"]])
def test_dcp_flags_refuse_non_positive_values(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", *flag])
    assert info.value.code == 2 and "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--preset", "tinyy"], "--preset: unknown preset 'tinyy'; known presets: "),
    (["--layout", "nope"], "--layout: unknown cache layout 'nope'"),
    (["--sweep", "x"], "--sweep: unknown sweep 'x'"),
    (["--preset", "tiny", "--sweep", "x"], "--sweep: unknown sweep 'x'"),
    (["--seed", "-1"], "--seed: seed must be an int >= 0"),
    (["--seed", str(2 ** 32)], "--seed: seed must be an int >= 0 and < 2**32"),
    (["--mode", "decod"], "--mode: unknown mode 'decod'; modes: decode, prefill"),
    (["--mode", "Decode"], "--mode: unknown mode 'Decode'"),
    (["--mode", "prefill", "--dcp", "2"], "nothing to run: --mode prefill with --dcp 2"),
    (["--impl", ""], "--impl: no impl given"),
    (["--suite", ""], "--suite: no suite given"),
    (["--suite", "accuracy,nope"], "--suite: unknown suite 'nope'"),
    (["--impl", "torch_eager,torch_eager"], "--impl: impl name 'torch_eager' is given more than once"),
    (["--impl", "nosuchmod:Foo"], "--impl: nosuchmod:Foo: cannot import nosuchmod"),
    (["--impl", "planted_impls:NoSuchClass"], "--impl: planted_impls:NoSuchClass: module planted_impls has no"),
    (["--device", "tpu"], "--device: unknown device 'tpu'"),
    (["--preset", "tiny", "--sweep", "gpu-quick"], "--sweep: sweep gpu-quick takes the presets deepseek-v3"),
    (["--dcp-interleave", "4"], "--dcp-interleave applies to decode context parallel runs only"),
    (["--suite", "placement", "--mode", "dcp"], "nothing to run: --mode dcp selects no workload of suites placement"),
    (["--suite", "equivalence", "--impl", "planted_impls:PlainDecode"],
     "nothing to run: --impl planted_impls:PlainDecode selects no workload of suites equivalence"),
    (["--page-size", "16,1000000000"], "--page-size 16,1000000000: the paged cache of workload decode tiny h4 b"),
    (["--stall-timeout", "5"], "--stall-timeout needs --isolate or --devices: a hang in this process cannot be "
                               "interrupted"),
    (["--isolate", "--stall-timeout", "-1"], "--stall-timeout must be a number of seconds > 0, got -1.0"),
    (["--devices", "0", "--stall-timeout", "inf"], "--stall-timeout must be a number of seconds > 0, got inf"),
])
def test_bad_run_options_are_usage_errors_before_anything_runs(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert main(["run", "--device", "cpu", "--out", str(out), "--impl", "torch_eager", "--mode", "decode", *args]) == 2
    assert f"error: {message}" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--page-size", "abc"], "argument --page-size: expected comma-separated ints, got 'abc'"),
    (["--page-size", "1.5"], "argument --page-size: expected comma-separated ints"),
    (["--page-size", "16,0"], "argument --page-size: values must be >= 1"),
    (["--page-size", "-4"], "argument --page-size: values must be >= 1"),
    (["--devices", "a,b"], "argument --devices: expected comma-separated ints"),
    (["--devices=-1"], "argument --devices: values must be >= 0"),
    (["--stall-timeout", "5s"], "argument --stall-timeout: invalid float value: '5s'"),
])
def test_unparsable_or_out_of_range_numbers_are_argparse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_an_out_that_cannot_be_a_directory_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("mla_bench.runner.run_selection", lambda *a: pytest.fail("the run started"))
    blocker = tmp_path / "file"
    blocker.write_text("keep")
    for out, message in ((blocker, "exists and is not a directory"), (blocker / "sub", "cannot create the directory")):
        assert main(["run", "--device", "cpu", "--impl", "torch_eager", "--out", str(out)]) == 2
        printed = capsys.readouterr().out
        assert printed.startswith("error: ") and message in printed and str(out) in printed
    assert blocker.read_text() == "keep"


def test_run_files_that_cannot_be_written_in_out_are_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """Only ``--out`` itself was checked: a run.json that is a directory or a dangling link, or a report.html that
    is a directory, ended the run in a traceback after every result was made (helper 88)."""
    monkeypatch.setattr("mla_bench.runner.run_selection", lambda *a: pytest.fail("the run started"))
    cases = {"dir_run": ("run.json", lambda p: p.mkdir(), "is a directory"),
             "link_run": ("run.json", lambda p: p.symlink_to(tmp_path / "nowhere"), "is a link to nothing"),
             "dir_report": ("report.html", lambda p: p.mkdir(), "is a directory")}
    for out_name, (name, make, message) in cases.items():
        out = tmp_path / out_name
        out.mkdir()
        make(out / name)
        assert main(["run", "--device", "cpu", "--impl", "torch_eager", "--out", str(out)]) == 2
        printed = capsys.readouterr().out
        assert printed.startswith("error: ") and message in printed and name in printed, printed


def test_cpu_with_an_index_is_the_cpu():
    from mla_bench.device import pick_device

    assert pick_device("cpu:0") == pick_device("cpu") == torch.device("cpu")


def test_report_to_a_directory_or_an_unwritable_place_is_refused_and_writes_nothing(tmp_path, capsys):
    result = Result("accuracy", "accuracy", "failed", impl="x", label="w", message="rel_l2 too large")
    run = save_run(Run(environment={}, results=[result]), tmp_path / "run" / "run.json")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    for target, message in ((tmp_path / "dir", "is a directory"), (tmp_path / "file" / "r.html", "is not a directory")):
        assert main(["report", str(run), "-o", str(target)]) == 2
        assert message in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dir", "file", "run", "run.json"]
    before = run.read_bytes()
    assert main(["report", str(run), "-o", str(tmp_path / "run" / ".." / "run" / "run.json")]) == 2
    assert "is the run file itself" in capsys.readouterr().out and run.read_bytes() == before


def test_a_report_whose_plots_would_land_on_a_device_or_the_run_file_is_refused(tmp_path, capsys):
    """``-o /dev/null`` wrote ``/dev/null-errors-0.png``; a run file named like a plot of the report was overwritten
    with PNG data (helper 88)."""
    result = Result("accuracy", "accuracy", "failed", impl="x", label="w", message="rel_l2 too large")
    run = save_run(Run(environment={}, results=[result]), tmp_path / "a-errors-0.png")
    before = run.read_bytes()
    assert main(["report", str(run), "-o", str(tmp_path / "a.html")]) == 2
    assert "could overwrite the run file" in capsys.readouterr().out and run.read_bytes() == before
    assert main(["report", str(run), "-o", os.devnull]) == 2
    assert "is not a regular file" in capsys.readouterr().out and not Path(f"{os.devnull}-errors-0.png").exists()


def test_a_report_the_file_system_refuses_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import reports.html

    run = save_run(Run(environment={}, results=[Result("accuracy", "accuracy", "passed", impl="x", label="w")]),
                   tmp_path / "run.json")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reports.html, "write_report", full_disk)
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 2
    assert "cannot write the report" in capsys.readouterr().out


def test_a_filter_that_is_not_applied_gets_a_note_on_stderr(tmp_path, capsys):
    code, _ = _run(tmp_path, "note", "--impl", "torch_eager", "--mode", "prefill", "--layout", "fp8_ds_mla",
                   "--no-report")
    assert code == 0
    assert "note: --layout is not applied to the workloads of --mode prefill" in capsys.readouterr().err


def test_a_named_impl_tested_on_nothing_exits_1_with_its_reasons(tmp_path, capsys):
    code, path = _run(tmp_path, "decode-only", "--impl", "planted_impls:PlainDecode,torch_eager", "--mode",
                      "prefill,sparse_decode", "--no-report")
    out = capsys.readouterr().out
    assert code == 1 and "error: plain_decode was tested on nothing: all" in out and "torch_eager was" not in out
    refused = [r for r in load_run(path).results if r.impl == "plain_decode"]
    assert refused and {r.status for r in refused} == {"unsupported"}
    for reason, count in Counter(r.brief for r in refused).most_common():
        assert f"{count}x {reason}" in out and "unsupported mode" in reason
    code, _ = _run(tmp_path, "latency", "--impl", "torch_eager", "--suite", "latency", "--no-report")
    assert code == 1 and "1x latency is measured on CUDA devices only" in capsys.readouterr().out
    code, _ = _run(tmp_path, "all", "--impl", "all", "--suite", "latency", "--no-report")  # peers may be absent
    assert code == 0 and "tested on nothing" not in capsys.readouterr().out


def test_the_reasons_of_an_untested_impl_are_the_three_most_common_on_one_line_each():
    rng = random.Random()
    counts = rng.sample(range(1, 50), 5)
    reasons = Counter({f"reason {i} " + "x" * rng.randint(100, 400): n for i, n in enumerate(counts)})
    lines = untested_text("some_impl", reasons).plain.splitlines()
    assert lines[0] == f"error: some_impl was tested on nothing: all {sum(counts)} of its results are unsupported"
    top = reasons.most_common(3)
    assert [line.split("x ", 1)[0].strip() for line in lines[1:4]] == [str(n) for _, n in top]
    assert all(line.strip().split("x ", 1)[1] in (reason, reason[:157] + "...")
               for line, (reason, _) in zip(lines[1:4], top))
    assert all(len(line) <= 170 for line in lines) and lines[4:] == ["  ... and 2 more"]


def test_an_impl_that_changes_directory_does_not_move_the_runs_files(monkeypatch, tmp_path, capsys):
    """``--out relout`` was checked and made before the run, then run.json went to ``relout`` under the directory the
    impl moved to, and the CLI printed the relative path. Now the impl fails for it, and the directory is put back."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANTED_CHDIR", str(elsewhere))
    main(["run", "--device", "cpu", "--impl", "planted_impls:ChangesDirectory", "--mode", "decode", "--layout", "bf16",
          "--suite", "accuracy", "--out", "relout", "--no-report"])
    assert (tmp_path / "relout" / "run.json").is_file() and not (elsewhere / "relout").exists()
    assert f"results: {tmp_path / 'relout' / 'run.json'}" in capsys.readouterr().out
    run = load_run(tmp_path / "relout" / "run.json")
    moved = f"the working directory (now {elsewhere}, was {tmp_path})"
    assert {r.status for r in run.results} == {"failed"} and moved in run.results[0].message and Path.cwd() == tmp_path


@pytest.mark.parametrize("args, message", [
    (["--mode", ""], "argument --mode: expected one or more comma-separated values, got ''"),
    (["--mode", ","], "argument --mode: expected one or more comma-separated values, got ','"),
    (["--layout", " "], "argument --layout: expected one or more comma-separated values"),
    (["--page-size", ""], "argument --page-size: expected comma-separated ints, got ''"),
    (["--devices", ","], "argument --devices: expected comma-separated ints, got ','"),
    (["--preset", ""], "argument --preset: expected a value, got ''"),
    (["--sweep", ""], "argument --sweep: expected a value, got ''"),
    (["--out", ""], "argument --out: expected a value, got ''"),
    (["--devices", "0,1,0"], "argument --devices: GPU 0 is given more than once: each GPU runs one worker"),
    (["--suite", "accuracy,latency,accuracy"], "argument --suite: suite 'accuracy' is given more than once"),
])
def test_empty_or_repeated_values_are_argparse_errors(args, message, capsys, monkeypatch, tmp_path):
    """An empty list was taken as the option left out (``--mode ""`` ran every mode, ``--preset ""`` the default
    presets, ``--out ""`` wrote to results/); a GPU named twice got two workers timing each other's kernels, and a
    suite named twice ran twice, writing every result twice: a file the gate refuses as ambiguous."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mla_bench.runner.run_selection", lambda *a: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as info:
        main(["run", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["report", "run.json", "-o", ""])
    assert info.value.code == 2 and "argument -o/--output: expected a value" in capsys.readouterr().err


def test_paths_are_printed_as_given_not_read_as_markup(tmp_path, capsys):
    """Rich read ``[old]`` in a path as a style (the path printed lost it) and ``[/x]`` as a closing tag: the run
    crashed after writing run.json, before its report."""
    code, path = _run(tmp_path, "r[/x]", "--impl", "torch_eager", "--mode", "decode")
    out = capsys.readouterr().out
    assert code == 0 and f"results: {path}" in out and f"report:  {path.with_name('report.html')}" in out
    moved = save_run(load_run(path), tmp_path / "a[old]" / "run.json")
    assert main(["report", str(moved)]) == 0
    assert f"report: {moved.with_name('report.html')}" in capsys.readouterr().out


def test_compare_withholds_a_latency_change_between_results_measured_on_different_gpu_models(tmp_path, capsys):
    """Runs over an H100 and an H200 (``--devices``) may shard a workload onto either model: as the gate, compare
    does not put a latency measured on one model against one measured on the other (it called H200 0.05 ms -> H100
    0.08 ms a +60% regression)."""
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    devices = [Device("cuda:0", h100, "9.0"), Device("cuda:1", h200, "9.0")]

    def timed(label: str, ms: float, model: str) -> Result:
        return Result("latency", "latency", "passed", impl="k", workload={"label": label}, label=label,
                      metrics={"run_ms": ms, "run_ms_iqr": 0.001, "run_ms_spread": 0.001},
                      details={"device": model}, device=devices[model == h200].id)

    env = {"gpu": f"{h100} + {h200}"}
    a = save_run(Run(env, [timed("w1", 0.05, h200), timed("w2", 0.05, h100)], devices=devices), tmp_path / "a.json")
    b = save_run(Run(env, [timed("w1", 0.08, h100), timed("w2", 0.08, h100)], devices=devices), tmp_path / "b.json")
    assert main(["compare", str(a), str(b), "--rows", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("│")[3].strip(): line for line in lines if "│ latency" in line}
    assert "other GPU" in rows["w1"] and "%" not in rows["w1"] and "+60.0%" in rows["w2"]
    assert main(["compare", str(a), str(b), "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"regression .* w1 ", out) and re.search(r"regression .* w2 ", out)
    caption = " ".join(out.split())
    assert "regression 1," in caption
    assert "1 latency change(s) not shown: measured on one GPU model in A and another in B" in caption


def test_names_and_messages_with_undecodable_bytes_print_escaped(tmp_path, capsys):
    """A traceback naming a path that is not UTF-8 holds lone surrogates: printing it on a strict UTF-8 stdout raised
    UnicodeEncodeError (a traceback and exit 1, the gate's exit code for a regression)."""
    bad = os.fsdecode(b"/data/caf\xe9")
    runs = []
    for name, status in (("base", "passed"), ("new", "error")):
        result = Result("accuracy", "accuracy", status, impl=f"mine{bad}", label=f"w{bad}", device="cpu",
                        message=f"Traceback (most recent call last):\n  File {bad}/x.py\nOSError: {bad}")
        runs.append(str(save_run(Run(environment={}, results=[result], devices=[Device("cpu")]),
                                 tmp_path / f"{name}.json")))
    assert main(["gate", "--baseline", *runs]) == 1
    assert "OSError: /data/caf\\udce9" in capsys.readouterr().out
    assert main(["compare", *runs]) == 0
    assert "mine/data/caf\\udce9" in capsys.readouterr().out
