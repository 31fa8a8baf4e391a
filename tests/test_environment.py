"""The environment record of a run: what it says of the checkout the bench ran from."""

from __future__ import annotations

import pytest
import torch

from mla_bench import environment


@pytest.mark.parametrize("status, dirty", [("", False), (" M mla_bench/costs.py\n", True), (None, None)])
def test_git_dirty_is_unknown_when_git_status_cannot_tell(monkeypatch, status, dirty):
    """A git status that failed or timed out was recorded as a clean tree (``git_dirty: false``)."""
    answers = {"--show-toplevel": f"{environment.PROJECT_ROOT}\n", "HEAD": "abc123\n", "--porcelain": status}
    monkeypatch.setattr(environment, "_command", lambda argv: answers[argv[4]])
    assert environment._git() == {"git_commit": "abc123", "git_dirty": dirty}


def _tree(root, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_source_digest_names_the_code_whatever_its_git_state(tmp_path):
    """A run's git fields describe the checkout's metadata, which a copy of a working tree may carry stale (session
    66's H100 baseline says 8bd24ab dirty for the code of 414b43b): the digest depends on the sources alone."""
    files = {"mla_bench/a.py": "x = 1\n", "impls/triton/k.py": "y = 2\n", "suites/s.py": "", "reference/r.py": "z\n"}
    digest = environment.source_digest(_tree(tmp_path / "one", files))
    assert digest == environment.source_digest(_tree(tmp_path / "two", dict(reversed(files.items()))))
    assert len(digest) == 16 and int(digest, 16) >= 0
    unrelated = {**files, "tests/t.py": "assert 0\n", "mla_bench/notes.md": "text", "README.md": "text"}
    assert environment.source_digest(_tree(tmp_path / "three", unrelated)) == digest  # only the packages' *.py
    changes = [{**files, "impls/triton/k.py": "y = 3\n"},  # a byte changed
               {**files, "impls/triton/new.py": ""},  # a file added, even empty
               {k: v for k, v in files.items() if k != "suites/s.py"},  # an empty file removed
               {**{k: v for k, v in files.items() if k != "reference/r.py"}, "reference/q.py": "z\n"},  # renamed
               {**files, "impls/triton/k.py": "y = 2\nx", "mla_bench/a.py": " = 1\n"}]  # a byte moved across files
    digests = {environment.source_digest(_tree(tmp_path / f"c{i}", c)) for i, c in enumerate(changes)}
    assert len(digests) == len(changes) and digest not in digests


def test_a_run_records_the_digest_of_the_bench_it_ran_from():
    env = environment.collect(torch.device("cpu"), [])
    assert env["source_digest"] == environment.source_digest(environment.PROJECT_ROOT)
