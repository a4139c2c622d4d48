#!/usr/bin/env bash
# The committed adapter's decode at 1K and 16K (Sel full from ~8.3K on), this tree against OLD (the commit before,
# a CPU-only build), each with --interleave, on an otherwise idle machine:
#   OLD=/tmp/old/build/still bench/results/2026-12-06-sel-pass-cpu/depth.sh > bench/results/2026-12-06-sel-pass-cpu/depth.txt
set -uo pipefail
M=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf} AD=adapters/smollm2-135m-still.gguf S=build/still OLD=${OLD:-}
lscpu | grep "Model name"; grep -m1 "^model" /proc/cpuinfo; date -u; git log --oneline | head -1
for v in $S $OLD; do
    echo "## $v"
    $v bench -m $M --adapter $AD -p 0 -n 64 -d 1024,16384 --interleave -t 2 -r 2 2>&1 | grep "| tg"
done
date -u
