"""pytest plugin (entry point ``pytest11``): registers the bench's marks."""

from __future__ import annotations

MARKS = {
    "conformance": "conformance checks of an impl against the float64 reference",
    "decode": "dense decode path",
    "prefill": "prefill path",
    "sparse": "sparse top-k path",
    "chunked": "chunked prefill path",
    "dcp": "decode context parallel",
    "fp8": "FP8 cache layouts",
    "fp4": "FP4 cache layouts",
    "roundtrip": "cache layout roundtrips",
    "metadata": "paged metadata builders",
    "gpu": "needs a CUDA GPU",
    "slow": "slow; not part of the CI run",
}


def pytest_configure(config) -> None:
    for name, text in MARKS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
