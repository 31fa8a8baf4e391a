"""The pytest plugin: ``pytest --pyargs suites -m conformance --mla-impl ...`` checks any impl, a third party's
included, flags every planted bug, skips what an impl refuses with its reason, and GPU tests skip on CPU."""

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

TESTS = Path(__file__).parent

# A third party's kernel, known only to this test: decode in float32 with torch, written from the docs.
THIRD_PARTY = textwrap.dedent('''
    import torch
    from mla_bench.registry import Capabilities, Impl
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

    class CudaOnly(MyMLA):
        name = "my_cuda_only"
        capabilities = Capabilities(modes={"decode"}, devices=frozenset({"cuda"}))

    class Broken(MyMLA):
        name = "my_broken"

        def __init__(self):
            raise RuntimeError("my_broken found no CUDA context")
''')


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
    """One pytest session over the third-party impl, one whose constructor raises, the correct twins and every
    planted bug."""
    work = tmp_path_factory.mktemp("third_party")
    (work / "mypkg.py").write_text(THIRD_PARTY)
    impls = ["mypkg:Broken", "mypkg:MyMLA", "planted_impls:PlainDecode", "planted_impls:PlainFP8Decode",
             "planted_impls:PlainSparse", "torch_eager"]
    impls += [f"planted_impls:{cls.__name__}" for cls in planted_impls.PLANTED_BUGS]
    args = [sys.executable, "-m", "pytest", "--pyargs", "suites", "-m", "conformance", "-q", "-p", "no:cacheprovider",
            f"--junitxml={work / 'junit.xml'}"] + [f"--mla-impl={impl}" for impl in impls]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=600)
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


def test_an_impl_whose_constructor_raises_fails_one_test_and_the_other_impls_still_run(conformance):
    assert conformance["my_broken"] == Counter(failed=1), conformance["my_broken"]
    assert conformance["my_mla"]["passed"] == 7


@pytest.mark.parametrize("bug", planted_impls.PLANTED_BUGS, ids=lambda cls: cls.name)
def test_every_planted_bug_is_flagged_by_the_conformance_suite(conformance, bug):
    assert conformance[bug.name]["failed"] >= 1, conformance[bug.name]


def test_a_named_impl_whose_every_conformance_test_is_skipped_fails_the_session(tmp_path):
    """An impl tested on nothing (here: it declares CUDA only, the session runs on the CPU) is not a success; an
    impl that passed beside it is not named, and a user's deselection (-k) is no skip."""
    (tmp_path / "mypkg.py").write_text(THIRD_PARTY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))

    def session(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "suites", "-m", "conformance", "-q",
                               "-p", "no:cacheprovider", "--mla-device=cpu", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    done = session("--mla-impl=mypkg:CudaOnly", "--mla-impl=mypkg:MyMLA", "-k", "decode and bf16 and not ps1")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "my_cuda_only was tested on nothing" in done.stdout and "my_mla was tested" not in done.stdout
    assert " failed" not in done.stdout.splitlines()[-1], done.stdout[-500:]  # nothing failed: only skipped
    done = session("--mla-impl=mypkg:MyMLA", "--mla-impl=mypkg:CudaOnly", "-k", "my_mla and decode and bf16")
    assert done.returncode == 0 and "tested on nothing" not in done.stdout, done.stdout[-3000:]
    done = session("--mla-impl=mypkg:CudaOnly", "--collect-only")  # nothing runs: nothing is untested (it said 1)
    assert done.returncode == 0 and "tested on nothing" not in done.stdout, done.stdout[-3000:]


def test_gpu_marked_tests_skip_on_cpu_with_the_reason(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: the skip path is not taken")
    (tmp_path / "test_gpu_only.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_needs_gpu(cuda_timer):\n    assert False\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "needs a CUDA GPU (none present)" in done.stdout, done.stdout
