#!/usr/bin/env python3
"""Slow, obviously-correct numpy reference for Llama-architecture GGUF models.

Independent of the C engine: it reads the GGUF with the `gguf` PyPI package,
dequantizes every tensor to float32 with `gguf.quants.dequantize`, and runs the
whole forward pass with plain numpy.

Public API
----------
    load(path) -> Model             (memoised; also sets the module default)
    forward(token_ids) -> logits    (n_tok, n_vocab) float32, every position
    hidden_states(token_ids)        [embeddings, after layer 0, ..., after last
                                     layer, after final norm], each (n_tok, d)
    build_tokenizer(model)          HF `tokenizers.Tokenizer` from GGUF metadata
    greedy(model, ids, n)           greedy continuation (full recompute per step)
    perplexity(model, ids)          exp(mean NLL of ids[1:] given the prefix)

Conventions (what an engine must reproduce)
-------------------------------------------
* Tensor shapes: gguf reports ne = [n_in, n_out]; the numpy array returned by
  dequantize is (n_out, n_in), row-major, so y = x @ W.T.
* token_embd.weight (n_vocab, d) is the embedding table AND, when there is no
  output.weight (tied embeddings, as in SmolLM2), the output matrix:
  logits = final_norm(x) @ token_embd.T.
* RMSNorm: y = x / sqrt(mean(x^2) + eps) * w     (eps from the GGUF, ~1e-5).
* Attention: head h of Q uses KV head h // (n_head / n_head_kv); scale
  1/sqrt(head_dim); causal (position i sees 0..i); positions start at 0.
* FFN: down( silu(gate(x)) * up(x) ), silu(z) = z * sigmoid(z).
* RoPE: ADJACENT-PAIR ("normal", GPT-J style, ggml rope mode 0) rotation of
  every head of q and k, see `rope()` below for why.

Why adjacent pairs: HF Llama checkpoints store q_proj/k_proj so that RoPE
rotates the pair (x[i], x[i + D/2]) of each head ("rotate_half", NeoX style),
with angle pos * theta^(-2i/D), i in [0, D/2).  llama.cpp's converter
(convert_hf_to_gguf.py, LlamaModel.modify_tensors -> LlamaModel.permute) does,
for attn_q with n_head and for attn_k with n_head_kv heads,

    w.reshape(n_head, 2, D // 2, n_in).swapaxes(1, 2).reshape(w.shape)

i.e. within every head the output rows are re-ordered so that
GGUF row 2i = HF row i and GGUF row 2i+1 = HF row i + D/2.  Hence the HF
pair (i, i + D/2) becomes the adjacent GGUF pair (2i, 2i + 1), still with
frequency theta^(-2i/D), and llama.cpp evaluates LLM_ARCH_LLAMA with
LLAMA_ROPE_TYPE_NORM (mode 0):
    out[2i]   = x[2i] * cos(p*f_i) - x[2i+1] * sin(p*f_i)
    out[2i+1] = x[2i] * sin(p*f_i) + x[2i+1] * cos(p*f_i),  f_i = theta^(-2i/D)
Because q and k are permuted by the SAME per-head permutation, q.k dot
products are unchanged, so no other weight (v, output) needs un-permuting.
`self_check_rope()` verifies numerically that "adjacent-pair RoPE on the GGUF
weights" == "NeoX RoPE on the un-permuted (HF-layout) weights", and
`--rope-check` on the CLI compares perplexities of both RoPE styles applied
to the GGUF weights as stored (the correct one is dramatically better).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import tempfile
import time

import numpy as np

CACHE_VERSION = 1

_MODELS: dict = {}
_DEFAULT = None


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

class Model:
    """Dequantized float32 weights + hyper-parameters + tokenizer metadata."""

    def __init__(self, hp: dict, weights: dict, vocab: dict):
        self.hp = hp
        self.w = weights
        self.vocab = vocab  # tokens (list[str]), token_type (int array), merges (list[str])
        self.n_layer = int(hp["n_layer"])
        self.d = int(hp["d"])
        self.n_head = int(hp["n_head"])
        self.n_head_kv = int(hp["n_head_kv"])
        self.head_dim = self.d // self.n_head
        self.n_ff = int(hp["n_ff"])
        self.n_vocab = int(hp["n_vocab"])
        self.eps = float(hp["eps"])
        self.theta = float(hp["theta"])
        self.n_rot = int(hp["n_rot"])
        self.out_name = "output.weight" if "output.weight" in weights else "token_embd.weight"

    def forward(self, token_ids, rope_style="normal"):
        return forward(token_ids, model=self, rope_style=rope_style)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _string_array(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return []
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _read_gguf(path):
    import gguf  # the PyPI package

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, only 'llama' is supported")
    n_head = int(_field(reader, "llama.attention.head_count"))
    d = int(_field(reader, "llama.embedding_length"))
    hp = dict(
        n_layer=int(_field(reader, "llama.block_count")),
        d=d,
        n_head=n_head,
        n_head_kv=int(_field(reader, "llama.attention.head_count_kv", n_head)),
        n_ff=int(_field(reader, "llama.feed_forward_length")),
        eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        n_rot=int(_field(reader, "llama.rope.dimension_count", d // n_head)),
    )
    weights = {}
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        a = np.ascontiguousarray(a, dtype=np.float32)
        # gguf's shape is ne[] (fastest-varying first); numpy is the reverse.
        expect = tuple(int(x) for x in reversed(list(t.shape)))
        if a.shape != expect:
            a = a.reshape(expect)
        weights[t.name] = a
    hp["n_vocab"] = int(weights["token_embd.weight"].shape[0])
    tt = reader.fields.get("tokenizer.ggml.token_type")
    vocab = dict(
        tokens=_string_array(reader, "tokenizer.ggml.tokens"),
        merges=_string_array(reader, "tokenizer.ggml.merges"),
        token_type=np.array([int(tt.parts[i][0]) for i in tt.data], dtype=np.int32)
        if tt is not None else np.zeros(0, np.int32),
        bos=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        eos=int(_field(reader, "tokenizer.ggml.eos_token_id", -1)),
        pre=str(_field(reader, "tokenizer.ggml.pre", "")),
    )
    return hp, weights, vocab


def model_fingerprint(path):
    """Cheap content key: size + sha256 of the first and last MiB of the file
    (so copies/symlinks of the same model share caches)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:24]


def _cache_path(path):
    h = hashlib.sha256(f"{model_fingerprint(path)}|v{CACHE_VERSION}".encode()).hexdigest()[:16]
    d = os.environ.get("STILL_REF_CACHE") or os.path.join(tempfile.gettempdir(), "still_ref_cache")
    return os.path.join(d, f"{os.path.basename(path)}.{h}.npz")


def load(path, use_cache=True):
    """Load (and memoise) a GGUF model as float32 numpy arrays.

    The dequantized weights are cached as an uncompressed .npz under
    $STILL_REF_CACHE or <tmp>/still_ref_cache, keyed by path+size+mtime.
    """
    global _DEFAULT
    path = os.path.abspath(path)
    if path in _MODELS:
        _DEFAULT = _MODELS[path]
        return _DEFAULT
    cp = _cache_path(path)
    model = None
    if use_cache and os.path.exists(cp):
        try:
            with np.load(cp, allow_pickle=False) as z:
                hp = {k[3:]: z[k].item() for k in z.files if k.startswith("hp.")}
                w = {k[2:]: z[k] for k in z.files if k.startswith("w.")}
                vocab = dict(
                    tokens=[str(s) for s in z["v.tokens"]],
                    merges=[str(s) for s in z["v.merges"]],
                    token_type=z["v.token_type"],
                    bos=int(z["v.bos"]), eos=int(z["v.eos"]), pre=str(z["v.pre"]),
                )
            model = Model(hp, w, vocab)
        except Exception as e:  # corrupt/partial cache: rebuild
            print(f"ref_llama: ignoring bad cache {cp}: {e}", file=sys.stderr)
            model = None
    if model is None:
        hp, w, vocab = _read_gguf(path)
        model = Model(hp, w, vocab)
        if use_cache:
            try:
                os.makedirs(os.path.dirname(cp), exist_ok=True)
                arrs = {f"hp.{k}": np.array(v) for k, v in hp.items()}
                arrs.update({f"w.{k}": v for k, v in w.items()})
                arrs["v.tokens"] = np.array(vocab["tokens"], dtype=np.str_)
                arrs["v.merges"] = np.array(vocab["merges"], dtype=np.str_)
                arrs["v.token_type"] = vocab["token_type"]
                arrs["v.bos"] = np.array(vocab["bos"])
                arrs["v.eos"] = np.array(vocab["eos"])
                arrs["v.pre"] = np.array(vocab["pre"])
                tmp = cp + f".tmp{os.getpid()}.npz"
                np.savez(tmp, **arrs)
                os.replace(tmp, cp)
            except OSError as e:
                print(f"ref_llama: could not write cache {cp}: {e}", file=sys.stderr)
    _MODELS[path] = model
    _DEFAULT = model
    return model


# --------------------------------------------------------------------------
# Forward pass
# --------------------------------------------------------------------------

def rms_norm(x, w, eps):
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * r * w.astype(np.float64)).astype(x.dtype)


def rope_angles(n_tok, n_rot, theta, pos0=0):
    """cos/sin, shape (n_tok, n_rot/2); angle = pos * theta^(-2i/n_rot)."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    freq = theta ** (-2.0 * i / n_rot)
    pos = np.arange(pos0, pos0 + n_tok, dtype=np.float64)
    ang = pos[:, None] * freq[None, :]
    return np.cos(ang), np.sin(ang)


def rope(x, cos, sin, style="normal"):
    """Rotate x of shape (n_tok, n_heads, head_dim); first n_rot dims rotated.

    style "normal": adjacent pairs (x[2i], x[2i+1])  <- GGUF llama (correct)
    style "neox":   split halves   (x[i], x[i+n/2])   <- HF layout
    """
    n_rot = 2 * cos.shape[1]
    x64 = x.astype(np.float64)
    out = x64.copy()
    c = cos[:, None, :]
    s = sin[:, None, :]
    if style == "normal":
        a = x64[..., 0:n_rot:2]
        b = x64[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * c - b * s
        out[..., 1:n_rot:2] = a * s + b * c
    elif style == "neox":
        h = n_rot // 2
        a = x64[..., 0:h]
        b = x64[..., h:n_rot]
        out[..., 0:h] = a * c - b * s
        out[..., h:n_rot] = a * s + b * c
    else:
        raise ValueError(style)
    return out.astype(x.dtype)


def silu(z):
    z64 = z.astype(np.float64)
    with np.errstate(over="ignore"):  # exp(-z) -> inf gives silu -> -0, fine
        return (z64 / (1.0 + np.exp(-z64))).astype(z.dtype)


def attention(q, k, v, n_head_kv):
    """q (T, Hq, D), k/v (T, Hkv, D): causal softmax attention -> (T, Hq*D)."""
    T, Hq, D = q.shape
    group = Hq // n_head_kv
    scale = 1.0 / math.sqrt(D)
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)  # True = future -> masked
    out = np.empty((T, Hq, D), dtype=q.dtype)
    for h in range(Hq):
        kh = h // group
        s = (q[:, h, :].astype(np.float64) @ k[:, kh, :].astype(np.float64).T) * scale
        s[mask] = -np.inf
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[:, h, :] = p @ v[:, kh, :].astype(np.float64)
    return out.reshape(T, Hq * D)


def _run(model, token_ids, rope_style="normal", collect=False, dtype=np.float32):
    """Matmuls in `dtype` (float32 default; float64 to measure the reference's
    own rounding error); norms, RoPE, softmax and silu are always float64."""
    m = model
    dtype = np.dtype(dtype)

    def lin(a, name):  # y = a @ W.T, W stored (n_out, n_in)
        w = W[name]
        return a @ (w if w.dtype == dtype else w.astype(dtype)).T

    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError("empty token list")
    if ids.min() < 0 or ids.max() >= m.n_vocab:
        raise ValueError("token id out of range")
    T = ids.size
    W = m.w
    x = W["token_embd.weight"][ids].astype(dtype)
    hidden = [x.copy()] if collect else None
    cos, sin = rope_angles(T, m.n_rot, m.theta)
    D = m.head_dim
    for l in range(m.n_layer):
        p = f"blk.{l}."
        h = rms_norm(x, W[p + "attn_norm.weight"], m.eps)
        q = (lin(h, p + "attn_q.weight")).reshape(T, m.n_head, D)
        k = (lin(h, p + "attn_k.weight")).reshape(T, m.n_head_kv, D)
        v = (lin(h, p + "attn_v.weight")).reshape(T, m.n_head_kv, D)
        q = rope(q, cos, sin, rope_style)
        k = rope(k, cos, sin, rope_style)
        a = attention(q, k, v, m.n_head_kv)
        x = x + lin(a, p + "attn_output.weight")
        h = rms_norm(x, W[p + "ffn_norm.weight"], m.eps)
        g = lin(h, p + "ffn_gate.weight")
        u = lin(h, p + "ffn_up.weight")
        x = x + lin(silu(g) * u, p + "ffn_down.weight")
        if collect:
            hidden.append(x.copy())
    x = rms_norm(x, W["output_norm.weight"], m.eps)
    if collect:
        hidden.append(x.copy())
    logits = lin(x, m.out_name).astype(np.float32)
    return logits, hidden


def _model(model):
    if model is None:
        if _DEFAULT is None:
            raise RuntimeError("ref_llama: call load(path) first")
        return _DEFAULT
    return model


def forward(token_ids, model=None, rope_style="normal", dtype=np.float32):
    """Logits for every position: (n_tok, n_vocab) float32."""
    return _run(_model(model), token_ids, rope_style, dtype=dtype)[0]


def hidden_states(token_ids, model=None, dtype=np.float32):
    """[embeddings, after layer 0, ..., after layer L-1, after output_norm]."""
    return _run(_model(model), token_ids, collect=True, dtype=dtype)[1]


# --------------------------------------------------------------------------
# Checks / utilities
# --------------------------------------------------------------------------

def unpermute_hf(w, n_head):
    """Inverse of convert_hf_to_gguf's permute: GGUF row order -> HF row order."""
    n_out = w.shape[0]
    D = n_out // n_head
    return w.reshape(n_head, D // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def self_check_rope(model=None, n_tok=5, seed=0):
    """normal-RoPE(GGUF weights) == neox-RoPE(HF-layout weights): max |diff| of
    the attention scores q.k for layer 0 (should be ~1e-6 relative)."""
    m = _model(model)
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n_tok, m.d)).astype(np.float32)
    cos, sin = rope_angles(n_tok, m.n_rot, m.theta, pos0=3)
    wq, wk = m.w["blk.0.attn_q.weight"], m.w["blk.0.attn_k.weight"]
    D = m.head_dim
    q1 = rope((h @ wq.T).reshape(n_tok, m.n_head, D), cos, sin, "normal")
    k1 = rope((h @ wk.T).reshape(n_tok, m.n_head_kv, D), cos, sin, "normal")
    q2 = rope((h @ unpermute_hf(wq, m.n_head).T).reshape(n_tok, m.n_head, D), cos, sin, "neox")
    k2 = rope((h @ unpermute_hf(wk, m.n_head_kv).T).reshape(n_tok, m.n_head_kv, D), cos, sin, "neox")
    g = m.n_head // m.n_head_kv
    worst = 0.0
    for hh in range(m.n_head):
        s1 = q1[:, hh] @ k1[:, hh // g].T
        s2 = q2[:, hh] @ k2[:, hh // g].T
        worst = max(worst, float(np.max(np.abs(s1 - s2)) / (np.max(np.abs(s1)) + 1e-30)))
    return worst


def log_softmax(logits):
    l64 = logits.astype(np.float64)
    mx = l64.max(axis=-1, keepdims=True)
    return l64 - mx - np.log(np.exp(l64 - mx).sum(axis=-1, keepdims=True))


def perplexity(model, ids, rope_style="normal"):
    lg = forward(ids, model=model, rope_style=rope_style)
    lp = log_softmax(lg[:-1])
    nll = -lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(np.exp(nll.mean()))


def greedy(model, ids, n_new, stop=None):
    ids = list(ids)
    out = []
    for _ in range(n_new):
        t = int(np.argmax(forward(ids, model=model)[-1]))
        out.append(t)
        ids.append(t)
        if stop is not None and t in stop:
            break
    return out


def build_tokenizer(model=None):
    """HF `tokenizers` BPE tokenizer from the GGUF metadata (SmolLM/GPT-2 style):
    Digits(individual_digits=True) then ByteLevel(add_prefix_space=False);
    control tokens (token_type 3/4, e.g. <|im_start|>) are atomic specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    m = _model(model)
    toks = m.vocab["tokens"]
    vocab = {t: i for i, t in enumerate(toks)}
    merges = [tuple(s.split(" ", 1)) for s in m.vocab["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    tt = m.vocab["token_type"]
    specials = [AddedToken(toks[i], special=True, normalized=False)
                for i in range(len(toks)) if i < len(tt) and tt[i] in (3, 4)]
    if specials:
        tk.add_special_tokens(specials)
    return tk


def read_prose(path, n_chars=None, skip_chars=0):
    """A chunk of plain text from a corpus file, starting at a paragraph."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if skip_chars:
        j = text.find("\n\n", skip_chars)
        text = text[j + 2:] if j >= 0 else text[skip_chars:]
    text = text.replace("\r\n", "\n")
    return text if n_chars is None else text[:n_chars]


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--ids", help="comma-separated token ids")
    ap.add_argument("--ids-file", help="text file, one token id per line")
    ap.add_argument("--prompt", help="text to tokenize (HF tokenizer from GGUF)")
    ap.add_argument("--out", help="write raw little-endian float32 logits (n_tok x n_vocab)")
    ap.add_argument("--generate", type=int, default=0, help="greedy-decode N tokens")
    ap.add_argument("--ppl", help="text file: perplexity on --ntok tokens of it")
    ap.add_argument("--ntok", type=int, default=400)
    ap.add_argument("--skip", type=int, default=2000, help="chars to skip in --ppl file")
    ap.add_argument("--rope-check", action="store_true",
                    help="also report perplexity with NeoX rope on GGUF weights (should be awful)")
    ap.add_argument("--hidden", action="store_true", help="print hidden-state norms per layer")
    ap.add_argument("--f64-check", action="store_true",
                    help="compare float32 logits with a float64-matmul run (reference's own error)")
    a = ap.parse_args(argv)

    t0 = time.time()
    m = load(a.model)
    print(f"loaded {a.model} in {time.time() - t0:.1f}s: layers={m.n_layer} d={m.d} "
          f"heads={m.n_head}/{m.n_head_kv} ff={m.n_ff} vocab={m.n_vocab} "
          f"theta={m.theta} eps={m.eps} out={m.out_name}", file=sys.stderr)
    print(f"rope self-check (normal on GGUF vs neox on un-permuted): "
          f"rel diff {self_check_rope(m):.2e}", file=sys.stderr)

    ids = None
    if a.ids:
        ids = [int(s) for s in a.ids.split(",") if s.strip()]
    elif a.ids_file:
        with open(a.ids_file) as f:
            ids = [int(s) for s in f.read().split()]
    elif a.prompt is not None:
        ids = build_tokenizer(m).encode(a.prompt.encode().decode("unicode_escape")).ids
    if ids is not None:
        print(f"ids ({len(ids)}): {ids[:32]}{' ...' if len(ids) > 32 else ''}")
        if a.hidden:
            for i, hs in enumerate(hidden_states(ids, m)):
                print(f"  hidden[{i:2d}] rms(last) = {np.sqrt(np.mean(hs[-1] ** 2)):.6f}")
        lg = forward(ids, m)
        top = np.argsort(-lg[-1])[:5]
        print("last-position top5:", [(int(t), m.vocab["tokens"][t], float(lg[-1, t])) for t in top])
        if a.f64_check:
            l64 = forward(ids, m, dtype=np.float64)
            rel = np.linalg.norm(lg - l64, axis=1) / np.linalg.norm(l64, axis=1)
            print(f"float32 vs float64: max rel L2 {rel.max():.2e}, "
                  f"max abs {np.abs(lg - l64).max():.2e}")
        if a.out:
            lg.astype("<f4").tofile(a.out)
            print(f"wrote {lg.shape} float32 to {a.out}")
        if a.generate:
            tk = build_tokenizer(m)
            new = greedy(m, ids, a.generate, stop={m.vocab["eos"]})
            print("greedy:", repr(tk.decode(new, skip_special_tokens=False)))
    if a.ppl:
        tk = build_tokenizer(m)
        ptoks = tk.encode(read_prose(a.ppl, 20 * a.ntok, a.skip)).ids[: a.ntok]
        t0 = time.time()
        print(f"perplexity over {len(ptoks)} tokens of {a.ppl}: {perplexity(m, ptoks):.3f} "
              f"({time.time() - t0:.1f}s)")
        if a.rope_check:
            print(f"  same with NeoX (wrong) rope on GGUF weights: "
                  f"{perplexity(m, ptoks, rope_style='neox'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
