#!/usr/bin/env python3
"""The peer for `still finetune`'s speed: transformers + peft, the same model
(SmolLM2's GGUF weights dequantized by the `gguf` package), LoRA rank 8 /
alpha 16 on q, k, v, o, AdamW at lr 1e-4, sequences of --seq tokens, --batch
per step. On the CPU in float32; with --device cuda the frozen weights in
bf16, the LoRA weights and AdamW in float32, products under bf16 autocast and
SDPA attention (flash kernels): the usual peft recipe on a GPU, as `still
finetune --device cuda` runs (bf16 frozen products, fp32 LoRA and moments).
Prints learnt tokens per second over --steps steps after two warm-up steps.

  python3 scripts/bench-finetune-peer.py --model M --text FILE [--seq 512 --batch 2 --steps 4 --threads 2]
      [--device cuda]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args()
    import torch
    import ref_llama as RL
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(a.threads)
    m = RL.load(a.model)
    cfg = LlamaConfig(vocab_size=m.n_vocab, hidden_size=m.d, intermediate_size=m.n_ff, num_hidden_layers=m.n_layer,
                      num_attention_heads=m.n_head, num_key_value_heads=m.n_head_kv, head_dim=m.head_dim,
                      max_position_embeddings=8192, rms_norm_eps=m.eps, rope_theta=m.theta, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    W, sd = m.w, {"model.embed_tokens.weight": m.w["token_embd.weight"], "model.norm.weight": m.w["output_norm.weight"]}
    names = dict(attn_q="self_attn.q_proj", attn_k="self_attn.k_proj", attn_v="self_attn.v_proj",
                 attn_output="self_attn.o_proj", ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj",
                 attn_norm="input_layernorm", ffn_norm="post_attention_layernorm")
    for l in range(m.n_layer):
        for g, h in names.items():
            w = W[f"blk.{l}.{g}.weight"]
            if g == "attn_q":
                w = RL.unpermute_hf(w, m.n_head)
            if g == "attn_k":
                w = RL.unpermute_hf(w, m.n_head_kv)
            sd[f"model.layers.{l}.{h}.weight"] = w
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=False)
    gpu = a.device == "cuda"
    if gpu:
        model = model.to(device="cuda", dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if gpu:   # fp32 master weights for what trains, as still keeps them
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    ids = RL.build_tokenizer(m).encode(open(a.text, encoding="utf-8").read()[:200000], add_special_tokens=False).ids
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0)
    n_seq = len(ids) // a.seq

    def step(s):
        x = torch.tensor([ids[((s * a.batch + b) % n_seq) * a.seq:][:a.seq] for b in range(a.batch)], device=a.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss)

    step(0), step(1)
    if gpu:
        torch.cuda.synchronize()
    t0 = time.time()
    for s in range(2, a.steps + 2):
        step(s)
    if gpu:
        torch.cuda.synchronize()
    el = time.time() - t0
    n = a.steps * a.batch * (a.seq - 1)
    print(f"peer (torch {torch.__version__}, transformers {__import__('transformers').__version__}, peft "
          f"{__import__('peft').__version__}, {'bf16 frozen weights + autocast, ' + torch.cuda.get_device_name() if gpu else f'float32, {a.threads} threads'}): "
          f"{a.steps} steps of {a.batch} x {a.seq}, "
          f"{el:.1f} s, {n / el:.1f} learnt tokens/s"
          + (f", peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if gpu else ""))


if __name__ == "__main__":
    main()
