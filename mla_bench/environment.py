"""Where a run ran: GPU, driver, CUDA, torch, triton, python, platform, the bench's git commit and a digest of its
sources (``source_digest``: which code ran, also where the checkout's git metadata is missing or stale, as in a copy of
a working tree taken to another machine).

No hostname and no user names: a results file may be shared. ``gpu`` is what the gate compares before it
compares latencies (only runs on the same GPU model are comparable): the model of every device that ran part of
the run, so a run over several models (``--devices``) names them all and compares with no run of one model.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable

import torch

import mla_bench
from mla_bench.results import Device

PROJECT_ROOT = Path(mla_bench.__file__).resolve().parent.parent


def describe(device: torch.device, id: str) -> Device:
    """``device`` of this process as the run names it (``id``): a worker's ``cuda`` is the host's GPU that ``id``
    names, the only one it sees."""
    if device.type != "cuda":
        return Device(id)
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return Device(id, torch.cuda.get_device_name(index), f"{major}.{minor}")


def collect(device: torch.device, devices: list[Device]) -> dict[str, Any]:
    """The environment of a run asked to run on ``device`` (``--device``) whose results ``devices`` produced:
    ``gpu`` and ``compute_capability`` are theirs, the distinct values joined by " + "."""
    env: dict[str, Any] = {
        "device": str(device),
        "gpu": _joined(d.name for d in devices),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "compute_capability": _joined(d.compute_capability for d in devices),
        "driver": _driver_version() if any(d.name for d in devices) else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mla_bench": mla_bench.__version__,
        "source_digest": source_digest(PROJECT_ROOT),
    }
    env.update(_git())
    return env


SOURCE_PACKAGES = ("mla_bench", "impls", "suites", "reference")  # the code a result depends on (not the tests)


def source_digest(root: Path) -> str:
    """SHA-256 (hex, first 16 digits) of the ``*.py`` files of ``SOURCE_PACKAGES`` under ``root``, each file's path
    relative to ``root`` and its bytes, in path order: equal for the same code whatever its git state, different when
    any source file is added, removed, renamed or changed."""
    digest = hashlib.sha256()
    files = sorted(path for package in SOURCE_PACKAGES for path in (root / package).rglob("*.py"))
    for path in files:
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def _joined(values: Iterable[str | None]) -> str | None:
    """The distinct values, sorted and joined by " + " (None when there is none)."""
    distinct = sorted({v for v in values if v is not None})
    return " + ".join(distinct) or None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _driver_version() -> str | None:
    out = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def _git() -> dict[str, Any]:
    """The commit of the checkout the bench runs from, and whether its tracked files differ from it (both None when
    it is not its own git work tree)."""
    top = _command(["git", "-C", str(PROJECT_ROOT), "rev-parse", "--show-toplevel"])
    if not top or Path(top.strip()).resolve() != PROJECT_ROOT:
        return {"git_commit": None, "git_dirty": None}
    commit = _command(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"])
    status = _command(["git", "-C", str(PROJECT_ROOT), "status", "--porcelain", "--untracked-files=no"])
    # None when git status cannot tell (it failed or timed out): not a clean tree
    return {"git_commit": commit.strip() if commit else None,
            "git_dirty": None if status is None else bool(status.strip())}


def _command(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None
