# `make run` and `make test`: each sets up .venv when missing, installs the project, then runs.
# On a machine whose python3 already has torch (the GPU machine, no network) the venv reuses it;
# elsewhere torch comes as the CPU wheel torch==2.13.0 (never the multi-GB CUDA build).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test setup clean

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

run: $(STAMP)
	$(VENV)/bin/mla-bench run --suite all --out results

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) results
