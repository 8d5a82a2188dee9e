# Two entry points for a fresh machine: `make run` and `make test`. Both build the venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# llama.cpp's native build turns on AMX where the CPU has it, and every decode then
# segfaults (method-notes §3). On such CPUs build for AVX-512 without AMX; elsewhere
# (laptops, Apple silicon) let llama.cpp build natively.
#
# llamafile's sgemm multiplies float, Q8_0, Q5_0 and Q4_0 weights for batches of 2 or
# more tokens but not for one, so an F32/F16/Q8_0 target's logits for a verified draft
# differed from plain decoding's (by ~0.15 in the bundled model as F32) and greedy output
# drifted where two tokens nearly tie. It is also what makes llama.cpp's prompts fast on
# those types (a 1152-wide Q4_K_M falls back to Q5_0: 9.4 s against 15 s for 630 tokens).
# So it is built in, and packaging/llama-cpp/prompt-kernels.patch makes it a switch
# (ggml_cpu_set_prompt_kernels, together with the tiled K-quant matmul), off by default:
# Tandem turns it on for a prompt's prefill only, never for a verification.
#
# With ggml's RPC backend (libggml-rpc): `tandem worker` serves this machine's devices and
# `--workers` places a target's layers on other machines (docs/workers.md).
HAS_AMX := $(shell grep -qs amx_tile /proc/cpuinfo && echo yes)
ifeq ($(HAS_AMX),yes)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_LLAMAFILE=ON \
	-DGGML_RPC=ON
else
LLAMA_CMAKE_ARGS ?= -DGGML_LLAMAFILE=ON -DGGML_RPC=ON
endif

.PHONY: run test test-slow lint bench stress install clean dist dist-check differential

install: $(STAMP)

LLAMA_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
LLAMA_PATCHES := $(abspath $(wildcard packaging/llama-cpp/*.patch))

$(STAMP): pyproject.toml Makefile $(LLAMA_PATCHES)
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned, so nothing later resolves to a CUDA build.
	$(PY) -m pip install torch==2.13.0
	# Built here from the source release with Tandem's patches, never a cached wheel:
	# pip's cache does not know the flags it was built with (AMX or not). Unpacked
	# outside this repository, where git apply patches files as patch(1) does.
	src=$$(mktemp -d) && trap 'rm -rf "$$src"' EXIT && \
	$(PY) -m pip download --no-deps --no-binary :all: -d "$$src" \
		"llama-cpp-python==$(LLAMA_VERSION)" && \
	tar xzf "$$src/llama_cpp_python-$(LLAMA_VERSION).tar.gz" -C "$$src" && \
	(cd "$$src/llama_cpp_python-$(LLAMA_VERSION)" && \
	 for p in $(LLAMA_PATCHES); do git apply -p1 "$$p" || exit 1; done) && \
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --no-cache-dir \
		"$$src/llama_cpp_python-$(LLAMA_VERSION)"
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m app.gui

# `make test` stays under 30 minutes on 2 cores; the long end-to-end checks (sampling
# distributions, the synthetic differential slices, training, workers lost mid-answer) are
# the `slow` slice, which CI runs after it (.ci/run).
test: $(STAMP)
	$(VENV)/bin/ruff check app engine models training tests
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The differential over the whole matrix, N actions in checkpointed segments: a rerun
# with the same SEED resumes (10,000 actions take 5-8 hours on 2 quiet cores).
ACTIONS ?= 10000
SEED ?= 1
differential: $(STAMP)
	$(PY) -m tests.differential --matrix --actions $(ACTIONS) --seed $(SEED) \
		--out differential-cases

bench: $(STAMP)
	$(VENV)/bin/tandem bench --prompts training/data/spec_bench_dev.jsonl --per-category 5 \
		--drafters none,lookup --max-tokens 128 --json bench.json

# Native crashes under load (issue 19): the GUI and engine tests, again and again, beside
# busy loops. Not part of `make test`.
stress: $(STAMP)
	$(PY) -m tests.stress --runs 9 --load 3

# The packaged build: dist/tandem/ and dist/tandem-linux-x86_64.tar.gz, which run without
# a compiler, Python or this repository (docs/packaging.md). Its own venv in build/dist.
dist:
	bash packaging/dist/build.sh

# The bundle unpacked into an empty folder, run with an empty home: the CLI and the window.
dist-check:
	bash packaging/dist/check.sh

clean:
	rm -rf $(VENV) build/dist
