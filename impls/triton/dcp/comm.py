"""The collectives of DCP over heads, on a torch.distributed process group (gloo on CPU, NCCL on GPUs).

Heads split over ranks as ``tensor_split`` does (the first ``H % W`` ranks get one more), so ``W`` need not divide
``H``; each rank's slice is padded to the widest one so that every collective moves equal shapes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class HeadComm:
    def __init__(self, heads: int, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.groups = [g.tolist() for g in torch.arange(heads).tensor_split(world)]
        self.width = max(len(g) for g in self.groups)

    @property
    def my_heads(self) -> list[int]:
        return self.groups[self.rank]

    def _padded(self, x: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """``x[:, heads]`` padded with zeros to ``width`` heads, contiguous."""
        out = torch.zeros(x.shape[0], self.width, *x.shape[2:], dtype=x.dtype, device=x.device)
        out[:, :len(heads)] = x[:, heads] if x.shape[1] != len(heads) else x
        return out

    def all_gather_heads(self, own: torch.Tensor) -> torch.Tensor:
        """Each rank's ``[T, own heads, D]`` -> everyone's ``[T, H, D]``."""
        padded = self._padded(own, self.my_heads)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:, :len(heads)] for part, heads in zip(parts, self.groups)], dim=1)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[...]`` on each rank -> ``[W, ...]``."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def reduce_scatter_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``[T, H, D]`` over ranks; each rank keeps its heads ``[T, own heads, D]``."""
        inputs = [self._padded(x, heads) for heads in self.groups]
        out = torch.empty_like(inputs[0])
        dist.reduce_scatter(out, inputs, group=self.group)
        return out[:, :len(self.my_heads)]
