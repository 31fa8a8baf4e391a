# `make run` and `make test`: each sets up .venv when missing, installs the project, then runs.
# On a machine whose python3 already has torch (the GPU machine, no network) the venv reuses it;
# elsewhere torch comes as the CPU wheel torch==2.13.0 (never the multi-GB CUDA build).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test baseline compile-check setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if python3 -c "import torch, triton" 2>/dev/null; then \
		echo "using the system torch/triton"; \
		python3 -m venv --system-site-packages $(VENV) && \
		$(PY) -m pip install -q --no-deps --no-build-isolation -e . ; \
	else \
		python3 -m venv $(VENV) && \
		$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q torch==2.13.0 && \
		$(PY) -m pip install -q -e '.[test]' ; \
	fi
	@touch $(STAMP)

# The default sweep on the best device present (CUDA, else CPU with the Triton interpreter on the tiny preset):
# results/<time>-<device>/run.json and report.html.
run: $(STAMP)
	$(VENV)/bin/mla-bench run --impl all --suite all

# pytest, then the tiny CPU sweep gated against the committed baseline (the run's own exit status is left to
# the gate, which knows failures that the baseline already had from new ones).
test: $(STAMP)
	$(PY) -m pytest -q
	rm -rf results/ci-tiny
	$(VENV)/bin/mla-bench run --impl all --suite accuracy --device cpu --out results/ci-tiny --no-report \
		|| echo "the run reported failures: the gate decides"
	$(VENV)/bin/mla-bench gate --baseline baselines/cpu-tiny.json results/ci-tiny/run.json

# Every Triton kernel launch compiled for sm_90 without a GPU, with the GPU machine's Triton and the installed one
# (both run; the target fails if either fails).
TRITON_GPU := 3.6.0
compile-check: $(STAMP)
	@test -d .triton-$(TRITON_GPU) || \
		$(PY) -m pip install -q --no-deps --target .triton-$(TRITON_GPU) triton==$(TRITON_GPU)
	$(PY) -m impls.triton.compile_check --triton-path .triton-$(TRITON_GPU); gpu=$$?; \
		$(PY) -m impls.triton.compile_check; installed=$$?; \
		test $$gpu -eq 0 && test $$installed -eq 0

# Rewrite the CPU baseline after an intended change of results (review the diff before committing it).
baseline: $(STAMP)
	$(VENV)/bin/mla-bench run --impl all --suite accuracy --device cpu --out results/baseline-tiny --no-report
	mkdir -p baselines && cp results/baseline-tiny/run.json baselines/cpu-tiny.json

clean:
	rm -rf $(VENV) results
