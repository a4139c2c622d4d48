#!/usr/bin/env python3
"""Merge `still eval --json` files into one markdown table (task x length, a
column per configuration), e.g. the cells that scripts/eval-remote.sh ran as
separate jobs.

    scripts/eval-table.py [--order a,b,c] FILE.json...
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--order", help="configuration columns, comma-separated (default: first seen)")
    ap.add_argument("--max-samples", type=int, default=0,
                    help="use only the first K samples of each cell (samples are seeded by their index, so every "
                         "configuration then sees the same prompts)")
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
                row.append(f"{100.0 * sum(sum(s) / len(s) for s in got) / len(got):.0f}")
        print(f"| **mean** | {n} | " + " | ".join(row) + " |")
    counts = sorted({len(s) for s in cells.values()})
    print(f"\nscores in % of reference values found; samples per cell: {', '.join(map(str, counts))}")


if __name__ == "__main__":
    main()
