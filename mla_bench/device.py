"""Which device a run uses, and the Triton interpreter switch that a CPU run needs.

``TRITON_INTERPRET`` is read when a module defining ``@triton.jit`` kernels is imported, so ``prepare`` must run
before any impl (or layout with a kernel) is imported. This module imports nothing but torch.
"""

from __future__ import annotations

import os

import torch


def pick_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; asking for CUDA where there is none is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cpu":
        return torch.device("cpu")  # one CPU: cpu:0 would differ from the cpu its tensors report
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} asked for, but {torch.cuda.device_count()} GPU(s) are visible")
    return device


def prepare(name: str, *, keep_interpret: bool = False) -> torch.device:
    """The device for ``name``, made current (``make_current``); on CPU, Triton kernels run in the interpreter (set
    before they are imported). ``keep_interpret``: a ``TRITON_INTERPRET`` the environment sets is left as it is."""
    device = pick_device(name)
    if device.type == "cpu":
        if keep_interpret:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        else:
            os.environ["TRITON_INTERPRET"] = "1"
    make_current(device)
    return device


def make_current(device: torch.device) -> None:
    """Make ``cuda:N`` the process's current GPU: Triton launches on the current GPU whatever its tensors' device,
    so ``--device cuda:1`` would launch kernels on GPU 0 over GPU 1's memory."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
