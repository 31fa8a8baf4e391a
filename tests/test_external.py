"""The external adapters: absent packages are listed and skipped as not installed, installed but broken ones are
errors naming them; with stand-in packages (written from the real APIs, in plain torch) each adapter's plumbing
(shapes, page lists, lse base and empty-row conventions) passes the conformance sweep on CPU."""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import sys
import types
from pathlib import Path

import pytest
import torch

from mla_bench.registry import ImplNotInstalled, resolve
from mla_bench.runner import RunOptions, execute
from mla_bench.workload import Workload
from suites import sweeps
from suites.judge import judge

EXTERNAL = ["vllm_triton_mla", "flashinfer_mla", "flashmla", "flashmla_sparse"]
FAKES = Path(__file__).parent / "fake_kernels"


def _installed(name: str) -> bool:
    try:
        resolve(name).load()
    except ImplNotInstalled:
        return False
    return True


@pytest.mark.skipif(any(_installed(n) for n in EXTERNAL), reason="a real external package is installed here")
def test_absent_packages_are_not_installed_and_skipped_with_the_reason(capsys):
    from mla_bench.cli import main

    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    for name in EXTERNAL:
        line = next(line for line in listing.splitlines() if name in line)
        assert "not installed" in line
    run = execute(RunOptions(impls=EXTERNAL, device="cpu", preset="tiny", modes=["decode"]))
    assert sorted((r.impl, r.status) for r in run.results) == sorted((n, "unsupported") for n in EXTERNAL)
    assert all(r.message.startswith("not installed:") for r in run.results) and run.ok


def _forget(*packages: str) -> None:
    """Drop ``packages`` and their submodules from ``sys.modules`` (monkeypatch.delitem would put them back)."""
    for name in [name for name in sys.modules if name.split(".")[0] in packages]:
        del sys.modules[name]


def _hide_loaded(monkeypatch, *packages: str) -> None:
    """Take the real ``packages`` this process already imported out of ``sys.modules`` until the test ends, so that
    imports find the planted or stand-in ones (on a machine with FlashInfer or vLLM installed)."""
    for name in [name for name in sys.modules if name.split(".")[0] in packages]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def fake_packages(monkeypatch):
    _hide_loaded(monkeypatch, "vllm", "flashinfer", "flash_mla")
    monkeypatch.syspath_prepend(str(FAKES))
    yield
    _forget("vllm", "flashinfer", "flash_mla")  # before monkeypatch puts the real ones back


@pytest.mark.parametrize("name, expect", [("vllm_triton_mla", 6), ("flashinfer_mla", 7), ("flashmla", 5),
                                          ("flashmla_sparse", 6)])  # 64 heads, and 128 once per mode
def test_adapter_plumbing_passes_conformance_on_stand_in_kernels(fake_packages, name, expect):
    impl = resolve(name).load()
    # The adapters declare CUDA only; the stand-ins run anywhere.
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu", "cuda"}))
    from mla_bench.problem import build_problem

    verdicts = []
    for workload in sweeps.conformance(impl.capabilities):
        if impl.capabilities.refusal(workload, "cpu") is None:
            verdicts.append((workload.label, judge(impl, build_problem(workload, "cpu"))))
    bad = [(label, v.status, v.violations or v.message[-400:]) for label, v in verdicts if v.status != "passed"
           and v.status != "unsupported"]
    assert not bad
    assert sum(v.status == "passed" for _, v in verdicts) == expect


def test_flashinfer_lse_base_is_normalized(fake_packages):
    """Declaring the wrong base must fail: the conversion is what makes the stand-in pass."""
    impl = resolve("flashinfer_mla").load()
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu"}), lse_base="e")
    from mla_bench.problem import build_problem

    workload = sweeps.tiny()[0]
    verdict = judge(impl, build_problem(workload, torch.device("cpu")))
    assert verdict.status == "failed" and any("lse" in v for v in verdict.violations)


def test_flashinfer_empty_requests_get_lse_minus_inf(fake_packages):
    """FlashInfer writes a finite lse for a request with no keys (stand-in: the value seen on an H200); the adapter
    gives those rows -inf, the bench's convention, and only those rows."""
    impl = resolve("flashinfer_mla").load()
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu"}))
    from mla_bench.problem import build_problem
    from mla_bench.workload import Workload

    problem = build_problem(Workload(mode="decode", preset="tiny", q_lens=(1, 2, 1), kv_lens=(9, 0, 5), seed=4))
    verdict = judge(impl, problem)
    assert verdict.status == "passed", verdict.violations
    out, lse = impl.run(impl.plan(problem))
    assert bool(torch.isneginf(lse[1:3]).all()) and bool(torch.isfinite(lse[[0, 3]]).all())
    assert bool((out[1:3] == 0).all())


def test_vllm_splits_follow_vllm_033_rule():
    """One split per 512 keys of the longest request, rounded up to a power of two, at most two per SM."""
    from impls.external.vllm_triton import _kv_splits

    assert [_kv_splits(n, 132) for n in (1, 511, 512, 1024, 1600, 4096, 8192)] == [1, 1, 1, 2, 4, 8, 16]
    assert _kv_splits(131072, 132) == 256 and _kv_splits(1 << 20, 132) == 264 and _kv_splits(1 << 20, 2) == 4


def test_vllm_plan_takes_vllm_033_split_count(fake_packages, monkeypatch):
    """With ``is_mla`` the kernel gets vLLM's split count for the batch's longest request, not the old fixed 4: on the
    CPU (one SM, at most two splits) 1100 keys ask for 2, 700 for 1."""
    import importlib

    from mla_bench.problem import build_problem
    from mla_bench.workload import Workload

    module = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
    current, calls = module.decode_attention_fwd, []

    @functools.wraps(current)  # the adapter reads the API from the signature
    def recording(*args, **kwargs):
        calls.append(args[8])
        current(*args, **kwargs)

    monkeypatch.setattr(module, "decode_attention_fwd", recording)
    impl = resolve("vllm_triton_mla").load()
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu"}))
    for kv_lens, splits in (((1100, 40), 2), ((700, 40), 1)):
        verdict = judge(impl, build_problem(Workload(mode="decode", preset="tiny", q_lens=(1, 1), kv_lens=kv_lens)))
        assert verdict.status == "passed" and calls[-1] == splits, (verdict.violations, calls)


def test_vllm_before_is_mla_runs_as_that_backend_did(fake_packages, monkeypatch):
    """A vLLM whose kernel has no ``is_mla``: 4 splits, ``k_scale`` only with an fp8 cache, one query per request
    (uniform multi-token decode refused), and the adapter's plumbing still passes conformance."""
    import importlib

    module = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
    current = module.decode_attention_fwd
    calls = []

    def legacy(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale,
               page_size=1, logit_cap=0.0, k_scale=None):
        assert (k_scale is not None) == (k_buffer.dtype == torch.float8_e4m3fn), "k_scale goes with an fp8 cache"
        calls.append(num_kv_splits)
        scale = k_scale if k_scale is not None else torch.tensor(1.0)
        current(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale,
                page_size, logit_cap, scale, scale, is_mla=True)

    monkeypatch.setattr(module, "decode_attention_fwd", legacy)
    impl = resolve("vllm_triton_mla").load()
    assert impl.capabilities.query_len_kinds == frozenset({"single"}) and "before is_mla" in impl.description
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu"}))
    from mla_bench.problem import build_problem

    verdicts = [judge(impl, build_problem(w, "cpu")) for w in sweeps.conformance(impl.capabilities)
                if impl.capabilities.refusal(w, "cpu") is None]
    assert [v.status for v in verdicts] == ["passed"] * 5 and set(calls) == {4}


def test_flashmla_sparse_decode_takes_power_of_two_scales_and_64_or_128_heads(fake_packages):
    """Its Hopper kernel rounds each tile scale to bf16 (a correct kernel failed on exact fp32 scales, lse off by
    0.01-0.03), and it stops with 'Unsupported h_q' below 64 heads (an error, not a refusal)."""
    from mla_bench.problem import build_problem

    impl = resolve("flashmla").load()
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu", "cuda"}))

    def problem(preset, layout):
        return build_problem(Workload(mode="sparse_decode", q_lens=(1, 1), kv_lens=(80, 40), preset=preset,
                                      layout=layout, page_size=64, topk=16), "cpu")

    assert impl.refusal(problem("kimi-k2", "fp8_ds_mla_pow2")) is None
    assert "takes fp8_ds_mla_pow2; its kernel rounds tile scales to bf16" in impl.refusal(problem("kimi-k2",
                                                                                                  "fp8_ds_mla"))
    assert "16 heads in mode sparse_decode (FlashMLA's sparse decode runs 64 or 128)" in impl.refusal(
        problem("deepseek-v3-tp8", "fp8_ds_mla_pow2"))


DIST_INFO = {"flash_mla": ("flash_mla", "1.0.0+abc123"), "flashinfer": ("flashinfer-python", "0.2.5"),
             "vllm": ("vllm", "0.9.1")}
BROKEN = {  # impl: (files of a planted package that is installed but broken, what the error and its cause quote)
    "flashmla": ({"flash_mla/__init__.py": "raise ImportError('/site/flash_mla_cuda.so: undefined symbol: _ZN3c10')"},
                 "undefined symbol: _ZN3c10"),
    "flashmla_sparse": ({"flash_mla/__init__.py": "from flash_mla_cuda import fwd",  # the extension's ABI
                         "flash_mla_cuda.py": "raise ImportError('flash_mla_cuda.so: undefined symbol: _ZN2at', "
                                              "name='flash_mla_cuda')"}, "undefined symbol: _ZN2at"),
    "flashinfer_mla": ({"flashinfer/__init__.py": "from flashinfer.jit import build_mla", "flashinfer/jit.py": ""},
                       "cannot import name 'build_mla'"),
    "vllm_triton_mla": ({"vllm/__init__.py": ""}, "No module named 'vllm.attention'"),  # nor 'vllm.v1'
}
OLD_API = {  # impl: files of an installed package of another version, without the name the adapter calls
    "flashmla_sparse": {"flash_mla/__init__.py": "def get_mla_metadata(): ...\ndef flash_mla_with_kvcache(): ..."},
    "flashinfer_mla": {"flashinfer/__init__.py": "", "flashinfer/mla.py": "class BatchMLAWrapper: ..."},
    "vllm_triton_mla": {"vllm/__init__.py": "", "vllm/attention/__init__.py": "", "vllm/attention/ops/__init__.py": "",
                        "vllm/attention/ops/triton_decode_attention.py": "def decode_attention(): ..."},
}


@pytest.fixture
def plant(monkeypatch, tmp_path):
    """Writes a package (with its distribution's metadata) into a directory put first on sys.path."""
    planted: set[str] = set()

    def write(files: dict[str, str]) -> None:
        tops = {rel.split("/")[0].removesuffix(".py") for rel in files}
        _hide_loaded(monkeypatch, *(tops - planted))  # never a planted one: monkeypatch would put it back
        planted.update(tops)
        for rel, text in files.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
        for top in planted & DIST_INFO.keys():
            dist, version = DIST_INFO[top]
            info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
            info.mkdir(exist_ok=True)
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
            (info / "top_level.txt").write_text(f"{top}\n")
        monkeypatch.syspath_prepend(str(tmp_path))

    yield write
    _forget(*planted)


class _Absent(importlib.abc.MetaPathFinder):
    """Finds no ``top``, as Python says of a package that is not installed."""

    def __init__(self, top: str) -> None:
        self.top = top

    def find_spec(self, name, path=None, target=None):
        if name == self.top:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _absent_then_planted(monkeypatch, plant, name: str, files: dict[str, str]):
    """Loads ``name`` with its package absent (must be not installed), then with ``files`` planted: the error."""
    top = next(iter(files)).split("/")[0]
    _hide_loaded(monkeypatch, top)
    with monkeypatch.context() as absent:  # whatever this machine has installed
        absent.setattr(sys, "meta_path", [_Absent(top), *sys.meta_path])
        with pytest.raises(ImplNotInstalled, match="not installed"):
            resolve(name).load()
    plant(files)
    with pytest.raises(Exception) as info:
        resolve(name).load()
    assert not isinstance(info.value, ImplNotInstalled), f"a broken {top} is listed as absent: {info.value}"
    dist, version = DIST_INFO[top]
    assert f"{top} ({dist} {version}) is installed" in str(info.value)
    return info.value


@pytest.mark.parametrize("fixture", ["fake_packages", "plant"])
def test_stand_ins_replace_a_real_package_already_imported(monkeypatch, request, fixture):
    """Where vLLM is installed, this process imported it before the stand-ins go on the path (the skipif above
    loads every adapter): the stand-in and planted packages must still be the ones imported, the real one back after."""
    real = types.ModuleType("vllm")
    monkeypatch.setitem(sys.modules, "vllm", real)
    put = request.getfixturevalue(fixture)
    if fixture == "plant":
        put({"vllm/__init__.py": ""})
    vllm = importlib.import_module("vllm")
    assert vllm is not real and vllm.__file__  # a file on the path, not the module imported before


@pytest.mark.parametrize("name", BROKEN)
def test_planted_broken_package_is_an_error_naming_it_not_absent(monkeypatch, plant, name):
    """A package that is there but fails to import (an extension of another ABI, a name missing inside it, none of
    the module paths) is an error naming the package, its version and the cause (chained); absent, not installed."""
    files, quoted = BROKEN[name]
    error = _absent_then_planted(monkeypatch, plant, name, files)
    from impls.external import BrokenPackage

    assert isinstance(error, BrokenPackage) and quoted in str(error)
    assert isinstance(error.__cause__, ImportError) and quoted in str(error.__cause__)


@pytest.mark.parametrize("name", OLD_API)
def test_planted_package_without_the_called_name_is_an_error(monkeypatch, plant, name):
    """An installed version without the function or class the adapter calls is an error at load, naming it."""
    error = _absent_then_planted(monkeypatch, plant, name, OLD_API[name])
    from impls.external import BrokenPackage

    assert isinstance(error, BrokenPackage) and isinstance(error.__cause__, AttributeError)
    assert {"flashmla_sparse": "'flash_mla_sparse_fwd'", "flashinfer_mla": "'BatchMLAPagedAttentionWrapper'",
            "vllm_triton_mla": "'decode_attention_fwd'"}[name] in str(error)


def test_planted_broken_flash_mla_is_cannot_load_in_list_and_an_error_in_a_run(plant, capsys):
    """Where users see it: ``mla-bench list`` says cannot load (exit 1), a run gives an error result, not skips."""
    from mla_bench.cli import main

    plant(BROKEN["flashmla"][0])
    assert main(["list"]) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if "flashmla " in line)
    assert "cannot load" in line and "not installed" not in line
    run = execute(RunOptions(impls=["flashmla"], device="cpu", preset="tiny", modes=["decode"]))
    assert [r.status for r in run.results] == ["error"] and not run.ok
    assert "flash_mla (flash_mla 1.0.0+abc123) is installed" in run.results[0].message


def test_a_vllm_whose_kernel_returns_no_lse_is_an_error_naming_it_not_absent(fake_packages, monkeypatch):
    """An installed vLLM of a version without the lse output was listed as not installed and skipped."""
    import importlib

    from impls.external import BrokenPackage

    module = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")

    def without_lse(q, k_buffer, v_buffer, o, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale):
        raise AssertionError("never called")

    monkeypatch.setattr(module, "decode_attention_fwd", without_lse)
    with pytest.raises(BrokenPackage, match=r"^vllm \(.*\) is installed but its decode_attention_fwd returns no lse"):
        resolve("vllm_triton_mla").load()
