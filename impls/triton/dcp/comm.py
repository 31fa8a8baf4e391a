"""The collectives of DCP over heads, on a torch.distributed process group (gloo on CPU, NCCL on GPUs).

Heads split over ranks as ``tensor_split`` does (the first ``H % W`` ranks get one more), so ``W`` need not divide
``H``; each rank's slice is padded to the widest one so that every collective moves equal shapes. A rank's heads are
a contiguous ``slice``: indexing by it is a view, never an index tensor copied from the host, so a step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mla_bench.metadata.reference import cumulative


class HeadComm:
    def __init__(self, heads: int, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.sizes = [len(g) for g in torch.arange(heads).tensor_split(world)]
        bounds = cumulative(self.sizes)
        self.groups = [slice(start, end) for start, end in zip(bounds, bounds[1:])]
        self.width = max(self.sizes)

    @property
    def my_heads(self) -> slice:
        return self.groups[self.rank]

    def _padded(self, x: torch.Tensor, heads: slice) -> torch.Tensor:
        """``x[:, heads]`` (or ``x`` itself when it holds just those heads) padded with zeros to ``width`` heads."""
        count = heads.stop - heads.start
        out = torch.zeros(x.shape[0], self.width, *x.shape[2:], dtype=x.dtype, device=x.device)
        out[:, :count] = x[:, heads] if x.shape[1] != count else x
        return out

    def all_gather_heads(self, own: torch.Tensor) -> torch.Tensor:
        """Each rank's ``[T, own heads, D]`` -> everyone's ``[T, H, D]``."""
        padded = self._padded(own, self.my_heads)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:, :size] for part, size in zip(parts, self.sizes)], dim=1)

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
        return out[:, :self.sizes[self.rank]]
