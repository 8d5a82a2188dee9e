#!/usr/bin/env bash
# On the GPU machine (call 3): join the model, wait for the build, run the checks
# (docs/gpu.md). Each step is capped so one hang cannot take the others' time; what each
# writes lands in $OUT.
set -u
exec > >(tee $OUT/log.txt) 2>&1
D=/tmp/dev
M=$D/model.gguf
cat $D/model.1 $D/model.2 .dev/model.3 > $M
[ "$(sha256sum $M | cut -d' ' -f1)" = "$(cat $D/model.sha256)" ] || echo "MODEL CORRUPT"
for _ in $(seq 1 400); do [ -f $D/build.rc ] && break; sleep 1; done
echo "build rc=$(cat $D/build.rc 2>/dev/null) in $(( $(cat $D/build.end) - $(cat $D/build.start) )) s"
grep -E "^\[[0-9]+/[0-9]+\]" $D/build.log | tail -1
[ "$(cat $D/build.rc)" = 0 ] || { tail -40 $D/build.log; exit 1; }
ls -la $D/site/llama_cpp/lib | grep -v "\.so\.0"
readelf -d $D/site/llama_cpp/lib/libllama.so | grep -q "libstdc++" ||
    echo "WARNING: libllama links libstdc++ statically: torch and llama.cpp will crash together"
export PYTHONPATH=$D/site:$PWD PYTHONUNBUFFERED=1
# Both libraries in one process, both orders (the head on the GPU needs it).
python3 -c "import llama_cpp, torch; llama_cpp.llama_backend_init(); print('llama+torch ok')"
python3 -c "import torch, llama_cpp; llama_cpp.llama_backend_init(); print('torch+llama ok')"
# libllama before numpy (docs/gpu.md: the order once decided whether it loaded).
printf '#!/bin/sh\nexec python3 -c "import sys, llama_cpp; from app.cli import main; sys.exit(main())" "$@"\n' > $D/tandem
chmod +x $D/tandem
export PATH=$D:$PATH
step() { local cap=$1; shift; echo "=== $* ($(date +%T))"; timeout "$cap" "$@"; echo "=== rc=$?"; }
step 150 python3 -m tests.gpu_check --out $OUT --model $M --prompts $D/prompts.jsonl \
    --steps exactness,lossless --gpu-layers 0 --shapes ""
step 60 tandem plan --model $M --threads 16
for threads in 16 4; do
    step 150 tandem bench --model $M --threads $threads --prompts $D/prompts.jsonl \
        --per-category 1 --max-tokens 64 --drafters none,auto,lookup,head,head+memory \
        --head-device cuda --json $OUT/bench_${threads}t.json
done
step 200 tandem profile --shape llama-3.1-8b --threads 16 --gpu --head-device cpu \
    --head-device cuda --draft llama-3.2-1b --contexts 256 --workdir /tmp/pw \
    --out $OUT/measured_llama-3.1-8b_h100_16t.json
