#!/usr/bin/env python3
# Per-kernel totals of the LAST forward in an Nsight Compute CSV (ncu --csv --metrics gpu__time_duration.sum):
# from the last embedding kernel on, plus GEMM / still / other sums.   usage: ncu-kernel-sum.py FILE.csv [TOP]
import csv, sys, collections, re
if len(sys.argv) < 2:
    sys.exit('usage: ncu-kernel-sum.py FILE.csv [TOP]')
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit(f'ncu-kernel-sum: no kernel rows in {sys.argv[1]}')
hdr = rows[0]; ix = {h: i for i, h in enumerate(hdr)}
ks = []
for r in rows[1:]:
    if r[ix['Metric Name']] != 'gpu__time_duration.sum': continue
    v = float(r[ix['Metric Value']].replace(',', ''))
    unit = r[ix['Metric Unit']]
    us = v / 1000 if unit in ('nsecond', 'ns') else v * 1000 if unit in ('msecond', 'ms') else v
    ks.append((r[ix['Kernel Name']], us))
starts = [i for i, (n, _) in enumerate(ks) if 'embed' in n]
if not starts:
    sys.exit(f'ncu-kernel-sum: no embedding kernel (no forward) in {sys.argv[1]}')
start = starts[-1]
ks = ks[start:]
tot = collections.defaultdict(float); cnt = collections.Counter(); cat = collections.defaultdict(float)
for n, us in ks:
    n2 = n[:90]; tot[n2] += us; cnt[n2] += 1
    c = ('gemm' if re.search(r'gemm|xmma|cutlass|nvjet|sm90|Kernel2', n) else
         'still' if 'stillk' in n else 'other')
    cat[c] += us
T = sum(tot.values())
print(f'last forward: {T:.1f} us over {len(ks)} kernels; ' + ', '.join(f'{c} {v:.1f} us' for c, v in sorted(cat.items())))
for n, v in sorted(tot.items(), key=lambda x: -x[1])[:int(sys.argv[2]) if len(sys.argv) > 2 else 25]:
    print(f'{v:10.1f} us {100*v/T:5.1f}% {cnt[n]:4d}x {v/cnt[n]:8.2f} us each  {n}')
