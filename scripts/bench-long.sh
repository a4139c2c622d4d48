#!/usr/bin/env bash
# make bench-long: the long-context efficiency sweep. For each context length
# L, for each attention kind: a prefill test (`still bench -p L -n 0 -d 0`)
# and a decode test (`-p 0 -n NGEN -d L`), each in its own process so that the
# peak RSS is that cell's own; the same two tests with llama.cpp's
# `llama-bench -fa on` on the same GGUF and threads (its peak RSS from
# /usr/bin/time). Then $OUT/still.csv, $OUT/peer.csv (the same columns),
# $OUT/summary.md (prefill seconds, decode ms/token, memory) and, with
# gnuplot, $OUT/{prefill,decode,memory}.png (scripts/plot-bench.sh).
#
# Resumable: each cell's CSV goes to $OUT/cells/NAME.csv (written to a
# temporary file, then renamed), and a cell whose file exists is skipped, so
# an interrupted sweep continues where it stopped (same OUT). A failed cell
# (its stderr in cells/NAME.err) shows as "–", is retried by the next run,
# and makes the script exit 1 after the summary is written.
#
#   LENGTHS ("1024 2048 4096 8192 16384 32768 65536")  context lengths / depths
#   KINDS ("softmax swa lolcats liger still")  still's kinds, default options
#   SWA_WINDOW (896)  swa's window, = still's softmax budget (same-budget line)
#   THREADS (2)  REPS (1)  NGEN (32: tokens per decode test)
#   NOWARMUP_FROM (8192): cells of at least this length skip the warm-up run
#     (--no-warmup, both engines): at 64K one softmax prefill takes tens of
#     minutes on 2 threads, and a long prefill warms the caches by itself
#   MODEL (models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   OUT (bench/results/long-YYYY-MM-DD, UTC)
#   SKIP_PEER (0; 1: no llama.cpp)  PEER (peer/llama-bench)  STILL_BIN (build/still)
#   PEER_ONE_FROM (32768): from this length on, llama.cpp's prefill and decode
#     cells come from one process (bench/peer_prefill_decode.c, built here
#     against the peer's libllama with llama-bench's settings) instead of two
#     llama-bench runs, which would each prefill the whole context (an hour
#     at 64K); its RSS comes from getrusage. 0: never
#   SKIP (empty): an extended regular expression; cells whose NAME matches
#     are not run (shown as –), e.g. 'peer-.*65536$' leaves out llama.cpp at
#     64K, where one of its prefills takes most of an hour on 2 threads
set -euo pipefail
cd "$(dirname "$0")/.."

LENGTHS=${LENGTHS:-1024 2048 4096 8192 16384 32768 65536}
KINDS=${KINDS:-softmax swa lolcats liger still}
SWA_WINDOW=${SWA_WINDOW:-896}
THREADS=${THREADS:-2}
REPS=${REPS:-1}
NGEN=${NGEN:-32}
NOWARMUP_FROM=${NOWARMUP_FROM:-8192}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-bench/results/long-$(date -u +%Y-%m-%d)}
SKIP_PEER=${SKIP_PEER:-0}
PEER=${PEER:-peer/llama-bench}
STILL_BIN=${STILL_BIN:-build/still}
SKIP=${SKIP:-}
PEER_ONE_FROM=${PEER_ONE_FROM:-32768}
PEER_ONE=$(dirname "$PEER")/peer-prefill-decode

die() { echo "bench-long: error: $1" >&2; exit "${2:-1}"; }
log() { echo "bench-long: $*" >&2; }

is_count() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }
read -r -a lengths <<<"$LENGTHS"
read -r -a kinds <<<"$KINDS"
[ ${#lengths[@]} -gt 0 ] || die "LENGTHS is empty" 2
[ ${#kinds[@]} -gt 0 ] || die "KINDS is empty" 2
for v in "${lengths[@]}"; do is_count "$v" || die "LENGTHS: '$v' is not a positive integer" 2; done
for v in "${kinds[@]}"; do [[ $v =~ ^[a-z]+$ ]] || die "KINDS: bad kind '$v'" 2; done
[[ $PEER_ONE_FROM =~ ^[0-9]+$ ]] || die "PEER_ONE_FROM: '$PEER_ONE_FROM' is not a non-negative integer" 2
for var in THREADS REPS NGEN SWA_WINDOW NOWARMUP_FROM; do is_count "${!var}" || die "$var: '${!var}' is not a positive integer" 2; done
[ -x "$STILL_BIN" ] || die "$STILL_BIN missing (make build)"
[ -f "$MODEL" ] || die "$MODEL missing (make model)"
if [ "$SKIP_PEER" != 1 ]; then
    [ -x "$PEER" ] || die "$PEER missing (make peer, or SKIP_PEER=1 to run without llama.cpp)"
    [ -x /usr/bin/time ] || die "/usr/bin/time missing (Debian package time; it measures llama-bench's peak RSS), or SKIP_PEER=1"
fi

# The settings every cell depends on; a resumed sweep must use the same.
cells=$OUT/cells
mkdir -p "$cells"
settings=$(printf 'model=%s\nthreads=%s\nreps=%s\nngen=%s\nswa_window=%s\nnowarmup_from=%s\n' \
    "$MODEL" "$THREADS" "$REPS" "$NGEN" "$SWA_WINDOW" "$NOWARMUP_FROM")
if [ -f "$OUT/settings" ]; then
    [ "$(cat "$OUT/settings")" = "$settings" ] ||
        die "$OUT holds a sweep with other settings ($(paste -sd ' ' "$OUT/settings")); use another OUT"
else
    printf '%s\n' "$settings" >"$OUT/settings"
    date -u '+%Y-%m-%d %H:%M UTC' >"$OUT/started"
fi
rm -f "$cells"/*.tmp "$cells"/*.raw

HEADER=model,attn,test,n_prompt,n_gen,depth,reps,tps_mean,tps_sd,ms_per_token,peak_rss_mib,state_mib
total=$(( ${#lengths[@]} * 2 * (${#kinds[@]} + (SKIP_PEER == 1 ? 0 : 1)) ))
i=0 n_run=0 n_done=0 n_skip=0 n_fail=0

# A cell's file: the header and exactly one row.
valid_cell() { [ "$(wc -l <"$1")" -eq 2 ] && [ "$(head -n 1 "$1")" = "$HEADER" ]; }

# run_cell NAME KIND: run the command in CELL_CMD (an array) unless NAME is done.
# KIND peer: the command is llama-bench, its CSV is normalized to $HEADER.
run_cell() {
    local name=$1 kind=$2 f=$cells/$1.csv t0 rc=0
    i=$((i + 1))
    if [ -n "$SKIP" ] && [[ $name =~ $SKIP ]]; then
        log "[$i/$total] $name: not run (matches SKIP)"
        n_skip=$((n_skip + 1)); return 0
    fi
    if [ -f "$f" ] && valid_cell "$f"; then
        log "[$i/$total] $name: skipped (done: $f)"
        n_done=$((n_done + 1)); return 0
    fi
    printf '%q ' "${CELL_CMD[@]}" | sed 's/ $//' >"$cells/$name.cmd"
    echo >>"$cells/$name.cmd"
    log "[$i/$total] $name: running"
    t0=$SECONDS
    if [ "$kind" = peer ]; then
        /usr/bin/time -f %M -o "$cells/$name.rss" "${CELL_CMD[@]}" >"$f.raw" 2>"$cells/$name.err" || rc=$?
        [ $rc -ne 0 ] || python3 - "$f.raw" "$cells/$name.rss" "$MODEL" "$REPS" >"$f.tmp" <<'PY' || rc=$?
# llama-bench's CSV (one row) -> still bench's columns. ms/token: mean time
# per test / tokens; peak RSS: /usr/bin/time's %M (KiB); no state count.
import csv, sys
raw, rss, model, reps = sys.argv[1:5]
rows = list(csv.DictReader(open(raw)))
assert len(rows) == 1, f"expected one llama-bench row, got {len(rows)}"
r = rows[0]
p, n, d = int(r["n_prompt"]), int(r["n_gen"]), int(r["n_depth"])
test = (f"pp{p}" if p else f"tg{n}") + (f" @ d{d}" if d else "")
ms = float(r["avg_ns"]) / 1e6 / (p + n)
kib = int(open(rss).read().split()[-1])
print("model,attn,test,n_prompt,n_gen,depth,reps,tps_mean,tps_sd,ms_per_token,peak_rss_mib,state_mib")
print(",".join([model, "llama.cpp", test, str(p), str(n), str(d), reps, r["avg_ts"], r["stddev_ts"],
                f"{ms:.10g}", f"{kib / 1024:.10g}", ""]))
PY
    else
        "${CELL_CMD[@]}" >"$f.tmp" 2>"$cells/$name.err" || rc=$?
    fi
    if [ $rc -eq 0 ] && valid_cell "$f.tmp"; then
        mv "$f.tmp" "$f"
        rm -f "$f.raw"
        n_run=$((n_run + 1))
        log "[$i/$total] $name: $(tail -n 1 "$f" | awk -F, '{printf "%.2f t/s, %.3f ms/token, peak RSS %.1f MiB", $8, $10, $11}') ($((SECONDS - t0)) s)"
    else
        rm -f "$f.tmp" "$f.raw"
        n_fail=$((n_fail + 1))
        log "[$i/$total] $name: FAILED (exit $rc; $(tail -n 1 "$cells/$name.err" 2>/dev/null || true)); shown as – (see $cells/$name.err; rerun to retry)"
    fi
}

# run_peer_one L: llama.cpp's cells peer-ppL and peer-tgNGEN-dL from one
# process (see PEER_ONE_FROM), unless both are done.
run_peer_one() {
    local L=$1 pp=peer-pp$1 tg=peer-tg$NGEN-d$1 t0 rc=0 name
    i=$((i + 2))
    for name in "$pp" "$tg"; do
        if [ -n "$SKIP" ] && [[ $name =~ $SKIP ]]; then
            log "[$i/$total] $pp + $tg: not run ($name matches SKIP)"
            n_skip=$((n_skip + 2)); return 0
        fi
    done
    if [ -f "$cells/$pp.csv" ] && valid_cell "$cells/$pp.csv" && [ -f "$cells/$tg.csv" ] && valid_cell "$cells/$tg.csv"; then
        log "[$i/$total] $pp + $tg: skipped (done)"
        n_done=$((n_done + 2)); return 0
    fi
    if [ ! -x "$PEER_ONE" ] || [ bench/peer_prefill_decode.c -nt "$PEER_ONE" ]; then
        local src; src=$(dirname "$PEER")
        cc -O2 -I "$src/src/llama.cpp/include" -I "$src/src/llama.cpp/ggml/include" bench/peer_prefill_decode.c \
            "$src/build/src/libllama.a" "$src/build/ggml/src/libggml.a" "$src/build/ggml/src/libggml-cpu.a" \
            "$src/build/ggml/src/libggml-base.a" -lstdc++ -lgomp -lpthread -lm -o "$PEER_ONE" ||
            die "cannot build $PEER_ONE from bench/peer_prefill_decode.c (make peer first)"
    fi
    CELL_CMD=("$PEER_ONE" "$MODEL" "$L" "$NGEN" "$THREADS")
    for name in "$pp" "$tg"; do
        { printf '%q ' "${CELL_CMD[@]}" | sed 's/ $//'; echo "   # one process for $pp and $tg"; } >"$cells/$name.cmd"
    done
    log "[$i/$total] $pp + $tg: running (one process)"
    t0=$SECONDS
    "${CELL_CMD[@]}" >"$cells/$pp.raw" 2>"$cells/$pp.err" || rc=$?
    if [ $rc -eq 0 ] && [ "$(wc -l <"$cells/$pp.raw")" -eq 3 ] && [ "$(head -n 1 "$cells/$pp.raw")" = "$HEADER" ]; then
        sed -n '1p;2p' "$cells/$pp.raw" >"$cells/$pp.csv.tmp" && mv "$cells/$pp.csv.tmp" "$cells/$pp.csv"
        sed -n '1p;3p' "$cells/$pp.raw" >"$cells/$tg.csv.tmp" && mv "$cells/$tg.csv.tmp" "$cells/$tg.csv"
        cp "$cells/$pp.err" "$cells/$tg.err"
        rm -f "$cells/$pp.raw"
        n_run=$((n_run + 2))
        log "[$i/$total] $pp + $tg: $(sed -n 2p "$cells/$pp.csv" | awk -F, '{printf "%.2f t/s", $8}'), $(sed -n 2p "$cells/$tg.csv" | awk -F, '{printf "%.3f ms/token", $10}') ($((SECONDS - t0)) s)"
    else
        rm -f "$cells/$pp.raw"
        n_fail=$((n_fail + 2))
        log "[$i/$total] $pp + $tg: FAILED (exit $rc; $(tail -n 1 "$cells/$pp.err" 2>/dev/null || true)); shown as –"
    fi
}

log "sweep into $OUT: lengths ${lengths[*]}, kinds ${kinds[*]}$([ "$SKIP_PEER" = 1 ] || echo ' + llama.cpp'), $THREADS thread(s), $REPS rep(s), decode $NGEN tokens"
for L in "${lengths[@]}"; do
    warm=()
    [ "$L" -ge "$NOWARMUP_FROM" ] && warm=(--no-warmup)
    for k in "${kinds[@]}"; do
        opts=(--attn "$k" "${warm[@]}") id=$k
        if [ "$k" = swa ]; then opts+=(--window "$SWA_WINDOW"); id=swa-w$SWA_WINDOW; fi
        CELL_CMD=("$STILL_BIN" bench -m "$MODEL" -p "$L" -n 0 -d 0 -r "$REPS" -t "$THREADS" "${opts[@]}" --csv)
        run_cell "still-$id-pp$L" still
        CELL_CMD=("$STILL_BIN" bench -m "$MODEL" -p 0 -n "$NGEN" -d "$L" -r "$REPS" -t "$THREADS" "${opts[@]}" --csv)
        run_cell "still-$id-tg$NGEN-d$L" still
    done
    if [ "$SKIP_PEER" != 1 ] && [ "$PEER_ONE_FROM" -gt 0 ] && [ "$L" -ge "$PEER_ONE_FROM" ]; then
        run_peer_one "$L"
    elif [ "$SKIP_PEER" != 1 ]; then
        CELL_CMD=("$PEER" -m "$MODEL" -p "$L" -n 0 -d 0 -fa on -t "$THREADS" -r "$REPS" "${warm[@]}" -o csv)
        run_cell "peer-pp$L" peer
        CELL_CMD=("$PEER" -m "$MODEL" -p 0 -n "$NGEN" -d "$L" -fa on -t "$THREADS" -r "$REPS" "${warm[@]}" -o csv)
        run_cell "peer-tg$NGEN-d$L" peer
    fi
done
log "cells: $n_run run, $n_done done before, $n_skip not run (SKIP), $n_fail failed"

# still.csv, peer.csv (every finished cell in cells/, one header each) and
# summary.md (the lengths and kinds of this run plus any others in cells/).
peer_commit="not run (SKIP_PEER=1)"
if [ "$SKIP_PEER" != 1 ] || ls "$cells"/peer-*.csv >/dev/null 2>&1; then
    peer_commit=$(sed -n 's/^llama.cpp commit: *//p' "$(dirname "$PEER")/VERSION" 2>/dev/null || true)
    peer_commit=${peer_commit:-unknown}
fi
cpu=$(sed -n 's/^model name[[:space:]]*: *//p' /proc/cpuinfo | head -n 1)
python3 - "$OUT" "$LENGTHS" "$KINDS" "$SWA_WINDOW" "$THREADS" "$REPS" "$NGEN" "$MODEL" \
    "${cpu:-unknown}" "$peer_commit" "$STILL_BIN" "$PEER" "$PEER_ONE_FROM" <<'PY'
import csv, datetime, glob, os, sys
out, lengths, kinds, window, threads, reps, ngen, model, cpu, commit, still_bin, peer = sys.argv[1:13]
peer_one_from = int(sys.argv[13])
lengths, kinds, ngen = [int(x) for x in lengths.split()], kinds.split(), int(ngen)
HEADER = "model,attn,test,n_prompt,n_gen,depth,reps,tps_mean,tps_sd,ms_per_token,peak_rss_mib,state_mib".split(",")

def load(pattern):
    rows = []
    for f in sorted(glob.glob(os.path.join(out, "cells", pattern))):
        rows += list(csv.DictReader(open(f)))
    return rows

still, peer_rows = load("still-*.csv"), load("peer-*.csv")
kinds += sorted({r["attn"] for r in still} - set(kinds))
order = {k: i for i, k in enumerate(kinds)}
key = lambda r: (order.get(r["attn"], 0), int(r["n_prompt"]) + int(r["depth"]), int(r["n_gen"]))
for name, rows in (("still.csv", still), ("peer.csv", peer_rows)):
    with open(os.path.join(out, name), "w", newline="") as fh:
        w = csv.DictWriter(fh, HEADER, lineterminator="\n")
        w.writeheader()
        w.writerows(sorted(rows, key=key))

# (series, "pp"/"tg", L) -> row; series = kind or "llama.cpp"
cell = {}
for r in still + peer_rows:
    if int(r["n_gen"]) == 0 and int(r["depth"]) == 0:
        cell[r["attn"], "pp", int(r["n_prompt"])] = r
    elif int(r["n_prompt"]) == 0 and int(r["n_gen"]) == ngen:
        cell[r["attn"], "tg", int(r["depth"])] = r
lengths = sorted(set(lengths) | {L for (_, _, L) in cell})
series = kinds + ["llama.cpp"]
label = lambda k: f"swa (window {window})" if k == "swa" else k

def num(x):
    """A finite float, or None (empty, non-numeric, nan)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v and abs(v) != float("inf") else None

def fmt(v, digits=None):
    if v is None:
        return "–"
    if digits is None:
        digits = 3 if v < 10 else 2 if v < 100 else 1
    return f"{v:.{digits}f}"

def prefill_s(k, L):
    r = cell.get((k, "pp", L))
    t = r and num(r["tps_mean"])
    return int(r["n_prompt"]) / t if t else None

def decode_ms(k, L):
    r = cell.get((k, "tg", L))
    return r and num(r["ms_per_token"])

def ratio(a, b):
    return f"{a / b:.2f}×" if a is not None and b else "–"

def table(head, rows):
    return ["| " + " | ".join(head) + " |", "|" + " --- |" + " ---: |" * (len(head) - 1)] + \
           ["| " + " | ".join(r) + " |" for r in rows]

has_ratio = "still" in kinds and "softmax" in kinds
started = open(os.path.join(out, "started")).read().strip() if os.path.exists(os.path.join(out, "started")) else "?"
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
opt = lambda k: f" --window {window}" if k == "swa" else ""
lines = [
    "# Long-context sweep: still vs llama.cpp", "",
    f"Date: {now} (sweep started {started}); threads: {threads}; repetitions: {reps}; "
    f"CPU: {cpu}; llama.cpp commit: {commit}; model: `{model}`; decode: {ngen} tokens per test. "
    f"Each cell is its own process. Commands (L = each length, K = each kind of "
    f"{', '.join(kinds)}; swa adds `--window {window}`):", "",
    f"    {still_bin} bench -m {model} -p L -n 0 -d 0 -r {reps} -t {threads} --attn K --csv",
    f"    {still_bin} bench -m {model} -p 0 -n {ngen} -d L -r {reps} -t {threads} --attn K --csv",
    f"    /usr/bin/time -f %M {peer} -m {model} -p L -n 0 -d 0 -fa on -t {threads} -r {reps} -o csv",
    f"    /usr/bin/time -f %M {peer} -m {model} -p 0 -n {ngen} -d L -fa on -t {threads} -r {reps} -o csv", "",
    f"From {peer_one_from} tokens on, llama.cpp's prefill and decode cells come from one process, "
    f"`{os.path.dirname(peer)}/peer-prefill-decode {model} L {ngen} {threads}` (bench/peer_prefill_decode.c: "
    "the peer's libllama with llama-bench's settings, no warm-up; its peak RSS from getrusage), because each "
    "llama-bench run would prefill the whole context again." if peer_one_from > 0 else "", "",
    "(each cell's exact command is in `cells/NAME.cmd`; – = not run or failed)", "",
    "## Prefill: seconds to process L prompt tokens from an empty context (n_prompt / mean t/s)", "",
]
lines += table(["length"] + [label(k) for k in series] + (["still / softmax"] if has_ratio else []),
               [[str(L)] + [fmt(prefill_s(k, L)) for k in series] +
                ([ratio(prefill_s("still", L), prefill_s("softmax", L))] if has_ratio else []) for L in lengths])
lines += ["", f"## Decode: ms/token generating {ngen} tokens after a context of L tokens", ""]
lines += table(["depth"] + [label(k) for k in series] + (["still / softmax"] if has_ratio else []),
               [[str(L)] + [fmt(decode_ms(k, L), 2) for k in series] +
                ([ratio(decode_ms("still", L), decode_ms("softmax", L))] if has_ratio else []) for L in lengths])
lines += ["", "## Memory (MiB): peak RSS of the prefill process of L tokens; attention state of that context "
          "as the engine counts it (llama.cpp: no count)", ""]
mem = lambda k, L, col: num(cell[k, "pp", L][col]) if (k, "pp", L) in cell else None
lines += table(["length"] + [f"{label(k)} RSS" for k in series] + [f"{label(k)} state" for k in kinds],
               [[str(L)] + [fmt(mem(k, L, "peak_rss_mib"), 1) for k in series] +
                [fmt(mem(k, L, "state_mib"), 1) for k in kinds] for L in lengths])
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
PY
log "wrote $OUT/still.csv, $OUT/peer.csv, $OUT/summary.md"

if command -v gnuplot >/dev/null 2>&1; then
    scripts/plot-bench.sh "$OUT" || die "plotting failed (the CSVs and summary.md are written; rerun scripts/plot-bench.sh $OUT)"
else
    log "gnuplot not found: no PNG plots (apt-get install gnuplot-nox, then scripts/plot-bench.sh $OUT)"
fi
[ $n_fail -eq 0 ] || die "$n_fail cell(s) failed (see $cells/*.err); the others are in $OUT"
log "done: $OUT"
