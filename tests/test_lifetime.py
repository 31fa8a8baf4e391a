"""A worker or DCP rank dies with its parent, however the parent ends (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mla_bench import lifetime
from test_runner import _ends_within

CHILD = "import time; from mla_bench.lifetime import die_with_parent; die_with_parent({parent}); time.sleep(60)"
PARENT = ("import os, subprocess, sys, time; "
          "child = subprocess.Popen([sys.executable, '-c', {child!r}.format(parent=os.getpid())]); "
          "print(child.pid, flush=True); time.sleep(60)")

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


@linux_only
def test_a_child_is_killed_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(child=CHILD)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the child has imported the bench and made its request
        assert not _ends_within(child, seconds=0.2)  # alive while its parent is
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _ends_within(child, seconds=5)
    finally:
        parent.kill()


LATE_CHILD = "import time; time.sleep(1.0); " + CHILD.split("; ", 1)[1]  # asks only after its parent has gone
GONE_PARENT = ("import os, subprocess, sys; "
               "child = subprocess.Popen([sys.executable, '-c', {child!r}.format(parent=os.getpid())]); "
               "print(child.pid, flush=True)")  # exits at once


@linux_only
def test_a_child_whose_parent_is_already_gone_exits_at_once():
    """The death signal is asked for after the parent died: only the parent check can end the child then."""
    parent = subprocess.run([sys.executable, "-c", GONE_PARENT.format(child=LATE_CHILD)], capture_output=True,
                            text=True, timeout=30, check=True)
    assert _ends_within(int(parent.stdout), seconds=15)


@linux_only
def test_a_child_whose_parent_is_gone_exits_even_where_the_death_signal_is_refused(monkeypatch):
    """A sandbox may refuse prctl: the parent check must still end an orphan (it returned before that check)."""
    class RefusingLibc:
        def prctl(self, *args) -> int:
            return -1

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(lifetime.ctypes, "CDLL", lambda *args, **kwargs: RefusingLibc())
    monkeypatch.setattr(lifetime.os, "_exit", exit_)
    lifetime.die_with_parent(os.getppid())  # the parent lives: nothing happens
    with pytest.raises(SystemExit):
        lifetime.die_with_parent(os.getppid() + 1)  # the process that started us is gone: exit
