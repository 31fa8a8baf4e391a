"""Errors the bench raises on purpose, so callers can tell a refusal from a failure."""


class UnsupportedConfig(Exception):
    """An implementation refuses a combination it does not support (raised by ``plan``, never mid-run).

    The message names the combination, e.g. ``triton_decode: layout 'nvfp4' with page size 7``.
    """
