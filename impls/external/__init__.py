"""Adapters to third-party MLA kernels (vLLM, FlashInfer, FlashMLA), loaded lazily.

Each adapter imports its package when instantiated; when the package is absent it raises ``ImplNotInstalled``,
so ``mla-bench list`` shows it as not installed and the suites skip it with that reason. Each declares the
conventions its kernel returns (lse base, empty-row lse) in its Capabilities; the bench normalizes them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mla_bench.registry import ImplNotInstalled


def require(*modules: str, hint: str) -> ModuleType:
    """The first of ``modules`` that imports, or ``ImplNotInstalled`` naming them and how to install."""
    errors = []
    for name in modules:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImplNotInstalled(f"{hint} ({'; '.join(errors)})")
