#!/usr/bin/env bash
# The committed still adapter's decode at depth (issue 27's second bar), this tree and the commit before
# (OLD=path/to/still), alternated, on an otherwise idle machine:
#   bench/results/2026-12-06-decode-cpu-intel/depth.sh > bench/results/2026-12-06-decode-cpu-intel/depth.txt
set -uo pipefail
M=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf} AD=adapters/smollm2-135m-still.gguf S=build/still OLD=${OLD:-}
lscpu | grep "Model name"; grep -m1 "^model" /proc/cpuinfo; date -u; git log --oneline | head -1
for v in $S $OLD $S; do
    echo "## $v"
    $v bench -m $M --adapter $AD -p 0 -n 64 -d 1024,16384,65536 --interleave -t 2 -r 2 2>&1 | grep "| tg\|path"
done
date -u
