"""The judge's contract: ``run`` returns two tensors on the problem's device, ``out`` in the problem's dtype, and
leaves the problem's tensors as they were (one that writes into them fails, naming them, and they are restored);
a broken impl class is refused when it is resolved, naming what is wrong."""

from __future__ import annotations

import math
import os
import random
import re
import tempfile
import textwrap
import threading

import pytest
import torch

import planted_impls as planted
from mla_bench.errors import UnsupportedConfig
from mla_bench.problem import build_problem
from mla_bench.registry import Capabilities, ImplNotInstalled, resolve
from mla_bench.tolerances import BF16_CACHE_OF_WIDER_VALUES, tolerance_for
from mla_bench.workload import Workload
from suites.judge import References, judge


def _problem(dtype: str = "bfloat16"):
    """A decode problem of fresh random inputs, with an empty request and spare (poisoned) pages."""
    return build_problem(Workload(mode="decode", q_lens=(1, 2, 1), kv_lens=(37, 50, 0), page_size=16, dtype=dtype,
                                  seed=random.randint(1, 10 ** 6)))


class Bends(planted.PlainDecode):
    """The right answer, then ``bend(problem, out, lse)``: what a mistaken kernel returns or does."""

    name = "bends"

    def __init__(self, bend=lambda p, out, lse: (out, lse)):
        self.bend = bend

    def run(self, p):
        return self.bend(p, *super().run(p))


def _spare_page(p) -> int:
    """A page no request reads."""
    page = p.meta.page_size
    used = {int(p.meta.block_table[b, i]) for b, n in enumerate(p.meta.kv_lens) for i in range(-(-n // page))}
    return min(set(range(p.cache.num_blocks)) - used)


@pytest.mark.parametrize("dtype, bend, message", [
    ("bfloat16", lambda p, out, lse: out, "run must return (out, lse), two tensors; it returned a Tensor"),
    ("bfloat16", lambda p, out, lse: None, "it returned a NoneType"),
    ("bfloat16", lambda p, out, lse: (out, lse, None), "it returned a tuple of (Tensor, Tensor, NoneType)"),
    ("bfloat16", lambda p, out, lse: (out.float(), lse),
     "out is torch.float32 [4, 4, 512]; the problem's dtype is torch.bfloat16"),
    ("float32", lambda p, out, lse: (out.bfloat16(), lse),
     "out is torch.bfloat16 [4, 4, 512]; the problem's dtype is torch.float32"),
    ("bfloat16", lambda p, out, lse: (out, lse.to("meta")), "lse is on meta; the problem is on cpu"),
    ("bfloat16", lambda p, out, lse: (out, lse * (1 + 7j)), "lse is torch.complex64 [4, 4]; it must be real floating"),
    ("bfloat16", lambda p, out, lse: (out, lse.round().int()), "lse is torch.int32 [4, 4]; it must be real floating"),
], ids=["only-out", "none", "three", "float32-out", "bf16-out", "lse-elsewhere", "complex-lse", "int-lse"])
def test_outputs_that_break_the_contract_are_errors_naming_the_breach(dtype, bend, message):
    problem = _problem(dtype)
    assert judge(Bends(), problem).status == "passed"
    verdict = judge(Bends(bend), problem)
    assert verdict.status == "error" and message in verdict.message, verdict.message


class WritesLater(planted.PlainDecode):
    """Leaves a thread that doubles ``q`` once ``go`` is set (after its judge is done), then sets ``done``."""

    name = "writes_later"

    def __init__(self, go: threading.Event, done: threading.Event):
        self.go, self.done = go, done

    def run(self, p):
        def write():
            self.go.wait()
            p.q.mul_(2)
            self.done.set()
        threading.Thread(target=write, name="writes-later", daemon=True).start()
        self.run = super().run  # one thread
        return super().run(p)


class StartsTheWrite(planted.PlainDecode):
    """Correct, but its plan lets ``WritesLater``'s thread write, and waits for it."""

    name = "starts_the_write"

    def __init__(self, go: threading.Event, done: threading.Event):
        self.go, self.done = go, done

    def plan(self, problem):
        self.go.set()
        self.done.wait(10)
        return problem


class LeavesADeletedDirectory(planted.PlainDecode):
    """Its plan builds in a temporary directory it moved into, and leaves the process there once it is deleted."""

    name = "leaves_a_deleted_directory"

    def plan(self, problem):
        with tempfile.TemporaryDirectory() as build:
            os.chdir(build)
        return problem


def test_an_impl_that_leaves_a_deleted_working_directory_fails_and_the_next_impl_passes():
    """os.getcwd() raised once the directory was gone: every later impl's guard errored, nothing was put back."""
    problem, here = _problem(), os.getcwd()
    verdict = judge(LeavesADeletedDirectory(), problem)
    assert verdict.status == "failed" and f"the working directory (now a deleted directory, was {here})" in \
        "; ".join(verdict.violations), verdict.violations
    assert os.getcwd() == here and judge(planted.PlainDecode(), problem).status == "passed"


def test_an_output_that_is_a_view_of_an_input_is_judged_on_its_values_not_blamed_for_the_judges_write():
    """The judge NaN-filled a returned view of q between its runs, then failed the impl for writing into q."""
    verdict = judge(Bends(lambda p, out, lse: (p.q[..., :512], lse)), _problem())
    assert verdict.status == "failed" and not any("wrote into its inputs" in v for v in verdict.violations), \
        verdict.violations


def test_a_write_by_a_thread_an_earlier_impl_left_running_names_that_thread():
    """The write of a thread the first impl left running was blamed on the next impl alone (helper 89)."""
    problem, go, done = _problem(), threading.Event(), threading.Event()
    assert judge(WritesLater(go, done), problem).status == "passed"
    verdict = judge(StartsTheWrite(go, done), problem)
    assert verdict.status == "failed" and "by a thread an earlier impl left running: writes-later" in \
        "; ".join(verdict.violations), verdict.violations


class Refuses(planted.PlainDecode):
    """Refuses every problem, with ``reason``."""

    name = "refuses"

    def __init__(self, *reason):
        self.reason = reason

    def plan(self, problem):
        raise UnsupportedConfig(*self.reason)


@pytest.mark.parametrize("reason, status", [(("",), "error"), ((" \n",), "error"), ((None,), "error"), ((), "error"),
                                            (("", ""), "error"), ((object(),), "error"),
                                            (("no page size 16",), "unsupported")])
def test_a_refusal_must_give_its_reason(reason, status):
    """None, an empty pair or an object passed as "None", "('', '')" or the object's repr."""
    verdict = judge(Refuses(*reason), _problem())
    assert verdict.status == status
    assert (verdict.message == reason[0]) if status == "unsupported" else "with no reason" in verdict.message


def _write_q(p, out, lse):
    p.q[0, 0, :3] += 1


def _write_spare_page(p, out, lse):
    p.cache.data[_spare_page(p)].fill_(7)


def _shuffle_block_table(p, out, lse):
    p.meta.block_table[1] = p.meta.block_table[1].flip(0)


def _rebind_q(p, out, lse):
    p.q = p.q.clone()
    p.q[0, 0, :3] += 1


@pytest.mark.parametrize("name, write", [("q", _write_q), ("cache.data", _write_spare_page),
                                         ("meta.block_table", _shuffle_block_table), ("q", _rebind_q)])
def test_an_impl_writing_into_its_inputs_fails_naming_them_and_they_are_restored(name, write):
    problem = _problem()
    inputs = lambda: (problem.q, problem.cache.data, problem.meta.block_table)  # noqa: E731
    before = [tensor.clone() for tensor in inputs()]
    verdict = judge(Bends(lambda p, out, lse: write(p, out, lse) or (out, lse)), problem)
    assert verdict.status == "failed" and verdict.violations == [
        v for v in verdict.violations if v.startswith(f"wrote into its inputs: {name} (")], verdict.violations
    assert all(torch.equal(tensor, saved) for tensor, saved in zip(inputs(), before))
    assert judge(planted.PlainDecode(), problem).status == "passed"


def test_a_kernel_reading_one_page_past_each_request_is_flagged_on_a_uniform_batch_of_whole_pages():
    """Every row full before the block table's spare column (width 2 = the pages each request needs): requests 0
    and 1 read the next row's first page (real keys, weighted 0: their rows were right, to float32 rounding) and the
    last request read past the table's end, an IndexError in torch (an ``error`` verdict; on a GPU, whatever lies
    past the tensor). Now the entry past each request's last page is a spare (NaN) page, which the masked keys' 0
    weights do not hide."""
    problem = build_problem(Workload(mode="decode", q_lens=(1, 2, 1), kv_lens=(32, 32, 32), page_size=16,
                                     seed=random.randint(1, 10 ** 6)))
    assert judge(planted.PlainDecode(), problem).status == "passed"
    verdict = judge(planted.ReadsOnePagePast(), problem)
    assert verdict.status == "failed" and "NaN/Inf positions differ" in "; ".join(verdict.violations), \
        (verdict.violations, verdict.message[-500:])


class ChangesInPlan(planted.PlainDecode):
    """Right answers, but ``plan`` changes the problem with ``change(problem)`` first."""

    name = "changes_in_plan"

    def __init__(self, change):
        self.change = change

    def plan(self, problem):
        self.change(problem)
        return problem


def _widen_block_table(p):
    p.meta.block_table.data = p.meta.block_table.long()  # the same object and values, another dtype


@pytest.mark.parametrize("change, name", [
    (lambda p: setattr(p, "scale", p.scale * 576 ** -0.5 / 192 ** -0.5), "scale (rebound)"),  # 1/sqrt(576) as run reads
    (lambda p: setattr(p.meta, "kv_lens", tuple(n // 2 for n in p.meta.kv_lens)), "meta.kv_lens (rebound)"),
    (_widen_block_table, "meta.block_table (now torch.int64 [3, 5] in place, was torch.int32 [3, 5])"),
    (lambda p: p.meta.seq_lens.unsqueeze_(0), "meta.seq_lens (now torch.int32 [1, 3] in place, was torch.int32 [3])"),
    (lambda p: object.__setattr__(p.workload, "kv_lens", p.workload.kv_lens[::-1]), "workload.kv_lens (rebound)"),
    (lambda p: object.__setattr__(p.dims, "num_heads", 1), "dims.num_heads (rebound)"),
    (lambda p: object.__setattr__(p.cache.layout, "stray", 1), "cache.layout.stray (added)"),
])
def test_a_plan_that_changes_a_field_or_a_tensors_layout_fails_naming_it_and_the_next_impl_sees_it_undone(
        change, name):
    """Only tensor values were checked: a plan that rebound ``scale`` (which the reference then read) passed, and
    the correct impl judged after it on the same references failed; an in-place dtype or shape change passed; so did
    a frozen workload, dims or layout rewritten with ``object.__setattr__``."""
    problem = _problem()
    refs = References.of(problem)

    def fields():
        return (problem.scale, problem.meta.kv_lens, problem.meta.block_table.dtype, problem.meta.seq_lens.shape,
                vars(problem.workload).copy(), vars(problem.dims).copy(), vars(problem.cache.layout).copy())

    found = fields()
    for verdict in (judge(ChangesInPlan(change), problem), judge(ChangesInPlan(change), problem, refs)):
        assert verdict.status == "failed" and f"wrote into its inputs: {name}" in "; ".join(verdict.violations), \
            verdict.violations
    assert fields() == found
    assert judge(planted.PlainDecode(), problem, refs).status == "passed"


def test_a_bf16_cache_of_float32_values_reports_its_rounding_end_to_end():
    """e2e was the kernel error wherever the layout was bf16, so a float32 problem's cache rounding went unreported."""
    verdict = judge(planted.PlainDecode(), _problem("float32"))
    assert verdict.status == "passed" and verdict.e2e.rel_l2 > 100 * verdict.kernel.rel_l2, verdict.e2e
    assert tolerance_for("float32", "bf16", "e2e") == BF16_CACHE_OF_WIDER_VALUES
    assert tolerance_for("bfloat16", "bf16", "e2e") == tolerance_for("bfloat16", "bf16", "kernel")


def test_the_second_run_of_a_plan_is_judged_and_its_difference_from_the_first_reported():
    problem = _problem()
    plain = judge(planted.PlainDecode(), problem)
    assert plain.status == "passed" and plain.replay_max_abs == 0.0
    assert plain.metrics()["replay_max_abs"] == 0.0 and "kernel.rel_l2" in plain.metrics()
    stale = judge(planted.AccumulatesWithoutReset(), problem)
    assert stale.status == "failed" and stale.violations, stale.violations
    assert all(v.startswith("second run of the same plan: ") for v in stale.violations), stale.violations
    assert stale.kernel.rel_l2 > 0.5 and stale.replay_max_abs > 0.1  # the errors are the failing run's
    calls = iter(range(10))
    jitter = judge(Bends(lambda p, out, lse: (out, lse + 1e-5 * next(calls))), problem)  # within every tolerance
    assert jitter.status == "passed" and 0 < jitter.replay_max_abs < 1e-4, jitter.replay_max_abs
    calls = iter(range(10))
    wrong = judge(Bends(lambda p, out, lse: (torch.zeros_like(out), lse + 1e-5 * next(calls))), problem)
    assert wrong.status == "failed" and wrong.replay_max_abs is None  # wrong at once: not run again
    assert wrong.violations and not any(v.startswith("second run") for v in wrong.violations), wrong.violations


@pytest.mark.parametrize("second, message, difference", [
    (lambda out, lse: (out, lse[:, :1]), "lse has shape [4, 1], the first run's [4, 4]", math.inf),
    (lambda out, lse: (out, torch.where(lse.isfinite(), float("inf"), lse)), "NaN/Inf positions differ", math.inf),
], ids=["lse-shape", "lse-inf"])
def test_a_second_run_of_another_shape_or_infinities_differs_by_inf(second, message, difference):
    calls = iter(range(2))
    bent = Bends(lambda p, out, lse: second(out, lse) if next(calls) else (out, lse))
    verdict = judge(bent, _problem())
    assert verdict.status == "failed" and verdict.replay_max_abs == difference
    assert any(v.startswith("second run of the same plan: ") and message in v for v in verdict.violations), \
        verdict.violations


def test_an_input_written_by_both_runs_is_named_once():
    widths = iter((3, 5))

    def bump_q(p, out, lse):  # three elements in the first run, five in the second
        p.q[0, 0, :next(widths)] += 1
        return out, lse

    verdict = judge(Bends(bump_q), _problem())
    assert verdict.violations == ["wrote into its inputs: q (3 elements) (restored for the next impl)"]


def test_a_second_run_that_raises_is_an_error_naming_it():
    calls = iter(range(2))

    def second_raises(p, out, lse):
        if next(calls):
            raise RuntimeError("counter left set")
        return out, lse

    verdict = judge(Bends(second_raises), _problem())
    assert verdict.status == "error" and "second run of the same plan raised" in verdict.message
    assert "counter left set" in verdict.message


BROKEN = textwrap.dedent('''
    from mla_bench.registry import Capabilities, Impl

    class NoName(Impl):
        capabilities = Capabilities(modes={"decode"})

        def plan(self, problem):
            return problem

        def run(self, plan):
            return None

    class NoCapabilities(NoName):
        name = "no_capabilities"
        capabilities = None

    class Blank(NoName):
        name = "   "

    class TwoLines(NoName):
        name = "two\\nlines"

    class NamedAll(NoName):
        name = "all"

    class WithComma(NoName):
        name = "mine,yours"
''')


@pytest.mark.parametrize("attr, message", [
    ("NoName", "the class attribute 'name' must be a non-empty string"),
    ("NoCapabilities", "the class attribute 'capabilities' must be a Capabilities, got NoneType"),
    ("Absent", "has no attribute 'Absent'"),
    ("Blank", "the class attribute 'name' is '   '; a name is printable"),  # a blank column in the summary
    ("TwoLines", r"the class attribute 'name' is 'two\\nlines'"),
    ("NamedAll", "the class attribute 'name' is 'all'"),  # --impl all,NAME could not name it
    ("WithComma", "the class attribute 'name' is 'mine,yours'"),  # --impl lists are comma-separated
])
def test_a_broken_impl_class_is_refused_when_resolved_naming_what_is_wrong(tmp_path, monkeypatch, attr, message):
    module = f"user_impls_{random.randint(0, 10 ** 9)}"
    (tmp_path / f"{module}.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=message):
        resolve(f"{module}:{attr}")


def test_a_module_that_raises_on_import_is_refused_with_its_error_and_capabilities_must_declare_a_mode(
        tmp_path, monkeypatch):
    module = f"user_impls_{random.randint(0, 10 ** 9)}"
    (tmp_path / f"{module}.py").write_text("raise RuntimeError('no driver found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=f"importing {module} raised RuntimeError: no driver found"):
        resolve(f"{module}:MyMLA")
    with pytest.raises(ValueError, match="Capabilities.modes is empty"):
        Capabilities(modes=frozenset())


@pytest.mark.parametrize("line, error, says", [
    ("from mla_bench.workload import derive_seeds", ValueError, "(a name missing from the impl's own code"),
    ("import impls.triton.no_such_module", ValueError, "No module named 'impls.triton.no_such_module'"),
    ("import no_such_kernel_package", ImplNotInstalled, "No module named 'no_such_kernel_package'"),
    ("from torch import no_such_function", ImplNotInstalled, "cannot import name 'no_such_function'"),
    ("raise ImportError('needs the vendor library')", ImplNotInstalled, "needs the vendor library"),
])
def test_an_import_error_is_not_installed_only_where_a_package_is_absent(tmp_path, monkeypatch, line, error, says):
    """A typo in the project's or the impl's own imports read as "not installed": skipped, the run passing."""
    module = f"user_impls_{random.randint(0, 10 ** 9)}"
    (tmp_path / f"{module}.py").write_text(line + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(error, match=re.escape(says)):
        resolve(f"{module}:MyMLA")


@pytest.mark.parametrize("field, value, says", [
    ("layouts", {"bf16", "fp8-ds-mla"}, "Capabilities.layouts: unknown values ['fp8-ds-mla']"),
    ("layouts", "fp8_ds_mla_pow2", "Capabilities.layouts must be a set of values, got 'fp8_ds_mla_pow2'"),
    ("devices", {"gpu"}, "Capabilities.devices: unknown values ['gpu']"),
    ("page_sizes", 64, "Capabilities.page_sizes must be a set of values, got 64"),
    ("page_sizes", {64, 0}, "Capabilities.page_sizes must hold positive ints, got ['0']"),
    ("head_counts", {16, True}, "Capabilities.head_counts must hold positive ints, got ['True']"),
    ("modes", "decode", "Capabilities.modes must be a set of values, got 'decode'"),
])
def test_capabilities_refuse_a_misspelt_or_malformed_declaration(field, value, says):
    """Each was accepted: a misspelt layout or device made every workload needing it "unsupported" silently, a
    string matched its substrings ("fp8_ds_mla" in "fp8_ds_mla_pow2"), an int failed later in refusal."""
    with pytest.raises(ValueError, match=re.escape(says)):
        Capabilities(**{"modes": {"decode"}, field: value})
    assert Capabilities(modes={"decode"}, layouts=["bf16"], page_sizes=(16, 64)).page_sizes == {16, 64}


def _in_run(change):
    """An impl that answers right and then makes ``change`` to the problem, in every run."""
    return Bends(lambda p, out, lse: change(p) or (out, lse))


@pytest.mark.parametrize("impl, name", [
    (ChangesInPlan(lambda p: delattr(p, "scale")), "scale (deleted)"),
    (_in_run(lambda p: delattr(p, "scale")), "scale (deleted)"),
    (_in_run(lambda p: delattr(p.meta, "kv_lens")), "meta.kv_lens (deleted)"),
    (ChangesInPlan(lambda p: setattr(p, "workspace", torch.empty(8))), "workspace (added)"),
    (_in_run(lambda p: setattr(p.meta, "cursor", 3)), "meta.cursor (added)"),
], ids=["delete-in-plan", "delete-in-run", "delete-meta-in-run", "add-in-plan", "add-meta-in-run"])
def test_an_impl_deleting_or_adding_a_field_fails_naming_it_and_the_next_impl_sees_the_problem_as_given(impl, name):
    """A deleted field made the judge raise AttributeError while restoring it; an added one passed unnoticed."""
    problem = _problem()
    refs = References.of(problem)
    owners = (problem, problem.meta, problem.cache)
    given = [dict(vars(owner)) for owner in owners]
    verdict = judge(impl, problem, refs)
    assert verdict.status == "failed" and verdict.violations == [
        f"wrote into its inputs: {name} (restored for the next impl)"], verdict.violations
    assert all(vars(owner).keys() == fields.keys() and all(vars(owner)[k] is v for k, v in fields.items())
               for owner, fields in zip(owners, given))
    assert judge(planted.PlainDecode(), problem, refs).status == "passed"
