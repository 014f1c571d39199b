# Two commands on a fresh clone: `make run` (set up + train the default model on the bundled corpus + sample)
# and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU wheel that this kind of machine has on disk; an unpinned torch pulls a CUDA build.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test setup browser bigram clean mutants planted flaky peers

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/gptlab train
	$(BIN)/gptlab sample --max-new-tokens 500

# one pytest-xdist worker per core (at most 4), a test file's tests in one worker (its module fixtures built once);
# tests/conftest.py gives each worker its share of the cores' threads
test: $(STAMP) browser
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadfile --durations=15

# Debian packages some tests use, installed when missing and we are root with apt-get (otherwise those tests skip and
# the summary says so): chromium, which the attention page's and the playground's tests drive with Playwright (pip's
# Playwright cannot fetch its own browser here); the ARM64 cross compiler and qemu-user, which build and run the
# decode kernel's ARM builds (tests/test_arm.py); tmux, the terminal tests/test_chat_cli.py drives `gptlab chat` in.
APT_TOOLS := chromium:chromium aarch64-linux-gnu-g++:g++-aarch64-linux-gnu qemu-aarch64:qemu-user tmux:tmux
browser:
	@missing=""; for pair in $(APT_TOOLS); do command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; \
	  done; test -z "$$missing" || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; } || \
	  echo "make: not installed (it needs apt-get as root):$$missing: the tests that use them will skip and say so"

bigram: $(STAMP)
	$(BIN)/gptlab train --preset bigram

clean:
	rm -rf runs data .pytest_cache

# Mutation testing (not part of make test; long): mutmut per module, its score per module (docs/mutants.md).
# `make mutants MODULE=sampling` runs one module; results are kept in .mutants/, later runs re-test only what changed.
MODULE ?=
$(VENV)/.mutants-installed: $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[mutants]'
	touch $@

mutants: $(VENV)/.mutants-installed
	nice -n 10 $(BIN)/python scripts/mutants.py $(MODULE)

# llama.cpp as a peer (not part of make test; .ci/run runs it after make test): llama-cpp-python built from source
# (its build time printed; no pip cache, so the flags below always apply), then the peer tests and the peer bench.
# On CPUs with AMX the build leaves out ggml's AMX kernels: they fault (SIGILL at tilezero) in llama.cpp's build
# this pins, the bug of llama.cpp's open pull request #26954; llama.cpp then uses its AVX-512 VNNI kernels.
PEER_FLAGS := $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
$(VENV)/.peers-installed: $(STAMP) pyproject.toml
	@start=$$(date +%s); CMAKE_ARGS="$(if $(PEER_FLAGS),-DCMAKE_C_FLAGS='$(PEER_FLAGS)' -DCMAKE_CXX_FLAGS='$(PEER_FLAGS)')" \
	  $(BIN)/pip install --quiet --disable-pip-version-check --no-cache-dir -e '.[peers]' && \
	  echo "make: llama-cpp-python built and installed in $$(( $$(date +%s) - start )) s"
	touch $@

peers: $(VENV)/.peers-installed
	$(BIN)/python -m pytest -q -p no:randomly tests/test_llamacpp.py tests/test_bench_llamacpp.py
	$(BIN)/gptlab bench generate --peer llama.cpp --new-tokens 64 --rounds 3

# The catalogue of hand-planted bugs (tests/planted): each made in a copy of src/ and run against its tests.
planted: $(STAMP)
	$(BIN)/python scripts/planted.py

# The no-flaky-test check (long; alone on the machine): the suite 3 times in random order beside a busy process per
# core, then the timing-prone test files 20 times each (scripts/flaky.sh).
flaky: $(STAMP)
	scripts/flaky.sh $(BIN)/python
