#!/usr/bin/env bash
# Draw the plots of a long-context sweep (scripts/bench-long.sh) with gnuplot:
#   OUTDIR/prefill.png  prefill seconds vs context length (log-log)
#   OUTDIR/decode.png   decode ms/token vs depth (log x)
#   OUTDIR/memory.png   peak RSS MiB vs length, solid; attention state MiB,
#                       dashed, same colour (log-log)
# one line per kind plus llama.cpp. Reads OUTDIR/still.csv, OUTDIR/peer.csv
# (optional) and OUTDIR/settings; the gnuplot data and script go to
# OUTDIR/plot/ (regenerated each time).
# Usage: scripts/plot-bench.sh OUTDIR
set -euo pipefail
die() { echo "plot-bench: error: $1" >&2; exit "${2:-1}"; }
[ $# -eq 1 ] || die "usage: scripts/plot-bench.sh OUTDIR" 2
out=$1
[ -f "$out/still.csv" ] || die "$out/still.csv missing (run scripts/bench-long.sh first)"
command -v gnuplot >/dev/null 2>&1 ||
    die "gnuplot not found (Debian: apt-get install gnuplot-nox); the data is in $out/still.csv and $out/peer.csv"
term="png noenhanced"
if gnuplot -e 'set terminal' 2>&1 | grep -qw pngcairo; then term="pngcairo noenhanced font 'sans,10'"; fi

mkdir -p "$out/plot"
rm -f "$out"/plot/*.dat
python3 - "$out" "$term" <<'PY'
import csv, os, sys
out, term = sys.argv[1:3]
plot = os.path.join(out, "plot")
settings = {}
if os.path.exists(os.path.join(out, "settings")):
    settings = dict(l.strip().split("=", 1) for l in open(os.path.join(out, "settings")) if "=" in l)
window, threads, ngen = settings.get("swa_window", "?"), settings.get("threads", "?"), settings.get("ngen")
started = os.path.join(out, "started")
date = open(started).read().split()[0] if os.path.exists(started) else os.path.basename(os.path.normpath(out))

rows = list(csv.DictReader(open(os.path.join(out, "still.csv"))))
if os.path.exists(os.path.join(out, "peer.csv")):
    rows += list(csv.DictReader(open(os.path.join(out, "peer.csv"))))
if ngen is None:
    ngen = max((int(r["n_gen"]) for r in rows), default=0)
ngen = int(ngen)

def num(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v and abs(v) != float("inf") else None

series = []   # kinds in order of appearance, llama.cpp last
for r in rows:
    if r["attn"] not in series:
        series.append(r["attn"])
series.sort(key=lambda k: k == "llama.cpp")
label = lambda k: f"swa (window {window})" if k == "swa" else k
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#d62728", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
color = lambda i, k: "#000000" if k == "llama.cpp" else COLORS[i % len(COLORS)]

pts = {}   # (figure, series) -> [(x, y)]
for r in rows:
    k, p, n, d = r["attn"], int(r["n_prompt"]), int(r["n_gen"]), int(r["depth"])
    if n == 0 and d == 0 and p > 0:
        t = num(r["tps_mean"])
        if t:
            pts.setdefault(("prefill", k), []).append((p, p / t))
        for col, fig in (("peak_rss_mib", "rss"), ("state_mib", "state")):
            v = num(r[col])
            if v:
                pts.setdefault((fig, k), []).append((p, v))
    elif p == 0 and n == ngen:
        v = num(r["ms_per_token"])
        if v:
            pts.setdefault(("decode", k), []).append((d, v))

def datfile(fig, i):
    path = os.path.join(plot, f"{fig}-{i}.dat")
    with open(path, "w") as fh:
        fh.writelines(f"{x} {y:.10g}\n" for x, y in sorted(pts[fig, series[i]]))
    return path.replace("'", "''")

xs = sorted({x for v in pts.values() for x, _ in v})
xtics = ", ".join(f'"{x // 1024}K" {x}' if x >= 1024 and x % 1024 == 0 else f'"{x}" {x}' for x in xs)
gp = [f"set terminal {term} size 1000,620", "set grid", "set key outside right top", "set logscale x 2",
      f"set xtics ({xtics})" if xs else "", f"set xrange [{xs[0] / 1.2:g}:{xs[-1] * 1.2:g}]" if xs else "",
      "set pointsize 0.8"]
figs = [
    ("prefill", "Prefill time vs context length", "prompt length (tokens)", "seconds (log)", True,
     [("prefill", "", "")]),
    ("decode", f"Decode time per token vs context depth ({ngen} tokens after the context)", "context depth (tokens)",
     "ms / token", False, [("decode", "", "")]),
    ("memory", "Memory vs context length: peak RSS (solid), attention state (dashed)", "context length (tokens)",
     "MiB (log)", True, [("rss", "", " RSS"), ("state", "dt 2", " state")]),
]
for name, title, xl, yl, logy, parts in figs:
    plots = []
    for fig, dash, suffix in parts:
        for i, k in enumerate(series):
            if (fig, k) in pts:
                plots.append(f"'{datfile(fig, i)}' using 1:2 with linespoints lw 2 {dash} lc rgb '{color(i, k)}' "
                             f"title '{label(k)}{suffix}'")
    if not plots:
        print(f"plot-bench: no data for {name}.png", file=sys.stderr)
        continue
    png = os.path.join(out, f"{name}.png").replace("'", "''")
    gp += [f"set output '{png}'", f"set title '{title} - {date}, {threads} thread(s)'",
           f"set xlabel '{xl}'", f"set ylabel '{yl}'", "set logscale y" if logy else "unset logscale y",
           "plot " + ", \\\n     ".join(plots), "unset output"]
open(os.path.join(plot, "plot.gp"), "w").write("\n".join(l for l in gp if l) + "\n")
PY
gnuplot "$out/plot/plot.gp"
drawn=()
for f in prefill decode memory; do if [ -f "$out/$f.png" ]; then drawn+=("$out/$f.png"); fi; done
echo "plot-bench: wrote ${drawn[*]}" >&2
