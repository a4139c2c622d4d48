#!/usr/bin/env bash
# The retrieval table of issue 26 on a GPU machine: every (configuration,
# length) as its own `still eval --device cuda` run, one JSON file each (so a
# run cut short keeps the cells it finished), then scripts/eval-table.py.
#
#   scripts/eval-retrieval-gpu.sh STILL MODEL ADAPTER HAYSTACK OUTDIR [SAMPLES] [CONFIGS] [CONFIG_FILE]
#
# STILL: the still binary (e.g. the still-cuda of scripts/build-cuda-remote.sh);
# HAYSTACK: a novel the adapter never saw in training (Northanger Abbey for the
# committed one); SAMPLES per cell (default 50); CONFIGS: names from the list
# below, comma-separated (default: all, in that order). Equal memory: Sel of
# m = 896 per query head in f16 (9 heads, 768 selected + 128 local slots) is
# 2,688 slots per KV head (3 heads); swa's cache holds its window per KV head.
# CONFIG_FILE: more configurations, one `name|options` a line ($ADAPTER and
# $MODEL expand). Environment: LENGTHS (default "1k 2k 4k 8k"); TASKFILE, a
# `still eval --tasks` file used instead of the built-in tasks (e.g. the
# development set of scripts/make-retrieval-dev.py, with a training text as
# HAYSTACK); TASKS, built-in tasks to run instead of all six (comma-separated).
set -euo pipefail
[ $# -ge 5 ] || { echo "usage: $0 STILL MODEL ADAPTER HAYSTACK OUTDIR [SAMPLES] [CONFIGS] [CONFIG_FILE]" >&2; exit 2; }
STILL=$1 MODEL=$2 ADAPTER=$3 HAY=$4 OUT=$5 N=${6:-50}
TASKS=${TASKS:-niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,passkey}
WHAT=("$TASKS")
[ -n "${TASKFILE:-}" ] && WHAT=(--tasks "$TASKFILE")
declare -A OPTS=(
    [softmax]="--attn softmax"
    [still-global-m2560]="--adapter $ADAPTER --selection global --budget 2560"
    [swa-w2688]="--attn swa --window 2688"
    [still-chunk-m2688]="--adapter $ADAPTER --budget 2688"
    [still-chunk-m896]="--adapter $ADAPTER"
)
if [ -n "${8:-}" ]; then
    while IFS='|' read -r name opts; do
        [ -n "$name" ] && OPTS[$name]=$(eval echo "$opts")
    done < "$8"
fi
ORDER=${7:-softmax,still-global-m2560,swa-w2688,still-chunk-m2688,still-chunk-m896}
mkdir -p "$OUT"
for L in ${LENGTHS:-1k 2k 4k 8k}; do
    for c in ${ORDER//,/ }; do
        f="$OUT/$c-$L.json"
        [ -f "$f" ] && continue
        t0=$(date +%s)
        # shellcheck disable=SC2086
        "$STILL" eval "${WHAT[@]}" -m "$MODEL" --device cuda --lengths "$L" --samples "$N" --haystack "$HAY" \
            --compare "$c=${OPTS[$c]}" --json "$f.tmp" > "$OUT/$c-$L.md" 2> "$OUT/$c-$L.log"
        mv "$f.tmp" "$f"
        echo "$c $L: $(( $(date +%s) - t0 )) s"
    done
done
