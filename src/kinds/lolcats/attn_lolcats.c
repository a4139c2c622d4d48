/* The lolcats kind (LoLCATs): softmax over the chunk terrace's Local set,
 * scaled by a per-head window factor γ = σ(w), plus Hedgehog linear attention
 * over the history (chunks <= c(t) - 2):
 *
 *         γ Σ_{Local} e^{s_tj - m_t} v_j  +  φq(q_t)ᵀ S_t
 *   y_t = -----------------------------------------------        (spec)
 *         γ Σ_{Local} e^{s_tj - m_t}      +  φq(q_t)ᵀ z_t  + 1e-6
 *
 * S_t = Σ_{Hist(t)} φk(k_j) v_jᵀ (2F × D), z_t = Σ_{Hist(t)} φk(k_j) (2F),
 * per QUERY head (each query head has its own φq, φk; head h's φk maps the
 * keys of KV head h / G). The linear terms are not rescaled by e^{-m_t}.
 *
 * Parameters (floats, in this order): hq_W [H][D][F], hk_W [H][D][F] (φ(x)
 * uses x W), w [H].
 *
 * Schedule. The T new tokens are cut at chunk boundaries into segments
 * (a segment lies inside one chunk). When a segment starts chunk c >= 2, chunk
 * c - 2 leaves Local and is folded into S, z, one matrix product per chunk
 * (ΔS = Φkᵀ V). Segments are taken in groups; for a group:
 *   A  (parallel over head × segment) the folds' ΔS, Δz,
 *   B  (parallel over heads) the scan S += ΔS, with a snapshot of S, z per
 *      segment (what that segment's queries see),
 *   C  (parallel over head × segment) the outputs: φq(q_t)ᵀ S, φq(q_t)ᵀ z and
 *      the Local softmax as an online softmax over tiles of keys.
 * Decode (T = 1) is the same code with one segment.
 *
 * State (bounded, independent of the context length): the keys and values of
 * the last 2C positions per KV head (ring indexed by position mod 2C: the
 * previous chunk and the current one, or, right before a fold, the chunk
 * about to be folded and the one after it; n_ctx slots if n_ctx < 2C),
 * S [H][2F][D] and z [H][2F]: 2·Hk·2C·D + H·2F·(D+1) floats.
 * Keys of the current call are read from the input; the ring is written at
 * the end of the call.
 *
 * Training: backward (stage 1) gives the parameters' gradient,
 * backward_inputs (stage 2) also those of q, k and v; see below. */
#include "kinds/attn_rules.h"
#include "kinds/attn.h"
#include "kinds/attn_common.h"
#include "kinds/softmax/attn_softmax.h"
#include "kinds/still/attn_still_rules.h"
#include "common/common.h"
#include "cpu/vecmath.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

enum {
    SEG_GROUP = 16,   /* segments (chunks) per group: bounds the snapshot memory */
    KEY_TILE = 64,    /* keys per tile of the Local online softmax */
    TOK_BLOCK = 64,   /* query tokens per block of the Local softmax */
};

typedef struct {
    int R;             /* ring slots per KV head: 2C */
    float *k, *v;      /* [Hk][R][D] */
    float *S;          /* [H][2F][D] */
    float *z;          /* [H][2F] */
} lolcats_state;

/* The parameter layout (src/kinds/still/attn_still_rules.h: the GPU runs lolcats through still's kernels). */
static size_t lol_param_count(const attn_config *c) { return lolcats_par_count(c->n_head, c->head_dim, c->feature_dim); }
static size_t lol_w(const attn_config *c, int side, int h) {
    return lolcats_par_w(c->n_head, c->head_dim, c->feature_dim, side, h);
}
static size_t lol_factor(const attn_config *c, int h) {
    return lolcats_par_factor(c->n_head, c->head_dim, c->feature_dim, h);
}

static void lol_param_init(const attn_config *c, float *params, uint64_t seed) {
    const size_t H = (size_t)c->n_head, D = (size_t)c->head_dim, F = (size_t)c->feature_dim;
    uint64_t s = seed ^ 0x6c6f6c6361747321ULL;   /* "lolcats!" */
    /* torch's fan_in of the stacked (H, D, F) tensor is D·F. */
    attn_kaiming_uniform(params, 2 * H * D * F, D * F, &s);
    for (size_t h = 0; h < H; h++) params[lol_factor(c, (int)h)] = -2.197f;
}

static size_t lol_ring_floats(const attn_config *c, const lolcats_state *st) {
    return (size_t)c->n_head_kv * (size_t)st->R * (size_t)c->head_dim;
}

static size_t lol_lin_floats(const attn_config *c) {
    return (size_t)c->n_head * 2 * (size_t)c->feature_dim * ((size_t)c->head_dim + 1);
}

static void lol_free(attn_state *s) {
    if (!s) return;
    lolcats_state *st = s->impl;
    if (st) free(st->k), free(st->v), free(st->S), free(st);
    free(s);
}

static int lol_create(const attn_config *c, attn_state **out, still_err *err) {
    *out = NULL;
    if (c->head_dim > ATT_MAX_HEAD_DIM || c->head_dim <= 0 || c->n_head <= 0 || c->n_head_kv <= 0 ||
        c->n_head % c->n_head_kv)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention shape unsupported (head dim %d, %d heads, %d KV heads)",
                          c->head_dim, c->n_head, c->n_head_kv);
    if (c->chunk <= 0) return still_fail(err, STILL_E_ARG, "lolcats needs a positive chunk size, got %d", c->chunk);
    if (c->chunk > (1 << 20)) return still_fail(err, STILL_E_ARG, "lolcats chunk size %d too large", c->chunk);
    if (c->feature_dim <= 0)
        return still_fail(err, STILL_E_ARG, "lolcats needs a positive feature dimension, got %d", c->feature_dim);
    if (c->feature_dim > (1 << 16))
        return still_fail(err, STILL_E_ARG, "lolcats feature dimension %d too large", c->feature_dim);
    attn_state *s = calloc(1, sizeof *s);
    lolcats_state *st = calloc(1, sizeof *st);
    if (!s || !st) {
        free(s), free(st);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    s->cfg = *c;
    s->impl = st;
    /* 2C slots; fewer when the whole context fits (positions < n_ctx never collide). */
    st->R = c->n_ctx < 2 * c->chunk ? (c->n_ctx > 0 ? c->n_ctx : 1) : 2 * c->chunk;
    const size_t nr = lol_ring_floats(c, st), nl = lol_lin_floats(c);
    st->k = malloc(nr * sizeof(float));
    st->v = malloc(nr * sizeof(float));
    st->S = calloc(nl, sizeof(float));
    if (!st->k || !st->v || !st->S) {
        lol_free(s);
        return still_fail(err, STILL_E_NOMEM, "out of memory allocating the lolcats state (%.1f MiB)",
                          (2.0 * nr + nl) * sizeof(float) / 1048576.0);
    }
    st->z = st->S + (size_t)c->n_head * 2 * c->feature_dim * c->head_dim;
    *out = s;
    return STILL_OK;
}

static int lol_truncate(attn_state *s, int n, still_err *err) {
    if (n == s->n_seen) return STILL_OK;
    if (n != 0)
        return still_fail(err, STILL_E_ARG,
                          "cannot truncate a %d-token lolcats state to %d tokens (only to 0 or %d: history is folded)",
                          s->n_seen, n, s->n_seen);
    lolcats_state *st = s->impl;
    memset(st->S, 0, lol_lin_floats(&s->cfg) * sizeof(float));
    s->n_seen = 0;
    return STILL_OK;
}

static size_t lol_bytes(const attn_state *s) {
    return (2 * lol_ring_floats(&s->cfg, s->impl) + lol_lin_floats(&s->cfg)) * sizeof(float);
}

static int lol_regions(attn_state *s, attn_region *out, int max) {
    lolcats_state *st = s->impl;
    if (max < 3) return -1;
    const size_t nr = lol_ring_floats(&s->cfg, st) * sizeof(float);
    out[0] = (attn_region){st->k, nr}, out[1] = (attn_region){st->v, nr};
    out[2] = (attn_region){st->S, lol_lin_floats(&s->cfg) * sizeof(float)};   /* S and z */
    return 3;
}

/* Row of KV head hk at position pos: from the input if pos >= p0 (this
 * call's tokens), else from the ring (one of the last 2C positions). */
static inline const float *kv_row(const float *ring, const float *in, int p0, int pos, int hk, int Hk, int D, int R) {
    if (pos >= p0) return in + ((size_t)(pos - p0) * Hk + hk) * D;
    return ring + ((size_t)hk * R + pos % R) * D;
}

typedef struct {
    int a, b, c;      /* positions a .. b-1 of chunk c */
    int fold;         /* chunk c - 2 leaves Local when this segment starts */
} segment;

/* ΔS = Σ_j φk(k_j) v_jᵀ, Δz = Σ_j φk(k_j) over chunk f = seg->c - 2, head h. */
static void fold_chunk(const attn_config *c, const lolcats_state *st, const float *hkW, const attn_io *io, int f,
                       int h, float *dS, float *dz, float *phi) {
    const int D = c->head_dim, F = c->feature_dim, F2 = 2 * F, Hk = c->n_head_kv, C = c->chunk;
    const int hk = h / (c->n_head / Hk);
    const float *W = hkW + (size_t)h * D * F;
    memset(dS, 0, sizeof(float) * (size_t)F2 * D);
    memset(dz, 0, sizeof(float) * (size_t)F2);
    for (int pos = f * C; pos < (f + 1) * C; pos++) {
        const float *kr = kv_row(st->k, io->k, io->p0, pos, hk, Hk, D, st->R);
        const float *vr = kv_row(st->v, io->v, io->p0, pos, hk, Hk, D, st->R);
        attn_hedgehog(kr, W, D, F, phi);
        for (int i = 0; i < F2; i++) {
            const float p = phi[i];
            float *row = dS + (size_t)i * D;
            dz[i] += p;
#pragma omp simd
            for (int d = 0; d < D; d++) row[d] += p * vr[d];
        }
    }
}

/* Per-thread scratch floats of segment_out. */
static size_t out_scratch_floats(const attn_config *c) {
    const size_t D = (size_t)c->head_dim;
    return 2 * (size_t)c->feature_dim + (size_t)TOK_BLOCK * (2 * D + 3) + 2 * (size_t)KEY_TILE * D;
}

/* Outputs of the tokens of one segment for query head h, with the linear
 * state snapshot S [2F][D], z [2F] (NULL: empty history). Tokens go in blocks
 * of TOK_BLOCK; for each block the Local keys (lo .. last token) are gathered
 * tile by tile (keys transposed [D][KEY_TILE], values [KEY_TILE][D]) and each
 * token's online softmax (m, l, O) is updated with the tile. */
static void segment_out(const attn_config *c, const lolcats_state *st, const float *hqW, float gamma,
                        const attn_io *io, const segment *sg, int h, const float *S, const float *z, float *out,
                        float *scratch) {
    const int D = c->head_dim, F = c->feature_dim, F2 = 2 * F, H = c->n_head, Hk = c->n_head_kv, C = c->chunk;
    const int hk = h / (H / Hk), qd = H * D, p0 = io->p0;
    const float scale = attn_logit_scale(D);
    const float *W = hqW + (size_t)h * D * F;
    float *phq = scratch, *num = phq + F2, *O = num + (size_t)TOK_BLOCK * D, *den = O + (size_t)TOK_BLOCK * D;
    float *m = den + TOK_BLOCK, *l = m + TOK_BLOCK, *kt = l + TOK_BLOCK, *vt = kt + (size_t)KEY_TILE * D;
    const int lo = sg->c > 0 ? (sg->c - 1) * C : 0;
    for (int t0 = sg->a; t0 < sg->b; t0 += TOK_BLOCK) {
        const int nt = sg->b - t0 < TOK_BLOCK ? sg->b - t0 : TOK_BLOCK;
        /* linear part: φq(q_t)ᵀ S, φq(q_t)ᵀ z */
        for (int i = 0; i < nt; i++) {
            const float *qv = io->q + (size_t)(t0 + i - p0) * qd + (size_t)h * D;
            float *nm = num + (size_t)i * D, dn = 0;
            for (int d = 0; d < D; d++) nm[d] = 0;
            if (S) {
                attn_hedgehog(qv, W, D, F, phq);
                for (int f = 0; f < F2; f++) {
                    const float p = phq[f];
                    const float *row = S + (size_t)f * D;
                    dn += p * z[f];
#pragma omp simd
                    for (int d = 0; d < D; d++) nm[d] += p * row[d];
                }
            }
            den[i] = dn;
            m[i] = -INFINITY, l[i] = 0;
        }
        memset(O, 0, sizeof(float) * (size_t)nt * D);
        /* Local part: keys lo .. t0+nt-1, tile by tile */
        for (int j0 = lo; j0 < t0 + nt; j0 += KEY_TILE) {
            const int nj = t0 + nt - j0 < KEY_TILE ? t0 + nt - j0 : KEY_TILE;
            for (int j = 0; j < nj; j++) {
                const float *kr = kv_row(st->k, io->k, p0, j0 + j, hk, Hk, D, st->R);
                for (int d = 0; d < D; d++) kt[(size_t)d * KEY_TILE + j] = kr[d];
                memcpy(vt + (size_t)j * D, kv_row(st->v, io->v, p0, j0 + j, hk, Hk, D, st->R), sizeof(float) * D);
            }
            for (int j = nj; j < KEY_TILE; j++)
                for (int d = 0; d < D; d++) kt[(size_t)d * KEY_TILE + j] = 0;
            for (int i = 0; i < nt; i++) {
                const int t = t0 + i, jh = t - j0 + 1 < nj ? t - j0 + 1 : nj;   /* keys j0 .. j0+jh-1 <= t */
                if (jh <= 0) continue;
                const float *qv = io->q + (size_t)(t - p0) * qd + (size_t)h * D;
                float sc[KEY_TILE] = {0};
                for (int d = 0; d < D; d++) {
                    const float qx = qv[d];
                    const float *kd = kt + (size_t)d * KEY_TILE;
#pragma omp simd
                    for (int j = 0; j < KEY_TILE; j++) sc[j] += qx * kd[j];
                }
                float mx = m[i];
                for (int j = 0; j < jh; j++) {
                    sc[j] *= scale;
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                const float corr = vec_expf(m[i] - mx);   /* 0 on the first tile */
                float sum = 0;
                for (int j = 0; j < jh; j++) {
                    sc[j] = vec_expf(sc[j] - mx);
                    sum += sc[j];
                }
                float *o = O + (size_t)i * D;
                for (int d = 0; d < D; d++) o[d] *= corr;
                for (int j = 0; j < jh; j++) {
                    const float p = sc[j];
                    const float *vr = vt + (size_t)j * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) o[d] += p * vr[d];
                }
                l[i] = l[i] * corr + sum;
                m[i] = mx;
            }
        }
        for (int i = 0; i < nt; i++) {
            const float inv = 1.0f / still_den(gamma * l[i], 1.0f, den[i], 0);
            const float *o = O + (size_t)i * D, *nm = num + (size_t)i * D;
            float *dst = out + (size_t)(t0 + i - p0) * qd + (size_t)h * D;
            for (int d = 0; d < D; d++) dst[d] = (gamma * o[d] + nm[d]) * inv;
        }
    }
}

static int lol_forward(attn_state *s, const float *params, const attn_io *io, float *out, still_err *err) {
    lolcats_state *st = s->impl;
    const attn_config *c = &s->cfg;
    if (io->p0 != s->n_seen)
        return still_fail(err, STILL_E_STATE, "attention state holds %d tokens, input starts at %d", s->n_seen, io->p0);
    if (io->T < 0) return still_fail(err, STILL_E_ARG, "negative token count %d", io->T);
    if (io->p0 + io->T > c->n_ctx)
        return still_fail(err, STILL_E_STATE, "attention state full (%d + %d > %d tokens)", io->p0, io->T, c->n_ctx);
    if (!params) return still_fail(err, STILL_E_ARG, "lolcats needs its parameters (feature maps, window factors)");
    if (io->T == 0) return STILL_OK;

    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, F = c->feature_dim, F2 = 2 * F, C = c->chunk;
    const int p0 = io->p0, T = io->T;
    const float *hqW = params + lol_w(c, 0, 0), *hkW = params + lol_w(c, 1, 0), *wl = params + lol_factor(c, 0);
    const int c_first = p0 / C, c_last = (p0 + T - 1) / C, ns = c_last - c_first + 1;
    const int group = ns < SEG_GROUP ? ns : SEG_GROUP;
    const size_t lin1 = (size_t)F2 * D + F2;   /* one head's S and z */
    const int n_threads = omp_get_max_threads();
    const size_t per_thread = out_scratch_floats(c);

    segment *seg = malloc(sizeof(segment) * (size_t)ns);
    float *snap = malloc(sizeof(float) * (size_t)group * H * lin1);
    float *scratch = malloc(sizeof(float) * (size_t)n_threads * per_thread);
    float *phi = malloc(sizeof(float) * (size_t)n_threads * F2);
    if (!seg || !snap || !scratch || !phi) {
        free(seg), free(snap), free(scratch), free(phi);
        return still_fail(err, STILL_E_NOMEM, "out of memory in lolcats forward");
    }
    for (int i = 0; i < ns; i++) {
        const int cc = c_first + i;
        seg[i].c = cc;
        seg[i].a = cc * C > p0 ? cc * C : p0;
        seg[i].b = (cc + 1) * C < p0 + T ? (cc + 1) * C : p0 + T;
        seg[i].fold = cc >= 2 && seg[i].a == cc * C;
    }

    for (int g0 = 0; g0 < ns; g0 += group) {
        const int ng = ns - g0 < group ? ns - g0 : group;
        const int items = ng * H;
        /* A: folds of the chunks leaving Local, ΔS into the snapshots */
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
        for (int it = 0; it < items; it++) {
            const int i = it / H, h = it % H;
            const segment *sg = &seg[g0 + i];
            if (!sg->fold) continue;
            float *dS = snap + ((size_t)i * H + h) * lin1;
            fold_chunk(c, st, hkW, io, sg->c - 2, h, dS, dS + (size_t)F2 * D, phi + (size_t)omp_get_thread_num() * F2);
        }
        /* B: scan across the group's segments, snapshot per segment */
#pragma omp parallel for schedule(static) num_threads(n_threads < H ? n_threads : H)
        for (int h = 0; h < H; h++) {
            float *Sh = st->S + (size_t)h * F2 * D, *zh = st->z + (size_t)h * F2;
            for (int i = 0; i < ng; i++) {
                float *sn = snap + ((size_t)i * H + h) * lin1;
                if (seg[g0 + i].fold) {
                    for (size_t x = 0; x < (size_t)F2 * D; x++) Sh[x] += sn[x];
                    for (int x = 0; x < F2; x++) zh[x] += sn[(size_t)F2 * D + x];
                }
                memcpy(sn, Sh, sizeof(float) * (size_t)F2 * D);
                memcpy(sn + (size_t)F2 * D, zh, sizeof(float) * (size_t)F2);
            }
        }
        /* C: outputs */
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
        for (int it = 0; it < items; it++) {
            const int i = it / H, h = it % H;
            const segment *sg = &seg[g0 + i];
            const float *sn = snap + ((size_t)i * H + h) * lin1;
            const int has_hist = sg->c >= 2;
            segment_out(c, st, hqW, attn_sigmoid(wl[h]), io, sg, h, has_hist ? sn : NULL,
                        has_hist ? sn + (size_t)F2 * D : NULL, out, scratch + (size_t)omp_get_thread_num() * per_thread);
        }
    }

    /* Keep the last 2C positions' keys and values. */
    const int kvd = Hk * D;
    for (int pos = p0 + T - st->R > p0 ? p0 + T - st->R : p0; pos < p0 + T; pos++)
        for (int hk = 0; hk < Hk; hk++) {
            const size_t dst = ((size_t)hk * st->R + pos % st->R) * D, src = (size_t)(pos - p0) * kvd + (size_t)hk * D;
            memcpy(st->k + dst, io->k + src, sizeof(float) * (size_t)D);
            memcpy(st->v + dst, io->v + src, sizeof(float) * (size_t)D);
        }
    s->n_seen += T;
    free(seg), free(snap), free(scratch), free(phi);
    return STILL_OK;
}

/* ---- Backward (stage-1 training) ------------------------------------------
 *
 * For one query head h (KV head h / G) and token t, with the Local softmax
 * terms O_t = Σ_{Local} e^{s_tj - m_t} v_j and l_t = Σ_{Local} e^{s_tj - m_t}
 * (no parameters in them), φq_t = φq(q_t), S_t, z_t the sums over Hist(t):
 *
 *   N_t = γ O_t + S_tᵀ φq_t,  Z_t = γ l_t + φq_tᵀ z_t + 1e-6,  y_t = N_t / Z_t.
 *
 * With g = dL/dy_t:  dN = g / Z_t,  dZ = -(g · y_t) / Z_t, and
 *   dγ     += dN · O_t + dZ l_t                    (dw = dγ γ (1 - γ))
 *   dφq_t   = S_t dN + z_t dZ
 *   dS_t    = φq_t dNᵀ,  dz_t = φq_t dZ
 *   dφk_j   = Σ_{t : c(t) >= c(j) + 2} (dS_t v_j + dz_t)   (suffix sums over chunks)
 * and through the Hedgehog map φ = clamp(softmax(xW)) ⊕ clamp(softmax(-xW)):
 * zero where clamped, otherwise the softmax Jacobian, then dW += x ⊗ dz.
 *
 * Two sweeps per head. Sweep 1 (chunks in order) keeps the running S, z
 * (chunk c - 2 folded when chunk c starts), recomputes the outputs, adds dγ
 * and the q-side gradient, and keeps φq_t, dN_t, dZ_t per token of chunks
 * >= 2. Sweep 2 (chunks in reverse) keeps the suffix sums G = Σ φq_t dN_tᵀ
 * [2F][D], gz = Σ φq_t dZ_t [2F] over the tokens of chunks >= c + 2 and
 * gives the k-side gradient of chunk c's keys. Memory O(T (2F + D)) per
 * thread; work O(T·2C·D + T·2F·D) per head. Parallel over heads (each head
 * owns its slices of dparams). */

/* dW [D][F] += x ⊗ dz, dz the gradient of z = x W through the clamped
 * Hedgehog map, given dphi [2F]. Recomputes softmax(±xW) exactly as
 * attn_hedgehog does, so the clamp decisions match the forward. tmp: 4F. */
static void hedgehog_backward(const float *x, const float *W, int D, int F, const float *dphi, float *dW, float *tmp) {
    float *p = tmp, *pn = tmp + F, *dz = tmp + 2 * F;
    for (int f = 0; f < F; f++) p[f] = 0;
    for (int d = 0; d < D; d++) {
        const float xd = x[d];
        const float *wr = W + (size_t)d * F;
#pragma omp simd
        for (int f = 0; f < F; f++) p[f] += xd * wr[f];
    }
    for (int f = 0; f < F; f++) pn[f] = -p[f];
    attn_softmax_inplace(p, F);
    attn_softmax_inplace(pn, F);
    double sp = 0, sn = 0;   /* Σ p g, Σ pn gn over the entries not clamped */
    for (int f = 0; f < F; f++) {
        if (!(p[f] < STILL_FMAP_CLAMP)) sp += (double)p[f] * dphi[f];
        if (!(pn[f] < STILL_FMAP_CLAMP)) sn += (double)pn[f] * dphi[F + f];
    }
    for (int f = 0; f < F; f++) {
        const float g = p[f] < STILL_FMAP_CLAMP ? 0.0f : dphi[f], gn = pn[f] < STILL_FMAP_CLAMP ? 0.0f : dphi[F + f];
        dz[f] = p[f] * (g - (float)sp) - pn[f] * (gn - (float)sn);
    }
    for (int d = 0; d < D; d++) {
        const float xd = x[d];
        float *dr = dW + (size_t)d * F;
#pragma omp simd
        for (int f = 0; f < F; f++) dr[f] += xd * dz[f];
    }
}

/* Σ a[i] b[i] over n entries, in 16 lanes (vectorizes without -ffast-math). */
static inline float dot_f(const float *a, const float *b, int n) {
    float acc[16] = {0}, s = 0;
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* Per-thread scratch floats of head_backward. */
static size_t bwd_scratch_floats(const attn_config *c, int T) {
    const size_t D = (size_t)c->head_dim, F2 = 2 * (size_t)c->feature_dim;
    return (size_t)T * (F2 + D + 1)    /* φq_t, dN_t, dZ_t */
           + F2 * D + F2               /* S, z (sweep 2: G, gz) */
           + 2 * F2 + 3 * D            /* φ, dφ, O, y, dN of one token */
           + 2 * (size_t)c->chunk      /* its Local scores */
           + 2 * F2                    /* hedgehog_backward's tmp (4F) */
           + D * F2;                   /* this head's dWq, dWk [D][F] each */
}

static void head_backward(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                          float *dparams, int h, float *scratch) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, F = c->feature_dim, F2 = 2 * F, C = c->chunk;
    const int T = io->T, hk = h / (H / Hk), qd = H * D, kvd = Hk * D;
    const size_t WF = (size_t)D * F;
    const float *Wq = params + lol_w(c, 0, h), *Wk = params + lol_w(c, 1, h);
    const float w = params[lol_factor(c, h)], gamma = attn_sigmoid(w);
    const float scale = attn_logit_scale(D);

    float *phq_all = scratch, *dN_all = phq_all + (size_t)T * F2, *dZ_all = dN_all + (size_t)T * D;
    float *S = dZ_all + T, *z = S + (size_t)F2 * D, *phi = z + F2, *dphi = phi + F2, *O = dphi + F2, *y = O + D;
    float *dN = y + D, *tmp = dN + D, *dWq = tmp + 2 * F2, *dWk = dWq + WF, *sc = dWk + WF;
    const int nc = T > 0 ? (T - 1) / C + 1 : 0;
    double dgamma = 0;
    memset(dWq, 0, sizeof(float) * 2 * WF);

    /* Sweep 1: chunks in order. */
    memset(S, 0, sizeof(float) * ((size_t)F2 * D + F2));
    for (int cc = 0; cc < nc; cc++) {
        if (cc >= 2)   /* chunk cc - 2 leaves Local: fold it */
            for (int j = (cc - 2) * C; j < (cc - 1) * C; j++) {
                const float *kr = io->k + (size_t)j * kvd + (size_t)hk * D, *vr = io->v + (size_t)j * kvd + (size_t)hk * D;
                attn_hedgehog(kr, Wk, D, F, phi);
                for (int f = 0; f < F2; f++) {
                    z[f] += phi[f];
#pragma omp simd
                    for (int d = 0; d < D; d++) S[(size_t)f * D + d] += phi[f] * vr[d];
                }
            }
        const int lo = cc > 0 ? (cc - 1) * C : 0, t1 = (cc + 1) * C < T ? (cc + 1) * C : T;
        for (int t = cc * C; t < t1; t++) {
            const float *qv = io->q + (size_t)t * qd + (size_t)h * D, *g = dout + (size_t)t * qd + (size_t)h * D;
            /* Local softmax terms, m_t = max over Local(t) */
            float m = -INFINITY, l = 0;
            for (int j = lo; j <= t; j++) {
                const float s = dot_f(qv, io->k + (size_t)j * kvd + (size_t)hk * D, D) * scale;
                sc[j - lo] = s;
                m = s > m ? s : m;
            }
            for (int d = 0; d < D; d++) O[d] = 0;
            for (int j = lo; j <= t; j++) {
                const float *vr = io->v + (size_t)j * kvd + (size_t)hk * D;
                const float e = vec_expf(sc[j - lo] - m);
                l += e;
#pragma omp simd
                for (int d = 0; d < D; d++) O[d] += e * vr[d];
            }
            /* linear terms over Hist(t) (empty for chunks 0 and 1) */
            float den = 0;
            for (int d = 0; d < D; d++) y[d] = gamma * O[d];
            if (cc >= 2) {
                attn_hedgehog(qv, Wq, D, F, phi);
                for (int f = 0; f < F2; f++) {
                    den += phi[f] * z[f];
#pragma omp simd
                    for (int d = 0; d < D; d++) y[d] += phi[f] * S[(size_t)f * D + d];
                }
            }
            const float Z = still_den(gamma * l, 1.0f, den, 0), inv = 1.0f / Z;
            float gy = 0;
            for (int d = 0; d < D; d++) {
                y[d] *= inv;
                gy += g[d] * y[d];
                dN[d] = g[d] * inv;
            }
            const float dZ = -gy * inv;
            double dg = (double)dZ * l;
            for (int d = 0; d < D; d++) dg += (double)dN[d] * O[d];
            dgamma += dg;
            if (cc >= 2) {
                /* q side: dφq = S dN + z dZ */
                for (int f = 0; f < F2; f++) dphi[f] = z[f] * dZ + dot_f(S + (size_t)f * D, dN, D);
                hedgehog_backward(qv, Wq, D, F, dphi, dWq, tmp);
                memcpy(phq_all + (size_t)t * F2, phi, sizeof(float) * F2);
                memcpy(dN_all + (size_t)t * D, dN, sizeof(float) * D);
                dZ_all[t] = dZ;
            }
        }
    }
    dparams[lol_factor(c, h)] += (float)(dgamma * gamma * (1.0 - gamma));

    /* Sweep 2: chunks in reverse; G, gz (in S, z) hold the sums over the
     * queries of chunks >= cc + 2, which see chunk cc in their history. */
    float *G = S, *gz = z;
    memset(G, 0, sizeof(float) * ((size_t)F2 * D + F2));
    for (int cc = nc - 3; cc >= 0; cc--) {
        const int q1 = (cc + 3) * C < T ? (cc + 3) * C : T;
        for (int t = (cc + 2) * C; t < q1; t++) {
            const float *ph = phq_all + (size_t)t * F2, *dn = dN_all + (size_t)t * D;
            for (int f = 0; f < F2; f++) {
                gz[f] += ph[f] * dZ_all[t];
#pragma omp simd
                for (int d = 0; d < D; d++) G[(size_t)f * D + d] += ph[f] * dn[d];
            }
        }
        for (int j = cc * C; j < (cc + 1) * C; j++) {
            const float *kr = io->k + (size_t)j * kvd + (size_t)hk * D, *vr = io->v + (size_t)j * kvd + (size_t)hk * D;
            for (int f = 0; f < F2; f++)   /* dφk_j = G v_j + gz */
                dphi[f] = gz[f] + dot_f(G + (size_t)f * D, vr, D);
            hedgehog_backward(kr, Wk, D, F, dphi, dWk, tmp);
        }
    }
    /* accumulate this head's gradient into dparams */
    float *gq = dparams + lol_w(c, 0, h), *gk = dparams + lol_w(c, 1, h);
    for (size_t i = 0; i < WF; i++) gq[i] += dWq[i], gk[i] += dWk[i];
}

static int lol_backward(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                        float *dparams, still_err *err) {
    if (c->head_dim <= 0 || c->n_head <= 0 || c->n_head_kv <= 0 || c->n_head % c->n_head_kv)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention shape unsupported (head dim %d, %d heads, %d KV heads)",
                          c->head_dim, c->n_head, c->n_head_kv);
    if (c->chunk <= 0 || c->chunk > (1 << 20))
        return still_fail(err, STILL_E_ARG, "lolcats chunk size %d out of range", c->chunk);
    if (c->feature_dim <= 0 || c->feature_dim > (1 << 16))
        return still_fail(err, STILL_E_ARG, "lolcats feature dimension %d out of range", c->feature_dim);
    if (io->p0 != 0)
        return still_fail(err, STILL_E_ARG, "lolcats backward needs a whole sequence (p0 = 0), got p0 = %d", io->p0);
    if (io->T < 0) return still_fail(err, STILL_E_ARG, "negative token count %d", io->T);
    if (!params || !dparams) return still_fail(err, STILL_E_ARG, "lolcats backward needs params and dparams");
    if (io->T == 0) return STILL_OK;
    if (!io->q || !io->k || !io->v || !dout) return still_fail(err, STILL_E_ARG, "lolcats backward: missing q, k, v or dout");

    const int H = c->n_head;
    const int n_threads = omp_get_max_threads() < H ? omp_get_max_threads() : H;
    const size_t per_thread = bwd_scratch_floats(c, io->T);
    float *scratch = malloc(sizeof(float) * (size_t)n_threads * per_thread);
    if (!scratch)
        return still_fail(err, STILL_E_NOMEM, "out of memory in lolcats backward (%.1f MiB)",
                          (double)n_threads * per_thread * sizeof(float) / 1048576.0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int h = 0; h < H; h++)
        head_backward(c, params, io, dout, dparams, h, scratch + (size_t)omp_get_thread_num() * per_thread);
    free(scratch);
    return STILL_OK;
}

/* ---- Backward of the inputs (stage 2) --------------------------------------
 *
 * The quantities of backward above, now also differentiated with respect to
 * q, k and v, a chunk at a time with BLAS products. For query head h, chunk c
 * (queries t0 .. t1-1) and its Local keys lo .. t1-1 (lo = (c-1) C):
 *   logits  Ŝ = Q Kᵀ / sqrt(D), masked to j <= t; m_t = max_j Ŝ_tj, reached
 *           at key a_t; E = exp(Ŝ - m) (0 where masked), l = rowsum E, O = E V;
 *   linear  Φq = φq(Q), num = Φq S, den = Φq z (S, z over Hist: chunks <= c-2);
 *   y = (γ O + num) / Z,  Z = γ l + den + 1e-6,  dN = g / Z,  dZ = -(g · y) / Z.
 * Local part: dE = γ (dN Vᵀ + dZ 1ᵀ) and, holding m fixed, dŜ = E ⊙ dE. The
 * linear terms are not rescaled by e^{-m}, so y depends on m, and m moves
 * with the logit of a_t alone: ∂y/∂m = -Σ_j (∂y/∂Ŝ_tj at fixed m), i.e.
 * dŜ_{t,a_t} -= Σ_j dŜ_tj. Then
 *   dQ += dŜ K / sqrt(D),  dK_Local += dŜᵀ Q / sqrt(D),  dV_Local += γ Eᵀ dN.
 * Linear part, query side: dΦq = dN Sᵀ + dZ zᵀ, through the Hedgehog map
 * into dQ (and dWq). Key side: chunk c's keys are in the history of the
 * queries of chunks >= c + 2, whose sums
 *   Gs = Σ Φq_tᵀ dN_t [2F][D],  gz = Σ Φq_tᵀ dZ_t [2F]
 * give dΦk = V Gsᵀ + 1 gzᵀ and dV += Φk Gs, and dΦk goes through the
 * Hedgehog map into dK (and dWk). Sweep 1 (chunks in order) keeps the
 * running S, z, does everything but the key side of the linear part and
 * keeps each chunk's ΔGs = Φqᵀ dN, Δgz = Φqᵀ dZ; sweep 2 (chunks in reverse)
 * sums them into Gs, gz and does the key side.
 *
 * Hedgehog map of rows X (n × D): Zh = X W, φ = clamp(softmax(Zh)) ⊕
 * clamp(softmax(-Zh)). Given dφ, with p, pn the softmaxes before the clamp
 * and clamped entries passing no gradient (as hedgehog_backward does), per row
 *   dZh = p ⊙ (dφ⁺ - Σ p dφ⁺) - pn ⊙ (dφ⁻ - Σ pn dφ⁻),
 *   dX += dZh Wᵀ,  dW += Xᵀ dZh.
 * dγ and dw are as in backward.
 *
 * Parallel over query heads: each head owns its rows of dq and its slices
 * of dparams and writes its keys' and values' gradients into [T][D] buffers
 * of its own, summed over the G heads of each KV head in a fixed order at
 * the end, so the result does not depend on the thread count. Memory per
 * head: 2 T D floats (those buffers) and, per thread, (T / C) 2F (D + 1)
 * floats (the ΔGs, Δgz) plus one chunk's tiles. */

/* P [n][2F]: softmax(Zh) ⊕ softmax(-Zh) of rows X (stride ldx), Zh = X W,
 * before the clamp; Phi [n][2F]: the same clamped at >= 1e-12 (= φ). */
static void hedgehog_rows(const float *X, int ldx, int n, const float *W, int D, int F, float *P, float *Phi) {
    const int F2 = 2 * F;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, F, D, 1.0f, X, ldx, W, F, 0.0f, P, F2);
    for (int i = 0; i < n; i++) {
        float *p = P + (size_t)i * F2, *ph = Phi + (size_t)i * F2;
        for (int f = 0; f < F; f++) p[F + f] = -p[f];
        attn_softmax_inplace(p, F);
        attn_softmax_inplace(p + F, F);
        for (int f = 0; f < F2; f++) ph[f] = p[f] < STILL_FMAP_CLAMP ? STILL_FMAP_CLAMP : p[f];
    }
}

/* dZh [n][F] of the Hedgehog map from P (hedgehog_rows) and dPhi [n][2F]. */
static void hedgehog_rows_backward(const float *P, const float *dPhi, int n, int F, float *dZh) {
    const int F2 = 2 * F;
    for (int i = 0; i < n; i++) {
        const float *p = P + (size_t)i * F2, *pn = p + F, *g = dPhi + (size_t)i * F2, *gn = g + F;
        float *dz = dZh + (size_t)i * F;
        double sp = 0, sn = 0;   /* Σ p g, Σ pn gn over the entries not clamped */
        for (int f = 0; f < F; f++) {
            if (!(p[f] < STILL_FMAP_CLAMP)) sp += (double)p[f] * g[f];
            if (!(pn[f] < STILL_FMAP_CLAMP)) sn += (double)pn[f] * gn[f];
        }
        for (int f = 0; f < F; f++) {
            const float a = p[f] < STILL_FMAP_CLAMP ? 0.0f : g[f], b = pn[f] < STILL_FMAP_CLAMP ? 0.0f : gn[f];
            dz[f] = p[f] * (a - (float)sp) - pn[f] * (b - (float)sn);
        }
    }
}

/* Per-thread scratch floats of head_backward_inputs. */
static size_t bin_scratch_floats(const attn_config *c, int T) {
    const size_t C = (size_t)c->chunk, D = (size_t)c->head_dim, F2 = 2 * (size_t)c->feature_dim;
    const size_t nc = ((size_t)T + C - 1) / C;
    return nc * (F2 * D + F2)       /* ΔGs, Δgz per chunk */
           + F2 * D + F2            /* S, z; sweep 2: Gs, gz */
           + 2 * C * 2 * C          /* E, dE (dŜ) of one chunk's Local logits */
           + 3 * C * D              /* O, num, dN */
           + 3 * C                  /* l, den, dZ */
           + 3 * C * F2             /* P, Phi, dPhi */
           + C * F2 / 2;            /* dZh */
}

static void head_backward_inputs(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                                 const attn_grads *gr, float *dkh, float *dvh, int h, float *ws, int *amax) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, F = c->feature_dim, F2 = 2 * F, C = c->chunk;
    const int T = io->T, hk = h / (H / Hk), qd = H * D, kvd = Hk * D, C2 = 2 * C;
    const size_t lin1 = (size_t)F2 * D + F2;
    const float *Wq = params + lol_w(c, 0, h), *Wk = params + lol_w(c, 1, h);
    const float gamma = attn_sigmoid(params[lol_factor(c, h)]);
    const float scale = attn_logit_scale(D);
    const float *Q = io->q + (size_t)h * D, *K = io->k + (size_t)hk * D, *V = io->v + (size_t)hk * D;
    const float *Gin = dout + (size_t)h * D;
    float *dq = gr->dq ? gr->dq + (size_t)h * D : NULL;
    float *dWq = gr->dparams ? gr->dparams + lol_w(c, 0, h) : NULL;
    float *dWk = gr->dparams ? gr->dparams + lol_w(c, 1, h) : NULL;
    const int nc = (T + C - 1) / C;

    float *dG = ws, *S = dG + (size_t)nc * lin1, *z = S + (size_t)F2 * D, *E = z + F2, *dE = E + (size_t)C * C2;
    float *O = dE + (size_t)C * C2, *num = O + (size_t)C * D, *dN = num + (size_t)C * D, *l = dN + (size_t)C * D;
    float *den = l + C, *dZ = den + C, *P = dZ + C, *Phi = P + (size_t)C * F2, *dPhi = Phi + (size_t)C * F2;
    float *dZh = dPhi + (size_t)C * F2;
    double dgamma = 0;

    /* Sweep 1: chunks in order. */
    memset(S, 0, sizeof(float) * lin1);
    for (int cc = 0; cc < nc; cc++) {
        if (cc >= 2) {   /* chunk cc - 2 leaves Local: S += Φkᵀ V, z += Σ Φk */
            const size_t f0 = (size_t)(cc - 2) * C;
            hedgehog_rows(K + f0 * kvd, kvd, C, Wk, D, F, P, Phi);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F2, D, C, 1.0f, Phi, F2, V + f0 * kvd, kvd, 1.0f, S,
                        D);
            for (int i = 0; i < C; i++)
                for (int f = 0; f < F2; f++) z[f] += Phi[(size_t)i * F2 + f];
        }
        const int t0 = cc * C, t1 = t0 + C < T ? t0 + C : T, nq = t1 - t0;
        const int lo = cc > 0 ? (cc - 1) * C : 0, nk = t1 - lo;
        const float *Qc = Q + (size_t)t0 * qd, *Kl = K + (size_t)lo * kvd, *Vl = V + (size_t)lo * kvd;
        /* Local softmax terms */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, D, scale, Qc, qd, Kl, kvd, 0.0f, E, C2);
        for (int i = 0; i < nq; i++) {
            float *e = E + (size_t)i * C2;
            const int nv = t0 + i - lo + 1;   /* keys lo .. t */
            int a = 0;
            for (int j = 1; j < nv; j++) a = e[j] > e[a] ? j : a;
            const float m = e[a];
            float sum = 0;
            for (int j = 0; j < nv; j++) {
                e[j] = vec_expf(e[j] - m);
                sum += e[j];
            }
            for (int j = nv; j < nk; j++) e[j] = 0;
            l[i] = sum, amax[i] = a;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, D, nk, 1.0f, E, C2, Vl, kvd, 0.0f, O, D);
        /* linear terms over Hist */
        if (cc >= 2) {
            hedgehog_rows(Qc, qd, nq, Wq, D, F, P, Phi);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, D, F2, 1.0f, Phi, F2, S, D, 0.0f, num, D);
            for (int i = 0; i < nq; i++) {
                float dn = 0;
                for (int f = 0; f < F2; f++) dn += Phi[(size_t)i * F2 + f] * z[f];
                den[i] = dn;
            }
        } else {
            memset(num, 0, sizeof(float) * (size_t)nq * D);
            for (int i = 0; i < nq; i++) den[i] = 0;
        }
        /* y, dN, dZ, dγ */
        for (int i = 0; i < nq; i++) {
            const float *g = Gin + (size_t)(t0 + i) * qd, *o = O + (size_t)i * D, *nm = num + (size_t)i * D;
            float *dn = dN + (size_t)i * D;
            const float Z = still_den(gamma * l[i], 1.0f, den[i], 0), inv = 1.0f / Z;
            float gy = 0;
            for (int d = 0; d < D; d++) {
                gy += g[d] * (gamma * o[d] + nm[d]) * inv;
                dn[d] = g[d] * inv;
            }
            dZ[i] = -gy * inv;
            double dg = (double)dZ[i] * l[i];
            for (int d = 0; d < D; d++) dg += (double)dn[d] * o[d];
            dgamma += dg;
        }
        /* Local part: dŜ = E ⊙ γ (dN Vᵀ + dZ), then the max's share */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, D, gamma, dN, D, Vl, kvd, 0.0f, dE, C2);
        for (int i = 0; i < nq; i++) {
            const float *e = E + (size_t)i * C2, gz = gamma * dZ[i];
            float *ds = dE + (size_t)i * C2, r = 0;
            for (int j = 0; j < nk; j++) {
                ds[j] = e[j] * (ds[j] + gz);
                r += ds[j];
            }
            ds[amax[i]] -= r;
        }
        if (dq)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, D, nk, scale, dE, C2, Kl, kvd, 1.0f,
                        dq + (size_t)t0 * qd, qd);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, D, nq, scale, dE, C2, Qc, qd, 1.0f,
                    dkh + (size_t)lo * D, D);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, D, nq, gamma, E, C2, dN, D, 1.0f,
                    dvh + (size_t)lo * D, D);
        /* Linear part, query side; keep ΔGs, Δgz for sweep 2 */
        if (cc >= 2) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, F2, D, 1.0f, dN, D, S, D, 0.0f, dPhi, F2);
            for (int i = 0; i < nq; i++)
                for (int f = 0; f < F2; f++) dPhi[(size_t)i * F2 + f] += dZ[i] * z[f];
            hedgehog_rows_backward(P, dPhi, nq, F, dZh);
            if (dq)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, D, F, 1.0f, dZh, F, Wq, F, 1.0f,
                            dq + (size_t)t0 * qd, qd);
            if (dWq)
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, F, nq, 1.0f, Qc, qd, dZh, F, 1.0f, dWq, F);
            float *dGc = dG + (size_t)cc * lin1, *dgz = dGc + (size_t)F2 * D;
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F2, D, nq, 1.0f, Phi, F2, dN, D, 0.0f, dGc, D);
            for (int f = 0; f < F2; f++) dgz[f] = 0;
            for (int i = 0; i < nq; i++)
                for (int f = 0; f < F2; f++) dgz[f] += Phi[(size_t)i * F2 + f] * dZ[i];
        }
    }
    if (gr->dparams) gr->dparams[lol_factor(c, h)] += (float)(dgamma * gamma * (1.0 - gamma));

    /* Sweep 2: chunks in reverse; Gs, gz (in S, z) sum the ΔGs, Δgz of the
     * chunks >= cc + 2, whose queries see chunk cc (complete) in their history. */
    float *Gs = S, *gz = z;
    memset(Gs, 0, sizeof(float) * lin1);
    for (int cc = nc - 3; cc >= 0; cc--) {
        const float *dGc = dG + (size_t)(cc + 2) * lin1;
        for (size_t x = 0; x < lin1; x++) Gs[x] += dGc[x];
        const size_t j0 = (size_t)cc * C;
        const float *Kc = K + j0 * kvd, *Vc = V + j0 * kvd;
        hedgehog_rows(Kc, kvd, C, Wk, D, F, P, Phi);
        /* dΦk = V Gsᵀ + gz, dV += Φk Gs */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, C, F2, D, 1.0f, Vc, kvd, Gs, D, 0.0f, dPhi, F2);
        for (int i = 0; i < C; i++)
            for (int f = 0; f < F2; f++) dPhi[(size_t)i * F2 + f] += gz[f];
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, C, D, F2, 1.0f, Phi, F2, Gs, D, 1.0f, dvh + j0 * D, D);
        hedgehog_rows_backward(P, dPhi, C, F, dZh);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, C, D, F, 1.0f, dZh, F, Wk, F, 1.0f, dkh + j0 * D, D);
        if (dWk) cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, F, C, 1.0f, Kc, kvd, dZh, F, 1.0f, dWk, F);
    }
}

static int lol_backward_inputs(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                               const attn_grads *g, still_err *err) {
    if (c->head_dim <= 0 || c->n_head <= 0 || c->n_head_kv <= 0 || c->n_head % c->n_head_kv)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention shape unsupported (head dim %d, %d heads, %d KV heads)",
                          c->head_dim, c->n_head, c->n_head_kv);
    if (c->chunk <= 0 || c->chunk > (1 << 20))
        return still_fail(err, STILL_E_ARG, "lolcats chunk size %d out of range", c->chunk);
    if (c->feature_dim <= 0 || c->feature_dim > (1 << 16))
        return still_fail(err, STILL_E_ARG, "lolcats feature dimension %d out of range", c->feature_dim);
    if (!io || !g) return still_fail(err, STILL_E_ARG, "lolcats backward: no inputs or gradient buffers");
    if (io->p0 != 0)
        return still_fail(err, STILL_E_ARG, "lolcats backward needs a whole sequence (p0 = 0), got p0 = %d", io->p0);
    if (io->T < 0 || io->T > c->n_ctx)
        return still_fail(err, STILL_E_ARG, "lolcats backward: %d tokens, the context holds %d", io->T, c->n_ctx);
    if (!params) return still_fail(err, STILL_E_ARG, "lolcats backward needs its parameters");
    if (io->T == 0) return STILL_OK;
    if (!io->q || !io->k || !io->v || !dout)
        return still_fail(err, STILL_E_ARG, "lolcats backward: missing q, k, v or dout");

    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, T = io->T, G = H / Hk, kvd = Hk * D;
    const int n_threads = omp_get_max_threads() < H ? omp_get_max_threads() : H;
    const size_t per_thread = bin_scratch_floats(c, T), hd = (size_t)T * D;
    float *ws = malloc(sizeof(float) * (size_t)n_threads * per_thread);
    int *amax = malloc(sizeof(int) * (size_t)n_threads * c->chunk);
    float *dkv = calloc(2 * (size_t)H * hd, sizeof(float));   /* per query head: dk [T][D], dv [T][D] */
    if (!ws || !amax || !dkv) {
        free(ws), free(amax), free(dkv);
        return still_fail(err, STILL_E_NOMEM, "out of memory in lolcats backward (%.1f MiB)",
                          ((double)n_threads * per_thread + 2.0 * H * hd) * sizeof(float) / 1048576.0);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int h = 0; h < H; h++) {
        const int tid = omp_get_thread_num();
        head_backward_inputs(c, params, io, dout, g, dkv + (size_t)h * 2 * hd, dkv + (size_t)h * 2 * hd + hd, h,
                             ws + (size_t)tid * per_thread, amax + (size_t)tid * c->chunk);
    }
    /* the G query heads' shares of each KV head, in head order */
    if (g->dk || g->dv) {
#pragma omp parallel for schedule(static)
        for (int t = 0; t < T; t++)
            for (int hk = 0; hk < Hk; hk++)
                for (int x = 0; x < G; x++) {
                    const float *src = dkv + (size_t)(hk * G + x) * 2 * hd + (size_t)t * D;
                    const size_t o = (size_t)t * kvd + (size_t)hk * D;
                    if (g->dk)
                        for (int d = 0; d < D; d++) g->dk[o + d] += src[d];
                    if (g->dv)
                        for (int d = 0; d < D; d++) g->dv[o + d] += src[hd + d];
                }
    }
    free(ws), free(amax), free(dkv);
    return STILL_OK;
}

const attn_kind attn_kind_lolcats = {
    .name = "lolcats", .param_count = lol_param_count, .param_init = lol_param_init, .state_create = lol_create,
    .state_free = lol_free, .state_truncate = lol_truncate, .state_bytes = lol_bytes, .state_regions = lol_regions,
    .forward = lol_forward,
    .backward = lol_backward, .backward_inputs = lol_backward_inputs,
};
