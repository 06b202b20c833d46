# The two newcomer commands are `make demo` and `make test`; both bootstrap .venv/ first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo demo-engine test lint unit engine soak venv clean vllm-surface gpu-check engine-sweep \
	unit-operator unit-agent unit-dev contract-agent contract-rollout contract sim

venv:
	@bash scripts/bootstrap.sh

## The demo (docs/demo.md): a local kube-apiserver (built once and cached; go and etcd installed
## first when run as root), the chart, the operator and three real vLLM CPU pods; a WeightUpdate
## rolls v1 -> v2 live. SCENARIO=fail: one pod's checkpoint copy is corrupt; ON_FAILURE=Rollback;
## PREFETCH=Host: each pod stages and verifies v2 while it serves, out of traffic for the swap only.
## NODE=real: the same rollout on a real kubelet, containerd and controllers (root; docs/real-node.md).
SCENARIO ?= ok
NODE ?= stand-in
ON_FAILURE ?= Halt
PREFETCH ?= None
demo:
	@bash scripts/demo-prereqs.sh
	PYTHONPATH=devtools $(PY) -m weightroll_dev demo --scenario $(SCENARIO) --on-failure $(ON_FAILURE) \
	  --prefetch $(PREFETCH) --node $(NODE)

## The single-engine demo (no cluster): a verified update on one vLLM engine and the failure modes.
demo-engine: venv
	PYTHONPATH=devtools $(PY) -m weightroll_dev demo --engine

## Run every test tier that can run on this machine, after the static checks.
test: venv lint
	$(PY) -m pytest

## Static checks: ruff, mypy --strict, import layers.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check engine_agent operator devtools tests bench
	$(VENV)/bin/mypy
	PYTHONPATH=devtools $(VENV)/bin/lint-imports

## Fast tiers only (no vLLM engines).
unit: venv
	$(PY) -m pytest -m "not engine and not server and not cluster and not realnode"

engine: venv
	$(PY) -m pytest tests/engine

## One area at a time, each well under a minute of CPU (figures: README, "Working on one area").
## unit-operator: the operator's unit tests; unit-agent: the engine agent's (no vLLM engine);
## unit-dev: devtools, packaging and the bench entry points.
AREA_PYTEST = $(PY) -m pytest -q --durations=5
unit-operator: venv
	$(AREA_PYTEST) tests/unit/weightroll_operator
unit-agent: venv
	$(AREA_PYTEST) tests/unit/engine_agent
unit-dev: venv
	$(AREA_PYTEST) tests/unit/weightroll_dev $(wildcard tests/unit/test_*.py)

## contract-agent: the agent's HTTP contract (real servers, fake engines); contract-rollout: the
## operator against kmock and simulated agents, on virtual time (looptime); contract: both.
contract-agent: venv
	$(AREA_PYTEST) tests/contract/agent tests/contract/test_token_file.py
contract-rollout: venv
	$(AREA_PYTEST) tests/contract/rollout
contract: contract-agent contract-rollout

## The simulation tier at CI's fixed seed budget (`make soak` runs many more).
sim: venv
	$(AREA_PYTEST) tests/sim -m sim

## The simulation tier (tests/sim) with many more generated hostile schedules than CI runs
## (fresh randomness each time, SOAK_SEED=n to run one seed again). The first failing schedule
## is shrunk by greedy step deletion and printed as replay calls (tests/harness/sim/schedule.py).
## SOAK_EXAMPLES overrides the count; prints the schedules run and the violations found.
SOAK_EXAMPLES ?= 2000
soak: venv
	WEIGHTROLL_SIM_PROFILE=sim-soak WEIGHTROLL_SIM_EXAMPLES=$(SOAK_EXAMPLES) WEIGHTROLL_SIM_SHRINK=1 \
	$(PY) -m pytest tests/sim -m sim -s -p no:cacheprovider -k TestRolloutSim \
	$(if $(SOAK_SEED),--hypothesis-seed=$(SOAK_SEED))

## The prepared GPU check (bench/gpu_check.py): about 8 minutes on one GPU; DRY_RUN=1 on a CPU.
gpu-check: venv
	$(PY) bench/gpu_check.py $(if $(DRY_RUN),--dry-run)

## vLLM's internals weightroll touches, checked statically against the releases we claim (the
## CUDA wheels are downloaded, ~600 MB, never installed): writes docs/vllm-surface.md.
VLLM_SURFACE_RELEASES ?= 0.33.0 0.34.0
vllm-surface: venv
	@mkdir -p .cache/vllm-wheels
	@for v in $(VLLM_SURFACE_RELEASES); do \
	  $(PY) -m pip download --no-deps --only-binary=:all: -q -d .cache/vllm-wheels "vllm==$$v"; done
	PYTHONPATH=devtools $(PY) -m weightroll_dev.vllm_surface --installed \
	  $(foreach v,$(VLLM_SURFACE_RELEASES),.cache/vllm-wheels/vllm-$(v)-*.whl) \
	  --markdown docs/vllm-surface.md

## vLLM's model registry as the test matrix: every decoder architecture, a tiny model built from
## its transformers config, full/partial/sparse updates on a real CPU engine judged against a
## cold one; writes docs/models.md. One process per architecture (~2 min each on 2 cores).
## ARCH='Qwen3 Gemma2' limits it to architectures matching those regexes.
ARCH ?=
engine-sweep: venv
	PYTHONPATH=devtools $(PY) -m weightroll_dev.engine_sweep $(foreach a,$(ARCH),--arch $(a)) \
	  --out docs/models.md

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
