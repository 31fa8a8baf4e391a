"""The environment record of a run: what it says of the checkout the bench ran from."""

from __future__ import annotations

import pytest

from mla_bench import environment


@pytest.mark.parametrize("status, dirty", [("", False), (" M mla_bench/costs.py\n", True), (None, None)])
def test_git_dirty_is_unknown_when_git_status_cannot_tell(monkeypatch, status, dirty):
    """A git status that failed or timed out was recorded as a clean tree (``git_dirty: false``)."""
    answers = {"--show-toplevel": f"{environment.PROJECT_ROOT}\n", "HEAD": "abc123\n", "--porcelain": status}
    monkeypatch.setattr(environment, "_command", lambda argv: answers[argv[4]])
    assert environment._git() == {"git_commit": "abc123", "git_dirty": dirty}
