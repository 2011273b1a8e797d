# The README's two commands: `make run` and `make test`. Both create .venv and install once.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memfit-installed
GGUF_STAMP := $(VENV)/.memfit-gguf-installed
DEEPSPEED_STAMP := $(VENV)/.memfit-deepspeed-installed
# make test also installs the gguf extra (llama-cpp-python, which compiles llama.cpp: ~12 min on 2 cores the first
# time, seconds once pip has cached the wheel) so the GGUF exports are checked by llama.cpp; GGUF=0 skips it and
# those tests skip. make run never needs it.
GGUF ?= 1
# make test also installs the deepspeed extra (pure Python without its compiled ops: ~15 s), so the ZeRO-2/3
# strategies, SFT and DPO, are tested under torchrun; DEEPSPEED=0 skips it and those tests skip.
DEEPSPEED ?= 1
# llama.cpp without its multimodal library (memfit loads text models only): 237 s instead of 299 s on 2 cores.
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF
# CPU wheel by default (it lies on this machine's disk). GPU machines, e.g.:
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
CONFIG ?= configs/tiny.yaml
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: install run test test-fast lint clean

install: $(STAMP)

# Re-installs only when the dependency pins change; the log is shown only on failure.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (log: $(VENV)/install.log)"
	@$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)" \
		>$(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]' \
		>>$(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@touch $(STAMP)

$(GGUF_STAMP): $(STAMP)
	@echo "installing llama-cpp-python for the GGUF tests (log: $(VENV)/install-gguf.log)"
	@start=$$(date +%s); CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/python -m pip install -c constraints.txt \
		-e '.[gguf]' >$(VENV)/install-gguf.log 2>&1 || { cat $(VENV)/install-gguf.log; exit 1; }; \
		echo "llama-cpp-python installed in $$(( $$(date +%s) - start )) s"
	@$(BIN)/memfit gguf-converter install >>$(VENV)/install-gguf.log 2>&1 || { cat $(VENV)/install-gguf.log; exit 1; }
	@tail -n 1 $(VENV)/install-gguf.log
	@touch $@

# DeepSpeed's ops are JIT-built on first use where CUDA build tools exist; none are needed for ZeRO with torch's AdamW.
$(DEEPSPEED_STAMP): $(STAMP)
	@echo "installing deepspeed for the ZeRO tests (log: $(VENV)/install-deepspeed.log)"
	@DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 $(BIN)/python -m pip install -c constraints.txt --no-build-isolation \
		-e '.[deepspeed]' >$(VENV)/install-deepspeed.log 2>&1 || { cat $(VENV)/install-deepspeed.log; exit 1; }
	@touch $@

run: $(STAMP)
	$(BIN)/memfit run $(CONFIG)

# Lint first (under a second): style slips fail CI like a failing test. Two pytest-xdist workers by default, a
# test file the unit of work (the files that kill runs or time themselves share one: TIMED_FILES in
# tests/conftest.py), each worker and the runs it starts with its share of the cores (OMP_NUM_THREADS). On
# 2 cores, 2026-12-02: one process 2367 s, two workers 1459 s (docs/testing.md). TEST_WORKERS=0: one process.
# The 30 slowest tests are listed at the end, so every CI log says where the suite's time goes.
TEST_WORKERS ?= 2
test: lint $(if $(filter 1,$(GGUF)),$(GGUF_STAMP)) $(if $(filter 1,$(DEEPSPEED)),$(DEEPSPEED_STAMP))
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "unit"

lint: $(STAMP)
	$(BIN)/ruff check memfit flows tasks tests bench

clean:
	rm -rf runs mlflow.db .pytest_cache
