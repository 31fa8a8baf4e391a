"""pytest plugin (entry point ``pytest11``): the bench's marks, ``--mla-impl``, fixtures, GPU skips.

- ``--mla-impl NAME`` (repeatable; a registered name or ``module:Class``) picks the impls that the conformance
  suite (``pytest --pyargs suites -m conformance``) and the ``mla_impl`` fixture run; default: every
  discoverable impl.
- ``--mla-device`` (auto, cpu, cuda, cuda:N): where they run. On CPU, ``TRITON_INTERPRET=1`` is set (unless the
  environment sets it) at configure time where ``--mla-impl`` or ``--mla-device`` is given, before any test module
  imports a Triton kernel, else when the session first asks for an impl or ``mla_device``: a pytest session that
  never uses mla-bench keeps its environment (the plugin is installed for every session of the environment).
- Tests marked ``gpu`` are skipped with a reason where CUDA is absent.
- An impl named with ``--mla-impl`` whose every conformance test run was skipped (it refused or did not declare
  them all) fails the session: it was tested on nothing, which pytest alone reports as a success. Under
  pytest-xdist too: each test's reports carry its impl to the controller, which collects nothing itself. One whose
  every conformance test ``-m`` / ``-k`` deselected is named with the selection (pytest says only "deselected").
- Fixtures: ``mla_device``, ``mla_impl`` (parametrized over the chosen impls), ``cuda_timer`` (a CUDA-event
  clock for pytest-benchmark: ``benchmark.pedantic(...)`` after ``@pytest.mark.benchmark(timer=...)``, or
  ``mla_bench.timing.cuda_event_timer`` directly).
"""

from __future__ import annotations

from collections import Counter

import pytest

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
MODE_MARKS = {"decode": "decode", "prefill": "prefill", "chunked_prefill": "chunked", "sparse_decode": "sparse",
              "sparse_prefill": "sparse", "dcp": "dcp"}
NO_GPU = "needs a CUDA GPU (none present)"
NAMED_IMPL = "mla_bench_impl"  # the attribute naming the impl on each report of a named impl's conformance test


def pytest_addoption(parser) -> None:
    group = parser.getgroup("mla-bench")
    group.addoption("--mla-impl", action="append", default=[], metavar="NAME",
                    help="impl to test: a registered name or module:Class (repeatable; default: all)")
    group.addoption("--mla-device", default=None,
                    help="device for mla-bench impls: auto (the default), cpu, cuda, cuda:N")


def pytest_configure(config) -> None:
    for name, text in MARKS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if config.getoption("mla_impl") or config.getoption("mla_device"):
        session_device(config)  # an mla-bench session: TRITON_INTERPRET on CPU before test modules import kernels
    specs = config.getoption("mla_impl")
    if specs:
        from mla_bench.errors import repeated

        twice = repeated(specs)
        if twice is not None:  # every test would run twice under one id
            raise pytest.UsageError(f"--mla-impl {twice} is given more than once: give each impl once")
        _check_distinct_names([resolve_spec(spec) for spec in specs])
        config.pluginmanager.register(ConformanceCoverage(specs), "mla-bench-coverage")


def session_device(config):
    """The device of ``--mla-device`` (auto: CUDA when present), chosen once per session. On CPU, Triton kernels
    imported from then on run in the interpreter; a ``TRITON_INTERPRET`` the environment sets is left as it is."""
    if not hasattr(config, "_mla_device"):
        from mla_bench.device import prepare

        try:
            config._mla_device = prepare(config.getoption("mla_device") or "auto", keep_interpret=True)
        except ValueError as exc:
            raise pytest.UsageError(f"--mla-device: {exc}") from None
    return config._mla_device


class ConformanceCoverage:
    """Which impls named with ``--mla-impl`` ran a conformance test that was not skipped; the session fails when one
    had every conformance test that ran skipped (deselected tests do not count: the user chose those, and one whose
    every test was deselected is named with the selection, not failed). Each report of
    a named impl's test carries the impl's name (``NAMED_IMPL``; not a user property, which JUnit XML would write as
    the properties xunit2 forbids): pytest-xdist's controller, which gives the verdict, collects no items itself."""

    def __init__(self, named: list[str]) -> None:
        self.named = set(named)
        self.impl_of: dict[str, str] = {}  # a collected conformance test's node id -> its named impl
        self.skipped: set[str] = set()  # impls with a conformance test skipped
        self.tested: set[str] = set()  # impls with a conformance test that passed or failed
        self.untested: list[str] = []
        self.deselected: Counter[str] = Counter()  # named impl -> its conformance tests that -m / -k deselected
        self.unselected: list[str] = []  # named impls whose every conformance test was deselected

    def _named_impl(self, item) -> str | None:
        """The named impl whose conformance test ``item`` is, or None."""
        case = getattr(item, "callspec", None) and item.callspec.params.get("conformance_case")
        return case[0].name if case and (case[0].name in self.named or case[0].target in self.named) else None

    def pytest_deselected(self, items) -> None:
        self.deselected.update(filter(None, map(self._named_impl, items)))

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            name = self._named_impl(item)
            if name:
                self.impl_of[item.nodeid] = name
        self.unselected = sorted(set(self.deselected) - set(self.impl_of.values()))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if item.nodeid in self.impl_of:
            setattr(outcome.get_result(), NAMED_IMPL, self.impl_of[item.nodeid])

    def pytest_runtest_logreport(self, report) -> None:
        name = getattr(report, NAMED_IMPL, None)
        if name is None:
            return
        if report.skipped:
            self.skipped.add(name)
        elif report.when == "call" or report.failed:
            self.tested.add(name)

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        ran_all = not session.shouldstop and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
        if not ran_all or hasattr(session.config, "workerinput"):
            return  # stopped early (-x): some impls never ran; an xdist worker ran a part (its controller judges)
        self.untested = sorted(self.skipped - self.tested)
        if self.untested and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        option = terminalreporter.config.option
        selection = " ".join(f"{flag} {expr!r}" for flag, expr in (("-m", option.markexpr), ("-k", option.keyword))
                             if expr) or "the selection"
        for name in self.unselected:
            terminalreporter.write_line(f"mla-bench: no conformance test of {name} was selected: {selection} "
                                        f"deselected all {self.deselected[name]} of them", yellow=True, bold=True)
        for name in self.untested:
            terminalreporter.write_line(f"mla-bench: {name} was tested on nothing: every conformance test of it was "
                                        "skipped (-rs shows why)", red=True, bold=True)


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip(NO_GPU)


def impl_specs(config) -> list[str]:
    """The impls chosen with ``--mla-impl``, or every discoverable one (after the device is chosen: on CPU, an impl's
    Triton kernels must be imported with the interpreter on)."""
    from mla_bench.registry import discover

    session_device(config)
    return list(config.getoption("mla_impl")) or sorted(discover())


def _check_distinct_names(entries: list) -> None:
    """A usage error for two ``--mla-impl`` of one name (``registry.check_distinct_names``)."""
    from mla_bench.registry import check_distinct_names

    try:
        check_distinct_names(entries)
    except ValueError as exc:
        raise pytest.UsageError(f"--mla-impl: {exc}") from None


def resolve_spec(spec: str):
    """The registry entry of ``spec``; an unknown name is a usage error naming the known ones."""
    from mla_bench.registry import ImplNotInstalled, resolve

    try:
        return resolve(spec)
    except ImplNotInstalled as exc:  # module:Class whose module is absent
        raise pytest.UsageError(f"--mla-impl {spec}: {exc}") from None
    except ValueError as exc:  # a module that exits on import too (``registry.load_class``): not INTERNALERROR
        raise pytest.UsageError(f"--mla-impl: {exc}") from None


def workload_marks(workload) -> list:
    """Marks of a workload: its path (decode, prefill, chunked, sparse, dcp) and fp8 / fp4 by layout."""
    marks = [getattr(pytest.mark, MODE_MARKS[workload.mode.value])]
    layout = workload.layout if workload.mode.uses_cache else ""
    if "fp8" in layout:
        marks.append(pytest.mark.fp8)
    if "fp4" in layout:
        marks.append(pytest.mark.fp4)
    return marks


def pytest_generate_tests(metafunc) -> None:
    if "mla_impl" in metafunc.fixturenames:
        specs = impl_specs(metafunc.config)
        metafunc.parametrize("mla_impl", [resolve_spec(s) for s in specs], ids=specs, indirect=True)


@pytest.fixture(scope="session")
def mla_device(request):
    """The device chosen with ``--mla-device`` (auto: CUDA when present)."""
    return session_device(request.config)


@pytest.fixture
def mla_impl(request):
    """An instance of one chosen impl (skipped, with the reason, when its package is not installed)."""
    from mla_bench.registry import ImplNotInstalled

    try:
        return request.param.load()
    except ImplNotInstalled as exc:
        pytest.skip(f"not installed: {exc}")


@pytest.fixture
def cuda_timer():
    """A clock in seconds read from CUDA events (skips without CUDA): for pytest-benchmark's ``timer``."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    from mla_bench.timing import CudaEventTimer

    return CudaEventTimer()
