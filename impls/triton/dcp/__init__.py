"""Decode context parallel, for real: KV sharded over processes, partial attentions combined by LSE.

``run_dcp(workload_or_problem, world, ...)`` is the entry point (``DcpOutcome``: out, lse, timings); ``TritonDcp``
the registered impl (mode ``dcp``), which ``mla-bench run --dcp W`` judges on the sweep's decode workloads.
Modules: ``shard`` (a rank's tokens and causal frontiers), ``attention`` (the per-rank attention interface),
``comm`` (collectives over heads), ``step`` (one rank's step), ``launch`` (processes), ``reorg`` (chunked
prefill's context gather across ranks).
"""

from impls.triton.dcp.launch import DcpOutcome, run_dcp

__all__ = ["DcpOutcome", "run_dcp"]
