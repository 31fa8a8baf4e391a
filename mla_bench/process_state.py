"""The process-wide settings an impl must leave as it found them: torch's default dtype and device, the working
directory, and the environment variables the bench reads. Impls share one process (unless ``--isolate``): one that
set the default dtype to float64 made every later problem error out, under other impls' names, and one that set
``TRITON_INTERPRET=0`` on import left every Triton impl of a CPU run unsupported."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENVIRONMENT = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")  # read by the bench when it picks and prepares devices


def _working_directory() -> str | None:
    """The working directory; None where it was deleted (an impl's temporary build directory, say)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class ProcessState:
    default_dtype: torch.dtype
    default_device: torch.device
    directory: str | None
    environment: tuple[tuple[str, str | None], ...]

    @classmethod
    def now(cls) -> "ProcessState":
        return cls(torch.get_default_dtype(), torch.get_default_device(), _working_directory(),
                   tuple((name, os.environ.get(name)) for name in ENVIRONMENT))

    def restore(self) -> list[str]:
        """Put back each setting that differs from this state; what differed, as ``what (now X, was Y)``."""
        now, changed = ProcessState.now(), []
        if now.default_dtype != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
            changed.append(f"torch's default dtype (now {now.default_dtype}, was {self.default_dtype})")
        if now.default_device != self.default_device:  # None: no device context left on the CPU, as at start
            torch.set_default_device(None if self.default_device.type == "cpu" else self.default_device)
            changed.append(f"torch's default device (now {now.default_device}, was {self.default_device})")
        if now.directory != self.directory and self.directory is not None:
            os.chdir(self.directory)  # relative paths (a results directory, a peer's JIT cache) move with it
            changed.append(f"the working directory (now {now.directory or 'a deleted directory'}, was "
                           f"{self.directory})")
        for (name, was), (_, value) in zip(self.environment, now.environment):
            if value == was or (was is None and _is_the_benchs_default(name, value)):
                continue
            if was is None:
                os.environ.pop(name, None)  # a thread the impl left may have unset it meanwhile
            else:
                os.environ[name] = was
            changed.append(f"${name} (now {_shown(value)}, was {_shown(was)})")
        return changed


def _is_the_benchs_default(name: str, value: str | None) -> bool:
    """Whether an unset variable got the value the bench itself gives it on this host: ``impls.triton`` switches the
    interpreter on where no GPU is visible, before its kernels are defined (taking it back would leave later kernels
    compiled for a GPU). Anything else is a change, the interpreter switched on where a GPU is visible included (the
    later Triton kernels would run interpreted)."""
    return name == "TRITON_INTERPRET" and value == "1" and not torch.cuda.is_available()


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value)
