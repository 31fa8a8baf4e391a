"""Decode context parallel, for real: KV sharded over processes, partial attentions combined by LSE.

``run_dcp(workload_or_problem, world, ...)`` is the entry point (``DcpOutcome``: out, lse, timings); ``TritonDcp``
the registered impl (mode ``dcp``); ``as_dcp(workload, W, I)`` turns a decode workload into its DCP version, which
is what ``mla-bench run --dcp W`` judges (``suites.accuracy.judge_workload(as_dcp(w, W), [TritonDcp()], device)``). Modules: ``shard`` (a rank's tokens and causal frontiers), ``attention`` (the
per-rank attention interface), ``comm`` (collectives over heads), ``step`` (one rank's step), ``launch``
(processes), ``reorg`` (chunked prefill's context gather across ranks).
"""

from impls.triton.dcp.launch import DcpOutcome, as_dcp, run_dcp

__all__ = ["DcpOutcome", "as_dcp", "run_dcp"]
