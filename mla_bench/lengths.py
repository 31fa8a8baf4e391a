"""Per-request lengths (``q_lens``, ``kv_lens``): the one rule set that ``Workload``, the reference and the Triton
decode plan check them by, so that a request mix one of them takes is not refused, or rounded, by another.

The rules: as many kv_lens as q_lens, each an integer of any type ``operator.index`` takes (Python or numpy ints;
not bools, floats or strings), none negative, and no query longer than its context unless the caller allows it
(a DCP shard holds only part of a request's keys: ``visible_lens`` says which each query sees). A request with
kv_len 0 is padding and may carry queries. What only one caller needs (a nonempty batch, a mode's own rules,
the block table's capacity) stays with that caller.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Mapping
from typing import Any

import torch


def check_lengths(q_lens: Any, kv_lens: Any,
                  queries_may_exceed_keys: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``q_lens`` and ``kv_lens`` as tuples of Python ints, checked by the rules above: ValueError naming the
    request and its values."""
    q_lens, kv_lens = _ints("q_lens", q_lens), _ints("kv_lens", kv_lens)
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"q_lens has {len(q_lens)} requests but kv_lens has {len(kv_lens)}")
    for i, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        if q < 0 or kv < 0:
            raise ValueError(f"request {i}: lengths must be >= 0, got q_len={q}, kv_len={kv}")
        if q > kv > 0 and not queries_may_exceed_keys:
            raise ValueError(f"request {i}: query longer than context (q_len={q} > kv_len={kv})")
    return q_lens, kv_lens


def check_kv_lens(kv_lens: Any) -> tuple[int, ...]:
    """``kv_lens`` alone (no queries to match) as a tuple of Python ints, each an int >= 0: ValueError naming the
    request."""
    kv_lens = _ints("kv_lens", kv_lens)
    for i, kv in enumerate(kv_lens):
        if kv < 0:
            raise ValueError(f"request {i}: kv_len must be >= 0, got {kv}")
    return kv_lens


def check_page_size(page_size: Any) -> None:
    """ValueError unless ``page_size`` is a positive int (Python or numpy; a page size of 0 would divide by zero
    deep inside)."""
    check_int("page_size", page_size, 1)


def check_int(name: str, value: Any, least: int | None = None) -> int:
    """``value`` as a Python int: ValueError naming ``name`` unless it is an int, Python or numpy as lengths are (not
    a bool, which Python counts as one, a float or a tensor), of at least ``least`` when given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (least is not None and value < least):
        kind = {None: "an int", 0: "an int >= 0", 1: "a positive int"}.get(least, f"an int >= {least}")
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return int(value)


def _ints(name: str, values: Any) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints; a bool, a float or a string is an error, not something to round."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a sequence of ints, got {values!r}")
    if isinstance(values, (set, frozenset, Mapping)):  # iteration order would pair q_lens with kv_lens
        raise ValueError(f"{name} must be a sequence of ints in request order, not a {type(values).__name__}: "
                         f"got {values!r}")
    if getattr(values, "ndim", 1) != 1:  # a 0-d tensor does not iterate, a 2-D one's 1-element rows passed as ints
        raise ValueError(f"{name} must be a sequence of ints in one dimension, got {values.ndim}: {values!r}")
    return tuple(_int(name, i, value) for i, value in enumerate(values))


def _int(name: str, index: int, value: Any) -> int:
    """Request ``index``'s entry of ``name`` as a Python int (``operator.index``, which takes ``True`` and a bool
    tensor's entries as 1: no)."""
    if not isinstance(value, bool) and getattr(value, "dtype", None) not in (bool, torch.bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"request {index}: {name} must hold ints, got {value!r}")
