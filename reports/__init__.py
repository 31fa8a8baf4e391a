"""Console tables, plots, the HTML report, run comparison and the regression gate (run files: mla_bench.results)."""
