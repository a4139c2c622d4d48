#!/usr/bin/env bash
# make bench: `still bench` and llama.cpp's `llama-bench` side by side on the
# same GGUF, the same thread count and the same test sizes, in one run; prints
# both tables and the still/llama.cpp throughput ratios, and saves them under
# bench/results/.
#   THREADS (2)  P (512)  N (128)  REPS (5)  MODEL (models/...gguf)  STILL_ARGS (more `still bench` flags,
#   e.g. "--prefill int8")
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
P=${P:-512}
N=${N:-128}
REPS=${REPS:-5}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}

scripts/build-llama-cpp.sh >/dev/null
[ -x peer/llama-bench ] || { echo "bench: error: peer/llama-bench missing" >&2; exit 1; }

out=bench/results/$(date -u +%Y-%m-%d)-pp${P}-tg${N}-t${THREADS}.md
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== still bench ==" >&2
build/still bench -m "$MODEL" -p "$P" -n "$N" -t "$THREADS" -r "$REPS" ${STILL_ARGS:-} | tee "$tmp/still.md"
echo "== llama-bench (llama.cpp $(sed -n 's/^llama.cpp commit: *//p' peer/VERSION | cut -c1-10)) ==" >&2
# llama.cpp's AMX matmul (its weight repacking for CPUs with AMX) crashes on some
# virtual machines (seen 2026-12-02: SIGSEGV in ggml_backend_amx_mul_mat); then
# it runs again without repacking, and says so
if ! peer/llama-bench -m "$MODEL" -p "$P" -n "$N" -t "$THREADS" -r "$REPS" -o md > "$tmp/peer.md"; then
    echo "bench: llama-bench failed; again with --repack 0 (no AMX / repacked weights)" >&2
    peer/llama-bench -m "$MODEL" -p "$P" -n "$N" -t "$THREADS" -r "$REPS" --repack 0 -o md > "$tmp/peer.md"
fi
cat "$tmp/peer.md"

python3 - "$tmp/still.md" "$tmp/peer.md" "$out" "$THREADS" <<'PY'
import os, re, sys, datetime
still, peer, out, threads = sys.argv[1:5]
def rates(path):
    r = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for i, c in enumerate(cells):
            if re.fullmatch(r"(pp|tg)\d+( @ d\d+)?", c) and i + 1 < len(cells):
                m = re.match(r"([\d.]+)\s*±\s*([\d.]+)", cells[i + 1])
                if m: r[c] = (float(m.group(1)), float(m.group(2)))
    return r
s, p = rates(still), rates(peer)
lines = [f"# still vs llama.cpp, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {threads} threads"
         + (f" (still {os.environ['STILL_ARGS']})" if os.environ.get("STILL_ARGS") else ""), "",
         "| test | still t/s | llama.cpp t/s | ratio |", "| --- | ---: | ---: | ---: |"]
for k in s:
    if k in p:
        lines.append(f"| {k} | {s[k][0]:.2f} ± {s[k][1]:.2f} | {p[k][0]:.2f} ± {p[k][1]:.2f} | {s[k][0]/p[k][0]:.2f}x |")
lines += ["", "still:", "", open(still).read(), "llama.cpp:", "", open(peer).read()]
open(out, "w").write("\n".join(lines))
print("\n".join(lines[:4 + len(s)]))
print(f"\n(saved to {out})")
PY
