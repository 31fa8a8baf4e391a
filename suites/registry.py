"""The suites ``mla-bench run --suite`` knows, named as ``module:Class`` strings and imported only when used.

A suite whose module is absent (not written yet, or not shipped) is ``not available``: ``load_suite`` raises
``SuiteNotAvailable`` naming it, and the runner reports that instead of crashing.
"""

from __future__ import annotations

import importlib

SUITES: dict[str, str] = {
    "accuracy": "suites.accuracy:AccuracySuite",
    "roundtrip": "suites.roundtrip:RoundtripSuite",
    "metadata": "suites.metadata:MetadataSuite",
    "equivalence": "suites.equivalence:EquivalenceSuite",
    "latency": "suites.latency:LatencySuite",
    "placement": "suites.placement:PlacementSuite",
}


class SuiteNotAvailable(Exception):
    """The suite's module or class does not exist in this installation."""


def load_suite(name: str):
    """An instance of the suite registered as ``name``."""
    try:
        target = SUITES[name]
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(SUITES)}") from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the suite exists but one of its own imports is missing: a real error, with its traceback
        raise SuiteNotAvailable(f"suite {name!r} is not available: module {module_name} does not exist") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise SuiteNotAvailable(f"suite {name!r} is not available: {module_name} has no {attr}")
    return cls()
