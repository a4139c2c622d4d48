"""Attention kinds of the C engine against the float64 numpy reference
(tests/python/ref_attention.py).

The C side is driven through tests/tools/attn_tool (in $STILL_BUILD_DIR, else
<repo>/build; skipped when neither has it).  For every kind, GQA shape and
length, the whole sequence in one call (the chunk-parallel schedule) and
several random splits into prefill + single decode steps + mid-size calls must
match the reference to a relative error ||y - ref|| / ||ref|| < 1e-5.

To add a kind: extend pack_params (the flat float32 layout its C code reads),
reference() and, for its cases, KINDS / the parametrisations below.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_attention as R  # noqa: E402

RTOL = 1e-5
H, HK, D16 = 4, 2, 16



# --------------------------------------------------------------------------
# packing, running, reference
# --------------------------------------------------------------------------

def pack_params(kind, cfg, params):
    """The flat float32 parameter array the C kind reads (attn.h
    param_count(cfg) floats), from the reference's parameter dict."""
    if kind in ("softmax", "swa", "liger"):
        return np.zeros(0, dtype=np.float32)
    if kind == "lolcats":
        # hq_W [H][D][F], hk_W [H][D][F], w [H]
        return np.concatenate([np.asarray(params["hq_W"], np.float64).ravel(),
                               np.asarray(params["hk_W"], np.float64).ravel(),
                               np.asarray(params["w"], np.float64).ravel()]).astype(np.float32)
    raise NotImplementedError(f"pack_params: no layout for kind {kind!r}")


def make_inputs(L, H_, Hk, D, d, seed):
    """Seeded random inputs, float32: q, k, v, q_nope, k_nope (L, heads, D), x (L, d)."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(q=f(L, H_, D), k=f(L, Hk, D), v=f(L, Hk, D), q_nope=f(L, H_, D), k_nope=f(L, Hk, D), x=f(L, d))


def header_line(cfg):
    return " ".join(f"{k}={v}" for k, v in cfg.items()) + "\n"


def write_input(path, cfg, inp, packed=None):
    with open(path, "wb") as f:
        f.write(header_line(cfg).encode("ascii"))
        for name in ("q", "k", "v", "q_nope", "k_nope", "x"):
            f.write(np.ascontiguousarray(inp[name], dtype="<f4").tobytes())
        if packed is not None:
            f.write(np.ascontiguousarray(packed, dtype="<f4").tobytes())


def run_tool(tool, tmp_path, cfg, inp, packed=None, check=True):
    """Run attn_tool; returns (y (L, H, D) float32, state_bytes, param_count)
    or, with check=False, the CompletedProcess."""
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    write_input(src, cfg, inp, packed)
    if dst.exists():
        dst.unlink()
    # Passive OpenMP waiting: many short forward calls on a loaded machine
    # are otherwise dominated by spinning threads.
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")
    p = subprocess.run([str(tool), str(src), str(dst)], capture_output=True, text=True, timeout=60, env=env)
    if not check:
        return p
    assert p.returncode == 0, f"attn_tool failed ({header_line(cfg).strip()}): {p.stderr.strip()}"
    kv = dict(t.split("=") for t in p.stdout.split())
    y = np.fromfile(dst, dtype="<f4").reshape(cfg["L"], cfg["H"], cfg["D"])
    return y, int(kv["state_bytes"]), int(kv["param_count"])


def reference(kind, cfg, inp, params):
    q, k, v = inp["q"], inp["k"], inp["v"]
    if kind == "softmax":
        return R.softmax_attn(q, k, v)
    if kind == "swa":
        return R.swa_attn(q, k, v, cfg["window"])
    if kind == "lolcats":
        return R.lolcats_attn(q, k, v, params, C=cfg["chunk"])
    if kind == "liger":
        return R.liger_attn(inp["q_nope"], inp["k_nope"], q, k, v, window=cfg["window"])
    raise NotImplementedError(kind)


def make_params(kind, H_, D, F, seed):
    if kind != "lolcats":
        return {}
    rng = np.random.default_rng(seed + 1000)
    p = R.init_lolcats_params(H_, D, F, rng)
    # sharper feature maps and varied window factors than the init gives
    p["hq_W"] = p["hq_W"] * 3.0
    p["hk_W"] = p["hk_W"] * 3.0
    p["w"] = rng.normal(-1.0, 1.5, H_)
    return p


def rel_err(y, ref):
    n = np.linalg.norm(ref)
    return np.linalg.norm(y.astype(np.float64) - ref) / (n if n > 0 else 1.0)


def random_splits(rng, L, C):
    """Three random schedules: prefill + single steps; random mix of single
    steps and calls of about a chunk (crossing chunk boundaries); decode from
    a short prefill."""
    out = []
    p = int(rng.integers(0, L + 1))
    out.append(([p] if p else []) + [1] * (L - p))
    mix, left = [], L
    while left:
        n = int(rng.choice([1, 1, 2, max(1, C - 1), C, C + 1, 2 * C + 3, int(rng.integers(1, 3 * C + 1))]))
        n = min(n, left)
        mix.append(n)
        left -= n
    out.append(mix)
    p = min(L, int(rng.integers(1, C + 2)))
    out.append([p] + [1] * (L - p))
    return out


def check_kind(tool, tmp_path, kind, L, C, D=D16, F=16, seed=0, n_random=3, H_=H, Hk=HK):
    d = 12
    cfg = dict(kind=kind, L=L, H=H_, Hk=Hk, D=D, d=d, n_ctx=max(L, 1), window=C, chunk=C, F=F, seed=seed)
    inp = make_inputs(L, H_, Hk, D, d, seed)
    params = make_params(kind, H_, D, F, seed)
    packed = pack_params(kind, cfg, params)
    ref = reference(kind, cfg, inp, params)
    rng = np.random.default_rng(seed + 7)
    schedules = [[L]] + random_splits(rng, L, C)[:n_random]
    for i, sp in enumerate(schedules):
        c = dict(cfg, splits=",".join(map(str, sp)))
        if i == 1:
            c["check_truncate"] = 1
        y, _, pc = run_tool(tool, tmp_path, c, inp, packed)
        assert pc == packed.size
        e = rel_err(y, ref)
        assert e < RTOL, f"{kind} L={L} C={C} D={D} splits={sp}: relative error {e:.3g}"


# --------------------------------------------------------------------------
# agreement with the reference
# --------------------------------------------------------------------------

def lengths(C):
    return sorted({1, C - 1, C, 2 * C + 1, 3 * C + 17, 100} - {0})


CASES = [(kind, C, L) for kind in ("softmax", "swa", "lolcats", "liger") for C in (4, 8, 16) for L in lengths(C)
         if not (kind == "softmax" and C != 16)]   # softmax has no C / window


@pytest.mark.parametrize("kind,C,L", CASES, ids=[f"{k}-C{c}-L{n}" for k, c, n in CASES])
def test_kind_matches_reference(tool, tmp_path, kind, C, L):
    check_kind(tool, tmp_path, kind, L, C, seed=L * 31 + C)


@pytest.mark.parametrize("kind,C,F", [("softmax", 64, 64), ("swa", 64, 64), ("lolcats", 16, 64),
                                      ("lolcats", 64, 64), ("liger", 64, 64), ("liger", 16, 64)])
def test_kind_matches_reference_d64(tool, tmp_path, kind, C, F):
    check_kind(tool, tmp_path, kind, 150 if C == 64 else 100, C, D=64, F=F, seed=5, n_random=2)


@pytest.mark.parametrize("kind", ["lolcats", "liger"])
def test_smollm2_shape(tool, tmp_path, kind):
    """SmolLM2-135M's attention shape: H = 9, Hk = 3, D = 64, C = F = window = 64."""
    check_kind(tool, tmp_path, kind, 200, 64, D=64, F=64, seed=2, n_random=1, H_=9, Hk=3)


def test_gqa_group_one_and_large_values(tool, tmp_path):
    """H == Hk (no grouping) and inputs scaled up (peaked softmaxes)."""
    L, C, D, F = 45, 8, 16, 8
    for kind in ("lolcats", "liger", "swa"):
        cfg = dict(kind=kind, L=L, H=3, Hk=3, D=D, d=4, window=C, chunk=C, F=F)
        inp = make_inputs(L, 3, 3, D, 4, 11)
        for key in ("q", "k", "q_nope", "k_nope"):
            inp[key] = inp[key] * 3.0
        params = make_params(kind, 3, D, F, 11)
        ref = reference(kind, cfg, inp, params)
        for sp in ([L], [10] + [1] * 35):
            y, _, _ = run_tool(tool, tmp_path, dict(cfg, splits=",".join(map(str, sp))), inp,
                               pack_params(kind, cfg, params))
            assert rel_err(y, ref) < RTOL, kind


def test_threads_do_not_change_results(tool, tmp_path):
    L, C = 77, 8
    for kind in ("lolcats", "liger"):
        cfg = dict(kind=kind, L=L, H=H, Hk=HK, D=D16, d=4, window=C, chunk=C, F=16)
        inp = make_inputs(L, H, HK, D16, 4, 3)
        packed = pack_params(kind, cfg, make_params(kind, H, D16, 16, 3))
        ys = [run_tool(tool, tmp_path, dict(cfg, threads=n), inp, packed)[0] for n in (1, 2, 3)]
        assert np.array_equal(ys[0], ys[1]) and np.array_equal(ys[0], ys[2]), kind


# --------------------------------------------------------------------------
# parameter initialisation
# --------------------------------------------------------------------------

def test_lolcats_param_init(tool, tmp_path):
    """Without a params section the tool uses param_init(seed): kaiming-uniform
    maps (bound sqrt(6 / (D F))), w = -2.197; deterministic per seed."""
    L, D, F, C = 40, 16, 16, 8
    cfg = dict(kind="lolcats", L=L, H=H, Hk=HK, D=D, d=4, chunk=C, F=F, seed=42)
    inp = make_inputs(L, H, HK, D, 4, 9)
    got = []
    for seed in (42, 42, 43):
        po = tmp_path / f"p{len(got)}.bin"
        y, _, pc = run_tool(tool, tmp_path, dict(cfg, seed=seed, params_out=po), inp)
        p = np.fromfile(po, dtype="<f4")
        assert p.size == pc == 2 * H * D * F + H
        got.append((y, p))
    (y0, p0), (y1, p1), (_, p2) = got
    assert np.array_equal(p0, p1) and np.array_equal(y0, y1)
    assert not np.array_equal(p0, p2)
    W, w = p0[:2 * H * D * F], p0[2 * H * D * F:]
    b = math.sqrt(6.0 / (D * F))
    assert np.all(np.abs(W) <= b) and abs(W.mean()) < 0.05 * b
    assert abs(W.var() / (b * b / 3) - 1) < 0.1
    assert np.allclose(w, -2.197)
    params = {"hq_W": W[:H * D * F].reshape(H, D, F), "hk_W": W[H * D * F:].reshape(H, D, F), "w": w}
    assert rel_err(y0, R.lolcats_attn(inp["q"], inp["k"], inp["v"], params, C=C)) < RTOL


# --------------------------------------------------------------------------
# state size
# --------------------------------------------------------------------------

def state_bytes(tool, tmp_path, kind, n_ctx):
    L, D = 8, 16
    cfg = dict(kind=kind, L=L, H=H, Hk=HK, D=D, d=4, n_ctx=n_ctx, window=64, chunk=64, F=64)
    return run_tool(tool, tmp_path, cfg, make_inputs(L, H, HK, D, 4, 1))[1]


@pytest.mark.parametrize("kind", ["swa", "lolcats", "liger"])
def test_state_bounded(tool, tmp_path, kind):
    a, b = state_bytes(tool, tmp_path, kind, 2048), state_bytes(tool, tmp_path, kind, 65536)
    assert a == b > 0


def test_softmax_state_grows_linearly(tool, tmp_path):
    a, b = state_bytes(tool, tmp_path, "softmax", 2048), state_bytes(tool, tmp_path, "softmax", 65536)
    assert b == 32 * a


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind,bad", [("lolcats", {"chunk": 0}), ("lolcats", {"F": 0}), ("lolcats", {"chunk": -3}),
                                      ("liger", {"window": 0}), ("swa", {"window": -1}),
                                      ("nosuchkind", {}), ("softmax", {"splits": "3,4"}),
                                      ("softmax", {"bogus": 1}), ("softmax", {"Hk": 3}),
                                      ("softmax", {"routing": "magic"})])
def test_bad_config_is_one_line_error(tool, tmp_path, kind, bad):
    L = 8
    cfg = dict(dict(kind=kind, L=L, H=H, Hk=HK, D=16, d=4), **bad)
    p = run_tool(tool, tmp_path, cfg, make_inputs(L, H, HK, 16, 4, 0), check=False)
    assert p.returncode != 0
    msg = p.stderr.strip()
    assert msg and "\n" not in msg, msg


def test_bad_sizes_are_rejected(tool, tmp_path):
    L = 8
    cfg = dict(kind="lolcats", L=L, H=H, Hk=HK, D=16, d=4, chunk=4, F=8)
    inp = make_inputs(L, H, HK, 16, 4, 0)
    # a parameter section of the wrong size
    p = run_tool(tool, tmp_path, cfg, inp, np.zeros(5, np.float32), check=False)
    assert p.returncode != 0 and "bytes" in p.stderr
    # truncated inputs
    inp["x"] = inp["x"][:, :3]
    p = run_tool(tool, tmp_path, cfg, inp, check=False)
    assert p.returncode != 0
    # no header line
    src = tmp_path / "nohdr.bin"
    src.write_bytes(b"kind=softmax L=1")
    p = subprocess.run([str(tool), str(src), str(tmp_path / "o.bin")], capture_output=True, text=True)
    assert p.returncode != 0 and "header" in p.stderr


def test_context_limit(tool, tmp_path):
    """A kind refuses tokens beyond n_ctx with an error, not a crash."""
    L = 20
    for kind in ("lolcats", "liger"):
        cfg = dict(kind=kind, L=L, H=H, Hk=HK, D=16, d=4, n_ctx=10, window=4, chunk=4, F=8)
        p = run_tool(tool, tmp_path, cfg, make_inputs(L, H, HK, 16, 4, 0), check=False)
        assert p.returncode != 0 and "full" in p.stderr, p.stderr
