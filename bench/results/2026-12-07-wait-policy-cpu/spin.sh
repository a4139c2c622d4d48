#!/usr/bin/env bash
# The second run: libgomp's spin count between 1000 and its default (300,000 with no OMP_WAIT_POLICY), and one
# thread, idle and busy (run.sh's setup).
set -uo pipefail
M=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
grep -m1 "model name" /proc/cpuinfo
for round in 1 2; do
    for load in idle busy; do
        pid=""
        if [ $load = busy ]; then yes > /dev/null & pid=$!; fi
        sleep 1
        for cfg in "2 default" "2 GOMP_SPINCOUNT=3000" "2 GOMP_SPINCOUNT=10000" "2 GOMP_SPINCOUNT=30000" "2 GOMP_SPINCOUNT=100000" "1 default"; do
            set -- $cfg
            if [ $2 = default ]; then e=(); else e=("$2"); fi
            r=$(env "${e[@]}" build/still bench -m "$M" -p 0 -n 64 -r 3 -t $1 2>&1 | grep "| tg" | awk -F'|' '{print $9}')
            echo "round $round | $load | still -t $1 $2 | tg64 t/s |$r"
        done
        [ -n "$pid" ] && kill "$pid" && wait "$pid" 2>/dev/null
    done
done
