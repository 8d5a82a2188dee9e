# Two entry points for a fresh machine: `make run` and `make test`. Both build the venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# llama.cpp's native build turns on AMX where the CPU has it, and every decode then
# segfaults (method-notes §3). On such CPUs build for AVX-512 without AMX; elsewhere
# (laptops, Apple silicon) let llama.cpp build natively.
#
# Without llamafile's sgemm: it multiplies float and Q8_0 weights for batches of 2 or
# more tokens but not for one, so an F32/F16/Q8_0 target's logits for a verified draft
# differed from plain decoding's (by ~0.15 in the bundled model as F32) and greedy output
# drifted where two tokens nearly tie. ggml's own kernel gives every batch size the same
# sums (Q4_0 and K-quants never took that path).
#
# With ggml's RPC backend (libggml-rpc): `tandem worker` serves this machine's devices and
# `--workers` places a target's layers on other machines (docs/workers.md).
HAS_AMX := $(shell grep -qs amx_tile /proc/cpuinfo && echo yes)
ifeq ($(HAS_AMX),yes)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_LLAMAFILE=OFF \
	-DGGML_RPC=ON
else
LLAMA_CMAKE_ARGS ?= -DGGML_LLAMAFILE=OFF -DGGML_RPC=ON
endif

.PHONY: run test lint bench stress install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned, so nothing later resolves to a CUDA build.
	$(PY) -m pip install torch==2.13.0
	# Built here, never a cached wheel: pip's cache does not know the flags it was built
	# with (AMX or not, llamafile or not).
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --no-cache-dir \
		"llama-cpp-python==$$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)"
	$(PY) -m pip install -e '.[dev]'
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
