#!/usr/bin/env bash
# Issue 27, item 2's last part: does decode collapse when the machine is busy, and what do OpenMP's wait
# policies do about it? tg64 of the default model (softmax plan) at 2 threads, idle and with one busy process
# (`yes > /dev/null`, one core's worth) beside it, under libgomp's default and under OMP_WAIT_POLICY=passive /
# active and GOMP_SPINCOUNT=1000 / 0; llama.cpp (its own thread pool) alternated with them, under the same load.
# Run from the repository root after `make build peer`; prints the CPU model first.
set -uo pipefail
M=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
R=${ROUNDS:-2}
grep -m1 "model name" /proc/cpuinfo
nproc
for round in $(seq 1 "$R"); do
    for load in idle busy; do
        pid=""
        if [ $load = busy ]; then yes > /dev/null & pid=$!; fi
        sleep 1
        for pol in default OMP_WAIT_POLICY=passive OMP_WAIT_POLICY=active GOMP_SPINCOUNT=1000 GOMP_SPINCOUNT=0; do
            if [ $pol = default ]; then e=(); else e=("$pol"); fi
            r=$(env "${e[@]}" build/still bench -m "$M" -p 0 -n 64 -r 3 -t 2 2>&1 | grep "| tg" | awk -F'|' '{print $9}')
            echo "round $round | $load | still $pol | tg64 t/s |$r"
        done
        r=$(peer/llama-bench -m "$M" -p 0 -n 64 -r 3 -t 2 2>&1 | grep "tg64" | awk -F'|' '{print $(NF-1)}')
        echo "round $round | $load | llama.cpp | tg64 t/s |$r"
        [ -n "$pid" ] && kill "$pid" && wait "$pid" 2>/dev/null
    done
done
