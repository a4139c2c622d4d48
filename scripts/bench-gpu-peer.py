#!/usr/bin/env python3
"""The GPU peer of `still bench --device cuda`: Hugging Face transformers'
LlamaForCausalLM with PyTorch SDPA attention, bf16, batch 1, on the shape of
SmolLM2-135M (30 layers, d 576, 9 heads, 3 KV heads, head dim 64, d_ff 1536,
vocab 49152) with random weights (speed only).

For each length L: prefill of L tokens from an empty cache (ms, median of
--reps after a warm-up), and decode ms/token generating --ngen tokens one at
a time after a context of L tokens (the cache filled by one prefill). Prints
a markdown table, or CSV with --csv.

  python3 scripts/bench-gpu-peer.py --lengths 1024,16384,65536 [--ngen 32] [--reps 3]
"""
import argparse
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,65536")
    ap.add_argument("--ngen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--csv", action="store_true")
    a = ap.parse_args()
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
        assert all(L > 0 for L in lengths) and a.ngen > 0 and a.reps > 0
    except (ValueError, AssertionError):
        sys.exit("bench-gpu-peer: error: --lengths takes positive integers, --ngen and --reps positive")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.cache_utils import DynamicCache

    if not torch.cuda.is_available():
        sys.exit("bench-gpu-peer: error: no CUDA device")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=max(lengths) + a.ngen + 8,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(1)

    def sync_ms(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    rows = []
    with torch.inference_mode():
        for L in lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, L), device="cuda", generator=g)

            def prefill():
                return model(ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)

            prefill()   # warm-up
            pp = statistics.median(sync_ms(prefill) for _ in range(a.reps))
            times = []
            for _ in range(a.reps):
                out = prefill()
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)

                def steps():
                    nonlocal cache, nxt
                    for _ in range(a.ngen):
                        o = model(nxt, past_key_values=cache, use_cache=True)
                        cache, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
                times.append(sync_ms(steps) / a.ngen)
            rows.append((L, pp, statistics.median(times)))
            del ids
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name(0)
    if a.csv:
        print("peer,length,prefill_ms,decode_ms_per_token")
        for L, pp, tg in rows:
            print(f"transformers-sdpa,{L},{pp:.3f},{tg:.4f}")
    else:
        print(f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, {dev}, bf16, SDPA, "
              f"batch 1, median of {a.reps}, decode {a.ngen} tokens")
        print("| length | prefill ms | decode ms/token (at depth = length) |")
        print("| ---: | ---: | ---: |")
        for L, pp, tg in rows:
            print(f"| {L} | {pp:.2f} | {tg:.3f} |")


if __name__ == "__main__":
    main()
