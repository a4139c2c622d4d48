#!/usr/bin/env python3
"""Stage 2 against PyTorch + peft: the softmax plan with LoRA on q, k, v, o,
the same batch and the same LoRA values, loss and LoRA gradients compared.

Three steps, because the engine and PyTorch need not live on one machine:

  prepare  (here)       tokens of a held-out text, LoRA values (A as peft
                        initialises it, B random so that A's gradient is not
                        zero), the engine's loss and gradients for the batch
                        through tests/tools/finetune_tool -> PREP.npz
  torch    (anywhere    transformers' LlamaForCausalLM built from the GGUF's
           with torch)  weights dequantized by the `gguf` package (q and k rows
                        put back in Hugging Face's order), peft's LoRA with the
                        same values, float32 on the CPU (--device cpu) or bf16
                        on the GPU -> TORCH.npz
  compare               relative errors; exit 1 when the loss differs by more
                        than 1e-4 or a LoRA gradient by more than 1e-3 (float32)

  scripts/check-peft.py prepare --model M --text T --tool build/finetune_tool --out prep.npz
  scripts/check-peft.py torch --model M --prep prep.npz --out torch.npz [--device cpu|cuda]
  scripts/check-peft.py compare prep.npz torch.npz [--tol-loss 1e-4 --tol-grad 1e-3]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))

TARGETS = ["q", "k", "v", "o"]
HF = dict(q="q_proj", k="k_proj", v="v_proj", o="o_proj")


def shapes(m):
    d, qd, kvd = m.d, m.n_head * m.head_dim, m.n_head_kv * m.head_dim
    return dict(q=(d, qd), k=(d, kvd), v=(d, kvd), o=(qd, d))


def prepare(a):
    import ref_llama as RL
    m = RL.load(a.model)
    tok = RL.build_tokenizer(m)
    text = open(a.text, encoding="utf-8").read()[a.skip:a.skip + 40 * a.seq]
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) >= a.batch * a.seq, "text too short"
    seqs = np.array([ids[i * a.seq:(i + 1) * a.seq] for i in range(a.batch)], dtype=np.int32)
    rng = np.random.default_rng(a.seed)
    lora = {}
    for l in range(m.n_layer):
        for t in TARGETS:
            ni, no = shapes(m)[t]
            A = rng.uniform(-1, 1, (a.rank, ni)) / np.sqrt(ni)         # peft: kaiming_uniform(a=sqrt(5))
            B = rng.standard_normal((no, a.rank)) * a.b_scale          # not peft's zeros: A's gradient must exist
            lora[(l, t)] = (A.astype(np.float32), B.astype(np.float32))
    flat = np.concatenate([np.concatenate([lora[(l, t)][0].ravel(), lora[(l, t)][1].ravel()])
                           for l in range(m.n_layer) for t in TARGETS])
    loss, grads = 0.0, None
    with tempfile.TemporaryDirectory() as tmp:
        for b in range(a.batch):
            src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
            with open(src, "wb") as f:
                f.write(f"T={a.seq} rank={a.rank} alpha={a.alpha} targets=q,k,v,o\n".encode())
                f.write(seqs[b].astype("<i4").tobytes())
                f.write(np.ones(a.seq, "<f4").tobytes())
                f.write(flat.astype("<f4").tobytes())
            p = subprocess.run([a.tool, a.model, src, dst], capture_output=True, text=True, check=True)
            kv = dict(x.split("=") for x in p.stdout.split())
            loss += float(kv["loss"])
            g = np.fromfile(dst, dtype="<f4").astype(np.float64)
            grads = g if grads is None else grads + g
    n_tok = a.batch * (a.seq - 1)
    out = dict(tokens=seqs, rank=a.rank, alpha=a.alpha, loss=loss / n_tok, grads=grads / n_tok, lora=flat)
    np.savez(a.out, **out)
    print(f"prepare: {a.batch} x {a.seq} tokens, engine loss {loss / n_tok:.7f}, {flat.size} LoRA values -> {a.out}")


def unflat(m, rank, v):
    out, i = {}, 0
    for l in range(m.n_layer):
        for t in TARGETS:
            ni, no = shapes(m)[t]
            A = v[i:i + rank * ni].reshape(rank, ni); i += rank * ni
            B = v[i:i + no * rank].reshape(no, rank); i += no * rank
            out[(l, t)] = (A, B)
    return out


def run_torch(a):
    import torch
    import ref_llama as RL
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    m = RL.load(a.model, use_cache=False)
    P = np.load(a.prep)
    rank, alpha = int(P["rank"]), float(P["alpha"])
    dev = torch.device(a.device)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    cfg = LlamaConfig(vocab_size=m.n_vocab, hidden_size=m.d, intermediate_size=m.n_ff, num_hidden_layers=m.n_layer,
                      num_attention_heads=m.n_head, num_key_value_heads=m.n_head_kv, head_dim=m.head_dim,
                      max_position_embeddings=8192, rms_norm_eps=m.eps, rope_theta=m.theta,
                      tie_word_embeddings=m.out_name == "token_embd.weight", attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    W = m.w
    sd = {"model.embed_tokens.weight": W["token_embd.weight"], "model.norm.weight": W["output_norm.weight"]}
    if m.out_name != "token_embd.weight":
        sd["lm_head.weight"] = W[m.out_name]
    for l in range(m.n_layer):
        p, h = f"blk.{l}.", f"model.layers.{l}."
        sd[h + "self_attn.q_proj.weight"] = RL.unpermute_hf(W[p + "attn_q.weight"], m.n_head)
        sd[h + "self_attn.k_proj.weight"] = RL.unpermute_hf(W[p + "attn_k.weight"], m.n_head_kv)
        sd[h + "self_attn.v_proj.weight"] = W[p + "attn_v.weight"]
        sd[h + "self_attn.o_proj.weight"] = W[p + "attn_output.weight"]
        sd[h + "mlp.gate_proj.weight"] = W[p + "ffn_gate.weight"]
        sd[h + "mlp.up_proj.weight"] = W[p + "ffn_up.weight"]
        sd[h + "mlp.down_proj.weight"] = W[p + "ffn_down.weight"]
        sd[h + "input_layernorm.weight"] = W[p + "attn_norm.weight"]
        sd[h + "post_attention_layernorm.weight"] = W[p + "ffn_norm.weight"]
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                                                strict=False)
    assert not unexpected and all("lm_head" in k or "rotary" in k for k in missing), (missing, unexpected)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                                             target_modules=list(HF.values())))
    lora = unflat(m, rank, P["lora"].astype(np.float64))
    heads = dict(q=m.n_head, k=m.n_head_kv)
    mods = {}
    with torch.no_grad():
        for l in range(m.n_layer):
            for t in TARGETS:
                mod = model.base_model.model.model.layers[l].self_attn.__getattr__(HF[t])
                A, B = lora[(l, t)]
                if t in heads:
                    B = RL.unpermute_hf(B, heads[t])   # B's rows are the output rows q and k are permuted in
                mod.lora_A["default"].weight.copy_(torch.from_numpy(A.astype(np.float32)))
                mod.lora_B["default"].weight.copy_(torch.from_numpy(np.ascontiguousarray(B).astype(np.float32)))
                mods[(l, t)] = mod
    model = model.to(dev, dtype)
    ids = torch.from_numpy(P["tokens"].astype(np.int64)).to(dev)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = []
    for l in range(m.n_layer):
        for t in TARGETS:
            mod = mods[(l, t)]
            gA = mod.lora_A["default"].weight.grad.float().cpu().numpy().astype(np.float64)
            gB = mod.lora_B["default"].weight.grad.float().cpu().numpy().astype(np.float64)
            if t in heads:   # back to the GGUF row order of the engine
                n = heads[t]
                D = gB.shape[0] // n
                gB = gB.reshape(n, 2, D // 2, -1).swapaxes(1, 2).reshape(gB.shape)
            grads += [gA.ravel(), gB.ravel()]
    np.savez(a.out, loss=float(out.loss), grads=np.concatenate(grads), device=a.device,
             torch=torch.__version__, transformers=__import__("transformers").__version__,
             peft=__import__("peft").__version__)
    print(f"torch ({a.device}, {dtype}): loss {float(out.loss):.7f} -> {a.out}")


def compare(a):
    P, Q = np.load(a.prep), np.load(a.torch)
    import ref_llama as RL  # noqa: F401  (only for the shapes below)
    rank = int(P["rank"])
    el = abs(float(P["loss"]) - float(Q["loss"])) / abs(float(Q["loss"]))
    gp, gq = P["grads"], Q["grads"]
    eg = np.linalg.norm(gp - gq) / np.linalg.norm(gq)
    # per tensor: the worst relative error of any one LoRA tensor
    sizes = []
    for f in (a.model,) if a.model else ():
        m = RL.load(f)
        for l in range(m.n_layer):
            for t in TARGETS:
                ni, no = shapes(m)[t]
                sizes += [(f"blk.{l}.{t}.A", rank * ni), (f"blk.{l}.{t}.B", no * rank)]
    worst, wname, i = 0.0, "", 0
    for name, n in sizes:
        e = np.linalg.norm(gp[i:i + n] - gq[i:i + n]) / max(np.linalg.norm(gq[i:i + n]), 1e-30)
        if e > worst:
            worst, wname = e, name
        i += n
    dev = str(Q["device"])
    print(f"loss: engine {float(P['loss']):.7f}, torch {float(Q['loss']):.7f} ({dev}; torch {Q['torch']}, "
          f"transformers {Q['transformers']}, peft {Q['peft']}): relative difference {el:.2e}")
    print(f"LoRA gradients: relative difference {eg:.2e} over all {gp.size}"
          + (f"; worst tensor {wname} {worst:.2e}" if sizes else ""))
    ok = el <= a.tol_loss and eg <= a.tol_grad and (not sizes or worst <= a.tol_grad)
    print("PASS" if ok else "FAIL", f"(tolerances: loss {a.tol_loss:g}, gradients {a.tol_grad:g})")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--tool", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--b-scale", type=float, default=0.02)
    p.add_argument("--skip", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("torch")
    t.add_argument("--model", required=True)
    t.add_argument("--prep", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    c = sub.add_parser("compare")
    c.add_argument("prep")
    c.add_argument("torch")
    c.add_argument("--model", help="for the per-tensor figures")
    c.add_argument("--tol-loss", type=float, default=1e-4)
    c.add_argument("--tol-grad", type=float, default=1e-3)
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a)
    elif a.cmd == "torch":
        run_torch(a)
    else:
        sys.exit(compare(a))


if __name__ == "__main__":
    main()
