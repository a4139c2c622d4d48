#!/usr/bin/env bash
# gdn's output norm (plan key norm) in stage-1 conversions on the CPU: each plan trained on the same data and settings
# as bench/results/2026-12-07-gdn-cpu-conversion/, then Northanger Abbey's perplexity. Usage: run.sh NAME PLAN
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=../shared/data/corpus/austen M=models/SmolLM2-135M-Instruct.Q4_1.gguf R=bench/results/2026-12-07-gdn-norm-cpu
name=$1 plan=$2
./build/still linearize -m $M --plan "$plan" --data $D/emma.txt --data $D/mansfieldpark.txt \
    --data $D/prideandprejudice.txt --tokens ${TOKENS:-65536} --seq 512 --batch 4 --lr 1e-2 -o runs/norm-$name.gguf \
    > runs/norm-$name.log 2>&1
{ echo "# $name: --plan \"$plan\""; sed -n '/^| layer/,$p' runs/norm-$name.log; } > $R/linearize-$name.txt
for c in 512 2048; do
    n=8; [ $c = 2048 ] && n=4
    echo "$name | $plan | stage 1 | -c $c | $(./build/still perplexity -m $M --adapter runs/norm-$name.gguf -f $D/northangerabbey.txt -c $c --chunks $n 2>&1 | tail -1)"
done >> $R/ppl.txt
