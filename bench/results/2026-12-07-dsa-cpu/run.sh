#!/usr/bin/env bash
# dsa's stage 1 on the CPU (issue 30): the indexer's KL warm-up and the gate, then Northanger Abbey's perplexity of
# the untrained plan and the trained adapter at 1024 and 2048 (topk 512 by default: half and three quarters of the
# queries sparse). Usage: run.sh NAME PLAN   (TOKENS, SEQ, LR to change the defaults 65536, 1024, 1e-3)
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=../shared/data/corpus/austen M=models/SmolLM2-135M-Instruct.Q4_1.gguf R=bench/results/2026-12-07-dsa-cpu
name=$1 plan=$2
mkdir -p runs
grep -m1 "model name" /proc/cpuinfo > $R/cpu.txt
./build/still linearize -m $M --plan "$plan" --data $D/emma.txt --data $D/mansfieldpark.txt \
    --data $D/prideandprejudice.txt --tokens ${TOKENS:-65536} --seq ${SEQ:-1024} --batch 2 --lr ${LR:-1e-3} \
    -o runs/dsa-$name.gguf > runs/dsa-$name.log 2>&1
{ echo "# $name: --plan \"$plan\""; grep -E "^training:|^wall" runs/dsa-$name.log; sed -n '/^| layer/,$p' runs/dsa-$name.log; } \
    > $R/linearize-$name.txt
for c in 1024 2048; do
    n=$((16384 / c))
    u=$(./build/still perplexity -m $M --plan "$plan" -f $D/northangerabbey.txt -c $c --chunks $n 2>&1 | tail -1)
    t=$(./build/still perplexity -m $M --adapter runs/dsa-$name.gguf -f $D/northangerabbey.txt -c $c --chunks $n 2>&1 | tail -1)
    echo "$name | $plan | -c $c --chunks $n | untrained $u | stage 1 $t"
done >> $R/ppl.txt
