#!/usr/bin/env python3
"""The CPU peer for `still finetune`'s speed: transformers + peft, float32,
the same model (SmolLM2's GGUF weights dequantized by the `gguf` package),
LoRA rank 8 / alpha 16 on q, k, v, o, AdamW at lr 1e-4, sequences of --seq
tokens, --batch per step. Prints learnt tokens per second over --steps steps
after one warm-up step.

  python3 scripts/bench-finetune-peer.py --model M --text FILE [--seq 512 --batch 2 --steps 4 --threads 2]
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
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    ids = RL.build_tokenizer(m).encode(open(a.text, encoding="utf-8").read()[:200000], add_special_tokens=False).ids
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0)
    n_seq = len(ids) // a.seq

    def step(s):
        x = torch.tensor([ids[((s * a.batch + b) % n_seq) * a.seq:][:a.seq] for b in range(a.batch)])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss)

    step(0)
    t0 = time.time()
    for s in range(1, a.steps + 1):
        step(s)
    el = time.time() - t0
    n = a.steps * a.batch * (a.seq - 1)
    print(f"peer (torch {torch.__version__}, transformers {__import__('transformers').__version__}, peft "
          f"{__import__('peft').__version__}, float32, {a.threads} threads): {a.steps} steps of {a.batch} x {a.seq}, "
          f"{el:.1f} s, {n / el:.1f} learnt tokens/s")


if __name__ == "__main__":
    main()
