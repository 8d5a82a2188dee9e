#!/usr/bin/env bash
# On the GPU machine (call 2): keep the model's second part, show the build's progress.
cp .dev/model.2 /tmp/dev/
grep -E "^\[[0-9]+/[0-9]+\]" /tmp/dev/build.log | tail -1
grep -iE "error|fail" /tmp/dev/build.log | head -5
ls /tmp/dev
