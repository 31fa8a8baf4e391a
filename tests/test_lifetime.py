"""A worker or DCP rank dies with its parent, however the parent ends (Linux)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

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


@linux_only
def test_a_child_whose_parent_is_already_gone_exits_at_once():
    done = subprocess.run([sys.executable, "-c", CHILD.format(parent=1)], timeout=30)
    assert done.returncode == 1
