# The two newcomer commands are `make demo` and `make test`; both bootstrap .venv/ first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo demo-cluster test lint unit engine venv clean

venv:
	@bash scripts/bootstrap.sh

## Run the embedded demo (real vLLM engines on CPU, verified in-place update).
demo: venv
	$(VENV)/bin/weightroll demo

## Run the cluster demo: local kube-apiserver, the chart, the operator, three vLLM pods, a live
## rollout (SCENARIO=fail: one corrupt checkpoint copy; ON_FAILURE=Rollback to roll back). docs/demo.md
SCENARIO ?= ok
ON_FAILURE ?= Halt
demo-cluster: venv
	$(VENV)/bin/weightroll demo --cluster --scenario $(SCENARIO) --on-failure $(ON_FAILURE)

## Run every test tier that can run on this machine, after the static checks.
test: venv lint
	$(PY) -m pytest

## Static checks: ruff, mypy --strict, import layers.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check engine_agent operator tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## Fast tiers only (no vLLM engines).
unit: venv
	$(PY) -m pytest -m "not engine and not server and not cluster"

engine: venv
	$(PY) -m pytest tests/engine

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
