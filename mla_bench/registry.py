"""Implementations: the ``Impl`` interface, declared ``Capabilities``, and discovery.

An impl declares what it supports; everything else is refused *before* its code runs, with an
``UnsupportedConfig`` naming the combination: every subclass's ``plan`` is wrapped (``Impl.__init_subclass__``)
so that it checks the declared capabilities first, whoever calls it (the runner, a test, a user). ``plan(problem)``
does the per-step host work (metadata, workspaces) and may refuse finer conditions itself; ``run(plan)``
computes ``(out, lse)``. The two are timed separately.

Discovery: the built-in impls below (named as ``module:Class`` strings, so this module imports none of them),
plus any distribution that registers an entry point in the group ``mla_bench.impls``, plus any
``module:Class`` a user names directly.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch

from mla_bench.compare import EMPTY_LSE, LSE_BASES
from mla_bench.errors import UnsupportedConfig, repeated, reraise_interrupt
from mla_bench.layouts import LAYOUTS
from mla_bench.process_state import ProcessState
from mla_bench.workload import DEVICE_TYPES, DTYPES, INDEX_TRANSFORMS, Mode, Workload

ENTRY_POINT_GROUP = "mla_bench.impls"
QUERY_LEN_KINDS = ("single", "uniform", "varlen")

BUILTIN_IMPLS: dict[str, str] = {
    "torch_eager": "impls.torch_eager:TorchEager",
    "torch_eager_host_cache": "impls.torch_eager:TorchEagerHostCache",
    "triton_decode": "impls.triton.decode:TritonDecode",
    "triton_prefill": "impls.triton.prefill:TritonPrefill",
    "triton_chunked_prefill": "impls.triton.chunked:TritonChunkedPrefill",
    "triton_sparse": "impls.triton.sparse:TritonSparse",
    "triton_sparse_ragged": "impls.triton.sparse:TritonSparseRagged",
    "triton_dcp": "impls.triton.dcp.impl:TritonDcp",
    "vllm_triton_mla": "impls.external.vllm_triton:VllmTritonMLA",
    "flashinfer_mla": "impls.external.flashinfer_mla:FlashInferMLA",
    "flashmla": "impls.external.flash_mla:FlashMLA",
    "flashmla_sparse": "impls.external.flash_mla:FlashMLASparsePrefill",
}


@dataclass(frozen=True)
class Capabilities:
    """What an impl supports, and the conventions of what it returns.

    ``page_sizes`` / ``head_counts`` of None mean any. ``lse_base`` is the base of the returned lse ("e" or "2");
    ``empty_lse`` what it returns for a row that sees no key ("-inf", or FlashMLA's "+inf").

    Placement: ``cache_devices`` are the device types the paged cache may live on (None: only with the queries,
    on the problem's device); ``attention_device`` is where attention runs (None: on the problem's device;
    "cpu": on the host, whatever the problem's device). ``graph_safe`` promises that ``run`` neither synchronizes
    the host nor allocates (outputs and workspaces come from ``plan``), so it can be captured in a CUDA graph;
    the placement suite checks it.
    """

    modes: frozenset[Mode]
    layouts: frozenset[str] = frozenset({"bf16"})
    dtypes: frozenset[str] = frozenset({"bfloat16"})
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    page_sizes: frozenset[int] | None = None
    head_counts: frozenset[int] | None = None
    query_len_kinds: frozenset[str] = frozenset(QUERY_LEN_KINDS)
    index_transforms: frozenset[str] = frozenset(INDEX_TRANSFORMS)
    lse_base: str = "e"
    empty_lse: str = "-inf"
    cache_devices: frozenset[str] | None = None
    attention_device: str | None = None
    graph_safe: bool = False

    def __post_init__(self) -> None:
        for name in ("modes", "layouts", "dtypes", "devices", "page_sizes", "head_counts", "query_len_kinds",
                     "index_transforms", "cache_devices"):
            value = getattr(self, name)
            if value is not None:  # a set of values: a string would match its substrings, an int nothing
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise ValueError(f"Capabilities.{name} must be a set of values, got {value!r}")
                object.__setattr__(self, name, frozenset(value))
        object.__setattr__(self, "modes", frozenset(Mode(m) for m in self.modes))
        if not self.modes:
            raise ValueError("Capabilities.modes is empty: an impl declares at least one mode it runs")
        for name, allowed in (("layouts", tuple(LAYOUTS)), ("dtypes", DTYPES), ("devices", DEVICE_TYPES),
                              ("query_len_kinds", QUERY_LEN_KINDS), ("index_transforms", INDEX_TRANSFORMS)):
            unknown = set(getattr(self, name)) - set(allowed)
            if unknown:  # a misspelt value would make every workload needing it "unsupported", silently
                raise ValueError(f"Capabilities.{name}: unknown values {sorted(unknown)}; allowed {allowed}")
        consulted = ["dtypes", "devices", "head_counts", "query_len_kinds"]
        consulted += ["layouts", "page_sizes"] if any(m.uses_cache for m in self.modes) else []
        consulted += ["index_transforms"] if any(m.sparse for m in self.modes) else []
        for name in consulted:  # an empty set refuses every workload of a declared mode, silently
            if getattr(self, name) == frozenset():
                raise ValueError(f"Capabilities.{name} is empty: it refuses every workload of the modes declared")
        for name in ("page_sizes", "head_counts"):
            bad = [v for v in getattr(self, name) or () if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if bad:
                raise ValueError(f"Capabilities.{name} must hold positive ints, got {sorted(map(repr, bad))}")
        if self.lse_base not in LSE_BASES:
            raise ValueError(f"Capabilities.lse_base must be one of {LSE_BASES}, got {self.lse_base!r}")
        if self.empty_lse not in EMPTY_LSE:
            raise ValueError(f"Capabilities.empty_lse must be one of {EMPTY_LSE}, got {self.empty_lse!r}")
        if self.cache_devices is not None and not self.cache_devices <= set(DEVICE_TYPES):
            raise ValueError(f"Capabilities.cache_devices: unknown values {sorted(set(self.cache_devices))}; "
                             f"allowed {DEVICE_TYPES}")
        if self.attention_device not in (None, *DEVICE_TYPES):
            raise ValueError(f"Capabilities.attention_device must be None or one of {DEVICE_TYPES}, "
                             f"got {self.attention_device!r}")

    def refusal(self, workload: Workload, device: torch.device | str) -> str | None:
        """Why this workload on this device is not supported, or None when it is."""
        device_type = torch.device(device).type
        checks = [
            (workload.mode in self.modes, f"mode {workload.mode.value}"),
            (device_type in self.devices, f"device {device_type}"),
            (workload.dtype in self.dtypes, f"dtype {workload.dtype}"),
            (self.head_counts is None or workload.dims.num_heads in self.head_counts,
             f"{workload.dims.num_heads} heads"),
            (workload.query_len_kind in self.query_len_kinds, f"{workload.query_len_kind} query lengths"),
        ]
        if workload.mode.uses_cache:
            cache_type = workload.cache_device or device_type
            checks += [
                (workload.layout in self.layouts, f"layout {workload.layout}"),
                (self.page_sizes is None or workload.page_size in self.page_sizes, f"page size {workload.page_size}"),
                (cache_type == device_type if self.cache_devices is None else cache_type in self.cache_devices,
                 f"cache on {cache_type} with queries on {device_type}"),
            ]
        if workload.mode.sparse:
            checks.append((workload.index_transform in self.index_transforms,
                           f"index transform {workload.index_transform}"))
        unsupported = [what for ok, what in checks if not ok]
        return ", ".join(unsupported) if unsupported else None

    def summary(self) -> dict[str, str]:
        """Readable columns for ``mla-bench list``."""
        def names(values: Any) -> str:
            return "any" if values is None else ", ".join(str(v.value if isinstance(v, Mode) else v)
                                                          for v in sorted(values, key=str))
        return {"modes": names(self.modes), "layouts": names(self.layouts), "dtypes": names(self.dtypes),
                "devices": names(self.devices), "page sizes": names(self.page_sizes),
                "heads": names(self.head_counts), "query lengths": names(self.query_len_kinds),
                "lse": f"base {self.lse_base}, empty {self.empty_lse}", "placement": self.placement()}

    def placement(self) -> str:
        """Where the cache lives and where attention runs, in words (for ``mla-bench list``)."""
        cache = "with the queries" if self.cache_devices is None else "on " + ", ".join(sorted(self.cache_devices))
        text = f"cache {cache}, attention on {self.attention_device or 'the device'}"
        return text + (", graph-safe" if self.graph_safe else "")


class Impl(ABC):
    """An MLA implementation under test. Subclasses set ``name``, ``capabilities`` and write ``plan`` / ``run``."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's own ``plan`` is wrapped to refuse a problem outside the declared capabilities before its
        body runs: called directly, an impl would otherwise compute whatever its code does with an input it never
        claimed (a dense decode given a sparse problem answers without the top-k, silently)."""
        super().__init_subclass__(**kwargs)
        if not getattr(cls.plan, "checks_capabilities", False):  # its own plan, or one from a mixin
            cls.plan = _refusing_undeclared(cls.plan)

    @abstractmethod
    def plan(self, problem: Any) -> Any:
        """Per-step host work for ``problem`` (metadata, workspaces). Raise ``UnsupportedConfig`` to refuse."""

    @abstractmethod
    def run(self, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute ``(out, lse)`` for a plan made by ``plan``."""

    def poison(self, plan: Any) -> None:
        """Fill the buffers ``run`` writes into with NaN, so unwritten elements show. Impls that allocate their
        outputs in ``plan`` (CUDA-graph safe ones) override this; the others allocate fresh outputs in ``run``."""

    def refusal(self, problem: Any) -> str | None:
        """Why ``problem`` is out of this impl's declared capabilities, or None."""
        return self.capabilities.refusal(problem.workload, problem.device)

    def refuse_undeclared(self, problem: Any) -> None:
        """UnsupportedConfig naming why ``problem`` is out of the declared capabilities (plan's own first check)."""
        reason = self.refusal(problem)
        if reason:
            raise UnsupportedConfig(f"{self.name}: unsupported {reason} ({problem.workload.label})")


def _refusing_undeclared(plan: Any) -> Any:
    """``plan`` behind the capability check (see ``Impl.__init_subclass__``)."""
    @functools.wraps(plan)
    def checked(self: Impl, problem: Any) -> Any:
        self.refuse_undeclared(problem)
        return plan(self, problem)
    checked.checks_capabilities = True
    return checked


class ImplNotInstalled(Exception):
    """An impl whose package is absent (a third-party kernel): listed, and skipped with this reason."""


@dataclass
class ImplEntry:
    """One discoverable impl: its name, where it comes from, and how to load it."""

    name: str
    target: str  # "module:Class"
    origin: str  # "builtin", "entry point (dist)", or "path"
    _cls: type[Impl] | None = field(default=None, repr=False)
    conflict: str = ""  # set where other targets are registered under this name: loading it is then an error

    def load(self) -> Impl:
        """Import and instantiate; ``ImplNotInstalled`` when the impl's own dependency is missing, ValueError when
        its name is registered twice or its class has another name (its results would carry that one)."""
        if self.conflict:
            raise ValueError(self.conflict)
        if self._cls is None:
            cls = load_class(self.target)
            if cls.name != self.name:
                raise ValueError(f"{self.target} is registered as {self.name!r} but its class is named {cls.name!r}: "
                                 f"its results would carry another name; register it as {cls.name!r}")
            self._cls = cls
        with _left_alone(self.target, "making it"):
            return self._cls()


PROJECT_PACKAGES = ("mla_bench", "impls", "reference", "suites")


def _missing_dependency(exc: ImportError, module_name: str) -> bool:
    """Whether an ImportError raised importing ``module_name`` says a package is absent (the module itself, or a
    third-party package it needs), rather than that a name is missing from the project's or the impl's own code
    (a typo, which must show as an error, not as "not installed")."""
    missing = exc.name
    if missing is None:
        return True  # raised by hand to say a dependency is absent
    if _is_or_contains(missing, module_name):
        # the impl's module or a package above it is not there at all; a plain ImportError naming one of them is a
        # name missing from it ("cannot import name ... from 'mypkg'") or a circular import: the impl's own code
        return module_not_found(exc, module_name)
    return missing.split(".")[0] not in {*PROJECT_PACKAGES, module_name.split(".")[0]}


def module_not_found(exc: ImportError, module_name: str) -> bool:
    """Whether ``exc``, raised importing ``module_name``, says that module or a package above it does not exist
    (rather than that something inside an existing one failed to import)."""
    return isinstance(exc, ModuleNotFoundError) and exc.name is not None and _is_or_contains(exc.name, module_name)


def _is_or_contains(package: str, module_name: str) -> bool:
    return module_name == package or module_name.startswith(package + ".")


def _broken(target: str, module_name: str, exc: BaseException, why: str = "") -> ValueError:
    """The error of an impl whose module raised ``exc`` on import, with the trace."""
    return ValueError(f"{target}: importing {module_name} raised {type(exc).__name__}: {exc}{why}\n"
                      f"{''.join(traceback.format_exception(exc))}")


@contextlib.contextmanager
def _left_alone(target: str, doing: str) -> Iterator[None]:
    """Around an impl's import or construction (``doing``): the process's settings (``process_state``), which every
    impl shares, are put back however it ends (a constructor that changed them and then raised left them changed),
    and a ValueError names what it changed when it ended normally."""
    state = ProcessState.now()
    try:
        yield
    except BaseException:
        state.restore()
        raise
    changed = state.restore()
    if changed:
        raise ValueError(f"{target}: {doing} changed the settings every impl of the process shares: "
                         f"{'; '.join(changed)} (put back; an impl must leave them as it found them)")


def load_class(target: str) -> type[Impl]:
    """Import ``module:Class`` and check that it is an Impl with a ``name`` and ``Capabilities``. ValueError names
    what is wrong (also an exception other than ImportError raised while importing the module)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"an impl target is 'module:Class', got {target!r}")
    with _left_alone(target, f"importing {module_name}"):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if _missing_dependency(exc, module_name):
                raise ImplNotInstalled(f"{target}: cannot import {module_name} ({exc})") from exc
            raise _broken(target, module_name, exc, " (a name missing from the impl's own code or the project's, "
                                                     "not an absent package)") from exc
        except BaseException as exc:  # noqa: BLE001 - the impl's module is broken (sys.exit too): a refusal that
            reraise_interrupt(exc)  # says so, with the trace, not the caller's end
            raise _broken(target, module_name, exc) from exc
    if not hasattr(module, attr):
        raise ValueError(f"{target}: module {module_name} has no attribute {attr!r}")
    cls = getattr(module, attr)
    if not (isinstance(cls, type) and issubclass(cls, Impl)):
        raise ValueError(f"{target} is not an Impl subclass")
    name = getattr(cls, "name", None)
    if not (isinstance(name, str) and name):
        raise ValueError(f"{target}: the class attribute 'name' must be a non-empty string")
    if name != name.strip() or not name.isprintable() or "," in name or name == "all":
        raise ValueError(f"{target}: the class attribute 'name' is {name!r}; a name is printable, with no comma and no "
                         f"space at either end, and not 'all' (results, tables and --impl lists name impls by it)")
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        raise ValueError(f"{target}: the class attribute 'capabilities' must be a Capabilities, "
                         f"got {type(getattr(cls, 'capabilities', None)).__name__}")
    if cls.capabilities.graph_safe and cls.poison is Impl.poison:
        raise ValueError(f"{target}: capabilities declare graph_safe (outputs from plan) but the class does not "
                         "override poison: elements run leaves unwritten would never show")
    return cls


def discover() -> dict[str, ImplEntry]:
    """Built-in impls and those registered by installed distributions, by name. A name registered with several
    targets loads none of them (which one ran would be an accident of precedence): its entry names them all."""
    found = {name: [ImplEntry(name, target, "builtin")] for name, target in BUILTIN_IMPLS.items()}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else "unknown"
        found.setdefault(ep.name, []).append(ImplEntry(ep.name, ep.value, f"entry point ({dist})"))
    for name, same in found.items():
        if len({entry.target for entry in same}) > 1:
            targets = ", ".join(f"{entry.target} ({entry.origin})" for entry in same)
            same[0].conflict = f"impl name {name!r} is registered more than once: {targets}; keep one"
    return {name: same[0] for name, same in found.items()}


def resolve(spec: str) -> ImplEntry:
    """An impl by registered name, or by ``module:Class`` path."""
    entries = discover()
    if spec in entries:
        return entries[spec]
    if ":" in spec:
        cls = load_class(spec)
        return ImplEntry(cls.name, spec, "path", cls)
    raise ValueError(f"unknown impl {spec!r}; known: {', '.join(sorted(entries))} (or give module:Class)")


def check_distinct_names(entries: list[ImplEntry]) -> None:
    """ValueError for two impls of one name: their results would share keys, and a result of one would count as the
    other's (the pytest plugin's "tested on nothing" check passed a user's impl beside a built-in of its name)."""
    twice = repeated([entry.name for entry in entries])
    if twice is not None:
        targets = ", ".join(e.target for e in entries if e.name == twice)
        raise ValueError(f"impl name {twice!r} is given more than once ({targets}); give each impl once")
