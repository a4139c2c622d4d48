#!/usr/bin/env bash
# The decode governor (src/model/decode_threads.h) against the fixed thread count and llama.cpp, idle and with
# one busy process beside (run.sh's setup): tg128 at 2 threads, default (governor) vs --fixed-threads.
set -uo pipefail
M=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
grep -m1 "model name" /proc/cpuinfo
for round in 1 2 3; do
    for load in idle busy; do
        pid=""
        if [ $load = busy ]; then yes > /dev/null & pid=$!; fi
        sleep 1
        for f in "" --fixed-threads; do
            r=$(build/still bench -m "$M" -p 0 -n 128 -r 3 -t 2 $f 2>&1 | grep "| tg" | awk -F'|' '{print $9}')
            echo "round $round | $load | still ${f:-(governor)} | tg128 t/s |$r"
        done
        r=$(peer/llama-bench -m "$M" -p 0 -n 128 -r 3 -t 2 2>&1 | grep "tg128" | awk -F'|' '{print $(NF-1)}')
        echo "round $round | $load | llama.cpp | tg128 t/s |$r"
        [ -n "$pid" ] && kill "$pid" && wait "$pid" 2>/dev/null
    done
done
