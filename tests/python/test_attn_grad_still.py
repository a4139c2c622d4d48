"""Stage-2 gradients of the still kind (src/kinds/still/attn_still.c:
still_backward_inputs) against central finite differences of the float64
numpy reference ref_attention.still_attn.

The C side runs through tests/tools/attn_tool with grad_out=PATH: the input
carries a random dout [L][H*D] and the tool writes the gradients of
f = sum(dout * y) with respect to q, k, v (after RoPE), q_nope, k_nope, x
and the parameters. For each of q, k, v, x and the parameter vector the test
compares

  * <dX, u> with (f(X + h u) - f(X - h u)) / 2h for a few random unit
    directions u (all elements at once), and
  * single elements: a key and a value element of a selected token (Sel),
    of a folded token (in the linear state), and the largest entry of dq,

in float64 with h = 1e-5. The error is relative to max(|fd|, s), s the
typical size of the quantity (directions: ||dX|| / sqrt(n); elements:
1e-2 max |dX|), and must stay below 1e-4 (the C side is float32). The
selection is a fixed routing decision in the C backward: every perturbation
is checked to leave the reference's selection unchanged (else another
direction is drawn).

Cases: chunk C = 8 (two with 16), L = nC + 5 crossing several chunks so
that Sel and the linear state are both non-empty (checked), GQA H=4 Hk=2,
selection per query head and per KV head, budget capped (Sel fills up) and
uncapped (budget 0 with an explicit lambda), routing saliency / keynorm / qk /
position / none, linear on and off, gate on and off (and in the denominator
too: gate_den), NP-Map and Hedgehog,
D = 16, d = 12. Also: q_nope and k_nope get exactly zero; x gets exactly
zero without the gate (or without the linear branch), as do the parameters
without the linear branch; the gradients are bit-identical for 1, 2 and 3
threads.
"""

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_attention as R  # noqa: E402
from test_attn_still import DM, H, HK, header_line, make_inputs, make_params, pack_params  # noqa: E402

RTOL = 1e-4
FD_H = 1e-5
D, F = 16, 6
N_DIRS = 3          # random directions per tensor
WORST = {}          # worst error per case family (printed with pytest -s)


def unpack_params(vec, fm, gate, base):
    """The reference's parameter dict with the entries the flat float32
    layout (pack_params) carries replaced by vec (float64)."""
    p = dict(base)
    vec = np.asarray(vec, np.float64)
    o = 0
    shapes = ([("q_u", (H, D)), ("k_u", (H, D)), ("q_W", (H, D, D)), ("k_W", (H, D, D))] if fm == "npmap"
              else [("hq_W", (H, D, F)), ("hk_W", (H, D, F))])
    if gate:
        shapes += [("Wg", (H * D, DM)), ("bg", (H * D,))]
    for name, shp in shapes:
        n = int(np.prod(shp))
        p[name] = vec[o:o + n].reshape(shp)
        o += n
    assert o == vec.size
    return p


def run_grad(tool, tmp_path, cfg, inp, dout, packed, tag="g"):
    """attn_tool with grad_out: (y, dict of float64 gradients, raw bytes)."""
    src, dst, gp = tmp_path / f"{tag}_in.bin", tmp_path / f"{tag}_y.bin", tmp_path / f"{tag}_grad.bin"
    cfg = dict(cfg, grad_out=gp)
    with open(src, "wb") as f:
        f.write(header_line(cfg).encode("ascii"))
        for name in ("q", "k", "v", "q_nope", "k_nope", "x"):
            f.write(np.ascontiguousarray(inp[name], dtype="<f4").tobytes())
        f.write(np.ascontiguousarray(dout, dtype="<f4").tobytes())
        f.write(np.ascontiguousarray(packed, dtype="<f4").tobytes())
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")
    p = subprocess.run([str(tool), str(src), str(dst)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, f"attn_tool failed ({header_line(cfg).strip()}): {p.stderr.strip()}"
    L = cfg["L"]
    y = np.fromfile(dst, dtype="<f4").reshape(L, H, D)
    raw = np.fromfile(gp, dtype="<f4")
    shapes = dict(q=(L, H, D), k=(L, HK, D), v=(L, HK, D), q_nope=(L, H, D), k_nope=(L, HK, D), x=(L, DM))
    g, o = {}, 0
    for name in ("q", "k", "v", "q_nope", "k_nope", "x"):
        n = int(np.prod(shapes[name]))
        g[name] = raw[o:o + n].astype(np.float64).reshape(shapes[name])
        o += n
    g["params"] = raw[o:].astype(np.float64)
    assert g["params"].size == packed.size
    return y, g, raw


# --------------------------------------------------------------------------
# the cases
# --------------------------------------------------------------------------

def case(name, C=8, routing="saliency", mode="cap", per_kv=0, linear=1, fm="npmap", gate=1, n_chunks=4, gate_den=0):
    """mode 'cap': budget 2C + 5 with lambda 2 (Sel full after three leaving
    chunks); 'ref': budget 0 (uncapped) with lambda 3. L = n_chunks C + 5."""
    L = n_chunks * C + 5
    budget, lam = {"cap": (2 * C + 5, 2), "ref": (0, 3)}[mode]
    return dict(name=name, chunk=C, L=L, budget=budget, lam=lam, n_ctx=L, per_kv_head=per_kv, routing=routing,
                linear=linear, feature_map=fm, gate=gate, gate_den=gate_den)


CASES = [
    case("saliency-cap-kv0-npmap-gate"),
    case("saliency-ref-kv1-npmap-gate", mode="ref", per_kv=1),
    case("keynorm-cap-kv1-hedgehog-nogate", routing="keynorm", per_kv=1, fm="hedgehog", gate=0),
    case("position-ref-kv0-hedgehog-gate-C16", C=16, routing="position", mode="ref", fm="hedgehog", n_chunks=3),
    case("saliency-cap-kv0-npmap-nogate", gate=0),
    case("saliency-cap-kv1-nolinear", per_kv=1, linear=0),
    case("keynorm-ref-kv0-nolinear", routing="keynorm", mode="ref", linear=0),
    case("none-kv0-npmap-gate", routing="none", mode="ref"),
    case("qk-cap-kv1-hedgehog-gate", routing="qk", per_kv=1, fm="hedgehog"),
    case("saliency-ref-kv0-npmap-gate-C16", C=16, mode="ref"),
    case("saliency-cap-kv0-npmap-gateden", gate_den=1),
    case("qk-ref-kv1-hedgehog-gateden", routing="qk", mode="ref", per_kv=1, fm="hedgehog", gate_den=1),
]


def tool_cfg(v):
    return dict(kind="still", L=v["L"], H=H, Hk=HK, D=D, d=DM, F=F, chunk=v["chunk"], budget=v["budget"],
                **{"lambda": v["lam"]}, n_ctx=v["n_ctx"], per_kv_head=v["per_kv_head"], routing=v["routing"],
                linear=v["linear"], feature_map=v["feature_map"], gate=v["gate"], gate_den=v["gate_den"], seed=0)


def reference(v, inp, params):
    """(y, picks) of the float64 reference."""
    y, sets = R.still_attn(inp["q"], inp["k"], inp["v"], inp["x"], params, C=v["chunk"], m=v["budget"],
                           n_ctx=v["n_ctx"], lam=v["lam"], per_kv_head=bool(v["per_kv_head"]),
                           routing=v["routing"], linear=bool(v["linear"]), feature_map=v["feature_map"],
                           gate=bool(v["gate"]), gate_den=bool(v["gate_den"]), return_sets=True)
    return y, sets


def picks_key(sets):
    return [[tuple(int(j) for j in c) for c in hs] for hs in sets["picks"]]


def setup(v):
    seed = zlib.crc32(v["name"].encode())
    inp = make_inputs(v["L"], D, DM, seed)
    params = make_params(D, DM, F, seed)
    packed = pack_params(params, v["feature_map"], v["gate"])
    rng = np.random.default_rng(seed + 7)
    dout = rng.standard_normal((v["L"], H, D)).astype(np.float32)
    return inp, params, packed, dout, rng


def record(v, what, err):
    fam = v["name"]
    WORST.setdefault(fam, {})
    WORST[fam][what] = max(WORST[fam].get(what, 0.0), err)


@pytest.fixture(scope="module", autouse=True)
def report_worst():
    yield
    for fam, d in WORST.items():
        print(f"\n{fam}: " + ", ".join(f"{k} {e:.2e}" for k, e in sorted(d.items())))


@pytest.mark.parametrize("v", CASES, ids=[c["name"] for c in CASES])
def test_gradients_match_finite_differences(tool, tmp_path, v):
    inp, params, packed, dout, rng = setup(v)
    ex = {k: a.astype(np.float64) for k, a in inp.items()}
    pvec = packed.astype(np.float64)
    dout64 = dout.astype(np.float64)
    y, g, _ = run_grad(tool, tmp_path, tool_cfg(v), inp, dout, packed)

    y_ref, sets = reference(v, ex, unpack_params(pvec, v["feature_map"], v["gate"], params))
    num = np.linalg.norm(y.astype(np.float64) - y_ref)
    assert num <= 1e-5 * np.linalg.norm(y_ref), f"{v['name']}: the forward differs from the reference"
    base_picks = picks_key(sets)
    # the case exercises what it claims: Sel and the linear state are non-empty
    G = H // HK
    if v["routing"] != "none":
        assert all(len(s) > 0 for s in sets["sel"][-1])
        if v["budget"]:
            assert all(len(s) == v["budget"] - 2 * v["chunk"] for s in sets["sel"][-1])
    else:
        assert all(len(s) == 0 for s in sets["sel"][-1])
    assert all(len(s) > 0 for s in sets["lin"][-1])

    # inputs the kind does not read: exactly zero
    assert not g["q_nope"].any() and not g["k_nope"].any()
    if not (v["linear"] and v["gate"]):
        assert not g["x"].any()
    if not v["linear"]:
        assert not g["params"].any()

    def f(name, delta):
        """Loss and selection with `name` moved by delta."""
        e = dict(ex)
        pv = pvec
        if name == "params":
            pv = pvec + delta
        else:
            e[name] = ex[name] + delta
        yy, ss = reference(v, e, unpack_params(pv, v["feature_map"], v["gate"], params))
        return float(np.sum(dout64 * yy)), picks_key(ss)

    def fd(name, u):
        """Central difference along u; None if the selection moves."""
        fp, sp = f(name, FD_H * u)
        fm, sm = f(name, -FD_H * u)
        if sp != base_picks or sm != base_picks:
            return None
        return (fp - fm) / (2 * FD_H)

    full = {"q": ex["q"], "k": ex["k"], "v": ex["v"], "x": ex["x"], "params": pvec}
    names = ["q", "k", "v"] + (["x"] if v["linear"] and v["gate"] else []) + (["params"] if v["linear"] else [])
    for name in names:
        gr = g[name]
        typical = np.linalg.norm(gr) / np.sqrt(gr.size)
        assert typical > 0, f"{v['name']}: d{name} is zero"
        done = tries = 0
        while done < N_DIRS:
            tries += 1
            assert tries <= 4 * N_DIRS, f"{v['name']}: every direction for {name} changes the selection"
            u = rng.standard_normal(full[name].shape)
            u /= np.linalg.norm(u)
            d = fd(name, u)
            if d is None:
                continue
            err = abs(float(np.sum(gr * u)) - d) / max(abs(d), typical)
            record(v, f"d{name}", err)
            assert err < RTOL, f"{v['name']}: <d{name}, u> = {np.sum(gr * u):.8g}, fd {d:.8g} (rel {err:.2e})"
            done += 1

    # single elements: a selected token's key and value, a folded token's key,
    # and the largest entry of dq
    hs = 0
    kv = hs if v["per_kv_head"] else hs // G
    elems = []
    sel = sets["sel"][-1][hs]
    if len(sel):
        j = int(sel[len(sel) // 2])
        elems += [("k", (j, kv, 3)), ("v", (j, kv, 5))]
    lin = sets["lin"][-1][hs]
    j = int(lin[len(lin) // 3])
    elems += [("k", (j, kv, 7)), ("v", (j, kv, 2))]
    elems.append(("q", np.unravel_index(int(np.argmax(np.abs(g["q"]))), g["q"].shape)))
    for name, idx in elems:
        gr = g[name]
        u = np.zeros(gr.shape)
        u[idx] = 1.0
        d = fd(name, u)
        assert d is not None, f"{v['name']}: moving {name}{idx} changes the selection"
        err = abs(gr[idx] - d) / max(abs(d), 1e-2 * np.abs(gr).max())
        record(v, "elements", err)
        assert err < RTOL, f"{v['name']}: d{name}{tuple(map(int, idx))} = {gr[idx]:.8g}, fd {d:.8g} (rel {err:.2e})"


@pytest.mark.parametrize("v", [CASES[0], CASES[2]], ids=[CASES[0]["name"], CASES[2]["name"]])
def test_threads_give_identical_gradients(tool, tmp_path, v):
    inp, _, packed, dout, _ = setup(v)
    raws = [run_grad(tool, tmp_path, dict(tool_cfg(v), threads=n), inp, dout, packed, tag=f"t{n}")[2]
            for n in (1, 2, 3)]
    assert np.array_equal(raws[0], raws[1]) and np.array_equal(raws[0], raws[2])


def test_longer_sequence_sel_fills(tool, tmp_path):
    """More chunks (L = 7C + 5, C = 8): Sel full after chunk 2, the later
    leaving chunks folded whole; one direction per input."""
    v = case("saliency-cap-kv1-npmap-gate-long", per_kv=1, n_chunks=7)
    inp, params, packed, dout, rng = setup(v)
    ex = {k: a.astype(np.float64) for k, a in inp.items()}
    dout64 = dout.astype(np.float64)
    _, g, _ = run_grad(tool, tmp_path, tool_cfg(v), inp, dout, packed)
    _, sets = reference(v, ex, params)
    base = picks_key(sets)
    assert all(len(hs[-1]) == 0 for hs in sets["picks"])   # the last leaving chunk finds Sel full
    for name in ("q", "k", "v", "x"):
        u = rng.standard_normal(ex[name].shape)
        u /= np.linalg.norm(u)
        vals = []
        for sgn in (1, -1):
            e = dict(ex)
            e[name] = ex[name] + sgn * FD_H * u
            yy, ss = reference(v, e, params)
            assert picks_key(ss) == base
            vals.append(float(np.sum(dout64 * yy)))
        d = (vals[0] - vals[1]) / (2 * FD_H)
        typical = np.linalg.norm(g[name]) / np.sqrt(g[name].size)
        err = abs(float(np.sum(g[name] * u)) - d) / max(abs(d), typical)
        record(v, f"d{name}", err)
        assert err < RTOL, (name, err)
