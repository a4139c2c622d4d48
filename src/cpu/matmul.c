/* Matrix kernels on quantized weights: Y (n_tok x n_out) = X (n_tok x n_in) . W^T.
 *
 * Activations stay float32 throughout (no int8 activation quantization), so
 * results agree with a float reference to rounding error.
 *
 * Few tokens (decode; n_tok < MV_MAX_TOK for the hot types, n_tok == 1
 *   otherwise): matrix-vector kernels with the weights dequantized in
 *   registers.  Q4_0 / Q4_1 / Q8_0 / F32 / F16 / BF16 have dedicated AVX-512
 *   (and, except the float types, AVX2) loops; the block scales of a run of
 *   blocks are converted to float up front (one gather per 16 blocks), Q4
 *   nibbles become floats through a per-block 16-entry table (vpermps).
 *   Under AVX-512 the quantized kernels also take 2-4 tokens at once, so
 *   each block is dequantized once per token group.  Other types dequantize
 *   256-element chunks into an L1 stack buffer.  Parallel over 16-row groups.
 *
 * Many tokens (prefill): the rows of W are processed in panels of
 *   PN = GEMM_NR * pw rows.  Each thread dequantizes its panel once into a
 *   thread-private buffer laid out [sub-panel][k][GEMM_NR] (K x PN floats,
 *   kept in L2) -- for Q4_0/Q4_1/Q8_0 directly in that transposed layout
 *   with row-strided gathers, for the other types row by row followed by
 *   16x16 in-register transposes.  A register-tiled fp32 micro-kernel
 *   (AVX-512: 8 tokens x 48 rows, 24 zmm accumulators) then runs over X
 *   packed as [token tile][k][GEMM_MR].  Dequantization is amortized over
 *   all tokens.  Parallel over panels.
 *
 * The vector width is chosen at compile time (__AVX512F__, __AVX2__ + __FMA__,
 * or portable scalar code).  Scratch memory is allocated once per call. */
#include "cpu/kernels.h"
#include "common/common.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define MM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MM_AVX2 1
#endif

/* Dequantization chunk (elements): a multiple of every block size. */
#define DQ_CHUNK 256

/* ------------------------------------------------------------------ */
/* Small helpers                                                       */
/* ------------------------------------------------------------------ */

static inline __attribute__((unused)) float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

static inline int mm_max_threads(void) {
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int mm_thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#if defined(MM_AVX2)
static inline float hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* dot product of two float vectors */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
#if defined(MM_AVX512)
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i + 16 <= n; i += 16)
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#elif defined(MM_AVX2)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float s = hsum256(_mm256_add_ps(s0, s1));
#else
    float p[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) p[j] += a[i + j] * b[i + j];
    float s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ------------------------------------------------------------------ */
/* Matrix-vector kernels (few tokens)                                  */
/* ------------------------------------------------------------------ */

/* Rows are handled MV_R at a time so the x loads are shared and there are
 * several independent accumulation chains. */
#if defined(MM_AVX512)
#define MV_R 8
#else
#define MV_R 4
#endif
/* Below this many tokens the (multi-token) matrix-vector kernels beat
 * packing a panel for the GEMM path (measured on Sapphire Rapids). */
#ifndef MV_MAX_TOK
#define MV_MAX_TOK 8
#endif

/* Generic: dequantize each row chunk into an L1 buffer and dot with x. */
static void mv_generic(const weight_matrix *W, const float *x, float *y, int64_t r0, int64_t r1) {
    float buf[DQ_CHUNK];
    const int64_t K = W->n_in, bs = tensor_type_block_elems(W->type);
    const size_t bb = tensor_type_block_bytes(W->type);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)W->data + (size_t)r * W->row_bytes;
        float s = 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += DQ_CHUNK) {
            int64_t len = K - k0 < DQ_CHUNK ? K - k0 : DQ_CHUNK;
            dequantize_row(W->type, row + (size_t)(k0 / bs) * bb, buf, len, NULL);
            s += dot_f32(buf, x + k0, len);
        }
        y[r] = s;
    }
}

/* Block scales (fp16) of up to MV_CHUNK consecutive blocks are converted to
 * float into small stack arrays first, so the inner loops broadcast them
 * straight from L1 instead of converting one at a time. */
#define MV_CHUNK 64   /* a multiple of 16 */

static inline __attribute__((unused)) void cvt_scales(const uint8_t *p, size_t stride, int n, float *out) {
    uint16_t h[MV_CHUNK];
    for (int i = 0; i < n; i++) memcpy(&h[i], p + (size_t)i * stride, 2);
    int i = 0;
#if defined(MM_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(MM_AVX2) && defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = f16_to_f32(h[i]);
}

/* Scales of R rows for blocks [b0, b0+n): d (at byte 0 of the block) and the
 * additive term c: Q4_1 m (byte 2), Q4_0 -8d, Q8_0 unused. */
static inline __attribute__((always_inline, unused)) void
mv_scales(uint32_t type, const uint8_t *w, size_t rb, const int R, int64_t b0, int n, size_t bsz,
          float d[][MV_CHUNK], float c[][MV_CHUNK]) {
#if defined(MM_AVX512)
    /* one 16-lane gather fetches the 32-bit word (d | second half) of 16 blocks */
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)bsz));
    for (int j = 0; j < R; j++) {
        const uint8_t *p = w + (size_t)j * rb + (size_t)b0 * bsz;
        for (int i = 0; i < n; i += 16) {
            const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, p + (size_t)i * bsz, 1);
            const __m512 vd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
            _mm512_storeu_ps(&d[j][i], vd);
            if (type == TT_Q4_1)
                _mm512_storeu_ps(&c[j][i], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
            else if (type == TT_Q4_0)
                _mm512_storeu_ps(&c[j][i], _mm512_mul_ps(vd, _mm512_set1_ps(-8.0f)));
        }
    }
#else
    for (int j = 0; j < R; j++) {
        const uint8_t *p = w + (size_t)j * rb + (size_t)b0 * bsz;
        cvt_scales(p, bsz, n, d[j]);
        if (type == TT_Q4_1) cvt_scales(p + 2, bsz, n, c[j]);
        else if (type == TT_Q4_0)
            for (int i = 0; i < n; i++) c[j][i] = -8.0f * d[j][i];
    }
#endif
}

#if defined(MM_AVX512)

/* Q4_0 / Q4_1: per block a 16-entry table T[v] = d*v + c (exact dequantized
 * values) is built with one FMA; the nibbles, zero-extended to 32-bit lanes,
 * index it with vpermps (which only looks at the low 4 bits, so the low
 * nibble needs no masking).  NT tokens (x rows at stride ldx, y rows at
 * stride ldy) share each dequantized block. */
#define MV_NT 4
static inline __attribute__((always_inline)) void
mv_q4_avx512(uint32_t type, const uint8_t *w, size_t rb, const int R, int64_t nb, const float *x, int64_t ldx,
             const int NT, float *y, int64_t ldy) {
    const size_t bsz = type == TT_Q4_1 ? 20 : 18, qoff = type == TT_Q4_1 ? 4 : 2;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[MV_R][MV_NT];
    float d[MV_R][MV_CHUNK], c[MV_R][MV_CHUNK];
    for (int j = 0; j < R; j++)
        for (int t = 0; t < NT; t++) acc[j][t] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += MV_CHUNK) {
        const int n = nb - b0 < MV_CHUNK ? (int)(nb - b0) : MV_CHUNK;
        mv_scales(type, w, rb, R, b0, n, bsz, d, c);
        const uint8_t *wq = w + (size_t)b0 * bsz + qoff;
        const float *xb = x + 32 * b0;
        for (int b = 0; b < n; b++, wq += bsz, xb += 32) {
            __m512 xl[MV_NT], xh[MV_NT];
            for (int t = 0; t < NT; t++) {
                xl[t] = _mm512_loadu_ps(xb + t * ldx);
                xh[t] = _mm512_loadu_ps(xb + t * ldx + 16);
            }
            for (int j = 0; j < R; j++) {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wq + (size_t)j * rb)));
                const __m512 T = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[j][b]), _mm512_set1_ps(c[j][b]));
                const __m512 wl = _mm512_permutexvar_ps(v, T);
                const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), T);
                for (int t = 0; t < NT; t++) {
                    acc[j][t] = _mm512_fmadd_ps(wl, xl[t], acc[j][t]);
                    acc[j][t] = _mm512_fmadd_ps(wh, xh[t], acc[j][t]);
                }
            }
        }
    }
    for (int j = 0; j < R; j++)
        for (int t = 0; t < NT; t++) y[t * ldy + j] = _mm512_reduce_add_ps(acc[j][t]);
}

static inline __attribute__((always_inline)) void
mv_q8_0_avx512(const uint8_t *w, size_t rb, const int R, int64_t nb, const float *x, int64_t ldx, const int NT,
               float *y, int64_t ldy) {
    __m512 acc[MV_R][MV_NT];
    float d[MV_R][MV_CHUNK];
    for (int j = 0; j < R; j++)
        for (int t = 0; t < NT; t++) acc[j][t] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += MV_CHUNK) {
        const int n = nb - b0 < MV_CHUNK ? (int)(nb - b0) : MV_CHUNK;
        mv_scales(TT_Q8_0, w, rb, R, b0, n, 34, d, NULL);
        const uint8_t *wq = w + (size_t)b0 * 34 + 2;
        const float *xb = x + 32 * b0;
        for (int b = 0; b < n; b++, wq += 34, xb += 32) {
            __m512 xl[MV_NT], xh[MV_NT];
            for (int t = 0; t < NT; t++) {
                xl[t] = _mm512_loadu_ps(xb + t * ldx);
                xh[t] = _mm512_loadu_ps(xb + t * ldx + 16);
            }
            for (int j = 0; j < R; j++) {
                const uint8_t *q = wq + (size_t)j * rb;
                const __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                const __m512 qh = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
                const __m512 vd = _mm512_set1_ps(d[j][b]);
                if (NT == 1) {
                    /* scale the partial dot product instead of the weights */
                    const __m512 s = _mm512_fmadd_ps(qh, xh[0], _mm512_mul_ps(ql, xl[0]));
                    acc[j][0] = _mm512_fmadd_ps(s, vd, acc[j][0]);
                } else {
                    const __m512 wl = _mm512_mul_ps(ql, vd), wh = _mm512_mul_ps(qh, vd);
                    for (int t = 0; t < NT; t++) {
                        acc[j][t] = _mm512_fmadd_ps(wl, xl[t], acc[j][t]);
                        acc[j][t] = _mm512_fmadd_ps(wh, xh[t], acc[j][t]);
                    }
                }
            }
        }
    }
    for (int j = 0; j < R; j++)
        for (int t = 0; t < NT; t++) y[t * ldy + j] = _mm512_reduce_add_ps(acc[j][t]);
}

/* Float weights (F16 / BF16 / F32), K may have a tail. */
static inline __m512 ld16_f16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline __m512 ld16_bf16(const uint8_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __attribute__((always_inline)) void
mv_float_avx512(uint32_t type, const uint8_t *w, size_t rb, const int R, int64_t K, const float *x, float *y) {
    __m512 acc[MV_R];
    for (int j = 0; j < R; j++) acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        for (int j = 0; j < R; j++) {
            const uint8_t *p = w + (size_t)j * rb;
            __m512 wv;
            if (type == TT_F16) wv = ld16_f16(p + 2 * k);
            else if (type == TT_BF16) wv = ld16_bf16(p + 2 * k);
            else wv = _mm512_loadu_ps((const float *)(const void *)(p + 4 * k));
            acc[j] = _mm512_fmadd_ps(wv, xv, acc[j]);
        }
    }
    for (int j = 0; j < R; j++) {
        float s = _mm512_reduce_add_ps(acc[j]);
        const uint8_t *p = w + (size_t)j * rb;
        for (int64_t kk = k; kk < K; kk++) {
            float wv;
            if (type == TT_F16) wv = ld_f16(p + 2 * kk);
            else if (type == TT_BF16) { uint16_t h; memcpy(&h, p + 2 * kk, 2); wv = bf16_to_f32(h); }
            else memcpy(&wv, p + 4 * kk, 4);
            s += wv * x[kk];
        }
        y[j] = s;
    }
}

#elif defined(MM_AVX2)

/* Q4_0 / Q4_1: w = d*q + c per 8 elements, then FMA with x. */
static inline __attribute__((always_inline)) void
mv_q4_avx2(uint32_t type, const uint8_t *w, size_t rb, const int R, int64_t nb, const float *x, float *y) {
    const size_t bsz = type == TT_Q4_1 ? 20 : 18, qoff = type == TT_Q4_1 ? 4 : 2;
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m256 acc[MV_R];
    float d[MV_R][MV_CHUNK], c[MV_R][MV_CHUNK];
    for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += MV_CHUNK) {
        const int n = nb - b0 < MV_CHUNK ? (int)(nb - b0) : MV_CHUNK;
        mv_scales(type, w, rb, R, b0, n, bsz, d, c);
        const uint8_t *wq = w + (size_t)b0 * bsz + qoff;
        const float *xb = x + 32 * b0;
        for (int b = 0; b < n; b++, wq += bsz, xb += 32) {
            for (int j = 0; j < R; j++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(wq + (size_t)j * rb));
                const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
                const __m256 vd = _mm256_set1_ps(d[j][b]), vc = _mm256_set1_ps(c[j][b]);
                __m256 f[4];
                f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                for (int i = 0; i < 4; i++)
                    acc[j] = _mm256_fmadd_ps(_mm256_fmadd_ps(f[i], vd, vc), _mm256_loadu_ps(xb + 8 * i), acc[j]);
            }
        }
    }
    for (int j = 0; j < R; j++) y[j] = hsum256(acc[j]);
}

static inline __attribute__((always_inline)) void
mv_q8_0_avx2(const uint8_t *w, size_t rb, const int R, int64_t nb, const float *x, float *y) {
    __m256 acc[MV_R];
    float d[MV_R][MV_CHUNK];
    for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += MV_CHUNK) {
        const int n = nb - b0 < MV_CHUNK ? (int)(nb - b0) : MV_CHUNK;
        mv_scales(TT_Q8_0, w, rb, R, b0, n, 34, d, NULL);
        const uint8_t *wq = w + (size_t)b0 * 34 + 2;
        const float *xb = x + 32 * b0;
        for (int b = 0; b < n; b++, wq += 34, xb += 32) {
            for (int j = 0; j < R; j++) {
                const uint8_t *q = wq + (size_t)j * rb;
                const __m128i q0 = _mm_loadu_si128((const __m128i *)q), q1 = _mm_loadu_si128((const __m128i *)(q + 16));
                __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), _mm256_loadu_ps(xb));
                s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), _mm256_loadu_ps(xb + 8), s);
                s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), _mm256_loadu_ps(xb + 16), s);
                s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), _mm256_loadu_ps(xb + 24), s);
                acc[j] = _mm256_fmadd_ps(s, _mm256_set1_ps(d[j][b]), acc[j]);
            }
        }
    }
    for (int j = 0; j < R; j++) y[j] = hsum256(acc[j]);
}

#endif /* MM_AVX2 */

/* Matrix-vector for rows [r0, r1) of one token. */
static void mv_rows(const weight_matrix *W, const float *x, float *y, int64_t r0, int64_t r1) {
#if defined(MM_AVX512) || defined(MM_AVX2)
    const uint8_t *base = W->data;
    const size_t rb = W->row_bytes;
    const int64_t nb = W->n_in / 32;
    int64_t r = r0;
#define MV_DISPATCH(call_r, call_1)                                        \
    do {                                                                   \
        for (; r + MV_R <= r1; r += MV_R) { const int R_ = MV_R; call_r; } \
        for (; r < r1; r++) { const int R_ = 1; call_1; }                  \
    } while (0)
#define ROWS base + (size_t)r * rb, rb, R_
#if defined(MM_AVX512)
    switch (W->type) {
    case TT_Q4_1:
        MV_DISPATCH(mv_q4_avx512(TT_Q4_1, ROWS, nb, x, 0, 1, y + r, 0), mv_q4_avx512(TT_Q4_1, ROWS, nb, x, 0, 1, y + r, 0));
        return;
    case TT_Q4_0:
        MV_DISPATCH(mv_q4_avx512(TT_Q4_0, ROWS, nb, x, 0, 1, y + r, 0), mv_q4_avx512(TT_Q4_0, ROWS, nb, x, 0, 1, y + r, 0));
        return;
    case TT_Q8_0:
        MV_DISPATCH(mv_q8_0_avx512(ROWS, nb, x, 0, 1, y + r, 0), mv_q8_0_avx512(ROWS, nb, x, 0, 1, y + r, 0));
        return;
    case TT_F16:
        MV_DISPATCH(mv_float_avx512(TT_F16, ROWS, W->n_in, x, y + r), mv_float_avx512(TT_F16, ROWS, W->n_in, x, y + r));
        return;
    case TT_BF16:
        MV_DISPATCH(mv_float_avx512(TT_BF16, ROWS, W->n_in, x, y + r),
                    mv_float_avx512(TT_BF16, ROWS, W->n_in, x, y + r));
        return;
    case TT_F32:
        MV_DISPATCH(mv_float_avx512(TT_F32, ROWS, W->n_in, x, y + r), mv_float_avx512(TT_F32, ROWS, W->n_in, x, y + r));
        return;
    default: break;
    }
#else
    switch (W->type) {
    case TT_Q4_1:
        MV_DISPATCH(mv_q4_avx2(TT_Q4_1, ROWS, nb, x, y + r), mv_q4_avx2(TT_Q4_1, ROWS, nb, x, y + r));
        return;
    case TT_Q4_0:
        MV_DISPATCH(mv_q4_avx2(TT_Q4_0, ROWS, nb, x, y + r), mv_q4_avx2(TT_Q4_0, ROWS, nb, x, y + r));
        return;
    case TT_Q8_0: MV_DISPATCH(mv_q8_0_avx2(ROWS, nb, x, y + r), mv_q8_0_avx2(ROWS, nb, x, y + r)); return;
    default: break;
    }
#endif
#undef ROWS
#undef MV_DISPATCH
#endif
    mv_generic(W, x, y, r0, r1);
}

#if defined(MM_AVX512)
/* NT (2..MV_NT) tokens at once for rows [r0, r1): each block is dequantized
 * once in registers and used for all NT tokens. */
#define MV_RT 4 /* rows per step when NT > 1 */
static inline __attribute__((always_inline)) void
mv_rows_nt(const weight_matrix *W, const float *x, float *y, int64_t r0, int64_t r1, const int NT) {
    const uint8_t *base = W->data;
    const size_t rb = W->row_bytes;
    const int64_t nb = W->n_in / 32, K = W->n_in, N = W->n_out;
    int64_t r = r0;
    switch (W->type) {
    case TT_Q4_1:
        for (; r + MV_RT <= r1; r += MV_RT) mv_q4_avx512(TT_Q4_1, base + (size_t)r * rb, rb, MV_RT, nb, x, K, NT, y + r, N);
        for (; r < r1; r++) mv_q4_avx512(TT_Q4_1, base + (size_t)r * rb, rb, 1, nb, x, K, NT, y + r, N);
        break;
    case TT_Q4_0:
        for (; r + MV_RT <= r1; r += MV_RT) mv_q4_avx512(TT_Q4_0, base + (size_t)r * rb, rb, MV_RT, nb, x, K, NT, y + r, N);
        for (; r < r1; r++) mv_q4_avx512(TT_Q4_0, base + (size_t)r * rb, rb, 1, nb, x, K, NT, y + r, N);
        break;
    default: /* TT_Q8_0 */
        for (; r + MV_RT <= r1; r += MV_RT) mv_q8_0_avx512(base + (size_t)r * rb, rb, MV_RT, nb, x, K, NT, y + r, N);
        for (; r < r1; r++) mv_q8_0_avx512(base + (size_t)r * rb, rb, 1, nb, x, K, NT, y + r, N);
        break;
    }
}
#endif

/* Y = X W^T for a few tokens, parallel over 16-row groups; within a group
 * the tokens are processed in chunks of up to MV_NT while its rows are hot
 * in L1. */
static void matvec(const weight_matrix *W, const float *X, float *Y, int64_t n_tok) {
    const int64_t n_out = W->n_out, K = W->n_in;
    const int64_t ngroups = (n_out + 15) / 16; /* 16-row work units */
    const int par = (double)n_out * (double)K * (double)n_tok >= 32768.0 && mm_max_threads() > 1;
    (void)par; /* unused without OpenMP */
#if defined(MM_AVX512)
    const int multi = W->type == TT_Q4_1 || W->type == TT_Q4_0 || W->type == TT_Q8_0;
#endif
#pragma omp parallel for schedule(static) if (par)
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t r0 = g * 16, r1 = r0 + 16 < n_out ? r0 + 16 : n_out;
        int64_t t = 0;
#if defined(MM_AVX512)
        if (multi) {
            for (; t + 4 <= n_tok; t += 4) mv_rows_nt(W, X + t * K, Y + t * n_out, r0, r1, 4);
            switch (n_tok - t) {
            case 3: mv_rows_nt(W, X + t * K, Y + t * n_out, r0, r1, 3); t += 3; break;
            case 2: mv_rows_nt(W, X + t * K, Y + t * n_out, r0, r1, 2); t += 2; break;
            default: break;
            }
        }
#endif
        for (; t < n_tok; t++) mv_rows(W, X + t * K, Y + t * n_out, r0, r1);
    }
}

/* ------------------------------------------------------------------ */
/* Matrix-matrix path (n_tok > 1)                                      */
/* ------------------------------------------------------------------ */

#if defined(MM_AVX512)
#define VW 16
typedef __m512 vec;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_SET1(x) _mm512_set1_ps(x)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GEMM_MR 8
#define GEMM_NV 3
#elif defined(MM_AVX2)
#define VW 8
typedef __m256 vec;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(x) _mm256_set1_ps(x)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define GEMM_MR 6
#define GEMM_NV 2
#else
#define VW 1
typedef float vec;
#define V_ZERO() 0.0f
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_SET1(x) (x)
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define GEMM_MR 4
#define GEMM_NV 4
#endif
#define GEMM_NR (VW * GEMM_NV)
#ifndef GEMM_KC
#define GEMM_KC 4096 /* longest K slice of one micro-kernel call (splitting helped nowhere measured) */
#endif
/* rows dequantized + transposed together */
#define TR_ROWS (VW >= 4 ? VW : 4)

/* C[MR][NR] (leading dim ldc) = A[K][MR] . B[K][NR]  (+ C if accumulate) */
static inline __attribute__((always_inline)) void
micro_kernel(int64_t K, const float *restrict a, const float *restrict b, float *restrict c, int64_t ldc,
             int accumulate) {
    vec acc[GEMM_MR][GEMM_NV];
    if (accumulate) {
#pragma GCC unroll 16
        for (int i = 0; i < GEMM_MR; i++)
#pragma GCC unroll 8
            for (int j = 0; j < GEMM_NV; j++) acc[i][j] = V_LOAD(c + i * ldc + j * VW);
    } else {
#pragma GCC unroll 16
        for (int i = 0; i < GEMM_MR; i++)
#pragma GCC unroll 8
            for (int j = 0; j < GEMM_NV; j++) acc[i][j] = V_ZERO();
    }
    for (int64_t k = 0; k < K; k++) {
        vec bv[GEMM_NV];
#pragma GCC unroll 8
        for (int j = 0; j < GEMM_NV; j++) bv[j] = V_LOAD(b + j * VW);
#pragma GCC unroll 16
        for (int i = 0; i < GEMM_MR; i++) {
            const vec av = V_SET1(a[i]);
#pragma GCC unroll 8
            for (int j = 0; j < GEMM_NV; j++) acc[i][j] = V_FMA(av, bv[j], acc[i][j]);
        }
        a += GEMM_MR;
        b += GEMM_NR;
    }
#pragma GCC unroll 16
    for (int i = 0; i < GEMM_MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < GEMM_NV; j++) V_STORE(c + i * ldc + j * VW, acc[i][j]);
}

/* Transpose a TR_ROWS x TR_ROWS tile: d[j*ldd + i] = s[i*lds + j]. */
static inline void transpose_tile(const float *s, int64_t lds, float *d, int64_t ldd) {
#if defined(MM_AVX512)
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(s + i * lds);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    /* u[4g + c]: lane L holds column 4L+c of rows 4g..4g+3 */
    for (int g = 0; g < 4; g++) {
        __m512d a0 = _mm512_castps_pd(t[4 * g]), a1 = _mm512_castps_pd(t[4 * g + 1]);
        __m512d b0 = _mm512_castps_pd(t[4 * g + 2]), b1 = _mm512_castps_pd(t[4 * g + 3]);
        r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
        r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
        r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
        r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
    }
    for (int c = 0; c < 4; c++) {
        __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
        __m512 v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
        __m512 w0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
        __m512 w1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        _mm512_storeu_ps(d + (0 + c) * ldd, _mm512_shuffle_f32x4(v0, w0, 0x88));
        _mm512_storeu_ps(d + (4 + c) * ldd, _mm512_shuffle_f32x4(v0, w0, 0xDD));
        _mm512_storeu_ps(d + (8 + c) * ldd, _mm512_shuffle_f32x4(v1, w1, 0x88));
        _mm512_storeu_ps(d + (12 + c) * ldd, _mm512_shuffle_f32x4(v1, w1, 0xDD));
    }
#elif defined(MM_AVX2)
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(s + i * lds);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) {
        __m256d a0 = _mm256_castps_pd(t[4 * g]), a1 = _mm256_castps_pd(t[4 * g + 1]);
        __m256d b0 = _mm256_castps_pd(t[4 * g + 2]), b1 = _mm256_castps_pd(t[4 * g + 3]);
        r[4 * g + 0] = _mm256_castpd_ps(_mm256_unpacklo_pd(a0, b0));
        r[4 * g + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a0, b0));
        r[4 * g + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(a1, b1));
        r[4 * g + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(a1, b1));
    }
    /* r[4g + c] lane L (128-bit) = column 4L+c of rows 4g..4g+3 */
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(d + c * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
        _mm256_storeu_ps(d + (4 + c) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
    }
#else
    for (int i = 0; i < TR_ROWS; i++)
        for (int j = 0; j < TR_ROWS; j++) d[j * ldd + i] = s[i * lds + j];
#endif
}

#if defined(MM_AVX512)
/* "Vertical" dequantization of 16 rows [r, r+16) straight into the
 * transposed panel layout (dst[k * GEMM_NR + i] = W[r + i][k]): 32-bit
 * gathers with a row-stride index fetch the same 4 bytes of one block from
 * each of the 16 rows, so every output vector is 16 rows at one k and no
 * transpose is needed.  Rows >= n_out are masked off (gathered as 0, giving
 * zero scales and thus zero weights). */
static void pack16_q_avx512(const weight_matrix *W, int64_t r, float *restrict dst) {
    const uint32_t type = W->type;
    const size_t bsz = type == TT_Q4_1 ? 20 : (type == TT_Q4_0 ? 18 : 34);
    const size_t qoff = type == TT_Q4_1 ? 4 : 2;
    const int64_t nb = W->n_in / 32, nvalid = W->n_out - r;
    const __mmask16 k = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1u);
    const __m512i ridx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)W->row_bytes));
    const __m512i zero = _mm512_setzero_si512(), m4 = _mm512_set1_epi32(0x0f);
    const uint8_t *base = (const uint8_t *)W->data + (size_t)r * W->row_bytes;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = base + (size_t)b * bsz;
        float *o = dst + 32 * b * GEMM_NR;
        const __m512i g = _mm512_mask_i32gather_epi32(zero, k, ridx, p, 1);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        if (type == TT_Q8_0) {
            for (int j4 = 0; j4 < 8; j4++) {
                const __m512i q = _mm512_mask_i32gather_epi32(zero, k, ridx, p + qoff + 4 * j4, 1);
                for (int i = 0; i < 4; i++) {
                    const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(q, 24 - 8 * i), 24);
                    _mm512_storeu_ps(o + (4 * j4 + i) * GEMM_NR, _mm512_mul_ps(_mm512_cvtepi32_ps(v), d));
                }
            }
        } else {
            const __m512 m = type == TT_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))
                                             : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
            for (int j4 = 0; j4 < 4; j4++) {
                const __m512i q = _mm512_mask_i32gather_epi32(zero, k, ridx, p + qoff + 4 * j4, 1);
                for (int i = 0; i < 4; i++) {
                    const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(q, 8 * i), m4);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(q, 8 * i + 4), m4);
                    _mm512_storeu_ps(o + (4 * j4 + i) * GEMM_NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m));
                    _mm512_storeu_ps(o + (4 * j4 + i + 16) * GEMM_NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m));
                }
            }
        }
    }
}
#endif

/* Dequantize rows [o0, o0 + PN) of W (rows >= n_out are zero) into
 * bp laid out [PN / GEMM_NR][K][GEMM_NR]. */
static void pack_panel(const weight_matrix *W, int64_t o0, int64_t PN, float *restrict bp) {
    const int64_t K = W->n_in, bs = tensor_type_block_elems(W->type);
    const size_t bb = tensor_type_block_bytes(W->type);
    float tmp[TR_ROWS * DQ_CHUNK];
#if defined(MM_AVX512)
    const int vertical = (W->type == TT_Q4_0 || W->type == TT_Q4_1 || W->type == TT_Q8_0) &&
                         W->row_bytes <= (size_t)INT32_MAX / 16;
#endif
    for (int64_t g = 0; g < PN; g += TR_ROWS) {
        const int64_t sub = g / GEMM_NR, col = g % GEMM_NR;
        float *dst = bp + sub * K * GEMM_NR + col;
#if defined(MM_AVX512)
        if (vertical) {
            if (o0 + g < W->n_out) pack16_q_avx512(W, o0 + g, dst);
            else
                for (int64_t kk = 0; kk < K; kk++) memset(dst + kk * GEMM_NR, 0, TR_ROWS * sizeof(float));
            continue;
        }
#endif
        for (int64_t k0 = 0; k0 < K; k0 += DQ_CHUNK) {
            const int64_t len = K - k0 < DQ_CHUNK ? K - k0 : DQ_CHUNK;
            for (int i = 0; i < TR_ROWS; i++) {
                const int64_t r = o0 + g + i;
                float *t = tmp + i * DQ_CHUNK;
                if (r < W->n_out) {
                    const uint8_t *row = (const uint8_t *)W->data + (size_t)r * W->row_bytes;
                    dequantize_row(W->type, row + (size_t)(k0 / bs) * bb, t, len, NULL);
                } else {
                    memset(t, 0, (size_t)len * sizeof(float));
                }
            }
            int64_t kk = 0;
            for (; kk + TR_ROWS <= len; kk += TR_ROWS)
                transpose_tile(tmp + kk, DQ_CHUNK, dst + (k0 + kk) * GEMM_NR, GEMM_NR);
            for (; kk < len; kk++)
                for (int i = 0; i < TR_ROWS; i++) dst[(k0 + kk) * GEMM_NR + i] = tmp[i * DQ_CHUNK + kk];
        }
    }
}

/* Pack token tile t of X (M x K) into xp[t] = [K][MR], zero-padding rows >= M. */
static void pack_x_tile(const float *X, int64_t M, int64_t K, int64_t t, float *restrict xp) {
    float *d = xp + t * K * GEMM_MR;
    for (int i = 0; i < GEMM_MR; i++) {
        const int64_t m = t * GEMM_MR + i;
        if (m < M) {
            const float *s = X + m * K;
            for (int64_t k = 0; k < K; k++) d[k * GEMM_MR + i] = s[k];
        } else {
            for (int64_t k = 0; k < K; k++) d[k * GEMM_MR + i] = 0.0f;
        }
    }
}

static int gemm(const weight_matrix *W, const float *X, float *Y, int64_t M) {
    const int64_t K = W->n_in, N = W->n_out;
    int nth = mm_max_threads();
    /* Small problems are not worth waking the other threads for. */
    if ((double)M * (double)N * (double)K < 262144.0) nth = 1;
    /* Panel width: two sub-panels unless that leaves threads idle. */
    int64_t pw = 2;
    if ((N + 2 * GEMM_NR - 1) / (2 * GEMM_NR) < 2 * (int64_t)nth) pw = 1;
    if ((double)(2 * GEMM_NR) * (double)K * sizeof(float) > 1048576.0) pw = 1; /* keep the panel in L2 */
    const int64_t PN = GEMM_NR * pw;
    const int64_t npanels = (N + PN - 1) / PN;
    if (npanels < nth) nth = (int)npanels;
    const int64_t mt = (M + GEMM_MR - 1) / GEMM_MR;

    size_t xp_elems, bp_elems, total;
    if (still_mul_overflow((size_t)mt * GEMM_MR, (size_t)K, &xp_elems) ||
        still_mul_overflow((size_t)PN * (size_t)K, (size_t)nth, &bp_elems) ||
        still_add_overflow(xp_elems, bp_elems + 16, &total) ||
        still_mul_overflow(total, sizeof(float), &total))
        return -1;
    float *scratch = malloc(total);
    if (!scratch) return -1;
    float *xp = scratch;
    float *bp_all = scratch + xp_elems;
    /* K is split into nearly equal slices of at most GEMM_KC so that the
     * A tile of a slice stays in L1 while the sub-panels of a panel use it. */
    const int64_t nk = (K + GEMM_KC - 1) / GEMM_KC, kc = (K + nk - 1) / nk;

#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        float *bp = bp_all + (size_t)mm_thread_num() * (size_t)(PN * K);
        float ctile[GEMM_MR * GEMM_NR];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < mt; t++) pack_x_tile(X, M, K, t, xp);
        /* (implicit barrier: xp complete) */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npanels; p++) {
            const int64_t o0 = p * PN;
            pack_panel(W, o0, PN, bp);
            for (int64_t k0 = 0; k0 < K; k0 += kc) {
                const int64_t kl = K - k0 < kc ? K - k0 : kc;
                const int acc = k0 > 0;
                for (int64_t t = 0; t < mt; t++) {
                    const int64_t m0 = t * GEMM_MR;
                    const int64_t mv = M - m0 < GEMM_MR ? M - m0 : GEMM_MR;
                    const float *a = xp + t * K * GEMM_MR + k0 * GEMM_MR;
                    for (int64_t s = 0; s < pw; s++) {
                        const int64_t n0 = o0 + s * GEMM_NR;
                        if (n0 >= N) break;
                        const int64_t nv = N - n0 < GEMM_NR ? N - n0 : GEMM_NR;
                        const float *b = bp + s * K * GEMM_NR + k0 * GEMM_NR;
                        float *y = Y + m0 * N + n0;
                        if (mv == GEMM_MR && nv == GEMM_NR) {
                            micro_kernel(kl, a, b, y, N, acc);
                        } else {
                            /* edge tile: go through a full-size local tile */
                            if (acc) {
                                memset(ctile, 0, sizeof ctile);
                                for (int64_t i = 0; i < mv; i++)
                                    memcpy(ctile + i * GEMM_NR, y + i * N, (size_t)nv * sizeof(float));
                            }
                            micro_kernel(kl, a, b, ctile, GEMM_NR, acc);
                            for (int64_t i = 0; i < mv; i++)
                                memcpy(y + i * N, ctile + i * GEMM_NR, (size_t)nv * sizeof(float));
                        }
                    }
                }
            }
        }
    }
    free(scratch);
    return 0;
}

/* ------------------------------------------------------------------ */
/* Entry point                                                         */
/* ------------------------------------------------------------------ */

void matmul(const weight_matrix *W, const float *X, float *Y, int64_t n_tok) {
    if (n_tok <= 0 || W->n_out <= 0) return;
    const int64_t bs = tensor_type_block_elems(W->type);
    if (!tensor_type_supported(W->type) || W->n_in <= 0 || bs <= 0 || W->n_in % bs != 0 ||
        W->row_bytes < tensor_row_bytes(W->type, W->n_in)) {
        /* Invalid use: make it loud rather than silently wrong. */
        for (int64_t i = 0; i < n_tok * W->n_out; i++) Y[i] = NAN;
        return;
    }
    int mv_max = 2;
#if defined(MM_AVX512)
    /* the hot types have multi-token matrix-vector kernels */
    if (W->type == TT_Q4_1 || W->type == TT_Q4_0 || W->type == TT_Q8_0) mv_max = MV_MAX_TOK;
#endif
    if (n_tok < mv_max) {
        matvec(W, X, Y, n_tok);
        return;
    }
    /* Token chunks bound the packed-activation scratch to about 16 MiB. */
    int64_t mc = (int64_t)((16u << 20) / ((size_t)W->n_in * sizeof(float)));
    mc = mc < 64 ? 64 : mc - mc % GEMM_MR;
    if (n_tok > mc) {
        for (int64_t m0 = 0; m0 < n_tok; m0 += mc) {
            const int64_t m = n_tok - m0 < mc ? n_tok - m0 : mc;
            matmul(W, X + m0 * W->n_in, Y + m0 * W->n_out, m);
        }
        return;
    }
    if (gemm(W, X, Y, n_tok) != 0) {
        /* Out of memory for the packing buffers: fall back to the
         * matrix-vector path (needs no heap). */
        matvec(W, X, Y, n_tok);
    }
}

/* ------------------------------------------------------------------ */
/* The transposed product (training: gradients through frozen weights) */
/* ------------------------------------------------------------------ */

/* Rows r0 .. r0 + n − 1 of W dequantized to float, n_in apart (kernels.h). */
int weight_rows_to_f32(const weight_matrix *W, int64_t r0, int64_t n, float *out, still_err *err) {
    int rc = STILL_OK;
    for (int64_t r = 0; r < n && !rc; r++)
        rc = dequantize_row(W->type, (const uint8_t *)W->data + (size_t)(r0 + r) * W->row_bytes,
                            out + (size_t)r * (size_t)W->n_in, W->n_in, err);
    return rc;
}

/* dX (n_tok x n_in) += dY (n_tok x n_out) . W. The weights stay in their
 * type: row blocks of W are dequantized into a float tile (about 16 MiB at
 * most, in parallel over rows) and each tile's product runs in OpenBLAS. */
int matmul_t_acc(const weight_matrix *W, const float *dY, float *dX, int64_t n_tok) {
    if (n_tok <= 0 || W->n_out <= 0 || W->n_in <= 0) return STILL_OK;
    const int64_t bs = tensor_type_block_elems(W->type);
    if (!tensor_type_supported(W->type) || bs <= 0 || W->n_in % bs != 0 ||
        W->row_bytes < tensor_row_bytes(W->type, W->n_in))
        return STILL_E_UNSUPPORTED;
    int64_t rows = (int64_t)((16u << 20) / ((size_t)W->n_in * sizeof(float)));
    if (rows < 16) rows = 16;
    if (rows > W->n_out) rows = W->n_out;
    float *tile = malloc(sizeof(float) * (size_t)rows * (size_t)W->n_in);
    if (!tile) return STILL_E_NOMEM;
    for (int64_t o0 = 0; o0 < W->n_out; o0 += rows) {
        const int64_t n = W->n_out - o0 < rows ? W->n_out - o0 : rows;
#pragma omp parallel for schedule(static) if (n * W->n_in > 65536)
        for (int64_t o = 0; o < n; o++)
            dequantize_row(W->type, (const uint8_t *)W->data + (size_t)(o0 + o) * W->row_bytes,
                           tile + (size_t)o * W->n_in, W->n_in, NULL);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n_tok, (int)W->n_in, (int)n, 1.0f, dY + o0,
                    (int)W->n_out, tile, (int)W->n_in, 1.0f, dX, (int)W->n_in);
    }
    free(tile);
    return STILL_OK;
}
