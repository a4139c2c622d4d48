#!/usr/bin/env python3
"""Slow, obviously-correct float64 numpy reference of the attention kinds of
docs/spec `attention.md` (softmax, swa, lolcats, liger, still + ablations).

Everything is written straight from the formulas, one token and one head at a
time, with explicit index sets.  No chunked / parallel tricks, no online
softmax: this is the independent oracle the C engine is tested against.
Complexity is O(L^2 * H * D) or worse; use short sequences.

Conventions (shared by every function)
--------------------------------------
* q: (L, H, D), k: (L, Hk, D), v: (L, Hk, D) -- AFTER RoPE (except liger's
  q_nope/k_nope, which are the same projections BEFORE RoPE).  Inputs are
  converted to float64.  Output y: (L, H, D) float64 per-head outputs (before
  o_proj).
* GQA: G = H // Hk, query head h uses KV head h // G.
* s_tj = q_t . k_j / sqrt(D); positions start at 0; causal (j <= t).
* Chunk terrace (chunk size C): c(t) = t // C,
      Local(t) = { max(0, (c(t)-1) C) .. t }        (current chunk causally +
                                                      the whole previous one)
      Hist(t)  = { 0 .. (c(t)-1) C - 1 }             (chunks <= c(t) - 2)
* Sliding window of size W: t - W < j <= t (W keys including t itself).
* Feature maps are per QUERY head, for q and for k separately: head h's
  k-map is applied to k of KV head h // G (the reference code repeats KV heads
  before the feature map).  So the linear state S, z is per query head.
* sigma(x) = 1 / (1 + exp(-x)).

Parameters (dicts of numpy arrays)
----------------------------------
lolcats  : hq_W (H, D, F), hk_W (H, D, F)  Hedgehog maps phi(x) uses x @ W
           w    (H,)                       window factor gamma = sigma(w)
still    : q_u, k_u (H, D)                 NP-Map Householder vectors
           q_W, k_W (H, D, D)              NP-Map matrices, z = W @ x~ (W acts
                                           on the column vector x~, i.e. row i
                                           of W produces z_i)
           Wg (H*D, d), bg (H*D,)          gate, g_t = sigma(Wg @ x_t + bg),
                                           reshaped (H, D): head h gets entries
                                           h*D .. h*D+D-1
           hq_W, hk_W (H, D, F)            only for feature_map='hedgehog'

Interpretations where the spec is silent/ambiguous (all also listed in the
docstrings below)
---------------------------------------------------------------------------
1. Hedgehog phi(x) = [softmax(x W) (+) softmax(-x W)] (row vector x times W),
   NP-Map z = W x~ (matrix times column vector), literally as written.
2. kaiming-uniform = torch.nn.init.kaiming_uniform_ defaults (a=0, fan_in,
   leaky_relu gain sqrt(2)) applied to the stacked per-head tensor (H, D, F) as
   the LoLCATs code does: torch's fan_in of a 3-D tensor is D*F, so the bound
   is sqrt(6 / (D*F)).  (NP-Map is invariant to the scale of W anyway.)
3. The 1e-6 denominator term is kept in every variant (also linear=False and
   routing='none'); `eps` can be set to 0 to test exact identities.
4. Budget: Sel holds at most m - 2C tokens per selection head; a leaving chunk
   contributes n = min(lambda, C, slots_left) tokens (so the last chunk that
   fits may be partially selected); once slots_left == 0 every token of a
   leaving chunk goes to S, z.  m = 0 means uncapped.
5. lambda: explicit `lam` wins; else m > 0 -> floor((m - 2C) / ceil(n_ctx / C));
   else (m == 0) -> C // 16 (the reference code's C/16; 0 for C < 16, so pass
   lam explicitly for small C).  routing='none' forces lambda = 0.
6. Ties in every score ranking: higher score first, then lower position first.
7. Self-saliency at j = 0 (window {0}): a^nodiag is empty, a^nodiag_0 := 0, so
   Score_0 = log((1 + eps) / eps).
8. Selection happens only for chunks that have left Local, i.e. chunk c with
   (c + 2) C <= t; such a chunk is always complete (C tokens), so the final
   partial chunk (and the last complete chunk) are never scored for routing.
9. Per-KV-head selection: for every routing except random, the KV head's score
   is the SUM of its G query heads' scores (for keynorm this is G ||k_j||, same
   ranking); random draws one score per KV head.  The G query heads share the
   selected store; each query head keeps its own S, z (own feature maps).
10. The gate multiplies only the linear numerator; gate=False means g = 1.
"""

from __future__ import annotations

import math

import numpy as np

SAL_EPS = 1e-8      # epsilon of the self-saliency score
DEN_EPS = 1e-6      # epsilon of the lolcats / still denominators
FMAP_CLAMP = 1e-12  # feature-map entries are clamped at >= this
NORM_FLOOR = 1e-12  # NP-Map: z * ||x|| / max(||z||, NORM_FLOOR)

ROUTINGS = ("saliency", "random", "keynorm", "qk", "position", "none")


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------

def _f64(a):
    return np.asarray(a, dtype=np.float64)


def sigmoid(x):
    x = _f64(x)
    return 1.0 / (1.0 + np.exp(-x))


def _softmax_last(z):
    z = _f64(z)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _shapes(q, k, v):
    q, k, v = _f64(q), _f64(k), _f64(v)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError("q, k, v must be (L, heads, D)")
    L, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != L or k.shape[2] != D:
        raise ValueError(f"shape mismatch q{q.shape} k{k.shape} v{v.shape}")
    Hk = k.shape[1]
    if H % Hk:
        raise ValueError("H must be a multiple of Hk")
    return q, k, v, L, H, Hk, D, H // Hk


def _softmax_over(qv, K, V, idx, scale):
    """Plain softmax attention of one query vector over the key rows idx."""
    s = (K[idx] @ qv) * scale
    e = np.exp(s - s.max())
    return (e @ V[idx]) / e.sum()


def chunk_of(t, C):
    return t // C


def local_set(t, C):
    """Local(t): the current chunk causally plus the whole previous chunk."""
    c = t // C
    return np.arange(max(0, (c - 1) * C), t + 1)


def hist_set(t, C):
    """Hist(t): every position of chunks <= c(t) - 2."""
    c = t // C
    return np.arange(0, max(0, (c - 1) * C))


# --------------------------------------------------------------------------
# softmax / swa
# --------------------------------------------------------------------------

def softmax_attn(q, k, v):
    """y_t = sum_{j<=t} softmax_j(s_tj) v_j, per query head."""
    q, k, v, L, H, Hk, D, G = _shapes(q, k, v)
    scale = 1.0 / math.sqrt(D)
    y = np.zeros((L, H, D))
    for h in range(H):
        kv = h // G
        for t in range(L):
            y[t, h] = _softmax_over(q[t, h], k[:, kv], v[:, kv], np.arange(t + 1), scale)
    return y


def swa_attn(q, k, v, W):
    """Softmax restricted to the window t - W < j <= t (W >= 1 keys)."""
    if W < 1:
        raise ValueError("W must be >= 1")
    q, k, v, L, H, Hk, D, G = _shapes(q, k, v)
    scale = 1.0 / math.sqrt(D)
    y = np.zeros((L, H, D))
    for h in range(H):
        kv = h // G
        for t in range(L):
            idx = np.arange(max(0, t - W + 1), t + 1)
            y[t, h] = _softmax_over(q[t, h], k[:, kv], v[:, kv], idx, scale)
    return y


# --------------------------------------------------------------------------
# feature maps
# --------------------------------------------------------------------------

def hedgehog(x, W):
    """Hedgehog map: [softmax(x W) (+) softmax(-x W)], clamped at >= 1e-12.

    x: (..., D), W: (D, F)  ->  (..., 2F).  No bias.
    """
    z = _f64(x) @ _f64(W)
    out = np.concatenate([_softmax_last(z), _softmax_last(-z)], axis=-1)
    return np.maximum(out, FMAP_CLAMP)


def npmap_z(x, u, W):
    """NP-Map steps 1-3 (the pre-softmax vector z), x: (..., D) -> (..., D).

    1. x~ = x - 2 (x . u^) u^,  u^ = u / ||u||      (Householder reflection)
    2. z  = W x~                                    (z_i = sum_k W[i, k] x~_k)
    3. z <- z * ||x|| / max(||z||, 1e-12)
    """
    x, u, W = _f64(x), _f64(u), _f64(W)
    uh = u / np.linalg.norm(u)
    xt = x - 2.0 * (x @ uh)[..., None] * uh
    z = xt @ W.T
    nx = np.linalg.norm(x, axis=-1, keepdims=True)
    nz = np.linalg.norm(z, axis=-1, keepdims=True)
    return z * nx / np.maximum(nz, NORM_FLOOR)


def npmap(x, u, W):
    """NP-Map: phi(x) = [softmax(z) (+) softmax(-z)] clamped at >= 1e-12,
    z = npmap_z(x, u, W).  x: (..., D), u: (D,), W: (D, D) -> (..., 2D)."""
    z = npmap_z(x, u, W)
    out = np.concatenate([_softmax_last(z), _softmax_last(-z)], axis=-1)
    return np.maximum(out, FMAP_CLAMP)


# --------------------------------------------------------------------------
# parameter initialisation
# --------------------------------------------------------------------------

def _kaiming_uniform(shape, rng):
    """torch.nn.init.kaiming_uniform_ defaults (a=0, mode fan_in, leaky_relu):
    bound = sqrt(6 / fan_in), torch fan_in = shape[1] * prod(shape[2:])."""
    fan_in = shape[1] * int(np.prod(shape[2:]))
    b = math.sqrt(6.0 / fan_in)
    return rng.uniform(-b, b, size=shape)


def init_lolcats_params(H, D, F, rng):
    """Hedgehog maps per head for q and k (kaiming-uniform, no bias) and the
    window factor logit w = -2.197 (gamma = sigma(w) ~= 0.1)."""
    return {
        "hq_W": _kaiming_uniform((H, D, F), rng),
        "hk_W": _kaiming_uniform((H, D, F), rng),
        "w": np.full(H, -2.197),
    }


def init_still_params(H, D, d, rng, F=None):
    """NP-Map q/k per query head (u ~ N(0, 1), W kaiming-uniform), open gate
    (Wg = 0, bg = +2), plus Hedgehog maps (F defaults to D) for the
    feature_map='hedgehog' ablation."""
    F = D if F is None else F
    return {
        "q_u": rng.standard_normal((H, D)),
        "q_W": _kaiming_uniform((H, D, D), rng),
        "k_u": rng.standard_normal((H, D)),
        "k_W": _kaiming_uniform((H, D, D), rng),
        "Wg": np.zeros((H * D, d)),
        "bg": np.full(H * D, 2.0),
        "hq_W": _kaiming_uniform((H, D, F), rng),
        "hk_W": _kaiming_uniform((H, D, F), rng),
    }


# --------------------------------------------------------------------------
# lolcats
# --------------------------------------------------------------------------

def lolcats_attn(q, k, v, params, C=64, eps=DEN_EPS):
    """LoLCATs: windowed softmax over Local(t) (scaled by gamma = sigma(w))
    + Hedgehog linear attention over Hist(t); linear terms NOT rescaled by
    e^{-m_t}; m_t = max over Local(t).

        y_t = (g sum_Local e^{s-m} v + phq^T sum_Hist phk v^T)
              / (g sum_Local e^{s-m} + phq^T sum_Hist phk + eps)
    """
    q, k, v, L, H, Hk, D, G = _shapes(q, k, v)
    scale = 1.0 / math.sqrt(D)
    y = np.zeros((L, H, D))
    for h in range(H):
        kv = h // G
        K, V = k[:, kv], v[:, kv]
        gamma = float(sigmoid(_f64(params["w"])[h]))
        phq = hedgehog(q[:, h], params["hq_W"][h])
        phk = hedgehog(K, params["hk_W"][h])
        for t in range(L):
            loc, hist = local_set(t, C), hist_set(t, C)
            s = (K[loc] @ q[t, h]) * scale
            e = np.exp(s - s.max())
            S = phk[hist].T @ V[hist]          # (2F, D) = sum_j phk_j v_j^T
            z = phk[hist].sum(axis=0)          # (2F,)
            num = gamma * (e @ V[loc]) + phq[t] @ S
            den = gamma * e.sum() + phq[t] @ z + eps
            y[t, h] = num / den
    return y


# --------------------------------------------------------------------------
# liger
# --------------------------------------------------------------------------

def liger_attn(q_nope, k_nope, q, k, v, window=64):
    """Liger: y = 0.5 o_swa + 0.5 o_lin.

    o_swa: softmax over t - window < j <= t using the RoPE'd q, k.
    o_lin: phi = softmax over the D channels of the PRE-RoPE q / k;
           alpha_t = sigma(k_nope_t) ** (1/16) (per channel, per KV head);
           S_t = diag(alpha_t) S_{t-1} + phi(k_t) v_t^T,  o_lin = phi(q_t)^T S_t
           (no denominator, S_{-1} = 0).
    """
    q_nope, k_nope = _f64(q_nope), _f64(k_nope)
    q, k, v, L, H, Hk, D, G = _shapes(q, k, v)
    if q_nope.shape != q.shape or k_nope.shape != k.shape:
        raise ValueError("q_nope/k_nope must have the shapes of q/k")
    o_swa = swa_attn(q, k, v, window)
    o_lin = np.zeros((L, H, D))
    for h in range(H):
        kv = h // G
        S = np.zeros((D, D))
        for t in range(L):
            alpha = sigmoid(k_nope[t, kv]) ** (1.0 / 16.0)
            phk = _softmax_last(k_nope[t, kv])
            phq = _softmax_last(q_nope[t, h])
            S = alpha[:, None] * S + np.outer(phk, v[t, kv])
            o_lin[t, h] = phq @ S
    return 0.5 * o_swa + 0.5 * o_lin


# --------------------------------------------------------------------------
# still: routing scores
# --------------------------------------------------------------------------

def saliency_window(j, C):
    """R(j) = { max(0, j - C + 1) .. j }."""
    return np.arange(max(0, j - C + 1), j + 1)


def self_saliency(q, k, C, eps=SAL_EPS):
    """Explicit self-saliency score, per query head: (L, H).

    For token j, head h (KV head h // G), over R(j):
      a^diag_l   = softmax_{l in R(j)} (q_j . k_l / sqrt(D))
      a^nodiag_l = softmax over R(j) \\ {j};  a^nodiag_j := 0
                   (R(j) = {j}, i.e. j = 0: a^nodiag is all zero)
      Score_j    = sum_{l in R(j)} a^diag_l log((a^diag_l + eps)/(a^nodiag_l + eps))
    """
    q, k = _f64(q), _f64(k)
    L, H, D = q.shape
    G = H // k.shape[1]
    scale = 1.0 / math.sqrt(D)
    out = np.zeros((L, H))
    for h in range(H):
        kv = h // G
        for j in range(L):
            R = saliency_window(j, C)
            s = (k[R, kv] @ q[j, h]) * scale
            a_diag = _softmax_last(s)
            a_nodiag = np.zeros_like(a_diag)
            if len(R) > 1:
                a_nodiag[:-1] = _softmax_last(s[:-1])
            out[j, h] = np.sum(a_diag * np.log((a_diag + eps) / (a_nodiag + eps)))
    return out


def saliency_adiag(q, k, C):
    """List over heads h of lists over j of a^diag over R(j) (self last)."""
    q, k = _f64(q), _f64(k)
    L, H, D = q.shape
    G = H // k.shape[1]
    scale = 1.0 / math.sqrt(D)
    return [[_softmax_last((k[saliency_window(j, C), h // G] @ q[j, h]) * scale)
             for j in range(L)] for h in range(H)]


def saliency_p(q, k, C):
    """p_j = a^diag_j, the token's self-attention weight in R(j): (L, H)."""
    ad = saliency_adiag(q, k, C)
    return np.array([[ad[h][j][-1] for h in range(len(ad))] for j in range(len(ad[0]))])


def saliency_closed_form(q, k, C, eps=SAL_EPS):
    """Score written with a^nodiag_l = a^diag_l / (1 - p) (l != j), p = a^diag_j:
        Score_j = p log((p+eps)/eps)
                  + sum_{l != j} a_l log((a_l + eps) / (a_l / (1 - p) + eps))
    (terms with a_l = 0 are 0; p = 1 leaves only the first term).  Algebraically
    identical to self_saliency; (L, H)."""
    ad = saliency_adiag(q, k, C)
    H, L = len(ad), len(ad[0])
    out = np.zeros((L, H))
    for h in range(H):
        for j in range(L):
            a = ad[h][j]
            p, rest = a[-1], a[:-1]
            sc = p * math.log((p + eps) / eps)
            if p < 1.0:
                nz = rest[rest > 0]
                sc += np.sum(nz * np.log((nz + eps) / (nz / (1.0 - p) + eps)))
            out[j, h] = sc
    return out


def saliency_of_p(p, eps=SAL_EPS):
    """The score with eps -> 0 inside the sum over l != j only:
        f(p) = p log((p + eps) / eps) + (1 - p) log(1 - p),
    a pure function of p = a^diag_j.  f'(p) = log((p+eps)/eps) + p/(p+eps)
    - log(1-p) - 1 is negative only for p below about 0.763 eps (f has its
    minimum there) and positive above: f is increasing "over the range that
    matters".  The explicit score differs from f(p) by O(eps) terms that depend
    on the other weights of the window."""
    p = _f64(p)
    pc = np.minimum(p, np.nextafter(1.0, 0.0))
    return p * np.log((p + eps) / eps) + (1.0 - p) * np.log1p(-pc)


def qk_received(q, k, C):
    """'qk' routing score, per query head: (L, H).

    Score_j = mean over the queries i whose window R(i) contains j, i.e.
    i in { j .. min(j + C - 1, L - 1) }, of q_i . k_j / sqrt(D) ("mean q.k
    received inside the window").  For every chunk that is actually routed the
    C queries j .. j+C-1 all exist and precede the selection point, so the
    clipping at L - 1 never matters for routing.
    """
    q, k = _f64(q), _f64(k)
    L, H, D = q.shape
    G = H // k.shape[1]
    scale = 1.0 / math.sqrt(D)
    out = np.zeros((L, H))
    for h in range(H):
        for j in range(L):
            I = np.arange(j, min(j + C, L))
            out[j, h] = np.mean(q[I, h] @ k[j, h // G]) * scale
    return out


def keynorm_scores(k, H):
    """'keynorm' routing score per query head: ||k_j|| of its KV head: (L, H)."""
    k = _f64(k)
    G = H // k.shape[1]
    return np.stack([np.linalg.norm(k[:, h // G], axis=-1) for h in range(H)], axis=1)


def routing_scores(q, k, C, routing, per_kv_head=False, seed=0):
    """Scores (L, Hs) used to rank tokens, Hs = Hk if per_kv_head else H.

    saliency : self_saliency (explicit formula)
    qk       : qk_received
    keynorm  : ||k_j||
    random   : np.random.default_rng(seed).random((L, Hs)) (i.i.d. U[0,1),
               row-major, so a prefix of the sequence sees the same scores)
    position : None (selection is by position, see position_offsets)
    none     : None (lambda = 0)
    Per KV head (all but random): the sum of the G query heads' scores.
    """
    q, k = _f64(q), _f64(k)
    L, H, _ = q.shape
    Hk = k.shape[1]
    G = H // Hk
    Hs = Hk if per_kv_head else H
    if routing in ("position", "none"):
        return None
    if routing == "random":
        return np.random.default_rng(seed).random((L, Hs))
    if routing == "saliency":
        s = self_saliency(q, k, C)
    elif routing == "qk":
        s = qk_received(q, k, C)
    elif routing == "keynorm":
        s = keynorm_scores(k, H)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    if per_kv_head:
        s = s.reshape(L, Hk, G).sum(axis=2)
    return s


def position_offsets(n, C):
    """'position' routing: n evenly spaced offsets inside a chunk of C tokens,
    the centres of n equal segments: floor((2i + 1) C / (2n)), i = 0..n-1.
    (C=64, n=6 -> 5, 16, 26, 37, 48, 58; n = C -> every token.)"""
    return np.array([((2 * i + 1) * C) // (2 * n) for i in range(n)], dtype=np.int64)


def still_lambda(C, m, n_ctx, lam=None, routing="saliency"):
    """(lambda, cap): tokens kept per leaving chunk and Sel capacity per head.

    routing 'none'       -> lambda 0
    lam given            -> lambda = lam
    m > 0                -> lambda = floor((m - 2C) / ceil(n_ctx / C))
    m == 0               -> lambda = C // 16 (reference-code mode)
    cap = m - 2C if m > 0 else None (uncapped).  m must be 0 or >= 2C.
    """
    if m != 0 and m < 2 * C:
        raise ValueError("budget m must be 0 (uncapped) or >= 2C")
    cap = m - 2 * C if m > 0 else None
    if routing == "none":
        return 0, cap
    if lam is not None:
        if lam < 0:
            raise ValueError("lam must be >= 0")
        return int(lam), cap
    if m > 0:
        return (m - 2 * C) // (-(-n_ctx // C)), cap
    return C // 16, cap


# --------------------------------------------------------------------------
# still
# --------------------------------------------------------------------------

def still_selection(L, C, Hs, lam, cap, scores, routing):
    """Delayed selection.  Returns picks[hs][c] = sorted positions of chunk c
    that join Sel, for every chunk c that has left Local within L tokens
    (i.e. (c + 2) C <= L - 1).

    Chunks are processed in order c = 0, 1, ...; each takes
    n = min(lam, C, slots_left) tokens (slots_left = cap - used, or unbounded):
    the top-n by score (higher score first, ties -> lower position first), or
    for 'position' the evenly spaced offsets position_offsets(n, C).
    """
    n_left = max(0, (L - 1) // C - 1)   # chunks c with (c + 2) C <= L - 1
    picks = []
    for hs in range(Hs):
        used, per_chunk = 0, []
        for c in range(n_left):
            n = min(lam, C)
            if cap is not None:
                n = min(n, cap - used)
            chunk = list(range(c * C, c * C + C))
            if n <= 0:
                sel = []
            elif routing == "position":
                sel = [c * C + int(o) for o in position_offsets(n, C)]
            else:
                ranked = sorted(chunk, key=lambda j: (-scores[j, hs], j))
                sel = ranked[:n]
            used += len(sel)
            per_chunk.append(np.array(sorted(sel), dtype=np.int64))
        picks.append(per_chunk)
    return picks


def stored_as(X, store):
    """Rows of X (float64 holding float32 values) as the engine stores a
    selected key or value: 'f32' unchanged; 'f16' rounded to IEEE half
    (nearest even); 'q8' per row s = max|x| / 127 and x8 = round(x * (127 /
    max|x|)) in float32 (half to even), clipped to +-127, read back as s * x8."""
    if store == "f32":
        return X
    if store == "f16":
        return X.astype(np.float32).astype(np.float16).astype(np.float64)
    if store != "q8":
        raise ValueError(f"unknown sel_store {store!r}")
    X32 = X.astype(np.float32)
    amax = np.abs(X32).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    x8 = np.clip(np.rint(X32 * inv), -127, 127)
    s = (amax / np.float32(127)).astype(np.float32)
    return x8.astype(np.float64) * s.astype(np.float64)


def still_attn(q, k, v, x, params, C=64, m=896, n_ctx=8192, lam=None,
               per_kv_head=False, routing="saliency", linear=True,
               feature_map="npmap", gate=True, seed=0, eps=DEN_EPS,
               return_sets=False, sel_store="f32", select="chunk", sel_span=0,
               gate_den=False):
    """STILL attention (selected tokens + gated linear attention).

    q (L,H,D), k/v (L,Hk,D) after RoPE; x (L,d) the layer input (only used
    when gate=True); params as init_still_params; C chunk size; m the budget
    per head in softmax KV slots (0 = uncapped reference-code mode); n_ctx the
    configured maximum context; lam per-chunk keep count (see still_lambda).

    Per token t and query head h (selection head hs = h // G if per_kv_head
    else h):
      Sel(t)  = union of picks[hs][c] over chunks c <= c(t) - 2
      A(t)    = Local(t) u Sel(t)                 (disjoint union)
      Lin(t)  = Hist(t) \\ Sel(t)                  (what S_t, z_t hold)
      m_t     = max_{j in A(t)} s_tj
      S_t     = sum_{j in Lin(t)} phik(k_j) v_j^T,  z_t = sum_{j in Lin(t)} phik(k_j)
      y_t     = (sum_A e^{s-m} v_j + g_t (.) (phiq(q_t)^T S_t))
                / (sum_A e^{s-m} + phiq(q_t)^T z_t + eps)
    linear=False drops both linear terms (eps stays); gate=False -> g = 1.
    g_t = sigma(Wg @ x_t + bg) reshaped (H, D).
    gate_den=True (needs linear and gate): the gate also scales the linear
    term of the denominator, per channel d:
      y_td = (sum_A e^{s-m} v_jd + g_td (phiq^T S_t)_d)
             / (sum_A e^{s-m} + g_td phiq^T z_t + eps)

    routing: 'saliency' | 'random' | 'keynorm' | 'qk' | 'position' | 'none'
    (see routing_scores / position_offsets); feature_map 'npmap' | 'hedgehog'.
    sel_store: how the engine stores the selected tokens' keys and values
    ('f32', 'f16', 'q8'; see stored_as): the softmax over Sel uses the stored
    vectors, Local and the linear branch the exact ones.

    select: 'chunk' (the spec: lam tokens per leaving chunk join Sel forever)
    or 'global' (needs m > 0 and a scoring routing): Sel(t) = the best
    m - 2C of all tokens of chunks <= c(t) - 2 by (score desc, position asc),
    Lin(t) = the others.  A token once in Sel and later pushed out of it is
    folded as stored (the engine reads it back from its Sel store): its phik
    and v in the linear sums use stored_as(k), stored_as(v).

    sel_span R (routings with token scores; not qk, whose sums are still
    growing when a chunk leaves): a leaving token ranks by the best score of
    positions j - R .. j + R that lie in its chunk or the next one.

    return_sets=True returns (y, sets) with sets = dict(
        lam, cap, Hs, scores (L, Hs) or None, picks[hs][c],
        local[t] (array), sel[t][hs] (array), lin[t][hs] (array)).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}")
    if gate_den and not (linear and gate):
        raise ValueError("gate_den needs the linear branch and the gate")
    q, k, v, L, H, Hk, D, G = _shapes(q, k, v)
    scale = 1.0 / math.sqrt(D)
    Hs = Hk if per_kv_head else H
    if select not in ("chunk", "global"):
        raise ValueError(f"unknown select {select!r}")
    lam_eff, cap = still_lambda(C, m, n_ctx, lam, routing)
    scores = routing_scores(q, k, C, routing, per_kv_head, seed)
    if sel_span and routing not in ("position", "none"):
        if routing == "qk":
            raise ValueError("sel_span with qk routing is not modelled here")
        base = scores.copy()
        for j in range(L):
            c0 = (j // C) * C
            lo, hi = max(j - sel_span, c0), min(j + sel_span, c0 + 2 * C - 1, L - 1)
            scores[j] = base[lo:hi + 1].max(axis=0)
    if select == "global":
        if cap is None or routing in ("position", "none"):
            raise ValueError("global selection needs a budget and a scoring routing")
        picks = None
    else:
        picks = still_selection(L, C, Hs, lam_eff, cap, scores, routing)

    # per-token sets
    local_sets, sel_sets, lin_sets = [], [], []
    ever = [set() for _ in range(Hs)]   # global: tokens that have been in Sel
    for t in range(L):
        c = t // C
        local_sets.append(local_set(t, C))
        hist = hist_set(t, C)
        sel_t, lin_t = [], []
        for hs in range(Hs):
            if select == "global":
                ranked = sorted(hist.tolist(), key=lambda j: (-scores[j, hs], j))
                sel = np.array(sorted(ranked[:cap]), dtype=np.int64)
                ever[hs].update(sel.tolist())
            else:
                parts = [picks[hs][cc] for cc in range(0, c - 1)]   # chunks <= c-2
                sel = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            sel_t.append(sel)
            lin_t.append(np.setdiff1d(hist, sel))
        sel_sets.append(sel_t)
        lin_sets.append(lin_t)

    # feature maps per query head (k mapped with head h's k-map)
    if linear:
        phq_l, phk_l = [], []
        for h in range(H):
            kv = h // G
            if feature_map == "npmap":
                phq_l.append(npmap(q[:, h], params["q_u"][h], params["q_W"][h]))
                phk_l.append(npmap(k[:, kv], params["k_u"][h], params["k_W"][h]))
            elif feature_map == "hedgehog":
                phq_l.append(hedgehog(q[:, h], params["hq_W"][h]))
                phk_l.append(hedgehog(k[:, kv], params["hk_W"][h]))
            else:
                raise ValueError(f"unknown feature_map {feature_map!r}")
        phq = np.stack(phq_l, axis=1)
        phk = np.stack(phk_l, axis=1)
        # global selection folds evicted tokens as stored
        phk_st = []
        for h in range(H):
            Kst = stored_as(k[:, h // G], sel_store)
            if feature_map == "npmap":
                phk_st.append(npmap(Kst, params["k_u"][h], params["k_W"][h]))
            else:
                phk_st.append(hedgehog(Kst, params["hk_W"][h]))
        phk_st = np.stack(phk_st, axis=1)
    if linear and gate:
        x = _f64(x)
        g = sigmoid(x @ _f64(params["Wg"]).T + _f64(params["bg"])).reshape(L, H, D)
    else:
        g = np.ones((L, H, D))

    y = np.zeros((L, H, D))
    for h in range(H):
        kv = h // G
        hs = kv if per_kv_head else h
        K, V = k[:, kv], v[:, kv]
        Ks, Vs = stored_as(K, sel_store), stored_as(V, sel_store)
        for t in range(L):
            A = np.union1d(local_sets[t], sel_sets[t][hs])
            in_sel = np.isin(A, sel_sets[t][hs])[:, None]
            KA, VA = np.where(in_sel, Ks[A], K[A]), np.where(in_sel, Vs[A], V[A])
            s = (KA @ q[t, h]) * scale
            e = np.exp(s - s.max())
            num = e @ VA
            den = e.sum() + eps
            if linear:
                lin = lin_sets[t][hs]
                was = np.isin(lin, np.array(sorted(ever[hs]), dtype=np.int64))[:, None]   # evicted
                PK = np.where(was, phk_st[lin, h], phk[lin, h])
                VL = np.where(was, Vs[lin], V[lin])
                S = PK.T @ VL                     # (2F, D)
                z = PK.sum(axis=0)                # (2F,)
                num = num + g[t, h] * (phq[t, h] @ S)
                den = den + (g[t, h] if gate_den else 1.0) * (phq[t, h] @ z)
            y[t, h] = num / den
    if return_sets:
        sets = dict(lam=lam_eff, cap=cap, Hs=Hs, scores=scores, picks=picks,
                    local=local_sets, sel=sel_sets, lin=lin_sets)
        return y, sets
    return y
