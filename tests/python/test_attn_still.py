"""The still attention kind (src/kinds/still/attn_still.c) against the float64 numpy
reference ref_attention.still_attn, through tests/tools/attn_tool.

Every deterministic variant (routing saliency / keynorm / qk / position /
none, linear on/off, NP-Map / Hedgehog, gate on/off with a random nonzero
W_g, per-KV-head selection, budget mode with a small budget so Sel fills up,
derived lambda, reference mode budget 0) for C in {4, 8, 16}, D 16 and 64,
GQA H=4 Hk=2, several lengths including non-multiples of C, each run as one
call (chunk-parallel), random prefill + single steps and all single steps:
relative error per (token, head) ||y - ref|| / ||ref|| < 1e-5, and every
split bit-identical to the one-call run.

Random routing cannot reproduce numpy's generator: checked for determinism
given the seed, finiteness, and difference from saliency routing.
"""

import math
import os
import zlib
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_attention as R  # noqa: E402

RTOL = 1e-5
H, HK, DM = 4, 2, 12



# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def pack_params(params, feature_map, gate):
    """still's flat float32 layout: npmap: q_u [H][D], k_u [H][D], q_W [H][D][D],
    k_W [H][D][D]; hedgehog: hq_W [H][D][F], hk_W [H][D][F]; then with the
    gate: Wg [H*D][d], bg [H*D]."""
    keys = ["q_u", "k_u", "q_W", "k_W"] if feature_map == "npmap" else ["hq_W", "hk_W"]
    if gate:
        keys += ["Wg", "bg"]
    return np.concatenate([np.asarray(params[k], np.float64).ravel() for k in keys]).astype(np.float32)


def make_inputs(L, D, d, seed, scale=1.0, Hq=H, Hk=HK):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k = f(L, Hq, D) * np.float32(scale), f(L, Hk, D) * np.float32(scale)
    return dict(q=q, k=k, v=f(L, Hk, D), q_nope=f(L, Hq, D), k_nope=f(L, Hk, D), x=f(L, d))


def make_params(D, d, F, seed, Hq=H):
    """Reference init (float32-rounded) with a random nonzero gate, so the gate matters."""
    rng = np.random.default_rng(seed + 1000)
    p = R.init_still_params(Hq, D, d, rng, F=F)
    p["Wg"] = rng.standard_normal(p["Wg"].shape) * 0.4
    p["bg"] = rng.standard_normal(p["bg"].shape)
    return {k: v.astype(np.float32).astype(np.float64) for k, v in p.items()}


def header_line(cfg):
    return " ".join(f"{k}={v}" for k, v in cfg.items()) + "\n"


def run_tool(tool, tmp_path, cfg, inp, packed=None, check=True):
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(src, "wb") as f:
        f.write(header_line(cfg).encode("ascii"))
        for name in ("q", "k", "v", "q_nope", "k_nope", "x"):
            f.write(np.ascontiguousarray(inp[name], dtype="<f4").tobytes())
        if packed is not None:
            f.write(np.ascontiguousarray(packed, dtype="<f4").tobytes())
    if dst.exists():
        dst.unlink()
    p = subprocess.run([str(tool), str(src), str(dst)], capture_output=True, text=True, timeout=60)
    if not check:
        return p
    assert p.returncode == 0, f"attn_tool failed ({header_line(cfg).strip()}): {p.stderr.strip()}"
    kv = dict(t.split("=") for t in p.stdout.split())
    y = np.fromfile(dst, dtype="<f4").reshape(cfg["L"], cfg["H"], cfg["D"])
    return y, int(kv["state_bytes"]), int(kv["param_count"])


def row_rel_err(y, ref):
    """max over (token, head) of ||y - ref|| / ||ref||."""
    num = np.linalg.norm(y.astype(np.float64) - ref, axis=-1)
    den = np.linalg.norm(ref, axis=-1)
    return float(np.max(num / np.maximum(den, 1e-30))) if y.size else 0.0


def sub(inp, L):
    return {k: v[:L] for k, v in inp.items()}


def ref_still(inp, params, v):
    lam = None if v["lambda"] < 0 else v["lambda"]
    return R.still_attn(inp["q"], inp["k"], inp["v"], inp["x"], params, C=v["chunk"], m=v["budget"],
                        n_ctx=v["n_ctx"], lam=lam, per_kv_head=bool(v["per_kv_head"]), routing=v["routing"],
                        linear=bool(v["linear"]), feature_map=v["feature_map"], gate=bool(v["gate"]),
                        sel_store=v.get("sel", "f32"), select="global" if v.get("sel_global") else "chunk",
                        sel_span=v.get("sel_span", 0), gate_den=bool(v.get("gate_den", 0)))


def tool_cfg(v, L, D, F):
    keys = ("chunk", "budget", "lambda", "per_kv_head", "routing", "linear", "feature_map", "gate", "n_ctx")
    c = dict(kind="still", L=L, H=H, Hk=HK, D=D, d=DM, F=F, seed=v.get("seed", 0), sel_type=v.get("sel", "f32"),
             sel_global=v.get("sel_global", 0), sel_span=v.get("sel_span", 0), gate_den=v.get("gate_den", 0))
    c.update({k: v[k] for k in keys})
    return c


# --------------------------------------------------------------------------
# the variants
# --------------------------------------------------------------------------

def variant(C, routing="saliency", mode="cap", per_kv=0, linear=1, fm="npmap", gate=1, D=16, scale=1.0):
    """mode: 'cap'  budget m = 2C + 5 with lambda 2 (Sel fills after 3 chunks)
             'der'  budget m = 2C + 12, lambda derived from n_ctx
             'ref'  reference mode: budget 0, lambda 3 (uncapped)
             'c16'  budget 0, lambda -1 -> C // 16
             'glob' global selection, budget m = 2C + 5: Sel holds the best 5 of all
                    that left Local and evicts into the linear state"""
    Lmax = 3 * C + 17
    budget, lam, n_ctx = {"cap": (2 * C + 5, 2, 4 * C + 17), "der": (2 * C + 12, -1, Lmax),
                          "ref": (0, 3, Lmax), "c16": (0, -1, Lmax), "glob": (2 * C + 5, -1, Lmax)}[mode]
    return dict(chunk=C, budget=budget, **{"lambda": lam}, n_ctx=n_ctx, per_kv_head=per_kv, routing=routing,
                linear=linear, feature_map=fm, gate=gate, D=D, scale=scale, mode=mode, sel_global=int(mode == "glob"))


DET_ROUTINGS = ("saliency", "keynorm", "qk", "position", "none")
VARIANTS = []
# every deterministic routing x budget / reference mode x per-KV-head
for i, (routing, mode, per_kv) in enumerate((r, m, p) for r in DET_ROUTINGS for m in ("cap", "ref") for p in (0, 1)):
    VARIANTS.append(variant((4, 8, 16)[i % 3], routing, mode, per_kv))
# linear off, Hedgehog, gate off, derived lambda, C // 16, combinations
VARIANTS += [
    variant(4, "saliency", "cap", linear=0),
    variant(8, "qk", "ref", per_kv=1, linear=0),
    variant(16, "keynorm", "cap", linear=0, gate=0),
    variant(4, "saliency", "ref", fm="hedgehog"),
    variant(8, "position", "cap", per_kv=1, fm="hedgehog", gate=0),
    variant(16, "qk", "cap", fm="hedgehog"),
    variant(8, "saliency", "cap", gate=0),
    variant(16, "none", "ref", per_kv=1, gate=0),
    variant(4, "saliency", "der"),
    variant(16, "qk", "der", per_kv=1, fm="hedgehog"),
    variant(16, "saliency", "c16"),
    # larger logits (std 4): the closed-form saliency must still pick the same tokens
    variant(8, "saliency", "cap", scale=2.0),
    variant(8, "saliency", "ref", per_kv=1, scale=2.0),
    variant(16, "saliency", "ref", per_kv=1, fm="hedgehog", scale=1.5),
    # head dim 64
    variant(16, "saliency", "cap", D=64),
    variant(8, "qk", "ref", per_kv=1, D=64, fm="hedgehog"),
    variant(16, "keynorm", "ref", D=64, gate=0),
]
# Sel stored as half or 8-bit: the reference reads the same rounded vectors
# (D 16, 40 with a partial lane block, 64)
VARIANTS += [dict(v, sel=sel) for sel in ("f16", "q8") for v in (
    variant(4, "saliency", "cap"),
    variant(8, "qk", "ref", per_kv=1, fm="hedgehog"),
    variant(16, "saliency", "cap", D=64),
    variant(8, "keynorm", "ref", D=40, gate=0),
)]
# global selection (evicts into the linear state): every scoring routing, per KV head, Sel storage
VARIANTS += [
    variant(4, "saliency", "glob"),
    variant(8, "saliency", "glob", per_kv=1),
    variant(16, "saliency", "glob", D=64),
    variant(4, "qk", "glob", per_kv=1),
    variant(8, "keynorm", "glob", fm="hedgehog"),
    variant(16, "keynorm", "glob", gate=0),
    variant(8, "saliency", "glob", linear=0),
    variant(8, "saliency", "glob", scale=2.0),
]
# the gate in the denominator too (gate_den): chunk, reference and global selection, per KV head, D 64, f16 Sel
VARIANTS += [
    dict(variant(4, "saliency", "cap"), gate_den=1),
    dict(variant(8, "qk", "ref", per_kv=1), gate_den=1),
    dict(variant(16, "saliency", "cap", D=64), gate_den=1),
    dict(variant(8, "saliency", "glob", per_kv=1), gate_den=1),
    dict(variant(8, "keynorm", "cap", fm="hedgehog"), gate_den=1, sel="f16"),
]
# neighbour selection (sel_span): chunk and global selection, per KV head, spans up to the chunk
VARIANTS += [
    dict(variant(8, "saliency", "cap"), sel_span=2),
    dict(variant(8, "saliency", "glob", per_kv=1), sel_span=3),
    dict(variant(4, "keynorm", "glob"), sel_span=4),
    dict(variant(16, "saliency", "ref", D=64), sel_span=1),
]
VARIANTS += [dict(v, sel=sel) for sel in ("f16", "q8") for v in (
    variant(4, "saliency", "glob"),
    variant(16, "keynorm", "glob", per_kv=1, D=40),
)]


def vid(v):
    return (f"C{v['chunk']}-{v['routing']}-{v['mode']}-kv{v['per_kv_head']}-lin{v['linear']}-{v['feature_map']}"
            f"-g{v['gate']}-D{v['D']}-s{v['scale']}" + (f"-{v['sel']}" if "sel" in v else "")
            + (f"-span{v['sel_span']}" if v.get("sel_span") else "") + ("-gden" if v.get("gate_den") else ""))


def splits_for(rng, L, C, full):
    """One call; a random prefill then single steps; all single steps (and on
    the longest length a random mix of calls crossing chunk boundaries)."""
    p = int(rng.integers(1, L + 1))
    out = [[L], [p] + [1] * (L - p), [1] * L]
    if full:
        mix, left = [], L
        while left:
            n = min(left, int(rng.choice([1, 2, C - 1, C, C + 1, 2 * C + 3])) or 1)
            mix.append(n)
            left -= n
        out.append(mix)
    return out


@pytest.mark.parametrize("v", VARIANTS, ids=[vid(v) for v in VARIANTS])
def test_still_matches_reference(tool, tmp_path, v):
    C, D = v["chunk"], v["D"]
    F = 6 if D == 16 else 64
    Lmax = 3 * C + 17
    seed = zlib.crc32(vid(v).encode())
    inp = make_inputs(Lmax, D, DM, seed, v["scale"])
    params = make_params(D, DM, F, seed)
    packed = pack_params(params, v["feature_map"], v["gate"])
    ref = ref_still({k: inp[k].astype(np.float64) for k in inp}, params, v)   # causal: prefixes are prefixes
    # the variant exercises what it claims (Sel fills up in budget mode with explicit lambda)
    _, sets = R.still_attn(inp["q"], inp["k"], inp["v"], inp["x"], params, C=C, m=v["budget"], n_ctx=v["n_ctx"],
                           lam=None if v["lambda"] < 0 else v["lambda"], per_kv_head=bool(v["per_kv_head"]),
                           routing=v["routing"], linear=False, return_sets=True)
    if v["mode"] == "cap" and v["routing"] != "none":
        assert all(len(s) == 5 for s in sets["sel"][-1])
    if v["mode"] == "glob":   # Sel is full and some token that was in it has been evicted
        _, sets = R.still_attn(inp["q"], inp["k"], inp["v"], inp["x"], params, C=C, m=v["budget"], n_ctx=v["n_ctx"],
                               per_kv_head=bool(v["per_kv_head"]), routing=v["routing"], linear=False,
                               return_sets=True, select="global")
        assert all(len(s) == 5 for s in sets["sel"][-1])
        evicted = 0
        for hs in range(sets["Hs"]):
            ever = set().union(*(set(sets["sel"][t][hs].tolist()) for t in range(Lmax)))
            evicted += len(ever - set(sets["sel"][-1][hs].tolist()))
        assert evicted > 0
    rng = np.random.default_rng(seed)
    for L in sorted({1, C - 1, 2 * C + 1, 2 * C + 3, Lmax}):
        if L < 1:
            continue
        r = ref[:L]
        y0 = None
        for i, sp in enumerate(splits_for(rng, L, C, L == Lmax)):
            cfg = dict(tool_cfg(v, L, D, F), splits=",".join(map(str, sp)))
            if i == 1:
                cfg["check_truncate"] = 1
            y, _, pc = run_tool(tool, tmp_path, cfg, sub(inp, L), packed)
            assert pc == packed.size
            e = row_rel_err(y, r)
            assert e < RTOL, f"{vid(v)} L={L} splits={sp}: relative error {e:.3g}"
            if y0 is None:
                y0 = y
            else:   # one algorithm: every split gives the same bits
                assert np.array_equal(y, y0), f"{vid(v)} L={L} splits={sp}: differs from the one-call run"


def test_linear_branch_and_gate_matter(tool, tmp_path):
    """Guard against a test that passes vacuously: the variants differ."""
    C, L, D, F = 4, 3 * 4 + 17, 16, 6
    inp = make_inputs(L, D, DM, 5)
    params = make_params(D, DM, F, 5)
    base = variant(C, "saliency", "ref")
    outs = {}
    for name, ch in (("base", {}), ("nolin", {"linear": 0}), ("nogate", {"gate": 0}), ("hh", {"feature_map": "hedgehog"}),
                     ("kv", {"per_kv_head": 1}), ("none", {"routing": "none"}), ("gden", {"gate_den": 1})):
        v = dict(base, **ch)
        y, _, _ = run_tool(tool, tmp_path, tool_cfg(v, L, D, F), inp, pack_params(params, v["feature_map"], v["gate"]))
        outs[name] = y
    for name in outs:
        if name != "base":
            assert row_rel_err(outs[name], outs["base"].astype(np.float64)) > 1e-2, name


def test_sel_storage_matters(tool, tmp_path):
    """The half and 8-bit Sel variants are not vacuous: each output differs
    from the float32-Sel reference by more than the test tolerance, matches
    its own reference, and the state shrinks."""
    C, L, D, F = 8, 6 * 8 + 3, 64, 6
    inp = make_inputs(L, D, DM, 6)
    params = make_params(D, DM, F, 6)
    v = dict(variant(C, "saliency", "ref", D=D), n_ctx=L)
    exact = {k: a.astype(np.float64) for k, a in inp.items()}
    ref32 = ref_still(exact, params, v)
    nbytes = {}
    for sel in ("f32", "f16", "q8"):
        vs = dict(v, sel=sel)
        y, nbytes[sel], _ = run_tool(tool, tmp_path, tool_cfg(vs, L, D, F), inp, pack_params(params, "npmap", 1))
        assert row_rel_err(y, ref_still(exact, params, vs)) < RTOL, sel
        if sel != "f32":
            assert row_rel_err(y, ref32) > 10 * RTOL, sel
    assert nbytes["q8"] < nbytes["f16"] < nbytes["f32"]


# --------------------------------------------------------------------------
# saliency: the closed form the C code ranks by vs the explicit formula
# --------------------------------------------------------------------------

def closed_form_scores(q, k, C):
    """What src/kinds/still/attn_still.c computes: f(p) = p log((p+eps)/eps) + (1-p) log(1-p),
    p = the token's own softmax weight over its window R(j)."""
    return R.saliency_of_p(R.saliency_p(q, k, C))


@pytest.mark.parametrize("scale", [0.5, 1.0, 1.5, 2.0])
def test_saliency_closed_form_selects_as_explicit(scale):
    """On random inputs of moderate scale (logit std up to 4 at D = 16), the
    top-lambda tokens of every chunk by f(p) are those by the explicit score,
    per query head and with the G heads' scores summed per KV head."""
    for C, D in ((8, 16), (16, 16), (16, 64)):
        L = 8 * C
        inp = make_inputs(L, D, DM, int(scale * 100) + C + D, scale)
        q, k = inp["q"].astype(np.float64), inp["k"].astype(np.float64)
        ex = R.self_saliency(q, k, C)
        cf = closed_form_scores(q, k, C)
        G = H // HK
        for a, b in ((ex, cf), (ex.reshape(L, HK, G).sum(2), cf.reshape(L, HK, G).sum(2))):
            for h in range(a.shape[1]):
                for lam in (1, 2, 4, C // 2):
                    for c in range(L // C):
                        idx = np.arange(c * C, c * C + C)
                        ta = sorted(idx, key=lambda j: (-a[j, h], j))[:lam]
                        tb = sorted(idx, key=lambda j: (-b[j, h], j))[:lam]
                        assert sorted(ta) == sorted(tb), (scale, C, D, h, lam, c)


# --------------------------------------------------------------------------
# random routing
# --------------------------------------------------------------------------

def test_random_routing(tool, tmp_path):
    C, L, D, F = 4, 3 * 4 + 17, 16, 6
    inp = make_inputs(L, D, DM, 21)
    params = make_params(D, DM, F, 21)
    for per_kv in (0, 1):
        v = variant(C, "random", "cap", per_kv=per_kv)
        packed = pack_params(params, "npmap", 1)
        cfg = dict(tool_cfg(v, L, D, F), seed=7)
        a, _, _ = run_tool(tool, tmp_path, cfg, inp, packed)
        b, _, _ = run_tool(tool, tmp_path, dict(cfg, splits=",".join(["5"] + ["1"] * (L - 5)), check_truncate=1),
                           inp, packed)
        c, _, _ = run_tool(tool, tmp_path, dict(cfg, seed=8), inp, packed)
        s, _, _ = run_tool(tool, tmp_path, dict(cfg, routing="saliency"), inp, packed)
        assert np.isfinite(a).all()
        assert np.array_equal(a, b), "random routing must be deterministic given the seed, for any split"
        assert not np.array_equal(a, c), "another seed selects other tokens"
        assert not np.allclose(a, s, rtol=1e-4, atol=1e-5), "random routing differs from saliency routing"
        # up to the first selection (t < 2C) it is plain local attention, like every routing
        assert np.array_equal(a[:2 * C], s[:2 * C])
        # lambda = C: every leaving token is selected whatever the scores -> softmax
        va = dict(v, budget=0, n_ctx=L, **{"lambda": C})
        y, _, _ = run_tool(tool, tmp_path, dict(tool_cfg(va, L, D, F), seed=3), inp, packed)
        ref = R.softmax_attn(*(inp[n].astype(np.float64) for n in ("q", "k", "v")))
        assert row_rel_err(y, ref) < RTOL


# --------------------------------------------------------------------------
# threads, parameter init, state size, errors
# --------------------------------------------------------------------------

def test_threads_do_not_change_results(tool, tmp_path):
    C, L, D, F = 8, 77, 16, 6
    inp = make_inputs(L, D, DM, 3)
    params = make_params(D, DM, F, 3)
    for v in (variant(C, "qk", "cap", per_kv=1), variant(C, "saliency", "ref", fm="hedgehog")):
        v = dict(v, n_ctx=L)
        packed = pack_params(params, v["feature_map"], v["gate"])
        ys = [run_tool(tool, tmp_path, dict(tool_cfg(v, L, D, F), threads=n), inp, packed)[0] for n in (1, 2, 3)]
        assert np.array_equal(ys[0], ys[1]) and np.array_equal(ys[0], ys[2])


@pytest.mark.parametrize("fm", ["npmap", "hedgehog"])
def test_param_init(tool, tmp_path, fm):
    """Without a params section the tool uses param_init(seed): u ~ N(0, 1),
    W kaiming-uniform (bound sqrt(6 / fan_in), torch's fan_in of the stacked
    (H, D, D|F) tensor), Wg = 0, bg = +2; deterministic per seed; the layout
    read back into the reference reproduces the C output."""
    C, L, D, F = 4, 3 * 4 + 17, 16, 8
    v = variant(C, "saliency", "ref", fm=fm)
    base = tool_cfg(v, L, D, F)
    inp = make_inputs(L, D, DM, 9)
    got = []
    for seed in (42, 42, 43):
        po = tmp_path / f"p{len(got)}.bin"
        y, _, pc = run_tool(tool, tmp_path, dict(base, seed=seed, params_out=po), inp)
        got.append((y, np.fromfile(po, dtype="<f4")))
        assert got[-1][1].size == pc
    (y0, p0), (y1, p1), (_, p2) = got
    assert np.array_equal(p0, p1) and np.array_equal(y0, y1) and not np.array_equal(p0, p2)
    HD = H * D
    params = {}
    if fm == "npmap":
        assert p0.size == 2 * HD + 2 * H * D * D + HD * DM + HD
        params["q_u"], params["k_u"] = p0[:HD].reshape(H, D), p0[HD:2 * HD].reshape(H, D)
        u = p0[:2 * HD]
        assert abs(u.mean()) < 0.15 and abs(u.std() - 1) < 0.15
        W = p0[2 * HD:2 * HD + 2 * H * D * D]
        params["q_W"], params["k_W"] = W[:H * D * D].reshape(H, D, D), W[H * D * D:].reshape(H, D, D)
        b = math.sqrt(6.0 / (D * D))
        off = 2 * HD + 2 * H * D * D
    else:
        assert p0.size == 2 * H * D * F + HD * DM + HD
        W = p0[:2 * H * D * F]
        params["hq_W"], params["hk_W"] = W[:H * D * F].reshape(H, D, F), W[H * D * F:].reshape(H, D, F)
        b = math.sqrt(6.0 / (D * F))
        off = 2 * H * D * F
    assert np.all(np.abs(W) <= b) and abs(W.mean()) < 0.05 * b and abs(W.var() / (b * b / 3) - 1) < 0.1
    params["Wg"], params["bg"] = p0[off:off + HD * DM].reshape(HD, DM), p0[off + HD * DM:]
    assert not params["Wg"].any() and np.all(params["bg"] == 2.0)
    params = {k: np.asarray(a, np.float64) for k, a in params.items()}
    ref = ref_still({k: inp[k].astype(np.float64) for k in inp}, params, dict(v, n_ctx=L))
    assert row_rel_err(y0, ref) < RTOL


def smol_state_bytes(tool, tmp_path, n_ctx, budget, lam=-1, per_kv=0):
    """SmolLM2's shape: H=9, Hk=3, D=64, d=576, C=64."""
    L, Hq, Hk, D, d = 1, 9, 3, 64, 576
    cfg = dict(kind="still", L=L, H=Hq, Hk=Hk, D=D, d=d, n_ctx=n_ctx, chunk=64, budget=budget, per_kv_head=per_kv,
               **{"lambda": lam})
    inp = make_inputs(L, D, d, 1, Hq=Hq, Hk=Hk)
    return run_tool(tool, tmp_path, cfg, inp)[1]


def test_state_bytes(tool, tmp_path):
    # budget mode: fixed, whatever n_ctx (lambda 6 at 8K, 0 at 64K: same allocation)
    a = smol_state_bytes(tool, tmp_path, 2048, 896)
    assert a == smol_state_bytes(tool, tmp_path, 8192, 896) == smol_state_bytes(tool, tmp_path, 65536, 896) > 0
    kv = smol_state_bytes(tool, tmp_path, 65536, 896, per_kv=1)
    assert kv == smol_state_bytes(tool, tmp_path, 2048, 896, per_kv=1) < a
    # reference mode (budget 0, lambda 4): the selected store grows with n_ctx
    r1, r2 = smol_state_bytes(tool, tmp_path, 2048, 0, 4), smol_state_bytes(tool, tmp_path, 65536, 0, 4)
    assert r2 > 10 * r1 and r2 > a


@pytest.mark.parametrize("bad", [{"chunk": 0}, {"chunk": -4}, {"budget": 7}, {"budget": -1}, {"budget": 15},
                                 {"feature_map": "hedgehog", "F": 0}, {"n_ctx": 0}, {"Hk": 3},
                                 {"sel_global": 1, "budget": 0}, {"sel_global": 1, "budget": 20, "routing": "position"},
                                 {"sel_global": 1, "budget": 20, "routing": "none"}, {"sel_span": -1},
                                 {"sel_span": 9}])
def test_bad_config_is_one_line_error(tool, tmp_path, bad):
    L = 8
    cfg = dict(dict(kind="still", L=L, H=H, Hk=HK, D=16, d=DM, chunk=8), **bad)
    p = run_tool(tool, tmp_path, cfg, make_inputs(L, 16, DM, 0), check=False)
    assert p.returncode != 0
    msg = p.stderr.strip()
    assert msg and "\n" not in msg, msg


def test_context_limit(tool, tmp_path):
    L = 20
    cfg = dict(kind="still", L=L, H=H, Hk=HK, D=16, d=DM, n_ctx=10, chunk=4)
    p = run_tool(tool, tmp_path, cfg, make_inputs(L, 16, DM, 0), check=False)
    assert p.returncode != 0 and "full" in p.stderr, p.stderr


def test_ties_lower_position_first(tool, tmp_path):
    """keynorm with every ||k_j|| equal (entries +-1): all scores tie, so each
    leaving chunk keeps its first lambda positions, as in the reference."""
    C, L, D, F = 4, 5 * 4 + 3, 16, 6
    inp = make_inputs(L, D, DM, 20)
    inp["k"] = np.where(inp["k"] >= 0, 1.0, -1.0).astype(np.float32)
    params = make_params(D, DM, F, 20)
    for per_kv in (0, 1):
        v = dict(variant(C, "keynorm", "ref", per_kv=per_kv), n_ctx=L, **{"lambda": 2})
        _, sets = R.still_attn(inp["q"], inp["k"], inp["v"], inp["x"], params, C=C, m=0, lam=2, routing="keynorm",
                               per_kv_head=bool(per_kv), return_sets=True)
        assert all([list(c) for c in h] == [[c * C, c * C + 1] for c in range(len(h))] for h in sets["picks"])
        ref = ref_still({k: inp[k].astype(np.float64) for k in inp}, params, v)
        for sp in ([L], [1] * L):
            y, _, _ = run_tool(tool, tmp_path, dict(tool_cfg(v, L, D, F), splits=",".join(map(str, sp))), inp,
                               pack_params(params, "npmap", 1))
            assert row_rel_err(y, ref) < RTOL


@pytest.mark.parametrize("case", ["C16-D64-cap", "C8-qk-ref-kv", "smollm2", "smollm2-f16", "smollm2-q8", "smollm2-kv",
                                  "smollm2-q8-kv", "smollm2-glob-kv", "smollm2-glob-f16-kv", "smollm2-glob-q8-kv",
                                  "glob-q8-kv-g4", "glob-kv-g6"])
def test_long_sequences(tool, tmp_path, case):
    """Many chunks folded into S, z (float32 accumulation) and a Sel that fills
    up; SmolLM2's shape (H=9, Hk=3, D=64, d=576, C=64, m=896, n_ctx 8192 ->
    lambda 6) with its defaults; -kv: Sel per KV head (three query heads
    read each store); glob: global selection with m = 2C + 400, so that Sel
    spans seven tiles of 64 keys (its softmax part is summed tile by tile
    and merged in tile order; a decode step reads each tile for the three
    query heads of its KV head together, on several threads) and evicts; g4 / g6:
    8 and 12 query heads on 2 KV heads (the grouped read with four rows, and
    head by head beyond four)."""
    Hq, Hk, d = H, HK, DM
    if case == "C16-D64-cap":
        C, D, L = 16, 64, 600
        v = dict(variant(C, "saliency", "cap", D=D), budget=2 * C + 40, n_ctx=L, **{"lambda": 3})
    elif case == "C8-qk-ref-kv":
        C, D, L = 8, 16, 500
        v = dict(variant(C, "qk", "ref", per_kv=1, D=D), n_ctx=L)
    elif "glob" in case:
        C, D, L, Hq, Hk, d = 64, 64, 700, 9, 3, 576
        if case.endswith("-g4") or case.endswith("-g6"):
            L, Hq, Hk = 600, (8 if case.endswith("-g4") else 12), 2
        v = dict(variant(C, "saliency", "glob", per_kv=1, D=D), budget=2 * C + 400, n_ctx=L)
        for t in ("f16", "q8"):
            if t in case.split("-"):
                v["sel"] = t
    else:
        C, D, L, Hq, Hk, d = 64, 64, 300, 9, 3, 576
        parts = case.split("-")
        v = dict(variant(C, "saliency", "der", per_kv=int("kv" in parts), D=D), budget=896, n_ctx=8192)
        if len(parts) > 1 and parts[1] != "kv":
            v["sel"] = parts[1]
    F = 64
    inp = make_inputs(L, D, d, 4, Hq=Hq, Hk=Hk)
    params = make_params(D, d, F, 4, Hq=Hq)
    params["Wg"] = params["Wg"] / math.sqrt(d / DM)
    ref = ref_still({k: a.astype(np.float64) for k, a in inp.items()}, params, v)
    cfg = dict(tool_cfg(v, L, D, F), H=Hq, Hk=Hk, d=d)
    packed = pack_params(params, v["feature_map"], v["gate"])
    y0 = None
    for sp in ([L], [2 * C + 5] + [1] * (L - 2 * C - 5)):
        y, _, _ = run_tool(tool, tmp_path, dict(cfg, splits=",".join(map(str, sp))), inp, packed)
        assert row_rel_err(y, ref) < RTOL, (case, sp)
        if y0 is not None:
            assert np.array_equal(y, y0)
        y0 = y


# --------------------------------------------------------------------------
# global selection
# --------------------------------------------------------------------------

def test_global_selection_random_routing_is_deterministic(tool, tmp_path):
    """Global selection with random routing (not matched bit for bit by the
    reference's generator): any split gives the same bits, another seed
    other outputs."""
    C, L, D, F = 4, 3 * 4 + 17, 16, 6
    inp = make_inputs(L, D, DM, 23)
    packed = pack_params(make_params(D, DM, F, 23), "npmap", 1)
    cfg = dict(tool_cfg(variant(C, "random", "glob"), L, D, F), seed=7)
    a, _, _ = run_tool(tool, tmp_path, cfg, inp, packed)
    b, _, _ = run_tool(tool, tmp_path, dict(cfg, splits=",".join(["3"] + ["1"] * (L - 3)), check_truncate=1), inp, packed)
    c, _, _ = run_tool(tool, tmp_path, dict(cfg, seed=8), inp, packed)
    assert np.isfinite(a).all() and np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_global_selection_without_eviction_is_lambda_c(tool, tmp_path):
    """While the store holds every token that left Local, global selection
    keeps them all: the outputs of chunk selection with lambda = C
    (and, at this length, plain softmax attention over the whole prefix)."""
    C, D, F = 8, 16, 6
    L = 5 * C + 3               # 4 chunks leave: 32 tokens <= cap = 40
    inp = make_inputs(L, D, DM, 31)
    packed = pack_params(make_params(D, DM, F, 31), "npmap", 1)
    base = dict(kind="still", L=L, H=H, Hk=HK, D=D, d=DM, F=F, chunk=C, budget=2 * C + 40, n_ctx=L)
    g, _, _ = run_tool(tool, tmp_path, dict(base, sel_global=1), inp, packed)
    ch, _, _ = run_tool(tool, tmp_path, dict(base, **{"lambda": C}), inp, packed)
    assert row_rel_err(g, ch.astype(np.float64)) < 1e-6   # (Sel's slots in another order: float rounding only)
    ref = R.softmax_attn(*(inp[n].astype(np.float64) for n in ("q", "k", "v")))
    assert row_rel_err(g, ref) < RTOL


def test_global_selection_backward_refuses_eviction(tool, tmp_path):
    """Training treats selection as fixed: global selection's backward runs
    while nothing is evicted and says so, in one line, once something is."""
    C, D, F = 8, 16, 6
    inp = make_inputs(3 * C + 17, D, DM, 37)
    packed = pack_params(make_params(D, DM, F, 37), "npmap", 1)
    for L, budget, ok in ((3 * C + 17, 2 * C + 40, True), (3 * C + 17, 2 * C + 5, False)):
        cfg = dict(kind="still", L=L, H=H, Hk=HK, D=D, d=DM, F=F, chunk=C, budget=budget, n_ctx=L, sel_global=1,
                   grad_out=tmp_path / "g.bin")
        src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
        with open(src, "wb") as f:
            f.write(header_line(cfg).encode("ascii"))
            for name in ("q", "k", "v", "q_nope", "k_nope", "x"):
                f.write(np.ascontiguousarray(inp[name][:L], dtype="<f4").tobytes())
            f.write(np.ones((L, H * D), dtype="<f4").tobytes())
            f.write(np.ascontiguousarray(packed, dtype="<f4").tobytes())
        p = subprocess.run([str(tool), str(src), str(dst)], capture_output=True, text=True, timeout=60)
        if ok:
            assert p.returncode == 0, p.stderr
        else:
            msg = p.stderr.strip()
            assert p.returncode != 0 and "evicted" in msg and "\n" not in msg, msg


def test_sel_span_changes_selection(tool, tmp_path):
    """Neighbour selection is not vacuous: with a span the selected sets
    differ (reference) and so do the engine's outputs."""
    C, L, D, F = 8, 3 * 8 + 17, 16, 6
    inp = make_inputs(L, D, DM, 41)
    params = make_params(D, DM, F, 41)
    packed = pack_params(params, "npmap", 1)
    v0 = variant(C, "saliency", "glob")
    sets = [R.still_attn(inp["q"], inp["k"], inp["v"], inp["x"], params, C=C, m=v0["budget"], n_ctx=v0["n_ctx"],
                         routing="saliency", linear=False, return_sets=True, select="global", sel_span=r)[1]
            for r in (0, 3)]
    assert any(not np.array_equal(a, b) for a, b in zip(sets[0]["sel"][-1], sets[1]["sel"][-1]))
    y0, _, _ = run_tool(tool, tmp_path, tool_cfg(v0, L, D, F), inp, packed)
    y3, _, _ = run_tool(tool, tmp_path, tool_cfg(dict(v0, sel_span=3), L, D, F), inp, packed)
    assert row_rel_err(y3, y0.astype(np.float64)) > 1e-2
