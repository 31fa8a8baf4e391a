"""Deliberately broken MLA impls, each with one bug that real kernels shipped, and their correct twins.

Every suite must flag each planted bug: the tests run them through the conformance suite (pytest plugin) and
through ``mla-bench run``. ``PlainDecode``, ``PlainFP8Decode`` and ``PlainSparse`` are the same code without a
bug; they must pass, so a flagged planted impl is flagged for its bug, not for the harness.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import torch

from impls.torch_eager import TorchEager
from mla_bench.layouts import NOPE_DIM
from mla_bench.metadata.reference import blocks_needed, cumulative
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

DECODE = Capabilities(modes=frozenset({Mode.DECODE}), dtypes=frozenset({"bfloat16", "float32"}))
SPARSE = Capabilities(modes=frozenset({Mode.SPARSE_DECODE, Mode.SPARSE_PREFILL}),
                      dtypes=frozenset({"bfloat16", "float32"}), index_transforms=frozenset({"paged"}))


def _softmax_rows(q: torch.Tensor, keys: torch.Tensor, scale: float,
                  seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[H, 576]`` over ``keys`` ``[N, 576]`` in float32: ``(out [H, 512], lse [H])``; the keys where
    ``seen`` (``[N]`` bool, when given) is False get score -inf, weight 0."""
    scores = (q.float() @ keys.float().T) * scale
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[:, None])
    return probs @ keys[:, :NOPE_DIM].float(), lse


class PlainDecode(Impl):
    """Decode over the paged bf16 cache, one query row at a time: correct unless a subclass plants a bug."""

    name = "plain_decode"
    capabilities = DECODE

    def plan(self, problem):
        return problem

    def positions(self, problem, b: int) -> tuple[torch.Tensor, int]:
        """Token positions request ``b`` reads, and the causal frontier offset (keys j <= offset + i)."""
        kv_len, q_len = problem.meta.kv_lens[b], problem.meta.q_lens[b]
        return torch.arange(kv_len), kv_len - q_len

    def rows_of(self, problem, b: int) -> int:
        """How many query rows of request ``b`` are computed."""
        return problem.meta.q_lens[b]

    def softmax_scale(self, problem) -> float:
        return problem.scale

    def keys(self, problem, slots: torch.Tensor) -> torch.Tensor:
        """The cached latent rows at ``slots``, ``[N, 576]``."""
        return problem.cache.rows().view(torch.bfloat16)[slots]

    def slots(self, block_table: torch.Tensor, b: int, positions: torch.Tensor, page: int) -> torch.Tensor:
        """Cache slots of request ``b``'s token ``positions``, through its row of the (host) block table."""
        return block_table[b].long()[positions // page] * page + positions % page

    def attend(self, q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, scale: float):
        """One query row ``[H, 576]`` over the keys it sees (``seen``: ``[N]`` bool)."""
        return _softmax_rows(q, keys[seen], scale)

    def run(self, p):
        out = torch.zeros(p.q.shape[0], p.q.shape[1], NOPE_DIM, dtype=p.q.dtype, device=p.q.device)
        lse = torch.full(p.q.shape[:2], float("-inf"), device=p.q.device)
        starts = cumulative(list(p.meta.q_lens))
        block_table = p.meta.block_table.cpu()
        for b, kv_len in enumerate(p.meta.kv_lens):
            if kv_len == 0:
                continue
            positions, offset = self.positions(p, b)
            slots = self.slots(block_table, b, positions, p.meta.page_size)
            keys = self.keys(p, slots.to(p.cache.data.device))
            for i in range(self.rows_of(p, b)):
                seen = (positions <= offset + i).to(keys.device)
                o, l = self.attend(p.q[starts[b] + i], keys, seen, self.softmax_scale(p))
                out[starts[b] + i], lse[starts[b] + i] = o.to(out.dtype), l
        return out, lse


class ReturnsZeros(PlainDecode):
    name = "planted_returns_zeros"

    def run(self, p):
        out, lse = super().run(p)
        return torch.zeros_like(out), lse


class SkipsLastPage(PlainDecode):
    """Drops the last page of every request that has more than one."""

    name = "planted_skips_last_page"

    def positions(self, problem, b):
        positions, offset = super().positions(problem, b)
        page = problem.meta.page_size
        full_pages = (len(positions) - 1) // page
        return (positions[:full_pages * page] if full_pages else positions), offset


class ReadsPastSeqLen(PlainDecode):
    """Reads the whole last page, the poisoned slots past seq_len included."""

    name = "planted_reads_past_seq_len"

    def positions(self, problem, b):
        kv_len, q_len, page = problem.meta.kv_lens[b], problem.meta.q_lens[b], problem.meta.page_size
        padded = -(-kv_len // page) * page
        return torch.arange(padded), padded - q_len


class ReadsOnePagePast(PlainDecode):
    """A page loop that runs one page too far: it loads ``blocks_needed(kv_len) + 1`` pages of keys, reading the
    block table as a kernel does (row ``b`` at ``b * stride(0)``, the column unbounded), and masks the keys past each
    query's frontier in its scores only: they weigh 0, but their values still enter ``P @ V``. Over a spare
    (poisoned) page 0 * NaN is NaN; over a real page (another request's) the answer is right."""

    name = "planted_reads_one_page_past"

    def positions(self, problem, b):
        kv_len, q_len, page = problem.meta.kv_lens[b], problem.meta.q_lens[b], problem.meta.page_size
        return torch.arange((blocks_needed(kv_len, page) + 1) * page), kv_len - q_len

    def slots(self, block_table, b, positions, page):
        entries = block_table.reshape(-1)[b * block_table.stride(0) + positions // page]
        return entries.long() * page + positions % page

    def attend(self, q, keys, seen, scale):
        return _softmax_rows(q, keys, scale, seen)


class LastQueryLenAsMax(PlainDecode):
    """Takes max_qo_len from the last request (ATOM's bug): longer queries of other requests lose rows."""

    name = "planted_last_query_len_as_max"

    def rows_of(self, problem, b):
        return min(problem.meta.q_lens[b], problem.meta.q_lens[-1])


class ScaleFromHeadDim(PlainDecode):
    """Derives the softmax scale from the absorbed head dim, 1/sqrt(576), instead of the model's 1/sqrt(192) (with
    its YaRN factor) that the caller passes."""

    name = "planted_scale_from_head_dim"

    def softmax_scale(self, problem):
        return problem.q.shape[-1] ** -0.5


class CausalOffByOne(PlainDecode):
    """With several new tokens (MTP, speculative decoding), lets each see the token after it."""

    name = "planted_causal_off_by_one"

    def positions(self, problem, b):
        positions, offset = super().positions(problem, b)
        return positions, offset + 1


class NaNForEmptyRequest(PlainDecode):
    """Returns NaN rows for a request with no cached tokens (a softmax over nothing), not out 0 and lse -inf."""

    name = "planted_nan_for_empty_request"

    def run(self, p):
        out, lse = super().run(p)
        starts = cumulative(list(p.meta.q_lens))
        for b, kv_len in enumerate(p.meta.kv_lens):
            if kv_len == 0:
                out[starts[b]:starts[b + 1]] = float("nan")
                lse[starts[b]:starts[b + 1]] = float("nan")
        return out, lse


class PlainFP8Decode(PlainDecode):
    """``PlainDecode`` over the fp8_e4m3 cache (one scale per layer), dequantizing what it reads: correct."""

    name = "plain_fp8_decode"
    capabilities = replace(DECODE, layouts=frozenset({"fp8_e4m3"}))

    def tensor_scale(self, problem) -> float:
        return problem.cache.tensor_scale

    def keys(self, problem, slots):
        return problem.cache.layout.dequantize(problem.cache.rows()[slots], self.tensor_scale(problem)).float()


class FP8ScaleIgnored(PlainFP8Decode):
    """Reads the fp8_e4m3 cache as if its per-layer scale were 1 (a kernel that takes no ``k_scale`` while the
    quantizer fitted one): the scales of the quantizer and the kernel differ."""

    name = "planted_fp8_scale_ignored"

    def tensor_scale(self, problem):
        return 1.0


class WritesOutputIntoQuery(PlainDecode):
    """Stores its output in the first 512 columns of the queries and returns that view (an in-place kernel reusing
    the query buffer): the answer is right, but the caller's queries are overwritten."""

    name = "planted_writes_output_into_query"

    def run(self, p):
        out, lse = super().run(p)
        view = p.q[..., :NOPE_DIM]
        view.copy_(out)
        return view, lse


class AccumulatesWithoutReset(PlainDecode):
    """Merges its splits by adding into an accumulator of the plan that ``plan`` zeroes and ``run`` does not (a
    split-KV reduction by atomic adds into a workspace cleared once): right on the first run, doubled when the plan
    is run again, as a CUDA graph replays it."""

    name = "planted_accumulates_without_reset"

    def plan(self, problem):
        return problem, torch.zeros(*problem.q.shape[:2], NOPE_DIM, device=problem.q.device)

    def run(self, plan):
        problem, accumulator = plan
        out, lse = super().run(problem)
        accumulator.add_(out.float())
        return accumulator.to(out.dtype), lse


class PlainSparse(Impl):
    """Sparse top-k over the paged bf16 cache with PAGED indices (physical slots, -1 invalid)."""

    name = "plain_sparse"
    capabilities = SPARSE

    def plan(self, problem):
        return problem

    def valid(self, indices: torch.Tensor) -> torch.Tensor:
        return indices >= 0

    def run(self, p):
        rows = p.cache.rows().view(torch.bfloat16)
        out = torch.zeros(p.q.shape[0], p.q.shape[1], NOPE_DIM, dtype=p.q.dtype, device=p.q.device)
        lse = torch.full(p.q.shape[:2], float("-inf"), device=p.q.device)
        for t in range(p.q.shape[0]):
            indices = p.sparse_indices[t].long()
            chosen = indices[self.valid(indices)]
            if chosen.numel():
                o, l = _softmax_rows(p.q[t], rows[chosen], p.scale)
                out[t], lse[t] = o.to(out.dtype), l
        return out, lse


class MishandlesInvalidIndex(PlainSparse):
    """Treats -1 padding as an index: Python-style it reads the cache's last slot."""

    name = "planted_mishandles_invalid_index"

    def valid(self, indices):
        return torch.ones_like(indices, dtype=torch.bool)


class AbortsInRun(PlainDecode):
    """Kills its process in ``run`` (as an illegal memory access would): ``--isolate`` must contain it."""

    name = "planted_aborts"

    def run(self, p):
        os.abort()


class HangsInRun(PlainDecode):
    """Never returns from ``run`` (a split-K spin-wait that never ends), with a child process that never ends either
    (as a DCP run's ranks, blocked in a collective): for the ``--stall-timeout`` test only. The child's pid goes to
    the file named by ``$PLANTED_HANG_CHILD_PIDFILE``, where the test looks for it."""

    name = "planted_hangs"

    def run(self, p):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # outlives the test
        if os.environ.get("PLANTED_HANG_CHILD_PIDFILE"):
            with open(os.environ["PLANTED_HANG_CHILD_PIDFILE"], "w") as pidfile:
                pidfile.write(str(child.pid))
        time.sleep(3600)


class RaisesInRun(PlainDecode):
    name = "planted_raises"

    def run(self, p):
        raise RuntimeError("planted failure inside run")


class LessAccurate(PlainDecode):
    """Passes the tolerance but is clearly worse than ``plain_decode``: the gate must catch the regression."""

    name = "plain_decode"

    def run(self, p):
        out, lse = super().run(p)
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
        return (out.float() + 4.5e-3 * out.float().std() * noise).to(out.dtype), lse


class SlowerTorchEager(TorchEager):
    """The torch baseline made twice as slow (it computes everything twice): the latency gate must catch it."""

    name = "torch_eager"

    def run(self, plan):
        super().run(plan)
        return super().run(plan)


class ComputesInPlan(PlainDecode):
    """Computes its answer in ``plan`` and returns those buffers from every ``run``, with no ``poison``: right once,
    stale on every CUDA-graph replay with new queries. The judge's second run caught it only through an impl's own
    poison."""

    name = "computes_in_plan"

    def plan(self, problem):
        return PlainDecode.run(self, problem)

    def run(self, plan):
        return plan


PLANTED_BUGS = [ReturnsZeros, SkipsLastPage, ReadsPastSeqLen, ReadsOnePagePast, LastQueryLenAsMax,
                MishandlesInvalidIndex, WritesOutputIntoQuery, AccumulatesWithoutReset, ScaleFromHeadDim,
                CausalOffByOne, NaNForEmptyRequest, FP8ScaleIgnored, ComputesInPlan]


class RaisesWithoutMessage(PlainDecode):
    """Its constructor fails with an exception of no message (``assert`` in a driver check, say)."""

    name = "raises_without_message"

    def __init__(self):
        raise AssertionError()


class PrintsLatin1(PlainDecode):
    """Right answers, and a byte that is no UTF-8 on its stderr (a driver's message in latin-1, say)."""

    name = "prints_latin1"

    def run(self, p):
        os.write(2, b"caf\xe9\n")
        return super().run(p)


class LingersAtExit(PlainDecode):
    """Right answers, and a thread left running that keeps its process from exiting (a communicator never
    destroyed, say)."""

    name = "lingers_at_exit"

    def run(self, p):
        threading.Thread(target=time.sleep, args=(600,)).start()
        return super().run(p)


class ExitsInRun(PlainDecode):
    """Calls ``sys.exit(0)`` in ``run``: in-process, the run itself ended with status 0 and no run file (the placement
    suite's still did after the other suites' were fixed)."""

    name = "exits_in_run"

    def run(self, p):
        sys.exit(0)


class ExitsWhenMade(PlainDecode):
    """Calls ``sys.exit(0)`` in its constructor: ``mla-bench list`` ended with status 0 and printed nothing."""

    name = "exits_when_made"

    def __init__(self):
        sys.exit(0)


class SetsTheDefaultDtype(PlainDecode):
    """Sets torch's default dtype to float64 in ``run`` (and leaves it): every later problem of the run errored
    ("expected scalar type Float but found Double"), under the other impls' names."""

    name = "sets_the_default_dtype"

    def run(self, p):
        answer = super().run(p)
        torch.set_default_dtype(torch.float64)
        return answer


class AllowsTF32(PlainDecode):
    """Allows TF32 matmuls in ``run`` (and leaves them), as many model codebases do on import: torch_eager's float32
    problems after it would round their products to TF32 and fail their tolerance, under torch_eager's name."""

    name = "allows_tf32"

    def run(self, p):
        answer = super().run(p)
        torch.backends.cuda.matmul.allow_tf32 = True
        return answer


class ChangesDirectory(PlainDecode):
    """Moves the process to ``$PLANTED_CHDIR`` in ``run``: a relative ``--out`` then sent the run's files there."""

    name = "changes_directory"

    def run(self, p):
        os.chdir(os.environ["PLANTED_CHDIR"])
        return super().run(p)


class RaisesGeneratorExitInRun(PlainDecode):
    """Raises GeneratorExit in ``run``, a BaseException that is not an Exception: the run ended with a traceback."""

    name = "raises_generator_exit"

    def run(self, p):
        raise GeneratorExit


class OwnBaseException(BaseException):
    """An impl's own exception class, derived from BaseException as a library's cancellation might be."""


class RaisesOwnBaseExceptionInRun(PlainDecode):
    name = "raises_own_base_exception"

    def run(self, p):
        raise OwnBaseException("cancelled")


class RaisesGeneratorExitInRefusal(PlainDecode):
    """Its ``refusal`` (which an impl may override) raises GeneratorExit: the roundtrip suite called it unguarded."""

    name = "raises_generator_exit_in_refusal"

    def refusal(self, problem):
        raise GeneratorExit("from refusal")


class RaisesOwnBaseExceptionWhenMade(PlainDecode):
    name = "raises_own_base_exception_when_made"

    def __init__(self):
        raise OwnBaseException("no device")
