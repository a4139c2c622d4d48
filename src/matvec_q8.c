/* Integer matrix-vector products for decode: the activation vector is
 * quantized once to 8-bit blocks of 32 (a float scale per block and the
 * scaled sum of its integers), and each weight block's dot product with it
 * is an integer sum of products, scaled once per block:
 *
 *   Q4_0  w = d (q - 8):   d·dx·Σ q·xq − 8·d·(dx·Σ xq)
 *   Q4_1  w = d q + m:     d·dx·Σ q·xq + m·(dx·Σ xq)
 *   Q8_0  w = d q:         d·dx·Σ q·xq
 *   Q5_0  w = d (q - 16):  d·dx·Σ q·xq − 16·d·(dx·Σ xq)     (q: 4 bits of qs + 1 of qh)
 *   Q5_1  w = d q + m:     d·dx·Σ q·xq + m·(dx·Σ xq)
 *
 * Three paths, chosen at run time for the CPU the binary runs on:
 * AVX-512 VNNI (vpdpbusd on 256-bit lanes, AVX512VL), AVX2 (vpmaddubsw +
 * vpmaddwd), and portable C. The portable path is also what the tests hold
 * the others to (exactly: integer sums are exact and each path scales and
 * adds in the same order, up to float rounding in the final sum). */
#include "quant.h"
#include "common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MQ_X86 1
#endif

int act_q8_init(act_q8 *a, int64_t n_max) {
    memset(a, 0, sizeof *a);
    if (n_max <= 0 || n_max % 32) return STILL_E_ARG;
    a->q = aligned_alloc(64, (size_t)((n_max + 63) / 64 * 64));
    a->d = malloc(sizeof(float) * (size_t)(n_max / 32));
    a->s = malloc(sizeof(float) * (size_t)(n_max / 32));
    if (!a->q || !a->d || !a->s) {
        act_q8_free(a);
        return STILL_E_NOMEM;
    }
    a->n_max = n_max;
    return STILL_OK;
}

void act_q8_free(act_q8 *a) {
    free(a->q), free(a->d), free(a->s);
    memset(a, 0, sizeof *a);
}

/* Symmetric 8-bit blocks as llama.cpp's Q8_1 (d = max|x| / 127, q = round(x / d)). */
int act_q8_quantize(act_q8 *a, const float *x, int64_t n) {
    if (n > a->n_max || n % 32) return STILL_E_ARG;
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            const int v = (int)lrintf(xb[i] * id);
            a->q[32 * b + i] = (int8_t)v;
            sum += v;
        }
        a->d[b] = d;
        a->s[b] = d * (float)sum;
    }
    a->n = n;
    return STILL_OK;
}

int matvec_q8_supported(uint32_t type) {
    return type == TT_Q4_0 || type == TT_Q4_1 || type == TT_Q8_0 || type == TT_Q5_0 || type == TT_Q5_1;
}

/* ---- per-block integer dots: Σ q·xq for one weight block ------------------ */

/* Bytes per block; offset of qs; offset of qh (Q5 types); the offset the
 * integers carry (w = d (q - off) for Q4_0 / Q5_0); whether a min m follows d. */
static inline void block_layout(uint32_t type, size_t *bsz, size_t *qoff) {
    switch (type) {
    case TT_Q4_0: *bsz = 18, *qoff = 2; break;
    case TT_Q4_1: *bsz = 20, *qoff = 4; break;
    case TT_Q5_0: *bsz = 22, *qoff = 6; break;
    case TT_Q5_1: *bsz = 24, *qoff = 8; break;
    default: *bsz = 34, *qoff = 2; break;   /* Q8_0 */
    }
}
static inline float q_offset(uint32_t type) { return type == TT_Q4_0 ? 8.0f : type == TT_Q5_0 ? 16.0f : 0.0f; }
static inline int has_min(uint32_t type) { return type == TT_Q4_1 || type == TT_Q5_1; }
static inline uint32_t ld_qh(const uint8_t *w, uint32_t type) {
    uint32_t qh;
    memcpy(&qh, w + (type == TT_Q5_0 ? 2 : 4), 4);
    return qh;
}

static inline float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* Portable: rows [r0, r1). Not auto-vectorized under GCC: GCC 12.2 with
 * -O3 -march=native on an AVX512-VNNI CPU turns the signed 8-bit product
 * loop below into vpdpbusd, which takes one operand as unsigned, and gets
 * wrong sums (a 32-element int8 dot gave -48000 for 1664); this loop is the
 * reference the vector paths are tested against, so it stays scalar. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
static void mv_q8_portable(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
    size_t bsz, qoff;
    block_layout(W->type, &bsz, &qoff);
    const int64_t nb = W->n_in / 32;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = (const uint8_t *)W->data + (size_t)r * W->row_bytes;
        float acc = 0, off = 0;
        for (int64_t b = 0; b < nb; b++, w += bsz) {
            const int8_t *xq = x->q + 32 * b;
            int dot = 0;
            if (W->type == TT_Q8_0) {
                for (int i = 0; i < 32; i++) dot += (int8_t)w[qoff + i] * xq[i];
            } else {
                const uint32_t qh = W->type == TT_Q5_0 || W->type == TT_Q5_1 ? ld_qh(w, W->type) : 0;
                for (int i = 0; i < 16; i++) {
                    const int lo = (w[qoff + i] & 15) | (int)(((qh >> i) & 1u) << 4);
                    const int hi = (w[qoff + i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
                    dot += lo * xq[i] + hi * xq[i + 16];
                }
            }
            const float d = ld_f16(w);
            acc += (float)dot * (d * x->d[b]);
            if (has_min(W->type)) off += ld_f16(w + 2) * x->s[b];
            else off -= q_offset(W->type) * d * x->s[b];
        }
        y[r] = acc + off;
    }
}

#ifdef MQ_X86
/* The 32 weight integers of a block as unsigned bytes in x's order (Q4: low
 * nibbles are elements 0..15, high nibbles 16..31); Q8_0 is signed and taken
 * as |q| with xq's signs moved over (as vpmaddubsw / vpdpbusd take u8 × s8). */
#define MQ_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MQ_TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

static inline uint16_t ld_u16(const uint8_t *p) {   /* blocks are not 2-byte aligned */
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

static inline MQ_TARGET_AVX2 __m256i q4_unpack(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* bit j of qh as 16 in byte j (AVX2: each byte picks its qh byte, tests its bit) */
static inline MQ_TARGET_AVX2 __m256i q5_high_avx2(uint32_t qh) {
    const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                         3, 3, 3, 3, 3);
    const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), sel), bits);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bits), _mm256_set1_epi8(16));
}

static inline MQ_TARGET_AVX2 float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row; DOT(w, x) gives the 8 int32 partial sums of a block. */
#define MQ_ROW_LOOP(DOT)                                                                       \
    for (int64_t r = r0; r < r1; r++) {                                                        \
        const uint8_t *w = (const uint8_t *)W->data + (size_t)r * W->row_bytes;                \
        __m256 acc = _mm256_setzero_ps();                                                      \
        float off = 0;                                                                         \
        for (int64_t b = 0; b < nb; b++, w += bsz) {                                           \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));           \
            __m256i dot;                                                                       \
            DOT;                                                                               \
            const float d = _cvtsh_ss(ld_u16(w));                                              \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x->d[b]), acc);  \
            if (has_min(type)) off += _cvtsh_ss(ld_u16(w + 2)) * x->s[b];                      \
            else off -= qoffs * d * x->s[b];                                                   \
        }                                                                                      \
        y[r] = hsum8(acc) + off;                                                               \
    }

static MQ_TARGET_AVX2 void mv_q8_avx2(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
    size_t bsz, qoff;
    const uint32_t type = W->type;
    block_layout(type, &bsz, &qoff);
    const int64_t nb = W->n_in / 32;
    const float qoffs = q_offset(type);
    const __m256i ones = _mm256_set1_epi16(1);
    if (type == TT_Q8_0) {
        MQ_ROW_LOOP({
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + qoff));
            dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
        })
    } else if (type == TT_Q5_0 || type == TT_Q5_1) {
        MQ_ROW_LOOP({
            const __m256i q = _mm256_or_si256(q4_unpack(w + qoff), q5_high_avx2(ld_qh(w, type)));
            dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
        })
    } else {
        MQ_ROW_LOOP({ dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q4_unpack(w + qoff), xv), ones); })
    }
}

static MQ_TARGET_VNNI void mv_q8_vnni(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
    size_t bsz, qoff;
    const uint32_t type = W->type;
    block_layout(type, &bsz, &qoff);
    const int64_t nb = W->n_in / 32;
    const float qoffs = q_offset(type);
    const __m256i zero = _mm256_setzero_si256(), sixteen = _mm256_set1_epi8(16);
    if (type == TT_Q8_0) {
        MQ_ROW_LOOP({
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + qoff));
            dot = _mm256_dpbusd_epi32(zero, _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        })
    } else if (type == TT_Q5_0 || type == TT_Q5_1) {
        MQ_ROW_LOOP({
            const __m256i q = _mm256_or_si256(q4_unpack(w + qoff), _mm256_maskz_mov_epi8((__mmask32)ld_qh(w, type), sixteen));
            dot = _mm256_dpbusd_epi32(zero, q, xv);
        })
    } else {
        MQ_ROW_LOOP({ dot = _mm256_dpbusd_epi32(zero, q4_unpack(w + qoff), xv); })
    }
}
#undef MQ_ROW_LOOP
#endif

const char *matvec_q8_path_name(int path) {
    static const char *const names[] = {"auto", "portable", "avx2", "avx512-vnni"};
    return path >= 0 && path <= MATVEC_Q8_VNNI ? names[path] : "?";
}

int matvec_q8_best_path(void) {
#ifdef MQ_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        return MATVEC_Q8_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return MATVEC_Q8_AVX2;
#endif
    return MATVEC_Q8_PORTABLE;
}

int matvec_q8_path_available(int path) {
    if (path == MATVEC_Q8_PORTABLE) return 1;
    const int best = matvec_q8_best_path();
    return path >= MATVEC_Q8_PORTABLE && path <= best;
}

static void mv_q8_rows(int path, const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
#ifdef MQ_X86
    if (path == MATVEC_Q8_VNNI) {
        mv_q8_vnni(W, x, y, r0, r1);
        return;
    }
    if (path == MATVEC_Q8_AVX2) {
        mv_q8_avx2(W, x, y, r0, r1);
        return;
    }
#endif
    mv_q8_portable(W, x, y, r0, r1);
}

int matvec_q8_many(const weight_matrix *const *W, float *const *y, int n, const act_q8 *x, int path) {
    if (n < 1 || n > 8) return STILL_E_ARG;
    int64_t first[9] = {0}, rows = 0;   /* the 16-row groups of every matrix, numbered through */
    for (int i = 0; i < n; i++) {
        if (!matvec_q8_supported(W[i]->type) || x->n != W[i]->n_in || W[i]->n_in % 32) return STILL_E_ARG;
        first[i] = rows;
        rows += (W[i]->n_out + 15) / 16;
    }
    first[n] = rows;
    if (path == MATVEC_Q8_AUTO) path = matvec_q8_best_path();
    if (!matvec_q8_path_available(path)) return STILL_E_UNSUPPORTED;
    double work = 0;
    for (int i = 0; i < n; i++) work += (double)W[i]->n_out * (double)W[i]->n_in;
    const int par = work >= 32768.0;
    (void)par;
    /* one parallel region for all of them (one fork/join instead of n) */
#pragma omp parallel for schedule(static) if (par)
    for (int64_t g = 0; g < rows; g++) {
        int i = 0;
        while (g >= first[i + 1]) i++;
        const int64_t r0 = (g - first[i]) * 16, r1 = r0 + 16 < W[i]->n_out ? r0 + 16 : W[i]->n_out;
        mv_q8_rows(path, W[i], x, y[i], r0, r1);
    }
    return STILL_OK;
}

int matvec_q8(const weight_matrix *W, const act_q8 *x, float *y, int path) {
    return matvec_q8_many(&W, &y, 1, x, path);
}
