"""The record every suite produces: one ``Result`` per (suite, check, impl, workload); and the run file.

``metrics`` holds numbers only (error metrics with ``kernel.`` / ``e2e.`` prefixes, timing statistics,
counts); ``details`` holds small JSON-able extras (tolerances, tables); ``message`` the refusal reason,
violations or traceback. Results serialize to plain JSON and load back with validation.

A run file (``save_run`` / ``load_run``) is one versioned JSON object: format tag, version, environment, the
devices that ran it, device ceilings and every Result. It may come from anyone, so loading never uses pickle or
eval and checks every field's type; a corrupt or foreign file raises ``RunFileError``.
"""

from __future__ import annotations

import json
import math
import reprlib
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
    device: str | None = None    # the Device.id of the run's device that produced it; None: none did (a suite that
    #                              failed to load) or a run file of version 1

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Result.status must be one of {STATUSES}, got {self.status!r}")
        for name in ("suite", "check", "label", "message"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Result.{name} must be a string")
        for name in ("impl", "device"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"Result.{name} must be a string or null")
        if self.workload is not None and not isinstance(self.workload, dict):
            raise ValueError("Result.workload must be an object or null")
        if not isinstance(self.metrics, dict) or not isinstance(self.details, dict):
            raise ValueError("Result.metrics and Result.details must be objects")
        for key, value in self.metrics.items():
            if not isinstance(key, str) or not _is_number(value):
                raise ValueError(f"Result.metrics[{key!r}] must be a number (in a float's range), got "
                                 f"{reprlib.repr(value)}")

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "unsupported")

    @property
    def brief(self) -> str:
        """The message in one line for tables: its first line, followed by the exception (the last line) when a
        traceback follows it, so "suite X crashed:" still says what was raised."""
        lines = [line.strip() for line in self.message.strip().splitlines() if line.strip()]
        if not any(line.startswith("Traceback") for line in lines):
            return lines[0] if lines else ""
        return lines[-1] if lines[0].startswith("Traceback") else f"{lines[0]} {lines[-1]}"

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


@dataclass(frozen=True)
class Device:
    """A device that ran part of a run, as the run's results name it (``Result.device``).

    ``id`` is ``cuda:N`` (the host's GPU N, as ``--device`` and ``--devices`` number them) or ``cpu``; ``name`` the
    GPU's model, which keys the run's ceilings, and ``compute_capability`` its ``major.minor`` (both None for the
    CPU, and for a worker that died before it said).
    """

    id: str
    name: str | None = None
    compute_capability: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("Device.id must be a non-empty string")
        for name in ("name", "compute_capability"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"Device.{name} must be a string or null")

    @classmethod
    def from_dict(cls, data: Any) -> "Device":
        if not isinstance(data, dict):
            raise ValueError(f"a device must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown device fields: {sorted(unknown)}")
        return cls(**data)


# ---- run files ---------------------------------------------------------------------------------------------------
RUN_FORMAT = "mla-bench-run"
RUN_VERSION = 2
READ_VERSIONS = (1, 2)  # version 1: no devices, and results that do not say which device produced them


class RunFileError(ValueError):
    """A results file that is not a valid mla-bench run: corrupt, foreign, or of another version."""


@dataclass
class Run:
    """One run: where it ran (environment, and each device that ran part of it), the device ceilings measured
    during it, and its Results.

    ``ceilings`` maps a device name (``Device.name``: a GPU model) to its measured ``copy_gbps`` (read + write) and
    ``matmul_tflops`` (bf16).
    """

    environment: dict[str, Any]
    results: list[Result]
    ceilings: dict[str, dict[str, float]] = field(default_factory=dict)
    created: str = ""
    command: list[str] = field(default_factory=list)
    devices: list[Device] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"format": RUN_FORMAT, "version": RUN_VERSION, "created": self.created, "command": self.command,
                "environment": self.environment, "devices": [asdict(d) for d in self.devices],
                "ceilings": self.ceilings, "results": [r.to_dict() for r in self.results]}

    @classmethod
    def from_dict(cls, data: Any) -> "Run":
        """Validate and rebuild; every problem is a ``RunFileError`` saying where it is."""
        if not isinstance(data, dict):
            raise RunFileError(f"a run file holds a JSON object, got {type(data).__name__}")
        if data.get("format") != RUN_FORMAT:
            raise RunFileError(f"not an mla-bench run file (format is {data.get('format')!r}, "
                               f"expected {RUN_FORMAT!r})")
        if isinstance(data.get("version"), bool) or data.get("version") not in READ_VERSIONS:
            raise RunFileError(f"unsupported run file version {data.get('version')!r} (this mla-bench reads "
                               f"versions {', '.join(map(str, READ_VERSIONS))})")
        unknown = set(data) - {"format", "version", "created", "command", "environment", "devices", "ceilings",
                               "results"}
        if unknown:
            raise RunFileError(f"unknown top-level fields: {sorted(unknown)}")
        created, command = data.get("created", ""), data.get("command", [])
        if not isinstance(created, str):
            raise RunFileError("'created' must be a string")
        if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
            raise RunFileError("'command' must be a list of strings")
        environment = data.get("environment")
        if not isinstance(environment, dict) or not all(
                isinstance(v, (str, int, float, bool)) or v is None for v in environment.values()):
            raise RunFileError("'environment' must be an object of strings, numbers, booleans or nulls")
        devices = _parse_devices(data.get("devices", []))
        ceilings = _parse_ceilings(data.get("ceilings", {}))
        results = data.get("results")
        if not isinstance(results, list):
            raise RunFileError("'results' must be a list")
        parsed, known = [], {None} | {d.id for d in devices}
        for i, item in enumerate(results):
            try:
                parsed.append(Result.from_dict(item))
            except (TypeError, ValueError) as exc:
                raise RunFileError(f"results[{i}]: {exc}") from None
            if parsed[-1].device not in known:
                raise RunFileError(f"results[{i}]: device {parsed[-1].device!r} is not one of the run's 'devices'")
        return cls(environment=environment, results=parsed, ceilings=ceilings, created=created, command=command,
                   devices=devices)


def _parse_devices(value: Any) -> list[Device]:
    """The run's devices; ``RunFileError`` unless they are a list of device objects of distinct ids."""
    if not isinstance(value, list):
        raise RunFileError("'devices' must be a list")
    devices = []
    for i, item in enumerate(value):
        try:
            devices.append(Device.from_dict(item))
        except (TypeError, ValueError) as exc:
            raise RunFileError(f"devices[{i}]: {exc}") from None
    if len({d.id for d in devices}) < len(devices):
        raise RunFileError("'devices' names a device more than once")
    return devices


def _parse_ceilings(value: Any) -> dict[str, dict[str, float]]:
    """The ceilings with non-finite numbers (saved as strings) restored; ``RunFileError`` unless they map device
    names to objects of numbers."""
    if isinstance(value, dict) and all(isinstance(c, dict) for c in value.values()):
        decoded = {device: {k: _decode_number(v) for k, v in c.items()} for device, c in value.items()}
        if all(_is_number(v) for c in decoded.values() for v in c.values()):
            return decoded
    raise RunFileError("'ceilings' must map device names to objects of numbers")


def save_run(run: Run, path: str | Path) -> Path:
    """Write ``run`` as strict JSON (non-finite numbers become strings; ``load_run`` restores those of metrics and
    ceilings)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _json_safe(run.to_dict())
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    return path


def load_run(path: str | Path) -> Run:
    """Read and validate a run file; ``RunFileError`` (naming the file) when it is corrupt or foreign."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"{path}: cannot read ({exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise RunFileError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise RunFileError(f"{path}: not valid JSON (nested too deeply)") from None
    try:
        return Run.from_dict(data)
    except RunFileError as exc:
        raise RunFileError(f"{path}: {exc}") from None


def _is_number(value: Any) -> bool:
    """An int or float (not a bool) that converts to a float: JSON integers may be of any size."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, float) or abs(value) <= sys.float_info.max


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
