#!/usr/bin/env bash
# On the GPU machine (call 3): join the model, wait for the build, run the checks
# (docs/gpu.md). Each step is capped so one hang cannot take the others' time; what each
# writes lands in $OUT.
set -u
exec > >(tee $OUT/log.txt) 2>&1
D=/tmp/dev
M=$D/model.gguf
cat $D/model.1 $D/model.2 .dev/model.3 > $M
[ -f .dev/conversations.jsonl.gz ] && gunzip -c .dev/conversations.jsonl.gz > $D/conversations.jsonl
[ "$(sha256sum $M | cut -d' ' -f1)" = "$(cat $D/model.sha256)" ] || echo "MODEL CORRUPT"
step() { local cap=$1; shift; echo "=== $* ($(date +%T))"; timeout "$cap" "$@"; local rc=$?; echo "=== rc=$rc"; return $rc; }
# BUDGET_S: the seconds this call may take (what the session's device time allows); the
# training at the end takes what the checks before it leave.
END=$(( $(date +%s) + ${BUDGET_S:-540} ))
export PYTHONUNBUFFERED=1
# The packaged build's CPU libraries on this CPU, while CUDA builds: llama-cpp-python's
# Python files from the sdist with the bundle's libraries (prepare.sh).
if [ -f .dev/variants.tar.gz ]; then
    V=$D/variants
    mkdir -p $V && cp -r $D/llama_cpp_python-*/llama_cpp $V/ && mkdir -p $V/llama_cpp/lib
    tar -xzf .dev/variants.tar.gz -C $V/llama_cpp/lib
    PYTHONPATH=$V:$D/site:$PWD step 330 python3 -m app.cli check-cpu --model $M --threads 4 \
        --work-dir /tmp/check-cpu --json $OUT/check_cpu.json
    echo "check-cpu rc=$?" >> $OUT/verdicts.txt
fi
for _ in $(seq 1 400); do [ -f $D/build.rc ] && break; sleep 1; done
echo "build rc=$(cat $D/build.rc 2>/dev/null) in $(( $(cat $D/build.end) - $(cat $D/build.start) )) s"
grep -E "^\[[0-9]+/[0-9]+\]" $D/build.log | tail -1
[ "$(cat $D/build.rc)" = 0 ] || { tail -40 $D/build.log; exit 1; }
ls -la $D/site/llama_cpp/lib | grep -v "\.so\.0"
readelf -d $D/site/llama_cpp/lib/libllama.so | grep -q "libstdc++" ||
    echo "WARNING: libllama links libstdc++ statically: torch and llama.cpp will crash together"
export PYTHONPATH=$D/site:$PWD
# Both libraries in one process, both orders (the head on the GPU needs it).
python3 -c "import llama_cpp, torch; llama_cpp.llama_backend_init(); print('llama+torch ok')"
python3 -c "import torch, llama_cpp; llama_cpp.llama_backend_init(); print('torch+llama ok')"
# libllama before numpy (docs/gpu.md: the order once decided whether it loaded).
printf '#!/bin/sh\nexec python3 -c "import sys, llama_cpp; from app.cli import main; sys.exit(main())" "$@"\n' > $D/tandem
chmod +x $D/tandem
export PATH=$D:$PATH
# Exactness on both placements (the CPU one must be exact, the GPU one may not: then
# the planner keeps drafts off it), layers offloaded, lossless with the head on CUDA and
# the target on the CPU (Dovetail). Its exit code is the verdict (0, 1 failed, 3 nothing ran).
# --strict after a CUDA build: one that cannot offload (its CUDA part failed) fails the run.
STRICT=$([ "$(cat $D/build.backend 2>/dev/null)" = cpu ] || echo --strict)
step 200 python3 -m tests.gpu_check --out $OUT --model $M --prompts $D/prompts.jsonl \
    --steps exactness,lossless --gpu-layers 0 --shapes "" $STRICT
echo "gpu_check rc=$?" >> $OUT/verdicts.txt
step 40 tandem plan --model $M --threads 16
# What auto plans and runs with a CUDA build (the target may go to the GPU, plain there),
# beside plain decoding on the CPU (docs/gpu.md has the head's own layouts, 2026-11-27).
step 150 tandem bench --model $M --threads 16 --prompts $D/prompts.jsonl --per-category 1 \
    --max-tokens 64 --drafters none,auto,lookup --json $OUT/bench_16t.json
if [ -f $D/conversations.jsonl ] && [ $(( END - $(date +%s) )) -gt 150 ]; then
    LEFT=$(( END - $(date +%s) - 40 ))
    # Feature building overshoots its minutes by up to a shard: leave it a third.
    TRAIN=$(python3 -c "print(round(($LEFT - 60) * 0.6 / 60, 2))")
    DATA=$(python3 -c "print(round(($LEFT - 60) * 0.3 / 60, 2))")
    step $LEFT tandem train-draft --target $M --out $OUT/head --work-dir /tmp/train \
        --conversations-file $D/conversations.jsonl --conversations 4000 \
        --eval-conversations 32 --parallel 16 --threads 16 --device cuda \
        --init-from assets/draft-head-smollm2-135m --data-minutes $DATA --train-minutes $TRAIN
fi
