"""The record every suite produces: one ``Result`` per (suite, check, impl, workload).

``metrics`` holds numbers only (error metrics with ``kernel.`` / ``e2e.`` prefixes, timing statistics,
counts); ``details`` holds small JSON-able extras (tolerances, tables); ``message`` the refusal reason,
violations or traceback. Results serialize to plain JSON and load back with validation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("passed", "failed", "unsupported", "error")


@dataclass
class Result:
    suite: str                   # accuracy, roundtrip, metadata, equivalence, latency, placement
    check: str                   # what was checked, e.g. "accuracy", "roundtrip fp8_ds_mla", "max_qo_len"
    status: str                  # one of STATUSES
    impl: str | None = None      # None for checks of the bench's own parts (codecs, metadata builders)
    workload: dict[str, Any] | None = None  # Workload.to_dict()
    label: str = ""              # Workload.label, or a readable name of what was checked
    metrics: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Result.status must be one of {STATUSES}, got {self.status!r}")
        for name in ("suite", "check", "label", "message"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Result.{name} must be a string")
        if self.impl is not None and not isinstance(self.impl, str):
            raise ValueError("Result.impl must be a string or null")
        if self.workload is not None and not isinstance(self.workload, dict):
            raise ValueError("Result.workload must be an object or null")
        if not isinstance(self.metrics, dict) or not isinstance(self.details, dict):
            raise ValueError("Result.metrics and Result.details must be objects")
        for key, value in self.metrics.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"Result.metrics[{key!r}] must be a number, got {value!r}")

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "unsupported")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        # JSON has no NaN/Inf: store them as strings and restore on load.
        data["metrics"] = {k: _encode_number(v) for k, v in self.metrics.items()}
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "Result":
        if not isinstance(data, dict):
            raise ValueError(f"a result must be a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown result fields: {sorted(unknown)}")
        data = dict(data)
        metrics = data.get("metrics", {})
        if not isinstance(metrics, dict):
            raise ValueError("Result.metrics must be an object")
        data["metrics"] = {k: _decode_number(v) for k, v in metrics.items()}
        return cls(**data)


def _encode_number(value: float) -> float | str:
    return value if isinstance(value, int) or math.isfinite(value) else repr(float(value))


def _decode_number(value: Any) -> Any:
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value
