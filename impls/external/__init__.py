"""Adapters to third-party MLA kernels (vLLM, FlashInfer, FlashMLA), loaded lazily.

Each adapter imports its package when instantiated; when the package is absent it raises ``ImplNotInstalled``,
so ``mla-bench list`` shows it as not installed and the suites skip it with that reason. A package that is there
but cannot be used (an extension built against another torch, a version without the module or names the adapter
calls) raises ``BrokenPackage`` instead: an error (``cannot load``), never a silent skip. Each declares the
conventions its kernel returns (lse base, empty-row lse) in its Capabilities; the bench normalizes them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

from mla_bench.registry import ImplNotInstalled, module_not_found


class BrokenPackage(RuntimeError):
    """A third-party package that is installed but fails to import or lacks what its adapter calls."""


def installed(package: str) -> str:
    """``package`` with the distributions that provide it and their versions, where the metadata says."""
    found = []
    for dist in dict.fromkeys(importlib.metadata.packages_distributions().get(package, [])):
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(dist)
    return f"{package} ({', '.join(found)})" if found else f"{package} (version unknown)"


def _broken(package: str, what: str, exc: BaseException) -> BrokenPackage:
    """The error naming ``package``, its version, what failed and ``exc``."""
    return BrokenPackage(f"{installed(package)} is installed but {what}: {type(exc).__name__}: {exc}")


def require(*modules: str, names: tuple[str, ...] = (), hint: str) -> ModuleType:
    """The first of ``modules`` (one package's alternative paths) that exists, checked to have ``names``.

    ``ImplNotInstalled`` (with ``hint``) when the package is absent; ``BrokenPackage`` naming it, its version and
    the cause (chained) when it is installed but the module fails to import, is in none of the paths, or lacks a name.
    """
    package = modules[0].split(".")[0]
    failures: list[ImportError] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if not module_not_found(exc, name):
                raise _broken(package, f"importing {name} raised", exc) from exc
            if exc.name == package:
                raise ImplNotInstalled(f"{hint} ({name}: {exc})") from exc
            failures.append(exc)
        except Exception as exc:  # noqa: BLE001 - any failure of an installed package is named, with its version
            raise _broken(package, f"importing {name} raised", exc) from exc
        else:
            for attr in names:
                try:
                    getattr(module, attr)
                except AttributeError as exc:
                    raise _broken(package, f"{name} lacks {attr!r}, which the adapter calls", exc) from exc
            return module
    tried = "; ".join(f"{name}: {exc}" for name, exc in zip(modules, failures))
    raise BrokenPackage(f"{installed(package)} is installed but has none of the modules the adapter imports "
                        f"({tried})") from failures[-1]
