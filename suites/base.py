"""What a suite is: a named generator of Results over a run's context.

The runner builds one ``RunContext`` from the command line (or a test) and asks each selected suite for its
results; a suite never exits the process and never lets one impl's crash stop the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from mla_bench.registry import ImplEntry
from mla_bench.results import Result


@dataclass
class RunContext:
    """What the user asked for. Empty filters mean the suite's own defaults."""

    impls: list[ImplEntry]
    device: torch.device
    preset: str | None = None
    modes: list[str] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    page_sizes: list[int] = field(default_factory=list)
    seed: int = 0
    progress: Callable[[str], None] = lambda label: None  # called once per unit of work, for the progress bar


class Suite(Protocol):
    name: str

    def run(self, ctx: RunContext) -> Iterator[Result]:
        """Yield one Result per check."""
