#!/usr/bin/env python3
"""Per-layer budgets for a still plan at a fixed attention-state memory.

1. Score the layers: run `still probe` on retrieval prompts (a --tasks file
   and a --haystack that are not the evaluation's: make them with
   scripts/make-retrieval-dev.py and a training text) and average, per layer,
   the softmax teacher's attention mass on the needle at its strongest head.
   Layers where the teacher retrieves are the ones that need far tokens exact.
2. Allocate: the --top layers by score get --big tokens per KV head; every
   other layer gets the largest budget that keeps the whole state within the
   memory of a reference plan (--match, default: m = 896 per query head, the
   issue's equal memory), measured by the engine (`still generate -v`).

Prints the scores, the budgets and the --layer-budgets / --budget options;
--json FILE keeps them. Every figure comes from the engine's own output.

    scripts/layer-budgets.py -m MODEL --adapter A --tasks bench/data/retrieval-dev.jsonl \\
        --haystack ../shared/data/corpus/austen/emma.txt [--samples 12] [--length 4096] [--top 6] [--big 8320]

With --rank-only (no adapter needed) it stops after step 1 and prints the
ranking and the --top best layers as `softmax:L,L,...`: the layers to keep
exact in a linear hybrid (docs/plans.md, "Which layers to keep exact").
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"layer-budgets: error: {' '.join(cmd)} failed: {p.stderr.strip().splitlines()[-1:]}")
    return p.stdout, p.stderr


def probe_scores(a, n_tasks):
    """Mean teacher mass per layer over the samples (each sample a different item, tasks in turn)."""
    rows = re.compile(r"^\|\s*(\d+)\s*\|\s*\w+\s*\|\s*\d+\s*\|\s*([0-9.]+)\s*\|")
    total, n = {}, 0
    for i in range(a.samples):
        # items of a task file are used in turn: spread the samples over its tasks
        sample = (i % n_tasks) * a.items_per_task + i // n_tasks
        plan = ["--adapter", a.adapter] if a.adapter else []   # the teacher's mass does not depend on the plan
        out, _ = run([a.still, "probe", "-m", a.model, *plan, "--tasks", a.tasks, "--sample",
                      str(sample), "--length", str(a.length), "--haystack", a.haystack, "-t", str(a.threads)])
        got = {int(m.group(1)): float(m.group(2)) for m in map(rows.match, out.splitlines()) if m}
        if not got:
            sys.exit("layer-budgets: error: still probe printed no layer rows")
        for l, v in got.items():
            total[l] = total.get(l, 0.0) + v
        n += 1
        print(f"  probe sample {sample}: top layers "
              f"{sorted(got, key=lambda l: -got[l])[:8]}", file=sys.stderr)
    return {l: v / n for l, v in sorted(total.items())}


def state_mib(a, opts):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("Memory.")
        path = f.name
    try:
        _, err = run([a.still, "generate", "-m", a.model, *opts, "-f", path, "-n", "1", "-v", "-t", "1"])
    finally:
        os.unlink(path)
    m = re.search(r"attention state ([0-9.]+) MiB", err)
    if not m:
        sys.exit("layer-budgets: error: still generate -v printed no attention state")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--adapter", help="the still adapter whose budgets are set (not needed with --rank-only)")
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--haystack", required=True)
    ap.add_argument("--still", default="build/still")
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--top", type=int, default=6, help="layers that get --big (default 6)")
    ap.add_argument("--big", type=int, default=8320, help="their budget per KV head (default 8320: exact to 8K)")
    ap.add_argument("--tiers", help="instead of --top/--big: N:M,N:M,... the best N layers get M, the next N' get "
                    "M', ... (e.g. 4:8320,5:3200)")
    ap.add_argument("--match", default="--attn still --budget 896",
                    help="the plan whose state memory is the limit (default: m = 896 per query head)")
    ap.add_argument("--scores", help="reuse the scores of an earlier --json FILE instead of probing")
    ap.add_argument("--json", help="write scores and budgets here")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rank-only", action="store_true",
                    help="print the layers ranked by the teacher's mass and the --top best as a plan's softmax "
                         "layers (the exact layers of a linear hybrid, docs/plans.md), then stop")
    a = ap.parse_args()
    if not a.adapter and not a.rank_only:
        sys.exit("layer-budgets: error: --adapter is required (or --rank-only)")
    with open(a.tasks) as f:
        tasks = [json.loads(line)["task"] for line in f if line.strip()]
    names = list(dict.fromkeys(tasks))
    a.items_per_task = min(tasks.count(t) for t in names)
    if any(tasks[i * a.items_per_task] != t for i, t in enumerate(names)):
        sys.exit("layer-budgets: error: the tasks file must list each task's items together, equally many")
    if a.scores:
        with open(a.scores) as f:
            scores = {int(k): v for k, v in json.load(f)["scores"].items()}
    else:
        scores = probe_scores(a, len(names))
    n_layer = len(scores)
    if a.rank_only:
        ranked = sorted(scores, key=lambda l: -scores[l])
        print("| rank | layer | teacher mass on the needle (mean) |")
        print("|---:|---:|---:|")
        for i, l in enumerate(ranked):
            print(f"| {i + 1} | {l} | {scores[l]:.3f} |")
        print(f"\nexact layers (the best {a.top}): softmax:{','.join(str(l) for l in sorted(ranked[:a.top]))}")
        if a.json:
            tmp = a.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"scores": scores, "exact_layers": sorted(ranked[:a.top])}, f, indent=1)
            os.replace(tmp, a.json)
        return
    tiers = [(a.top, a.big)]
    if a.tiers:
        try:
            tiers = [(int(n), int(m)) for n, m in (t.split(":") for t in a.tiers.split(","))]
        except ValueError:
            sys.exit(f"layer-budgets: error: --tiers: expected N:M,N:M,... got '{a.tiers}'")
    ranked = sorted(scores, key=lambda l: -scores[l])
    given, at = {}, 0
    for n, m in tiers:
        for l in ranked[at:at + n]:
            given[l] = m
        at += n
    top = sorted(given)
    limit = state_mib(a, a.match.split())

    def opts(small):
        spec = ",".join(f"{l}={given[l]}" for l in top)
        return ["--adapter", a.adapter, "--budget", str(small), "--layer-budgets", spec]

    lo, hi = 128, max(m for _, m in tiers)   # the largest small budget within the limit (a budget is >= 2C)
    if state_mib(a, opts(lo)) > limit:
        sys.exit(f"layer-budgets: error: the tiers {tiers} do not fit in {limit:.2f} MiB even with the "
                 f"others at {lo}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if state_mib(a, opts(mid)) <= limit:
            lo = mid
        else:
            hi = mid
    got = state_mib(a, opts(lo))
    o = opts(lo)
    print("| layer | teacher mass on the needle (mean) | budget |")
    print("|---:|---:|---:|")
    for l in range(n_layer):
        print(f"| {l} | {scores[l]:.3f} | {given.get(l, lo)} |")
    print(f"\nstate {got:.2f} MiB (limit {limit:.2f} MiB: {a.match})")
    print("options: " + " ".join(o[2:]))
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"scores": scores, "tiers": tiers, "layers": {l: given[l] for l in top}, "small": lo, "state_mib": got,
                       "limit_mib": limit, "match": a.match, "options": o[2:], "samples": a.samples,
                       "length": a.length, "tasks": a.tasks, "haystack": a.haystack}, f, indent=1)
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
