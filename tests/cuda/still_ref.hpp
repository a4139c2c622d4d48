/* CPU side of the still tests of test_cuda_kernels (tests/cuda/kinds/still/; host C++ only):
 *
 * ref_still   the double-precision reference of the still forward over a
 *             whole sequence, written straight from
 *             tests/python/ref_attention.py's still_attn (explicit index
 *             sets, one token and one head at a time), with the routing
 *             details of the C engine (src/kinds/still/attn_still.c): the closed-form
 *             saliency score f(p), the random routing hash, ties to the lower
 *             position, NaN scores as -inf. Sel keys and values exact
 *             (with sel_q8: read back from 8-bit rows, ref_q8_row).
 * emu_call    a CPU emulation, in double, of what the GPU kernels compute
 *             for one call (cuda/attn_still*.cu): the same decomposition
 *             into blocks, tiles and slots from cuda/kinds/still/attn_still_layout.cuh,
 *             the same state (ring, ring scores, Sel, S / z, position),
 *             with checks of the decomposition's invariants (every row
 *             written once, every token scored once, no visible key outside
 *             a loaded tile row, ring accesses inside the ring). Against
 *             ref_still over any split of a sequence it checks the
 *             algorithm and its index arithmetic without a GPU. */
#ifndef STILL_TESTS_CUDA_STILL_REF_HPP
#define STILL_TESTS_CUDA_STILL_REF_HPP

#include "kinds/still/attn_still_layout.cuh"
#include "still_cuda.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

/* One sequence of still inputs. */
struct still_seq {
    int L, H, Hk, D, d;
    std::vector<float> q, k, v;    /* [L][H][D], [L][Hk][D], [L][Hk][D] (after RoPE) */
    std::vector<uint16_t> x;       /* [L][d] bf16, the gate's input */
    std::vector<float> params;     /* the CPU layout */
};

static inline double still_bf2d(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- reference -------------------------------------------------------------------------------- */

/* NP-Map in double: x̃ = x - 2 (x·u / u·u) u, z = W x̃, z · ‖x‖ / max(‖z‖, 1e-12),
 * [softmax(z) ⊕ softmax(-z)] clamped at 1e-12 (u·u = 0: no reflection). */
static void ref_npmap(const float *x, const float *u, const float *W, int D, double *phi) {
    double xu = 0, uu = 0, nx = 0;
    for (int i = 0; i < D; i++) xu += (double)x[i] * u[i], uu += (double)u[i] * u[i], nx += (double)x[i] * x[i];
    const double f = uu > 0 ? 2 * xu / uu : 0;
    std::vector<double> xt(D), z(D);
    for (int i = 0; i < D; i++) xt[i] = x[i] - f * u[i];
    double nz = 0;
    for (int i = 0; i < D; i++) {
        double a = 0;
        for (int j = 0; j < D; j++) a += (double)W[(size_t)i * D + j] * xt[j];
        z[i] = a, nz += a * a;
    }
    const double sc = sqrt(nx) / std::max(sqrt(nz), 1e-12);
    for (int half = 0; half < 2; half++) {
        const double sg = half ? -1 : 1;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < D; i++) mx = std::max(mx, sg * z[i] * sc);
        for (int i = 0; i < D; i++) sum += phi[half * D + i] = exp(sg * z[i] * sc - mx);
        for (int i = 0; i < D; i++) phi[half * D + i] = std::max(phi[half * D + i] / sum, 1e-12);
    }
}

/* lolcats' Hedgehog map in double: z = x W (W [D][F], F = D here),
 * [softmax(z) ⊕ softmax(-z)] clamped at 1e-12. */
static void ref_hedgehog(const float *x, const float *W, int D, double *phi) {
    std::vector<double> z(D, 0.0);
    for (int f = 0; f < D; f++)
        for (int d = 0; d < D; d++) z[f] += (double)x[d] * W[(size_t)d * D + f];
    for (int half = 0; half < 2; half++) {
        const double sg = half ? -1 : 1;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < D; i++) mx = std::max(mx, sg * z[i]);
        for (int i = 0; i < D; i++) sum += phi[half * D + i] = exp(sg * z[i] - mx);
        for (int i = 0; i < D; i++) phi[half * D + i] = std::max(phi[half * D + i] / sum, 1e-12);
    }
}

/* src/kinds/still/attn_still.c's saliency_of_p and route_random (attn_common.h's splitmix64). */
static double ref_saliency_of_p(double p) {
    if (!(p > 0)) p = 0;
    if (p > 1) p = 1;
    double r = p * log((p + 1e-8) / 1e-8);
    if (p < 1) r += (1 - p) * log1p(-p);
    return r;
}
static uint64_t ref_splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static double ref_route_random(uint64_t seed, int hs, int pos) {
    uint64_t s = seed ^ 0x5851f42d4c957f2dULL;
    s += ((uint64_t)(uint32_t)pos << 24) ^ (uint64_t)(uint32_t)hs;
    ref_splitmix(&s);
    return (double)(ref_splitmix(&s) >> 11) * 0x1.0p-53;
}

/* Sel in 8 bits (cfg.sel_q8, the CPU's --sel-cache q8), from the spec of the store: scale s = amax / 127,
 * element round-to-nearest-even(x · 127 / amax) clamped to ±127, read back as s · element. Returns the
 * row as read back, in double. */
static std::vector<double> ref_q8_row(const float *x, int D) {
    float amax = 0;
    for (int i = 0; i < D; i++) amax = std::max(amax, fabsf(x[i]));
    const float sc = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    std::vector<double> r(D);
    for (int i = 0; i < D; i++) {
        float v = nearbyintf(x[i] * inv);
        v = std::min(127.0f, std::max(-127.0f, v));
        r[i] = (double)sc * (double)v;
    }
    return r;
}

struct still_ref_result {
    std::vector<double> y;               /* [L][H][D] */
    std::vector<std::vector<int>> sel;   /* per selection head: positions in Sel order */
    std::vector<double> rank;            /* [L][Hs] the value tokens were ranked by (diagnostics) */
};

/* The spec's explicit self-saliency of a token from its window's logits lg (the token's own last):
 * Score = Σ_l a_diag_l log((a_diag_l + ε) / (a_nodiag_l + ε)), a_diag the softmax over the window, a_nodiag the
 * softmax over the window without the token (its own entry 0), ε = 1e-8. (The engines use the closed form f(p)
 * of the token's own weight p; explicit = true checks that form against this one.) */
static double ref_saliency_explicit(const std::vector<double> &lg) {
    const size_t n = lg.size();
    double mx = -INFINITY, mxo = -INFINITY;
    for (size_t i = 0; i < n; i++) mx = std::max(mx, lg[i]), mxo = i + 1 < n ? std::max(mxo, lg[i]) : mxo;
    double sd = 0, so = 0;
    for (size_t i = 0; i < n; i++) sd += exp(lg[i] - mx), so += i + 1 < n ? exp(lg[i] - mxo) : 0.0;
    double score = 0;
    for (size_t i = 0; i < n; i++) {
        const double ad = exp(lg[i] - mx) / sd, ao = i + 1 < n ? exp(lg[i] - mxo) / so : 0.0;
        score += ad * log((ad + 1e-8) / (ao + 1e-8));
    }
    return score;
}

static still_ref_result ref_still(const stc_still_config &cfg, const stc_still_info &info, const still_seq &s,
                                  bool explicit_saliency = false) {
    const int L = s.L, H = s.H, Hk = s.Hk, D = s.D, G = H / Hk, C = cfg.chunk, P = 2 * D, dm = s.d;
    const int Hs = info.n_sel_heads, lam = info.lambda, cap = info.cap, routing = cfg.routing;
    const bool capped = cfg.budget > 0, linear = cfg.linear != 0, gate = linear && cfg.gate;
    const bool gate_den = gate && cfg.gate_den;   /* the gate on the denominator's linear term too */
    const double scale = 1.0 / sqrt((double)D);
    auto Q = [&](int t, int h) { return &s.q[((size_t)t * H + h) * D]; };
    auto K = [&](int t, int hk) { return &s.k[((size_t)t * Hk + hk) * D]; };
    auto V = [&](int t, int hk) { return &s.v[((size_t)t * Hk + hk) * D]; };
    auto dot = [&](const float *a, const float *b) {
        double r = 0;
        for (int i = 0; i < D; i++) r += (double)a[i] * b[i];
        return r;
    };

    /* 1. routing scores per (position, query head) */
    std::vector<double> sc((size_t)L * H, 0.0);
    for (int h = 0; h < H; h++) {
        const int hk = h / G;
        for (int j = 0; j < L; j++) {
            double &o = sc[(size_t)j * H + h];
            if (routing == 0) {   /* saliency: f(p), p = own weight in R(j) */
                const int lo = std::max(0, j - C + 1);
                std::vector<double> lg;
                double mx = -INFINITY;
                for (int l = lo; l <= j; l++) lg.push_back(dot(Q(j, h), K(l, hk)) * scale), mx = std::max(mx, lg.back());
                double sum = 0;
                for (double x : lg) sum += exp(x - mx);
                o = explicit_saliency ? ref_saliency_explicit(lg) : ref_saliency_of_p(exp(lg.back() - mx) / sum);
            } else if (routing == 2) {   /* keynorm */
                o = sqrt(dot(K(j, hk), K(j, hk)));
            } else if (routing == 3) {   /* qk: Σ over the queries whose window holds j */
                for (int i = j; i <= std::min(j + C - 1, L - 1); i++) o += dot(Q(i, h), K(j, hk)) * scale;
            }
        }
    }

    /* 2. delayed selection of the chunks that left Local */
    still_ref_result res;
    res.sel.assign(Hs, std::vector<int>());
    res.rank.assign((size_t)L * Hs, NAN);
    std::vector<char> picked((size_t)Hs * L, 0);
    const int n_leave = L >= 1 && (L - 1) / C >= 1 ? (L - 1) / C - 1 : 0;
    for (int hs = 0; hs < Hs; hs++) {
        int used = 0;
        for (int c = 0; c < n_leave; c++) {
            int n = std::min(lam, C);
            if (capped) n = std::min(n, cap - used);
            if (n <= 0) continue;
            std::vector<int> pick;
            if (routing == 4) {
                for (int i = 0; i < n; i++) pick.push_back(c * C + (int)(((long long)(2 * i + 1) * C) / (2 * n)));
            } else {
                std::vector<std::pair<double, int>> r;
                for (int i = 0; i < C; i++) {
                    const int pos = c * C + i;
                    double v = 0;
                    if (routing == 1) v = ref_route_random(cfg.seed, hs, pos);
                    else {
                        const int h0 = cfg.per_kv_head ? hs * G : hs, nh = cfg.per_kv_head ? G : 1;
                        for (int h = h0; h < h0 + nh; h++) v += routing == 3 ? sc[(size_t)pos * H + h] / C : sc[(size_t)pos * H + h];
                    }
                    if (v != v) v = -INFINITY;
                    r.push_back({v, pos});
                    res.rank[(size_t)pos * Hs + hs] = v;
                }
                std::sort(r.begin(), r.end(), [](const std::pair<double, int> &a, const std::pair<double, int> &b) {
                    return a.first > b.first || (a.first == b.first && a.second < b.second);
                });
                for (int i = 0; i < n; i++) pick.push_back(r[i].second);
                std::sort(pick.begin(), pick.end());
            }
            for (int p : pick) res.sel[hs].push_back(p), picked[(size_t)hs * L + p] = 1;
            used += n;
        }
    }

    /* 3. feature maps per query head (k with head h's k-map), the gate */
    const size_t HD = (size_t)H * D;
    std::vector<double> phq, phk, gt;
    if (linear) {
        phq.resize((size_t)L * H * P), phk.resize((size_t)L * H * P);
        const float *pr = s.params.data();
        for (int t = 0; t < L; t++)
            for (int h = 0; h < H; h++) {
                if (cfg.lolcats) {   /* hq_W [H][D][F], hk_W [H][D][F] */
                    ref_hedgehog(Q(t, h), pr + (size_t)h * D * D, D, &phq[((size_t)t * H + h) * P]);
                    ref_hedgehog(K(t, h / G), pr + (H + (size_t)h) * D * D, D, &phk[((size_t)t * H + h) * P]);
                    continue;
                }
                ref_npmap(Q(t, h), pr + (size_t)h * D, pr + 2 * HD + (size_t)h * D * D, D, &phq[((size_t)t * H + h) * P]);
                ref_npmap(K(t, h / G), pr + HD + (size_t)h * D, pr + 2 * HD + (H + (size_t)h) * D * D, D,
                          &phk[((size_t)t * H + h) * P]);
            }
    }
    if (gate) {
        gt.resize((size_t)L * HD);
        const float *Wg = s.params.data() + 2 * HD + 2 * HD * D, *bg = Wg + HD * dm;
        for (int t = 0; t < L; t++)
            for (size_t r = 0; r < HD; r++) {
                double a = bg[r];
                for (int c = 0; c < dm; c++) a += (double)Wg[r * dm + c] * still_bf2d(s.x[(size_t)t * dm + c]);
                gt[(size_t)t * HD + r] = 1 / (1 + exp(-a));
            }
    }

    /* 4. outputs, head by head, chunk by chunk (S, z: the non-selected tokens of chunks <= c-2) */
    res.y.assign((size_t)L * HD, 0.0);
    std::vector<double> S((size_t)P * D), z(P), lg, num(D);
    for (int h = 0; h < H; h++) {
        const int hk = h / G, hs = cfg.per_kv_head ? hk : h;
        /* lolcats: the softmax sums scaled by γ = σ(w_h) */
        const double gam = cfg.lolcats ? 1 / (1 + exp(-(double)s.params[2 * HD * D + h])) : 1.0;
        std::fill(S.begin(), S.end(), 0.0), std::fill(z.begin(), z.end(), 0.0);
        for (int c = 0; c * C < L; c++) {
            if (c >= 2 && linear)
                for (int j = (c - 2) * C; j < (c - 1) * C; j++) {
                    if (picked[(size_t)hs * L + j]) continue;
                    const double *f = &phk[((size_t)j * H + h) * P];
                    for (int p = 0; p < P; p++) {
                        z[p] += f[p];
                        for (int x = 0; x < D; x++) S[(size_t)p * D + x] += f[p] * V(j, hk)[x];
                    }
                }
            int ns = 0;   /* Sel entries of chunks <= c-2: positions below (c-1) C */
            while (ns < (int)res.sel[hs].size() && res.sel[hs][ns] < (c - 1) * C) ns++;
            for (int t = c * C; t < std::min(L, (c + 1) * C); t++) {
                std::vector<int> keys(res.sel[hs].begin(), res.sel[hs].begin() + ns);
                for (int j = std::max(0, (c - 1) * C); j <= t; j++) keys.push_back(j);
                lg.assign(keys.size(), 0.0);
                double mx = -INFINITY;
                /* the first ns keys are Sel's: with sel_q8 read back from their 8-bit rows */
                auto key = [&](size_t i, int which) {
                    const float *row = which ? V(keys[i], hk) : K(keys[i], hk);
                    std::vector<double> r(row, row + D);
                    return (int)i < ns && cfg.sel_q8 ? ref_q8_row(row, D) : r;
                };
                for (size_t i = 0; i < keys.size(); i++) {
                    const std::vector<double> kr = key(i, 0);
                    double a = 0;
                    for (int x = 0; x < D; x++) a += (double)Q(t, h)[x] * kr[x];
                    lg[i] = a * scale, mx = std::max(mx, lg[i]);
                }
                double den = 0;
                std::fill(num.begin(), num.end(), 0.0);
                for (size_t i = 0; i < keys.size(); i++) {
                    const double e = gam * exp(lg[i] - mx);
                    den += e;
                    const std::vector<double> vr = key(i, 1);
                    for (int x = 0; x < D; x++) num[x] += e * vr[x];
                }
                double bz = 0;   /* φq·z, the linear term of the denominator */
                if (linear) {
                    const double *f = &phq[((size_t)t * H + h) * P];
                    for (int x = 0; x < D; x++) {
                        double a = 0;
                        for (int p = 0; p < P; p++) a += f[p] * S[(size_t)p * D + x];
                        num[x] += (gate ? gt[(size_t)t * HD + (size_t)h * D + x] : 1.0) * a;
                    }
                    for (int p = 0; p < P; p++) bz += f[p] * z[p];
                }
                /* gate_den: the denominator per channel, Σ e + g_x φq·z + 1e-6 */
                for (int x = 0; x < D; x++)
                    res.y[((size_t)t * H + h) * D + x] =
                        num[x] / (den + (gate_den ? gt[(size_t)t * HD + (size_t)h * D + x] : 1.0) * bz + 1e-6);
            }
        }
    }
    return res;
}

/* ---- emulation of the GPU kernels --------------------------------------------------------------- */

struct emu_state {
    int n_seen = 0;
    std::vector<double> ring_k, ring_v, ring_sc, sel_k, sel_v, lin;
    std::vector<int> sel_pos;
    long violations = 0;   /* broken invariants of the decomposition */
};

static emu_state emu_create(const stc_still_config &cfg, const stc_still_info &info) {
    const int C = cfg.chunk, D = cfg.head_dim, H = cfg.n_head, Hk = cfg.n_head_kv, rows = std::max(info.cap, 1);
    emu_state st;
    st.ring_k.assign((size_t)2 * C * Hk * D, NAN), st.ring_v = st.ring_k;
    st.ring_sc.assign((size_t)H * 2 * C, NAN);
    st.sel_k.assign((size_t)info.n_sel_heads * rows * D, NAN), st.sel_v = st.sel_k;
    st.sel_pos.assign((size_t)info.n_sel_heads * rows, -1);
    st.lin.assign((size_t)H * 2 * D * (D + 1), 0.0);
    return st;
}

/* One call: positions p0 = st.n_seen .. p0 + T - 1 of the sequence; writes
 * rows p0 .. p0+T-1 of y ([L][H][D]) and counts the writes in written. */
static void emu_call(const stc_still_config &cfg, const stc_still_info &info, const still_seq &s, emu_state &st,
                     int T, std::vector<double> &y, std::vector<int> &written) {
    using namespace stillk;
    const int H = s.H, Hk = s.Hk, D = s.D, G = H / Hk, C = cfg.chunk, P = 2 * D, dm = s.d, C2 = 2 * C;
    const int lam = info.lambda, cap = info.cap, rows_sel = std::max(cap, 1), routing = cfg.routing;
    const bool linear = cfg.linear != 0, gate = linear && cfg.gate, per_kv = cfg.per_kv_head != 0;
    const bool gate_den = gate && cfg.gate_den;
    const double scale = 1.0 / sqrt((double)D);
    const size_t HD = (size_t)H * D, slot_n = (size_t)H * P * (D + 1);
    const int p0 = st.n_seen;
    const call_geom g = make_geom(p0, T, C);
    long &bad = st.violations;

    /* key (which = 0) or value row of KV head hk at pos: ring before p0, input after */
    auto kv = [&](int pos, int hk, int which, double *dst) {
        if (pos < p0) {
            if (pos < g.ring_lo) bad++;
            const double *src = &(which ? st.ring_v : st.ring_k)[((size_t)(pos % C2) * Hk + hk) * D];
            for (int i = 0; i < D; i++) dst[i] = src[i];
            return;
        }
        if (pos >= p0 + T) bad++;
        const float *src = &(which ? s.v : s.k)[((size_t)pos * Hk + hk) * D];
        for (int i = 0; i < D; i++) dst[i] = src[i];
    };
    std::vector<double> kbuf(D), vbuf(D);
    std::vector<double> sc((size_t)H * T, routing == R_QK ? 0.0 : NAN);
    auto score = [&](int h, int pos) -> double & {
        if (pos < p0) {
            if (pos < g.ring_lo) bad++;
            return st.ring_sc[(size_t)h * C2 + pos % C2];
        }
        if (pos >= p0 + T) bad++;
        return sc[(size_t)h * T + (pos - p0)];
    };
    auto qrow = [&](int pos, int h) { return &s.q[((size_t)pos * H + h) * D]; };
    auto dotq = [&](const float *q, const double *k) {
        double r = 0;
        for (int i = 0; i < D; i++) r += (double)q[i] * k[i];
        return r;
    };
    const float *pr = s.params.data();

    /* score */
    if (routing == R_SALIENCY || routing == R_QK) {
        std::vector<int> cover((size_t)H * T, 0);
        for (int b = 0; b < max_score_tiles(T); b++) {
            const int tq0 = score_tile_q0(p0, b), r_lo = std::max(tq0, p0), r_hi = std::min(tq0 + kScoreRows - 1, p0 + T - 1);
            if (r_lo > r_hi) continue;
            const int J = score_sub_before(C), key_lo = std::max(0, r_lo - C + 1);
            for (int h = 0; h < H; h++)
                for (int t = r_lo; t <= r_hi; t++) {
                    double m = -INFINITY, l = 0, self = NAN;
                    int seen = 0;
                    for (int sb = 0; sb <= J; sb++) {
                        const int kb = tq0 + kScoreRows * (sb - J);
                        if (kb + kKeys - 1 < key_lo || kb > r_hi) continue;
                        for (int j = 0; j < kKeys; j++) {
                            const int key = kb + j;
                            if (!in_window(key, t, C)) continue;
                            if (!(key >= key_lo && key <= r_hi)) { bad++; continue; }   /* not loaded */
                            seen++;
                            kv(key, h / G, 0, kbuf.data());
                            const double val = dotq(qrow(t, h), kbuf.data()) * scale;
                            if (routing == R_QK) score(h, key) += val;
                            const double mn = std::max(m, val);
                            l = l * exp(m - mn) + exp(val - mn);
                            m = mn;
                            if (key == t) self = val;
                        }
                    }
                    if (seen != std::min(C, t + 1)) bad++;   /* the whole window */
                    cover[(size_t)h * T + (t - p0)]++;
                    if (routing == R_SALIENCY) score(h, t) = saliency_of_p(exp(self - m) / l);
                }
        }
        for (int c : cover) bad += c != 1;
    } else if (routing == R_KEYNORM) {
        for (int t = 0; t < T; t++)
            for (int hk = 0; hk < Hk; hk++) {
                kv(p0 + t, hk, 0, kbuf.data());
                double n2 = 0;
                for (int i = 0; i < D; i++) n2 += kbuf[i] * kbuf[i];
                for (int gg = 0; gg < G; gg++) score(hk * G + gg, p0 + t) = sqrt(n2);
            }
    }

    /* leave */
    std::vector<double> slots((size_t)std::max(1, max_leaves(T, C)) * slot_n, NAN);
    if (g.n_leaves > max_leaves(T, C)) bad++;
    for (int k = 0; k < max_leaves(T, C); k++) {
        if (k >= g.n_leaves) continue;
        for (int h = 0; h < H; h++) {
            const int hk = h / G, hs = per_kv ? hk : h;
            const bool rep = !per_kv || h % G == 0;
            const int cl = g.leave_first + k, pos0 = cl * C;
            const int base = sel_count(cl, lam, cap), n = sel_count(cl + 1, lam, cap) - base;
            std::vector<int> picked(C, 0);
            if (n > 0) {
                if (routing == R_POSITION) {
                    for (int i = 0; i < n; i++) picked[position_offset(i, n, C)] = 1;
                } else {
                    std::vector<double> vals(C);
                    for (int i = 0; i < C; i++) {
                        double v = 0;
                        if (routing == R_RANDOM) v = route_random(cfg.seed, hs, pos0 + i);
                        else {
                            const int h0 = per_kv ? hs * G : hs, nh = per_kv ? G : 1;
                            for (int hh = h0; hh < h0 + nh; hh++) {
                                const double x = score(hh, pos0 + i);
                                v += routing == R_QK ? x / C : x;
                            }
                        }
                        vals[i] = v != v ? -INFINITY : v;
                    }
                    for (int i = 0; i < C; i++) {
                        int rank = 0;
                        for (int j = 0; j < C; j++) rank += ranks_before(vals[j], j, vals[i], i);
                        picked[i] = rank < n;
                    }
                }
                int cnt = 0;
                for (int i = 0; i < C; i++) cnt += picked[i];
                if (cnt != n) bad++;
                if (rep) {
                    int before = 0;
                    for (int i = 0; i < C; i++) {
                        if (!picked[i]) continue;
                        const int sl = base + before++;
                        if (sl >= cap) { bad++; continue; }
                        st.sel_pos[(size_t)hs * rows_sel + sl] = pos0 + i;
                        kv(pos0 + i, hk, 0, kbuf.data());
                        kv(pos0 + i, hk, 1, vbuf.data());
                        if (cfg.sel_q8) {   /* stored in 8 bits: the rows as read back (the inputs are floats) */
                            std::vector<float> kf(kbuf.begin(), kbuf.end()), vf(vbuf.begin(), vbuf.end());
                            const std::vector<double> kq = ref_q8_row(kf.data(), D), vq = ref_q8_row(vf.data(), D);
                            std::copy(kq.begin(), kq.end(), kbuf.begin()), std::copy(vq.begin(), vq.end(), vbuf.begin());
                        }
                        for (int x = 0; x < D; x++) {
                            st.sel_k[((size_t)hs * rows_sel + sl) * D + x] = kbuf[x];
                            st.sel_v[((size_t)hs * rows_sel + sl) * D + x] = vbuf[x];
                        }
                    }
                }
            }
            if (!linear) continue;
            double *dS = &slots[(size_t)k * slot_n];
            for (int p = 0; p < P; p++) {
                for (int x = 0; x < D; x++) dS[((size_t)h * P + p) * D + x] = 0;
                dS[(size_t)H * P * D + (size_t)h * P + p] = 0;
            }
            std::vector<double> phi(P);
            std::vector<float> kf(D);
            for (int i = 0; i < C; i++) {
                if (picked[i]) continue;
                kv(pos0 + i, hk, 0, kbuf.data());
                kv(pos0 + i, hk, 1, vbuf.data());
                for (int x = 0; x < D; x++) kf[x] = (float)kbuf[x];   /* exact: the inputs are floats */
                ref_npmap(kf.data(), pr + HD + (size_t)h * D, pr + 2 * HD + (H + (size_t)h) * D * D, D, phi.data());
                for (int p = 0; p < P; p++) {
                    for (int x = 0; x < D; x++) dS[((size_t)h * P + p) * D + x] += phi[p] * vbuf[x];
                    dS[(size_t)H * P * D + (size_t)h * P + p] += phi[p];
                }
            }
        }
    }

    /* scan */
    if (linear && g.n_leaves > 0)
        for (size_t e = 0; e < slot_n; e++) {
            double acc = st.lin[e];
            for (int k = 0; k < g.n_leaves; k++) slots[(size_t)k * slot_n + e] = acc += slots[(size_t)k * slot_n + e];
        }

    /* attention, then linear, per block */
    const int n_rt = row_tiles(C);
    std::vector<double> lbuf((size_t)T * H, NAN);
    for (int pass = 0; pass < 2; pass++)
        for (int blk = 0; blk < max_query_chunks(T, C) * n_rt; blk++)
            for (int h = 0; h < H; h++) {
                const int c = g.c_first + blk / n_rt, rt = blk % n_rt;
                if (c > g.c_last) continue;
                int lo, hi;
                block_rows(g, C, c, rt, &lo, &hi);
                if (lo > hi) continue;
                const int n_rows = hi - lo + 1, hk = h / G, hs = per_kv ? hk : h;
                if (n_rows > kRows) bad++;
                if (pass == 0) {   /* attention */
                    const key_list kl = make_keys(c, hi, C, lam, cap);
                    for (int r = 0; r < n_rows; r++) {
                        const int pos = lo + r, w0 = (r / 16) * 16;
                        const int w_lo = lo + w0, w_hi = lo + std::min(w0 + 15, n_rows - 1);
                        double m = -INFINITY, l = 0;
                        std::vector<double> o(D, 0.0);
                        int n_vis = 0;
                        for (int j = 0; j < kl.n_tiles; j++) {
                            bool mask;
                            int lim;
                            if (j < kl.n_sel_tiles) {
                                lim = tile_limit(kl, j, 0);
                                mask = lim < kKeys - 1;
                            } else {
                                const int tp = tile_pos0(kl, j);
                                if (tp > w_hi) {
                                    if (tile_limit(kl, j, pos) >= 0) bad++;   /* skipped a visible key */
                                    continue;
                                }
                                lim = tile_limit(kl, j, pos);
                                mask = tp + kKeys - 1 > w_lo;
                            }
                            if (!mask && lim < kKeys - 1) bad++;
                            for (int col = 0; col < kKeys; col++) {
                                if (mask && col > lim) continue;
                                if (!tile_row_valid(kl, j, col, hi)) { bad++; continue; }
                                const double *kr = kbuf.data(), *vr = vbuf.data();
                                if (j < kl.n_sel_tiles) {
                                    const size_t e = ((size_t)hs * rows_sel + j * kKeys + col) * D;
                                    kr = &st.sel_k[e], vr = &st.sel_v[e];
                                } else {
                                    const int kp = tile_pos0(kl, j) + col;
                                    if (kp > pos) bad++;
                                    kv(kp, hk, 0, kbuf.data());
                                    kv(kp, hk, 1, vbuf.data());
                                }
                                n_vis++;
                                const double sv = dotq(qrow(pos, h), kr) * scale, mn = std::max(m, sv);
                                const double corr = exp(m - mn), e = exp(sv - mn);
                                for (int x = 0; x < D; x++) o[x] = o[x] * corr + e * vr[x];
                                l = l * corr + e;
                                m = mn;
                            }
                        }
                        if (n_vis != kl.ns + (pos - kl.lo_pos + 1)) bad++;   /* |Sel prefix| + |Local(pos)| */
                        const bool fin = !(linear && c >= 2);
                        const int t = pos - p0;
                        for (int x = 0; x < D; x++) y[((size_t)pos * H + h) * D + x] = fin ? o[x] / (l + 1e-6) : o[x];
                        if (!fin) lbuf[(size_t)t * H + h] = l;
                        written[(size_t)pos * H + h]++;
                    }
                } else if (linear && c >= 2) {   /* linear */
                    const int idx = lin_index(g, c);
                    if (idx > g.n_leaves) bad++;
                    const double *src = idx == 0 ? st.lin.data() : &slots[(size_t)(idx - 1) * slot_n];
                    const double *S = src + (size_t)h * P * D, *z = src + (size_t)H * P * D + (size_t)h * P;
                    std::vector<double> phi(P);
                    for (int r = 0; r < n_rows; r++) {
                        const int pos = lo + r, t = pos - p0;
                        ref_npmap(qrow(pos, h), pr + (size_t)h * D, pr + 2 * HD + (size_t)h * D * D, D, phi.data());
                        double bz = 0;
                        for (int p = 0; p < P; p++) bz += phi[p] * z[p];
                        const double inv = 1 / (lbuf[(size_t)t * H + h] + bz + 1e-6);
                        for (int x = 0; x < D; x++) {
                            double a = 0, gx = 1;
                            for (int p = 0; p < P; p++) a += phi[p] * S[(size_t)p * D + x];
                            if (gate) {
                                const float *Wg = pr + 2 * HD + 2 * HD * D, *bg = Wg + HD * dm;
                                const size_t row = (size_t)h * D + x;
                                double pre = 0;
                                for (int cc = 0; cc < dm; cc++) pre += (double)Wg[row * dm + cc] * still_bf2d(s.x[(size_t)pos * dm + cc]);
                                gx = 1 / (1 + exp(-(pre + bg[row])));
                                a *= gx;
                            }
                            double &yo = y[((size_t)pos * H + h) * D + x];
                            /* gate_den: the denominator per channel */
                            yo = gate_den ? (yo + a) / (lbuf[(size_t)t * H + h] + gx * bz + 1e-6) : (yo + a) * inv;
                        }
                    }
                }
            }

    /* finish */
    const int end = p0 + T, first = std::max(p0, g.end_lo);
    for (int pos = first; pos < end; pos++)
        for (int hk = 0; hk < Hk; hk++)
            for (int x = 0; x < D; x++) {
                st.ring_k[((size_t)(pos % C2) * Hk + hk) * D + x] = s.k[((size_t)pos * Hk + hk) * D + x];
                st.ring_v[((size_t)(pos % C2) * Hk + hk) * D + x] = s.v[((size_t)pos * Hk + hk) * D + x];
            }
    if (routing == R_SALIENCY || routing == R_QK || routing == R_KEYNORM)
        for (int h = 0; h < H; h++)
            for (int pos = first; pos < end; pos++) st.ring_sc[(size_t)h * C2 + pos % C2] = sc[(size_t)h * T + (pos - p0)];
    if (linear && g.n_leaves > 0)
        for (size_t e = 0; e < slot_n; e++) st.lin[e] = slots[(size_t)(g.n_leaves - 1) * slot_n + e];
    if (end - g.end_lo > C2 || g.end_lo > end) bad++;   /* the ring holds at most 2C positions */
    st.n_seen = end;
}

/* Sel positions of an emulated state (as stc_still_selected returns them). */
static std::vector<std::vector<int>> emu_selected(const stc_still_config &cfg, const stc_still_info &info, const emu_state &st) {
    const int cnt = stillk::sel_count(stillk::n_left(st.n_seen, cfg.chunk), info.lambda, info.cap);
    std::vector<std::vector<int>> r(info.n_sel_heads);
    for (int hs = 0; hs < info.n_sel_heads; hs++)
        for (int i = 0; i < cnt; i++) r[hs].push_back(st.sel_pos[(size_t)hs * std::max(info.cap, 1) + i]);
    return r;
}

#endif
