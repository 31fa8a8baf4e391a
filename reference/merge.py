"""``merge_attn_states``: combine two partial attentions over disjoint key sets by their LSE.

Conventions (MLA_FACTS.md): an lse of +inf (FlashMLA's empty row) counts as -inf; when both sides are
empty the result is out 0, lse -inf (never NaN). Inputs: out ``[T, H, D]``, lse ``[T, H]`` (natural log).
Whatever an empty part's out holds is ignored; anything else non-finite (an lse of NaN, a NaN or inf out where
the lse is finite) is refused rather than merged into a plausible answer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mla_bench.errors import check_tensors
from reference.checks import check_tensor


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of both key sets, in float64."""
    return merge_many([(out_a, lse_a), (out_b, lse_b)])


def merge_many(parts: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of partial ``(out, lse)`` results (the DCP combine is this over ranks), given as any
    iterable (a generator too)."""
    parts = list(parts)
    check_parts(parts)
    lses = torch.stack([_finite_or_neginf(lse.double()) for _, lse in parts])
    outs = torch.stack([out.double() for out, _ in parts])
    total = torch.logsumexp(lses, dim=0)
    empty = torch.isneginf(total)
    weights = torch.exp(lses - torch.where(empty, 0.0, total))
    weighted = torch.where(weights[..., None] > 0, weights[..., None] * outs, 0.0)
    out = torch.where(empty[..., None], 0.0, weighted.sum(dim=0))
    return out, total


def check_parts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """At least one part; every out ``[T, H, D]`` and lse ``[T, H]`` of part 0's shapes; no NaN lse, and a finite
    out wherever the lse is finite (an lse of -inf or +inf marks an empty part, whose out may hold anything)."""
    if len(parts) == 0:
        raise ValueError("merge: no parts to merge")
    first = parts[0][0]
    for i, (out, lse) in enumerate(parts):
        check_tensor(f"part {i} out", out, 3)  # part 0's first: ``first`` is a checked tensor from here on
        check_tensor(f"part {i} lse", lse, 2)
        check_tensors("merge", **{f"part {i} out": out, f"part {i} lse": lse})  # meta holds no values to check
        if out.shape != first.shape or lse.shape != first.shape[:-1]:
            raise ValueError(f"merge: shapes differ: part {i} has out {list(out.shape)}, lse {list(lse.shape)}; "
                             f"part 0 has out {list(first.shape)}, so every lse must be {list(first.shape[:-1])}")
        if bool(torch.isnan(lse).any()):
            raise ValueError(f"merge: part {i} lse holds NaN (only -inf or +inf may mark an empty row)")
        if not bool(torch.isfinite(out[torch.isfinite(lse)]).all()):
            raise ValueError(f"merge: part {i} out holds NaN or inf in a row whose lse is finite")


def _finite_or_neginf(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isposinf(lse), float("-inf"), lse)
