"""The process-wide settings an impl must leave as it found them: torch's default dtype and device, the working
directory, and the environment variables the bench reads. Impls share one process (unless ``--isolate``): one that
set the default dtype to float64 made every later problem error out, under other impls' names, and one that set
``TRITON_INTERPRET=0`` on import left every Triton impl of a CPU run unsupported."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENVIRONMENT = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")  # read by the bench when it picks and prepares devices


@dataclass(frozen=True)
class ProcessState:
    default_dtype: torch.dtype
    default_device: torch.device
    directory: str
    environment: tuple[tuple[str, str | None], ...]

    @classmethod
    def now(cls) -> "ProcessState":
        return cls(torch.get_default_dtype(), torch.get_default_device(), os.getcwd(),
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
        if now.directory != self.directory:  # relative paths (a results directory, a peer's JIT cache) move with it
            os.chdir(self.directory)
            changed.append(f"the working directory (now {now.directory}, was {self.directory})")
        for (name, was), (_, value) in zip(self.environment, now.environment):
            if value != was:
                if was is None:
                    del os.environ[name]
                else:
                    os.environ[name] = was
                changed.append(f"${name} (now {value!r}, was {was!r})")
        return changed
