/* The still kind: selected tokens + gated linear attention (spec:
 * ../shared/spec/attention.md, section "still"; the float64 numpy reference
 * is tests/python/ref_attention.py: still_attn).
 *
 * For query t (chunk c = t / C) and query head h (selection head hs = h, or
 * h / G with per_kv_head):
 *
 *         Σ_{A(t)} e^{s_tj - m_t} v_j + g_t ⊙ (φq(q_t)ᵀ S)
 *   y_t = -------------------------------------------------,   A(t) = Local(t) ∪ Sel_hs,
 *         Σ_{A(t)} e^{s_tj - m_t}     + φq(q_t)ᵀ z + 1e-6       m_t = max over A(t)
 *
 * Local(t) = chunk c causally + the whole chunk c-1. When chunk c' leaves
 * Local (at the first token of chunk c'+2) each selection head keeps its
 * top-n tokens of c' by routing score (n = min(λ, C, slots left)) in Sel
 * forever; every other token of c' is folded into S += φk(k) vᵀ, z += φk(k)
 * (per query head, with that head's k-map; dropped when linear is off).
 *
 * Schedule. A call is cut at chunk boundaries into segments of at most C
 * tokens. Per segment (a scan across chunks):
 *   1. at the first token of chunk c >= 2: select from chunk c-2 and fold
 *      the rest into S, z (parallel over selection heads, then query heads);
 *   2. store the segment's keys and values in the Local ring;
 *   3. parallel over (query head, block of up to 8 tokens): the logits over
 *      the 2C ring slots (masked to Local(t)) and over Sel — rows of Q Kᵀ,
 *      register-blocked so each key loaded serves the whole block —, per
 *      token one max, exponentials and the softmax sums, then the numerators
 *      (rows of P V), the linear part φq(q)ᵀ[S | z], the gate and the
 *      output; and each token's own routing score (below), which is complete
 *      the moment the token arrives;
 *   4. (routing qk only) the "received" sums, added per head in token order.
 * All tokens of a segment share Sel, S and z, and every output element is
 * accumulated in the same order with the same operations whatever the block
 * size, so a whole-prompt prefill, a chunked prefill and decode (T = 1: a
 * one-token segment) give bit-identical outputs. Cost per token and query
 * head: (2C + |Sel|)·2D for the softmax part, D² (NP-Map of q) + 2·P·D
 * (φq S, and the fold's φk vᵀ) + D² (NP-Map of k at the fold) for the linear
 * part, D·d for the gate; selection O(C log λ) per leaving chunk and head.

 * Routing scores (per query head; per_kv_head sums its G heads):
 *   saliency: token j's self-attention weight p = a^diag_j over its rolling
 *     window R(j) = max(0, j-C+1)..j, which lies inside Local(j), so it comes
 *     from the logits already computed for j's own output; the score is the
 *     closed form f(p) = p log((p+ε)/ε) + (1-p) log(1-p), ε = 1e-8 (in
 *     double), which is the explicit formula without its O(ε) terms (they
 *     depend on the other weights of the window and lie in [0, C·ε·p]); f is
 *     increasing for p > 0.8 ε, so per query head it ranks as p does, and
 *     the sums over the G heads of a KV head differ from the summed explicit
 *     scores by less than G·C·ε. tests/python/test_attn_still.py checks that
 *     it selects the same tokens as the explicit formula.
 *   keynorm: ‖k_j‖; qk: (1/C) Σ_{i=j}^{j+C-1} q_i·k_j/√D, accumulated as the
 *     queries arrive (each i adds its logits over R(i)); random: a hash of
 *     (seed, selection head, position) mapped to [0, 1); position: the
 *     offsets floor((2i+1) C / (2n)); none: λ = 0.
 *   Ranking: higher score first, ties to the lower position.
 *
 * State (fixed size once Sel is full; allocated up front):
 *   Local ring  keys [Hk][D][2C'] (transposed), values [Hk][2C][D], slot = pos % 2C
 *   Sel         keys [Hs][D][cap'] (transposed), values [Hs][cap][D], count per head,
 *               as float32, IEEE half or 8-bit (cfg.sel_type; a decode step at full
 *               budget reads Sel once per query head, the largest read of a step).
 *               8-bit: per token, k ≈ sk·k8 and v ≈ sv·v8 with s = max|x|/127
 *               and x8 = round(x/s) (scales [Hs][lds], [Hs][cap]); a logit is
 *               sk·(q·k8), a value weight e·sv.
 *               (2C', cap': rounded up to a multiple of 16)
 *               cap = m - 2C (budget mode), or enough for n_ctx (budget 0)
 *   S [H][P][D], z [H][P]  (P = 2D for NP-Map, 2F for Hedgehog)
 *   scores [H][2C] (double) of the tokens still in Local, and one budget
 *   counter per selection head (= the Sel count).
 *
 * Parameters (floats, in order):
 *   npmap:    q_u [H][D], k_u [H][D], q_W [H][D][D], k_W [H][D][D]  (z = W x̃)
 *   hedgehog: hq_W [H][D][F], hk_W [H][D][F]                         (z = x W)
 *   gate:     Wg [H*D][d], bg [H*D]
 *
 * Backward (stage-1 training): still_backward; the gradients of the inputs
 * (stage 2, the whole model trains): still_backward_inputs; both at the end
 * of this file. The stage-1 backward's float64 reference (tests only) is
 * tests/ref/attn_still_ref.c.
 */
#include "kinds/attn_rules.h"
#include "kinds/attn.h"
#include "kinds/still/attn_still.h"
#include "kinds/still/attn_still_rules.h"
#include "kinds/attn_common.h"
#include "common/common.h"
#include "cpu/vecmath.h"

#include <cblas.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define DEN_EPS STILL_DEN_EPS         /* attn_still_rules.h */
#define SEL_TILE 64    /* Sel's keys are stored, and its softmax parts summed, in tiles of this many keys */
#define FMAP_CLAMP STILL_FMAP_CLAMP
#define NORM_FLOOR STILL_NORM_FLOOR
#define STILL_MAX_HEAD_DIM 256
#define FOLD_MAX 256   /* tokens per rank-n fold product */

typedef struct {
    /* shape */
    int C, H, Hk, D, G, Hs, d, Fd, P;
    int lam;                   /* tokens kept per leaving chunk (routing none: 0; global selection: unused) */
    int global;                /* global selection: Sel holds the best cap tokens of all that left Local */
    int capped;                /* budget mode: at most cap tokens per selection head */
    int cap;                   /* Sel capacity per selection head (storage) */
    int ldl, lds;              /* 2C and cap rounded up to 16 (rows of transposed keys) */
    /* state */
    float *kt_loc, *v_loc;     /* [Hk][D][ldl], [Hk][2C][D] */
    attn_sel_type sel_type;    /* storage of Sel's keys and values */
    void *kt_sel, *v_sel;      /* [Hs][lds / SEL_TILE tiles of [D][SEL_TILE]] (sel_kt_index), [Hs][cap][D], of sel_type */
    float *ks_sel, *vs_sel;    /* 8-bit only: scales [Hs][lds], [Hs][cap] */
    int *n_sel;                /* [Hs] */
    double *sel_sc;            /* global selection: [Hs][cap] routing score of each Sel slot, */
    int *sel_pos;              /* [Hs][cap] and its position (ties: the lower position ranks higher) */
    float *S, *z;              /* [H][P][D], [H][P] */
    double *score;             /* [H][2C] */
    /* scratch (not part of the sequence state) */
    float *lg;                 /* qk routing: logits of R(t), [C][H][C] */
    unsigned char *picked;     /* [Hs][C] */
    double *heap_v;            /* selection heaps: [Hs][C] scores, */
    int *heap_i;               /* [Hs][C] positions in the chunk */
    int *heap_s;               /* global selection: [Hs][cap] Sel slots, the worst on top */
    float *ev_k, *ev_v;        /* global selection: [Hs][C][D] keys and values evicted by a leave step, */
    int *n_ev;                 /* [Hs] how many (as stored: read back from Sel) */
    long long n_evicted;       /* evictions since the state was created or reset (the backward refuses any) */
    float *thr;                /* per-thread scratch */
    size_t thr_floats;
    float *dec_part;           /* a decode step's Sel partials per query head and tile, [H][n_tiles][D + 2]
                                * (m, l, o: sel_tile), when a KV head's query heads read its store together */
    int n_tiles;               /* lds / SEL_TILE, rounded up */
    int n_thr;
    int fold_rows;             /* tokens per fold product: min(C, FOLD_MAX) rounded up to TBMAX */
    /* the gate matrix of the parameters at wg_of as halves, when every value
     * is one (an f16 adapter's are): a decode step's gate reads half the
     * bytes, with the same sums bit for bit (a half widens exactly); built on
     * the first call with those parameters (a context's parameters do not
     * change while it lives: still.h); wg_exact 0: read the floats */
    const float *wg_of;
    _Float16 *wg_h;
    int wg_exact;
    /* backward only: when set, leave_chunk marks rec[hs * rec_len + pos] = 1
     * for every token it selects (not owned; does not change the forward) */
    unsigned char *rec;
    int rec_len;
} still_impl;

/* ---- configuration ---------------------------------------------------------- */

static int feat_half(const attn_config *c) { return c->feature_map == FMAP_HEDGEHOG ? c->feature_dim : c->head_dim; }

/* The parameter layout of this plan (src/kinds/still/attn_still_rules.h): head h's map of side 0 (q) or 1 (k), the
 * NP-Map's u, the gate after the maps. */
static size_t fmap_params(const attn_config *c) {
    return still_par_fmap_count(c->n_head, c->head_dim, c->feature_dim, c->feature_map == FMAP_HEDGEHOG);
}
static size_t par_w(const attn_config *c, int side, int h) {
    return still_par_w(c->n_head, c->head_dim, c->feature_dim, c->feature_map == FMAP_HEDGEHOG, side, h);
}
static size_t par_u(const attn_config *c, int side, int h) { return still_par_u(c->n_head, c->head_dim, side, h); }

int attn_still_gate(const attn_config *c, const float *params, const float **Wg, const float **bg) {
    *Wg = *bg = NULL;
    if (c->kind != ATTN_STILL || !c->linear || !c->gate || !params) return 0;
    const int hh = c->feature_map == FMAP_HEDGEHOG;
    *Wg = params + still_par_wg(c->n_head, c->head_dim, c->feature_dim, hh);
    *bg = params + still_par_bg(c->n_head, c->head_dim, c->feature_dim, hh, c->d_model);
    return 1;
}

static size_t still_param_count(const attn_config *c) {
    if (c->n_head <= 0 || c->head_dim <= 0) return 0;
    return still_par_count(c->n_head, c->head_dim, c->feature_dim, c->feature_map == FMAP_HEDGEHOG, c->gate,
                           c->d_model > 0 ? c->d_model : 0);
}

static void still_param_init(const attn_config *c, float *params, uint64_t seed) {
    const int H = c->n_head, D = c->head_dim, hh = c->feature_map == FMAP_HEDGEHOG, F = hh ? c->feature_dim : D;
    const size_t HD = (size_t)H * D, fan = (size_t)D * F;
    uint64_t s = seed;
    if (!hh)   /* the Householder vectors q_u, k_u: normal */
        for (size_t i = 0; i < 2 * HD; i++) params[still_par_u(H, D, 0, 0) + i] = (float)attn_rng_normal(&s);
    attn_kaiming_uniform(params + still_par_w(H, D, F, hh, 0, 0), HD * F, fan, &s);   /* q's W (every head) */
    attn_kaiming_uniform(params + still_par_w(H, D, F, hh, 1, 0), HD * F, fan, &s);   /* k's W */
    if (c->gate) {
        const size_t dm = (size_t)c->d_model;
        memset(params + still_par_wg(H, D, F, hh), 0, sizeof(float) * HD * dm);   /* W_g = 0 */
        float *bg = params + still_par_bg(H, D, F, hh, c->d_model);
        for (size_t i = 0; i < HD; i++) bg[i] = 2.0f;   /* b_g = +2: the gate open */
    }
}

/* λ and the Sel capacity (as the reference's still_lambda). */
static int still_check(const attn_config *c, int *lam, int *capped, int *cap, still_err *err) {
    const still_plan_fields f = {.head_dim = c->head_dim, .n_head = c->n_head, .n_head_kv = c->n_head_kv,
                                 .d_model = c->d_model, .n_ctx = c->n_ctx, .chunk = c->chunk, .budget = c->budget,
                                 .routing = (int)c->routing, .sel_span = c->sel_span, .sel_global = c->sel_global,
                                 .linear = c->linear, .feature_map = (int)c->feature_map, .feature_dim = c->feature_dim,
                                 .gate = c->gate, .gate_den = c->gate_den};
    char msg[160];
    const int bad = still_plan_check(&f, msg, sizeof msg);   /* attn_still_rules.h: the rules of every backend */
    if (bad) return still_fail(err, bad == STILL_PLAN_UNSUPPORTED ? STILL_E_UNSUPPORTED : STILL_E_ARG, "%s", msg);
    if (c->head_dim > STILL_MAX_HEAD_DIM)   /* this backend's limit */
        return still_fail(err, STILL_E_UNSUPPORTED, "still: head dim %d (at most %d on the CPU)", c->head_dim,
                          STILL_MAX_HEAD_DIM);
    *lam = still_lambda(c->routing == ROUTE_NONE, c->lambda, c->budget, c->chunk, c->n_ctx);
    *capped = c->budget > 0;
    const long long cp = still_capacity(c->budget, c->chunk, c->n_ctx, *lam);
    if (cp > (1 << 30)) return still_fail(err, STILL_E_ARG, "still: selected store too large (%lld tokens)", cp);
    *cap = (int)cp;
    return STILL_OK;
}

int attn_still_routing(const attn_config *c, int *lam, int *capped, int *cap, still_err *err) {
    return still_check(c, lam, capped, cap, err);
}

/* ---- small kernels ------------------------------------------------------------ */

/* The kernels below take TB rows at once (TB a compile-time constant in
 * 1, 2, 4, 8), so every weight or key loaded is used TB times from
 * registers. Each output element is accumulated in the same order with the
 * same operations whatever TB is, so a token gets the same bits in a
 * whole-prompt call (TB = 8) as in a decode step (TB = 1). */
#define TBMAX 8
#define LANES 16
#define INLINE static inline __attribute__((always_inline))

/* 16 floats as one GNU C vector (a zmm register under AVX-512, two ymm under
 * AVX2); element-wise arithmetic, so a lane computes what scalar code would.
 * Without AVX-512, gcc notes that returning one changes the ABI (-Wpsabi):
 * every function here that does is static and inlined, so no ABI is crossed. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));   /* unaligned access */
#define LD(p) (*(const v16u *)(const void *)(p))
#define ST(p, v) (*(v16u *)(void *)(p) = (v))

static int round16(int n) { return (n + LANES - 1) / LANES * LANES; }

/* 16 halves at p (any alignment) as floats (exact: every half is a float). */
INLINE v16 LDH(const _Float16 *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
#elif defined(__F16C__) && defined(__AVX__)
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + 8)));
    v16 r;
    memcpy(&r, &a, sizeof a);
    memcpy((char *)&r + sizeof a, &b, sizeof b);
    return r;
#else
    float t[LANES];
    for (int i = 0; i < LANES; i++) t[i] = (float)p[i];
    return LD(t);
#endif
}

/* out[tb] = Σ_i a[i] b[tb][i] over n entries: 16 lane partial sums, the
 * tail, then a fixed reduction tree. */
INLINE void dot_rows(const float *restrict a, const float *const *b, int n, float *out, const int TB) {
    v16 acc[TBMAX];
    for (int tb = 0; tb < TB; tb++) acc[tb] = (v16){0};
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        const v16 av = LD(a + i);
        for (int tb = 0; tb < TB; tb++) acc[tb] += av * LD(b[tb] + i);
    }
    for (int tb = 0; tb < TB; tb++) {
        float s = 0, c[LANES];
        for (int k = i; k < n; k++) s += a[k] * b[tb][k];
        memcpy(c, &acc[tb], sizeof c);
        for (int l = 0; l < 8; l++) c[l] += c[l + 8];
        for (int l = 0; l < 4; l++) c[l] += c[l + 4];
        out[tb] = s + ((c[0] + c[2]) + (c[1] + c[3]));
    }
}

/* Σ_i x[i] over n entries in a fixed order whatever the address or the caller (16 lane partial sums, the
 * tail, then dot_rows' reduction tree): sums that a prefill and a decode step must share bit for bit. */
INLINE float sum_fixed(const float *restrict x, int n) {
    v16 acc = (v16){0};
    int i = 0;
    for (; i + LANES <= n; i += LANES) acc += LD(x + i);
    float s = 0, c[LANES];
    for (int k = i; k < n; k++) s += x[k];
    memcpy(c, &acc, sizeof c);
    for (int l = 0; l < 8; l++) c[l] += c[l + 8];
    for (int l = 0; l < 4; l++) c[l] += c[l + 4];
    return s + ((c[0] + c[2]) + (c[1] + c[3]));
}

/* max_j x[j] over n entries (-inf for none), 16 lanes at a time: the maximum is the same in any order, so
 * this gives what the one-by-one loop gives (a serial chain of scalar compares was a fifth of a decode step's
 * Sel pass); a NaN is carried only as far as the scores' exponentials carry it anyway. */
INLINE float max_of(const float *restrict x, int n) {
    float m = -INFINITY;
    int i = 0;
#if defined(__AVX512F__)
    if (n >= LANES) {
        __m512 acc = _mm512_loadu_ps(x);
        for (i = LANES; i + LANES <= n; i += LANES) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
        m = _mm512_reduce_max_ps(acc);
    }
#elif defined(__AVX__)
    if (n >= 8) {
        __m256 acc = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
        float t[8];
        _mm256_storeu_ps(t, acc);
        for (int l = 0; l < 8; l++) m = t[l] > m ? t[l] : m;
    }
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* out[r] = Σ_i a[r][i] b[i] for NR rows against one vector: each row's sum is
 * formed exactly as dot_rows(a[r], &b, n, out + r, 1) forms it (same lane
 * partial sums, tail and reduction tree), with NR independent accumulator
 * chains in flight; a decode step's gate runs through this. */
INLINE void dot_multi_1(const float *const *a, const float *restrict b, int n, float *out, const int NR) {
    v16 acc[4];
    for (int r = 0; r < NR; r++) acc[r] = (v16){0};
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        const v16 bv = LD(b + i);
        for (int r = 0; r < NR; r++) acc[r] += LD(a[r] + i) * bv;
    }
    for (int r = 0; r < NR; r++) {
        float s = 0, c[LANES];
        for (int k = i; k < n; k++) s += a[r][k] * b[k];
        memcpy(c, &acc[r], sizeof c);
        for (int l = 0; l < 8; l++) c[l] += c[l + 8];
        for (int l = 0; l < 4; l++) c[l] += c[l + 4];
        out[r] = s + ((c[0] + c[2]) + (c[1] + c[3]));
    }
}

static float dotf(const float *a, const float *b, int n) {
    float r;
    dot_rows(a, &b, n, &r, 1);
    return r;
}

/* 16 signed bytes at p as floats (exact). */
INLINE v16 LDB(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)p)));
#elif defined(__AVX2__)
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p)));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p + 8))));
    v16 r;
    memcpy(&r, &a, sizeof a);
    memcpy((char *)&r + sizeof a, &b, sizeof b);
    return r;
#else
    float t[LANES];
    for (int i = 0; i < LANES; i++) t[i] = (float)p[i];
    return LD(t);
#endif
}

/* Keys and values are read as float32, as IEEE half or as signed bytes
 * (TYPE: attn_sel_type), widened exactly to float; the arithmetic is the
 * same (8-bit scales are applied by the callers). */
INLINE v16 LDKV(const void *p, size_t i, const int TYPE) {
    if (TYPE == SEL_F16) return LDH((const _Float16 *)p + i);
    if (TYPE == SEL_Q8) return LDB((const int8_t *)p + i);
    return LD((const float *)p + i);
}
INLINE float LDKV1(const void *p, size_t i, const int TYPE) {
    if (TYPE == SEL_F16) return (float)((const _Float16 *)p)[i];
    if (TYPE == SEL_Q8) return (float)((const int8_t *)p)[i];
    return ((const float *)p)[i];
}

/* out[tb][j] = Σ_x q[tb][x] Kt[x][j] for j < n16 (a multiple of 16):
 * rows of Q Kᵀ with the keys stored transposed (leading dimension ldk)
 * (8-bit keys: the sums before their scales).
 * NJ blocks of 16 keys per pass, so that even one row (TB = 1, a decode
 * step) keeps several independent accumulator chains in flight; each
 * element is the same sum in the same order whatever NJ is. */
INLINE void qk_rows(const float *const *q, const void *restrict Kt, size_t ldk, int n16, int D, float *restrict out,
                    size_t ldo, const int TB, const int TYPE) {
    const int NJ = TB <= 2 ? 4 : TB <= 4 ? 2 : 1;   /* NJ·TB <= TBMAX accumulators (TB = 3: a KV head's query heads) */
    int j0 = 0;
    for (; j0 + NJ * LANES <= n16; j0 += NJ * LANES) {
        v16 acc[TBMAX];
        for (int a = 0; a < NJ * TB; a++) acc[a] = (v16){0};
        for (int x = 0; x < D; x++)
            for (int jb = 0; jb < NJ; jb++) {
                const v16 kr = LDKV(Kt, (size_t)x * ldk + j0 + jb * LANES, TYPE);
                for (int tb = 0; tb < TB; tb++) acc[jb * TB + tb] += q[tb][x] * kr;
            }
        for (int jb = 0; jb < NJ; jb++)
            for (int tb = 0; tb < TB; tb++) ST(out + (size_t)tb * ldo + j0 + jb * LANES, acc[jb * TB + tb]);
    }
    for (; j0 < n16; j0 += LANES) {
        v16 acc[TBMAX];
        for (int tb = 0; tb < TB; tb++) acc[tb] = (v16){0};
        for (int x = 0; x < D; x++) {
            const v16 kr = LDKV(Kt, (size_t)x * ldk + j0, TYPE);
            for (int tb = 0; tb < TB; tb++) acc[tb] += q[tb][x] * kr;
        }
        for (int tb = 0; tb < TB; tb++) ST(out + (size_t)tb * ldo + j0, acc[tb]);
    }
}

/* o[tb][x] += Σ_{j<n} e[tb][j] V[j][x] (V rows of D values, in order of j),
 * NX blocks of 16 channels per pass (independent chains, as in qk_rows). */
INLINE void pv_rows(const float *restrict e, size_t lde, const void *restrict V, int n, int D, float *restrict o,
                    size_t ldo, const int TB, const int TYPE) {
    const int NX = TB <= 2 ? 4 : TB <= 4 ? 2 : 1;
    int x0 = 0;
    for (; x0 + NX * LANES <= D; x0 += NX * LANES) {
        v16 acc[TBMAX];
        for (int xb = 0; xb < NX; xb++)
            for (int tb = 0; tb < TB; tb++) acc[xb * TB + tb] = LD(o + (size_t)tb * ldo + x0 + xb * LANES);
        for (int j = 0; j < n; j++)
            for (int xb = 0; xb < NX; xb++) {
                const v16 vr = LDKV(V, (size_t)j * D + x0 + xb * LANES, TYPE);
                for (int tb = 0; tb < TB; tb++) acc[xb * TB + tb] += e[(size_t)tb * lde + j] * vr;
            }
        for (int xb = 0; xb < NX; xb++)
            for (int tb = 0; tb < TB; tb++) ST(o + (size_t)tb * ldo + x0 + xb * LANES, acc[xb * TB + tb]);
    }
    for (; x0 + LANES <= D; x0 += LANES) {
        v16 acc[TBMAX];
        for (int tb = 0; tb < TB; tb++) acc[tb] = LD(o + (size_t)tb * ldo + x0);
        for (int j = 0; j < n; j++) {
            const v16 vr = LDKV(V, (size_t)j * D + x0, TYPE);
            for (int tb = 0; tb < TB; tb++) acc[tb] += e[(size_t)tb * lde + j] * vr;
        }
        for (int tb = 0; tb < TB; tb++) ST(o + (size_t)tb * ldo + x0, acc[tb]);
    }
    for (int x = x0; x < D; x++)
        for (int tb = 0; tb < TB; tb++) {
            float a = o[(size_t)tb * ldo + x];
            for (int j = 0; j < n; j++) a += e[(size_t)tb * lde + j] * LDKV1(V, (size_t)j * D + x, TYPE);
            o[(size_t)tb * ldo + x] = a;
        }
}

/* φ = [softmax(z) ⊕ softmax(-z)], clamped; z has n entries, out 2n. */
static void fmap_finish(const float *z, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = z[i], out[n + i] = -z[i];
    attn_softmax_inplace(out, n);
    attn_softmax_inplace(out + n, n);
    for (int i = 0; i < 2 * n; i++) out[i] = out[i] < FMAP_CLAMP ? FMAP_CLAMP : out[i];
}

/* Feature maps of head h (side 0: q-map, 1: k-map) for TB vectors x[tb]
 * (D floats each): out[tb] (ldo apart) gets P floats.
 *   NP-Map: x̃ = x - 2(x·û)û, z = W x̃, z ← z ‖x‖ / max(‖z‖, 1e-12)
 *   Hedgehog: z = x W
 * then φ = [softmax(z) ⊕ softmax(-z)] clamped at 1e-12.
 * tmp: TBMAX * 2 * max(D, F) floats. */
INLINE void feature_rows(const attn_config *c, const float *params, int h, int side, const float *const *x,
                         float *out, size_t ldo, float *tmp, const int TB) {
    const int D = c->head_dim;
    if (c->feature_map == FMAP_HEDGEHOG) {
        const int F = c->feature_dim;
        const float *W = params + par_w(c, side, h);
        for (int tb = 0; tb < TB; tb++) {
            float *z = tmp;
            for (int f = 0; f < F; f++) z[f] = 0;
            for (int d = 0; d < D; d++) {
                const float xd = x[tb][d];
                const float *wr = W + (size_t)d * F;
                for (int f = 0; f < F; f++) z[f] += xd * wr[f];
            }
            fmap_finish(z, F, out + (size_t)tb * ldo);
        }
        return;
    }
    const float *u = params + par_u(c, side, h);
    const float *W = params + par_w(c, side, h);
    float *xt = tmp, *zz = tmp + (size_t)TBMAX * D, col[TBMAX];
    const float *xr[TBMAX];
    const float uu = dotf(u, u, D);
    for (int tb = 0; tb < TB; tb++) {
        /* x·û û = (x·u / u·u) u */
        const float f = still_npmap_reflect(dotf(x[tb], u, D), uu);
        float *xo = xt + (size_t)tb * D;
        for (int i = 0; i < D; i++) xo[i] = x[tb][i] - f * u[i];
        xr[tb] = xo;
    }
    for (int i = 0; i < D; i++) {
        dot_rows(W + (size_t)i * D, xr, D, col, TB);
        for (int tb = 0; tb < TB; tb++) zz[(size_t)tb * D + i] = col[tb];
    }
    for (int tb = 0; tb < TB; tb++) {
        float *z = zz + (size_t)tb * D;
        const float nx = sqrtf(dotf(x[tb], x[tb], D)), nz = sqrtf(dotf(z, z, D));
        const float sc = still_npmap_rescale(nx, nz);
        for (int i = 0; i < D; i++) z[i] *= sc;
        fmap_finish(z, D, out + (size_t)tb * ldo);
    }
}

/* ---- state -------------------------------------------------------------------- */

static size_t still_state_bytes(const attn_state *s) {
    const still_impl *r = s->impl;
    const size_t C2 = 2 * (size_t)r->C, D = (size_t)r->D;
    const size_t local = (size_t)r->Hk * D * ((size_t)r->ldl + C2);
    const size_t sel = (size_t)r->Hs * D * ((size_t)r->lds + (size_t)r->cap);
    const size_t lin = (size_t)r->H * (size_t)r->P * (D + 1);   /* S, z */
    const size_t esz = r->sel_type == SEL_F16 ? sizeof(_Float16) : r->sel_type == SEL_Q8 ? 1 : sizeof(float);
    const size_t scales = r->sel_type == SEL_Q8 ? (size_t)r->Hs * ((size_t)r->lds + (size_t)r->cap) : 0;
    const size_t glob = r->global ? (size_t)r->Hs * (size_t)r->cap * (sizeof(double) + sizeof(int)) : 0;
    return (local + lin + scales) * sizeof(float) + sel * esz + (size_t)r->H * C2 * sizeof(double) +
           (size_t)r->Hs * sizeof(int) + glob;
}

static void impl_free(still_impl *r) {
    if (!r) return;
    free(r->kt_loc), free(r->v_loc), free(r->kt_sel), free(r->v_sel), free(r->n_sel);
    free(r->ks_sel), free(r->vs_sel);
    free(r->S), free(r->z), free(r->score), free(r->lg), free(r->picked), free(r->thr), free(r->dec_part);
    free(r->heap_v), free(r->heap_i);
    free(r->sel_sc), free(r->sel_pos), free(r->heap_s), free(r->ev_k), free(r->ev_v), free(r->n_ev);
    free(r->wg_h);
    free(r);
}

static void still_state_free(attn_state *s) {
    if (!s) return;
    impl_free(s->impl);
    free(s);
}

static void impl_reset(still_impl *r) {
    memset(r->n_sel, 0, sizeof(int) * (size_t)r->Hs);
    memset(r->S, 0, sizeof(float) * (size_t)r->H * (size_t)r->P * (size_t)r->D);
    memset(r->z, 0, sizeof(float) * (size_t)r->H * (size_t)r->P);
    memset(r->score, 0, sizeof(double) * (size_t)r->H * 2 * (size_t)r->C);
    r->n_evicted = 0;
}

static void *xcalloc(size_t n, size_t sz) { return calloc(n ? n : 1, sz); }

/* Per-thread scratch of a work item (TBMAX tokens of one head); after it,
 * four gate rows widened from their halves (d floats each). */
static size_t scratch_gate_rows(const still_impl *r) {
    const size_t D = (size_t)r->D, P = (size_t)r->P, F = (size_t)(r->Fd > r->D ? r->Fd : r->D);
    const size_t block = TBMAX * ((size_t)r->ldl + P + 3 * D + 2 * F + 4) +
                         TBMAX * (SEL_TILE + 2 * D + 2);   /* Sel by tiles: logits, a tile's o, the running o, m, l */
    const size_t fold = TBMAX * D + (size_t)r->fold_rows * (P + D) + TBMAX * 2 * F;
    return (block > fold ? block : fold) + 64;
}
static size_t scratch_floats(const still_impl *r) { return scratch_gate_rows(r) + 4 * (size_t)r->d; }

static int still_state_create(const attn_config *c, attn_state **out, still_err *err) {
    *out = NULL;
    int lam = 0, capped = 0, cap = 0;
    int rc = still_check(c, &lam, &capped, &cap, err);
    if (rc) return rc;
    attn_state *s = calloc(1, sizeof *s);
    still_impl *r = calloc(1, sizeof *r);
    if (!s || !r) {
        free(s), free(r);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    r->C = c->chunk, r->H = c->n_head, r->Hk = c->n_head_kv, r->D = c->head_dim, r->G = c->n_head / c->n_head_kv;
    r->Hs = c->per_kv_head ? r->Hk : r->H;
    r->d = c->d_model;
    r->Fd = feat_half(c), r->P = 2 * r->Fd;
    r->lam = lam, r->capped = capped, r->cap = cap;
    r->ldl = round16(2 * r->C), r->lds = round16(cap);
    const size_t C = (size_t)r->C, D = (size_t)r->D, H = (size_t)r->H, Hk = (size_t)r->Hk, Hs = (size_t)r->Hs;
    const size_t P = (size_t)r->P, ccap = (size_t)cap;
    r->kt_loc = xcalloc(Hk * D * (size_t)r->ldl, sizeof(float));
    r->v_loc = xcalloc(Hk * 2 * C * D, sizeof(float));
    r->sel_type = c->sel_type;
    const size_t esz = c->sel_type == SEL_F16 ? sizeof(_Float16) : c->sel_type == SEL_Q8 ? 1 : sizeof(float);
    r->kt_sel = xcalloc(Hs * D * (size_t)r->lds, esz);
    r->v_sel = xcalloc(Hs * ccap * D, esz);
    if (c->sel_type == SEL_Q8) {
        r->ks_sel = xcalloc(Hs * (size_t)r->lds, sizeof(float));
        r->vs_sel = xcalloc(Hs * ccap, sizeof(float));
    }
    r->n_sel = xcalloc(Hs, sizeof(int));
    r->S = xcalloc(H * P * D, sizeof(float));
    r->z = xcalloc(H * P, sizeof(float));
    r->score = xcalloc(H * 2 * C, sizeof(double));
    r->lg = c->routing == ROUTE_QK ? xcalloc(C * H * C, sizeof(float)) : NULL;
    r->picked = xcalloc(Hs * C, 1);
    r->heap_v = xcalloc(Hs * C, sizeof(double));
    r->heap_i = xcalloc(Hs * C, sizeof(int));
    r->global = c->sel_global != 0;
    if (r->global) {
        r->sel_sc = xcalloc(Hs * ccap, sizeof(double));
        r->sel_pos = xcalloc(Hs * ccap, sizeof(int));
        r->heap_s = xcalloc(Hs * ccap, sizeof(int));
        r->ev_k = xcalloc(Hs * C * D, sizeof(float));
        r->ev_v = xcalloc(Hs * C * D, sizeof(float));
        r->n_ev = xcalloc(Hs, sizeof(int));
    }
    r->fold_rows = (r->C < FOLD_MAX ? r->C : FOLD_MAX) + TBMAX - 1;
    r->fold_rows -= r->fold_rows % TBMAX;
    r->thr_floats = scratch_floats(r);
    r->n_thr = omp_get_max_threads();
    r->thr = xcalloc((size_t)r->n_thr * r->thr_floats, sizeof(float));
    r->n_tiles = (r->lds + SEL_TILE - 1) / SEL_TILE;
    if (c->per_kv_head && r->G > 1 && r->n_tiles > 0) r->dec_part = xcalloc(H * (size_t)r->n_tiles * (D + 2), sizeof(float));
    s->cfg = *c;
    s->impl = r;
    if (!r->kt_loc || !r->v_loc || !r->kt_sel || !r->v_sel ||
        (c->sel_type == SEL_Q8 && (!r->ks_sel || !r->vs_sel)) || !r->n_sel || !r->S || !r->z || !r->score ||
        (c->routing == ROUTE_QK && !r->lg) || !r->picked || !r->heap_v || !r->heap_i || !r->thr ||
        (c->per_kv_head && r->G > 1 && r->n_tiles > 0 && !r->dec_part) ||
        (r->global && (!r->sel_sc || !r->sel_pos || !r->heap_s || !r->ev_k || !r->ev_v || !r->n_ev))) {
        size_t bytes = still_state_bytes(s);
        still_state_free(s);
        return still_fail(err, STILL_E_NOMEM, "still: out of memory allocating the state (%.1f MiB)",
                          (double)bytes / 1048576.0);
    }
    *out = s;
    return STILL_OK;
}

static int still_state_truncate(attn_state *s, int n, still_err *err) {
    if (n == s->n_seen) return STILL_OK;
    if (n != 0)
        return still_fail(err, STILL_E_ARG,
                          "still: cannot truncate a %d-token state to %d tokens (its linear state is folded; only 0 or %d)",
                          s->n_seen, n, s->n_seen);
    impl_reset(s->impl);
    s->n_seen = 0;
    return STILL_OK;
}

/* Local's keys and values, Sel (its keys, values, scales, counts; global selection's scores, positions, heap and
 * the last leave step's evictions), the linear state S, z and the saliency scores of the tokens in Local. */
static int still_state_regions(attn_state *s, attn_region *out, int max) {
    still_impl *r = s->impl;
    const size_t C = (size_t)r->C, D = (size_t)r->D, H = (size_t)r->H, Hk = (size_t)r->Hk, Hs = (size_t)r->Hs;
    const size_t cap = (size_t)r->cap, esz = r->sel_type == SEL_F16 ? sizeof(_Float16) : r->sel_type == SEL_Q8 ? 1 : 4;
    attn_region all[] = {
        {r->kt_loc, Hk * D * (size_t)r->ldl * sizeof(float)}, {r->v_loc, Hk * 2 * C * D * sizeof(float)},
        {r->kt_sel, Hs * D * (size_t)r->lds * esz}, {r->v_sel, Hs * cap * D * esz},
        {r->ks_sel, r->ks_sel ? Hs * (size_t)r->lds * sizeof(float) : 0}, {r->vs_sel, r->vs_sel ? Hs * cap * sizeof(float) : 0},
        {r->n_sel, Hs * sizeof(int)}, {r->S, H * (size_t)r->P * D * sizeof(float)}, {r->z, H * (size_t)r->P * sizeof(float)},
        {r->score, H * 2 * C * sizeof(double)}, {&r->n_evicted, sizeof r->n_evicted},
        {r->sel_sc, r->global ? Hs * cap * sizeof(double) : 0}, {r->sel_pos, r->global ? Hs * cap * sizeof(int) : 0},
        {r->heap_s, r->global ? Hs * cap * sizeof(int) : 0}, {r->ev_k, r->global ? Hs * C * D * sizeof(float) : 0},
        {r->ev_v, r->global ? Hs * C * D * sizeof(float) : 0}, {r->n_ev, r->global ? Hs * sizeof(int) : 0},
    };
    const int n = (int)(sizeof all / sizeof all[0]);
    if (max < n) return -1;
    for (int i = 0; i < n; i++) out[i] = all[i];
    return n;
}

static int n_threads_for(const still_impl *r, int n_items) {
    int n = omp_get_max_threads() < r->n_thr ? omp_get_max_threads() : r->n_thr;
    return n < n_items ? n : (n_items > 0 ? n_items : 1);
}

/* ---- the leave step: chunk cl leaves Local ------------------------------------ */

/* Ranking of selection: (score a, position i) is worse than (b, j) when its
 * score is lower, or equal with a later position. */
static inline int heap_worse(double a, int i, double b, int j) { return still_ranks_before(b, j, a, i); }

/* 8-bit copy of x (n floats) into out (stride apart): out = round(x / s),
 * s = max|x| / 127 (0 for an all-zero x); returns s. */
static float quantize_q8(const float *x, int n, int8_t *out, size_t stride) {
    float amax = 0;
    for (int i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float inv = still_q8_inv(amax);   /* attn_still_rules.h */
    for (int i = 0; i < n; i++) out[(size_t)i * stride] = (int8_t)still_q8_level(x[i], inv);
    return still_q8_scale(amax);
}

/* The routing score of token i of the chunk at ring offset base (position pos0 + i) for selection head hs
 * (per_kv_head: the sum over its G query heads; NaN ranks last). */
static double leave_score_1(const attn_config *cfg, const still_impl *r, int hs, int base, int pos0, int i) {
    const attn_routing rt = cfg->routing;
    double v = 0;
    if (rt == ROUTE_RANDOM) v = still_route_random(cfg->seed, hs, pos0 + i);
    else {
        const int C2 = 2 * r->C, h0 = cfg->per_kv_head ? hs * r->G : hs, nh = cfg->per_kv_head ? r->G : 1;
        for (int h = h0; h < h0 + nh; h++) {
            v += still_route_term((int)rt, r->score[(size_t)h * C2 + base + i], r->C);
        }
    }
    return still_rank_value(v);
}

/* ... with sel_span R: the best of offsets i - R .. i + R that are still in the ring, i.e. in the leaving
 * chunk or the next one (0 .. 2C - 1; the next chunk is complete when its predecessor leaves). */
static double leave_score(const attn_config *cfg, const still_impl *r, int hs, int base, int pos0, int i) {
    const int R = cfg->sel_span;
    if (R <= 0 || cfg->routing == ROUTE_POSITION || cfg->routing == ROUTE_NONE)
        return leave_score_1(cfg, r, hs, base, pos0, i);
    const int C2 = 2 * r->C, lo = still_span_lo(i, R), hi = still_span_hi(i, R, C2);
    double best = -INFINITY;
    for (int j = lo; j <= hi; j++) {   /* offset j of the leaving chunk: ring slot (base + j) mod 2C */
        const double v = leave_score_1(cfg, r, hs, (base + j) % C2 - j, pos0, j);
        best = v > best ? v : best;
    }
    return best;
}

/* Sel's keys of a selection head are stored transposed in tiles of SEL_TILE keys: tile t holds keys
 * t·SEL_TILE .. as [D][w] (w = SEL_TILE, or what is left of lds for the last tile), so that a pass over a
 * tile reads one contiguous block instead of D rows lds apart (a decode step read 64 strided streams,
 * which the hardware prefetchers do not follow). Element (x, j) of the head's keys: */
static inline size_t sel_kt_index(const still_impl *r, int x, int j) {
    const int t0 = j / SEL_TILE * SEL_TILE, w = r->lds - t0 < SEL_TILE ? r->lds - t0 : SEL_TILE;
    return (size_t)t0 * (size_t)r->D + (size_t)x * (size_t)w + (size_t)(j - t0);
}

/* Sel slot j of selection head hs := key column col of the ring's transposed keys kt (leading dimension ldl)
 * and value vi, stored as sel_type. */
static void sel_put(still_impl *r, int hs, int j, const float *kt, int ldl, int col, const float *vi) {
    const int D = r->D;
    const size_t ko = (size_t)hs * D * r->lds, vo = (size_t)hs * r->cap * D;
    if (r->sel_type == SEL_F16) {   /* rounded to nearest (even) */
        _Float16 *kts = (_Float16 *)r->kt_sel + ko, *vs = (_Float16 *)r->v_sel + vo + (size_t)j * D;
        for (int x = 0; x < D; x++) kts[sel_kt_index(r, x, j)] = (_Float16)kt[(size_t)x * ldl + col];
        for (int x = 0; x < D; x++) vs[x] = (_Float16)vi[x];
    } else if (r->sel_type == SEL_Q8) {
        float kx[STILL_MAX_HEAD_DIM];
        for (int x = 0; x < D; x++) kx[x] = kt[(size_t)x * ldl + col];
        int8_t *kts = (int8_t *)r->kt_sel + ko, *vs = (int8_t *)r->v_sel + vo + (size_t)j * D;
        r->ks_sel[(size_t)hs * r->lds + j] =
            quantize_q8(kx, D, kts + sel_kt_index(r, 0, j), sel_kt_index(r, 1, j) - sel_kt_index(r, 0, j));
        r->vs_sel[(size_t)hs * r->cap + j] = quantize_q8(vi, D, vs, 1);
    } else {
        float *kts = (float *)r->kt_sel + ko;
        for (int x = 0; x < D; x++) kts[sel_kt_index(r, x, j)] = kt[(size_t)x * ldl + col];
        memcpy((float *)r->v_sel + vo + (size_t)j * D, vi, sizeof(float) * (size_t)D);
    }
}

/* Sel slot j of selection head hs read back as stored: key k [D], value v [D]. */
static void sel_get(const still_impl *r, int hs, int j, float *k, float *v) {
    const int D = r->D;
    const size_t ko = (size_t)hs * D * r->lds, vo = (size_t)hs * r->cap * D + (size_t)j * D;
    if (r->sel_type == SEL_F16) {
        const _Float16 *kts = (const _Float16 *)r->kt_sel + ko, *vs = (const _Float16 *)r->v_sel + vo;
        for (int x = 0; x < D; x++) k[x] = (float)kts[sel_kt_index(r, x, j)], v[x] = (float)vs[x];
    } else if (r->sel_type == SEL_Q8) {
        const int8_t *kts = (const int8_t *)r->kt_sel + ko, *vs = (const int8_t *)r->v_sel + vo;
        const float sk = r->ks_sel[(size_t)hs * r->lds + j], sv = r->vs_sel[(size_t)hs * r->cap + j];
        for (int x = 0; x < D; x++) k[x] = sk * (float)kts[sel_kt_index(r, x, j)], v[x] = sv * (float)vs[x];
    } else {
        const float *kts = (const float *)r->kt_sel + ko;
        for (int x = 0; x < D; x++) k[x] = kts[sel_kt_index(r, x, j)];
        memcpy(v, (const float *)r->v_sel + vo, sizeof(float) * (size_t)D);
    }
}

/* Global selection of one leaving chunk for selection head hs: Sel becomes the best cap tokens of Sel and
 * the chunk (higher score, then the lower position). The chunk's tokens are taken best first: into a free
 * slot while there is one, else into the slot of Sel's worst token when they rank above it (that token is
 * evicted: read back as stored into ev_k / ev_v, to be folded), else they and every later one fold. Taken
 * best first, a token of the chunk is never evicted by one of the same chunk. */
static void leave_global(const attn_config *cfg, still_impl *r, int hs, int base, int pos0) {
    const int C = r->C, D = r->D, G = r->G, ldl = r->ldl, cap = r->cap;
    unsigned char *pk = r->picked + (size_t)hs * C;
    double *cv = r->heap_v + (size_t)hs * C;
    int *ci = r->heap_i + (size_t)hs * C;
    double *ssc = r->sel_sc + (size_t)hs * cap;
    int *spos = r->sel_pos + (size_t)hs * cap, *hp = r->heap_s + (size_t)hs * cap;
    const int hk = cfg->per_kv_head ? hs : hs / G;
    const float *kt = r->kt_loc + (size_t)hk * D * ldl, *vl = r->v_loc + (size_t)hk * 2 * C * D;
    memset(pk, 0, (size_t)C);
    r->n_ev[hs] = 0;
    /* the chunk, best first (insertion sort: C is small and the order is total) */
    for (int i = 0; i < C; i++) {
        const double v = leave_score(cfg, r, hs, base, pos0, i);
        int k = i;
        while (k > 0 && heap_worse(cv[k - 1], ci[k - 1], v, i)) cv[k] = cv[k - 1], ci[k] = ci[k - 1], k--;
        cv[k] = v, ci[k] = i;
    }
    int heap = 0;   /* hp[0 .. cap) is a heap of Sel's slots, the worst on top */
#define SLOT_WORSE(a, b) heap_worse(ssc[a], spos[a], ssc[b], spos[b])
    for (int k = 0; k < C; k++) {
        const int i = ci[k], pos = pos0 + i;
        int j;
        if (r->n_sel[hs] < cap) j = r->n_sel[hs]++;
        else {
            if (!heap) {   /* heapify (bottom-up) */
                for (int x = 0; x < cap; x++) hp[x] = x;
                for (int x = cap / 2 - 1; x >= 0; x--)
                    for (int c = x;;) {
                        int w = c;
                        const int a = 2 * c + 1, b = a + 1;
                        if (a < cap && SLOT_WORSE(hp[a], hp[w])) w = a;
                        if (b < cap && SLOT_WORSE(hp[b], hp[w])) w = b;
                        if (w == c) break;
                        const int t = hp[c];
                        hp[c] = hp[w], hp[w] = t, c = w;
                    }
                heap = 1;
            }
            j = hp[0];
            if (cap == 0 || !heap_worse(ssc[j], spos[j], cv[k], pos)) break;   /* it and the rest fold */
            const int e = r->n_ev[hs]++;
            sel_get(r, hs, j, r->ev_k + ((size_t)hs * C + e) * D, r->ev_v + ((size_t)hs * C + e) * D);
            if (r->rec && spos[j] < r->rec_len) r->rec[(size_t)hs * r->rec_len + spos[j]] = 0;
            r->n_evicted++;
        }
        sel_put(r, hs, j, kt, ldl, base + i, vl + (size_t)(base + i) * D);
        ssc[j] = cv[k], spos[j] = pos, pk[i] = 1;
        if (r->rec && pos < r->rec_len) r->rec[(size_t)hs * r->rec_len + pos] = 1;
        if (heap)   /* slot j (the top) got a better token: sift it down */
            for (int c = 0;;) {
                int w = c;
                const int a = 2 * c + 1, b = a + 1;
                if (a < cap && SLOT_WORSE(hp[a], hp[w])) w = a;
                if (b < cap && SLOT_WORSE(hp[b], hp[w])) w = b;
                if (w == c) break;
                const int t = hp[c];
                hp[c] = hp[w], hp[w] = t, c = w;
            }
    }
#undef SLOT_WORSE
}

static void leave_chunk(const attn_config *cfg, still_impl *r, const float *params, int cl) {
    const int C = r->C, D = r->D, G = r->G, H = r->H, Hs = r->Hs, P = r->P, C2 = 2 * C, ldl = r->ldl;
    const int base = (cl % 2) * C, pos0 = cl * C;
    const attn_routing rt = cfg->routing;

    /* Selection, per selection head. */
#pragma omp parallel for schedule(static) num_threads(n_threads_for(r, Hs))
    for (int hs = 0; hs < Hs; hs++) {
        if (r->global) {
            leave_global(cfg, r, hs, base, pos0);
            continue;
        }
        unsigned char *pk = r->picked + (size_t)hs * C;
        memset(pk, 0, (size_t)C);
        const int n = still_picks(r->lam, r->capped, r->cap, r->n_sel[hs]);
        if (n <= 0) continue;
        if (rt == ROUTE_POSITION) {
            for (int i = 0; i < n; i++) pk[still_position_offset(i, n, C)] = 1;
        } else {
            /* top-n in one pass, O(C log n): a heap of the best n so far with
             * the worst on top (lower score; on equal scores the later
             * position, since tokens arrive in position order a later token
             * with an equal score never displaces an earlier one). */
            double *hv = r->heap_v + (size_t)hs * C;
            int *hi = r->heap_i + (size_t)hs * C, hn = 0;
            for (int i = 0; i < C; i++) {
                const double v = leave_score(cfg, r, hs, base, pos0, i);
                if (hn < n) {   /* sift up */
                    int c = hn++;
                    while (c > 0) {
                        const int p = (c - 1) / 2;
                        if (!heap_worse(v, i, hv[p], hi[p])) break;
                        hv[c] = hv[p], hi[c] = hi[p], c = p;
                    }
                    hv[c] = v, hi[c] = i;
                } else if (v > hv[0]) {   /* replace the worst, sift down */
                    int c = 0;
                    for (;;) {
                        int w = c;
                        const int a = 2 * c + 1, b = a + 1;
                        double wv = v;
                        int wi = i;
                        if (a < hn && heap_worse(hv[a], hi[a], wv, wi)) w = a, wv = hv[a], wi = hi[a];
                        if (b < hn && heap_worse(hv[b], hi[b], wv, wi)) w = b;
                        if (w == c) break;
                        hv[c] = hv[w], hi[c] = hi[w], c = w;
                    }
                    hv[c] = v, hi[c] = i;
                }
            }
            for (int k = 0; k < hn; k++) pk[hi[k]] = 1;
        }
        /* Append in position order. */
        const int hk = cfg->per_kv_head ? hs : hs / G;
        const float *kt = r->kt_loc + (size_t)hk * D * ldl;
        const float *vl = r->v_loc + (size_t)hk * C2 * D;
        if (r->rec)
            for (int i = 0; i < C; i++)
                if (pk[i] && pos0 + i < r->rec_len) r->rec[(size_t)hs * r->rec_len + pos0 + i] = 1;
        for (int i = 0; i < C; i++)
            if (pk[i]) sel_put(r, hs, r->n_sel[hs]++, kt, ldl, base + i, vl + (size_t)(base + i) * D);
    }
    if (!cfg->linear) return;

    /* Fold the other tokens into S, z, per query head: their k-features Φ
     * (TBMAX rows at a time) and values gathered into [n][P] and [n][D],
     * then S += Φᵀ V as one rank-n product (n = C - picked, at most
     * FOLD_MAX per product) and z += the column sums of Φ. */
#pragma omp parallel for schedule(static) num_threads(n_threads_for(r, H))
    for (int h = 0; h < H; h++) {
        float *ts = r->thr + (size_t)omp_get_thread_num() * r->thr_floats;
        const int fm = r->fold_rows;
        float *kx = ts, *phi = kx + (size_t)TBMAX * D, *vg = phi + (size_t)fm * P, *tmp = vg + (size_t)fm * D;
        const int hk = h / G, hs = cfg->per_kv_head ? hk : h;
        const unsigned char *pk = r->picked + (size_t)hs * C;
        const float *kt = r->kt_loc + (size_t)hk * D * ldl;
        const float *vl = r->v_loc + (size_t)hk * C2 * D;
        float *S = r->S + (size_t)h * P * D, *z = r->z + (size_t)h * P;
        const float *xr[TBMAX];
        /* rows u: the tokens global selection evicted from Sel (as stored), then the chunk's unpicked ones */
        const int ne = r->global ? r->n_ev[hs] : 0, nu = ne + C;
        const float *evk = r->global ? r->ev_k + (size_t)hs * C * D : NULL;
        const float *evv = r->global ? r->ev_v + (size_t)hs * C * D : NULL;
        int n = 0, nb = 0;   /* rows gathered; rows of the current feature block */
        for (int u = 0; u <= nu; u++) {
            const int i = u - ne;
            if (u < ne) {
                float *k = kx + (size_t)nb * D;
                memcpy(k, evk + (size_t)u * D, sizeof(float) * (size_t)D);
                memcpy(vg + (size_t)n * D, evv + (size_t)u * D, sizeof(float) * (size_t)D);
                xr[nb++] = k, n++;
            } else if (u < nu && !pk[i]) {
                float *k = kx + (size_t)nb * D;
                for (int x = 0; x < D; x++) k[x] = kt[(size_t)x * ldl + base + i];
                memcpy(vg + (size_t)n * D, vl + (size_t)(base + i) * D, sizeof(float) * (size_t)D);
                xr[nb++] = k, n++;
            }
            if (nb == TBMAX || (nb > 0 && (u == nu || n == fm))) {
                float *out = phi + (size_t)(n - nb) * P;
                for (int j = nb; j < TBMAX; j++) xr[j] = xr[nb - 1];
                /* a partial block repeats its last row (n - nb is a multiple of TBMAX, fm rows fit) */
                if (nb > 1) feature_rows(cfg, params, h, 1, xr, out, (size_t)P, tmp, TBMAX);
                else feature_rows(cfg, params, h, 1, xr, out, (size_t)P, tmp, 1);
                nb = 0;
            }
            if (n > 0 && (u == nu || n == fm)) {
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, P, D, n, 1.0f, phi, P, vg, D, 1.0f, S, D);
                for (int j = 0; j < n; j++) {
                    const float *pr = phi + (size_t)j * P;
                    for (int p = 0; p < P; p++) z[p] += pr[p];
                }
                n = 0;
            }
        }
    }
}

/* ---- Sel's softmax part, tile by tile ------------------------------------------------ */

/* Sel's softmax part over keys t0 .. t0+nt-1 (a tile: t0 a multiple of SEL_TILE, nt <= SEL_TILE) of
 * selection head hs for TB query rows q: with s_j = scale · (ks_j ·) q·k_j (8-bit keys: their scale),
 *   pm[tb] = max_j s_j,   pl[tb] = Σ_j e^{s_j − pm},   po[tb][x] = Σ_j e^{s_j − pm} (vs_j ·) v_j[x]
 * (po: TB rows of D). sc: TB × SEL_TILE floats of scratch. Each row's sums are the same whatever TB is, so
 * a decode step that reads a tile for the query heads of a KV head together (still_forward) gets the bits
 * of the prefill's per-head pass. */
INLINE void sel_tile(const still_impl *r, int hs, int t0, int nt, const float *const *q, float scale, float *sc,
                     float *pm, float *pl, float *po, const int TB) {
    const int D = r->D, lds = r->lds, w = lds - t0 < SEL_TILE ? lds - t0 : SEL_TILE, n16 = round16(nt);
    const size_t ko = (size_t)hs * D * lds + (size_t)t0 * D, vo = ((size_t)hs * r->cap + (size_t)t0) * D;
    const int q8 = r->sel_type == SEL_Q8;
    if (r->sel_type == SEL_F16) qk_rows(q, (const _Float16 *)r->kt_sel + ko, (size_t)w, n16, D, sc, SEL_TILE, TB, SEL_F16);
    else if (q8) qk_rows(q, (const int8_t *)r->kt_sel + ko, (size_t)w, n16, D, sc, SEL_TILE, TB, SEL_Q8);
    else qk_rows(q, (const float *)r->kt_sel + ko, (size_t)w, n16, D, sc, SEL_TILE, TB, SEL_F32);
    const float *ks = q8 ? r->ks_sel + (size_t)hs * lds + t0 : NULL, *vsc = q8 ? r->vs_sel + (size_t)hs * r->cap + t0 : NULL;
    for (int tb = 0; tb < TB; tb++) {
        float *sv = sc + (size_t)tb * SEL_TILE;
        if (ks)
            for (int j = 0; j < nt; j++) sv[j] *= ks[j];
        for (int j = 0; j < nt; j++) sv[j] *= scale;
        const float m = max_of(sv, nt);
#pragma omp simd
        for (int j = 0; j < nt; j++) sv[j] = vec_expf(sv[j] - m);
        const float l = sum_fixed(sv, nt);
        if (vsc)   /* the weights take the value scales */
            for (int j = 0; j < nt; j++) sv[j] *= vsc[j];
        pm[tb] = m, pl[tb] = l;
    }
    for (int i = 0; i < TB * D; i++) po[i] = 0;
    if (r->sel_type == SEL_F16) pv_rows(sc, SEL_TILE, (const _Float16 *)r->v_sel + vo, nt, D, po, (size_t)D, TB, SEL_F16);
    else if (q8) pv_rows(sc, SEL_TILE, (const int8_t *)r->v_sel + vo, nt, D, po, (size_t)D, TB, SEL_Q8);
    else pv_rows(sc, SEL_TILE, (const float *)r->v_sel + vo, nt, D, po, (size_t)D, TB, SEL_F32);
}

/* The running (M, L, O) of Sel's part, merged with a tile's (pm, pl, po) in tile order (first: taken). */
INLINE void sel_merge(int first, float *M, float *L, float *O, float pm, float pl, const float *po, int D) {
    if (first) {
        *M = pm, *L = pl;
        for (int x = 0; x < D; x++) O[x] = po[x];
        return;
    }
    const float mx = pm > *M ? pm : *M, a = vec_expf(*M - mx), b = vec_expf(pm - mx);
    *L = fmaf(pl, b, *L * a);
    for (int x = 0; x < D; x++) O[x] = fmaf(po[x], b, O[x] * a);
    *M = mx;
}

/* ---- a block of tokens of one head ---------------------------------------------- */

/* Tokens t0 .. t0+nb-1 (nb <= TB; rows nb..TB-1 repeat the last token and are
 * computed but not written) of query head h, all in one chunk. pre: NULL, or (a
 * decode step, TB = 1) the head's Sel partials per tile, [n_tiles][D + 2] (m, l,
 * o of sel_tile), already computed (still_forward). */
INLINE void block_head(const attn_config *cfg, const still_impl *r, const float *params, const attn_io *io, int t0,
                       int nb, int h, float *out, float *ts, const float *pre, const int TB) {
    const int C = r->C, C2 = 2 * C, D = r->D, G = r->G, P = r->P, H = r->H, ldl = r->ldl;
    const int hk = h / G, hs = cfg->per_kv_head ? hk : h;
    const int c = (io->p0 + t0) / C, cur = (c % 2) * C, prev = C - cur;
    const float scale = attn_logit_scale(D);
    const int ns = r->n_sel[hs];
    const int F = r->Fd > D ? r->Fd : D;
    float *sl = ts;                                   /* [TB][ldl] local logits, then weights */
    float *phi = sl + (size_t)TBMAX * ldl;            /* [TB][P] */
    float *o = phi + (size_t)TBMAX * P;               /* [TB][D] softmax numerator */
    float *ln = o + (size_t)TBMAX * D;                /* [TB][D] linear numerator */
    float *gt = ln + (size_t)TBMAX * D;               /* [TB][D] gate */
    float *den = gt + (size_t)TBMAX * D, *lz = den + TBMAX;
    float *tmp = lz + TBMAX;                          /* feature maps: TBMAX · 2F */
    float *tsc = tmp + (size_t)TBMAX * 2 * F;         /* [TB][SEL_TILE] a tile's logits, then weights */
    float *tpo = tsc + (size_t)TBMAX * SEL_TILE;      /* [TB][D] a tile's o */
    float *sO = tpo + (size_t)TBMAX * D;              /* [TB][D] Sel's running o, */
    float *sM = sO + (size_t)TBMAX * D, *sL = sM + TBMAX;   /* max and sum */
    float mloc[TBMAX];
    const float *q[TBMAX];
    int pos[TBMAX];
    for (int tb = 0; tb < TB; tb++) {
        const int t = t0 + (tb < nb ? tb : nb - 1);
        q[tb] = io->q + (size_t)t * H * D + (size_t)h * D;
        pos[tb] = io->p0 + t;
    }

    /* Logits over the ring: rows of Q Kᵀ. */
    qk_rows(q, r->kt_loc + (size_t)hk * D * ldl, (size_t)ldl, ldl, D, sl, (size_t)ldl, TB, SEL_F32);

    for (int tb = 0; tb < TB; tb++) {
        float *sr = sl + (size_t)tb * ldl;
        const int p = pos[tb], cur_hi = p - c * C;   /* valid: current chunk 0..cur_hi, previous chunk if c >= 1 */
        for (int i = 0; i < C; i++) {
            sr[cur + i] = i <= cur_hi ? sr[cur + i] * scale : -INFINITY;
            sr[prev + i] = c >= 1 ? sr[prev + i] * scale : -INFINITY;
        }

        /* Routing score of this token (its window R(p) lies in Local(p)). */
        const int rlo = still_window_lo(p, C);
        if (tb < nb) {
            if (cfg->routing == ROUTE_SALIENCY) {
                float mr = -INFINITY;
                for (int l = rlo; l <= p; l++) mr = sr[l % C2] > mr ? sr[l % C2] : mr;
                float sum = 0;
                for (int l = rlo; l <= p; l++) sum += vec_expf(sr[l % C2] - mr);
                const float pw = vec_expf(sr[p % C2] - mr) / sum;
                r->score[(size_t)h * C2 + p % C2] = still_saliency_of_p((double)pw);
            } else if (cfg->routing == ROUTE_KEYNORM) {
                const float *k = io->k + (size_t)(p - io->p0) * r->Hk * D + (size_t)hk * D;
                double n2 = 0;
                for (int x = 0; x < D; x++) n2 += (double)k[x] * k[x];
                r->score[(size_t)h * C2 + p % C2] = sqrt(n2);
            } else if (cfg->routing == ROUTE_QK) {
                float *lg = r->lg + ((size_t)(p % C) * H + h) * C;   /* index l - (p - C + 1) */
                for (int l = rlo; l <= p; l++) lg[l - (p - C + 1)] = sr[l % C2];
            }
        }

        /* Local's max, exponentials and sum (Sel's part joins below). */
        const float m = max_of(sr, C2);
#pragma omp simd
        for (int j = 0; j < C2; j++) sr[j] = vec_expf(sr[j] - m);
        mloc[tb] = m, den[tb] = sum_fixed(sr, C2);
    }

    /* Softmax numerators: local slots, then Sel by tiles, merged in tile order; the two joined at the max
     * over both: o = o_loc e^{m_loc − m} + O e^{M − m}, the denominator alike. */
    for (int i = 0; i < TB * D; i++) o[i] = 0;
    pv_rows(sl, (size_t)ldl, r->v_loc + (size_t)hk * C2 * D, C2, D, o, (size_t)D, TB, SEL_F32);
    if (ns) {
        const int n_t = (ns + SEL_TILE - 1) / SEL_TILE;
        for (int ti = 0; ti < n_t; ti++) {
            if (pre) {   /* TB = 1 */
                const float *pp = pre + (size_t)ti * (D + 2);
                sel_merge(ti == 0, sM, sL, sO, pp[0], pp[1], pp + 2, D);
                continue;
            }
            const int tt = ti * SEL_TILE, nt = ns - tt < SEL_TILE ? ns - tt : SEL_TILE;
            float pm[TBMAX], pl[TBMAX];
            sel_tile(r, hs, tt, nt, q, scale, tsc, pm, pl, tpo, TB);
            for (int tb = 0; tb < TB; tb++)
                sel_merge(ti == 0, sM + tb, sL + tb, sO + (size_t)tb * D, pm[tb], pl[tb], tpo + (size_t)tb * D, D);
        }
        for (int tb = 0; tb < TB; tb++) {
            const float mx = sM[tb] > mloc[tb] ? sM[tb] : mloc[tb];
            const float a = vec_expf(mloc[tb] - mx), b = vec_expf(sM[tb] - mx);
            float *ot = o + (size_t)tb * D;
            const float *Ot = sO + (size_t)tb * D;
            for (int x = 0; x < D; x++) ot[x] = fmaf(Ot[x], b, ot[x] * a);
            den[tb] = fmaf(sL[tb], b, den[tb] * a);
        }
    }

    /* Linear branch: only chunks <= c-2 are folded, so nothing before c = 2. */
    const int lin = cfg->linear && c >= 2;
    if (lin) {
        feature_rows(cfg, params, h, 0, q, phi, (size_t)P, tmp, TB);
        const float *S = r->S + (size_t)h * P * D, *z = r->z + (size_t)h * P;
        for (int i = 0; i < TB * D; i++) ln[i] = 0;
        pv_rows(phi, (size_t)P, S, P, D, ln, (size_t)D, TB, SEL_F32);
        const float *pr[TBMAX];
        for (int tb = 0; tb < TB; tb++) pr[tb] = phi + (size_t)tb * P;
        dot_rows(z, pr, P, lz, TB);
        if (cfg->gate) {
            const size_t HD = (size_t)H * D, dm = (size_t)cfg->d_model;
            const float *Wg = params + fmap_params(cfg), *bg = Wg + HD * dm;
            const float *xr[TBMAX];
            float a[TBMAX];
            for (int tb = 0; tb < TB; tb++) xr[tb] = io->x + (size_t)(pos[tb] - io->p0) * dm;
            int x = 0;
            if (TB == 1 && io->T == 1 && io->gate_pre)   /* one token, its pre-activations given (model.c) */
                for (; x < D; x++) {
                    const size_t row = (size_t)h * D + x;
                    gt[x] = 1.0f / (1.0f + vec_expf(-(bg[row] + io->gate_pre[row])));
                }
            if (TB == 1 && r->wg_exact)   /* one token: four rows at a time, widened from the halves */
                for (; x + 4 <= D; x += 4) {
                    const size_t row = (size_t)h * D + x;
                    float *wf = ts + scratch_gate_rows(r);
                    const _Float16 *wh = r->wg_h + row * dm;
                    size_t i = 0;
                    for (; i + LANES <= 4 * dm; i += LANES) ST(wf + i, LDH(wh + i));
                    for (; i < 4 * dm; i++) wf[i] = (float)wh[i];
                    const float *wr[4] = {wf, wf + dm, wf + 2 * dm, wf + 3 * dm};
                    dot_multi_1(wr, xr[0], (int)dm, a, 4);
                    for (int i = 0; i < 4; i++) gt[x + i] = 1.0f / (1.0f + vec_expf(-(bg[row + i] + a[i])));
                }
            else if (TB == 1)   /* one token: four rows at a time */
                for (; x + 4 <= D; x += 4) {
                    const size_t row = (size_t)h * D + x;
                    const float *wr[4] = {Wg + row * dm, Wg + (row + 1) * dm, Wg + (row + 2) * dm, Wg + (row + 3) * dm};
                    dot_multi_1(wr, xr[0], (int)dm, a, 4);
                    for (int i = 0; i < 4; i++) gt[x + i] = 1.0f / (1.0f + vec_expf(-(bg[row + i] + a[i])));
                }
            for (; x < D; x++) {
                const size_t row = (size_t)h * D + x;
                dot_rows(Wg + row * dm, xr, (int)dm, a, TB);
                for (int tb = 0; tb < TB; tb++) gt[(size_t)tb * D + x] = 1.0f / (1.0f + vec_expf(-(bg[row] + a[tb])));
            }
            for (int i = 0; i < TB * D; i++) ln[i] *= gt[i];
        }
    }
    for (int tb = 0; tb < nb; tb++) {
        const float inv = 1.0f / still_den(den[tb], 1.0f, lin ? lz[tb] : 0.0f, 0);
        const float *ot = o + (size_t)tb * D, *lt = ln + (size_t)tb * D;
        float *dst = out + (size_t)(t0 + tb) * H * D + (size_t)h * D;
        if (lin && cfg->gate_den) {   /* per channel: (o + g a) / (l + g b + 1e-6) */
            const float *gtt = gt + (size_t)tb * D;
            for (int x = 0; x < D; x++) dst[x] = (ot[x] + lt[x]) / still_den(den[tb], gtt[x], lz[tb], 1);
        } else if (lin)
            for (int x = 0; x < D; x++) dst[x] = (ot[x] + lt[x]) * inv;
        else
            for (int x = 0; x < D; x++) dst[x] = ot[x] * inv;
    }
}

static void block_head_8(const attn_config *cfg, const still_impl *r, const float *params, const attn_io *io, int t0,
                         int nb, int h, float *out, float *ts, const float *pre) {
    block_head(cfg, r, params, io, t0, nb, h, out, ts, pre, 8);
}
static void block_head_4(const attn_config *cfg, const still_impl *r, const float *params, const attn_io *io, int t0,
                         int nb, int h, float *out, float *ts, const float *pre) {
    block_head(cfg, r, params, io, t0, nb, h, out, ts, pre, 4);
}
static void block_head_2(const attn_config *cfg, const still_impl *r, const float *params, const attn_io *io, int t0,
                         int nb, int h, float *out, float *ts, const float *pre) {
    block_head(cfg, r, params, io, t0, nb, h, out, ts, pre, 2);
}
static void block_head_1(const attn_config *cfg, const still_impl *r, const float *params, const attn_io *io, int t0,
                         int nb, int h, float *out, float *ts, const float *pre) {
    block_head(cfg, r, params, io, t0, nb, h, out, ts, pre, 1);
}

/* ---- forward --------------------------------------------------------------------- */

/* The G query heads of selection head hs, one tile: sel_tile with TB = G where G is 2, 3 or 4 (the same
 * sums per row as TB = 1), else head by head; partials into r->dec_part. */
static void sel_tile_group(const still_impl *r, int hs, int ti, const float *const *q, float scale, float *sc,
                           float *po) {
    const int D = r->D, G = r->G, tt = ti * SEL_TILE, ns = r->n_sel[hs], nt = ns - tt < SEL_TILE ? ns - tt : SEL_TILE;
    float pm[TBMAX], pl[TBMAX];
    if (G == 2) sel_tile(r, hs, tt, nt, q, scale, sc, pm, pl, po, 2);
    else if (G == 3) sel_tile(r, hs, tt, nt, q, scale, sc, pm, pl, po, 3);
    else if (G == 4) sel_tile(r, hs, tt, nt, q, scale, sc, pm, pl, po, 4);
    else
        for (int g = 0; g < G; g++) sel_tile(r, hs, tt, nt, q + g, scale, sc, pm + g, pl + g, po + (size_t)g * D, 1);
    for (int g = 0; g < G; g++) {
        float *dst = r->dec_part + ((size_t)(hs * G + g) * r->n_tiles + ti) * (D + 2);
        dst[0] = pm[g], dst[1] = pl[g];
        memcpy(dst + 2, po + (size_t)g * D, sizeof(float) * (size_t)D);
    }
}

/* A decode step's Sel partials (token t of io; selection per KV head, G <= TBMAX): every (KV head, tile) a
 * work item, in one parallel loop. Returns 0 (nothing done) when no store holds a token. */
static int sel_tiles_grouped(still_impl *r, const attn_io *io, int t) {
    const int D = r->D, G = r->G, H = r->H;
    if (G > TBMAX) return 0;
    int start[64 + 1], n_items = 0;
    if (r->Hs > 64) return 0;
    for (int hs = 0; hs < r->Hs; hs++) start[hs] = n_items, n_items += (r->n_sel[hs] + SEL_TILE - 1) / SEL_TILE;
    start[r->Hs] = n_items;
    if (!n_items) return 0;
    const float scale = attn_logit_scale(D);
#pragma omp parallel for schedule(static) num_threads(n_threads_for(r, n_items))
    for (int it = 0; it < n_items; it++) {
        int hs = 0;
        while (start[hs + 1] <= it) hs++;
        float *ts = r->thr + (size_t)omp_get_thread_num() * r->thr_floats;
        const float *q[TBMAX];
        for (int g = 0; g < G; g++) q[g] = io->q + (size_t)t * H * D + (size_t)(hs * G + g) * D;
        sel_tile_group(r, hs, it - start[hs], q, scale, ts, ts + (size_t)TBMAX * SEL_TILE);
    }
    return 1;
}

/* The halves of params' gate matrix (still_impl.wg_h), once per parameter
 * buffer; without memory for them the floats are read. */
static void gate_halves(const attn_config *cfg, still_impl *r, const float *params) {
    if (!cfg->linear || !cfg->gate || !params || r->wg_of == params) return;
    r->wg_of = params, r->wg_exact = 0;
    const size_t n = (size_t)r->H * (size_t)r->D * (size_t)r->d;
    if (!r->wg_h && !(r->wg_h = malloc(n * sizeof(_Float16)))) return;
    const float *Wg = params + fmap_params(cfg);
    int exact = 1;
    for (size_t i = 0; i < n; i++) {
        r->wg_h[i] = (_Float16)Wg[i];
        exact &= (float)r->wg_h[i] == Wg[i];
    }
    r->wg_exact = exact;
}

static int still_forward(attn_state *s, const float *params, const attn_io *io, float *out, still_err *err) {
    still_impl *r = s->impl;
    const attn_config *cfg = &s->cfg;
    if (io->p0 != s->n_seen)
        return still_fail(err, STILL_E_STATE, "still: state holds %d tokens, input starts at %d", s->n_seen, io->p0);
    if (io->T < 0) return still_fail(err, STILL_E_ARG, "still: negative token count %d", io->T);
    if (io->T == 0) return STILL_OK;
    if (io->T > cfg->n_ctx - io->p0)
        return still_fail(err, STILL_E_STATE, "still: state full (%d + %d > %d tokens)", io->p0, io->T, cfg->n_ctx);
    if (!io->q || !io->k || !io->v || !out) return still_fail(err, STILL_E_ARG, "still: q, k, v and out are required");
    if (cfg->linear && cfg->gate && !io->x) return still_fail(err, STILL_E_ARG, "still: the gate needs the layer input x");
    if (cfg->linear && !params) return still_fail(err, STILL_E_ARG, "still: parameters required");

    gate_halves(cfg, r, params);
    const int C = r->C, C2 = 2 * C, D = r->D, H = r->H, Hk = r->Hk, kvd = Hk * D, ldl = r->ldl;
    for (int t0 = 0; t0 < io->T;) {
        const int pos0 = io->p0 + t0, c = pos0 / C;
        int n = C - pos0 % C;
        if (n > io->T - t0) n = io->T - t0;
        if (pos0 % C == 0) {
            if (c >= 2) leave_chunk(cfg, r, params, c - 2);
            if (cfg->routing == ROUTE_QK)
                for (int h = 0; h < H; h++)
                    for (int i = 0; i < C; i++) r->score[(size_t)h * C2 + (c % 2) * C + i] = 0;
        }
        /* Store the segment's keys and values in the ring. */
        for (int t = t0; t < t0 + n; t++) {
            const int slot = (io->p0 + t) % C2;
            for (int hk = 0; hk < Hk; hk++) {
                const float *k = io->k + (size_t)t * kvd + (size_t)hk * D;
                float *kt = r->kt_loc + (size_t)hk * D * ldl;
                for (int x = 0; x < D; x++) kt[(size_t)x * ldl + slot] = k[x];
                memcpy(r->v_loc + ((size_t)hk * C2 + slot) * D, io->v + (size_t)t * kvd + (size_t)hk * D,
                       sizeof(float) * (size_t)D);
            }
        }
        /* One token with Sel per KV head: its query heads read each tile of their store together, the
         * tiles spread over the threads (sel_tiles_grouped); then the heads merge them as below. */
        const int grouped = n == 1 && r->dec_part && sel_tiles_grouped(r, io, t0);
        /* Outputs, per (head, block of up to 8 tokens). */
        const int n_blk = (n + TBMAX - 1) / TBMAX, n_items = n_blk * H;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads_for(r, n_items))
        for (int it = 0; it < n_items; it++) {
            const int h = it % H, b = it / H;
            float *ts = r->thr + (size_t)omp_get_thread_num() * r->thr_floats;
            const int ta = t0 + b * TBMAX, nb = t0 + n - ta < TBMAX ? t0 + n - ta : TBMAX;
            if (nb > 4) block_head_8(cfg, r, params, io, ta, nb, h, out, ts, NULL);
            else if (nb > 2) block_head_4(cfg, r, params, io, ta, nb, h, out, ts, NULL);
            else if (nb == 2) block_head_2(cfg, r, params, io, ta, nb, h, out, ts, NULL);
            else block_head_1(cfg, r, params, io, ta, nb, h, out, ts,
                              grouped ? r->dec_part + (size_t)h * r->n_tiles * (r->D + 2) : NULL);
        }
        /* qk routing: each query adds its logits over R(i) to the keys it
         * received, per head in token order. */
        if (cfg->routing == ROUTE_QK) {
#pragma omp parallel for schedule(static) num_threads(n_threads_for(r, H))
            for (int h = 0; h < H; h++) {
                for (int t = t0; t < t0 + n; t++) {
                    const int pos = io->p0 + t, rlo = still_window_lo(pos, C);
                    const float *lg = r->lg + ((size_t)(pos % C) * H + h) * C;
                    double *sc = r->score + (size_t)h * C2;
                    for (int l = rlo; l <= pos; l++) sc[l % C2] += lg[l - (pos - C + 1)];
                }
            }
        }
        t0 += n;
    }
    s->n_seen += io->T;
    return STILL_OK;
}

/* ---- backward (stage 1: attention transfer) ---------------------------------------- */

/* Gradient of Σ dout ⊙ y over a whole sequence with respect to the
 * parameters. Every parameter acts through the linear branch (the feature
 * maps on φq, φk; the gate on the linear numerator), so with linear off the
 * gradient is zero. Selection is a fixed routing decision: the backward runs
 * the float forward once with a recorder in leave_chunk
 * (attn_still_record_selection), so it uses exactly the tokens the forward
 * selects. The float64 reference of the same gradient (token by token, one
 * head at a time: slow and obvious) is test code, tests/ref/attn_still_ref.c
 * (attn_still_backward_ref); tests/test_attn_still_grad.c checks it against
 * finite differences and this backward against it. */

/* ---- the fast backward: float32, matrix products per chunk ------------------------ */

/* The gradient, organised for speed: every step that is a sum over tokens
 * is a matrix product (OpenBLAS sgemm, single-threaded inside the per-head
 * parallel loop, so the result does not depend on the thread count). Per
 * query head h, with P = 2·Fd feature entries:
 *   1. feature maps, batched: φk of the keys that get folded (rows j <
 *      (nc-2) C; selected rows zeroed), φq of the queries that see a linear
 *      term (rows t >= 2C), keeping x̃, z0 = W x̃ and the norms for step 6;
 *   2. the scan: S_c = S_{c-1} + φk(chunk c-2)ᵀ V(chunk c-2), z_c likewise,
 *      stored for every chunk c >= 2;
 *   3. per chunk c >= 2: the softmax part over A(t) (logits against the
 *      Sel prefix and the two Local chunks, masked, then E V), the linear
 *      part a = φq S_c, b = φq z_c, the gate; then the output gradients
 *      dnum = dy/den, dden = -(dy·y)/den, dφq = dA S_cᵀ + db z_cᵀ, and
 *      dS_c = φqᵀ dA, dz_c = φqᵀ db;
 *   4. suffix sums R_c = Σ_{c' >= c} dS_c'; dφk of chunk cj = V R_{cj+2}ᵀ + Rz;
 *   5. gate: dWg_h += dPreᵀ X, dbg_h += Σ_t dPre;
 *   6. feature-map backward, batched: softmax halves (clamped entries pass
 *      nothing), the norm rescale, z0 = W x̃ (gW += dZ0ᵀ X̃, dX̃ = dZ0 W) and
 *      the Householder vector. */

typedef struct {
    float *A, *F, *dF;        /* raw softmax halves, clamped φ, its gradient: [T][P] */
    float *Xt, *Z0;           /* x̃ and z0 = W x̃ (NP-Map) or z = x W (Hedgehog): [T][mx] */
    float *alpha, *sc, *nz;   /* x·u, ‖x‖/max(‖z0‖, floor), ‖z0‖: [T] */
    float *dn;                /* stage 2 only: d‖x‖ [T] (scratch of fmap_bwd_rows) */
} fmap_side;

static size_t fast_floats(const attn_config *c, int T, int n_sel) {
    const size_t D = (size_t)c->head_dim, Fd = (size_t)feat_half(c), P = 2 * Fd, C = (size_t)c->chunk;
    const size_t nc = ((size_t)T + C - 1) / C, mx = Fd > D ? Fd : D, Tz = (size_t)T;
    return 2 * (3 * Tz * P + 2 * Tz * mx + 3 * Tz)   /* the two fmap sides */
           + 2 * Tz * mx                              /* dZ0, dX̃ */
           + 2 * nc * P * (D + 1)                     /* S_c, z_c; dS_c, dz_c */
           + 2 * (size_t)n_sel * D                    /* Sel keys and values */
           + C * ((size_t)n_sel + 2 * C)              /* logits of one chunk */
           + 4 * C * D + 3 * C                        /* numerators, linear part, dA, gate; den, b, db */
           + Tz * D                                   /* dPre */
           + 32 * 16;                                 /* carve() rounds each of the 30 pieces up to 16 */
}

static float *carve(float **p, size_t n) {
    float *r = *p;
    *p += (n + 15) / 16 * 16;
    return r;
}

/* φ of n rows x (leading dimension ldx) for head h, side 0 (q) / 1 (k). */
static void fmap_fwd_rows(const attn_config *c, const float *params, int h, int side, const float *X, int ldx, int n,
                          fmap_side *f) {
    const int D = c->head_dim, hed = c->feature_map == FMAP_HEDGEHOG, Fd = hed ? c->feature_dim : D;
    const int P = 2 * Fd;
    if (n <= 0) return;
    if (hed) {
        const float *W = params + par_w(c, side, h);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, Fd, D, 1.0f, X, ldx, W, Fd, 0.0f, f->Z0, Fd);
        for (int t = 0; t < n; t++) f->sc[t] = 1.0f;
    } else {
        const float *u = params + par_u(c, side, h);
        const float *W = params + par_w(c, side, h);
        const float uu = dotf(u, u, D);
        for (int t = 0; t < n; t++) {
            const float *x = X + (size_t)t * ldx;
            const float a = dotf(x, u, D), fct = still_npmap_reflect(a, uu);
            float *xt = f->Xt + (size_t)t * D;
            for (int i = 0; i < D; i++) xt[i] = x[i] - fct * u[i];
            f->alpha[t] = a;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, D, D, 1.0f, f->Xt, D, W, D, 0.0f, f->Z0, D);
        for (int t = 0; t < n; t++) {
            const float *x = X + (size_t)t * ldx, *z0 = f->Z0 + (size_t)t * D;
            const float nx = sqrtf(dotf(x, x, D)), nz = sqrtf(dotf(z0, z0, D));
            f->nz[t] = nz;
            f->sc[t] = still_npmap_rescale(nx, nz);
        }
    }
    for (int t = 0; t < n; t++) {
        float *a = f->A + (size_t)t * P, *phi = f->F + (size_t)t * P;
        const float *z = f->Z0 + (size_t)t * Fd, s = f->sc[t];
        for (int i = 0; i < Fd; i++) a[i] = z[i] * s, a[Fd + i] = -z[i] * s;
        attn_softmax_inplace(a, Fd);
        attn_softmax_inplace(a + Fd, Fd);
        for (int i = 0; i < P; i++) phi[i] = a[i] < FMAP_CLAMP ? FMAP_CLAMP : a[i];
    }
}

/* Back-propagate dF (n rows; overwritten) through the feature map into gu [D]
 * and gW (both NULL: the parameters are not wanted) and, when dX is given,
 * into the inputs: dX [n] (ldd apart) += ∂/∂x (stage 2). dZ0, dXt: [n][mx]
 * scratch; with dX, f->dn holds n floats of scratch.
 *   Hedgehog z = x W:  gW += Xᵀ dZ, dX += dZ Wᵀ.
 *   NP-Map z = z0 sc, sc = ‖x‖ / max(‖z0‖, 1e-12), z0 = W x̃, x̃ = H x with
 *   the Householder matrix H = I - 2 u uᵀ / u·u (symmetric):
 *     dz0 = sc (dz - z0 (z0·dz) / ‖z0‖²) above the floor (sc dz below it),
 *     d‖x‖ = (z0·dz) / max(‖z0‖, 1e-12), dx̃ = Wᵀ dz0 (row: dz0 W),
 *     dx = H dx̃ + d‖x‖ x / ‖x‖ (‖x‖ > 0). */
static void fmap_bwd_rows(const attn_config *c, const float *params, int h, int side, const float *X, int ldx, int n,
                          fmap_side *f, float *dZ0, float *dXt, float *gu, float *gW, float *dX, int ldd) {
    const int D = c->head_dim, hed = c->feature_map == FMAP_HEDGEHOG, Fd = hed ? c->feature_dim : D;
    const int P = 2 * Fd;
    if (n <= 0) return;
    for (int t = 0; t < n; t++) {
        const float *a = f->A + (size_t)t * P, *g = f->dF + (size_t)t * P;
        float *dz = dZ0 + (size_t)t * Fd;
        for (int i = 0; i < Fd; i++) dz[i] = 0;
        for (int half = 0; half < 2; half++) {
            const float sg = half ? -1.0f : 1.0f, *ah = a + half * Fd, *gh = g + half * Fd;
            float dot = 0;
            for (int i = 0; i < Fd; i++)
                if (!(ah[i] < FMAP_CLAMP)) dot += ah[i] * gh[i];
            for (int i = 0; i < Fd; i++) dz[i] += sg * ah[i] * ((ah[i] < FMAP_CLAMP ? 0.0f : gh[i]) - dot);
        }
    }
    if (hed) {
        const float *W = params + par_w(c, side, h);   /* [D][F] */
        if (gW) cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, Fd, n, 1.0f, X, ldx, dZ0, Fd, 1.0f, gW, Fd);
        if (dX) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, D, Fd, 1.0f, dZ0, Fd, W, Fd, 1.0f, dX, ldd);
        return;
    }
    /* z = z0 sc: dz0 = sc (dz - z0 (z0·dz) / ‖z0‖²) above the norm floor */
    for (int t = 0; t < n; t++) {
        float *dz = dZ0 + (size_t)t * D;
        const float *z0 = f->Z0 + (size_t)t * D, nz = f->nz[t], s = f->sc[t];
        const float zd = dotf(z0, dz, D);
        const float pr = nz > NORM_FLOOR ? zd / (nz * nz) : 0.0f;
        if (dX) f->dn[t] = still_npmap_rescale(zd, nz);   /* d‖x‖ = zd / max(‖z0‖, floor) */
        for (int i = 0; i < D; i++) dz[i] = s * (dz[i] - z0[i] * pr);
    }
    const float *u = params + par_u(c, side, h);
    const float *W = params + par_w(c, side, h);
    if (gW) cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, D, n, 1.0f, dZ0, D, f->Xt, D, 1.0f, gW, D);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, D, D, 1.0f, dZ0, D, W, D, 0.0f, dXt, D);
    /* x̃ = x - 2 (x·u / u·u) u */
    const float beta = dotf(u, u, D);
    if (dX)
        for (int t = 0; t < n; t++) {
            const float *x = X + (size_t)t * ldx, *dxt = dXt + (size_t)t * D;
            const float fu = beta > 0 ? 2.0f * dotf(dxt, u, D) / beta : 0.0f;
            const float nx = sqrtf(dotf(x, x, D)), fx = nx > 0 ? f->dn[t] / nx : 0.0f;
            float *o = dX + (size_t)t * ldd;
            for (int i = 0; i < D; i++) o[i] += dxt[i] - fu * u[i] + fx * x[i];
        }
    if (!gu || !(beta > 0)) return;
    double s_adu = 0;
    for (int t = 0; t < n; t++) {
        const float *x = X + (size_t)t * ldx, *dx = dXt + (size_t)t * D;
        const float du = dotf(dx, u, D), al = f->alpha[t];
        s_adu += (double)al * du;
        for (int i = 0; i < D; i++) gu[i] += -2.0f / beta * (x[i] * du + al * dx[i]);
    }
    for (int i = 0; i < D; i++) gu[i] += (float)(4.0 * s_adu / ((double)beta * beta)) * u[i];
}

/* Shared by the backwards of one head h: the feature maps of the keys that
 * get folded (rows j < (nc-2) C, selected rows zeroed) and of the queries
 * that see a linear term (rows t >= 2C, stored at t - 2C), then the scan
 * S_c = Σ_{chunks <= c-2} φkᵀ V, z_c likewise, for every chunk c >= 2. */
static void fmaps_and_scan(const attn_config *cfg, const float *params, int h, const float *Q, const float *K,
                           const float *V, const unsigned char *picked, int T, fmap_side *fq, fmap_side *fk,
                           float *Sc, float *zc) {
    const int D = cfg->head_dim, C = cfg->chunk, P = 2 * feat_half(cfg), nc = (T + C - 1) / C;
    const int qd = cfg->n_head * D, kvd = cfg->n_head_kv * D, nk = (nc - 2) * C, q0 = 2 * C;
    fmap_fwd_rows(cfg, params, h, 1, K, kvd, nk, fk);
    for (int j = 0; j < nk; j++)
        if (picked[j]) memset(fk->F + (size_t)j * P, 0, sizeof(float) * (size_t)P);
    fmap_fwd_rows(cfg, params, h, 0, Q + (size_t)q0 * qd, qd, T - q0, fq);
    for (int c = 2; c < nc; c++) {
        float *S = Sc + (size_t)c * P * D, *z = zc + (size_t)c * P;
        if (c == 2) memset(S, 0, sizeof(float) * (size_t)P * D), memset(z, 0, sizeof(float) * (size_t)P);
        else memcpy(S, S - (size_t)P * D, sizeof(float) * (size_t)P * D), memcpy(z, z - P, sizeof(float) * (size_t)P);
        const float *Fr = fk->F + (size_t)(c - 2) * C * P;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, P, D, C, 1.0f, Fr, P, V + (size_t)(c - 2) * C * kvd, kvd,
                    1.0f, S, D);
        for (int i = 0; i < C; i++)
            for (int q = 0; q < P; q++) z[q] += Fr[(size_t)i * P + q];
    }
}

/* The selected tokens' keys and values of one KV head, gathered in order. */
/* The state gradients per query chunk dSc [nc][P][D], dzc [nc][P] into suffix sums over chunks 2 .. nc-1
 * (chunk c's becomes the sum over c' >= c: what the keys folded into S_c receive). */
static void suffix_sums(float *dSc, float *dzc, int nc, int P, int D) {
    for (int c = nc - 2; c >= 2; c--) {
        float *a = dSc + (size_t)c * P * D;
        const float *b = a + (size_t)P * D;
        for (size_t i = 0; i < (size_t)P * D; i++) a[i] += b[i];
        for (int q = 0; q < P; q++) dzc[(size_t)c * P + q] += dzc[(size_t)(c + 1) * P + q];
    }
}

static void gather_sel(const float *K, const float *V, int kvd, int D, const int *sel_pos, int n_selpos, float *Ks,
                       float *Vs) {
    for (int i = 0; i < n_selpos; i++) {
        memcpy(Ks + (size_t)i * D, K + (size_t)sel_pos[i] * kvd, sizeof(float) * (size_t)D);
        memcpy(Vs + (size_t)i * D, V + (size_t)sel_pos[i] * kvd, sizeof(float) * (size_t)D);
    }
}

static void head_bwd_fast(const attn_config *cfg, const float *params, const attn_io *io, const float *dout,
                          float *dparams, int h, const int *sel_pos, int n_selpos, const unsigned char *rec, float *wk) {
    const int H = cfg->n_head, Hk = cfg->n_head_kv, D = cfg->head_dim, C = cfg->chunk, T = io->T, G = H / Hk;
    const int hk = h / G, hs = cfg->per_kv_head ? hk : h, Fd = feat_half(cfg), P = 2 * Fd, qd = H * D, kvd = Hk * D;
    const int gate = cfg->gate, dm = gate ? cfg->d_model : 0, nc = (T + C - 1) / C, mx = Fd > D ? Fd : D;
    const size_t Hz = (size_t)H;
    if (nc <= 2) return;   /* no query sees a linear term */
    const unsigned char *picked = rec + (size_t)hs * T;
    const float scale = attn_logit_scale(D);
    const int nk = (nc - 2) * C, q0 = 2 * C, nq = T - q0;

    float *p = wk;
    fmap_side fq = {0}, fk = {0};
    fmap_side *sides[2] = {&fq, &fk};
    for (int i = 0; i < 2; i++) {
        fmap_side *f = sides[i];
        f->A = carve(&p, (size_t)T * P), f->F = carve(&p, (size_t)T * P), f->dF = carve(&p, (size_t)T * P);
        f->Xt = carve(&p, (size_t)T * mx), f->Z0 = carve(&p, (size_t)T * mx);
        f->alpha = carve(&p, T), f->sc = carve(&p, T), f->nz = carve(&p, T);
    }
    float *dZ0 = carve(&p, (size_t)T * mx), *dXt = carve(&p, (size_t)T * mx);
    float *Sc = carve(&p, (size_t)nc * P * D), *zc = carve(&p, (size_t)nc * P);
    float *dSc = carve(&p, (size_t)nc * P * D), *dzc = carve(&p, (size_t)nc * P);
    float *Ks = carve(&p, (size_t)n_selpos * D), *Vs = carve(&p, (size_t)n_selpos * D);
    const int ldg = n_selpos + 2 * C;
    float *lg = carve(&p, (size_t)C * ldg);
    float *num = carve(&p, (size_t)C * D), *lin = carve(&p, (size_t)C * D), *dA = carve(&p, (size_t)C * D);
    float *gt = carve(&p, (size_t)C * D), *den = carve(&p, C), *bb = carve(&p, C), *db = carve(&p, C);
    float *dPre = carve(&p, (size_t)T * D);

    const float *Q = io->q + (size_t)h * D, *K = io->k + (size_t)hk * D, *V = io->v + (size_t)hk * D;

    /* 1. feature maps */
    fmaps_and_scan(cfg, params, h, Q, K, V, picked, T, &fq, &fk, Sc, zc);   /* 1. and 2. */

    /* 3. per chunk: outputs and their gradients */
    gather_sel(K, V, kvd, D, sel_pos, n_selpos, Ks, Vs);
    const float *Wg = gate ? params + fmap_params(cfg) + (size_t)h * D * dm : NULL;
    const float *bg = gate ? params + fmap_params(cfg) + Hz * D * dm + (size_t)h * D : NULL;
    memset(dPre, 0, sizeof(float) * (size_t)T * D);
    int ns = 0;
    for (int c = 2; c < nc; c++) {
        const int t0 = c * C, nt = T - t0 < C ? T - t0 : C, lo = (c - 1) * C;
        while (ns < n_selpos && sel_pos[ns] < lo) ns++;
        const float *S = Sc + (size_t)c * P * D, *z = zc + (size_t)c * P;
        const float *Fq = fq.F + (size_t)(t0 - q0) * P;
        float *dFq = fq.dF + (size_t)(t0 - q0) * P;
        /* softmax part: logits [nt][ns | 2C] */
        if (ns)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, ns, D, scale, Q + (size_t)t0 * qd, qd, Ks, D, 0.0f,
                        lg, ldg);
        const int nl = t0 + nt - lo;   /* local keys lo .. t0+nt-1 */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, nl, D, scale, Q + (size_t)t0 * qd, qd,
                    K + (size_t)lo * kvd, kvd, 0.0f, lg + ns, ldg);
        for (int i = 0; i < nt; i++) {
            float *r = lg + (size_t)i * ldg;
            const int nvis = ns + (t0 + i - lo + 1);   /* Sel, then local keys up to t */
            float m = -INFINITY;
            for (int j = 0; j < nvis; j++) m = r[j] > m ? r[j] : m;
            float sum = 0;
            for (int j = 0; j < nvis; j++) sum += r[j] = expf(r[j] - m);
            for (int j = nvis; j < ns + nl; j++) r[j] = 0;
            den[i] = sum;
        }
        if (ns)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, D, ns, 1.0f, lg, ldg, Vs, D, 0.0f, num, D);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, D, nl, 1.0f, lg + ns, ldg, V + (size_t)lo * kvd,
                    kvd, ns ? 1.0f : 0.0f, num, D);
        /* linear part and gate */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, D, P, 1.0f, Fq, P, S, D, 0.0f, lin, D);
        cblas_sgemv(CblasRowMajor, CblasNoTrans, nt, P, 1.0f, Fq, P, z, 1, 0.0f, bb, 1);
        if (gate) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, D, dm, 1.0f, io->x + (size_t)t0 * dm, dm, Wg, dm,
                        0.0f, gt, D);
            for (int i = 0; i < nt; i++)
                for (int x = 0; x < D; x++) gt[(size_t)i * D + x] = 1.0f / (1.0f + expf(-(gt[(size_t)i * D + x] + bg[x])));
        }
        /* gradients at the output */
        for (int i = 0; i < nt; i++) {
            const float *dy = dout + (size_t)(t0 + i) * qd + (size_t)h * D;
            const float *nu = num + (size_t)i * D, *a = lin + (size_t)i * D, *g = gate ? gt + (size_t)i * D : NULL;
            float *da = dA + (size_t)i * D, *dp = dPre + (size_t)(t0 + i) * D;
            if (g && cfg->gate_den) {   /* per channel: den_x = l + g_x b + 1e-6, dden_x = -dy_x y_x / den_x */
                float dbs = 0;
                for (int x = 0; x < D; x++) {
                    const float inx = 1.0f / still_den(den[i], g[x], bb[i], 1), dnx = dy[x] * inx;
                    const float dden = -dnx * (nu[x] + g[x] * a[x]) * inx;
                    dbs += dden * g[x];
                    da[x] = dnx * g[x];
                    dp[x] = (dnx * a[x] + dden * bb[i]) * g[x] * (1.0f - g[x]);
                }
                db[i] = dbs;
                continue;
            }
            const float inv = 1.0f / still_den(den[i], 1.0f, bb[i], 0);
            float gy = 0;
            for (int x = 0; x < D; x++) gy += dy[x] * (nu[x] + (g ? g[x] : 1.0f) * a[x]);
            db[i] = -gy * inv * inv;
            for (int x = 0; x < D; x++) {
                const float dnx = dy[x] * inv;
                if (g) {
                    da[x] = dnx * g[x];
                    dp[x] = dnx * a[x] * g[x] * (1.0f - g[x]);
                } else
                    da[x] = dnx;
            }
        }
        /* dφq = dA Sᵀ + db zᵀ; dS_c = φqᵀ dA; dz_c = φqᵀ db */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, P, D, 1.0f, dA, D, S, D, 0.0f, dFq, P);
        for (int i = 0; i < nt; i++)
            for (int q = 0; q < P; q++) dFq[(size_t)i * P + q] += db[i] * z[q];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, P, D, nt, 1.0f, Fq, P, dA, D, 0.0f, dSc + (size_t)c * P * D,
                    D);
        cblas_sgemv(CblasRowMajor, CblasTrans, nt, P, 1.0f, Fq, P, db, 1, 0.0f, dzc + (size_t)c * P, 1);
    }

    /* 4. suffix sums, then dφk of the folded keys (chunk cj is in S_c for c >= cj+2) */
    suffix_sums(dSc, dzc, nc, P, D);
    for (int cj = 0; cj + 2 < nc; cj++) {
        const float *R = dSc + (size_t)(cj + 2) * P * D, *Rz = dzc + (size_t)(cj + 2) * P;
        float *dF = fk.dF + (size_t)cj * C * P;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, C, P, D, 1.0f, V + (size_t)cj * C * kvd, kvd, R, D, 0.0f,
                    dF, P);
        for (int i = 0; i < C; i++) {
            float *r = dF + (size_t)i * P;
            if (picked[cj * C + i]) memset(r, 0, sizeof(float) * (size_t)P);
            else
                for (int q = 0; q < P; q++) r[q] += Rz[q];
        }
    }

    /* 5. gate */
    if (gate) {
        float *dWg = dparams + fmap_params(cfg) + (size_t)h * D * dm, *dbg = dparams + fmap_params(cfg) + Hz * D * dm;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, dm, nq, 1.0f, dPre + (size_t)q0 * D, D,
                    io->x + (size_t)q0 * dm, dm, 1.0f, dWg, dm);
        for (int t = q0; t < T; t++)
            for (int x = 0; x < D; x++) dbg[(size_t)h * D + x] += dPre[(size_t)t * D + x];
    }

    /* 6. feature-map backward into this head's slices */
    float *gqu = NULL, *gku = NULL, *gqW, *gkW;
    if (cfg->feature_map == FMAP_HEDGEHOG) {
        gqW = dparams + par_w(cfg, 0, h), gkW = dparams + par_w(cfg, 1, h);
    } else {
        gqu = dparams + par_u(cfg, 0, h), gku = dparams + par_u(cfg, 1, h);
        gqW = dparams + par_w(cfg, 0, h), gkW = dparams + par_w(cfg, 1, h);
    }
    fmap_bwd_rows(cfg, params, h, 0, Q + (size_t)q0 * qd, qd, nq, &fq, dZ0, dXt, gqu, gqW, NULL, 0);
    fmap_bwd_rows(cfg, params, h, 1, K, kvd, nk, &fk, dZ0, dXt, gku, gkW, NULL, 0);
}

/* The selection the forward makes over io (a whole sequence; attn_still.h):
 * the float forward (its output into y [T][H*D]) run once on a fresh state
 * with the recorder on in leave_chunk. rec [Hs][T] (zeroed by the caller)
 * gets 1 where a token is selected; the first n_selpos[hs] entries of
 * sel_pos + hs*T are the positions selection head hs selects, in order;
 * *max_sel the largest count. */
/* rec gets the tokens in Sel after the whole sequence. Selection is then one fixed set for every query
 * only if nothing was evicted; the backwards need that (allow_evict 0: an eviction is an error), the
 * diagnosis reads the end state (allow_evict 1). */
int attn_still_record_selection(const attn_config *cfg, const float *params, const attn_io *io, float *y,
                                unsigned char *rec, int *sel_pos, int *n_selpos, int *max_sel, int allow_evict,
                                still_err *err) {
    const int T = io->T, Hs = cfg->per_kv_head ? cfg->n_head_kv : cfg->n_head;
    attn_state *s = NULL;
    int rc = still_state_create(cfg, &s, err);
    if (rc) return rc;
    ((still_impl *)s->impl)->rec = rec, ((still_impl *)s->impl)->rec_len = T;
    rc = still_forward(s, params, io, y, err);
    const long long n_ev = ((still_impl *)s->impl)->n_evicted;
    still_state_free(s);
    if (rc) return rc;
    if (n_ev && !allow_evict)
        return still_fail(err, STILL_E_UNSUPPORTED,
                          "still backward: global selection evicted %lld tokens in this %d-token sequence; training "
                          "supports sequences the store holds (at most budget - chunk = %d tokens)",
                          n_ev, io->T, cfg->budget - cfg->chunk);
    *max_sel = 0;
    for (int hs = 0; hs < Hs; hs++) {
        n_selpos[hs] = 0;
        for (int j = 0; j < T; j++)
            if (rec[(size_t)hs * T + j]) sel_pos[(size_t)hs * T + n_selpos[hs]++] = j;
        *max_sel = n_selpos[hs] > *max_sel ? n_selpos[hs] : *max_sel;
    }
    return STILL_OK;
}

/* Shared by the backward and the fused distillation step: checks, then the
 * selection the forward makes (the float forward run once with the recorder
 * on in leave_chunk), then the fast backward per head. */
static int still_backward_run(const attn_config *cfg, const float *params, const attn_io *io, const float *dout,
                              float *dparams, const float *target, float scale, double *mse, still_err *err) {
    int lam = 0, capped = 0, cap = 0;
    int rc = still_check(cfg, &lam, &capped, &cap, err);
    if (rc) return rc;
    if (!io || (!target && (!dout || !dparams)))
        return still_fail(err, STILL_E_ARG, "still backward: io, dout and dparams are required");
    if (io->p0 != 0)
        return still_fail(err, STILL_E_ARG, "still backward needs a whole sequence (p0 = 0), got p0 = %d", io->p0);
    if (io->T < 0) return still_fail(err, STILL_E_ARG, "still backward: negative token count %d", io->T);
    if (io->T > cfg->n_ctx)
        return still_fail(err, STILL_E_ARG, "still backward: %d tokens exceed n_ctx %d", io->T, cfg->n_ctx);
    if (target) *mse = 0;
    if (io->T == 0) return STILL_OK;
    if (!cfg->linear && !target) return STILL_OK;   /* linear off: no parameter reaches the output */
    if (!io->q || !io->k || !io->v) return still_fail(err, STILL_E_ARG, "still backward: q, k and v are required");
    if (!params && cfg->linear) return still_fail(err, STILL_E_ARG, "still backward: parameters required");
    if (cfg->linear && cfg->gate && !io->x) return still_fail(err, STILL_E_ARG, "still backward: the gate needs the layer input x");

    const int T = io->T, H = cfg->n_head, Hs = cfg->per_kv_head ? cfg->n_head_kv : H;
    unsigned char *rec = calloc((size_t)Hs * T, 1);
    int *sel_pos = malloc(sizeof(int) * (size_t)Hs * T), *n_selpos = calloc((size_t)Hs, sizeof(int));
    float *y = malloc(sizeof(float) * (size_t)T * H * cfg->head_dim);
    void *wk = NULL;
    int max_sel = 0;
    if (!rec || !sel_pos || !n_selpos || !y) {
        rc = still_fail(err, STILL_E_NOMEM, "still backward: out of memory");
        goto done;
    }
    if ((rc = attn_still_record_selection(cfg, params, io, y, rec, sel_pos, n_selpos, &max_sel, 0, err))) goto done;
    if (target) {   /* distillation: the loss and its gradient from this forward */
        *mse = attn_mse_grad(y, target, (size_t)T * H * cfg->head_dim, scale, y);
        dout = y;
        if (!dparams || !cfg->linear) goto done;
    }

    const size_t per = fast_floats(cfg, T, max_sel) * sizeof(float);
    const int n_thr = omp_get_max_threads() < H ? omp_get_max_threads() : H;
    wk = malloc(per * (size_t)n_thr);
    if (!wk) {
        rc = still_fail(err, STILL_E_NOMEM, "still backward: out of memory (%.1f MiB)", (double)per * n_thr / 1048576.0);
        goto done;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_thr)
    for (int h = 0; h < H; h++) {
        const int hs = cfg->per_kv_head ? h / (H / cfg->n_head_kv) : h;
        char *w = (char *)wk + (size_t)omp_get_thread_num() * per;
        head_bwd_fast(cfg, params, io, dout, dparams, h, sel_pos + (size_t)hs * T, n_selpos[hs], rec, (float *)w);
    }
done:
    free(wk), free(rec), free(sel_pos), free(n_selpos), free(y);
    return rc;
}

static int still_backward(const attn_config *cfg, const float *params, const attn_io *io, const float *dout,
                          float *dparams, still_err *err) {
    return still_backward_run(cfg, params, io, dout, dparams, NULL, 0, NULL, err);
}

static int still_distill(const attn_config *cfg, const float *params, const attn_io *io, const float *target,
                         float scale, float *dparams, double *mse, still_err *err) {
    return still_backward_run(cfg, params, io, NULL, dparams, target, scale, mse, err);
}

/* ---- stage 2: gradients of the inputs ----------------------------------------------- */

/* still_backward_inputs: for a whole sequence and the forward's selection
 * (a fixed routing decision, recorded as for the stage-1 backward), the
 * gradient of Σ dout ⊙ y with respect to q, k, v (after RoPE), x (through
 * the gate) and, when wanted, the parameters. Per query head h (KV head hk,
 * selection head hs) and query t of chunk c, with A(t) = Sel_hs(chunks <=
 * c-2) ∪ Local(t):
 *
 *   e_j = e^{s_tj - m_t}, s_tj = q_t·k_j / √D, m_t = max_A s_tj (argmax j*: the first)
 *   N = Σ_A e_j v_j + g ⊙ a, a = Sᵀ φq(q_t);  Dn = Σ_A e_j + b + 1e-6, b = φq(q_t)·z;  y = N / Dn
 *   (the linear terms only for c >= 2 with linear on; g = 1 without the gate)
 *
 *   dN = dy / Dn, dDn = -(dy·y) / Dn
 *   softmax part: de_j = dN·v_j + dDn, ds_j = e_j de_j with m held fixed.
 *     The linear terms are not rescaled by e^{-m}, so y depends on m
 *     (∂e_j/∂m = -e_j): m's gradient -Σ_j ds_j goes to the argmax logit,
 *     ds_j* -= Σ_j ds_j (without a linear term Σ_j ds_j is 0 up to the 1e-6:
 *     applied all the same). Then dq_t += Σ_j ds_j k_j / √D, dk_j += ds_j
 *     q_t / √D, dv_j += e_j dN (Sel's keys gathered into [n_sel][D] rows,
 *     their gradients scattered back to the tokens' positions at the end);
 *   linear part: da = dN ⊙ g, dg = dN ⊙ a, db = dDn; the gate's dPre = dg ⊙
 *     g(1-g) gives dx_t += Wg_hᵀ dPre (one product over all heads at the
 *     end) and dWg_h += dPreᵀ X, dbg_h += Σ_t dPre;  dφq = S da + z db
 *     (through the q-map into dq_t);  dS_c = Σ_{t∈c} φq daᵀ, dz_c = Σ φq db,
 *     suffix-summed to R_c = Σ_{c'>=c} dS_c': a folded key j of chunk cj is
 *     in S_c for every c >= cj+2, so dφk_j = R_{cj+2} v_j + Rz_{cj+2}
 *     (through head h's k-map into dk_j) and dv_j += R_{cj+2}ᵀ φk_j.
 *
 * This is head_bwd_fast extended to every chunk (the softmax part also has
 * gradients in chunks 0 and 1) and to the inputs: per chunk, matrix products
 * over [Sel prefix | the two Local chunks] (logits Q Kᵀ, E V, dE = dN Vᵀ,
 * dV = Eᵀ dN, dQ = dS K, dK = dSᵀ Q), the scan of S_c, the suffix sums and
 * the batched feature-map backward (fmap_bwd_rows, now with the input
 * gradient). Heads run in parallel (sgemm single-threaded inside); each
 * writes its own columns of dq and dPre, its own parameter slices, and
 * private dk, dv [T][D]; the G heads of a KV head are then summed in head
 * order and dx is formed in fixed blocks of rows, so the result does not
 * depend on the thread count (bit-identical). The parameter gradient is the
 * stage-1 backward's (head_bwd_fast's products on the same data). As in the
 * stage-1 backward, Sel's keys and values are the exact float32 inputs
 * whatever cfg->sel_type (with f16 / q8 storage this is the gradient of the
 * float32-Sel function, the rounding passed straight through). Memory: per
 * thread about 2·T·(3P + 2D) + 2·(T/C)·P·D floats (the linear branch),
 * plus dk, dv [H][T][D] and dPre [T][H·D]. */

#define DX_ROWS 64   /* rows of dx per product (a fixed partition: thread-count independent) */

static size_t inputs_floats(const attn_config *c, int T, int n_sel) {
    const size_t D = (size_t)c->head_dim, Fd = (size_t)feat_half(c), P = 2 * Fd, C = (size_t)c->chunk;
    const size_t nc = ((size_t)T + C - 1) / C, mx = Fd > D ? Fd : D, Tz = (size_t)T, ns = (size_t)n_sel;
    const size_t lin = c->linear ? 2 * (3 * Tz * P + 2 * Tz * mx + 4 * Tz)   /* the two fmap sides */
                                       + 2 * Tz * mx                         /* dZ0, dX̃ */
                                       + 2 * nc * P * (D + 1)                /* S_c, z_c; dS_c, dz_c */
                                 : 0;
    return lin + 4 * ns * D          /* Sel keys, values and their gradients */
           + 2 * C * (ns + 2 * C)    /* E and dE (then dS) of one chunk */
           + 5 * C * D + 5 * C       /* numerators, linear part, dA, gate, dN; den, b, dDn, db (gate_den), argmax */
           + Tz * D                  /* dQ */
           + 48 * 16;                /* carve() rounds each of the (at most 40) pieces up to 16 */
}

/* One query head: dq of head h into dq (its columns; NULL: not wanted), its
 * own dk, dv [T][D] (overwritten), the gate's dPre into its columns of
 * dPre [T][H*D] (rows >= 2C; the gate only), and, when dparams is given,
 * its parameter slices. */
static void head_bwd_inputs(const attn_config *cfg, const float *params, const attn_io *io, const float *dout, int h,
                            const int *sel_pos, int n_selpos, const unsigned char *rec, float *wk, float *dK,
                            float *dV, float *dPre, float *dq, float *dparams) {
    const int H = cfg->n_head, Hk = cfg->n_head_kv, D = cfg->head_dim, C = cfg->chunk, T = io->T, G = H / Hk;
    const int hk = h / G, hs = cfg->per_kv_head ? hk : h, Fd = feat_half(cfg), P = 2 * Fd, qd = H * D, kvd = Hk * D;
    const int nc = (T + C - 1) / C, mx = Fd > D ? Fd : D;
    const int has_lin = cfg->linear && nc > 2, gate = has_lin && cfg->gate, dm = gate ? cfg->d_model : 0;
    const size_t Hz = (size_t)H, HD = Hz * D;
    const unsigned char *picked = rec + (size_t)hs * T;
    const float scale = attn_logit_scale(D);
    const int nk = has_lin ? (nc - 2) * C : 0, q0 = 2 * C, nq = has_lin ? T - q0 : 0;

    float *p = wk;
    fmap_side fq = {0}, fk = {0};
    float *dZ0 = NULL, *dXt = NULL, *Sc = NULL, *zc = NULL, *dSc = NULL, *dzc = NULL;
    if (cfg->linear) {
        fmap_side *sides[2] = {&fq, &fk};
        for (int i = 0; i < 2; i++) {
            fmap_side *f = sides[i];
            f->A = carve(&p, (size_t)T * P), f->F = carve(&p, (size_t)T * P), f->dF = carve(&p, (size_t)T * P);
            f->Xt = carve(&p, (size_t)T * mx), f->Z0 = carve(&p, (size_t)T * mx);
            f->alpha = carve(&p, T), f->sc = carve(&p, T), f->nz = carve(&p, T), f->dn = carve(&p, T);
        }
        dZ0 = carve(&p, (size_t)T * mx), dXt = carve(&p, (size_t)T * mx);
        Sc = carve(&p, (size_t)nc * P * D), zc = carve(&p, (size_t)nc * P);
        dSc = carve(&p, (size_t)nc * P * D), dzc = carve(&p, (size_t)nc * P);
    }
    float *Ks = carve(&p, (size_t)n_selpos * D), *Vs = carve(&p, (size_t)n_selpos * D);
    float *dKs = carve(&p, (size_t)n_selpos * D), *dVs = carve(&p, (size_t)n_selpos * D);
    const int ldg = n_selpos + 2 * C;
    float *E = carve(&p, (size_t)C * ldg), *dE = carve(&p, (size_t)C * ldg);
    float *num = carve(&p, (size_t)C * D), *lin = carve(&p, (size_t)C * D), *dA = carve(&p, (size_t)C * D);
    float *gt = carve(&p, (size_t)C * D), *dN = carve(&p, (size_t)C * D);
    float *den = carve(&p, C), *bb = carve(&p, C), *db = carve(&p, C);
    float *dbl = cfg->gate_den ? carve(&p, C) : db;   /* b's gradient: dDn, or Σ_x dDn_x g_x with gate_den */
    int *am = (int *)(void *)carve(&p, C);   /* argmax of each row (int and float have one size) */
    float *dQ = carve(&p, (size_t)T * D);

    const float *Q = io->q + (size_t)h * D, *K = io->k + (size_t)hk * D, *V = io->v + (size_t)hk * D;
    memset(dQ, 0, sizeof(float) * (size_t)T * D);
    memset(dK, 0, sizeof(float) * (size_t)T * D);
    memset(dV, 0, sizeof(float) * (size_t)T * D);
    if (n_selpos) {
        memset(dKs, 0, sizeof(float) * (size_t)n_selpos * D);
        memset(dVs, 0, sizeof(float) * (size_t)n_selpos * D);
    }

    if (has_lin) {
        /* feature maps of the keys that get folded (selected rows zeroed) and
         * of the queries that see a linear term (row t - 2C) */
        fmaps_and_scan(cfg, params, h, Q, K, V, picked, T, &fq, &fk, Sc, zc);
    }
    gather_sel(K, V, kvd, D, sel_pos, n_selpos, Ks, Vs);
    const float *Wg = gate ? params + fmap_params(cfg) + (size_t)h * D * dm : NULL;
    const float *bg = gate ? params + fmap_params(cfg) + HD * dm + (size_t)h * D : NULL;

    /* per chunk: the outputs, then their gradients */
    int ns = 0;
    for (int c = 0; c < nc; c++) {
        const int t0 = c * C, nt = T - t0 < C ? T - t0 : C, lo = c ? (c - 1) * C : 0, nl = t0 + nt - lo;
        const int lin_c = has_lin && c >= 2;
        while (ns < n_selpos && sel_pos[ns] < lo) ns++;   /* Sel(t): selected from chunks <= c-2 */
        const float *Qc = Q + (size_t)t0 * qd, *Kl = K + (size_t)lo * kvd, *Vl = V + (size_t)lo * kvd;
        /* logits [nt][ns | nl], masked causally; weights e = exp(s - m) */
        if (ns)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, ns, D, scale, Qc, qd, Ks, D, 0.0f, E, ldg);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, nl, D, scale, Qc, qd, Kl, kvd, 0.0f, E + ns, ldg);
        for (int i = 0; i < nt; i++) {
            float *r = E + (size_t)i * ldg;
            const int nvis = ns + (t0 + i - lo + 1);   /* Sel, then local keys up to t */
            float m = -INFINITY;
            int jm = 0;
            for (int j = 0; j < nvis; j++)
                if (r[j] > m) m = r[j], jm = j;
            float sum = 0;
            for (int j = 0; j < nvis; j++) sum += r[j] = expf(r[j] - m);
            for (int j = nvis; j < ns + nl; j++) r[j] = 0;
            den[i] = sum, am[i] = jm;
        }
        if (ns) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, D, ns, 1.0f, E, ldg, Vs, D, 0.0f, num, D);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, D, nl, 1.0f, E + ns, ldg, Vl, kvd, ns ? 1.0f : 0.0f,
                    num, D);
        /* linear part a = φq S_c, b = φq z_c, and the gate */
        const float *S = lin_c ? Sc + (size_t)c * P * D : NULL, *z = lin_c ? zc + (size_t)c * P : NULL;
        const float *Fq = lin_c ? fq.F + (size_t)(t0 - q0) * P : NULL;
        if (lin_c) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, D, P, 1.0f, Fq, P, S, D, 0.0f, lin, D);
            cblas_sgemv(CblasRowMajor, CblasNoTrans, nt, P, 1.0f, Fq, P, z, 1, 0.0f, bb, 1);
            if (gate) {
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, D, dm, 1.0f, io->x + (size_t)t0 * dm, dm, Wg,
                            dm, 0.0f, gt, D);
                for (int i = 0; i < nt; i++)
                    for (int x = 0; x < D; x++)
                        gt[(size_t)i * D + x] = 1.0f / (1.0f + expf(-(gt[(size_t)i * D + x] + bg[x])));
            }
        }
        /* dN = dy / Dn, dDn = -(dy·y) / Dn = -(dy·N) / Dn²; da, dPre */
        for (int i = 0; i < nt; i++) {
            const float *dy = dout + (size_t)(t0 + i) * qd + (size_t)h * D, *nu = num + (size_t)i * D;
            const float *a = lin + (size_t)i * D, *g = gate ? gt + (size_t)i * D : NULL;
            if (lin_c && g && cfg->gate_den) {
                /* per channel: Dn_x = l + g_x b + 1e-6, dDn_x = -dy_x y_x / Dn_x; l gets Σ_x dDn_x, b gets
                 * Σ_x dDn_x g_x, g_x gets dN_x a_x + dDn_x b */
                float *dn = dN + (size_t)i * D, *da = dA + (size_t)i * D;
                float *dp = dPre + (size_t)(t0 + i) * HD + (size_t)h * D;
                float sl = 0, sb = 0;
                for (int x = 0; x < D; x++) {
                    const float inx = 1.0f / still_den(den[i], g[x], bb[i], 1);
                    dn[x] = dy[x] * inx;
                    const float dd = -dn[x] * (nu[x] + g[x] * a[x]) * inx;
                    sl += dd, sb += dd * g[x];
                    da[x] = dn[x] * g[x];
                    dp[x] = (dn[x] * a[x] + dd * bb[i]) * g[x] * (1.0f - g[x]);
                }
                db[i] = sl, dbl[i] = sb;
                continue;
            }
            const float inv = 1.0f / still_den(den[i], 1.0f, lin_c ? bb[i] : 0.0f, 0);
            float gy = 0;
            if (lin_c)
                for (int x = 0; x < D; x++) gy += dy[x] * (nu[x] + (g ? g[x] : 1.0f) * a[x]);
            else
                for (int x = 0; x < D; x++) gy += dy[x] * nu[x];
            db[i] = -gy * inv * inv;
            float *dn = dN + (size_t)i * D;
            for (int x = 0; x < D; x++) dn[x] = dy[x] * inv;
            if (lin_c) {
                float *da = dA + (size_t)i * D;
                if (g) {
                    float *dp = dPre + (size_t)(t0 + i) * HD + (size_t)h * D;
                    for (int x = 0; x < D; x++) da[x] = dn[x] * g[x], dp[x] = dn[x] * a[x] * g[x] * (1.0f - g[x]);
                } else
                    memcpy(da, dn, sizeof(float) * (size_t)D);
            }
        }
        /* dE = dN Vᵀ; dV += Eᵀ dN */
        if (ns) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, ns, D, 1.0f, dN, D, Vs, D, 0.0f, dE, ldg);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ns, D, nt, 1.0f, E, ldg, dN, D, 1.0f, dVs, D);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, nl, D, 1.0f, dN, D, Vl, kvd, 0.0f, dE + ns, ldg);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nl, D, nt, 1.0f, E + ns, ldg, dN, D, 1.0f,
                    dV + (size_t)lo * D, D);
        /* dS = E ⊙ (dE + dDn), then m's share -Σ_j dS_j to the argmax */
        for (int i = 0; i < nt; i++) {
            float *r = dE + (size_t)i * ldg;
            const float *e = E + (size_t)i * ldg, dd = db[i];
            const int nvis = ns + (t0 + i - lo + 1);
            float sum = 0;
            for (int j = 0; j < nvis; j++) sum += r[j] = e[j] * (r[j] + dd);
            for (int j = nvis; j < ns + nl; j++) r[j] = 0;
            r[am[i]] -= sum;
        }
        /* dQ += dS K / √D; dK += dSᵀ Q / √D */
        if (ns) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, D, ns, scale, dE, ldg, Ks, D, 1.0f,
                        dQ + (size_t)t0 * D, D);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ns, D, nt, scale, dE, ldg, Qc, qd, 1.0f, dKs, D);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, D, nl, scale, dE + ns, ldg, Kl, kvd, 1.0f,
                    dQ + (size_t)t0 * D, D);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nl, D, nt, scale, dE + ns, ldg, Qc, qd, 1.0f,
                    dK + (size_t)lo * D, D);
        if (lin_c) {
            /* dφq = dA S_cᵀ + dDn z_cᵀ; dS_c = φqᵀ dA; dz_c = φqᵀ dDn */
            float *dFq = fq.dF + (size_t)(t0 - q0) * P;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nt, P, D, 1.0f, dA, D, S, D, 0.0f, dFq, P);
            for (int i = 0; i < nt; i++)
                for (int q = 0; q < P; q++) dFq[(size_t)i * P + q] += dbl[i] * z[q];
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, P, D, nt, 1.0f, Fq, P, dA, D, 0.0f,
                        dSc + (size_t)c * P * D, D);
            cblas_sgemv(CblasRowMajor, CblasTrans, nt, P, 1.0f, Fq, P, dbl, 1, 0.0f, dzc + (size_t)c * P, 1);
        }
    }

    if (has_lin) {
        /* suffix sums; the folded keys of chunk cj (in S_c for c >= cj+2):
         * dφk = V R_{cj+2}ᵀ + Rz, dV += φk R_{cj+2} (selected rows of φk are 0) */
        suffix_sums(dSc, dzc, nc, P, D);
        for (int cj = 0; cj + 2 < nc; cj++) {
            const float *R = dSc + (size_t)(cj + 2) * P * D, *Rz = dzc + (size_t)(cj + 2) * P;
            float *dF = fk.dF + (size_t)cj * C * P;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, C, P, D, 1.0f, V + (size_t)cj * C * kvd, kvd, R, D,
                        0.0f, dF, P);
            for (int i = 0; i < C; i++) {
                float *r = dF + (size_t)i * P;
                if (picked[cj * C + i]) memset(r, 0, sizeof(float) * (size_t)P);
                else
                    for (int q = 0; q < P; q++) r[q] += Rz[q];
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, C, D, P, 1.0f, fk.F + (size_t)cj * C * P, P, R, D,
                        1.0f, dV + (size_t)cj * C * D, D);
        }
        /* the gate's parameters: dWg_h += dPreᵀ X, dbg_h += Σ_t dPre */
        if (gate && dparams) {
            float *dWg = dparams + fmap_params(cfg) + (size_t)h * D * dm;
            float *dbg = dparams + fmap_params(cfg) + HD * dm + (size_t)h * D;
            const float *dp = dPre + (size_t)q0 * HD + (size_t)h * D;
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, dm, nq, 1.0f, dp, (int)HD, io->x + (size_t)q0 * dm,
                        dm, 1.0f, dWg, dm);
            for (int t = 0; t < nq; t++)
                for (int x = 0; x < D; x++) dbg[x] += dp[(size_t)t * HD + x];
        }
        /* feature-map backward: into dq / dk, and this head's parameter slices */
        float *gqu = NULL, *gku = NULL, *gqW = NULL, *gkW = NULL;
        if (dparams) {
            if (cfg->feature_map == FMAP_HEDGEHOG) {
                gqW = dparams + par_w(cfg, 0, h), gkW = dparams + par_w(cfg, 1, h);
            } else {
                gqu = dparams + par_u(cfg, 0, h), gku = dparams + par_u(cfg, 1, h);
                gqW = dparams + par_w(cfg, 0, h), gkW = dparams + par_w(cfg, 1, h);
            }
        }
        fmap_bwd_rows(cfg, params, h, 0, Q + (size_t)q0 * qd, qd, nq, &fq, dZ0, dXt, gqu, gqW, dQ + (size_t)q0 * D, D);
        fmap_bwd_rows(cfg, params, h, 1, K, kvd, nk, &fk, dZ0, dXt, gku, gkW, dK, D);
    }

    /* Sel's gradients back to the tokens' positions; dq into head h's columns */
    for (int i = 0; i < n_selpos; i++) {
        float *a = dK + (size_t)sel_pos[i] * D, *b = dV + (size_t)sel_pos[i] * D;
        const float *ga = dKs + (size_t)i * D, *gb = dVs + (size_t)i * D;
        for (int x = 0; x < D; x++) a[x] += ga[x], b[x] += gb[x];
    }
    if (dq)
        for (int t = 0; t < T; t++) {
            float *o = dq + (size_t)t * qd + (size_t)h * D;
            const float *s = dQ + (size_t)t * D;
            for (int x = 0; x < D; x++) o[x] += s[x];
        }
}

static int still_backward_inputs(const attn_config *cfg, const float *params, const attn_io *io, const float *dout,
                                 const attn_grads *g, still_err *err) {
    int lam = 0, capped = 0, cap = 0;
    int rc = still_check(cfg, &lam, &capped, &cap, err);
    if (rc) return rc;
    if (!io || !dout || !g) return still_fail(err, STILL_E_ARG, "still backward_inputs: io, dout and the gradients are required");
    if (io->p0 != 0)
        return still_fail(err, STILL_E_ARG, "still backward_inputs needs a whole sequence (p0 = 0), got p0 = %d", io->p0);
    if (io->T < 0) return still_fail(err, STILL_E_ARG, "still backward_inputs: negative token count %d", io->T);
    if (io->T > cfg->n_ctx)
        return still_fail(err, STILL_E_ARG, "still backward_inputs: %d tokens exceed n_ctx %d", io->T, cfg->n_ctx);
    if (io->T == 0) return STILL_OK;
    if (!io->q || !io->k || !io->v) return still_fail(err, STILL_E_ARG, "still backward_inputs: q, k and v are required");
    if (!params && cfg->linear) return still_fail(err, STILL_E_ARG, "still backward_inputs: parameters required");
    if (cfg->linear && cfg->gate && !io->x)
        return still_fail(err, STILL_E_ARG, "still backward_inputs: the gate needs the layer input x");

    const int T = io->T, H = cfg->n_head, Hk = cfg->n_head_kv, D = cfg->head_dim, G = H / Hk, C = cfg->chunk;
    const int Hs = cfg->per_kv_head ? Hk : H, kvd = Hk * D;
    const int gate = cfg->linear && cfg->gate && T > 2 * C, dm = cfg->d_model;
    const size_t HD = (size_t)H * D, TD = (size_t)T * D;
    unsigned char *rec = calloc((size_t)Hs * T, 1);
    int *sel_pos = malloc(sizeof(int) * (size_t)Hs * T), *n_selpos = calloc((size_t)Hs, sizeof(int));
    float *y = malloc(sizeof(float) * (size_t)T * HD);
    float *dKh = malloc(sizeof(float) * (size_t)H * TD), *dVh = malloc(sizeof(float) * (size_t)H * TD);
    float *dPre = gate ? calloc((size_t)T * HD, sizeof(float)) : NULL;
    void *wk = NULL;
    int max_sel = 0;
    if (!rec || !sel_pos || !n_selpos || !y || !dKh || !dVh || (gate && !dPre)) {
        rc = still_fail(err, STILL_E_NOMEM, "still backward_inputs: out of memory");
        goto done;
    }
    if ((rc = attn_still_record_selection(cfg, params, io, y, rec, sel_pos, n_selpos, &max_sel, 0, err))) goto done;

    const size_t per = inputs_floats(cfg, T, max_sel) * sizeof(float);
    const int n_thr = omp_get_max_threads() < H ? omp_get_max_threads() : H;
    wk = malloc(per * (size_t)n_thr);
    if (!wk) {
        rc = still_fail(err, STILL_E_NOMEM, "still backward_inputs: out of memory (%.1f MiB)",
                        (double)per * n_thr / 1048576.0);
        goto done;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_thr)
    for (int h = 0; h < H; h++) {
        const int hs = cfg->per_kv_head ? h / G : h;
        float *w = (float *)(void *)((char *)wk + (size_t)omp_get_thread_num() * per);
        head_bwd_inputs(cfg, params, io, dout, h, sel_pos + (size_t)hs * T, n_selpos[hs], rec, w, dKh + (size_t)h * TD,
                        dVh + (size_t)h * TD, dPre, g->dq, g->dparams);
    }
    /* dk, dv: the G query heads of each KV head, summed in head order */
    if (g->dk || g->dv) {
        const int nt = omp_get_max_threads() < T ? omp_get_max_threads() : T;
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int t = 0; t < T; t++)
            for (int hk = 0; hk < Hk; hk++)
                for (int x = 0; x < D; x++) {
                    const size_t o = (size_t)t * D + x;
                    float sk = dKh[(size_t)hk * G * TD + o], sv = dVh[(size_t)hk * G * TD + o];
                    for (int i = 1; i < G; i++)
                        sk += dKh[((size_t)hk * G + i) * TD + o], sv += dVh[((size_t)hk * G + i) * TD + o];
                    if (g->dk) g->dk[(size_t)t * kvd + (size_t)hk * D + x] += sk;
                    if (g->dv) g->dv[(size_t)t * kvd + (size_t)hk * D + x] += sv;
                }
    }
    /* dx += dPre Wg over the rows t >= 2C that have a gate (fixed blocks of rows) */
    if (gate && g->dx) {
        const float *Wg = params + fmap_params(cfg);
        const int r0 = 2 * C, nb = (T - r0 + DX_ROWS - 1) / DX_ROWS;
        const int nt = omp_get_max_threads() < nb ? omp_get_max_threads() : nb;
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int b = 0; b < nb; b++) {
            const int t0 = r0 + b * DX_ROWS, n = T - t0 < DX_ROWS ? T - t0 : DX_ROWS;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, dm, (int)HD, 1.0f, dPre + (size_t)t0 * HD,
                        (int)HD, Wg, dm, 1.0f, g->dx + (size_t)t0 * dm, dm);
        }
    }
done:
    free(wk), free(rec), free(sel_pos), free(n_selpos), free(y), free(dKh), free(dVh), free(dPre);
    return rc;
}

const attn_kind attn_kind_still = {
    .name = "still",
    .needs_nope = 0,
    .needs_x = 1,
    .param_count = still_param_count,
    .param_init = still_param_init,
    .state_create = still_state_create,
    .state_free = still_state_free,
    .state_truncate = still_state_truncate,
    .state_bytes = still_state_bytes,
    .state_regions = still_state_regions,
    .forward = still_forward,
    .backward = still_backward,
    .backward_inputs = still_backward_inputs,
    .distill = still_distill,
    .x_gate = attn_still_gate,
};

/* ---- diagnosis (still probe; attn_still.h) ----------------------------------------- */

void still_explain_free(still_explain *e) {
    if (!e) return;
    free(e->route), free(e->rank), free(e->score), free(e->w_soft), free(e->w_lin);
    free(e->w_local), free(e->w_sel), free(e->w_fold), free(e->w_exact);
    memset(e, 0, sizeof *e);
}

/* The feature map of head h (side 0: q-map, 1: k-map) of one vector x, in
 * double (the diagnosis' weights; the float64 reference backward in
 * tests/ref/attn_still_ref.c has its own copy with the gradient); phi gets
 * P = 2·Fd entries, clamped at 1e-12. w: 3·max(D, F) doubles. */
static void fmap_d(const attn_config *c, const float *params, int h, int side, const float *x, double *phi, double *w) {
    const int D = c->head_dim, hed = c->feature_map == FMAP_HEDGEHOG, Fd = hed ? c->feature_dim : D;
    double *z = w, *z0 = w + Fd, *xt = z0 + (Fd > D ? Fd : D);
    const float *W = params + par_w(c, side, h);
    if (hed) {
        for (int f = 0; f < Fd; f++) z[f] = 0;
        for (int d = 0; d < D; d++)
            for (int f = 0; f < Fd; f++) z[f] += (double)x[d] * W[(size_t)d * Fd + f];
    } else {
        const float *u = params + par_u(c, side, h);
        double beta = 0, alpha = 0, nz = 0, nx = 0;
        for (int i = 0; i < D; i++) beta += (double)u[i] * u[i], alpha += (double)x[i] * u[i], nx += (double)x[i] * x[i];
        const double f = beta > 0 ? 2.0 * alpha / beta : 0.0;
        for (int i = 0; i < D; i++) xt[i] = x[i] - f * u[i];
        for (int i = 0; i < D; i++) {
            double a = 0;
            for (int j = 0; j < D; j++) a += (double)W[(size_t)i * D + j] * xt[j];
            z0[i] = a, nz += a * a;
        }
        nz = sqrt(nz);
        const double sc = sqrt(nx) / (nz > (double)NORM_FLOOR ? nz : (double)NORM_FLOOR);
        for (int i = 0; i < D; i++) z[i] = z0[i] * sc;
    }
    /* φ = [softmax(z) ⊕ softmax(-z)] */
    for (int half = 0; half < 2; half++) {
        const double sg = half ? -1.0 : 1.0;
        double mx = -INFINITY, sum = 0;
        for (int f = 0; f < Fd; f++) mx = sg * z[f] > mx ? sg * z[f] : mx;
        for (int f = 0; f < Fd; f++) sum += phi[half * Fd + f] = exp(sg * z[f] - mx);
        for (int f = 0; f < Fd; f++) phi[half * Fd + f] /= sum;
    }
    for (int f = 0; f < 2 * Fd; f++) phi[f] = phi[f] < (double)FMAP_CLAMP ? (double)FMAP_CLAMP : phi[f];
}

/* Query head h's gate for one layer input xt, in double: g[x] = σ(Wg_row · xt + bg_row), rows h·D .. h·D+D-1. */
static void gate_row_d(const attn_config *c, const float *params, int h, const float *xt, double *g) {
    const size_t D = (size_t)c->head_dim, dm = (size_t)c->d_model;
    const float *Wg = params + fmap_params(c), *bg = Wg + (size_t)c->n_head * D * dm;
    for (size_t x = 0; x < D; x++) {
        const size_t row = (size_t)h * D + x;
        double pre = bg[row];
        for (size_t i = 0; i < dm; i++) pre += (double)Wg[row * dm + i] * xt[i];
        g[x] = 1.0 / (1.0 + exp(-pre));
    }
}

/* Token j's self-attention weight in its rolling window R(j) for query head h. */
static double self_weight(const attn_config *c, const attn_io *io, int h, int j) {
    const int D = c->head_dim, H = c->n_head, Hk = c->n_head_kv, hk = h / (H / Hk), C = c->chunk;
    const float *q = io->q + ((size_t)j * H + h) * D;
    const int lo = j - C + 1 > 0 ? j - C + 1 : 0;
    double mx = -INFINITY, s = 0, self = 0, lg[4096];
    const int n = j - lo + 1;
    for (int l = lo; l <= j; l++) {
        const float *k = io->k + ((size_t)l * Hk + hk) * D;
        double d = 0;
        for (int x = 0; x < D; x++) d += (double)q[x] * k[x];
        lg[l - lo] = d / sqrt((double)D);
        mx = lg[l - lo] > mx ? lg[l - lo] : mx;
    }
    for (int i = 0; i < n; i++) s += exp(lg[i] - mx);
    self = exp(lg[n - 1] - mx);
    return self / s;
}

int attn_still_explain(const attn_config *c, const float *params, const attn_io *io, const int *qs, int n_q,
                       const int *ks, int n_k, still_explain *out, still_err *err) {
    memset(out, 0, sizeof *out);
    int lam = 0, capped = 0, cap = 0;
    int rc = still_check(c, &lam, &capped, &cap, err);
    if (rc) return rc;
    const int T = io->T, H = c->n_head, Hk = c->n_head_kv, G = H / Hk, D = c->head_dim, C = c->chunk;
    const int Hs = c->per_kv_head ? Hk : H, Fd = feat_half(c), P = 2 * Fd;
    if (io->p0 != 0 || T <= 0 || n_q <= 0 || n_k < 0 || C > 4096)
        return still_fail(err, STILL_E_ARG, "still explain: a whole sequence, queries and a chunk <= 4096 are required");
    for (int i = 0; i < n_q; i++)
        if (qs[i] < 0 || qs[i] >= T) return still_fail(err, STILL_E_ARG, "still explain: query %d out of range", qs[i]);
    for (int i = 0; i < n_k; i++)
        if (ks[i] < 0 || ks[i] >= T) return still_fail(err, STILL_E_ARG, "still explain: key %d out of range", ks[i]);
    out->n_q = n_q, out->n_k = n_k, out->H = H, out->Hs = Hs, out->C = C;
    const size_t nk = (size_t)(n_k ? n_k : 1), nq = (size_t)n_q;
    out->route = calloc((size_t)Hs * nk, 1);
    out->rank = calloc((size_t)Hs * nk, sizeof(int));
    out->score = calloc((size_t)Hs * nk, sizeof(double));
    out->w_soft = calloc((size_t)H * nq, sizeof(double));
    out->w_lin = calloc((size_t)H * nq, sizeof(double));
    out->w_local = calloc((size_t)H * nq, sizeof(double));
    out->w_sel = calloc((size_t)H * nq, sizeof(double));
    out->w_fold = calloc((size_t)H * nq, sizeof(double));
    out->w_exact = calloc((size_t)H * nq, sizeof(double));
    unsigned char *rec = calloc((size_t)Hs * T, 1), *is_key = calloc((size_t)T, 1);
    int *sel_pos = malloc(sizeof(int) * (size_t)Hs * T), *n_selpos = calloc((size_t)Hs, sizeof(int)), max_sel = 0;
    float *y = malloc(sizeof(float) * (size_t)T * H * D);
    const int mx = Fd > D ? Fd : D;
    double *phi = malloc(sizeof(double) * (size_t)P * 2), *fw = malloc(sizeof(double) * (size_t)(4 * mx + 2));
    double *z = malloc(sizeof(double) * (size_t)P), *lg = malloc(sizeof(double) * (size_t)T);
    double *sc = malloc(sizeof(double) * (size_t)C), *phik = malloc(sizeof(double) * (size_t)T * P);
    if (!phik || !out->route || !out->rank || !out->score || !out->w_soft || !out->w_lin || !out->w_local || !out->w_sel ||
        !out->w_fold || !out->w_exact || !rec || !is_key || !sel_pos || !n_selpos || !y || !phi || !fw || !z || !lg || !sc) {
        rc = still_fail(err, STILL_E_NOMEM, "still explain: out of memory");
        goto done;
    }
    if ((rc = attn_still_record_selection(c, params, io, y, rec, sel_pos, n_selpos, &max_sel, 1, err))) goto done;
    for (int i = 0; i < n_k; i++) is_key[ks[i]] = 1;
    const int cq = qs[0] / C;
    /* routes and saliency ranks, from the first query */
    for (int hs = 0; hs < Hs; hs++)
        for (int i = 0; i < n_k; i++) {
            const int j = ks[i], cj = j / C;
            const size_t at = (size_t)hs * n_k + i;
            out->route[at] = cj >= cq - 1 ? ROUTE_LOCAL : rec[(size_t)hs * T + j] ? ROUTE_SEL
                           : c->linear ? ROUTE_FOLDED : ROUTE_DROPPED;
            if (c->routing != ROUTE_SALIENCY || cj > cq - 2 || (cj + 1) * C > T) continue;
            for (int l = 0; l < C; l++) {   /* the scores of j's whole chunk */
                double s = 0;
                for (int g = 0; g < (c->per_kv_head ? G : 1); g++)
                    s += still_saliency_of_p(self_weight(c, io, c->per_kv_head ? hs * G + g : hs, cj * C + l));
                sc[l] = s;
            }
            const int me = j - cj * C;
            int r = 1;
            for (int l = 0; l < C; l++) r += sc[l] > sc[me] || (sc[l] == sc[me] && l < me);
            out->rank[at] = r, out->score[at] = sc[me];
        }
    /* the shares of each query's denominator */
    int last = 0;   /* keys folded for some query lie before the last query's Local */
    for (int qi = 0; qi < n_q; qi++) last = (qs[qi] / C - 1) * C > last ? (qs[qi] / C - 1) * C : last;
    for (int h = 0; h < H; h++) {
        const int hk = h / G, hs = c->per_kv_head ? hk : h;
        for (int j = 0; c->linear && j < last; j++)   /* head h's φk of every token that may be folded */
            fmap_d(c, params, h, 1, io->k + ((size_t)j * Hk + hk) * D, phik + (size_t)j * P, fw);
        for (int qi = 0; qi < n_q; qi++) {
            const int t = qs[qi], ct = t / C, lo = (ct - 1) * C > 0 ? (ct - 1) * C : 0;
            const float *q = io->q + ((size_t)t * H + h) * D;
            /* logits over A(t): Local lo..t, and Sel of chunks <= ct-2 */
            double m = -INFINITY;
            int n = 0;
            for (int j = 0; j <= t; j++) {
                const int in_a = j >= lo || (j < (ct - 1) * C && rec[(size_t)hs * T + j]);
                if (!in_a) {
                    lg[j] = NAN;
                    continue;
                }
                const float *k = io->k + ((size_t)j * Hk + hk) * D;
                double d = 0;
                for (int x = 0; x < D; x++) d += (double)q[x] * k[x];
                lg[j] = d / sqrt((double)D);
                m = lg[j] > m ? lg[j] : m;
                n++;
            }
            double e_loc = 0, e_sel = 0, e_key = 0;
            for (int j = 0; j <= t; j++) {
                if (isnan(lg[j])) continue;
                const double e = exp(lg[j] - m);
                if (j >= lo) e_loc += e;
                else e_sel += e;
                if (is_key[j]) e_key += e;
            }
            /* the linear state: folded tokens of chunks <= ct-2 */
            double lin = 0, lin_key = 0;
            if (c->linear && ct >= 2) {
                fmap_d(c, params, h, 0, q, z, fw);   /* φq */
                for (int j = 0; j < (ct - 1) * C; j++) {
                    if (rec[(size_t)hs * T + j]) continue;
                    const double *pk = phik + (size_t)j * P;
                    double d = 0;
                    for (int p = 0; p < P; p++) d += z[p] * pk[p];
                    lin += d;
                    if (is_key[j]) lin_key += d;
                }
                if (c->gate_den && io->x) {   /* the gate scales these terms per channel: use the head's mean gate */
                    double g[STILL_MAX_HEAD_DIM], gm = 0;
                    gate_row_d(c, params, h, io->x + (size_t)t * c->d_model, g);
                    for (int x = 0; x < D; x++) gm += g[x];
                    lin *= gm / D, lin_key *= gm / D;
                }
            }
            /* what exact softmax would give the same tokens (folded, or dropped without a linear branch),
             * on the scale of e^{s - m}: the linear state's target */
            double ex = 0;
            for (int j = 0; j < (ct - 1) * C; j++) {
                if (rec[(size_t)hs * T + j]) continue;
                const float *k = io->k + ((size_t)j * Hk + hk) * D;
                double d = 0;
                for (int x = 0; x < D; x++) d += (double)q[x] * k[x];
                ex += exp(d / sqrt((double)D) - m);
            }
            const double den = e_loc + e_sel + lin + (double)DEN_EPS;
            const size_t at = (size_t)h * n_q + qi;
            out->w_soft[at] = e_key / den, out->w_lin[at] = lin_key / den;
            out->w_local[at] = e_loc / den, out->w_sel[at] = e_sel / den, out->w_fold[at] = lin / den;
            out->w_exact[at] = ex / (e_loc + e_sel + ex + (double)DEN_EPS);
            (void)n;
        }
    }
done:
    free(rec), free(is_key), free(sel_pos), free(n_selpos), free(y), free(phi), free(fw), free(z), free(lg), free(sc);
    free(phik);
    if (rc) still_explain_free(out);
    return rc;
}
