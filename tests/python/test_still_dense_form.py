"""The dense form of a still layer that the GPU fine-tune runs (cuda/train/train_lm_still.cu, src/train/train_lm_cuda.c), in
float64 numpy, against the reference (ref_attention.still_attn, written token by token from the spec) and its own
backward against central finite differences.

The dense form records the routing as one number per selection head and key, out[hs][j] = the first query chunk
from which key j is no longer in the softmax part (never: a large number), and then per query head
    E = exp(s Q K^T - m) on soft(t, j) = (j <= t and c(t) < out[j]),   L = phi_q phi_k^T on lin(t, j) = c(t) >= out[j]
    y = (E V + g * L V) / (rowsum E + rowsum L + eps)       (gate_den: rowsum E + g * rowsum L + eps)
This file checks that the rule for out reproduces chunk selection and global selection with evictions (the tokens
pushed out of Sel fold into the linear state), that the outputs are the reference's, and that the backward the
kernels implement (the maximum's share, the masks, the NP-Map's backward, the gate) is the gradient of that form.
"""

import math

import numpy as np
import pytest

import ref_attention as ref

NEVER = 1 << 30


def dense_route(scores, L, C, select, lam, cap):
    """out (Hs, L) by the kernels' rule (route_global_kernel, route_chunk_kernel)."""
    Hs = scores.shape[1]
    nc = -(-L // C)
    out = np.full((Hs, L), NEVER, dtype=np.int64)
    better = lambda hs, i, j: scores[i, hs] > scores[j, hs] or (scores[i, hs] == scores[j, hs] and i < j)
    for hs in range(Hs):
        if select == "global":
            for j in range((nc - 2) * C if nc > 2 else 0):
                for cq in range(j // C + 2, nc):
                    rank = sum(better(hs, i, j) for i in range((cq - 1) * C))   # chunks <= cq - 2
                    if rank >= cap:
                        out[hs, j] = cq
                        break
        else:
            used = 0
            for c in range(nc - 2):
                n = min(lam, C) if cap is None else max(0, min(lam, C, cap - used))
                for j in range(c * C, c * C + C):
                    rank = sum(better(hs, i, j) for i in range(c * C, c * C + C))
                    out[hs, j] = NEVER if rank < n else c + 2
                used += n
    return out


def masks(out_row, L, C):
    t = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    soft = (j <= t) & ((t // C) < out_row[None, :])
    lin = (t // C) >= out_row[None, :]
    return soft, lin


def npmap_parts(x, u, W):
    """The NP-Map's forward with what its backward needs (rows x: (n, D))."""
    uu = u @ u
    f = 2 * (x @ u) / uu if uu > 0 else np.zeros(len(x))
    xt = x - f[:, None] * u
    z0 = xt @ W.T
    nx = np.linalg.norm(x, axis=1)
    nz = np.linalg.norm(z0, axis=1)
    sc = nx / np.maximum(nz, ref.NORM_FLOOR)
    z = z0 * sc[:, None]
    a1 = ref._softmax_last(z)
    a2 = ref._softmax_last(-z)
    phi = np.maximum(np.concatenate([a1, a2], axis=1), ref.FMAP_CLAMP)
    return phi, dict(x=x, u=u, W=W, uu=uu, z0=z0, nx=nx, nz=nz, sc=sc, a1=a1, a2=a2)


def hedgehog_parts(x, W):
    """lolcats' Hedgehog map z = x W (no norm, no reflection) with what its backward needs."""
    z = x @ W
    a1 = ref._softmax_last(z)
    a2 = ref._softmax_last(-z)
    phi = np.maximum(np.concatenate([a1, a2], axis=1), ref.FMAP_CLAMP)
    return phi, dict(hedgehog=True, W=W, a1=a1, a2=a2, D=W.shape[1])


def npmap_bwd(p, dphi):
    """npmap_bwd_kernel's formulas: dx from dphi (Hedgehog: dx = dz Wᵀ)."""
    if p.get("hedgehog"):
        F = p["D"]
        g1 = np.where(p["a1"] < ref.FMAP_CLAMP, 0.0, dphi[:, :F])
        g2 = np.where(p["a2"] < ref.FMAP_CLAMP, 0.0, dphi[:, F:])
        dz = p["a1"] * (g1 - (p["a1"] * g1).sum(1, keepdims=True)) - p["a2"] * (g2 - (p["a2"] * g2).sum(1, keepdims=True))
        return dz @ p["W"].T
    D = p["x"].shape[1]
    g1 = np.where(p["a1"] < ref.FMAP_CLAMP, 0.0, dphi[:, :D])
    g2 = np.where(p["a2"] < ref.FMAP_CLAMP, 0.0, dphi[:, D:])
    d1 = (p["a1"] * g1).sum(1, keepdims=True)
    d2 = (p["a2"] * g2).sum(1, keepdims=True)
    dz = p["a1"] * (g1 - d1) - p["a2"] * (g2 - d2)
    zd = (p["z0"] * dz).sum(1)
    fl = np.maximum(p["nz"], ref.NORM_FLOOR)
    pr = np.where(p["nz"] > ref.NORM_FLOOR, zd / (p["nz"] ** 2), 0.0)
    dz0 = p["sc"][:, None] * (dz - p["z0"] * pr[:, None])
    dxt = dz0 @ p["W"]
    fu = 2 * (dxt @ p["u"]) / p["uu"] if p["uu"] > 0 else np.zeros(len(dxt))
    fx = np.where(p["nx"] > 0, (zd / fl) / np.where(p["nx"] > 0, p["nx"], 1), 0.0)
    return dxt - fu[:, None] * p["u"] + fx[:, None] * p["x"]


def dense_forward(q, k, v, x, params, out, C, per_kv_head, linear, gate, gate_den, keep=False, lolcats=False):
    """lolcats: E scaled by gamma = sigmoid(w) per head, Hedgehog maps, no gate (out: every key folds at c + 2)."""
    L, H, D = q.shape
    Hk = k.shape[1]
    G = H // Hk
    scale = 1 / math.sqrt(D)
    g = ref.sigmoid(x @ params["Wg"].T + params["bg"]).reshape(L, H, D) if (linear and gate) else np.ones((L, H, D))
    y = np.zeros((L, H, D))
    saved = []
    for h in range(H):
        kv = h // G
        hs = kv if per_kv_head else h
        soft, lin = masks(out[hs], L, C)
        S = scale * q[:, h] @ k[:, kv].T
        Sm = np.where(soft, S, -np.inf)
        m = Sm.max(1)
        am = Sm.argmax(1)   # the lowest index among equal maxima, as mask_soft_kernel
        E = np.where(soft, np.exp(S - m[:, None]), 0.0)
        if lolcats:
            E = E * ref.sigmoid(params["w"][h])
        l = E.sum(1)
        num = E @ v[:, kv]
        a = np.zeros((L, D))
        b = np.zeros(L)
        pq = pk = None
        Lm = np.zeros((L, L))
        if linear and lolcats:
            phq, pq = hedgehog_parts(q[:, h], params["hq_W"][h])
            phk, pk = hedgehog_parts(k[:, kv], params["hk_W"][h])
        elif linear:
            phq, pq = npmap_parts(q[:, h], params["q_u"][h], params["q_W"][h])
            phk, pk = npmap_parts(k[:, kv], params["k_u"][h], params["k_W"][h])
        if linear:
            Lm = np.where(lin, phq @ phk.T, 0.0)
            b = Lm.sum(1)
            a = Lm @ v[:, kv]
        gh = g[:, h]
        den = l[:, None] + (gh * b[:, None] if gate_den else b[:, None]) + ref.DEN_EPS
        y[:, h] = (num + gh * a) / den
        saved.append(dict(E=E, l=l, am=am, Lm=Lm, a=a, b=b, pq=pq, pk=pk, phq=phq if linear else None,
                          phk=phk if linear else None, g=gh))
    return (y, g, saved) if keep else y


def dense_backward(q, k, v, x, params, out, C, per_kv_head, linear, gate, gate_den, dy, lolcats=False):
    """The kernels' backward, step by step (still_attn_backward in src/train/train_lm_cuda.c)."""
    L, H, D = q.shape
    Hk = k.shape[1]
    G = H // Hk
    scale = 1 / math.sqrt(D)
    y, g, saved = dense_forward(q, k, v, x, params, out, C, per_kv_head, linear, gate, gate_den, keep=True,
                                lolcats=lolcats)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dpre = np.zeros((L, H, D))
    for h in range(H):
        kv = h // G
        hs = kv if per_kv_head else h
        sv = saved[h]
        soft, lin = masks(out[hs], L, C)
        gh, a, b, l = sv["g"], sv["a"], sv["b"], sv["l"]
        den = l[:, None] + (gh * b[:, None] if gate_den else b[:, None]) + ref.DEN_EPS
        dN = dy[:, h] / den
        dd = -dN * y[:, h]
        dl = dd.sum(1)
        db = (dd * gh).sum(1) if gate_den else dl
        dA = dN * gh
        if linear and gate:
            dpre[:, h] = (dN * a + (dd * b[:, None] if gate_den else 0.0)) * gh * (1 - gh)
        E = sv["E"]
        dv[:, kv] += E.T @ dN
        dS = E * (dN @ v[:, kv].T + dl[:, None])
        dS[np.arange(L), sv["am"]] -= dS.sum(1)
        dq[:, h] += scale * dS @ k[:, kv]
        dk[:, kv] += scale * dS.T @ q[:, h]
        if linear:
            dv[:, kv] += sv["Lm"].T @ dA
            dL = np.where(lin, dA @ v[:, kv].T + db[:, None], 0.0)
            dq[:, h] += npmap_bwd(sv["pq"], dL @ sv["phk"])
            dk[:, kv] += npmap_bwd(sv["pk"], dL.T @ sv["phq"])
    dx = dpre.reshape(L, H * D) @ params["Wg"] if (linear and gate) else np.zeros_like(x)
    return dq, dk, dv, dx


def make(L, H, Hk, D, d, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((L, H, D)) * 1.5
    k = rng.standard_normal((L, Hk, D)) * 1.5
    v = rng.standard_normal((L, Hk, D))
    x = rng.standard_normal((L, d))
    p = ref.init_still_params(H, D, d, rng)
    p["Wg"] = rng.standard_normal((H * D, d)) * 0.3   # a gate that depends on x
    p["bg"] = rng.standard_normal(H * D) * 0.5
    return q, k, v, x, p


CASES = [
    # select, m, lam, per_kv_head, linear, gate_den
    ("global", 64, None, True, True, True),     # cap 32 of 6 leaving chunks of 16: evictions
    ("global", 64, None, False, True, False),
    ("global", 48, None, True, False, False),   # cap 16, linear off: evicted tokens are dropped
    ("chunk", 96, 3, True, True, False),        # cap 64: the fifth leaving chunk is cut, the sixth folds whole
    ("chunk", 0, 2, False, True, True),         # uncapped
]


@pytest.mark.parametrize("select,m,lam,per_kv,linear,gate_den", CASES)
def test_dense_form_is_the_reference(select, m, lam, per_kv, linear, gate_den):
    L, H, Hk, D, d, C = 130, 4, 2, 8, 12, 16
    q, k, v, x, p = make(L, H, Hk, D, d, 7)
    y_ref, sets = ref.still_attn(q, k, v, x, p, C=C, m=m, n_ctx=256, lam=lam, per_kv_head=per_kv, linear=linear,
                                 gate=True, select=select, gate_den=gate_den, return_sets=True)
    lam_eff, cap = sets["lam"], sets["cap"]
    out = dense_route(sets["scores"], L, C, select, lam_eff, cap)
    # the routing itself: per query chunk, Sel and the linear set are the reference's
    for t in range(0, L, C):
        for hs in range(sets["Hs"]):
            soft, lin = masks(out[hs], L, C)
            local = set(sets["local"][t].tolist())
            assert set(np.nonzero(soft[t])[0].tolist()) - local == set(sets["sel"][t][hs].tolist())
            assert set(np.nonzero(lin[t])[0].tolist()) == set(sets["lin"][t][hs].tolist())
    if select == "global":   # the case is what it says: something was evicted
        assert any((out[hs] < NEVER).any() and (out[hs][out[hs] < NEVER] > np.arange(L)[out[hs] < NEVER] // C + 2).any()
                   for hs in range(sets["Hs"]))
    y = dense_forward(q, k, v, x, p, out, C, per_kv, linear, True, gate_den)
    assert np.max(np.abs(y - y_ref)) < 1e-12 * max(1.0, np.max(np.abs(y_ref)))


@pytest.mark.parametrize("select,m,lam,per_kv,linear,gate_den", CASES)
def test_dense_backward_finite_differences(select, m, lam, per_kv, linear, gate_den):
    L, H, Hk, D, d, C = 90, 4, 2, 8, 12, 16
    q, k, v, x, p = make(L, H, Hk, D, d, 11)
    lam_eff, cap = ref.still_lambda(C, m, 256, lam)
    scores = ref.routing_scores(q, k, C, "saliency", per_kv)
    out = dense_route(scores, L, C, select, lam_eff, 16 if select == "global" else cap)
    rng = np.random.default_rng(3)
    dy = rng.standard_normal((L, H, D))
    grads = dense_backward(q, k, v, x, p, out, C, per_kv, linear, True, gate_den, dy)
    loss = lambda q_, k_, v_, x_: np.sum(dy * dense_forward(q_, k_, v_, x_, p, out, C, per_kv, linear, True, gate_den))
    for i, (name, arr) in enumerate((("q", q), ("k", k), ("v", v), ("x", x))):
        u = rng.standard_normal(arr.shape)
        eps = 1e-6
        args_p = [q, k, v, x]
        args_m = [q, k, v, x]
        args_p[i] = arr + eps * u
        args_m[i] = arr - eps * u
        fd = (loss(*args_p) - loss(*args_m)) / (2 * eps)
        an = np.sum(grads[i] * u)
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), (name, fd, an)


def lolcats_route(L, C, rows):
    """lolcats as the dense form: no selection, every key folds when it leaves Local (the same row for all heads)."""
    j = np.arange(L)
    return np.repeat(np.where(j // C + 2 < -(-L // C), j // C + 2, NEVER)[None, :], rows, axis=0)


def make_lolcats(L, H, Hk, D, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((L, H, D)) * 1.5
    k = rng.standard_normal((L, Hk, D)) * 1.5
    v = rng.standard_normal((L, Hk, D))
    p = ref.init_lolcats_params(H, D, D, rng)
    p["w"] = rng.standard_normal(H)   # window factors away from their initial value
    return q, k, v, np.zeros((L, 1)), p


def test_dense_form_lolcats():
    L, H, Hk, D, C = 130, 4, 2, 8, 16
    q, k, v, x, p = make_lolcats(L, H, Hk, D, 5)
    y_ref = ref.lolcats_attn(q, k, v, p, C=C)
    y = dense_forward(q, k, v, x, p, lolcats_route(L, C, Hk), C, True, True, False, False, lolcats=True)
    assert np.max(np.abs(y - y_ref)) < 1e-12 * max(1.0, np.max(np.abs(y_ref)))


def test_dense_backward_lolcats():
    L, H, Hk, D, C = 90, 4, 2, 8, 16
    q, k, v, x, p = make_lolcats(L, H, Hk, D, 6)
    out = lolcats_route(L, C, Hk)
    rng = np.random.default_rng(4)
    dy = rng.standard_normal((L, H, D))
    grads = dense_backward(q, k, v, x, p, out, C, True, True, False, False, dy, lolcats=True)
    loss = lambda q_, k_, v_: np.sum(dy * dense_forward(q_, k_, v_, x, p, out, C, True, True, False, False, lolcats=True))
    for i, arr in enumerate((q, k, v)):
        u = rng.standard_normal(arr.shape)
        args_p, args_m = [q, k, v], [q, k, v]
        args_p[i], args_m[i] = arr + 1e-6 * u, arr - 1e-6 * u
        fd = (loss(*args_p) - loss(*args_m)) / 2e-6
        an = np.sum(grads[i] * u)
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), (i, fd, an)
