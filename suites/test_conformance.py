"""Conformance of any MLA impl against the float64 reference, shipped with the bench:

    pytest --pyargs suites -m conformance --mla-impl mypkg:MyMLA

One test per (impl, workload) of ``suites.sweeps.conformance``: the tiny sweep bent to what the impl declares on the
session's device (head count, page size, a host cache on a GPU; an impl without bf16 gets the cache-reading
workloads in its first declared layout), over every mode and layout, widened by a test on
each mode's smallest workload per declared value it misses (a dtype such as float16, a layout, the largest head count
and page size, a non-power-of-two page size, each request then a page longer). A combination the impl does not
declare, or that its ``plan`` refuses with ``UnsupportedConfig``, is skipped with that reason; everything else must
pass ``suites.judge.judge`` (poisoned outputs and unused pages, permuted blocks, the bench's tolerances, inputs left
as they were, and a second run of the same plan within the tolerances too). An impl that is not installed, or whose
constructor raises, has a test per workload of the unbent sweep all the same, skipped or failing: a filter that
selects tests by mode, layout or label (``-m decode``, ``-k bf16``) selects those too.
"""

from __future__ import annotations

import pytest

from mla_bench import pytest_plugin
from mla_bench.errors import reraise_interrupt
from mla_bench.pytest_plugin import impl_specs, resolve_spec, session_device, workload_marks

_PROBLEMS: dict = {}


def pytest_generate_tests(metafunc) -> None:
    if "conformance_case" not in metafunc.fixturenames:
        return
    if not metafunc.config.pluginmanager.is_registered(pytest_plugin):  # its options and fixtures are missing
        raise pytest.UsageError("the mla-bench pytest plugin is not loaded: install mla-bench (pip install -e .) or "
                                "pass -p mla_bench.pytest_plugin")
    from mla_bench.registry import ImplNotInstalled
    from suites import sweeps

    cases, device = [], session_device(metafunc.config)
    for spec in impl_specs(metafunc.config):
        entry = resolve_spec(spec)
        caps, skip_reason = None, None
        try:
            caps = entry.load().capabilities
        except ImplNotInstalled as exc:
            skip_reason = f"not installed: {exc}"
        except BaseException as exc:  # noqa: BLE001 - its tests fail with the traceback; the collection goes on
            reraise_interrupt(exc)
        for workload in sweeps.tiny() if caps is None else sweeps.conformance(caps, device):
            cases.append(pytest.param((entry, workload, skip_reason, caps is not None), marks=workload_marks(workload),
                                      id=f"{entry.name}-{workload.label.replace(' ', '_')}"))
    metafunc.parametrize("conformance_case", cases)


def _problem(workload, device):
    """The problem and references of a workload, built once per session and shared by every impl."""
    from mla_bench.problem import build_problem
    from suites.judge import References

    key = (workload.key, str(device))
    if key not in _PROBLEMS:
        problem = build_problem(workload, device)
        _PROBLEMS[key] = (problem, References.of(problem))
    return _PROBLEMS[key]


@pytest.mark.conformance
def test_conformance(conformance_case, mla_device) -> None:
    from suites.judge import judge

    entry, workload, skip_reason, loaded = conformance_case
    if skip_reason:
        pytest.skip(skip_reason)
    impl = entry.load()  # raises again (the test fails with the traceback) where it raised at collection
    assert loaded, f"{entry.target} raised when constructed at collection, but not now"
    refusal = impl.capabilities.refusal(workload, mla_device)
    if refusal:
        pytest.skip(f"{impl.name}: unsupported {refusal}")
    problem, refs = _problem(workload, mla_device)
    verdict = judge(impl, problem, refs)
    if verdict.status == "unsupported":
        pytest.skip(verdict.message)
    details = "\n".join(verdict.violations) or verdict.message
    assert verdict.status == "passed", f"{impl.name} {verdict.status} on {workload.label}:\n{details}"
