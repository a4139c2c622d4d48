#!/usr/bin/env python3
"""The gdn kind's GPU kernels against flash-linear-attention (fla), on the GPU machine.

    python3 scripts/bench-gdn-fla.py DIR [--lengths 1024,8192] [--reps 20]

DIR holds what `bench_gdn_cuda DIR` wrote: one prefill's inputs (q, k, v, β, log α) and still's outputs y
(the gate open, w_n = 1: y = o / rms(o), o = S q̂). Checks y against
  1. a float64 token-by-token recurrence in PyTorch (the spec's S ← α S (I − β k̂ k̂ᵀ) + β v k̂ᵀ; first 512 tokens),
  2. fla's chunk_gated_delta_rule (Triton, fp32 inputs; fla has no query-head groups sharing a state, so each KV
     head's k, v, β, log α are repeated for its G query heads: the same outputs, G times the state work),
then times fla's forward at each length: on the model's heads expanded (H states) and on Hk heads (one query head
per state, the state work still's kernels do), in fp32 and bf16; and a decode step at each depth: the state after a
prefill of that many tokens (chunk_gated_delta_rule's final state), then fused_recurrent_gated_delta_rule on one
token from it, each step one call (no CUDA graph, as bench_gdn_cuda's step). Prints markdown."""
import argparse
import os
import sys

import numpy as np
import torch


def load(d, name, shape):
    return torch.from_numpy(np.fromfile(os.path.join(d, name), dtype=np.float32).reshape(shape))


def rms_rows(o):
    return o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-6)


def row_err(got, ref):
    num = ((got - ref) ** 2).sum(-1).sqrt()
    den = (ref ** 2).sum(-1).sqrt().clamp_min(1e-30)
    r = num / den
    return r.max().item(), ((got - ref) ** 2).sum().sqrt().item() / (ref ** 2).sum().sqrt().item()


def median_ms(f, warm, reps):
    """The median of reps timed calls of f (CUDA events, synchronised each call) after warm untimed ones, in ms."""
    for _ in range(warm):
        f()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        f()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def recurrent_f64(q, k, v, beta, lal, G):
    """q [L][H][D], k, v [L][Hk][D], beta, lal [L][Hk]: raw o [L][H][D] in float64, token by token."""
    L, H, D = q.shape
    Hk = k.shape[1]
    q = q.double() / q.double().norm(dim=-1, keepdim=True).clamp_min(1e-6)
    k = k.double() / k.double().norm(dim=-1, keepdim=True).clamp_min(1e-6)
    v, beta, alpha = v.double(), beta.double(), lal.double().exp()
    S = torch.zeros(Hk, D, D, dtype=torch.float64)   # S[v][k]
    eye = torch.eye(D, dtype=torch.float64)
    o = torch.zeros(L, H, D, dtype=torch.float64)
    for t in range(L):
        for hk in range(Hk):
            kk = k[t, hk]
            M = eye - beta[t, hk] * torch.outer(kk, kk)
            S[hk] = alpha[t, hk] * S[hk] @ M + beta[t, hk] * torch.outer(v[t, hk], kk)
            for g in range(G):
                o[t, hk * G + g] = S[hk] @ q[t, hk * G + g]
    return o


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--lengths", default="1024,4096,8192,32768")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    L, H, Hk, D = map(int, open(os.path.join(a.dir, "shape.txt")).read().split())
    G = H // Hk
    q, y = load(a.dir, "q.bin", (L, H, D)), load(a.dir, "y.bin", (L, H, D))
    k, v = load(a.dir, "k.bin", (L, Hk, D)), load(a.dir, "v.bin", (L, Hk, D))
    beta, lal = load(a.dir, "beta.bin", (L, Hk)), load(a.dir, "lal.bin", (L, Hk))
    n = min(L, 512)
    ref = rms_rows(recurrent_f64(q[:n], k[:n], v[:n], beta[:n], lal[:n], G))
    w, allrel = row_err(y[:n].double(), ref)
    print(f"still vs float64 recurrence, first {n} tokens of {L} ({H} heads over {Hk}, D {D}): "
          f"worst row {w:.2e}, whole {allrel:.2e}")
    dev = torch.device("cuda")
    rep = lambda x: x.repeat_interleave(G, dim=1)   # KV head hk -> query heads hk*G .. hk*G+G-1
    o, _ = chunk_gated_delta_rule(q[None].to(dev), rep(k)[None].to(dev), rep(v)[None].to(dev),
                                  rep(lal[..., None])[..., 0][None].to(dev), rep(beta[..., None])[..., 0][None].to(dev),
                                  scale=1.0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    fo = rms_rows(o[0].double().cpu())
    w, allrel = row_err(y.double(), fo)
    w2, all2 = row_err(fo[:n], ref)
    print(f"still vs fla chunk_gated_delta_rule (fp32), {L} tokens: worst row {w:.2e}, whole {allrel:.2e}; "
          f"fla vs float64 (first {n}): worst row {w2:.2e}, whole {all2:.2e}")
    print()
    print(f"fla {getattr(sys.modules.get('fla'), '__version__', '?')} chunk_gated_delta_rule forward, "
          f"{torch.cuda.get_device_name()}, median of {a.reps} after 3 (ms):")
    print()
    print("| tokens | fla fp32 H=%d | fla bf16 H=%d | fla fp32 H=%d | fla bf16 H=%d |" % (H, H, Hk, Hk))
    print("| ---: | ---: | ---: | ---: | ---: |")
    for Lt in [int(x) for x in a.lengths.split(",")]:
        row = [str(Lt)]
        for heads in (H, Hk):
            for dt in (torch.float32, torch.bfloat16):
                qq = torch.randn(1, Lt, heads, D, device=dev, dtype=dt)
                kk = torch.randn(1, Lt, heads, D, device=dev, dtype=dt)
                vv = torch.randn(1, Lt, heads, D, device=dev, dtype=dt)
                gg = -torch.rand(1, Lt, heads, device=dev, dtype=torch.float32) * 0.1
                bb = torch.rand(1, Lt, heads, device=dev, dtype=dt)
                f = lambda: chunk_gated_delta_rule(qq, kk, vv, gg, bb, scale=1.0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
                row.append("%.3f" % median_ms(f, 3, a.reps))
        print("| " + " | ".join(row) + " |")
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    print()
    print(f"fla fused_recurrent_gated_delta_rule, one token from the state at each depth, median of "
          f"{10 * a.reps} steps (us):")
    print()
    print("| depth | fla fp32 H=%d | fla bf16 H=%d | fla fp32 H=%d | fla bf16 H=%d |" % (H, H, Hk, Hk))
    print("| ---: | ---: | ---: | ---: | ---: |")
    for Lt in [int(x) for x in a.lengths.split(",")]:
        row = [str(Lt)]
        for heads in (H, Hk):
            for dt in (torch.float32, torch.bfloat16):
                mk = lambda n: torch.randn(1, n, heads, D, device=dev, dtype=dt)
                gg = -torch.rand(1, Lt, heads, device=dev, dtype=torch.float32) * 0.1
                bb = torch.rand(1, Lt, heads, device=dev, dtype=dt)
                _, state = chunk_gated_delta_rule(mk(Lt), mk(Lt), mk(Lt), gg, bb, scale=1.0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
                q1, k1, v1 = mk(1), mk(1), mk(1)
                g1 = -torch.rand(1, 1, heads, device=dev, dtype=torch.float32) * 0.1
                b1 = torch.rand(1, 1, heads, device=dev, dtype=dt)
                f = lambda: fused_recurrent_gated_delta_rule(q1, k1, v1, g1, b1, scale=1.0, initial_state=state,
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
                row.append("%.1f" % (1000.0 * median_ms(f, 5, 10 * a.reps)))
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
