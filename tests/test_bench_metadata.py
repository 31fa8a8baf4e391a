"""The metadata benchmark runs end to end (a smoke test on tiny batches; its numbers are not judged here)."""

import json

from suites.bench_metadata import main


def test_benchmark_writes_one_row_per_device_batch_and_way(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--devices", "cpu", "--batches", "1,3", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["way"]) for r in rows] == [(1, "reference"), (1, "fast"), (3, "reference"), (3, "fast")]
    assert all(0 < r["host_ms"] <= r["total_ms"] for r in rows)
    assert "metadata build per step" in capsys.readouterr().out
