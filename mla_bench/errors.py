"""Errors the bench raises on purpose, so callers can tell a refusal from a failure, and how messages name values."""

import torch


class UnsupportedConfig(Exception):
    """An implementation refuses a combination it does not support (raised by ``plan``, never mid-run).

    The message names the combination, e.g. ``triton_decode: layout 'nvfp4' with page size 7``.
    """


def describe(value: object) -> str:
    """A tensor's dtype and shape, or the type of anything else, for error messages."""
    return f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
