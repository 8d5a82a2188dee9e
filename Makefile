# Two entry points for a fresh machine: `make run` and `make test`. Both build the venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# llama.cpp's native build turns on AMX where the CPU has it, and every decode then
# segfaults (method-notes §3). On such CPUs build for AVX-512 without AMX; elsewhere
# (laptops, Apple silicon) let llama.cpp build natively.
HAS_AMX := $(shell grep -qs amx_tile /proc/cpuinfo && echo yes)
ifeq ($(HAS_AMX),yes)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON
endif

.PHONY: run test lint bench stress install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned, so nothing later resolves to a CUDA build.
	$(PY) -m pip install torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m app.gui

test: $(STAMP)
	$(VENV)/bin/ruff check app engine models training tests
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/tandem bench --prompts ../shared/data/spec_bench_dev.jsonl --per-category 5 \
		--drafters none,lookup --max-tokens 128 --json bench.json

# Native crashes under load (issue 19): the GUI and engine tests, again and again, beside
# busy loops. Not part of `make test`.
stress: $(STAMP)
	$(PY) -m tests.stress --runs 9 --load 3

clean:
	rm -rf $(VENV)
