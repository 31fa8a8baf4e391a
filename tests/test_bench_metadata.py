"""The metadata benchmark runs end to end (a smoke test on tiny batches; its numbers are not judged here)."""

import json

import pytest
import torch

from suites.bench_metadata import Step, bench, main


def test_benchmark_writes_one_row_per_device_batch_and_way(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--devices", "cpu", "--batches", "1,3", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["way"]) for r in rows] == [(1, "reference"), (1, "fast"), (3, "reference"), (3, "fast")]
    assert all(0 < r["host_ms"] <= r["total_ms"] for r in rows)
    assert "metadata build per step" in capsys.readouterr().out


def test_benchmark_refuses_a_build_that_differs_from_the_reference_even_in_dtype_only(monkeypatch):
    built = Step.fast

    def int64_seq_lens(self, *args):
        step = built(self, *args)
        return {**step, "seq_lens": step["seq_lens"].long()}

    monkeypatch.setattr(Step, "fast", int64_seq_lens)
    with pytest.raises(AssertionError, match=r"fast on cpu B=2 differs .*seq_lens: dtype torch.int64, expected "
                                             r"torch.int32"):
        bench([torch.device("cpu")], [2], repeats=1, seed=0)
