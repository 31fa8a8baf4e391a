"""Presets, softmax scale, Workload validation and serialization, Problem construction, impl registration."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re

import pytest
import torch

from mla_bench.compare import compare, normalize_lse
from mla_bench.dims import PRESETS, get_preset
from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import POISON_BYTE
from mla_bench.problem import build_problem
from mla_bench.registry import Capabilities, Impl, ImplNotInstalled, discover, resolve
from mla_bench.tolerances import tolerance_for
from mla_bench.workload import SEED_LIMIT, Mode, Workload


def test_softmax_scales_match_the_models():
    assert get_preset("deepseek-v3").softmax_scale == pytest.approx(0.1352338, abs=5e-8)
    assert get_preset("deepseek-v2-lite").softmax_scale == pytest.approx(0.1147214, abs=5e-8)
    assert {name: dims.num_heads for name, dims in PRESETS.items()} == {
        "deepseek-v3": 128, "deepseek-v3-tp8": 16, "deepseek-v2-lite": 16, "kimi-k2": 64, "tiny": 4}
    for dims in PRESETS.values():
        assert (dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim, dims.v_head_dim) == (512, 64, 128, 128)


@pytest.mark.parametrize("field, value, says", [
    ("num_heads", True, "MLADims.num_heads must be a positive int, got True"),
    ("q_lora_rank", "1536", "MLADims.q_lora_rank must be a positive int or None, got '1536'"),  # was a TypeError
    ("rope_factor", float("nan"), "MLADims.rope_factor must be a finite number > 0, got nan"),  # NaN softmax_scale
    ("mscale_all_dim", -1.0, "MLADims.mscale_all_dim must be a finite number >= 0, got -1.0"),
])
def test_model_dims_refuse_a_bad_field_by_name(field, value, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        dataclasses.replace(get_preset("deepseek-v3"), **{field: value})


def test_workload_label_is_one_line_and_json_roundtrips():
    w = Workload.uniform("decode", 32, 1, 4096, preset="deepseek-v3-tp8", layout="fp8_ds_mla")
    assert w.label == "decode deepseek-v3-tp8 h16 b32 q1 ctx4096 ps64 fp8_ds_mla"
    mixed = Workload(mode="sparse_prefill", q_lens=(3, 1), kv_lens=(40, 9), topk=8, seed=3)
    assert "\n" not in mixed.label and "topk8 paged" in mixed.label and "#" in mixed.label
    for workload in (w, mixed):
        again = Workload.from_dict(json.loads(json.dumps(workload.to_dict())))
        assert again == workload and hash(again) == hash(workload) and again.key == workload.key
    assert Workload(mode="decode", q_lens=(3, 1), kv_lens=(40, 10)).label != \
        Workload(mode="decode", q_lens=(3, 1), kv_lens=(40, 9)).label


def test_prefill_workloads_of_two_page_sizes_have_two_labels():
    """Prefill reads no cache, so its label left the page size out; but the page size sizes the block table drawn
    before the inputs, so two page sizes were two problems under one label (the report keeps one row a label)."""
    kv = random.randint(33, 300)
    default = Workload.uniform("prefill", random.randint(1, 3), random.randint(1, kv), kv, seed=random.randrange(99))
    other = default.replace(page_size=random.choice([1, 8, 16, 32]))
    assert not torch.equal(build_problem(default).q, build_problem(other).q)
    assert default.label != other.label and " ps" not in default.label  # the default keeps the labels of baselines


def test_query_length_kinds():
    assert Workload(mode="decode", q_lens=(1, 1), kv_lens=(5, 6)).query_len_kind == "single"
    assert Workload(mode="decode", q_lens=(2, 2), kv_lens=(5, 6)).query_len_kind == "uniform"
    assert Workload(mode="decode", q_lens=(1, 3), kv_lens=(5, 6)).query_len_kind == "varlen"


@pytest.mark.parametrize("fields, message", [
    (dict(q_lens=(1, -1), kv_lens=(3, 3)), "must be >= 0"),
    (dict(q_lens=(4,), kv_lens=(3,)), "query longer than context"),
    (dict(q_lens=(1,), kv_lens=(3, 4)), "q_lens has 1 requests but kv_lens has 2"),
    (dict(q_lens=(), kv_lens=()), "at least one request"),
    (dict(q_lens=(0,), kv_lens=(3,)), "at least one query token"),
    (dict(q_lens=(1.5,), kv_lens=(3,)), "must hold ints"),
    (dict(q_lens=(1,), kv_lens=(3,), mode="sparse_decode", topk=4), "larger than the longest context"),
    (dict(q_lens=(1,), kv_lens=(3,), mode="sparse_decode"), "needs topk"),
    (dict(q_lens=(1,), kv_lens=(3,), topk=2), "only for sparse modes"),
    (dict(q_lens=(1,), kv_lens=(3,), mode="dcp", dcp_world=0), "dcp_world must be a positive int"),
    (dict(q_lens=(1,), kv_lens=(3,), mode="dcp", dcp_interleave=0), "dcp_interleave must be a positive int"),
    (dict(q_lens=(1,), kv_lens=(3,), dcp_world=2), "only for mode dcp"),
    (dict(q_lens=(1,), kv_lens=(3,), mode="chunked_prefill"), "needs chunk_size"),
    (dict(q_lens=(1,), kv_lens=(0,), mode="prefill"), "needs the new tokens as keys"),
    (dict(q_lens=(1,), kv_lens=(3,), mode="prefill", layout="fp8_ds_mla"), "leave layout"),
    (dict(q_lens=(1,), kv_lens=(3,), mode="flash"), "unknown mode"),
    (dict(q_lens=(1,), kv_lens=(3,), layout="int4"), "unknown cache layout"),
    (dict(q_lens=(1,), kv_lens=(3,), preset="llama"), "unknown preset"),
    (dict(q_lens=(1,), kv_lens=(3,), dtype="int8"), "dtype must be one of"),
    (dict(q_lens=(1,), kv_lens=(3,), page_size=0), "page_size must be a positive int"),
    (dict(q_lens=(1,), kv_lens=(3,), num_heads=0), "num_heads must be a positive int"),
    (dict(q_lens=(1,), kv_lens=(3,), seed=-1), "seed must be an int >= 0"),
    (dict(q_lens=(1,), kv_lens=(3,), seed=2 ** 32), r"seed must be an int >= 0 and < 2\*\*32"),
    (dict(q_lens=(1,), kv_lens=(3,), seed=True), "seed must be an int .*, got True"),
    (dict(q_lens=(1,), kv_lens=(3,), seed=1.0), "seed must be an int .*, got 1.0"),
])
def test_bad_workloads_name_the_problem(fields, message):
    fields = {"mode": "decode", **fields}
    with pytest.raises(ValueError, match=message):
        Workload(**fields)


@pytest.mark.parametrize("field, value, message", [
    ("preset", ["tiny"], r"unknown preset \['tiny'\]"),
    ("preset", {"name": "tiny"}, r"unknown preset \{'name': 'tiny'\}"),
    ("layout", ["bf16"], r"unknown cache layout \['bf16'\]"),
    ("preset", 7, "unknown preset 7"),
])
def test_from_dict_refuses_a_preset_or_layout_that_is_not_a_name(field, value, message):
    """An unhashable name from JSON failed the registry look-up with ``TypeError: unhashable type``."""
    with pytest.raises(ValueError, match=message):
        Workload.from_dict({"mode": "decode", "q_lens": [1], "kv_lens": [2], field: value})


def test_every_seed_accepted_draws_its_own_inputs():
    """Seeds up to 2**64 were accepted, but the generator keeps 32 bits: ``s`` and ``s + 2**32`` were two workloads
    with one problem. The largest seed accepted builds, and differs from seed 0 and from the next smallest."""
    largest = Workload(mode="decode", q_lens=(1,), kv_lens=(4,), seed=2 ** 32 - 1)
    problems = [build_problem(largest.replace(seed=seed)) for seed in (0, 2 ** 32 - 2, 2 ** 32 - 1)]
    assert problems[-1].q.shape == (1, 4, 576)
    assert not any(torch.equal(problems[-1].q, other.q) for other in problems[:-1])
    wrapped = [torch.randn(4, generator=torch.Generator().manual_seed(seed)) for seed in (5, 5 + SEED_LIMIT)]
    assert torch.equal(*wrapped)  # why the limit: a larger seed would repeat a smaller one's inputs


def test_build_problem_on_cuda_without_cuda_is_a_value_error(monkeypatch):
    """torch raised ``AssertionError: Torch not compiled with CUDA enabled``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w = Workload(mode="decode", q_lens=(1,), kv_lens=(4,), seed=int(torch.randint(100, ())))
    for device in ("cuda", torch.device("cuda:1")):
        with pytest.raises(ValueError, match=r"the problem on cuda(:1)?, but CUDA is not available \(decode "):
            build_problem(w, device)
    with pytest.raises(ValueError, match="cache on cuda, but CUDA is not available"):
        build_problem(w.replace(cache_device="cuda"))
    assert build_problem(w, "cpu").q.device.type == "cpu"


def test_from_dict_refuses_foreign_data():
    with pytest.raises(ValueError, match="unknown workload fields"):
        Workload.from_dict({"mode": "decode", "q_lens": [1], "kv_lens": [2], "evil": 1})
    with pytest.raises(ValueError, match="missing fields"):
        Workload.from_dict({"mode": "decode"})
    with pytest.raises(ValueError, match="JSON object"):
        Workload.from_dict([1, 2])


def test_problems_are_deterministic_in_the_seed_and_never_zero():
    w = Workload(mode="decode", q_lens=(1, 2), kv_lens=(30, 70), page_size=16, seed=5)
    a, b = build_problem(w), build_problem(w)
    c = build_problem(w.replace(seed=6))
    assert torch.equal(a.q, b.q) and torch.equal(a.cache.data, b.cache.data)
    assert torch.equal(a.meta.block_table, b.meta.block_table)
    assert not torch.equal(a.q, c.q)
    assert bool((a.q != 0).all()) and bool((a.kv != 0).all())


def test_problem_cache_is_poisoned_outside_written_slots_and_blocks_are_permuted():
    w = Workload(mode="decode", q_lens=(1, 1, 1), kv_lens=(30, 70, 16), page_size=16, seed=1)
    p = build_problem(w)
    rows = p.cache.rows()
    written = torch.zeros(rows.shape[0], dtype=torch.bool)
    written[p.meta.token_slots] = True
    assert bool((rows[~written] == POISON_BYTE).all())
    assert not bool((rows[written] == POISON_BYTE).all(dim=1).any())
    owned = {int(s) // 16 for s in p.meta.token_slots}
    table = p.meta.block_table
    needed = [2, 5, 1]
    owned_in_order = [int(x) for b, n in enumerate(needed) for x in table[b, :n]]
    assert owned_in_order != sorted(owned_in_order)  # a permutation, not the identity
    for b, n in enumerate(needed):  # padding entries point at pages nobody owns
        assert all(int(x) not in owned for x in table[b, n:])


@pytest.mark.parametrize("page_size, kv_lens", [(1, (3, 2)), (13, (26, 9)), (16, (20, 0, 9))])
def test_block_tables_defeat_page_math_that_ignores_them_whatever_the_seed(page_size, kv_lens):
    """The pages were left to the draw: for some seeds page 0 or the last page was owned, or a request's pages were
    consecutive ascending, so a kernel that read page ``j`` for block ``j``, slot -1 as the last slot, or
    ``block_table[b, 0] + j`` passed (seed 0 of the tiny sweep's ragged sparse prefill did)."""
    for seed in range(30):
        p = build_problem(Workload(mode="decode", q_lens=(1,) * len(kv_lens), kv_lens=kv_lens, page_size=page_size,
                                   seed=seed))
        rows = p.cache.rows()
        assert bool((rows[:page_size] == POISON_BYTE).all()) and bool((rows[-page_size:] == POISON_BYTE).all()), seed
        for b, kv_len in enumerate(kv_lens):
            pages = p.meta.block_table[b, :-(-kv_len // page_size)]
            assert pages.numel() < 2 or bool((pages.diff() != 1).any()), (seed, pages.tolist())


@pytest.mark.parametrize("mode, extra", [("decode", {}), ("sparse_decode", {"topk": 3}), ("dcp", {"dcp_world": 2}),
                                         ("chunked_prefill", {"chunk_size": 8}), ("prefill", {})])
def test_a_workloads_cache_bytes_are_those_of_the_cache_its_problem_holds(mode, extra):
    """The runner refuses, before anything runs, a workload whose cache would not fit (``--page-size`` 1,000,000
    failed every result on allocation); it sizes the cache by ``Workload.cache_bytes``."""
    for layout in ("bf16", "fp8_ds_mla", "nvfp4"):
        page_size = random.choice([1, 7, 16, 64])
        kv_lens = (random.randint(3, 40), 0, random.randint(3, 40))
        w = Workload(mode=mode, q_lens=(1, 0, 2), kv_lens=kv_lens, page_size=page_size,
                     layout="bf16" if mode == "prefill" else layout, **extra)
        cache = build_problem(w).cache
        assert w.cache_bytes == (0 if cache is None else cache.data.nbytes) and (mode == "prefill") == (cache is None)


@pytest.mark.parametrize("mode, extra", [("prefill", {}), ("chunked_prefill", {"chunk_size": 8}),
                                         ("sparse_prefill", {"topk": 6}), ("dcp", {"dcp_world": 2})])
def test_problem_shapes_per_mode(mode, extra):
    w = Workload(mode=mode, q_lens=(2, 3), kv_lens=(9, 20), page_size=4, **extra)
    p = build_problem(w)
    width = 576 if Mode(mode).absorbed else 192
    assert p.q.shape == (5, 4, width)
    if mode == "chunked_prefill":
        assert p.k_nope.shape == (5, 4, 128) and p.k_pe.shape == (5, 64) and p.v.shape == (5, 4, 128)
    if mode == "prefill":
        assert p.k_nope.shape == (29, 4, 128) and p.cache is None
    if mode == "sparse_prefill":
        idx = p.topk_indices
        assert idx.shape == (5, 6)
        frontier = torch.tensor([7, 8, 17, 18, 19])[:, None]
        assert bool(((idx == -1) | ((idx >= 0) & (idx <= frontier))).all())
        assert bool(((p.sparse_indices == -1) == (idx == -1)).all())


class PageSixteenOnly(Impl):
    """Declares page size 16 only; its plan would take anything."""

    name = "page16"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), page_sizes=frozenset({16}))

    def plan(self, problem):
        return problem

    def run(self, plan):
        raise AssertionError("not called")


class PageSixteenTimed(PageSixteenOnly):
    """A subclass that overrides plan again and calls the parent's."""

    def plan(self, problem):
        return super().plan(problem)


class PlansAnything:
    """A mixin that is no Impl: its plan is the one a class below inherits."""

    def plan(self, problem):
        return problem


class PageSixteenMixedIn(PlansAnything, Impl):
    name = "page16"
    capabilities = PageSixteenOnly.capabilities

    def run(self, plan):
        raise AssertionError("not called")


@pytest.mark.parametrize("impl", [PageSixteenOnly, PageSixteenTimed, PageSixteenMixedIn])
def test_plan_called_directly_refuses_what_the_impl_did_not_declare(impl):
    """Not only the runner: any caller of plan meets the declared capabilities first."""
    w = Workload(mode="decode", q_lens=(1,), kv_lens=(20,), page_size=16, seed=int(torch.randint(0, 99, ())))
    problem = build_problem(w)
    assert impl().plan(problem) is problem
    with pytest.raises(UnsupportedConfig, match="page16: unsupported page size 64"):
        impl().plan(build_problem(w.replace(page_size=64)))


def _package(tmp_path, monkeypatch, **modules: str) -> str:
    """A fresh package of ``modules`` (name -> source; ``__init__`` included) on sys.path; its name."""
    package = f"user_pkg_{random.randint(0, 10 ** 9)}"
    (tmp_path / package).mkdir()
    for module, source in {"__init__": "", **modules}.items():
        (tmp_path / package / f"{module}.py").write_text(source.replace("PKG", package))
    monkeypatch.syspath_prepend(str(tmp_path))
    return package


@pytest.mark.parametrize("modules", [
    {"mod": "from PKG import no_such_helper\n"},                       # a name missing from its own package
    {"mod": "from PKG.helpers import h\n", "helpers": "from PKG.mod import MyMLA\nh = 1\n"},  # a circular import
])
def test_an_import_error_inside_the_impls_own_package_is_an_error_not_not_installed(tmp_path, monkeypatch, modules):
    """Both read as "not installed" (the ImportError names a package above the impl's module): skipped, run passed."""
    package = _package(tmp_path, monkeypatch, **modules)
    with pytest.raises(ValueError, match=f"importing {package}.mod raised ImportError"):
        resolve(f"{package}.mod:MyMLA")
    with pytest.raises(ImplNotInstalled, match="No module named 'no_such_kernel_pkg'"):
        resolve("no_such_kernel_pkg.mod:MyMLA")


@pytest.mark.parametrize("source, says", [("import sys\nsys.exit(5)\n", "SystemExit: 5"),
                                           ("raise GeneratorExit('closed')\n", "GeneratorExit: closed")])
def test_an_impl_module_that_exits_on_import_is_an_error_not_the_callers_end(tmp_path, monkeypatch, source, says):
    """``sys.exit`` in an impl's module ended ``mla-bench run --impl mod:Class`` and ``list`` with no word (helper
    88); ``--impl all`` and the pytest plugin already caught it. GeneratorExit ended them with a traceback."""
    package = _package(tmp_path, monkeypatch, mod=source)
    with pytest.raises(ValueError, match=f"importing {package}.mod raised {says}"):
        resolve(f"{package}.mod:MyMLA")


@pytest.mark.parametrize("mod, says", [
    ("import os\nfrom impls.torch_eager import TorchEager as MyMLA\nos.environ['TRITON_INTERPRET'] = '0'\n",
     "importing PKG.mod changed the settings every impl of the process shares: $TRITON_INTERPRET (now '0', was "),
    ("import torch\nfrom impls.torch_eager import TorchEager\n\n\nclass MyMLA(TorchEager):\n"
     "    def __init__(self):\n        torch.set_default_dtype(torch.float16)\n",
     "making it changed the settings every impl of the process shares: torch's default dtype (now torch.float16"),
])
def test_an_impl_that_changes_the_processs_settings_when_loaded_is_refused_and_they_are_put_back(
        tmp_path, monkeypatch, mod, says):
    """A module that set TRITON_INTERPRET=0 on import left every Triton impl of a CPU run unsupported, silently."""
    package = _package(tmp_path, monkeypatch, mod=mod)
    before = (os.environ.get("TRITON_INTERPRET"), torch.get_default_dtype())
    with pytest.raises(ValueError) as info:
        resolve(f"{package}.mod:MyMLA").load()
    assert says.replace("PKG", package) in str(info.value), str(info.value)
    assert (os.environ.get("TRITON_INTERPRET"), torch.get_default_dtype()) == before


def test_a_constructor_that_changes_the_processs_settings_and_raises_leaves_them_as_they_were(tmp_path, monkeypatch):
    """Only a constructor that returned had them put back: one that set float64 and then raised left it for every
    later impl (review of 3901129)."""
    mod = ("import torch\nfrom impls.torch_eager import TorchEager\n\n\nclass MyMLA(TorchEager):\n"
           "    def __init__(self):\n        torch.set_default_dtype(torch.float64)\n"
           "        raise RuntimeError('no')\n")
    package = _package(tmp_path, monkeypatch, mod=mod)
    with pytest.raises(RuntimeError, match="no"):
        resolve(f"{package}.mod:MyMLA").load()
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("gpu_visible", [False, True])
def test_an_unset_variable_given_a_value_is_a_change_unless_it_is_the_benchs_own_default(tmp_path, monkeypatch,
                                                                                         gpu_visible):
    """impls.triton sets TRITON_INTERPRET=1 where no GPU is visible and it was unset, before its kernels are defined:
    the import check refused the first Triton impl and deleted the variable, so later kernels compiled for a GPU.
    On a GPU host the same value is a change (later Triton kernels would run interpreted): it passed unseen there."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_visible)
    package = _package(tmp_path, monkeypatch, mod="import os\nfrom impls.torch_eager import TorchEager as MyMLA\n"
                                                  "os.environ.setdefault('TRITON_INTERPRET', '1')\n")
    if not gpu_visible:
        assert resolve(f"{package}.mod:MyMLA").load().name == "torch_eager" and os.environ["TRITON_INTERPRET"] == "1"
        return
    with pytest.raises(ValueError, match=re.escape("$TRITON_INTERPRET (now '1', was unset)")):
        resolve(f"{package}.mod:MyMLA").load()
    assert "TRITON_INTERPRET" not in os.environ


def test_an_unset_cuda_visible_devices_given_a_value_is_refused_and_unset_again(tmp_path, monkeypatch):
    """Workers started later inherit it: an impl that hid the GPUs from them passed as no change."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    package = _package(tmp_path, monkeypatch, mod="import os\nfrom impls.torch_eager import TorchEager as MyMLA\n"
                                                  "os.environ['CUDA_VISIBLE_DEVICES'] = ''\n")
    with pytest.raises(ValueError, match=re.escape("$CUDA_VISIBLE_DEVICES (now '', was unset)")):
        resolve(f"{package}.mod:MyMLA").load()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize("modes, field", [
    ({"decode"}, "page_sizes"), ({"decode"}, "layouts"), ({"prefill"}, "dtypes"), ({"decode"}, "head_counts"),
    ({"decode", "sparse_decode"}, "index_transforms"),
])
def test_capabilities_refuse_an_empty_set_that_a_declared_mode_reads(modes, field):
    """Each was accepted, and the impl was "unsupported" on every workload of the mode (silently under ``all``)."""
    with pytest.raises(ValueError, match=f"Capabilities.{field} is empty"):
        Capabilities(modes=modes, **{field: frozenset()})
    assert Capabilities(modes={"prefill"}, layouts=(), index_transforms=()).layouts == frozenset()  # read by none


GRAPH_SAFE = '''
from mla_bench.registry import Capabilities, Impl

class Unpoisoned(Impl):
    name = "unpoisoned"
    capabilities = Capabilities(modes={"decode"}, graph_safe=True)

    def plan(self, problem):
        return problem

    def run(self, plan):
        return None

class Poisoned(Unpoisoned):
    def poison(self, plan):
        pass
'''


def test_a_graph_safe_impl_must_poison_the_outputs_its_plan_allocates(tmp_path, monkeypatch):
    """Its outputs come from plan: with ``poison`` left a no-op, rows ``run`` never writes kept whatever plan put there
    and passed."""
    package = _package(tmp_path, monkeypatch, mod=GRAPH_SAFE)
    with pytest.raises(ValueError, match="declare graph_safe .* does not override poison"):
        resolve(f"{package}.mod:Unpoisoned")
    assert resolve(f"{package}.mod:Poisoned").load().name == "unpoisoned"


def test_a_name_registered_twice_loads_neither_and_an_entry_point_must_carry_its_class_name(monkeypatch):
    """An entry point named like a builtin, or like another distribution's, was dropped silently (the first won);
    one named otherwise than its class filed its results under the class's name, beside a builtin of that name."""
    import importlib.metadata as metadata

    registered = [("torch_eager", "planted_impls:SlowerTorchEager"), ("plain_decode", "planted_impls:PlainDecode"),
                  ("my_mla", "planted_impls:PlainDecode"), ("plain_sparse", "planted_impls:PlainSparse"),
                  ("plain_sparse", "planted_impls:PlainDecode"),
                  ("torch_eager_host_cache", "impls.torch_eager:TorchEagerHostCache")]
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group: [metadata.EntryPoint(name, value, group) for name, value in registered])
    found = discover()
    for name, target in registered[0], registered[4]:
        with pytest.raises(ValueError, match=f"impl name '{name}' is registered more than once: .*{target}"):
            found[name].load()
    with pytest.raises(ValueError, match="registered as 'my_mla' but its class is named 'plain_decode'"):
        found["my_mla"].load()
    assert found["plain_decode"].load().name == "plain_decode" and found["triton_decode"].origin == "builtin"
    assert found["torch_eager_host_cache"].load().name == "torch_eager_host_cache"  # the same target twice is one


@pytest.mark.parametrize("conventions, message", [
    (dict(base=2), "normalize_lse: base must be one of ('e', '2'), got 2"),
    (dict(base="2.0"), "normalize_lse: base must be one of ('e', '2'), got '2.0'"),
    (dict(empty="+Inf"), "normalize_lse: empty must be one of ('-inf', '+inf'), got '+Inf'"),
])
def test_normalize_lse_refuses_a_convention_capabilities_cannot_declare(conventions, message):
    """Any base but the string "2" (2, "2.0") and any empty-row marker but "+inf" left the lse unconverted."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        normalize_lse(torch.randn(3, 4), **conventions)


def test_a_softmax_scale_that_is_zero_as_a_float_is_refused():
    """Fraction(1, 10**400) passed as positive and then acted as a scale of 0."""
    from fractions import Fraction

    from mla_bench.dims import softmax_scale_problem
    assert softmax_scale_problem(Fraction(1, 10 ** random.randint(400, 500))).endswith("which is 0 as a float")
    assert softmax_scale_problem(Fraction(1, 10)) is None and softmax_scale_problem(5e-324) is None


def test_an_lse_of_the_other_empty_row_convention_is_a_mismatch():
    """An impl that declared FlashMLA's +inf for empty rows and returned -inf passed: -inf was left as it was."""
    live = torch.randn(3, dtype=torch.float64)
    ref_out, ref_lse = torch.zeros(4, 1, 8, dtype=torch.float64), torch.cat([live, torch.tensor([float("-inf")])])
    ref_out[:3] = torch.randn(3, 1, 8, dtype=torch.float64)
    lse = ref_lse.clone()[:, None]
    as_declared = normalize_lse(torch.where(lse.isneginf(), float("inf"), lse), empty="+inf")
    assert compare(ref_out, as_declared, ref_out, ref_lse[:, None]).nonfinite_mismatch == 0
    assert compare(ref_out, normalize_lse(lse, empty="+inf"), ref_out, ref_lse[:, None]).nonfinite_mismatch == 1
    assert compare(ref_out, normalize_lse(lse), ref_out, ref_lse[:, None]).nonfinite_mismatch == 0


@pytest.mark.parametrize("spoil, name, dtype", [
    (lambda t: t.to(torch.complex128) * (1 + 1j), "out", "torch.complex128"),
    (lambda t: t > 0, "out", "torch.bool"),
    (lambda t: (t * 100).long(), "out", "torch.int64"),
])
def test_compare_refuses_outputs_that_are_not_real_floating_point(spoil, name, dtype):
    """A complex out lost its imaginary part in the float64 cast (a UserWarning and perfect metrics); bools and ints
    were compared as numbers."""
    ref, lse = torch.randn(3, 2, 8, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"^compare: {name} must be a real floating-point tensor, got {dtype}$"):
        compare(spoil(ref), lse, ref, lse)


@pytest.mark.parametrize("layout", ["nvfp4_typo", None, ["bf16"]])
def test_tolerance_for_refuses_a_layout_it_does_not_know(layout):
    """An unknown layout (a typo, None) got the kernel bound as its e2e bound, silently looser or tighter."""
    with pytest.raises(ValueError, match=r"no tolerance for cache layout .*; known: bf16, fp8_e4m3, .*nvfp4"):
        tolerance_for("bfloat16", layout, "e2e")


@pytest.mark.parametrize("change, says", [
    (lambda: torch.set_float32_matmul_precision("medium"), "torch.backends.mkldnn.matmul.fp32_precision (now 'bf16'"),
    (lambda: setattr(torch.backends, "fp32_precision", "tf32"), "torch.backends.fp32_precision (now 'tf32'"),
    (lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
     "torch.backends.mkldnn.matmul.fp32_precision (now 'bf16'"),
    (lambda: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction",
                     not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
     "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction (now "),
    (lambda: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction",
                     not torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
     "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction (now "),
    (lambda: torch.use_deterministic_algorithms(True, warn_only=True),
     "torch's deterministic algorithms (now on, warning only, was off)"),
])
def test_torchs_numerics_switches_are_process_settings_named_and_put_back(change, says):
    """TF32 or bf16 matmuls allowed, or deterministic algorithms switched on, by one impl changed the numbers (or
    raised) in every later impl of the process, under their names."""
    from mla_bench.process_state import ProcessState

    before = ProcessState.now()
    change()
    changed = before.restore()
    assert any(says in c for c in changed), changed
    assert ProcessState.now() == before
