"""Errors the bench raises on purpose, so callers can tell a refusal from a failure, and how messages name values."""

from contextlib import contextmanager
from typing import Iterator

import torch


class UnsupportedConfig(Exception):
    """An implementation refuses a combination it does not support (raised by ``plan``, never mid-run).

    The message names the combination, e.g. ``triton_decode: layout 'nvfp4' with page size 7``.
    """


def reraise_interrupt(exc: BaseException) -> None:
    """Re-raise ``exc`` if it is the user's Ctrl-C (KeyboardInterrupt). Callers catch BaseException around an impl's
    code and contain everything else as that impl's result: ``sys.exit``, GeneratorExit and an impl's own
    BaseException subclasses ended the whole run, losing every result."""
    if isinstance(exc, KeyboardInterrupt):
        raise exc


def describe(value: object) -> str:
    """A tensor's dtype and shape, or the type of anything else, for error messages."""
    return f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def given(**values: object) -> dict[str, object]:
    """The entries of ``values`` that are not None: the optional tensors (outputs, visible lengths) a caller passed,
    for the checks that take every tensor they name."""
    return {name: value for name, value in values.items() if value is not None}


def check_tensors(who: str, meta_ok: bool = False, **tensors: object) -> None:
    """ValueError, prefixed ``who`` (when given), naming each of ``tensors`` that is not a torch.Tensor or, unless
    ``meta_ok`` (a later placement check names it), lies on the meta device, which holds no values (checks that read
    values failed deep inside torch). Host-only: no sync."""
    problems = [f"{name} must be a torch.Tensor, got {type(t).__name__}" if not isinstance(t, torch.Tensor)
                else f"{name} is on the meta device, which holds no values"
                for name, t in tensors.items() if not isinstance(t, torch.Tensor) or (t.is_meta and not meta_ok)]
    if problems:
        raise ValueError(f"{who}: " * bool(who) + "; ".join(problems))


def repeated(values: list) -> object | None:
    """The first of ``values`` given more than once (None when each is given once): options that name things."""
    return next((value for i, value in enumerate(values) if value in values[:i]), None)


@contextmanager
def about_flag(flag: str) -> Iterator[None]:
    """Prefix the message of an error raised inside with ``flag``, the command-line option whose value it refuses
    (registries and checks name the value, not the flag), unless the message names the flag already."""
    try:
        yield
    except Exception as exc:
        if len(exc.args) == 1 and isinstance(exc.args[0], str) and flag not in exc.args[0]:
            exc.args = (f"{flag}: {exc.args[0]}",)
        raise
