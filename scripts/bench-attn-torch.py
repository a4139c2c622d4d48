#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the shapes bench_attn_cuda times.

Causal self-attention over L tokens (prefill) and one decode step at depth L
(a single query over L keys), bf16, SmolLM2's 9 query heads over 3 KV heads
with head dim 64 unless told otherwise; grouped-query heads through
enable_gqa=True (or, with --repeat-kv, K/V repeated to H heads beforehand,
outside the timing). Each point is the median of --reps timed calls (CUDA
events) after --warmup untimed ones. Prints the same markdown table as
build/cuda/bench_attn_cuda, to run side by side on the GPU machine:

    python3 scripts/bench-attn-torch.py [--lengths 1024,...] [--backend flash]

Tensors are laid out [1, L, H, D] (the C side's [L][H][D]) and handed to
SDPA as [1, H, L, D] views. TFLOP/s counts the causal products only,
4·D·H·L(L+1)/2; decode GB/s counts the K and V bytes, 2·L·Hk·D·2.
"""
import argparse
import contextlib
import statistics
import sys

import torch
import torch.nn.functional as F


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--backend", choices=["default", "flash", "efficient", "cudnn", "math"], default="default",
                    help="force one SDPA backend (default: PyTorch's choice)")
    ap.add_argument("--repeat-kv", action="store_true",
                    help="repeat K/V to all heads instead of enable_gqa=True")
    a = ap.parse_args()
    try:
        a.lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        ap.error("--lengths: expected numbers separated by commas")
    if any(x <= 0 for x in a.lengths) or a.reps < 1 or a.warmup < 0 or a.heads % a.kv_heads:
        ap.error("lengths and --reps must be positive, --heads a multiple of --kv-heads")
    return a


def backend_context(name):
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name])


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    a = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench-attn-torch: no CUDA device")
    H, Hk, D = a.heads, a.kv_heads, a.dim
    gqa = Hk != H
    torch.manual_seed(42)
    lmax = max(a.lengths)
    q_all = torch.randn(1, lmax, H, D, device="cuda", dtype=torch.bfloat16)
    k_all = torch.randn(1, lmax, Hk, D, device="cuda", dtype=torch.bfloat16)
    v_all = torch.randn(1, lmax, Hk, D, device="cuda", dtype=torch.bfloat16)

    p = torch.cuda.get_device_properties(0)
    print(f"0: {p.name}, compute {p.major}.{p.minor}, {p.multi_processor_count} SMs; torch {torch.__version__}\n")
    how = "K/V repeated to all heads" if a.repeat_kv and gqa else "enable_gqa=True" if gqa else "MHA"
    print(f"torch SDPA (backend {a.backend}, {how}): causal, {H} heads, {Hk} KV heads, head dim {D}, bf16; "
          f"median of {a.reps} after {a.warmup} warm-up\n")
    print("| L | prefill ms | prefill TFLOP/s | decode us | decode GB/s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    with backend_context(a.backend), torch.no_grad():
        for L in a.lengths:
            q = q_all[:, :L].transpose(1, 2)
            k = k_all[:, :L].transpose(1, 2)
            v = v_all[:, :L].transpose(1, 2)
            if a.repeat_kv and gqa:
                k = k.repeat_interleave(H // Hk, dim=1)
                v = v.repeat_interleave(H // Hk, dim=1)
            kw = {"enable_gqa": True} if gqa and not a.repeat_kv else {}
            qd = q[:, :, L - 1:L]
            reps = (a.reps + 1) // 2 if L >= 32768 else a.reps
            pre = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw), a.warmup, reps)
            # one query after all L keys: no mask (SDPA's is_causal aligns to the top-left corner)
            dec = time_ms(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=False, **kw), a.warmup, a.reps)
            flops = 4.0 * D * H * (L * (L + 1) / 2)
            kv_bytes = 2.0 * L * Hk * D * 2
            print(f"| {L} | {pre:.3f} | {flops / (pre * 1e-3) / 1e12:.1f} | {dec * 1e3:.1f} | "
                  f"{kv_bytes / (dec * 1e-3) / 1e9:.0f} |", flush=True)
            del q, k, v, qd


if __name__ == "__main__":
    main()
