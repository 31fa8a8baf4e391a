"""The process-wide settings an impl must leave as it found them: torch's default dtype and device, its numerics
switches (float32 matmul precision per backend, cuBLAS's reduced-precision reductions, deterministic algorithms), the
working directory, and the environment variables the bench reads. Impls share one process (unless ``--isolate``):
one that set the default dtype to float64 made every later problem error out, under other impls' names; one that
set ``TRITON_INTERPRET=0`` on import left every Triton impl of a CPU run unsupported; one that allowed TF32 would
have torch_eager's float32 problems fail their tolerance, under torch_eager's name."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

ENVIRONMENT = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")  # read by the bench when it picks and prepares devices
# torch.backends switches that change the numbers other impls compute, read through the float32-precision API of
# torch >= 2.9 (the legacy allow_tf32 and set_float32_matmul_precision write it; reading the legacy ones raises once
# both APIs were used). Not mkldnn.fp32_precision: its setter writes the generic one (torch 2.11 and 2.13).
NUMERICS = ("fp32_precision", "cuda.matmul.fp32_precision", "mkldnn.matmul.fp32_precision",
            "cuda.matmul.allow_bf16_reduced_precision_reduction", "cuda.matmul.allow_fp16_reduced_precision_reduction")


def _switch(path: str) -> tuple[object, str]:
    """The object holding ``torch.backends.<path>`` and the attribute's name."""
    owner, _, name = path.rpartition(".")
    return functools.reduce(getattr, owner.split(".") if owner else [], torch.backends), name


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
    numerics: tuple[object, ...]  # NUMERICS' values, in order
    deterministic: tuple[bool, bool]  # torch.use_deterministic_algorithms: on, warn only
    directory: str | None
    environment: tuple[tuple[str, str | None], ...]

    @classmethod
    def now(cls) -> "ProcessState":
        deterministic = (torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled())
        return cls(torch.get_default_dtype(), torch.get_default_device(),
                   tuple(getattr(*_switch(path)) for path in NUMERICS), deterministic,
                   _working_directory(), tuple((name, os.environ.get(name)) for name in ENVIRONMENT))

    def restore(self) -> list[str]:
        """Put back each setting that differs from this state; what differed, as ``what (now X, was Y)``."""
        now, changed = ProcessState.now(), []
        if now.default_dtype != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
            changed.append(f"torch's default dtype (now {now.default_dtype}, was {self.default_dtype})")
        if now.default_device != self.default_device:  # None: no device context left on the CPU, as at start
            torch.set_default_device(None if self.default_device.type == "cpu" else self.default_device)
            changed.append(f"torch's default device (now {now.default_device}, was {self.default_device})")
        for path, was, value in zip(NUMERICS, self.numerics, now.numerics):
            if value != was:
                setattr(*_switch(path), was)
                changed.append(f"torch.backends.{path} (now {value!r}, was {was!r})")
        if now.deterministic != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
            changed.append(f"torch's deterministic algorithms (now {_on_or_off(now.deterministic)}, was "
                           f"{_on_or_off(self.deterministic)})")
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


def _on_or_off(deterministic: tuple[bool, bool]) -> str:
    on, warn_only = deterministic
    return ("on, warning only" if warn_only else "on") if on else "off"


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value)
