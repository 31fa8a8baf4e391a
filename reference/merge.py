"""``merge_attn_states``: combine two partial attentions over disjoint key sets by their LSE.

Conventions (MLA_FACTS.md): an lse of +inf (FlashMLA's empty row) counts as -inf; when both sides are
empty the result is out 0, lse -inf (never NaN). Inputs: out ``[T, H, D]``, lse ``[T, H]`` (natural log).
"""

from __future__ import annotations

import torch


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of both key sets, in float64."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:-1]:
        raise ValueError(f"merge_attn_states: shapes differ: out {list(out_a.shape)} / {list(out_b.shape)}, "
                         f"lse {list(lse_a.shape)} / {list(lse_b.shape)}")
    return merge_many([(out_a, lse_a), (out_b, lse_b)])


def merge_many(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of partial ``(out, lse)`` results (the DCP combine is this over ranks)."""
    lses = torch.stack([_finite_or_neginf(lse.double()) for _, lse in parts])
    outs = torch.stack([out.double() for out, _ in parts])
    total = torch.logsumexp(lses, dim=0)
    empty = torch.isneginf(total)
    weights = torch.exp(lses - torch.where(empty, 0.0, total))
    weighted = torch.where(weights[..., None] > 0, weights[..., None] * outs, 0.0)
    out = torch.where(empty[..., None], 0.0, weighted.sum(dim=0))
    return out, total


def _finite_or_neginf(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isposinf(lse), float("-inf"), lse)
