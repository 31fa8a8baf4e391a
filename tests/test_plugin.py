"""The pytest plugin: ``pytest --pyargs suites -m conformance --mla-impl ...`` checks any impl, a third party's
included, flags every planted bug, skips what an impl refuses with its reason, fails an impl tested on nothing (under
pytest-xdist too), and GPU tests skip on CPU; a session that does not use mla-bench keeps Triton as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

import planted_impls
from suites import sweeps

TESTS = Path(__file__).parent
PLUGIN = "mla_bench.pytest_plugin"  # the name its pytest11 entry point registers it under

# A third party's kernel, known only to this test: decode in float32 with torch, written from the docs.
THIRD_PARTY = textwrap.dedent('''
    import sys

    import torch
    from mla_bench.registry import Capabilities, Impl, ImplNotInstalled
    from mla_bench.metadata.reference import request_token_slots

    class MyMLA(Impl):
        name = "my_mla"
        capabilities = Capabilities(modes={"decode"}, page_sizes=frozenset({16, 64}))

        def plan(self, problem):
            m = problem.meta
            table = m.block_table.cpu()
            return problem, [request_token_slots(table, b, n, m.page_size) for b, n in enumerate(m.kv_lens)]

        def run(self, plan):
            p, slots = plan
            rows = p.cache.rows().view(torch.bfloat16).float()
            out = torch.zeros(p.q.shape[0], p.q.shape[1], 512, dtype=p.q.dtype)
            lse = torch.full(p.q.shape[:2], float("-inf"))
            t = 0
            for q_len, kv_len, s in zip(p.meta.q_lens, p.meta.kv_lens, slots):
                k = rows[s]
                for i in range(q_len):
                    if kv_len:
                        scores = p.q[t].float() @ k[: kv_len - q_len + i + 1].T * p.scale
                        lse[t] = torch.logsumexp(scores, -1)
                        out[t] = (torch.softmax(scores, -1) @ k[: kv_len - q_len + i + 1, :512]).to(p.q.dtype)
                    t += 1
            return out, lse

    class Wide(MyMLA):
        name = "my_wide"
        capabilities = Capabilities(modes={"decode"}, dtypes={"bfloat16", "float16"},
                                    head_counts=frozenset({2, 16}), page_sizes=frozenset({16, 24, 128}))

    class CudaOnly(MyMLA):
        name = "my_cuda_only"
        capabilities = Capabilities(modes={"decode"}, devices=frozenset({"cuda"}))

    class Broken(MyMLA):
        name = "my_broken"

        def __init__(self):
            raise RuntimeError("my_broken found no CUDA context")

    class Exits(MyMLA):
        name = "my_exits"

        def __init__(self):
            sys.exit(0)

    class Absent(MyMLA):
        name = "my_absent"

        def __init__(self):
            raise ImplNotInstalled("my_absent needs mykernels (pip install mykernels)")

    class PowerOfTwoPages(MyMLA):
        """Finds a token's page with a shift: exact for its page size 16, wrong past 32 keys for its page size 48."""
        name = "my_pow2_pages"
        capabilities = Capabilities(modes={"decode"}, page_sizes=frozenset({16, 48}))

        def plan(self, problem):
            m = problem.meta
            table, shift = m.block_table.cpu().long(), m.page_size.bit_length() - 1
            slots = []
            for b, n in enumerate(m.kv_lens):
                positions = torch.arange(n)
                page = (positions >> shift).clamp(max=max(0, (n - 1) // m.page_size))
                slots.append(table[b][page] * m.page_size + positions % m.page_size)
            return problem, slots
''')

# Sparse top-k kernels over FP8 pages, as FlashMLA's: one right and FP8 only, one that declares fp8_ds_mla beside bf16
# and reads every cache as bf16.
SPARSE_FP8 = textwrap.dedent('''
    from dataclasses import replace

    import planted_impls
    import torch

    class SparseFP8(planted_impls.PlainSparse):
        name = "my_sparse_fp8"
        capabilities = replace(planted_impls.SPARSE, layouts=frozenset({"fp8_ds_mla"}))

        def run(self, p):
            rows = p.cache.layout.dequantize(p.cache.rows(), p.cache.tensor_scale)
            out = torch.zeros(*p.q.shape[:2], 512, dtype=p.q.dtype)
            lse = torch.full(p.q.shape[:2], float("-inf"))
            for t in range(p.q.shape[0]):
                chosen = p.sparse_indices[t][p.sparse_indices[t] >= 0].long()
                if chosen.numel():
                    scores = p.q[t].float() @ rows[chosen].float().T * p.scale
                    lse[t] = torch.logsumexp(scores, -1)
                    out[t] = (torch.softmax(scores, -1) @ rows[chosen, :512].float()).to(p.q.dtype)
            return out, lse

    class SparseBF16AsFP8(planted_impls.PlainSparse):
        name = "my_sparse_bf16_as_fp8"
        capabilities = replace(planted_impls.SPARSE, layouts=frozenset({"bf16", "fp8_ds_mla"}))
''')

# A project's own tests beside the plugin: its kernel must be compiled (e.g. ahead of time for a GPU it lacks), and
# the interpreter comes on only for a session that asks for mla-bench's device.
OWN_TRITON_TESTS = textwrap.dedent('''
    import os

    import triton
    import triton.language as tl

    @triton.jit
    def store_one(x_ptr):
        tl.store(x_ptr, 1.0)

    def test_own_kernel_is_compiled_not_interpreted():
        assert type(store_one).__name__ == "JITFunction", type(store_one)

    def test_mla_device_switches_the_interpreter_on_for_the_cpu(mla_device):
        assert os.environ.get("TRITON_INTERPRET") == ("1" if mla_device.type == "cpu" else None)
''')

# A GPU host faked on a CPU: the session's device reads as CUDA (what the capabilities and the conformance sweep see,
# whatever --mla-device says), while each problem is built, and each impl runs, on the CPU.
FAKE_GPU = textwrap.dedent('''
    import torch

    import mla_bench.device
    import mla_bench.problem

    mla_bench.device.pick_device = lambda name: torch.device("cuda")
    build_on_cpu = mla_bench.problem.build_problem
    mla_bench.problem.build_problem = lambda workload, device: build_on_cpu(workload, "cpu")
''')


def _pytest(cwd: Path, *args: str, path: tuple[Path, ...] = (), **env: str) -> subprocess.CompletedProcess:
    """``python -m pytest -q ARGS`` in its own process from ``cwd`` (no cache), ``path`` first on its PYTHONPATH, and
    ``env`` over this one's environment less ``TRITON_INTERPRET`` (which this session's conftest sets).

    The plugin is loaded by name as its entry point would load it (a no-op where the package is installed), so that
    a source tree on PYTHONPATH, as on the GPU machine, runs these tests as an installed one does; ``-p
    no:mla_bench.pytest_plugin`` in ``args`` still leaves it out."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env, PYTHONPATH=os.pathsep.join([*map(str, path), os.environ.get("PYTHONPATH", "")]))
    plugin = [] if f"no:{PLUGIN}" in args else ["-p", PLUGIN]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *args], cwd=cwd,
                          env=environ, capture_output=True, text=True, timeout=600)


def _conformance(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The conformance suite on the CPU with ``args`` and ``env``, the third party's ``mypkg`` and the planted impls
    importable."""
    (cwd / "mypkg.py").write_text(THIRD_PARTY)
    return _pytest(cwd, "--pyargs", "suites", "-m", "conformance", "--mla-device=cpu", *args, path=(cwd, TESTS), **env)


def _outcomes(junit: Path) -> dict[str, Counter]:
    """Per impl (the first part of the test id): passed / failed / skipped counts, and skip messages."""
    counts: dict[str, Counter] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        impl = case.get("name").split("[", 1)[1].split("-", 1)[0]
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        counts.setdefault(impl, Counter())[outcome] += 1
        skipped = case.find("skipped")
        if skipped is not None:
            counts[impl]["reason: " + skipped.get("message", "")] += 1
    return counts


@pytest.fixture(scope="module")
def conformance(tmp_path_factory) -> dict[str, Counter]:
    """One pytest session over the third-party impl, one whose constructor raises and one whose constructor exits,
    the correct twins and every planted bug."""
    work = tmp_path_factory.mktemp("third_party")
    impls = ["mypkg:Broken", "mypkg:Exits", "mypkg:MyMLA", "planted_impls:PlainDecode", "planted_impls:PlainFP8Decode",
             "planted_impls:PlainSparse", "torch_eager"]
    impls += [f"planted_impls:{cls.__name__}" for cls in planted_impls.PLANTED_BUGS]
    done = _conformance(work, f"--junitxml={work / 'junit.xml'}", *[f"--mla-impl={impl}" for impl in impls])
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # the planted bugs fail
    return _outcomes(work / "junit.xml")


def test_a_third_party_impl_passes_and_its_refusals_are_skipped_with_reasons(conformance):
    mine = conformance["my_mla"]
    # Every bf16 decode workload passes, page sizes 1/13 moved to the declared 16; the rest is skipped.
    assert mine["passed"] == 7 and mine["failed"] == 0, mine
    reasons = [key for key in mine if key.startswith("reason: ")]
    assert any("unsupported mode prefill" in r for r in reasons) and any("dtype float32" in r for r in reasons)
    for twin in ("plain_decode", "plain_sparse", "torch_eager"):
        assert conformance[twin]["passed"] >= 2 and conformance[twin]["failed"] == 0, twin
    assert conformance["plain_fp8_decode"]["passed"] >= 1 and conformance["plain_fp8_decode"]["failed"] == 0


def test_the_largest_head_count_and_page_size_an_impl_declares_and_float16_are_checked(tmp_path):
    """Only the smallest declared head count and page size were checked (every other one moved there), and no
    workload was float16: a kernel wrong at 16 heads, page 24 or 128, or in float16 passed."""
    done = _conformance(tmp_path, "-rA", "--mla-impl=mypkg:Wide")
    assert done.returncode == 0, done.stdout[-3000:]
    passed = [line for line in done.stdout.splitlines() if line.startswith("PASSED") and "[my_wide-decode" in line]
    for value in ("_h16_", "_ps24_", "_ps128_", "_float16_"):
        assert sum(value in line for line in passed) == 1, (value, done.stdout[-3000:])


def test_a_host_cache_impl_is_tested_on_a_gpu_host(tmp_path):
    """On a GPU the impl whose cache lives in host memory was refused every workload (the cache was put on the GPU
    with the queries): tested on nothing. Its caches now go to the host, and torch_eager's stay with the queries.
    The GPU is faked (``FAKE_GPU``): the problems and the runs are on the CPU."""
    (tmp_path / "fake_gpu.py").write_text(FAKE_GPU)
    done = _conformance(tmp_path, "-p", "fake_gpu", "-rA", "-m", "conformance and decode",
                        "--mla-impl=torch_eager_host_cache", "--mla-impl=torch_eager", TRITON_INTERPRET="1")
    assert done.returncode == 0 and "tested on nothing" not in done.stdout, done.stdout[-3000:]
    passed = [line for line in done.stdout.splitlines() if line.startswith("PASSED")]
    host = [line for line in passed if "[torch_eager_host_cache-" in line]
    assert len(host) >= 8 and all("_cache-cpu_" in line for line in host), done.stdout[-3000:]
    assert not any("_cache-cpu_" in line for line in passed if "[torch_eager-" in line), done.stdout[-3000:]


def test_a_kernel_wrong_at_its_odd_page_size_past_the_first_page_is_flagged(tmp_path):
    """The test at a declared page size (48) took the smallest decode (9 and 20 keys) as it was: every request in one
    page, so a kernel whose page arithmetic holds for powers of two only passed. Each request is now a page longer."""
    done = _conformance(tmp_path, "-m", "conformance and decode", "--mla-impl=mypkg:PowerOfTwoPages")
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert done.returncode == 1 and len(failed) == 1 and "_ps48_" in failed[0], done.stdout[-3000:]


def test_every_layout_an_impl_declares_is_checked_in_each_of_its_modes(tmp_path):
    """The sweep's sparse workloads are bf16: a sparse kernel over fp8_ds_mla alone was tested on nothing (the session
    failed), and one that declared fp8_ds_mla beside bf16 without an FP8 path passed."""
    (tmp_path / "mysparse.py").write_text(SPARSE_FP8)
    done = _conformance(tmp_path, f"--junitxml={tmp_path / 'junit.xml'}", "-m", "conformance and sparse",
                        "--mla-impl=mysparse:SparseFP8", "--mla-impl=mysparse:SparseBF16AsFP8")
    assert done.returncode == 1 and "tested on nothing" not in done.stdout, done.stdout[-3000:]
    outcomes = _outcomes(tmp_path / "junit.xml")
    assert outcomes["my_sparse_fp8"]["passed"] >= 2 and outcomes["my_sparse_fp8"]["failed"] == 0, outcomes
    assert outcomes["my_sparse_bf16_as_fp8"]["failed"] == 2, outcomes  # sparse decode and prefill over FP8


def test_a_named_impl_whose_every_conformance_test_was_deselected_is_named_with_the_selection(tmp_path):
    """``-m`` that left an impl no test said only "25 deselected" (and exited 5 where it left none at all)."""
    (tmp_path / "mysparse.py").write_text(SPARSE_FP8)
    done = _conformance(tmp_path, "-m", "conformance and sparse and fp8", "--mla-impl=torch_eager",
                        "--mla-impl=mysparse:SparseFP8")
    note = "no conformance test of torch_eager was selected: -m 'conformance and sparse and fp8' deselected all"
    assert done.returncode == 0 and note in done.stdout, done.stdout[-3000:]
    assert "of my_sparse_fp8 was selected" not in done.stdout, done.stdout[-3000:]
    done = _conformance(tmp_path, "-m", "conformance and dcp and fp4", "--mla-impl=torch_eager")
    assert done.returncode == 5 and "no conformance test of torch_eager was selected" in done.stdout, done.stdout


def test_an_impl_whose_constructor_raises_fails_one_test_and_the_other_impls_still_run(conformance):
    """Each of its tests fails (one per workload of the sweep); so do those of one that calls sys.exit (at collection
    it ended the session in an INTERNALERROR)."""
    assert conformance["my_broken"] == Counter(failed=len(sweeps.tiny())), conformance["my_broken"]
    assert conformance["my_exits"] == Counter(failed=len(sweeps.tiny())), conformance["my_exits"]
    assert conformance["my_mla"]["passed"] == 7


@pytest.mark.parametrize("bug", planted_impls.PLANTED_BUGS, ids=lambda cls: cls.name)
def test_every_planted_bug_is_flagged_by_the_conformance_suite(conformance, bug):
    assert conformance[bug.name]["failed"] >= 1, conformance[bug.name]


def test_a_named_impl_whose_every_conformance_test_is_skipped_fails_the_session(tmp_path):
    """An impl tested on nothing (here: it declares CUDA only, the session runs on the CPU) is not a success; an
    impl that passed beside it is not named, and a user's deselection (-k) is no skip."""
    done = _conformance(tmp_path, "--mla-impl=mypkg:CudaOnly", "--mla-impl=mypkg:MyMLA", "-k",
                        "decode and bf16 and not ps1")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "my_cuda_only was tested on nothing" in done.stdout and "my_mla was tested" not in done.stdout
    assert " failed" not in done.stdout.splitlines()[-1], done.stdout[-500:]  # nothing failed: only skipped
    done = _conformance(tmp_path, "--mla-impl=mypkg:MyMLA", "--mla-impl=mypkg:CudaOnly", "-k",
                        "my_mla and decode and bf16")
    assert done.returncode == 0 and "tested on nothing" not in done.stdout, done.stdout[-3000:]
    done = _conformance(tmp_path, "--mla-impl=mypkg:CudaOnly", "--collect-only")  # nothing ran: nothing untested
    assert done.returncode == 0 and "tested on nothing" not in done.stdout, done.stdout[-3000:]


def test_an_impl_that_cannot_be_loaded_is_not_filtered_away(tmp_path):
    """Filtered to decode, an impl whose constructor raises fails its decode tests and one that is not installed is
    tested on nothing: each had one unmarked test, which -m deselected, and the session passed."""
    done = _conformance(tmp_path, "-m", "conformance and decode", "--mla-impl=mypkg:Broken", "--mla-impl=mypkg:Absent",
                        "--mla-impl=mypkg:MyMLA")
    assert done.returncode == 1 and "my_absent was tested on nothing" in done.stdout, done.stdout[-3000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert failed and all("[my_broken-decode_" in line for line in failed), done.stdout[-3000:]


def test_an_impl_tested_on_nothing_fails_the_session_under_xdist(tmp_path):
    """pytest-xdist's controller collects nothing itself: the verdict read the controller's own items (none) and
    passed a session whose named impl was tested on nothing."""
    pytest.importorskip("xdist")
    done = _conformance(tmp_path, "-n", "2", "--mla-impl=mypkg:CudaOnly", "--mla-impl=mypkg:MyMLA", "-k",
                        "decode and bf16 and not ps1")
    assert done.returncode == 1 and "my_cuda_only was tested on nothing" in done.stdout, done.stdout[-3000:]
    assert "my_mla was tested" not in done.stdout, done.stdout[-3000:]
    done = _conformance(tmp_path, "-n", "2", "--mla-impl=mypkg:MyMLA", "-k", "decode and bf16")
    assert done.returncode == 0 and "tested on nothing" not in done.stdout, done.stdout[-3000:]


def test_a_named_impl_that_never_ran_is_not_called_tested_on_nothing(tmp_path):
    """A session stopped at its first failure (-x) never ran the impl named after the failing one, and --setup-only
    runs no test: neither skipped anything (the second exited 1, the first said every test of my_mla was skipped)."""
    done = _conformance(tmp_path, "-x", "--mla-impl=planted_impls:ReturnsZeros", "--mla-impl=mypkg:MyMLA")
    assert done.returncode == 1 and "stopping after 1 failures" in done.stdout, done.stdout[-3000:]
    assert "tested on nothing" not in done.stdout, done.stdout[-3000:]
    done = _conformance(tmp_path, "--setup-only", "--mla-impl=mypkg:MyMLA")
    assert done.returncode == 0 and "tested on nothing" not in done.stdout, done.stdout[-3000:]


def test_a_broken_setup_is_named_instead_of_failing_inside_pytest(tmp_path):
    """An impl module that exits on import is a usage error naming it (it was pytest's INTERNALERROR), and the suite
    without the plugin says to load it (it said "no option named 'mla_impl'")."""
    (tmp_path / "exits_on_import.py").write_text("import sys\n\nsys.exit(0)\n")
    done = _conformance(tmp_path, "--collect-only", "--mla-impl=exits_on_import:MyMLA")
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "INTERNALERROR" not in output, output[-3000:]
    assert "--mla-impl: exits_on_import:MyMLA: importing exits_on_import raised SystemExit: 0" in output, \
        output[-3000:]
    done = _pytest(tmp_path, "-p", f"no:{PLUGIN}", "--pyargs", "suites", "--collect-only")
    assert done.returncode != 0 and "the mla-bench pytest plugin is not loaded" in done.stdout, done.stdout[-3000:]


def test_an_impl_named_twice_is_a_usage_error(tmp_path):
    """Every conformance test ran twice under one id (helper 88); the CLI's ``--impl`` refuses it too."""
    done = _conformance(tmp_path, "--collect-only", "--mla-impl=torch_eager", "--mla-impl=torch_eager")
    output = done.stdout + done.stderr
    assert done.returncode == 4 and "--mla-impl torch_eager is given more than once" in output, output[-3000:]


def test_two_impls_of_one_name_are_a_usage_error(tmp_path):
    """A user's impl named like a built-in passed beside it: its tests, every one skipped, counted as tested through
    the built-in's (coverage is by name), and its failures read as the built-in's."""
    (tmp_path / "twin.py").write_text("from impls.torch_eager import TorchEager\n\n\n"
                                      "class Twin(TorchEager):\n    name = 'torch_eager'\n")
    done = _conformance(tmp_path, "--collect-only", "--mla-impl=torch_eager", "--mla-impl=twin:Twin")
    output = done.stdout + done.stderr
    assert done.returncode == 4 and "impl name 'torch_eager' is given more than once (impls.torch_eager:TorchEager, " \
        "twin:Twin)" in output, output[-3000:]


def test_a_session_without_mla_bench_keeps_triton_as_it_was(tmp_path):
    """The plugin is installed for every pytest session of the environment: on a CPU host it switched Triton's
    interpreter on for all of them, so a project's own kernel (compiled ahead of time for a GPU it lacks, say) came
    back interpreted, even with TRITON_INTERPRET=0 set. mla-bench's device still switches it on for its own use."""
    (tmp_path / "test_own.py").write_text(OWN_TRITON_TESTS)
    done = _pytest(tmp_path, "test_own.py")
    assert done.returncode == 0, done.stdout[-3000:]
    done = _pytest(tmp_path, "test_own.py", "--mla-device=cpu", "-k", "own_kernel", TRITON_INTERPRET="0")
    assert done.returncode == 0, done.stdout[-3000:]


def test_gpu_marked_tests_skip_on_cpu_with_the_reason(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: the skip path is not taken")
    (tmp_path / "test_gpu_only.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_needs_gpu(cuda_timer):\n    assert False\n")
    done = _pytest(tmp_path, "-rs", str(tmp_path))
    assert done.returncode == 0 and "needs a CUDA GPU (none present)" in done.stdout, done.stdout


class _Config:
    """What ``session_device`` reads of a pytest config: ``--mla-device``."""

    def __init__(self, device: str | None) -> None:
        self.device = device

    def getoption(self, name: str) -> str | None:
        assert name == "mla_device", name
        return self.device


@pytest.mark.parametrize("env", [None, "0", ""])
def test_the_cli_sets_the_interpreter_and_the_plugin_keeps_the_environments(monkeypatch, env):
    """Both go through ``prepare``: on the CPU the CLI switches the interpreter on over whatever the environment set,
    the plugin only where the environment set nothing (a user's TRITON_INTERPRET=0 stays)."""
    import torch

    from mla_bench import device as devices
    from mla_bench.pytest_plugin import session_device

    for keep, config in ((False, None), (True, _Config("cpu")), (True, _Config(None)), (True, _Config(""))):
        if env is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", env)
        monkeypatch.setattr(devices, "pick_device", lambda name: torch.device("cpu"))  # auto too, on a GPU host
        device = devices.prepare("cpu") if config is None else session_device(config)
        assert device.type == "cpu"
        assert os.environ["TRITON_INTERPRET"] == ("1" if env is None or not keep else env), (keep, env)


def test_the_plugin_chooses_its_device_once_and_names_a_bad_one(monkeypatch):
    """``--mla-device`` empty or absent is auto; the device is chosen and made current once per session; a device
    pick_device refuses is a usage error naming the option; one make_current fails on fails every call (not the
    first only, leaving later ones on another GPU)."""
    import torch

    from mla_bench import device as devices
    from mla_bench.pytest_plugin import session_device

    with pytest.raises(pytest.UsageError, match=r"^--mla-device: device must be cpu, cuda or cuda:N, got 'mps'$"):
        session_device(_Config("mps"))
    picked, made = [], []
    monkeypatch.setattr(devices, "pick_device", lambda name: picked.append(name) or torch.device("cuda", 1))
    monkeypatch.setattr(devices, "make_current", made.append)
    config = _Config("")
    assert session_device(config) == session_device(config) == torch.device("cuda", 1)
    assert picked == ["auto"] and made == [torch.device("cuda", 1)]
    monkeypatch.setattr(devices, "make_current", lambda device: (_ for _ in ()).throw(RuntimeError("no GPU 1")))
    config = _Config("cuda:1")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no GPU 1"):
            session_device(config)


# Decode kernels over FP8 pages alone, as FlashMLA's FP8 decode: one right, one with the planted NaN rows for a
# request with no cached token (not out 0 and lse -inf).
DECODE_FP8 = textwrap.dedent('''
    from dataclasses import replace

    import planted_impls

    class DecodeFP8(planted_impls.PlainFP8Decode):
        name = "my_decode_fp8"
        capabilities = replace(planted_impls.PlainFP8Decode.capabilities, layouts=frozenset({"fp8_ds_mla"}))

    class EmptyRequestNaN(planted_impls.NaNForEmptyRequest, DecodeFP8):
        name = "my_decode_fp8_empty"
''')


def test_an_fp8_only_decode_impl_is_checked_on_the_edge_cases(tmp_path):
    """The sweep's decode edge cases are bf16: an FP8-only decode kernel never saw an empty request, so one that
    gives its rows NaN passed. They now run in its layout."""
    (tmp_path / "mydecode.py").write_text(DECODE_FP8)
    done = _conformance(tmp_path, f"--junitxml={tmp_path / 'junit.xml'}", "-m", "conformance and decode",
                        "--mla-impl=mydecode:DecodeFP8", "--mla-impl=mydecode:EmptyRequestNaN")
    assert done.returncode == 1, done.stdout[-3000:]
    outcomes = _outcomes(tmp_path / "junit.xml")
    assert outcomes["my_decode_fp8"]["passed"] == 9 and outcomes["my_decode_fp8"]["failed"] == 0, outcomes
    assert outcomes["my_decode_fp8_empty"]["failed"] == 1, outcomes
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "[my_decode_fp8_empty-decode_tiny_h4_b4_q1_ctx0-100_ps16_fp8_ds_mla" in failed[0], \
        done.stdout[-3000:]
