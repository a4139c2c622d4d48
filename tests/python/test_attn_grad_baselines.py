"""Stage-2 gradients (attn_kind.backward_inputs) of the baseline kinds
softmax, swa, lolcats and liger against central finite differences of the
float64 numpy reference (tests/python/ref_attention.py).

The C side runs through tests/tools/attn_tool with the header key
grad_out=PATH: the input then carries a random dout [L][H*D] and the tool
writes the gradients of the loss  f = sum(dout * y)  with respect to q, k, v,
q_nope, k_nope, x and the kind's parameters.  For every input tensor X the
test compares

  * <dX, u> with (f(X + h u) - f(X - h u)) / 2h for a few random unit
    directions u (every element of X at once), and
  * dX[i] with the same difference along a single element i (the largest
    gradient entry and a few random ones),

both in float64 with h = 1e-5; the error is relative to max(|fd|, s) with s
the typical size of a directional derivative ||dX|| / sqrt(n) (single
elements: 1e-2 max |dX|), and must stay below 1e-4 (the C side is float32).
Tensors a kind does not read (q_nope/k_nope for softmax, swa and lolcats)
must come back exactly zero.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_attention as R  # noqa: E402
from test_attn_kinds import header_line, make_inputs, make_params, pack_params, reference  # noqa: E402

RTOL = 1e-4
FD_H = 1e-5
NAMES = ("q", "k", "v", "q_nope", "k_nope")


def unpack_params(kind, H_, D, F, packed):
    """The reference's parameter dict from the flat float32 array (so the
    reference sees exactly the parameters the C side reads)."""
    if kind != "lolcats":
        return {}
    p = np.asarray(packed, np.float64)
    n = H_ * D * F
    return {"hq_W": p[:n].reshape(H_, D, F), "hk_W": p[n:2 * n].reshape(H_, D, F), "w": p[2 * n:]}


def run_grad(tool, tmp_path, cfg, inp, dout, packed=None, tag="g"):
    """Run attn_tool with grad_out; returns (y, dict of float64 gradients by
    input name plus "params", the raw float32 gradient file)."""
    src, dst, gp = tmp_path / f"{tag}_in.bin", tmp_path / f"{tag}_y.bin", tmp_path / f"{tag}_grad.bin"
    cfg = dict(cfg, grad_out=gp)
    with open(src, "wb") as f:
        f.write(header_line(cfg).encode("ascii"))
        for name in ("q", "k", "v", "q_nope", "k_nope", "x"):
            f.write(np.ascontiguousarray(inp[name], dtype="<f4").tobytes())
        f.write(np.ascontiguousarray(dout, dtype="<f4").tobytes())
        if packed is not None and packed.size:
            f.write(np.ascontiguousarray(packed, dtype="<f4").tobytes())
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")
    p = subprocess.run([str(tool), str(src), str(dst)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, f"attn_tool failed ({header_line(cfg).strip()}): {p.stderr.strip()}"
    L, H_, Hk, D, d = cfg["L"], cfg["H"], cfg["Hk"], cfg["D"], cfg["d"]
    y = np.fromfile(dst, dtype="<f4").reshape(L, H_, D)
    raw = np.fromfile(gp, dtype="<f4")
    shapes = dict(q=(L, H_, D), k=(L, Hk, D), v=(L, Hk, D), q_nope=(L, H_, D), k_nope=(L, Hk, D), x=(L, d))
    g, o = {}, 0
    for name in ("q", "k", "v", "q_nope", "k_nope", "x"):
        n = int(np.prod(shapes[name]))
        g[name] = raw[o:o + n].astype(np.float64).reshape(shapes[name])
        o += n
    g["params"] = raw[o:].astype(np.float64)
    P = 0 if packed is None else packed.size
    assert g["params"].size == P, (g["params"].size, P)
    return y, g, raw


class Problem:
    """One kind, shape and input set: the float64 loss f and the C gradient."""

    def __init__(self, tool, tmp_path, kind, L, H_=4, Hk=2, D=16, C=16, F=16, window=None, seed=0, wscale=None,
                 shift=None):
        self.kind, self.C = kind, C
        d = 4
        self.cfg = dict(kind=kind, L=L, H=H_, Hk=Hk, D=D, d=d, n_ctx=L, window=window or C, chunk=C, F=F,
                        seed=seed)
        inp = make_inputs(L, H_, Hk, D, d, seed)
        for name, off in (shift or {}).items():   # e.g. k_nope shifted up: decays near 1
            inp[name] = (inp[name] + off).astype(np.float32)
        self.inp = {k: v.astype(np.float64) for k, v in inp.items()}
        params = make_params(kind, H_, D, F, seed)
        if wscale is not None and kind == "lolcats":
            params["hq_W"] = params["hq_W"] * wscale
            params["hk_W"] = params["hk_W"] * wscale
        self.packed = pack_params(kind, self.cfg, params)
        self.params = unpack_params(kind, H_, D, F, self.packed)
        rng = np.random.default_rng(seed + 99)
        self.dout = rng.standard_normal((L, H_, D)).astype(np.float32).astype(np.float64)
        self.y, self.g, self.raw = run_grad(tool, tmp_path, self.cfg, self.inp, self.dout, self.packed)

    def ref(self, inp, params):
        return reference(self.kind, self.cfg, inp, params)

    def loss(self, inp=None, params=None):
        return float(np.sum(self.dout * self.ref(inp or self.inp, params or self.params)))

    def loss_moved(self, name, u, h):
        """f with tensor `name` (or the flat parameter vector) moved by h u."""
        if name == "params":
            flat = np.asarray(self.packed, np.float64) + h * u
            H_, D, F = self.cfg["H"], self.cfg["D"], self.cfg["F"]
            return self.loss(params=unpack_params(self.kind, H_, D, F, flat))
        inp = dict(self.inp)
        inp[name] = self.inp[name] + h * u
        return self.loss(inp=inp)

    def fd(self, name, u):
        return (self.loss_moved(name, u, FD_H) - self.loss_moved(name, u, -FD_H)) / (2 * FD_H)


def check_grad(pb, name, n_dirs=3, n_single=3, seed=0):
    """Directional and single-element checks of pb's gradient of `name`;
    returns the worst relative error."""
    g = pb.g[name]
    assert np.all(np.isfinite(g)), name
    rng = np.random.default_rng(seed + 12345)
    gn = np.linalg.norm(g)
    assert gn > 0, f"{pb.kind}: zero gradient for {name}"
    worst = 0.0
    typ = gn / math.sqrt(g.size)
    for i in range(n_dirs):
        u = rng.standard_normal(g.shape)
        u /= np.linalg.norm(u)
        fd = pb.fd(name, u)
        an = float(np.sum(g * u))
        e = abs(an - fd) / max(abs(fd), typ)
        worst = max(worst, e)
        assert e < RTOL, f"{pb.kind} {name} direction {i}: analytic {an:.9g} vs fd {fd:.9g} (rel {e:.3g})"
    flat = g.ravel()
    idx = [int(np.argmax(np.abs(flat)))] + [int(i) for i in rng.integers(0, flat.size, n_single - 1)]
    for i in idx:
        u = np.zeros(flat.size)
        u[i] = 1.0
        fd = pb.fd(name, u.reshape(g.shape))
        e = abs(flat[i] - fd) / max(abs(fd), 1e-2 * np.abs(flat).max())
        worst = max(worst, e)
        assert e < RTOL, f"{pb.kind} {name}[{np.unravel_index(i, g.shape)}]: analytic {flat[i]:.9g} vs fd {fd:.9g}"
    return worst


def check_problem(pb, names, **kw):
    # the forward the tool ran agrees with the reference (the FD baseline)
    ref = pb.ref(pb.inp, pb.params)
    assert np.linalg.norm(pb.y - ref) / np.linalg.norm(ref) < 1e-5
    worst = {}
    for n in names:
        worst[n] = check_grad(pb, n, **kw)
    # inputs the kind does not read get no gradient
    for n in set(NAMES) - set(names):
        assert not np.any(pb.g[n]), f"{pb.kind}: nonzero gradient for unused {n}"
    assert not np.any(pb.g["x"]), f"{pb.kind}: nonzero gradient for x"
    print(f"{pb.kind} L={pb.cfg['L']} H={pb.cfg['H']} Hk={pb.cfg['Hk']}: " +
          " ".join(f"{n}={e:.2e}" for n, e in worst.items()))
    return worst


# --------------------------------------------------------------------------
# softmax and swa
# --------------------------------------------------------------------------

@pytest.mark.parametrize("L,H_,Hk", [(150, 4, 2), (70, 2, 2)])
def test_softmax_grad(tool, tmp_path, L, H_, Hk):
    """Several key tiles (64 keys) and query tiles, GQA and G = 1."""
    pb = Problem(tool, tmp_path, "softmax", L, H_=H_, Hk=Hk, seed=L)
    check_problem(pb, ("q", "k", "v"))


@pytest.mark.parametrize("L,W,H_,Hk", [(2 * 16 + 17, 16, 4, 2), (150, 5, 4, 2), (150, 70, 2, 2)])
def test_swa_grad(tool, tmp_path, L, W, H_, Hk):
    """Windows smaller than a tile, of a tile and across tiles."""
    pb = Problem(tool, tmp_path, "swa", L, H_=H_, Hk=Hk, window=W, seed=L + W)
    check_problem(pb, ("q", "k", "v"))


# --------------------------------------------------------------------------
# lolcats
# --------------------------------------------------------------------------

@pytest.mark.parametrize("L,H_,Hk,wscale", [(3 * 16 + 17, 4, 2, None), (4 * 16, 2, 2, None), (3 * 16 + 5, 2, 1, 12.0)])
def test_lolcats_grad(tool, tmp_path, L, H_, Hk, wscale):
    """Chunk 16, F 16, 4-5 chunks (the linear history is not empty from
    chunk 2 on), GQA, G = 1, G = 2 with one KV head, and sharp feature maps
    (wscale: many clamped Hedgehog entries); the parameters' gradient too."""
    pb = Problem(tool, tmp_path, "lolcats", L, H_=H_, Hk=Hk, C=16, F=16, seed=L + H_, wscale=wscale)
    if wscale is not None:   # the clamp is exercised
        phq = R.hedgehog(pb.inp["q"][:, 0], pb.params["hq_W"][0])
        assert np.sum(phq <= R.FMAP_CLAMP) > 10
    check_problem(pb, ("q", "k", "v", "params"))


def test_lolcats_params_grad_matches_stage1(tool, tmp_path):
    """backward_inputs' parameter gradient is the stage-1 one: without
    grad_params the input gradients are unchanged and dparams is absent (0)."""
    L = 3 * 16 + 17
    pb = Problem(tool, tmp_path, "lolcats", L, C=16, F=16, seed=3)
    _, g2, _ = run_grad(tool, tmp_path, dict(pb.cfg, grad_params=0), pb.inp, pb.dout, pb.packed, tag="np")
    for n in NAMES:
        assert np.array_equal(pb.g[n], g2[n]), n
    assert not np.any(g2["params"])
    assert np.any(pb.g["params"])


# --------------------------------------------------------------------------
# liger
# --------------------------------------------------------------------------

@pytest.mark.parametrize("L,H_,Hk,W", [(150, 4, 2, 16), (2 * 16 + 17, 2, 2, 16), (140, 2, 1, 70)])
def test_liger_grad(tool, tmp_path, L, H_, Hk, W):
    """Window 16 (and one across key tiles); L = 150 and 140 cross two of
    the recurrence's checkpoints (every 64 tokens) and end inside a block."""
    pb = Problem(tool, tmp_path, "liger", L, H_=H_, Hk=Hk, window=W, seed=L + W)
    check_problem(pb, ("q", "k", "v", "q_nope", "k_nope"))


def test_liger_decay_far_back(tool, tmp_path):
    """Keys whose decay is close to 1 (large k_nope) carry state across many
    checkpoints: the gradient of the first tokens' k_nope and v must still
    be right (single elements at t = 0 and t = 1)."""
    pb = Problem(tool, tmp_path, "liger", 200, H_=2, Hk=1, window=8, seed=4, shift={"k_nope": 3.0})
    for name in ("k_nope", "v", "q_nope"):
        g = pb.g[name]
        for t, i in ((0, 3), (1, 7), (70, 0)):
            u = np.zeros(g.shape)
            u[t, 0, i] = 1.0
            fd = pb.fd(name, u)
            e = abs(g[t, 0, i] - fd) / max(abs(fd), 1e-2 * np.abs(g).max())
            assert e < RTOL, f"{name}[{t},0,{i}]: {g[t, 0, i]:.9g} vs fd {fd:.9g}"


@pytest.mark.parametrize("kind", ["liger", "lolcats", "softmax"])
def test_head_dim_40(tool, tmp_path, kind):
    """Head dim 40: liger's recurrence runs in three column blocks (16, 16,
    8) whose partial sums are added; the other kinds' products at another D."""
    pb = Problem(tool, tmp_path, kind, 100, H_=2, Hk=1, D=40, C=16, F=16, window=16, seed=40)
    check_problem(pb, ("q", "k", "v", "q_nope", "k_nope") if kind == "liger" else
                  ("q", "k", "v", "params") if kind == "lolcats" else ("q", "k", "v"), n_dirs=2, n_single=2)


# --------------------------------------------------------------------------
# threads, accumulation, errors
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["softmax", "swa", "lolcats", "liger"])
def test_threads_do_not_change_gradients(tool, tmp_path, kind):
    """threads=1 and threads=2 give bit-identical gradients (every work item
    owns what it writes; partial sums are added in a fixed order)."""
    L = 150
    cfg = dict(kind=kind, L=L, H=4, Hk=2, D=16, d=4, n_ctx=L, window=16, chunk=16, F=16)
    inp = make_inputs(L, 4, 2, 16, 4, 21)
    packed = pack_params(kind, cfg, make_params(kind, 4, 16, 16, 21))
    dout = np.random.default_rng(5).standard_normal((L, 4, 16)).astype(np.float32)
    raws = [run_grad(tool, tmp_path, dict(cfg, threads=n), inp, dout, packed, tag=f"t{n}")[2] for n in (1, 2)]
    assert np.array_equal(raws[0], raws[1])


def test_length_one_and_partial_tiles(tool, tmp_path):
    """L = 1 and a length just past a tile: finite, and for L = 1 exact
    (y_0 = v_0 for softmax: dv_0 = dout_0 summed over the group, dq = dk = 0)."""
    for kind in ("softmax", "swa", "lolcats", "liger"):
        cfg = dict(kind=kind, L=1, H=4, Hk=2, D=16, d=4, n_ctx=1, window=16, chunk=16, F=16)
        inp = make_inputs(1, 4, 2, 16, 4, 2)
        packed = pack_params(kind, cfg, make_params(kind, 4, 16, 16, 2))
        dout = np.random.default_rng(1).standard_normal((1, 4, 16)).astype(np.float32)
        _, g, _ = run_grad(tool, tmp_path, cfg, inp, dout, packed, tag=kind)
        if kind in ("softmax", "swa"):   # zero up to rounding (dP - Di = g.v - g.y)
            assert np.abs(g["q"]).max() < 1e-6 and np.abs(g["k"]).max() < 1e-6
            want = dout.reshape(1, 2, 2, 16).sum(axis=2)
            assert np.allclose(g["v"], want, rtol=1e-6, atol=1e-6)
        for n in NAMES:
            assert np.all(np.isfinite(g[n]))
    pb = Problem(tool, tmp_path, "softmax", 65, H_=2, Hk=1, seed=9)
    check_problem(pb, ("q", "k", "v"), n_dirs=2, n_single=2)
