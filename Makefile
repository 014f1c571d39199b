# Two commands on a fresh clone: `make run` (set up + train the default model on the bundled corpus + sample)
# and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU wheel that this kind of machine has on disk; an unpinned torch pulls a CUDA build.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test setup bigram clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/gptlab train
	$(BIN)/gptlab sample --max-new-tokens 500

test: $(STAMP)
	$(BIN)/python -m pytest

bigram: $(STAMP)
	$(BIN)/gptlab train --preset bigram

clean:
	rm -rf runs data .pytest_cache
