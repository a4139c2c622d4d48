#!/usr/bin/env bash
# How this directory's GPU results were made (H200; /tmp/w as in
# scripts/build-cuda-remote.sh). Development set only (own templates,
# scripts/make-retrieval-dev.py; Emma, a training novel, as haystack), 8K:
#   run-gpu.sh dev8k NAMES   the named configs.txt lines (and softmax) on dev_locker + dev_price
set -uo pipefail
cd "$(dirname "$0")/../../.."
W=/tmp/w R=$W/res S=$W/build/still-cuda M=$W/model.gguf A=adapters/smollm2-135m-still.gguf
CFG=bench/results/2026-12-02-8k-gap/configs.txt
mkdir -p $R
case $1 in
dev8k)
    shift
    for t in locker price; do
        grep "\"dev_$t\"" bench/data/retrieval-dev.jsonl > $W/dev-$t.jsonl
        for c in "$@"; do
            TASKFILE=$W/dev-$t.jsonl LENGTHS=8k setsid nohup scripts/eval-retrieval-gpu.sh $S $M $A \
                $W/data/austen/emma.txt $R/dev8k-$t 50 $c $CFG > $R/dev8k-$t-$c.out 2>&1 &
        done
    done ;;
esac
