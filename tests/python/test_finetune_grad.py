"""Stage 2's whole-model backward (src/train/train_lm.c) against central finite
differences of an independent float64 numpy model.

The model is tests/tiny_model.h's tiny random Llama (2 layers, d 64, 4 heads
over 2 KV heads, quantized Q4_1 / Q8_0 and float weights), written by
tests/tools/finetune_tool and read back with the `gguf` package
(ref_llama.load: its own dequantization). The reference forward is written
here from ref_llama's pieces (RMSNorm, adjacent-pair RoPE, SwiGLU) with LoRA
on every target and each attention kind from ref_attention.py; the loss is
Σ_t w_t CE(logits_t, token_{t+1}). The C side (finetune_tool) gives the loss
and the gradients of every LoRA tensor (and, with train_attn, the attention
parameters). LoRA B is random and nonzero so every gradient is nonzero.

Check per tensor group (one LoRA target's A or B over both layers, the
attention parameters): the derivative along the C gradient itself (its
norm, which a wrong direction or scale would miss) and along random
directions, each against (f(θ + h u) − f(θ − h u)) / 2h in float64. Layer 0's
LoRA gradients depend on every backward piece of layer 1 and of the head
(RMSNorm, RoPE, the kind's input gradients, SwiGLU, the output product)."""

import math
import zlib
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_attention as R  # noqa: E402
import ref_llama as RL  # noqa: E402
from test_attn_kinds import pack_params as pack_baseline  # noqa: E402
from test_attn_still import pack_params as pack_still  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
TENSOR = dict(q="attn_q", k="attn_k", v="attn_v", o="attn_output", gate="ffn_gate", up="ffn_up", down="ffn_down")


@pytest.fixture(scope="module")
def ftool():
    bdir = os.environ.get("STILL_BUILD_DIR")
    exe = os.path.join(bdir, "finetune_tool") if bdir else os.path.join(ROOT, "build", "finetune_tool")
    if bdir:
        assert os.path.exists(exe), f"{exe} missing (build the project first)"
    elif not os.path.exists(exe):
        pytest.skip("finetune_tool not built (set STILL_BUILD_DIR)")
    return exe


@pytest.fixture(scope="module")
def tiny(ftool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    subprocess.run([ftool, "--write-tiny", path], check=True)
    return path, RL.load(path, use_cache=False)


def shapes(m):
    d, qd, kvd, ff = m.d, m.n_head * m.head_dim, m.n_head_kv * m.head_dim, m.n_ff
    return dict(q=(d, qd), k=(d, kvd), v=(d, kvd), o=(qd, d), gate=(d, ff), up=(d, ff), down=(ff, d))


def make_lora(m, rank, rng):
    """{(layer, target): (A [rank][n_in], B [n_out][rank])}, both random."""
    out = {}
    for l in range(m.n_layer):
        for t in TARGETS:
            ni, no = shapes(m)[t]
            out[(l, t)] = (rng.standard_normal((rank, ni)) / math.sqrt(ni), rng.standard_normal((no, rank)) * 0.3)
    return out


def flat_lora(m, lora):
    return np.concatenate([np.concatenate([lora[(l, t)][0].ravel(), lora[(l, t)][1].ravel()])
                           for l in range(m.n_layer) for t in TARGETS])


def unflat_lora(m, rank, v):
    out, i = {}, 0
    for l in range(m.n_layer):
        for t in TARGETS:
            ni, no = shapes(m)[t]
            a = v[i:i + rank * ni].reshape(rank, ni); i += rank * ni
            b = v[i:i + no * rank].reshape(no, rank); i += no * rank
            out[(l, t)] = (a, b)
    return out, i


def group_slices(m, rank):
    """(name, slice) of every LoRA target's A and B over both layers."""
    idx, i = {}, 0
    for l in range(m.n_layer):
        for t in TARGETS:
            ni, no = shapes(m)[t]
            idx.setdefault((t, "A"), []).append(np.arange(i, i + rank * ni)); i += rank * ni
            idx.setdefault((t, "B"), []).append(np.arange(i, i + no * rank)); i += no * rank
    return [(f"{t}.{ab}", np.concatenate(v)) for (t, ab), v in idx.items()]


# --------------------------------------------------------------------------
# the float64 reference
# --------------------------------------------------------------------------

def kind_ref(kind, plan, q, k, v, qn, kn, x, params):
    if kind == "softmax":
        return R.softmax_attn(q, k, v)
    if kind == "swa":
        return R.swa_attn(q, k, v, plan["window"])
    if kind == "lolcats":
        return R.lolcats_attn(q, k, v, params, C=plan["chunk"])
    if kind == "liger":
        return R.liger_attn(qn, kn, q, k, v, window=plan["window"])
    if kind == "still":
        return R.still_attn(q, k, v, x, params, C=plan["chunk"], m=plan["budget"], n_ctx=q.shape[0],
                            lam=plan["lambda"], per_kv_head=bool(plan["per_kv_head"]), routing=plan["routing"],
                            linear=bool(plan["linear"]), feature_map=plan["feature_map"], gate=bool(plan["gate"]))
    raise NotImplementedError(kind)


def ref_loss(m, tok, w, kind, plan, lora, s, attn_params):
    W = {k: v.astype(np.float64) for k, v in m.w.items()}
    T, D = len(tok), m.head_dim
    cos, sin = RL.rope_angles(T, m.n_rot, m.theta)

    def proj(l, t, x, name):
        a, b = lora[(l, t)]
        return x @ W[f"blk.{l}.{name}.weight"].T + s * (x @ a.T) @ b.T

    x = W["token_embd.weight"][tok]
    for l in range(m.n_layer):
        h = RL.rms_norm(x, W[f"blk.{l}.attn_norm.weight"], m.eps)
        q = proj(l, "q", h, "attn_q").reshape(T, m.n_head, D)
        k = proj(l, "k", h, "attn_k").reshape(T, m.n_head_kv, D)
        v = proj(l, "v", h, "attn_v").reshape(T, m.n_head_kv, D)
        qr, kr = RL.rope(q, cos, sin), RL.rope(k, cos, sin)
        y = kind_ref(kind, plan, qr, kr, v, q, k, h, attn_params[l]).reshape(T, m.n_head * D)
        x = x + proj(l, "o", y, "attn_output")
        h = RL.rms_norm(x, W[f"blk.{l}.ffn_norm.weight"], m.eps)
        g, u = proj(l, "gate", h, "ffn_gate"), proj(l, "up", h, "ffn_up")
        x = x + proj(l, "down", RL.silu(g) * u, "ffn_down")
    x = RL.rms_norm(x, W["output_norm.weight"], m.eps)
    logits = x @ W[m.out_name].T
    mx = logits.max(axis=1, keepdims=True)
    lse = (mx + np.log(np.exp(logits - mx).sum(axis=1, keepdims=True)))[:, 0]
    nll = lse[:-1] - logits[np.arange(T - 1), tok[1:]]
    return float(np.sum(w[:-1] * nll))


# --------------------------------------------------------------------------
# the C side
# --------------------------------------------------------------------------

def run_tool(ftool, model_path, tmp, hdr, tok, w, lora_flat, attn_flat):
    src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
    with open(src, "wb") as f:
        f.write((" ".join(f"{k}={v}" for k, v in hdr.items()) + "\n").encode())
        f.write(np.asarray(tok, "<i4").tobytes())
        f.write(np.asarray(w, "<f4").tobytes())
        f.write(np.asarray(lora_flat, "<f4").tobytes())
        f.write(np.asarray(attn_flat, "<f4").tobytes())
    p = subprocess.run([ftool, model_path, src, dst], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert p.returncode == 0, p.stderr
    kv = dict(t.split("=") for t in p.stdout.split())
    g = np.fromfile(dst, dtype="<f4").astype(np.float64)
    return float(kv["loss"]), float(kv["wsum"]), g


PLANS = {
    "softmax": {},
    "swa": dict(window=16),
    "lolcats": dict(chunk=8, F=8),
    "liger": dict(window=8),
    "still": dict(chunk=8, budget=16 + 6, **{"lambda": 2}, per_kv_head=1, routing="position", linear=1,
                  feature_map="npmap", gate=1),
    "still-hedgehog": dict(chunk=8, budget=0, **{"lambda": 1}, per_kv_head=0, routing="position", linear=1,
                           feature_map="hedgehog", gate=0, F=8),
}


def attn_params_for(kind, plan, m, rng):
    """Per layer: the reference's parameter dict and the packed float32 array."""
    dicts, packed = [], []
    for _ in range(m.n_layer):
        if kind == "lolcats":
            p = R.init_lolcats_params(m.n_head, m.head_dim, plan["F"], rng)
            p["hq_W"], p["hk_W"] = p["hq_W"] * 3, p["hk_W"] * 3
            p["w"] = rng.normal(-1.0, 1.0, m.n_head)
            flat = pack_baseline("lolcats", {}, p)
        elif kind == "still":
            fm = plan["feature_map"]
            p = R.init_still_params(m.n_head, m.head_dim, m.d, rng, F=plan.get("F") if fm == "hedgehog" else None)
            p["Wg"] = rng.standard_normal(p["Wg"].shape) * 0.3
            p["bg"] = rng.standard_normal(p["bg"].shape)
            flat = pack_still(p, fm, plan["gate"])
        else:
            p, flat = {}, np.zeros(0, np.float32)
        # the C side reads float32: the reference uses exactly those values
        packed.append(flat.astype(np.float32))
        dicts.append(p)
    return dicts, packed


def unpack_attn(kind, plan, m, flat, template):
    """Reference dicts from a flat float64 vector laid out as the C side's."""
    out, i = [], 0
    for l in range(m.n_layer):
        p = {}
        if kind == "lolcats":
            keys = ["hq_W", "hk_W", "w"]
        elif kind == "still":
            keys = (["q_u", "k_u", "q_W", "k_W"] if plan["feature_map"] == "npmap" else ["hq_W", "hk_W"])
            keys += ["Wg", "bg"] if plan["gate"] else []
        else:
            keys = []
        for k in keys:
            shp = np.shape(template[l][k])
            n = int(np.prod(shp))
            p[k] = flat[i:i + n].reshape(shp); i += n
        out.append(p)
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_whole_model_gradients(ftool, tiny, tmp_path, name):
    path, m = tiny
    kind = name.split("-")[0]
    plan = dict(PLANS[name])
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    T, rank, alpha = 40, 4, 8.0
    s = alpha / rank
    tok = rng.integers(0, m.n_vocab, T)
    w = rng.choice([0.0, 1.0, 0.5, 2.0], T).astype(np.float32)
    lora = make_lora(m, rank, rng)
    lora = {key: (a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64))
            for key, (a, b) in lora.items()}
    dicts, packed = attn_params_for(kind, plan, m, rng)
    train_attn = int(sum(p.size for p in packed) > 0)
    attn_flat = np.concatenate(packed) if train_attn else np.zeros(0)
    dicts = [{k: np.asarray(v, np.float64).astype(np.float32).astype(np.float64) for k, v in p.items()} for p in dicts]
    hdr = dict(T=T, kind=kind, rank=rank, alpha=alpha, targets="all", train_attn=train_attn, threads=2)
    hdr.update({k: v for k, v in plan.items()})
    theta_l = flat_lora(m, lora)
    loss_c, wsum_c, g = run_tool(ftool, path, str(tmp_path), hdr, tok, w, theta_l, attn_flat)
    n_l = theta_l.size
    g_lora, g_attn = g[:n_l], g[n_l:]

    def f(th_l, th_a):
        lo, _ = unflat_lora(m, rank, th_l)
        ap = unpack_attn(kind, plan, m, th_a, dicts) if train_attn else [{}] * m.n_layer
        return ref_loss(m, tok, w.astype(np.float64), kind, plan, lo, s, ap)

    base = f(theta_l, attn_flat.astype(np.float64))
    assert abs(wsum_c - float(np.sum(w[:-1]))) < 1e-5
    assert abs(loss_c - base) <= 1e-4 * abs(base), f"{name}: loss {loss_c} vs reference {base}"

    groups = [(gname, idx, "lora") for gname, idx in group_slices(m, rank)]
    if train_attn:
        groups.append(("attn", np.arange(attn_flat.size), "attn"))
    h = 1e-5
    worst = 0.0
    for gname, idx, which in groups:
        gc = (g_lora if which == "lora" else g_attn)[idx]
        gnorm = np.linalg.norm(gc)
        assert gnorm > 0, f"{name} {gname}: zero gradient"
        dirs = [gc / gnorm] + [rng.standard_normal(idx.size) for _ in range(2)]
        for j, u in enumerate(dirs):
            u = u / np.linalg.norm(u)
            tl, ta = theta_l.copy(), attn_flat.astype(np.float64).copy()
            if which == "lora":
                tl[idx] += h * u
                fp = f(tl, ta)
                tl[idx] -= 2 * h * u
                fm = f(tl, ta)
            else:
                ta[idx] += h * u
                fp = f(tl, ta)
                ta[idx] -= 2 * h * u
                fm = f(tl, ta)
            fd = (fp - fm) / (2 * h)
            an = float(gc @ u)
            # along the gradient: relative to its norm; random: to its typical size ||g|| / sqrt(n)
            scale_ = gnorm if j == 0 else gnorm / math.sqrt(idx.size)
            e = abs(an - fd) / scale_
            worst = max(worst, e)
            assert e < 2e-3, f"{name} {gname} dir {j}: analytic {an:.6g} vs finite differences {fd:.6g} (err {e:.2g})"
    print(f"{name}: loss {loss_c:.6f} (ref {base:.6f}), worst relative error {worst:.2g}")


def test_dropout_is_deterministic_and_changes_the_loss(ftool, tiny, tmp_path):
    path, m = tiny
    rng = np.random.default_rng(5)
    T, rank = 32, 4
    tok = rng.integers(0, m.n_vocab, T)
    w = np.ones(T, np.float32)
    theta = flat_lora(m, make_lora(m, rank, rng)).astype(np.float32)
    hdr = dict(T=T, rank=rank, alpha=8, targets="all")
    l0, _, g0 = run_tool(ftool, path, str(tmp_path), hdr, tok, w, theta, np.zeros(0))
    l1, _, g1 = run_tool(ftool, path, str(tmp_path), dict(hdr, dropout=0.3, drop_seed=7), tok, w, theta, np.zeros(0))
    l2, _, g2 = run_tool(ftool, path, str(tmp_path), dict(hdr, dropout=0.3, drop_seed=7), tok, w, theta, np.zeros(0))
    l3, _, _ = run_tool(ftool, path, str(tmp_path), dict(hdr, dropout=0.3, drop_seed=8), tok, w, theta, np.zeros(0))
    assert l1 == l2 and np.array_equal(g1, g2)
    assert l1 != l0 and l3 != l1
    assert np.all(np.isfinite(g1)) and not np.array_equal(g0, g1)


def test_threads_do_not_change_the_gradient_much(ftool, tiny, tmp_path):
    path, m = tiny
    rng = np.random.default_rng(9)
    T, rank = 48, 2
    tok = rng.integers(0, m.n_vocab, T)
    w = np.ones(T, np.float32)
    theta = flat_lora(m, make_lora(m, rank, rng)).astype(np.float32)
    hdr = dict(T=T, rank=rank, alpha=4, targets="all", kind="softmax")
    _, _, g1 = run_tool(ftool, path, str(tmp_path), dict(hdr, threads=1), tok, w, theta, np.zeros(0))
    _, _, g2 = run_tool(ftool, path, str(tmp_path), dict(hdr, threads=2), tok, w, theta, np.zeros(0))
    assert np.linalg.norm(g1 - g2) <= 1e-5 * np.linalg.norm(g1)


def test_dropout_gradient_against_the_engines_own_finite_differences(ftool, tiny, tmp_path):
    """With LoRA dropout the masks are the engine's own (a hash of the seed), so
    the reference here is central differences of the engine's float32 loss at
    the same seed: coarser (h = 1e-2, tolerance 2%) but it fails for a mask
    the backward does not reproduce."""
    path, m = tiny
    rng = np.random.default_rng(21)
    T, rank = 40, 4
    tok = rng.integers(0, m.n_vocab, T)
    w = np.ones(T, np.float32)
    theta = flat_lora(m, make_lora(m, rank, rng)).astype(np.float64)
    hdr = dict(T=T, rank=rank, alpha=8, targets="all", dropout=0.3, drop_seed=11, threads=2)
    _, _, g = run_tool(ftool, path, str(tmp_path), hdr, tok, w, theta, np.zeros(0))
    h = 1e-2
    for gname, idx in group_slices(m, rank):
        gc = g[idx]
        u = gc / np.linalg.norm(gc)
        tp, tm = theta.copy(), theta.copy()
        tp[idx] += h * u
        tm[idx] -= h * u
        lp = run_tool(ftool, path, str(tmp_path), hdr, tok, w, tp, np.zeros(0))[0]
        lm = run_tool(ftool, path, str(tmp_path), hdr, tok, w, tm, np.zeros(0))[0]
        fd = (lp - lm) / (2 * h)
        assert abs(fd - np.linalg.norm(gc)) <= 0.02 * np.linalg.norm(gc), (gname, fd, np.linalg.norm(gc))
