"""Self-checks of tests/python/ref_attention.py (no C engine needed).

Each identity is computed independently here (dense masked matrices, explicit
products), not with the reference's own helpers.
"""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_attention as R  # noqa: E402

H, HK, D, DM = 4, 2, 8, 12   # GQA group G = 2


def make(L, seed=0, scale=1.0, H=H, Hk=HK, D=D, d=DM):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((L, H, D)) * scale
    k = rng.standard_normal((L, Hk, D)) * scale
    v = rng.standard_normal((L, Hk, D))
    x = rng.standard_normal((L, d))
    return q, k, v, x, rng


def dense_masked(q, k, v, mask):
    """y[t, h] = softmax over j with mask[h, t, j] of q_t.k_j/sqrt(D), dense."""
    L, Hq, Dh = q.shape
    G = Hq // k.shape[1]
    kr = np.repeat(k, G, axis=1)
    vr = np.repeat(v, G, axis=1)
    s = np.einsum("thd,jhd->htj", q, kr) / math.sqrt(Dh)
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("htj,jhd->thd", p, vr)


def causal(L):
    t = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    return np.broadcast_to(j <= t, (H, L, L))


# ---------------------------------------------------------------- softmax, swa

@pytest.mark.parametrize("L", [1, 2, 7, 30])
def test_softmax_equals_dense(L):
    q, k, v, _, _ = make(L, seed=L)
    np.testing.assert_allclose(R.softmax_attn(q, k, v), dense_masked(q, k, v, causal(L)),
                               rtol=1e-12, atol=1e-12)


def test_swa():
    L = 23
    q, k, v, _, _ = make(L, seed=3)
    full = R.softmax_attn(q, k, v)
    for W in (L, L + 5, 1000):
        np.testing.assert_allclose(R.swa_attn(q, k, v, W), full, rtol=1e-12, atol=1e-12)
    t = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    for W in (1, 3, 8):
        band = np.broadcast_to((j <= t) & (j > t - W), (H, L, L))
        np.testing.assert_allclose(R.swa_attn(q, k, v, W), dense_masked(q, k, v, band),
                                   rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(R.swa_attn(q, k, v, 1), np.repeat(v, H // HK, axis=1), atol=1e-14)


# ---------------------------------------------------------------- feature maps

def test_npmap_norm_and_halves():
    rng = np.random.default_rng(1)
    for Dh in (4, 8, 64):
        x = rng.standard_normal((50, Dh)) * rng.uniform(0.01, 30, size=(50, 1))
        u = rng.standard_normal(Dh)
        W = rng.uniform(-1, 1, size=(Dh, Dh))
        z = R.npmap_z(x, u, W)
        np.testing.assert_allclose(np.linalg.norm(z, axis=-1), np.linalg.norm(x, axis=-1),
                                   rtol=1e-12)
        # direction is that of W @ householder(x), computed independently
        uh = u / np.linalg.norm(u)
        Hh = np.eye(Dh) - 2 * np.outer(uh, uh)
        ref = (W @ Hh @ x.T).T
        ref = ref / np.linalg.norm(ref, axis=-1, keepdims=True) * np.linalg.norm(x, axis=-1, keepdims=True)
        np.testing.assert_allclose(z, ref, rtol=1e-10, atol=1e-12)
        phi = R.npmap(x, u, W)
        assert phi.shape == (50, 2 * Dh)
        assert (phi >= 1e-12).all()
        # each half sums to 1 (clamping can add at most Dh * 1e-12)
        np.testing.assert_allclose(phi[:, :Dh].sum(-1), 1.0, atol=Dh * 1e-12 + 1e-14)
        np.testing.assert_allclose(phi[:, Dh:].sum(-1), 1.0, atol=Dh * 1e-12 + 1e-14)
        # invariant to the scale of W and of u (only directions matter)
        np.testing.assert_allclose(R.npmap(x, 5.0 * u, 0.3 * W), phi, rtol=1e-10, atol=1e-15)
    # zero input: finite, uniform halves
    phi0 = R.npmap(np.zeros(8), rng.standard_normal(8), rng.standard_normal((8, 8)))
    np.testing.assert_allclose(phi0, np.full(16, 1 / 8), atol=1e-15)


def test_hedgehog():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((10, 8))
    W = rng.standard_normal((8, 5))
    phi = R.hedgehog(x, W)
    z = x @ W
    ref = np.concatenate([np.exp(z) / np.exp(z).sum(-1, keepdims=True),
                          np.exp(-z) / np.exp(-z).sum(-1, keepdims=True)], axis=-1)
    np.testing.assert_allclose(phi, np.maximum(ref, 1e-12), rtol=1e-12)
    assert phi.shape == (10, 10)


def test_init_params():
    rng = np.random.default_rng(0)
    p = R.init_still_params(9, 64, 576, rng)
    assert p["q_W"].shape == (9, 64, 64) and p["q_u"].shape == (9, 64)
    assert p["Wg"].shape == (9 * 64, 576) and not p["Wg"].any()
    np.testing.assert_allclose(R.sigmoid(p["bg"]), 1 / (1 + math.exp(-2)))
    assert np.abs(p["q_W"]).max() <= math.sqrt(6 / (64 * 64))
    pl = R.init_lolcats_params(9, 64, 64, rng)
    assert pl["hq_W"].shape == (9, 64, 64)
    np.testing.assert_allclose(R.sigmoid(pl["w"]), 0.1, atol=1e-4)


# ---------------------------------------------------------------- lolcats, liger

def test_lolcats_short_is_softmax():
    # L <= 2C: Hist is empty for every t, gamma cancels (eps = 0)
    C = 8
    q, k, v, _, rng = make(2 * C, seed=5)
    p = R.init_lolcats_params(H, D, 6, rng)
    np.testing.assert_allclose(R.lolcats_attn(q, k, v, p, C, eps=0.0), R.softmax_attn(q, k, v),
                               rtol=1e-12, atol=1e-12)


def test_liger_explicit():
    L = 29
    q, k, v, _, rng = make(L, seed=6)
    qn = rng.standard_normal(q.shape)
    kn = rng.standard_normal(k.shape)
    G = H // HK
    y = R.liger_attn(qn, kn, q, k, v, window=5)
    sm = lambda a: np.exp(a - a.max()) / np.exp(a - a.max()).sum()
    alpha = (1 / (1 + np.exp(-kn))) ** (1 / 16)
    lin = np.zeros((L, H, D))
    for h in range(H):
        kv = h // G
        for t in range(L):
            for j in range(t + 1):
                decay = np.prod(alpha[j + 1:t + 1, kv], axis=0)  # ones if j == t
                lin[t, h] += (sm(qn[t, h]) * decay) @ sm(kn[j, kv]) * v[j, kv]
    t_ = np.arange(L)[:, None]
    j_ = np.arange(L)[None, :]
    band = np.broadcast_to((j_ <= t_) & (j_ > t_ - 5), (H, L, L))
    np.testing.assert_allclose(y, 0.5 * dense_masked(q, k, v, band) + 0.5 * lin,
                               rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------- still

def terrace_local_mask(L, C):
    t = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    return np.broadcast_to((j <= t) & (j // C >= t // C - 1), (H, L, L))


@pytest.mark.parametrize("C", [4, 8])
def test_still_none_linear_off_is_local(C):
    for L in (1, C, 2 * C + 1, 3 * C + 17):
        q, k, v, x, rng = make(L, seed=L + C)
        p = R.init_still_params(H, D, DM, rng)
        ref = dense_masked(q, k, v, terrace_local_mask(L, C))
        y = R.still_attn(q, k, v, x, p, C=C, m=0, lam=3, routing="none", linear=False, eps=0.0)
        np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
        # saliency routing with lambda = 0 is the same thing
        y0 = R.still_attn(q, k, v, x, p, C=C, m=0, lam=0, linear=False, eps=0.0)
        np.testing.assert_allclose(y0, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("routing", ["saliency", "random", "keynorm", "qk", "position"])
def test_still_all_selected_is_softmax(routing):
    # lambda >= C: every token of every leaving chunk joins Sel, so A(t) is all
    # j <= t and S, z are empty -> exactly softmax, with or without the linear
    # branch (eps = 0).
    C, L = 4, 3 * 4 + 7
    q, k, v, x, rng = make(L, seed=11)
    p = R.init_still_params(H, D, DM, rng)
    full = dense_masked(q, k, v, causal(L))
    for linear in (False, True):
        for per_kv in (False, True):
            y = R.still_attn(q, k, v, x, p, C=C, m=0, lam=C, routing=routing,
                             linear=linear, per_kv_head=per_kv, eps=0.0)
            np.testing.assert_allclose(y, full, rtol=1e-12, atol=1e-12)
    # same through the derived lambda: n_ctx = C -> T_max = 1 -> lambda = m - 2C >= C
    m = 2 * C + C * (-(-L // C))
    y, sets = R.still_attn(q, k, v, x, p, C=C, m=m, n_ctx=C, routing=routing,
                           eps=0.0, return_sets=True)
    assert sets["lam"] >= C
    np.testing.assert_allclose(y, full, rtol=1e-12, atol=1e-12)


def test_still_hedgehog_none_is_lolcats():
    # routing none + Hedgehog maps + gate off == lolcats with gamma = 1
    C, L = 4, 3 * 4 + 17
    q, k, v, x, rng = make(L, seed=12)
    p = R.init_still_params(H, D, DM, rng, F=6)
    pl = {"hq_W": p["hq_W"], "hk_W": p["hk_W"], "w": np.full(H, 50.0)}
    assert R.sigmoid(50.0) == 1.0
    ref = R.lolcats_attn(q, k, v, pl, C)
    y = R.still_attn(q, k, v, x, p, C=C, m=0, routing="none", feature_map="hedgehog", gate=False)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    # a saturated gate (Wg = 0, bg = 40 -> sigma = 1.0 exactly) is the same
    p2 = dict(p, bg=np.full(H * D, 40.0))
    y2 = R.still_attn(q, k, v, x, p2, C=C, m=0, routing="none", feature_map="hedgehog")
    np.testing.assert_allclose(y2, ref, rtol=1e-12, atol=1e-12)


def test_still_reassembled_from_sets():
    # recompute the output formula from the returned sets with dense matrices
    C, L = 4, 3 * 4 + 17
    q, k, v, x, rng = make(L, seed=13)
    p = R.init_still_params(H, D, DM, rng)
    p["Wg"] = rng.standard_normal(p["Wg"].shape) * 0.3
    for per_kv in (False, True):
        y, s = R.still_attn(q, k, v, x, p, C=C, m=2 * C + 5, n_ctx=4 * C, lam=2,
                            per_kv_head=per_kv, return_sets=True)
        G = H // HK
        g = 1 / (1 + np.exp(-(x @ p["Wg"].T + p["bg"]))).reshape(L, H, D)
        for h in range(H):
            hs = h // G if per_kv else h
            kv = h // G
            A = np.zeros((L, L), bool)
            Lin = np.zeros((L, L), bool)
            for t in range(L):
                A[t, s["local"][t]] = True
                A[t, s["sel"][t][hs]] = True
                Lin[t, s["lin"][t][hs]] = True
            sc = q[:, h] @ k[:, kv].T / math.sqrt(D)
            sc = np.where(A, sc, -np.inf)
            e = np.exp(sc - sc.max(axis=1, keepdims=True))
            phq = R.npmap(q[:, h], p["q_u"][h], p["q_W"][h])
            phk = R.npmap(k[:, kv], p["k_u"][h], p["k_W"][h])
            kern = (phq @ phk.T) * Lin                       # phq_t . phk_j on Lin(t)
            num = e @ v[:, kv] + g[:, h] * (kern @ v[:, kv])
            den = e.sum(1) + kern.sum(1) + 1e-6
            np.testing.assert_allclose(y[:, h], num / den[:, None], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("routing", R.ROUTINGS)
@pytest.mark.parametrize("per_kv", [False, True])
def test_still_sets_invariants(routing, per_kv):
    C, L = 4, 6 * 4 + 3
    q, k, v, x, rng = make(L, seed=14)
    p = R.init_still_params(H, D, DM, rng)
    cap_slots = 5
    y, s = R.still_attn(q, k, v, x, p, C=C, m=2 * C + cap_slots, n_ctx=64, lam=2,
                        routing=routing, per_kv_head=per_kv, seed=3, return_sets=True)
    Hs = HK if per_kv else H
    assert s["Hs"] == Hs
    lam = 0 if routing == "none" else 2
    assert s["lam"] == lam and s["cap"] == cap_slots
    for hs in range(Hs):
        sizes = [len(c) for c in s["picks"][hs]]
        # (L-1)//C - 1 = 5 leaving chunks; budget 5 with lambda 2 -> 2, 2, 1, 0, 0
        assert len(sizes) == 5
        assert sizes == ([2, 2, 1, 0, 0] if lam else [0] * 5)
        for c, sel in enumerate(s["picks"][hs]):
            assert ((sel >= c * C) & (sel < c * C + C)).all()
            if routing not in ("position", "none") and len(sel):
                sc = s["scores"][:, hs]
                rest = np.setdiff1d(np.arange(c * C, c * C + C), sel)
                # top by score; on ties the lower position wins
                for a in sel:
                    for b in rest:
                        assert sc[a] > sc[b] or (sc[a] == sc[b] and a < b)
    for t in range(L):
        c = t // C
        loc = s["local"][t]
        hist = np.arange(0, max(0, (c - 1) * C))
        assert set(loc) | set(hist) == set(range(t + 1))
        assert not (set(loc) & set(hist))
        for hs in range(Hs):
            sel, lin = set(s["sel"][t][hs]), set(s["lin"][t][hs])
            assert not (sel & lin), "selected tokens must not be in S/z"
            assert sel | lin == set(hist)
            assert len(sel) <= cap_slots
            if t + 1 < L:
                assert sel <= set(s["sel"][t + 1][hs]), "never evicted"
    assert np.isfinite(y).all()


def test_position_offsets():
    assert list(R.position_offsets(6, 64)) == [5, 16, 26, 37, 48, 58]
    assert list(R.position_offsets(8, 8)) == list(range(8))
    assert list(R.position_offsets(1, 8)) == [4]
    assert list(R.position_offsets(2, 4)) == [1, 3]


def test_random_routing_seeded():
    C, L = 4, 30
    q, k, v, x, rng = make(L, seed=15)
    p = R.init_still_params(H, D, DM, rng)
    kw = dict(C=C, m=0, lam=1, routing="random", return_sets=True)
    _, a = R.still_attn(q, k, v, x, p, seed=7, **kw)
    _, b = R.still_attn(q, k, v, x, p, seed=7, **kw)
    _, c = R.still_attn(q, k, v, x, p, seed=8, **kw)
    pa = [list(map(list, h)) for h in a["picks"]]
    assert pa == [list(map(list, h)) for h in b["picks"]]
    assert pa != [list(map(list, h)) for h in c["picks"]]


def test_lambda_derivation():
    assert R.still_lambda(64, 896, 8192) == (6, 768)
    assert R.still_lambda(64, 0, 8192, lam=4) == (4, None)
    assert R.still_lambda(64, 0, 8192) == (4, None)        # C/16
    assert R.still_lambda(64, 896, 8192, routing="none") == (0, 768)
    assert R.still_lambda(64, 256, 8192) == (1, 128)       # 128 // 128
    assert R.still_lambda(64, 896, 1000) == (48, 768)      # T_max = ceil(1000/64) = 16
    with pytest.raises(ValueError):
        R.still_lambda(64, 100, 8192)


@pytest.mark.parametrize("routing", R.ROUTINGS)
def test_still_prefix_consistent(routing):
    # causality / decode == prefill: outputs of a prefix do not depend on later tokens
    C, L = 4, 3 * 4 + 9
    q, k, v, x, rng = make(L, seed=16)
    p = R.init_still_params(H, D, DM, rng)
    p["Wg"] = rng.standard_normal(p["Wg"].shape) * 0.3
    kw = dict(C=C, m=2 * C + 3, n_ctx=8 * C, lam=2, routing=routing, seed=5)
    full = R.still_attn(q, k, v, x, p, **kw)
    for Lp in (1, C + 1, 2 * C, 2 * C + 1, 3 * C + 2, L - 1):
        yp = R.still_attn(q[:Lp], k[:Lp], v[:Lp], x[:Lp], p, **kw)
        np.testing.assert_allclose(yp, full[:Lp], rtol=1e-12, atol=1e-13)


def test_per_kv_head_equivalences():
    C, L = 4, 3 * 4 + 9
    # G = 1: per KV head == per query head
    q, k, v, x, rng = make(L, seed=17, H=2, Hk=2)
    p = R.init_still_params(2, D, DM, rng)
    a = R.still_attn(q, k, v, x, p, C=C, m=0, lam=1)
    b = R.still_attn(q, k, v, x, p, C=C, m=0, lam=1, per_kv_head=True)
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
    # G = 2 with identical query heads inside a group: summed score ranks the same
    q, k, v, x, rng = make(L, seed=18)
    q[:, 1] = q[:, 0]
    q[:, 3] = q[:, 2]
    p = R.init_still_params(H, D, DM, rng)
    for key in ("q_u", "q_W", "k_u", "k_W"):
        p[key][1] = p[key][0]
        p[key][3] = p[key][2]
    for routing in ("saliency", "qk", "keynorm"):
        a = R.still_attn(q, k, v, x, p, C=C, m=0, lam=1, routing=routing)
        b = R.still_attn(q, k, v, x, p, C=C, m=0, lam=1, routing=routing, per_kv_head=True)
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


# ---------------------------------------------------------------- saliency

def test_saliency_explicit_vs_closed_form():
    C = 8
    eps = 1e-8
    for scale in (0.5, 1.0, 4.0, 20.0):
        q, k, _, _, _ = make(40, seed=int(scale * 10), scale=scale)
        ex = R.self_saliency(q, k, C)
        cf = R.saliency_closed_form(q, k, C)
        np.testing.assert_allclose(ex, cf, rtol=1e-9, atol=1e-14)
        # j = 0: window {0}, a^nodiag := 0
        np.testing.assert_allclose(ex[0], math.log((1 + eps) / eps), rtol=1e-14)
        # Score_j = f(p) + delta with 0 <= delta <= (|R(j)| - 1) eps p
        p = R.saliency_p(q, k, C)
        delta = ex - R.saliency_of_p(p)
        nwin = np.minimum(np.arange(40) + 1, C)[:, None] - 1
        assert (delta >= -1e-13).all()
        assert (delta <= nwin * eps * p + 1e-13).all()


def test_saliency_of_p_monotone():
    p = np.concatenate([np.geomspace(1e-8, 0.5, 4000), 1 - np.geomspace(0.5, 1e-12, 4000)[1:]])
    f = R.saliency_of_p(p)
    assert (np.diff(f) > 0).all()
    # and it really decreases below ~0.763 eps (the spec's "over the range that matters")
    lo = np.geomspace(1e-12, 7e-9, 200)
    assert (np.diff(R.saliency_of_p(lo)) < 0).all()


def _top_by(score, C, n_chunks, lam):
    out = []
    for c in range(n_chunks):
        idx = list(range(c * C, c * C + C))
        out.append(sorted(sorted(idx, key=lambda j: (-score[j], j))[:lam]))
    return out


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0, 3.0])
def test_saliency_rank_by_p_selects_same(scale):
    # The fast path "rank by p = a^diag_j" vs the explicit formula on random
    # inputs (D = 16, C = 8, lambda 1..4; logits q.k/sqrt(D) have std 4 scale^2).
    # Up to scale 2 the selections are identical.  At scale 3 they can differ,
    # but only in chunks where the selection boundary falls among tokens whose
    # p is below 1e-7 (fewer than lambda tokens attend to themselves at all).
    C, L = 8, 8 * 12
    q, k, _, _, _ = make(L, seed=100 + int(scale * 10), scale=scale, D=16)
    ex = R.self_saliency(q, k, C)
    p = R.saliency_p(q, k, C)
    n_diff = 0
    for h in range(H):
        for lam in (1, 2, 4):
            a = _top_by(ex[:, h], C, L // C, lam)
            b = _top_by(p[:, h], C, L // C, lam)
            for c in range(L // C):
                if a[c] != b[c]:
                    n_diff += 1
                    assert np.sort(p[c * C:(c + 1) * C, h])[::-1][lam - 1] < 1e-7
    if scale <= 2.0:
        assert n_diff == 0


def test_saliency_order_violations_only_below_eps():
    # Exact monotonicity in p does NOT hold: the explicit score carries O(eps)
    # terms that depend on the rest of the window, and f(p) decreases for
    # p < 0.763 eps.  Check that every pairwise order disagreement between p
    # and the explicit score involves a token with p below 1e-7.
    C, L = 8, 8 * 12
    n_viol = 0
    for scale in (5.0, 10.0, 30.0):
        q, k, _, _, _ = make(L, seed=int(scale), scale=scale, D=16)
        ex = R.self_saliency(q, k, C)
        p = R.saliency_p(q, k, C)
        for h in range(H):
            dp = p[:, h][:, None] - p[:, h][None, :]
            ds = ex[:, h][:, None] - ex[:, h][None, :]
            bad = (dp * ds) < 0
            n_viol += bad.sum() // 2
            pmin = np.minimum(p[:, h][:, None], p[:, h][None, :])
            assert (pmin[bad] < 1e-7).all()
    assert n_viol > 0   # documents that the ordering is not exactly monotone


# ---------------------------------------------------------------- finiteness

@pytest.mark.parametrize("C", [4, 8])
def test_all_lengths_finite(C):
    Lmax = 3 * C + 17
    qa, ka, va, xa, rng = make(Lmax, seed=C, scale=3.0)
    qn = rng.standard_normal(qa.shape) * 3
    kn = rng.standard_normal(ka.shape) * 3
    ps = R.init_still_params(H, D, DM, rng, F=6)
    pl = R.init_lolcats_params(H, D, 6, rng)
    variants = [
        dict(m=2 * C + 5, n_ctx=2 * C),                 # derived lambda, capped
        dict(m=0, lam=2, routing="random"),
        dict(m=0, lam=2, routing="keynorm", per_kv_head=True),
        dict(m=0, lam=2, routing="qk", feature_map="hedgehog"),
        dict(m=0, lam=3, routing="position", gate=False),
        dict(m=0, lam=2, routing="none", linear=False),
    ]
    for L in range(1, Lmax + 1):
        q, k, v, x = qa[:L], ka[:L], va[:L], xa[:L]
        outs = [R.softmax_attn(q, k, v), R.swa_attn(q, k, v, 5),
                R.lolcats_attn(q, k, v, pl, C),
                R.liger_attn(qn[:L], kn[:L], q, k, v, window=6)]
        outs += [R.still_attn(q, k, v, x, ps, C=C, **kw) for kw in variants]
        for y in outs:
            assert y.shape == (L, H, D)
            assert np.isfinite(y).all()


def test_still_short_is_softmax():
    # L <= 2C: Hist(t) is empty, A(t) = Local(t) = {0..t} for every config
    C = 8
    q, k, v, x, rng = make(2 * C, seed=19)
    p = R.init_still_params(H, D, DM, rng)
    full = R.softmax_attn(q, k, v)
    for kw in (dict(), dict(per_kv_head=True), dict(feature_map="hedgehog", routing="qk")):
        y = R.still_attn(q, k, v, x, p, C=C, eps=0.0, **kw)
        np.testing.assert_allclose(y, full, rtol=1e-12, atol=1e-12)


def test_ties_lower_position_first():
    # keynorm with every ||k_j|| exactly equal (entries +-1): all scores tie,
    # so each leaving chunk selects its first lambda positions
    C, L = 4, 5 * 4 + 1
    q, _, v, x, rng = make(L, seed=20)
    k = rng.choice([-1.0, 1.0], size=(L, HK, D))
    p = R.init_still_params(H, D, DM, rng)
    _, s = R.still_attn(q, k, v, x, p, C=C, m=0, lam=2, routing="keynorm", return_sets=True)
    assert np.all(s["scores"] == s["scores"][0, 0])
    for hs in range(H):
        assert [list(c) for c in s["picks"][hs]] == [[c * C, c * C + 1] for c in range(4)]
