"""What to compute: a request mix, the MLA path, the cache layout and the run parameters.

A ``Workload`` is a frozen, validated, hashable record. It prints as one line
(``decode deepseek-v3-tp8 h16 b32 q1 ctx4096 ps64 bf16``) and round-trips through JSON.
Per request, ``kv_lens`` counts every key the queries may see (context plus the new tokens, vLLM's
``seq_lens``); query ``i`` of a request sees keys ``j <= kv_len - q_len + i``. A request with
``kv_len == 0`` is padding: its rows attend nothing and give out 0, lse -inf.

``cache_device`` says where the paged cache lives: None (the default) with the queries on the problem's device,
or a device type ("cpu": host memory, the queries and outputs on the GPU). Left unset it appears neither in the
label nor in the JSON, so existing workloads keep their labels and keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from mla_bench.dims import MLADims, get_preset
from mla_bench.lengths import check_int, check_lengths


class Mode(str, Enum):
    """The MLA paths the bench knows."""

    DECODE = "decode"                    # absorbed MQA over the paged latent cache
    PREFILL = "prefill"                  # compute-friendly MHA (qk 192, v 128) over a ragged batch
    CHUNKED_PREFILL = "chunked_prefill"  # MHA over new tokens plus paged context in chunks of MCC tokens
    SPARSE_DECODE = "sparse_decode"      # absorbed MQA over per-token top-k cache positions
    SPARSE_PREFILL = "sparse_prefill"    # the same with many query tokens per request
    DCP = "dcp"                          # absorbed decode with the KV sharded over ranks

    @property
    def absorbed(self) -> bool:
        """True where queries are 576-wide and attend the latent cache directly."""
        return self in (Mode.DECODE, Mode.SPARSE_DECODE, Mode.SPARSE_PREFILL, Mode.DCP)

    @property
    def sparse(self) -> bool:
        return self in (Mode.SPARSE_DECODE, Mode.SPARSE_PREFILL)

    @property
    def uses_cache(self) -> bool:
        """True where keys come from the paged cache (prefill takes its keys as plain tensors)."""
        return self is not Mode.PREFILL


INDEX_TRANSFORMS = ("paged", "ragged")
DTYPES = ("bfloat16", "float16", "float32")
DEVICE_TYPES = ("cpu", "cuda")
DEFAULT_PAGE_SIZE = 64
INT32_MAX = 2 ** 31 - 1  # the metadata's offsets and lengths are int32
SEED_LIMIT = 2 ** 32  # torch's CPU generator keeps a seed's low 32 bits: s and s + 2**32 give the same inputs


def derive_seed(seed: int, offset: int, stride: int = 1) -> int:
    """``seed * stride + offset`` wrapped into [0, 2**32): one of a family of seeds drawn from a workload's seed
    (the DCP shards' page tables, the roundtrip suite's values). The generator kept only the low 32 bits of the plain
    sum before, so every family keeps its inputs. Offsets below 2**32 give distinct seeds, hence distinct inputs; a
    ``stride`` keeps consecutive seeds' families apart (offsets below it never reach the next seed's)."""
    return (seed * stride + offset) % SEED_LIMIT


def query_len_kind(q_lens: tuple[int, ...]) -> str:
    """``single`` (all 1), ``uniform`` (all equal, > 1: MTP / speculative) or ``varlen``."""
    if all(q == 1 for q in q_lens):
        return "single"
    if len(set(q_lens)) == 1:
        return "uniform"
    return "varlen"


def _span(values: tuple[int, ...]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


@dataclass(frozen=True)
class Workload:
    """A request mix on one MLA path, validated on construction."""

    mode: Mode
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    preset: str = "tiny"
    num_heads: int | None = None
    layout: str = "bf16"
    page_size: int = DEFAULT_PAGE_SIZE
    dtype: str = "bfloat16"
    topk: int | None = None
    index_transform: str | None = None
    dcp_world: int = 1
    dcp_interleave: int = 1
    chunk_size: int | None = None
    seed: int = 0
    cache_device: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _parse_mode(self.mode))
        q_lens, kv_lens = check_lengths(self.q_lens, self.kv_lens)
        object.__setattr__(self, "q_lens", q_lens)
        object.__setattr__(self, "kv_lens", kv_lens)
        if self.mode.sparse and self.index_transform is None:
            object.__setattr__(self, "index_transform", "paged")
        self._validate()

    # ---- validation -------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        from mla_bench.layouts import get_layout  # local: layouts import nothing from here, keep it that way

        _look_up("preset", self.preset, get_preset)
        if not self.q_lens:
            raise ValueError("a workload needs at least one request (q_lens and kv_lens are empty)")
        for i, (q, kv) in enumerate(zip(self.q_lens, self.kv_lens)):
            if kv == 0 and q > 0 and not self.mode.absorbed:
                raise ValueError(f"request {i}: mode {self.mode.value} needs the new tokens as keys, "
                                 f"so q_len={q} needs kv_len >= {q}, got 0")
        if sum(self.q_lens) == 0:
            raise ValueError("a workload needs at least one query token (every q_len is 0)")
        if max(self.total_q, self.total_kv) > INT32_MAX:  # build_problem failed on the overflow
            raise ValueError(f"the requests' {self.total_q} query and {self.total_kv} cached tokens must each fit the "
                             f"metadata's int32 offsets (at most {INT32_MAX})")
        if self.num_heads is not None:
            self._count("num_heads")
        _look_up("cache layout", self.layout, get_layout)
        self._count("page_size")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        seed = check_int("seed", self.seed, 0)
        if seed >= SEED_LIMIT:
            raise ValueError(f"seed must be an int >= 0 and < 2**32 (torch's generator keeps a seed's low 32 bits, "
                             f"so larger seeds repeat smaller ones' inputs), got {seed!r}")
        object.__setattr__(self, "seed", seed)
        if self.cache_device not in (None, *DEVICE_TYPES):
            raise ValueError(f"cache_device must be None or one of {DEVICE_TYPES}, got {self.cache_device!r}")
        if self.cache_device is not None and not self.mode.uses_cache:
            raise ValueError(f"cache_device is only for modes that read the cache, not {self.mode.value}")
        self._validate_mode_fields()

    def _validate_mode_fields(self) -> None:
        mode = self.mode
        if mode.sparse:
            if self.topk is None:
                raise ValueError(f"mode {mode.value} needs topk")
            self._count("topk")
            if self.topk > max(self.kv_lens):
                raise ValueError(f"topk={self.topk} is larger than the longest context ({max(self.kv_lens)})")
            if self.index_transform not in INDEX_TRANSFORMS:
                raise ValueError(f"index_transform must be one of {INDEX_TRANSFORMS}, got {self.index_transform!r}")
        else:
            if self.topk is not None:
                raise ValueError(f"topk is only for sparse modes, not {mode.value}")
            if self.index_transform is not None:
                raise ValueError(f"index_transform is only for sparse modes, not {mode.value}")
        self._count("dcp_world")  # in every mode: a numpy 1 outside DCP was kept, and the label failed to serialize
        self._count("dcp_interleave")
        if mode is not Mode.DCP and (self.dcp_world, self.dcp_interleave) != (1, 1):
            raise ValueError(f"dcp_world / dcp_interleave are only for mode dcp, not {mode.value}")
        if mode is Mode.CHUNKED_PREFILL:
            if self.chunk_size is None:
                raise ValueError("mode chunked_prefill needs chunk_size (MCC, tokens per context chunk)")
            self._count("chunk_size")
        elif self.chunk_size is not None:
            raise ValueError(f"chunk_size is only for mode chunked_prefill, not {mode.value}")
        if mode is Mode.PREFILL and self.layout != "bf16":
            raise ValueError("mode prefill takes its keys as tensors, not from a cache: leave layout at 'bf16'")

    def _count(self, name: str) -> None:
        """Field ``name`` checked as a positive int and stored as a Python int: numpy ints too, as the lengths take
        them (a numpy field would not serialize)."""
        object.__setattr__(self, name, check_int(name, getattr(self, name), 1))

    # ---- derived ----------------------------------------------------------------------------------------------
    @property
    def dims(self) -> MLADims:
        dims = get_preset(self.preset)
        return dims if self.num_heads is None else dims.with_heads(self.num_heads)

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def total_kv(self) -> int:
        return sum(self.kv_lens)

    @property
    def query_len_kind(self) -> str:
        return query_len_kind(self.q_lens)

    @property
    def cache_bytes(self) -> int:
        """The bytes of the paged cache ``build_problem`` makes (whole pages: each request's and the pool's spares);
        0 for modes that read no cache."""
        if not self.mode.uses_cache:
            return 0
        from mla_bench.layouts import get_layout  # local, as in _validate
        from mla_bench.metadata.reference import SPARE_BLOCKS, blocks_needed

        pages = sum(blocks_needed(n, self.page_size) for n in self.kv_lens) + SPARE_BLOCKS
        return pages * self.page_size * get_layout(self.layout).bytes_per_token

    @property
    def label(self) -> str:
        """One readable line; a digest disambiguates mixes that share their length spans."""
        parts = [self.mode.value, self.preset, f"h{self.dims.num_heads}", f"b{self.batch}",
                 f"q{_span(self.q_lens)}", f"ctx{_span(self.kv_lens)}"]
        if self.mode.uses_cache:
            parts += [f"ps{self.page_size}", self.layout]
        elif self.page_size != DEFAULT_PAGE_SIZE:  # prefill reads no cache, but its page size shapes its inputs
            parts.append(f"ps{self.page_size}")
        if self.dtype != "bfloat16":
            parts.append(self.dtype)
        if self.mode.sparse:
            parts.append(f"topk{self.topk} {self.index_transform}")
        if self.mode is Mode.DCP:
            parts.append(f"W{self.dcp_world} I{self.dcp_interleave}")
        if self.mode is Mode.CHUNKED_PREFILL:
            parts.append(f"mcc{self.chunk_size}")
        if self.seed:
            parts.append(f"seed{self.seed}")
        if self.cache_device:
            parts.append(f"cache-{self.cache_device}")
        if len(set(self.q_lens)) > 1 or len(set(self.kv_lens)) > 1:
            parts.append("#" + self.key[:6])
        return " ".join(parts)

    @property
    def key(self) -> str:
        """A stable digest of the whole record (same on every machine)."""
        return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def __str__(self) -> str:
        return self.label

    # ---- construction and serialization -------------------------------------------------------------------------
    @classmethod
    def uniform(cls, mode: Mode | str, batch: int, q_len: int, kv_len: int, **fields: Any) -> "Workload":
        """``batch`` identical requests."""
        batch = check_int("batch", batch, 1)
        return cls(mode=mode, q_lens=(q_len,) * batch, kv_lens=(kv_len,) * batch, **fields)

    def replace(self, **changes: Any) -> "Workload":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["mode"] = self.mode.value
        data["q_lens"] = list(self.q_lens)
        data["kv_lens"] = list(self.kv_lens)
        if self.cache_device is None:
            del data["cache_device"]  # unset: the JSON (and so the key) of a workload stays as before the field
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "Workload":
        """Rebuild and re-validate a workload from JSON data; unknown or missing fields are errors."""
        if not isinstance(data, dict):
            raise ValueError(f"a workload must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown workload fields: {sorted(unknown)}")
        missing = {"mode", "q_lens", "kv_lens"} - set(data)
        if missing:
            raise ValueError(f"workload is missing fields: {sorted(missing)}")
        return cls(**data)


def _parse_mode(mode: Any) -> Mode:
    try:
        return Mode(mode)
    except ValueError:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(m.value for m in Mode)}") from None


def _look_up(kind: str, name: Any, lookup: Callable[[str], Any]) -> None:
    """``lookup(name)`` (a preset or layout registry); a name that is not a string, such as ``["tiny"]`` from JSON,
    is refused as unknown too, instead of failing the registry's dict look-up with ``TypeError: unhashable``."""
    if not isinstance(name, str):
        raise ValueError(f"unknown {kind} {name!r}: a {kind} is named by a string")
    lookup(name)
