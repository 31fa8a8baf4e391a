"""Run files: round trip, and a clear RunFileError for corrupt, foreign or tampered files."""

from __future__ import annotations

import json
import math

import pytest

from mla_bench.results import RUN_FORMAT, RUN_VERSION, Device, Result, Run, RunFileError, load_run, save_run


def _run() -> Run:
    results = [
        Result("accuracy", "accuracy", "passed", impl="torch_eager", workload={"mode": "decode", "q_lens": [1],
                                                                               "kv_lens": [7]},
               label="decode tiny", metrics={"kernel.rel_l2": 2.5e-3, "kernel.nonfinite_mismatch": 3,
                                             "kernel.lse_max_abs": float("inf"), "odd": float("nan")},
               details={"tolerance": {"kernel": {"rel_l2": 8e-3}}, "weird": float("-inf")}),
        Result("latency", "latency", "unsupported", impl="x", label="(all workloads)", message="no CUDA"),
    ]
    return Run(environment={"gpu": None, "torch": "2.13", "gpu_count": 0}, results=results,
               ceilings={"H100": {"copy_gbps": 3000.0, "matmul_tflops": 700.0}}, created="now", command=["a", "b"])


def test_round_trip_keeps_everything_including_non_finite_metrics(tmp_path):
    path = save_run(_run(), tmp_path / "run.json")
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    loaded = load_run(path)
    original = _run()
    assert loaded.environment == original.environment and loaded.ceilings == original.ceilings
    assert loaded.command == ["a", "b"] and loaded.created == "now"
    assert [r.label for r in loaded.results] == [r.label for r in original.results]
    metrics = loaded.results[0].metrics
    assert metrics["kernel.rel_l2"] == 2.5e-3 and metrics["kernel.nonfinite_mismatch"] == 3
    assert metrics["kernel.lse_max_abs"] == float("inf") and math.isnan(metrics["odd"])
    assert loaded.results[0].details["weird"] == "-inf"  # as save_run says: only metrics and ceilings turn back


def test_non_finite_ceilings_round_trip(tmp_path):
    """save_run writes a non-finite ceiling as a string (strict JSON); load_run restores it, as for metrics."""
    run = _run()
    run.ceilings = {"H100": {"copy_gbps": float("nan"), "matmul_tflops": float("inf")}}
    loaded = load_run(save_run(run, tmp_path / "run.json"))
    assert math.isnan(loaded.ceilings["H100"]["copy_gbps"]) and loaded.ceilings["H100"]["matmul_tflops"] == math.inf


def test_round_trip_keeps_the_devices_and_the_device_of_each_result(tmp_path):
    run = _run()
    run.devices = [Device("cuda:0", "NVIDIA H100 80GB HBM3", "9.0"), Device("cuda:1", "NVIDIA H200", "9.0")]
    run.results[0].device = "cuda:1"
    loaded = load_run(save_run(run, tmp_path / "run.json"))
    assert loaded.devices == run.devices and [r.device for r in loaded.results] == ["cuda:1", None]


def test_a_version_1_file_loads_without_devices(tmp_path):
    """A file as version 1 wrote it (no devices, results that do not name theirs) still loads."""
    old = {"format": RUN_FORMAT, "version": 1, "created": "then", "command": ["mla-bench", "run"],
           "environment": {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"},
           "ceilings": {"NVIDIA H100 80GB HBM3": {"copy_gbps": 3000.0, "matmul_tflops": "nan"}},
           "results": [{"suite": "latency", "check": "latency", "status": "passed", "impl": "x", "workload": None,
                        "label": "w", "metrics": {"run_ms": 0.01}, "details": {"device": "NVIDIA H100 80GB HBM3"},
                        "message": ""}]}
    loaded = load_run(_write(tmp_path, old))
    assert loaded.devices == [] and [r.device for r in loaded.results] == [None]
    assert math.isnan(loaded.ceilings["NVIDIA H100 80GB HBM3"]["matmul_tflops"])


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _valid() -> dict:
    return _run().to_dict() | {"results": [_run().results[1].to_dict()]}


@pytest.mark.parametrize("data, message", [
    ("{not json", "not valid JSON"),
    ('{"format": "mla-bench-run", "version": 1, "environment": {}, "results": [', "not valid JSON"),
    ([1, 2, 3], "JSON object"),
    ({"benchmarks": []}, "not an mla-bench run file"),
    (_valid() | {"format": "pytest-benchmark"}, "not an mla-bench run file"),
    (_valid() | {"version": 99}, "unsupported run file version 99"),
    (_valid() | {"extra": 1}, "unknown top-level fields"),
    (_valid() | {"environment": {"gpu": ["a"]}}, "'environment'"),
    (_valid() | {"ceilings": {"H100": {"copy_gbps": "fast"}}}, "'ceilings'"),
    (_valid() | {"results": {"a": 1}}, "'results' must be a list"),
    (_valid() | {"results": ["text"]}, "results[0]: a result must be a JSON object"),
    (_valid() | {"results": [{"suite": "a", "check": "b", "status": "pwned"}]}, "results[0]: Result.status"),
    (_valid() | {"results": [{"suite": "a", "check": "b", "status": "passed", "metrics": {"x": "1e9"}}]},
     "results[0]: Result.metrics['x'] must be a number"),
    (_valid() | {"results": [{"suite": "a", "check": "b", "status": "passed", "label": 5}]}, "Result.label"),
    (_valid() | {"results": [{"suite": "a", "status": "passed"}]}, "results[0]"),
    (_valid() | {"results": [{"suite": "a", "check": "b", "status": "passed", "__class__": "x"}]},
     "unknown result fields"),
    (_valid() | {"command": "rm -rf /"}, "'command'"),
    (_valid() | {"version": True}, "unsupported run file version True"),  # True == 1 in Python
    ('{"format": "mla-bench-run", "results": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"version": ' + "9" * 5000 + "}", "not valid JSON"),  # Python refuses to parse an int of > 4300 digits
    (_valid() | {"results": [{"suite": "a", "check": "b", "status": "passed", "metrics": {"x": 10 ** 400}}]},
     "results[0]: Result.metrics['x'] must be a number"),  # no float holds it: the report would crash
    (_valid() | {"ceilings": {"H100": {"copy_gbps": 10 ** 400}}}, "'ceilings'"),
    (_valid() | {"devices": {"cuda:0": "H100"}}, "'devices' must be a list"),
    (_valid() | {"devices": [{"id": 0}]}, "devices[0]: Device.id must be a non-empty string"),
    (_valid() | {"devices": [{"id": "cuda:0", "name": ["H100"]}]}, "devices[0]: Device.name must be a string"),
    (_valid() | {"devices": [{"id": "cuda:0", "serial": "x"}]}, "devices[0]: unknown device fields: ['serial']"),
    (_valid() | {"devices": ["cuda:0"]}, "devices[0]: a device must be a JSON object"),
    (_valid() | {"devices": [{"id": "cuda:0"}, {"id": "cuda:0", "name": "H200"}]}, "names a device more than once"),
    (_valid() | {"results": [{"suite": "a", "check": "b", "status": "passed", "device": "cuda:7"}]},
     "results[0]: device 'cuda:7' is not one of the run's 'devices'"),
    (_valid() | {"results": [{"suite": "a", "check": "b", "status": "passed", "device": 0}]},
     "results[0]: Result.device must be a string or null"),
])
def test_corrupt_or_foreign_files_get_a_clear_error(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(RunFileError) as info:
        load_run(path)
    assert message in str(info.value) and path in str(info.value)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(RunFileError, match="cannot read"):
        load_run(tmp_path / "absent.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RunFileError):
        load_run(tmp_path / "bin.json")


def test_format_constants_are_what_files_carry(tmp_path):
    data = json.loads(save_run(_run(), tmp_path / "r.json").read_text())
    assert data["format"] == RUN_FORMAT and data["version"] == RUN_VERSION


TRACEBACK = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: unknown preset 'tinyy'\n"


@pytest.mark.parametrize("message, brief", [
    ("suite accuracy crashed:\n" + TRACEBACK, "suite accuracy crashed: ValueError: unknown preset 'tinyy'"),
    ("could not build the problem or its reference:\n" + TRACEBACK,
     "could not build the problem or its reference: ValueError: unknown preset 'tinyy'"),
    (TRACEBACK, "ValueError: unknown preset 'tinyy'"),
    ("rel_l2 3e-2 > 8e-3\nsecond line", "rel_l2 3e-2 > 8e-3"),
    ("", ""),
])
def test_brief_shows_the_exception_of_a_traceback_after_the_first_line(message, brief):
    assert Result("accuracy", "accuracy", "error", message=message).brief == brief
