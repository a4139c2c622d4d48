#!/usr/bin/env bash
# How this directory's GPU results were made (H200; /tmp/w as in
# scripts/build-cuda-remote.sh: still-cuda, model.gguf, data/ = the corpora).
#   run-gpu.sh dev          the candidates of configs.txt on the development set
#                           (own templates, a training novel as haystack), 4K and 8K
#   run-gpu.sh test NAMES   the named candidates on the built-in tasks, held-out novel, 1K-8K
#   run-gpu.sh ppl NAMES    held-out perplexity at 2K / 4K / 8K
set -uo pipefail
cd "$(dirname "$0")/../../.."
W=/tmp/w R=$W/res S=$W/build/still-cuda M=$W/model.gguf A=adapters/smollm2-135m-still.gguf
CFG=bench/results/2026-12-02-layer-budgets/configs.txt
mkdir -p $R
names() { cut -d'|' -f1 $CFG | paste -sd' '; }
case $1 in
dev)
    for c in softmax $(names); do
        TASKFILE=bench/data/retrieval-dev.jsonl LENGTHS="4k 8k" nohup scripts/eval-retrieval-gpu.sh $S $M $A \
            $W/data/austen/emma.txt $R/dev 50 $c $CFG > $R/dev-$c.out 2>&1 &
    done ;;
test)
    shift
    for c in "$@"; do for L in 1k 2k 4k 8k; do
        LENGTHS=$L nohup scripts/eval-retrieval-gpu.sh $S $M $A $W/data/austen/northangerabbey.txt \
            $R/test 50 $c $CFG > $R/test-$c-$L.out 2>&1 &
    done; done ;;
ppl)
    shift
    for c in "$@"; do
        opts=$(grep "^$c|" $CFG | cut -d'|' -f2 | sed "s#\$ADAPTER#$A#")
        [ "$c" = softmax ] && opts="--attn softmax"
        ( for L in 2048 4096 8192; do
            # shellcheck disable=SC2086
            $S perplexity -m $M $opts --device cuda -c $L --chunks $((32768 / L)) \
                -f $W/data/austen/northangerabbey.txt 2>&1 | tail -1 | sed "s#^#$c $L: #"
        done ) > $R/ppl-$c.txt 2>&1 &
    done ;;
esac
# (later) dev8k: the default against three-tier budgets, dev_locker and dev_price at 8K
if [ "$1" = dev8k ]; then
    for t in locker price; do
        grep "\"dev_$t\"" bench/data/retrieval-dev.jsonl > $W/dev-$t.jsonl
        for c in $(cut -d'|' -f1 ${CFG%.txt}-tiers.txt); do
            TASKFILE=$W/dev-$t.jsonl LENGTHS=8k nohup scripts/eval-retrieval-gpu.sh $S $M $A \
                $W/data/austen/emma.txt $R/dev8k-$t 50 $c ${CFG%.txt}-tiers.txt > $R/dev8k-$t-$c.out 2>&1 &
        done
    done
    wait
fi
