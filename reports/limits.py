"""How much the report and ``compare`` show before they summarize: one place for the renderers and the command line
(which must not import matplotlib, through the report, to print its help)."""

COMPARE_ROWS = 200  # a comparison of more results lists what changed first and counts what it leaves out
REPORT_ROWS = 100  # a pass/fail matrix or latency table of more workloads is summarized: thousands are unreadable
