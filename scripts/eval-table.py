#!/usr/bin/env python3
"""Merge `still eval --json` files into one markdown table (task x length, a
column per configuration), e.g. the cells that scripts/eval-remote.sh ran as
separate jobs.

    scripts/eval-table.py [--order a,b,c] FILE.json...
"""
import argparse
import json
import math
import sys

Z95 = 1.959964


def interval(s):
    """95% interval of a cell's mean: Wilson's for 0/1 scores, else the normal
    approximation (clipped to [0, 1])."""
    n = len(s)
    p = sum(s) / n
    if all(x in (0, 1) for x in s):
        d = 1 + Z95 * Z95 / n
        c = (p + Z95 * Z95 / (2 * n)) / d
        h = Z95 * math.sqrt(p * (1 - p) / n + Z95 * Z95 / (4 * n * n)) / d
        return max(0.0, c - h), min(1.0, c + h)
    var = sum((x - p) ** 2 for x in s) / (n - 1) if n > 1 else 0.0
    h = Z95 * math.sqrt(var / n)
    return max(0.0, p - h), min(1.0, p + h)


def mean_interval(cells_):
    """The mean of the task means and its normal-approximation 95% interval
    (independent tasks: the variances of the task means add)."""
    k = len(cells_)
    m = sum(sum(s) / len(s) for s in cells_) / k
    var = 0.0
    for s in cells_:
        n, p = len(s), sum(s) / len(s)
        v = sum((x - p) ** 2 for x in s) / (n - 1) if n > 1 else 0.0
        var += v / n
    h = Z95 * math.sqrt(var) / k
    return m, max(0.0, m - h), min(1.0, m + h)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--order", help="configuration columns, comma-separated (default: first seen)")
    ap.add_argument("--max-samples", type=int, default=0,
                    help="use only the first K samples of each cell (samples are seeded by their index, so every "
                         "configuration then sees the same prompts)")
    ap.add_argument("--ci", action="store_true", help="print each cell's 95%% interval beside its mean")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()

    cells = {}        # (config, task, length) -> list of per-sample scores
    configs, tasks, lengths = [], [], set()
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"eval-table: error: {path}: {e}")
        for r in doc.get("results", []):
            key = (r["config"], r["task"], r["length"])
            if key in cells:
                sys.exit(f"eval-table: error: {path}: cell {key} appears twice")
            cells[key] = r["scores"][: args.max_samples] if args.max_samples > 0 else r["scores"]
            if r["config"] not in configs:
                configs.append(r["config"])
            if r["task"] not in tasks:
                tasks.append(r["task"])
            lengths.add(r["length"])
    if args.order:
        order = args.order.split(",")
        missing = [c for c in order if c not in configs]
        if missing:
            sys.exit(f"eval-table: error: no results for configuration(s) {', '.join(missing)}")
        configs = order + [c for c in configs if c not in order]
    lengths = sorted(lengths)

    def cell(c, t, n):
        s = cells.get((c, t, n))
        if s is None:
            return "–"
        if args.ci:
            lo, hi = interval(s)
            return f"{100.0 * sum(s) / len(s):.0f} [{100 * lo:.0f}–{100 * hi:.0f}]"
        return f"{100.0 * sum(s) / len(s):.0f}"

    print("| task | length | " + " | ".join(configs) + " |")
    print("|---|---:|" + "---:|" * len(configs))
    for t in tasks:
        for n in lengths:
            print(f"| {t} | {n} | " + " | ".join(cell(c, t, n) for c in configs) + " |")
    # mean over the tasks at each length (only where every task ran)
    for n in lengths:
        row = []
        for c in configs:
            got = [cells[(c, t, n)] for t in tasks if (c, t, n) in cells]
            if len(got) < len(tasks):
                row.append("–")
            else:
                m, lo, hi = mean_interval(got)
                row.append(f"{100 * m:.0f} [{100 * lo:.0f}–{100 * hi:.0f}]" if args.ci else f"{100 * m:.0f}")
        print(f"| **mean** | {n} | " + " | ".join(row) + " |")
    counts = sorted({len(s) for s in cells.values()})
    print(f"\nscores in % of reference values found; samples per cell: {', '.join(map(str, counts))}"
          + ("; [95% interval: Wilson's for 0/1 cells, normal approximation for partial scores and the means]"
             if args.ci else ""))


if __name__ == "__main__":
    main()
