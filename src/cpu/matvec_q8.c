/* Integer matrix-vector products for decode: the activation vector is
 * quantized once to 8-bit blocks of 32 (a float scale dx per block and the
 * scaled sum s = dx·Σ xq of its integers), and each weight block's dot
 * product with it is an integer sum of products, scaled once per block:
 *
 *   Q4_0  w = d (q - 8):   d·dx·Σ q·xq − 8·d·(dx·Σ xq)
 *   Q4_1  w = d q + m:     d·dx·Σ q·xq + m·(dx·Σ xq)
 *   Q8_0  w = d q:         d·dx·Σ q·xq
 *   Q5_0  w = d (q - 16):  d·dx·Σ q·xq − 16·d·(dx·Σ xq)     (q: 4 bits of qs + 1 of qh)
 *   Q5_1  w = d q + m:     d·dx·Σ q·xq + m·(dx·Σ xq)
 *
 * K-quants (super-blocks of 256, so rows must be multiples of 256) line up
 * with the activation's blocks: sub-block i of super-block B is activation
 * block 8B + i.
 *
 *   Q4_K  w = (d·sc) q − dmin·mn   (8 sub-blocks of 32, 6-bit sc and mn):
 *         (d·sc)·dx·Σ q·xq − dmin·mn·s                      (q: 4 bits)
 *   Q5_K  the same with q of 5 bits (the fifth from qh)
 *   Q6_K  w = (d·sc) (q − 32)     (16 sub-blocks of 16, int8 sc, q of 6 bits):
 *         each 32-block takes both of its halves' scales in integers,
 *         d·dx·(sc0·Σ₀ (q−32)·xq + sc1·Σ₁ (q−32)·xq)
 *         (the vector paths: u8 q × s8 xq minus 32 × s8 xq in 16-bit pair
 *         sums, each pair sum times its half's scale in vpmaddwd)
 *
 * Four paths, chosen at run time for the CPU the binary runs on:
 * AVX-512 VNNI (vpdpbusd on 256-bit lanes, AVX512VL), AVX-VNNI (the same
 * vpdpbusd in its VEX form, for CPUs without AVX-512: Intel's client and
 * E-core parts since Alder Lake, AMD's since Zen 5), AVX2 (vpmaddubsw +
 * vpmaddwd), and portable C. The portable path is also what the tests hold
 * the others to (exactly: integer sums are exact and each path scales and
 * adds in the same order, up to float rounding in the final sum). */
#include "cpu/kernels.h"
#include "common/common.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
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

/* Symmetric 8-bit blocks as llama.cpp's Q8_1 (d = max|x| / 127, q = round(x / d)). A NaN or an infinity
 * has no 8-bit value (fmaxf would skip a NaN and the block would go on without it): STILL_E_ARG, and the
 * caller takes the float product, which carries it on. */
int act_q8_quantize(act_q8 *a, const float *x, int64_t n) {
    if (n > a->n_max || n % 32) return STILL_E_ARG;
#if defined(__AVX512F__)
    /* the same blocks in vectors (prefill quantizes every token's rows): the maximum, d and 1 / d as below, the
     * products rounded to nearest even as lrintf does (the default rounding mode), so bit for bit the loop's */
    for (int64_t b = 0; b < n / 32; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16), z = _mm512_setzero_ps();
        if (_mm512_cmp_ps_mask(_mm512_sub_ps(x0, x0), z, _CMP_NEQ_UQ) | _mm512_cmp_ps_mask(_mm512_sub_ps(x1, x1), z, _CMP_NEQ_UQ))
            return STILL_E_ARG;
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.0f, id = d > 0 && 1.0f / d < INFINITY ? 1.0f / d : 0.0f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(a->q + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(a->q + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        a->d[b] = d;
        a->s[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
    a->n = n;
    return STILL_OK;
#endif
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0, nonfinite = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i])), nonfinite += xb[i] - xb[i];
        if (nonfinite != 0.0f || isnan(nonfinite)) return STILL_E_ARG;
        /* subnormal blocks (no finite 1 / d) give zeros: 0 · ∞ would be NaN */
        const float d = amax / 127.0f, id = d > 0 && 1.0f / d < INFINITY ? 1.0f / d : 0.0f;
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

static inline int is_k(uint32_t type) { return type == TT_Q4_K || type == TT_Q5_K || type == TT_Q6_K; }

int matvec_q8_supported(uint32_t type) {
    return type == TT_Q4_0 || type == TT_Q4_1 || type == TT_Q8_0 || type == TT_Q5_0 || type == TT_Q5_1 || is_k(type);
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

/* Q4_K / Q5_K: the 6-bit scales and mins of a super-block's 8 sub-blocks
 * (12 bytes), read byte by byte as dq_q4_k does. */
static inline void k_scales_ref(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

static inline size_t k_block_bytes(uint32_t type) { return type == TT_Q4_K ? 144 : type == TT_Q5_K ? 176 : 210; }

/* Portable K-quants (scalar for the same reason as mv_q8_portable). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
static void mv_q8_portable_k(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
    const uint32_t type = W->type;
    const size_t bsz = k_block_bytes(type);
    const int64_t nsb = W->n_in / 256;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = (const uint8_t *)W->data + (size_t)r * W->row_bytes;
        float acc = 0, off = 0;
        for (int64_t B = 0; B < nsb; B++, w += bsz) {
            const int8_t *xq = x->q + 256 * B;
            const float *dx = x->d + 8 * B, *sx = x->s + 8 * B;
            if (type == TT_Q6_K) {   /* ql[128] | qh[64] | int8 sc[16] | d */
                const int8_t *sc = (const int8_t *)(w + 192);
                const float d = ld_f16(w + 208);
                for (int g = 0; g < 8; g++) {   /* 32 elements: 128h + 32t + l */
                    const int h = g >> 2, t = g & 3;
                    const uint8_t *L = w + 64 * h + 32 * (t & 1), *H = w + 128 + 32 * h;
                    int dot[2] = {0, 0};
                    for (int l = 0; l < 32; l++) {
                        const int q = ((L[l] >> (4 * (t >> 1))) & 15) | (((H[l] >> (2 * t)) & 3) << 4);
                        dot[l >> 4] += (q - 32) * xq[32 * g + l];
                    }
                    acc += (float)(sc[2 * g] * dot[0] + sc[2 * g + 1] * dot[1]) * (d * dx[g]);
                }
            } else {   /* d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128] */
                const float d = ld_f16(w), dmin = ld_f16(w + 2);
                int sc[8], mn[8];
                k_scales_ref(w + 4, sc, mn);
                const uint8_t *qh = w + 16, *qs = w + (type == TT_Q4_K ? 16 : 48);
                for (int i = 0; i < 8; i++) {
                    const uint8_t *q = qs + 32 * (i >> 1);
                    int dot = 0;
                    for (int l = 0; l < 32; l++) {
                        int v = (q[l] >> (4 * (i & 1))) & 15;
                        if (type == TT_Q5_K) v |= ((qh[l] >> i) & 1) << 4;
                        dot += v * xq[32 * i + l];
                    }
                    acc += (float)dot * ((d * (float)sc[i]) * dx[i]);
                    off -= (dmin * (float)mn[i]) * sx[i];
                }
            }
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
#define MQ_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

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

/* Bytes ahead of the block being read that each block's loop asks the cache
 * for. A decode step streams every weight once from memory; without it the
 * loops ran at about half the memory's read bandwidth on a 2-core AMD EPYC
 * (Zen 3, bench/bench_matmul -q on matrices larger than the L3: Q8_0 8 GB/s,
 * with it 12.8, the machine's sequential read rate). 4 KiB beat 2 and 8.
 * (A prefetch past the end of the weights is harmless: it never faults.) */
#define MQ_PREFETCH 4096

/* One row; DOT(w, x) gives the 8 int32 partial sums of a block. */
#define MQ_ROW_LOOP(DOT)                                                                       \
    for (int64_t r = r0; r < r1; r++) {                                                        \
        const uint8_t *w = (const uint8_t *)W->data + (size_t)r * W->row_bytes;                \
        __m256 acc = _mm256_setzero_ps();                                                      \
        float off = 0;                                                                         \
        for (int64_t b = 0; b < nb; b++, w += bsz) {                                           \
            _mm_prefetch((const char *)(w + MQ_PREFETCH), _MM_HINT_T0);                        \
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

/* Eight rows at once (AVX2), for Q4_0 / Q4_1 / Q8_0 where a block's integer work is short enough that the
 * per-block float work of the row loop (a scale to convert, a product, a broadcast, a conversion of the sums)
 * weighed as much as the products themselves on CPUs that split 256-bit operations (AMD Zen 1). Each 32-bit lane
 * of the result holds one row, so each block's scales are applied to eight rows in one vector and no row needs a
 * horizontal sum. The eight rows' scale words: one 32-bit load a row (d, then m or two quant bytes), bytes
 * regrouped so that d0..d7 and m0..m7 are the low and high halves. Eight rows read as eight streams a row
 * apart, which the hardware prefetcher follows less well than the row loop's one stream: each block asks the
 * cache for as many bytes of the next eight rows as it reads of these (Zen 1, bench_matmul -q avx2 on the
 * 576 x 49152 head: Q8_0 at 9.7 GB/s, 8.5 without; 4 KiB ahead of each row instead: 7.2). */
static inline MQ_TARGET_AVX2 __m256i ld_rows2(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_loadu2_m128i((const __m128i *)hi, (const __m128i *)lo);
}
static inline int32_t ld_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline MQ_TARGET_AVX2 __m256i scale_words_r8(const uint8_t *w, size_t rb) {
    const __m256i dm = _mm256_setr_epi32(ld_i32(w), ld_i32(w + rb), ld_i32(w + 2 * rb), ld_i32(w + 3 * rb),
                                         ld_i32(w + 4 * rb), ld_i32(w + 5 * rb), ld_i32(w + 6 * rb), ld_i32(w + 7 * rb));
    const __m256i shuf = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12,
                                          13, 2, 3, 6, 7, 10, 11, 14, 15);
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dm, shuf), 0xD8);   /* [d0..d7 | m0..m7] as halves */
}

/* Q4_0 / Q4_1, rows r .. r + 7: the rows' 16 quant bytes of a block transposed in registers (4 x 4 dwords per
 * 128-bit lane: lane k of column c holds bytes 4c .. 4c + 3 of row k), each column's low nibbles against the
 * activation's bytes 4c .. 4c + 3 broadcast, its high nibbles against bytes 16 + 4c ..; the eight vpmaddubsw's
 * 16-bit pair sums add up in 16 bits: |q xq + q' xq'| <= 2 * 15 * 127 = 3810, eight of them <= 30480 < 2^15. */
/* The body of the eight-row kernels, one per ISA: Q4_SUMS(s, lo, hi, xlo, xhi) adds the products of the unsigned
 * nibbles lo / hi with the activation bytes xlo / xhi to s and Q4_ROWS(s) turns s into eight int32 row sums;
 * Q8_DOT(w, x) is one Q8_0 row's block as 8 int32 partial sums. AVX2 adds 16-bit pair sums (vpmaddubsw) and
 * widens them once a block; VNNI adds four-byte sums straight into 32 bits (vpdpbusd). */
/* The body for nx (1 .. 4) activations xs at once (several sequences' decode steps; one for a single step): each
 * block's rows are loaded, transposed and split into nibbles once, then every activation takes the same
 * operations in the same order, so each result is bit for bit what it gets alone. y: the first activation's
 * output; the others' follow ystride floats apart. */
#define MQ_Q4_R8_MULTI(Q4_ZERO, Q4_SUMS, Q4_ROWS)                                                            \
    size_t bsz, qoff;                                                                                      \
    const uint32_t type = W->type;                                                                         \
    block_layout(type, &bsz, &qoff);                                                                       \
    const size_t rb = W->row_bytes;                                                                        \
    const int64_t nb = W->n_in / 32;                                                                       \
    const uint8_t *w = (const uint8_t *)W->data + (size_t)r * rb;                                          \
    const __m256i m4 = _mm256_set1_epi8(15);                                                               \
    const uint8_t *pf = w + 8 * rb;                                                                        \
    __m256 acc[4], accs[4];                                                                                \
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps(), accs[j] = _mm256_setzero_ps();              \
    for (int64_t b = 0; b < nb; b++, w += bsz) {                                                           \
        for (int k = 0; k < 8 * (int)bsz; k += 64) _mm_prefetch((const char *)(pf + k), _MM_HINT_T0);      \
        pf += 8 * bsz;                                                                                     \
        const uint8_t *q = w + qoff;                                                                       \
        const __m256i r04 = ld_rows2(q, q + 4 * rb), r15 = ld_rows2(q + rb, q + 5 * rb);                   \
        const __m256i r26 = ld_rows2(q + 2 * rb, q + 6 * rb), r37 = ld_rows2(q + 3 * rb, q + 7 * rb);      \
        const __m256i t0 = _mm256_unpacklo_epi32(r04, r15), t1 = _mm256_unpackhi_epi32(r04, r15);          \
        const __m256i t2 = _mm256_unpacklo_epi32(r26, r37), t3 = _mm256_unpackhi_epi32(r26, r37);          \
        const __m256i col[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),              \
                                _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};             \
        __m256i lo[4], hi[4];                                                                              \
        for (int c = 0; c < 4; c++)                                                                        \
            lo[c] = _mm256_and_si256(col[c], m4), hi[c] = _mm256_and_si256(_mm256_srli_epi16(col[c], 4), m4); \
        const __m256i g = scale_words_r8(w, rb);                                                           \
        const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(g));                                       \
        const __m256 mm = type == TT_Q4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(g, 1)) : d;           \
        for (int j = 0; j < nx; j++) {                                                                     \
            const int8_t *xb = xs[j].q + 32 * b;                                                           \
            __m256i s = Q4_ZERO;                                                                           \
            for (int c = 0; c < 4; c++)                                                                    \
                Q4_SUMS(s, lo[c], hi[c], _mm256_set1_epi32(ld_i32(xb + 4 * c)),                            \
                        _mm256_set1_epi32(ld_i32(xb + 16 + 4 * c)));                                       \
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Q4_ROWS(s)), _mm256_mul_ps(d, _mm256_set1_ps(xs[j].d[b])), acc[j]); \
            accs[j] = _mm256_fmadd_ps(mm, _mm256_set1_ps(xs[j].s[b]), accs[j]);                            \
        }                                                                                                  \
    }                                                                                                      \
    for (int j = 0; j < nx; j++)                                                                           \
        _mm256_storeu_ps(y + (size_t)j * ystride + r,                                                      \
                         _mm256_fmadd_ps(accs[j], _mm256_set1_ps(type == TT_Q4_1 ? 1.0f : -q_offset(type)), acc[j]));

#define MQ_Q8_0_R8(Q8_DOT)                                                                                 \
    const size_t rb = W->row_bytes, bsz = 34;                                                              \
    const int64_t nb = W->n_in / 32;                                                                       \
    const uint8_t *w = (const uint8_t *)W->data + (size_t)r * rb;                                          \
    const uint8_t *pf = w + 8 * rb;                                                                        \
    __m256 acc = _mm256_setzero_ps();                                                                      \
    for (int64_t b = 0; b < nb; b++, w += bsz) {                                                           \
        for (int k = 0; k < 8 * (int)bsz; k += 64) _mm_prefetch((const char *)(pf + k), _MM_HINT_T0);      \
        pf += 8 * bsz;                                                                                     \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));                           \
        __m256i p[8];                                                                                      \
        for (int k = 0; k < 8; k++) {                                                                      \
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k * rb + 2));                      \
            p[k] = Q8_DOT(wv, xv);                                                                         \
        }                                                                                                  \
        const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3])); \
        const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7])); \
        const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),                      \
                                             _mm256_permute2x128_si256(h0, h1, 0x31));                     \
        const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(scale_words_r8(w, rb)));                   \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x->d[b])), acc);    \
    }                                                                                                      \
    _mm256_storeu_ps(y + r, acc);

/* Q4_0 / Q4_1, rows r .. r + 7: the rows' 16 quant bytes of a block transposed in registers (4 x 4 dwords per
 * 128-bit lane: lane k of column c holds bytes 4c .. 4c + 3 of row k), each column's low nibbles against the
 * activation's bytes 4c .. 4c + 3 broadcast, its high nibbles against bytes 16 + 4c ... AVX2: the eight
 * vpmaddubsw's 16-bit pair sums add up in 16 bits: |q xq + q' xq'| <= 2 * 15 * 127 = 3810, eight of them
 * <= 30480 < 2^15. */
#define MQ_SUMS_AVX2(s, lo, hi, xlo, xhi) \
    s = _mm256_add_epi16(_mm256_add_epi16(s, _mm256_maddubs_epi16(lo, xlo)), _mm256_maddubs_epi16(hi, xhi))
#define MQ_ROWS_AVX2(s) _mm256_madd_epi16(s, _mm256_set1_epi16(1))
#define MQ_SUMS_VNNI(s, lo, hi, xlo, xhi) s = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s, lo, xlo), hi, xhi)
#define MQ_SUMS_AVXVNNI(s, lo, hi, xlo, xhi) s = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s, lo, xlo), hi, xhi)
#define MQ_ROWS_SAME(s) (s)
/* Q8_0, rows r .. r + 7: each row's block as in the row loop (8 int32 partial sums), the eight rows' partial
 * sums reduced to one vector of eight row sums (vphaddd, then the two lanes added). */
#define MQ_DOT8_AVX2(wv, xv) \
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), _mm256_set1_epi16(1))
#define MQ_DOT8_VNNI(wv, xv) _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv))
#define MQ_DOT8_AVXVNNI(wv, xv) \
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv))

static MQ_TARGET_AVX2 void mv_q4_r8_avx2(const weight_matrix *W, const act_q8 *x, float *y, int64_t r) {
    const act_q8 *xs = x;
    const int nx = 1;
    const size_t ystride = 0;
    MQ_Q4_R8_MULTI(_mm256_setzero_si256(), MQ_SUMS_AVX2, MQ_ROWS_AVX2)
}
static MQ_TARGET_VNNI void mv_q4_r8_vnni(const weight_matrix *W, const act_q8 *x, float *y, int64_t r) {
    const act_q8 *xs = x;
    const int nx = 1;
    const size_t ystride = 0;
    MQ_Q4_R8_MULTI(_mm256_setzero_si256(), MQ_SUMS_VNNI, MQ_ROWS_SAME)
}
static MQ_TARGET_AVXVNNI void mv_q4_r8_avxvnni(const weight_matrix *W, const act_q8 *x, float *y, int64_t r) {
    const act_q8 *xs = x;
    const int nx = 1;
    const size_t ystride = 0;
    MQ_Q4_R8_MULTI(_mm256_setzero_si256(), MQ_SUMS_AVXVNNI, MQ_ROWS_SAME)
}
static MQ_TARGET_AVX2 void mv_q4_r8x_avx2(const weight_matrix *W, const act_q8 *xs, int nx, float *y, size_t ystride,
                                           int64_t r) {
    MQ_Q4_R8_MULTI(_mm256_setzero_si256(), MQ_SUMS_AVX2, MQ_ROWS_AVX2)
}
static MQ_TARGET_VNNI void mv_q4_r8x_vnni(const weight_matrix *W, const act_q8 *xs, int nx, float *y, size_t ystride,
                                          int64_t r) {
    MQ_Q4_R8_MULTI(_mm256_setzero_si256(), MQ_SUMS_VNNI, MQ_ROWS_SAME)
}
static MQ_TARGET_AVXVNNI void mv_q4_r8x_avxvnni(const weight_matrix *W, const act_q8 *xs, int nx, float *y,
                                                size_t ystride, int64_t r) {
    MQ_Q4_R8_MULTI(_mm256_setzero_si256(), MQ_SUMS_AVXVNNI, MQ_ROWS_SAME)
}
static MQ_TARGET_AVX2 void mv_q8_0_r8_avx2(const weight_matrix *W, const act_q8 *x, float *y, int64_t r) {
    MQ_Q8_0_R8(MQ_DOT8_AVX2)
}
static MQ_TARGET_VNNI void mv_q8_0_r8_vnni(const weight_matrix *W, const act_q8 *x, float *y, int64_t r) {
    MQ_Q8_0_R8(MQ_DOT8_VNNI)
}
static MQ_TARGET_AVXVNNI void mv_q8_0_r8_avxvnni(const weight_matrix *W, const act_q8 *x, float *y, int64_t r) {
    MQ_Q8_0_R8(MQ_DOT8_AVXVNNI)
}

static MQ_TARGET_AVX2 void mv_q8_avx2(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
    size_t bsz, qoff;
    const uint32_t type = W->type;
    block_layout(type, &bsz, &qoff);
    const int64_t nb = W->n_in / 32;
    const float qoffs = q_offset(type);
    const __m256i ones = _mm256_set1_epi16(1);
    if (type == TT_Q4_0 || type == TT_Q4_1 || type == TT_Q8_0)
        for (; r0 + 8 <= r1; r0 += 8) {
            if (type == TT_Q8_0) mv_q8_0_r8_avx2(W, x, y, r0);
            else mv_q4_r8_avx2(W, x, y, r0);
        }
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
    if (type == TT_Q4_0 || type == TT_Q4_1 || type == TT_Q8_0)
        for (; r0 + 8 <= r1; r0 += 8) {
            if (type == TT_Q8_0) mv_q8_0_r8_vnni(W, x, y, r0);
            else mv_q4_r8_vnni(W, x, y, r0);
        }
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
/* AVX-VNNI: the AVX2 path's operands (no AVX-512 masks) into the VEX vpdpbusd. */
static MQ_TARGET_AVXVNNI void mv_q8_avxvnni(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0,
                                           int64_t r1) {
    size_t bsz, qoff;
    const uint32_t type = W->type;
    block_layout(type, &bsz, &qoff);
    const int64_t nb = W->n_in / 32;
    const float qoffs = q_offset(type);
    const __m256i zero = _mm256_setzero_si256();
    if (type == TT_Q4_0 || type == TT_Q4_1 || type == TT_Q8_0)
        for (; r0 + 8 <= r1; r0 += 8) {
            if (type == TT_Q8_0) mv_q8_0_r8_avxvnni(W, x, y, r0);
            else mv_q4_r8_avxvnni(W, x, y, r0);
        }
    if (type == TT_Q8_0) {
        MQ_ROW_LOOP({
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + qoff));
            dot = _mm256_dpbusd_avx_epi32(zero, _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        })
    } else if (type == TT_Q5_0 || type == TT_Q5_1) {
        MQ_ROW_LOOP({
            const __m256i q = _mm256_or_si256(q4_unpack(w + qoff), q5_high_avx2(ld_qh(w, type)));
            dot = _mm256_dpbusd_avx_epi32(zero, q, xv);
        })
    } else {
        MQ_ROW_LOOP({ dot = _mm256_dpbusd_avx_epi32(zero, q4_unpack(w + qoff), xv); })
    }
}
#undef MQ_ROW_LOOP

/* ---- K-quants on the vector paths ----------------------------------------- */

/* Q4_K / Q5_K scales and mins as bytes: u[0..1] the 8 scales, u[2..3] the 8
 * mins (llama.cpp's word-wise unpacking of the 12 bytes). */
static inline void k_scales_u32(const uint8_t *s, uint32_t u[4]) {
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    const uint32_t mins_lo = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_lo;
    u[0] &= m1;
}

/* Q4_K / Q5_K rows. Per super-block: the 8 sub-block scales (d·sc)·dx as one
 * vector (lane i broadcast for sub-block i), the mins' term dmin·mn·s for all
 * 8 at once; qs[32p..32p+31] holds sub-blocks 2p (low nibbles) and 2p+1 (high
 * nibbles) in x's order. FIVE: the fifth bit of sub-block i is bit i of
 * qh[l], moved to bit 4 (qh shifted down two bits per pair; the 16-bit
 * shifts move no bit across a byte into bit 4). DOT(q, x): 8 int32 partial
 * sums of u8 q × s8 x; OR16(a, b): a | (b & 16). */
#define MQ_K45_ROWS(FIVE, DOT, OR16)                                                                    \
    for (int64_t r = r0; r < r1; r++) {                                                                 \
        const uint8_t *w = (const uint8_t *)W->data + (size_t)r * W->row_bytes;                         \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), offv = _mm256_setzero_ps();      \
        for (int64_t B = 0; B < nsb; B++, w += bsz) {                                                   \
            for (size_t o = 0; o < bsz; o += 64) _mm_prefetch((const char *)(w + MQ_PREFETCH + o), _MM_HINT_T0); \
            uint32_t u[4];                                                                              \
            k_scales_u32(w + 4, u);                                                                     \
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(ld_u16(w))), dmin = _mm256_set1_ps(_cvtsh_ss(ld_u16(w + 2))); \
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u)));        \
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2))));  \
            const __m256 scl = _mm256_mul_ps(_mm256_mul_ps(d, sc), _mm256_loadu_ps(x->d + 8 * B));     \
            offv = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, mn), _mm256_loadu_ps(x->s + 8 * B), offv);      \
            const int8_t *xq = x->q + 256 * B;                                                          \
            const uint8_t *qs = w + (FIVE ? 48 : 16);                                                   \
            __m256i qh = FIVE ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256(); \
            for (int p = 0; p < 4; p++) {                                                               \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));                   \
                __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15); \
                if (FIVE) {                                                                             \
                    lo = OR16(lo, _mm256_slli_epi16(qh, 4));                                            \
                    hi = OR16(hi, _mm256_slli_epi16(qh, 3));                                            \
                    qh = _mm256_srli_epi16(qh, 2);                                                      \
                }                                                                                       \
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 64 * p));                  \
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 64 * p + 32));             \
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(lo, x0)),                                 \
                                       _mm256_permutevar8x32_ps(scl, _mm256_set1_epi32(2 * p)), acc0);  \
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(hi, x1)),                                 \
                                       _mm256_permutevar8x32_ps(scl, _mm256_set1_epi32(2 * p + 1)), acc1); \
            }                                                                                           \
        }                                                                                               \
        y[r] = hsum8(_mm256_add_ps(acc0, acc1)) + hsum8(offv);                                          \
    }

/* Q6_K rows. 32-block g = 4h + t of a super-block: the low 4 bits from
 * ql[64h + 32(t&1) + l] (nibble t>>1), the top 2 from qh[32h + l] (bits 2t,
 * moved to bits 4..5). Σ (q - 32)·xq in 16-bit pair sums (u8 q × s8 xq minus
 * 32 × s8 xq, both exact: at most 2·63·127), then vpmaddwd by the half's
 * scale: the 16-bit lanes 0..7 are the first half (sc[2g]), 8..15 the second
 * (sc[2g+1]); S holds the even scales in its low 128 bits, the odd ones in
 * the high, and a byte shuffle spreads scale g over each half. OR30(a, b):
 * a | (b & 0x30). */
#define MQ_Q6K_GROUP(G, LO, HI, ACC)                                                                    \
    do {                                                                                                \
        const __m256i q = OR30(LO, HI);                                                                 \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * (G)));                        \
        const __m256i pr = _mm256_sub_epi16(_mm256_maddubs_epi16(q, xv), _mm256_maddubs_epi16(k32, xv)); \
        const __m256i dot = _mm256_madd_epi16(pr, _mm256_shuffle_epi8(S, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (G))))); \
        ACC = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(G)), ACC); \
    } while (0)
#define MQ_Q6K_ROWS                                                                                     \
    for (int64_t r = r0; r < r1; r++) {                                                                 \
        const uint8_t *w = (const uint8_t *)W->data + (size_t)r * W->row_bytes;                         \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                  \
        for (int64_t B = 0; B < nsb; B++, w += 210) {                                                   \
            for (int o = 0; o < 210; o += 64) _mm_prefetch((const char *)(w + MQ_PREFETCH + o), _MM_HINT_T0); \
            const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(ld_u16(w + 208))), _mm256_loadu_ps(x->d + 8 * B)); \
            const __m256i S = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(w + 192)), evenodd)); \
            const int8_t *xq = x->q + 256 * B;                                                          \
            for (int h = 0; h < 2; h++) {                                                               \
                const __m256i L0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));                   \
                const __m256i L1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));              \
                const __m256i H = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));              \
                MQ_Q6K_GROUP(4 * h + 0, _mm256_and_si256(L0, m15), _mm256_slli_epi16(H, 4), acc0);      \
                MQ_Q6K_GROUP(4 * h + 1, _mm256_and_si256(L1, m15), _mm256_slli_epi16(H, 2), acc1);      \
                MQ_Q6K_GROUP(4 * h + 2, _mm256_and_si256(_mm256_srli_epi16(L0, 4), m15), H, acc0);      \
                MQ_Q6K_GROUP(4 * h + 3, _mm256_and_si256(_mm256_srli_epi16(L1, 4), m15), _mm256_srli_epi16(H, 2), acc1); \
            }                                                                                           \
        }                                                                                               \
        y[r] = hsum8(_mm256_add_ps(acc0, acc1));                                                        \
    }

#define MQ_K_CONSTS                                                                                     \
    const int64_t nsb = W->n_in / 256;                                                                  \
    const size_t bsz = k_block_bytes(W->type);                                                          \
    const __m256i m15 = _mm256_set1_epi8(15), k16 = _mm256_set1_epi8(16), k32 = _mm256_set1_epi8(32);   \
    const __m256i k30 = _mm256_set1_epi8(0x30);                                                         \
    const __m128i evenodd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);       \
    (void)bsz, (void)k16, (void)k32, (void)k30, (void)evenodd;

static MQ_TARGET_AVX2 void mv_q8_k_avx2(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
    MQ_K_CONSTS
    const __m256i ones = _mm256_set1_epi16(1);
#define DOT(q, xv) _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones)
#define OR16(a, b) _mm256_or_si256(a, _mm256_and_si256(b, k16))
#define OR30(a, b) _mm256_or_si256(a, _mm256_and_si256(b, k30))
    if (W->type == TT_Q4_K) {
        MQ_K45_ROWS(0, DOT, OR16)
    } else if (W->type == TT_Q5_K) {
        MQ_K45_ROWS(1, DOT, OR16)
    } else {
        MQ_Q6K_ROWS
    }
#undef DOT
#undef OR16
#undef OR30
}

/* VNNI: vpdpbusd for the Q4_K / Q5_K dots, vpternlogd for the bit merges. */
static MQ_TARGET_VNNI void mv_q8_k_vnni(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
    MQ_K_CONSTS
    const __m256i zero = _mm256_setzero_si256();
#define DOT(q, xv) _mm256_dpbusd_epi32(zero, q, xv)
#define OR16(a, b) _mm256_ternarylogic_epi32(a, b, k16, 0xF8)
#define OR30(a, b) _mm256_ternarylogic_epi32(a, b, k30, 0xF8)
    if (W->type == TT_Q4_K) {
        MQ_K45_ROWS(0, DOT, OR16)
    } else if (W->type == TT_Q5_K) {
        MQ_K45_ROWS(1, DOT, OR16)
    } else {
        MQ_Q6K_ROWS
    }
#undef DOT
#undef OR16
#undef OR30
}

/* AVX-VNNI: the VEX vpdpbusd for the Q4_K / Q5_K dots, AVX2's bit merges. */
static MQ_TARGET_AVXVNNI void mv_q8_k_avxvnni(const weight_matrix *W, const act_q8 *x, float *y, int64_t r0,
                                             int64_t r1) {
    MQ_K_CONSTS
    const __m256i zero = _mm256_setzero_si256();
#define DOT(q, xv) _mm256_dpbusd_avx_epi32(zero, q, xv)
#define OR16(a, b) _mm256_or_si256(a, _mm256_and_si256(b, k16))
#define OR30(a, b) _mm256_or_si256(a, _mm256_and_si256(b, k30))
    if (W->type == TT_Q4_K) {
        MQ_K45_ROWS(0, DOT, OR16)
    } else if (W->type == TT_Q5_K) {
        MQ_K45_ROWS(1, DOT, OR16)
    } else {
        MQ_Q6K_ROWS
    }
#undef DOT
#undef OR16
#undef OR30
}
#undef MQ_K45_ROWS
#undef MQ_Q6K_GROUP
#undef MQ_Q6K_ROWS
#undef MQ_K_CONSTS
#endif

const char *matvec_q8_path_name(int path) {
    static const char *const names[] = {"auto", "portable", "avx2", "avx512-vnni", "avx-vnni"};
    return path >= 0 && path <= MATVEC_Q8_LAST ? names[path] : "?";
}

#ifdef MQ_X86
/* F16C (CPUID 1: ECX bit 29) and AVX-VNNI (CPUID 7.1: EAX bit 4) read directly: clang's __builtin_cpu_supports
 * does not know either name (gcc's does), and the fuzz targets build with clang. */
static int cpuid_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
}
static int cpuid_avxvnni(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
}
#endif

static int path_available_uncached(int path) {
    if (path == MATVEC_Q8_PORTABLE) return 1;
#ifdef MQ_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpuid_f16c();
    if (path == MATVEC_Q8_AVX2) return avx2;
    if (path == MATVEC_Q8_VNNI)
        return avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw");
    if (path == MATVEC_Q8_AVXVNNI) return avx2 && cpuid_avxvnni();
#endif
    return 0;
}

/* Asked before every product: the answer is kept, per path, for the process's life (the CPU does not change
 * under it), because CPUID leaves the guest under virtualization and cost a decode step about 1% of its time
 * (perf, AMD EPYC VM, the still adapter at 2 threads). 0: not asked yet, 1: no, 2: yes; a race only computes
 * the same answer twice. */
int matvec_q8_path_available(int path) {
    static _Atomic int known[MATVEC_Q8_LAST + 1];
    if (path < 0 || path > MATVEC_Q8_LAST) return 0;
    int k = atomic_load_explicit(&known[path], memory_order_relaxed);
    if (!k) atomic_store_explicit(&known[path], k = path_available_uncached(path) ? 2 : 1, memory_order_relaxed);
    return k == 2;
}

/* AVX-512 VNNI before AVX-VNNI: the same instruction on the same 256-bit lanes, and the AVX-512 path's
 * Q5 and K-quant bit merges take one instruction (masked moves, vpternlogd) where AVX2 takes two. */
int matvec_q8_best_path(void) {
    static const int order[] = {MATVEC_Q8_VNNI, MATVEC_Q8_AVXVNNI, MATVEC_Q8_AVX2};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
        if (matvec_q8_path_available(order[i])) return order[i];
    return MATVEC_Q8_PORTABLE;
}

static void mv_q8_rows(int path, const weight_matrix *W, const act_q8 *x, float *y, int64_t r0, int64_t r1) {
    if (is_k(W->type)) {
#ifdef MQ_X86
        if (path == MATVEC_Q8_VNNI) {
            mv_q8_k_vnni(W, x, y, r0, r1);
            return;
        }
        if (path == MATVEC_Q8_AVXVNNI) {
            mv_q8_k_avxvnni(W, x, y, r0, r1);
            return;
        }
        if (path == MATVEC_Q8_AVX2) {
            mv_q8_k_avx2(W, x, y, r0, r1);
            return;
        }
#endif
        mv_q8_portable_k(W, x, y, r0, r1);
        return;
    }
#ifdef MQ_X86
    if (path == MATVEC_Q8_VNNI) {
        mv_q8_vnni(W, x, y, r0, r1);
        return;
    }
    if (path == MATVEC_Q8_AVXVNNI) {
        mv_q8_avxvnni(W, x, y, r0, r1);
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
        if (!matvec_q8_supported(W[i]->type) || x->n != W[i]->n_in || W[i]->n_in % (is_k(W[i]->type) ? 256 : 32))
            return STILL_E_ARG;
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

int matvec_q8_batch(const weight_matrix *const *W, float *const *y, int n, const act_q8 *xs, int n_x, int path) {
    if (n < 1 || n > 8 || n_x < 1) return STILL_E_ARG;
    int64_t first[9] = {0}, rows = 0;
    for (int i = 0; i < n; i++) {
        if (!matvec_q8_supported(W[i]->type) || W[i]->n_in % (is_k(W[i]->type) ? 256 : 32)) return STILL_E_ARG;
        for (int j = 0; j < n_x; j++)
            if (xs[j].n != W[i]->n_in) return STILL_E_ARG;
        first[i] = rows;
        rows += (W[i]->n_out + 15) / 16;
    }
    first[n] = rows;
    if (path == MATVEC_Q8_AUTO) path = matvec_q8_best_path();
    if (!matvec_q8_path_available(path)) return STILL_E_UNSUPPORTED;
    /* a group's 16 weight rows stay in cache while every activation passes them: the weights are read once */
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < rows; g++) {
        int i = 0;
        while (g >= first[i + 1]) i++;
        int64_t r0 = (g - first[i]) * 16;
        const int64_t r1 = r0 + 16 < W[i]->n_out ? r0 + 16 : W[i]->n_out;
#ifdef MQ_X86
        /* Q4_0 / Q4_1 on the x86 paths: eight rows for up to four activations at once (each block unpacked once);
         * the single kernel takes the same eight-row steps, then the row loop for the rest */
        const uint32_t t = W[i]->type;
        if ((t == TT_Q4_0 || t == TT_Q4_1) && path != MATVEC_Q8_PORTABLE) {
            for (; r0 + 8 <= r1; r0 += 8)
                for (int j = 0; j < n_x; j += 4) {
                    const int nx = n_x - j < 4 ? n_x - j : 4;
                    float *yj = y[i] + (size_t)j * W[i]->n_out;
                    if (path == MATVEC_Q8_VNNI) mv_q4_r8x_vnni(W[i], xs + j, nx, yj, (size_t)W[i]->n_out, r0);
                    else if (path == MATVEC_Q8_AVXVNNI) mv_q4_r8x_avxvnni(W[i], xs + j, nx, yj, (size_t)W[i]->n_out, r0);
                    else mv_q4_r8x_avx2(W[i], xs + j, nx, yj, (size_t)W[i]->n_out, r0);
                }
        }
#endif
        if (r0 < r1)
            for (int j = 0; j < n_x; j++) mv_q8_rows(path, W[i], &xs[j], y[i] + (size_t)j * W[i]->n_out, r0, r1);
    }
    return STILL_OK;
}

int matvec_q8(const weight_matrix *W, const act_q8 *x, float *y, int path) {
    return matvec_q8_many(&W, &y, 1, x, path);
}
