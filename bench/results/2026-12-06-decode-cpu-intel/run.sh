#!/usr/bin/env bash
# CPU decode and prefill against llama.cpp (issue 27), alternated per line in one session.
# From the repository root: bench/results/2026-12-06-decode-cpu-intel/run.sh > bench/results/2026-12-06-decode-cpu-intel/run.txt
# OLD=path/to/still (a build of the commit before) adds it to every tg line.
set -uo pipefail
M=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
S=build/still P=peer/llama-bench OLD=${OLD:-}
AD=adapters/smollm2-135m-still.gguf
lscpu | grep "Model name"; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model" /proc/cpuinfo; nproc; date -u
git log --oneline | head -1
for round in 1 2 3; do
    for t in 1 2; do
        echo "## round $round tg128 t=$t"
        $S bench -m $M -p 0 -n 128 -r 3 -t $t | grep "tg128"
        $P -m $M -p 0 -n 128 -r 3 -t $t | grep "tg128"
        [ -n "$OLD" ] && $OLD bench -m $M -p 0 -n 128 -r 3 -t $t | grep "| tg128" | sed "s/^/before: /"
        [ $round = 1 ] && $S bench -m $M -p 0 -n 128 -r 3 -t $t --matvec float | grep "| tg128" | sed "s/^/float: /"
    done
done
for t in 1 2; do
    echo "## pp512 t=$t"
    $S bench -m $M -p 512 -n 0 -r 3 -t $t | grep "pp512"
    # llama.cpp's AMX weight repacking crashes on some virtual machines (SIGSEGV, seen here): then without it
    $P -m $M -p 512 -n 0 -r 3 -t $t | grep "pp512" || $P -m $M -p 512 -n 0 -r 3 -t $t --repack 0 | grep "pp512" | sed "s/^/repack 0: /"
done
echo "## still adapter, tg64 at depth 1024, 2 threads"
for round in 1 2; do
    $S bench -m $M --adapter $AD -p 0 -n 64 -d 1024 -t 2 -r 2 | grep "| tg64"
    [ -n "$OLD" ] && $OLD bench -m $M --adapter $AD -p 0 -n 64 -d 1024 -t 2 -r 2 | grep "| tg64" | sed "s/^/before: /"
done
date -u
