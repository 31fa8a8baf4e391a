"""A child process that must not outlive its parent: a worker of the runner, a rank of a DCP run.

``die_with_parent(parent)`` asks the kernel to SIGKILL the calling process when its parent exits (Linux
``prctl(PR_SET_PDEATHSIG)``), however the parent ends: killed by ``--stall-timeout``, crashed, or ``kill -9``. A
parent already gone when the child gets there is caught too (the child then belongs to another process). Elsewhere
it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the pid that started it) exits; exit at once if it already has."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    # refused in some sandboxes: then only the runner's kill of the whole tree ends this process, and only while the
    # runner lives, so the check below runs either way
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the request was made
