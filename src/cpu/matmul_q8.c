/* Prefill products with 8-bit activations: Y[t] = W xs[t] for M activations
 * quantized as decode quantizes one (act_q8: blocks of 32, a scale d and
 * s = d·Σ q each), for Q4_0, Q4_1 and Q8_0 weights, on the AVX-512 VNNI path.
 *
 * The float GEMM (matmul.c) dequantizes a panel of weight rows to float and
 * runs 16 FMAs per 16 rows × 1 k × 1 token. Here a panel of 32 rows is
 * repacked once into unsigned nibbles, 4 consecutive k of one row in a
 * 32-bit lane, 16 rows in a vector: per block of 32 k, eight vectors of rows
 * 0..15 and eight of rows 16..31 (vector g: k = 4g .. 4g + 3 for g < 4, the
 * low nibbles; k = 16 + 4(g − 4) .. for g >= 4, the high ones), then the
 * block's d and m (Q4_0: m = −8d) for the 32 rows; Q8_0's signed bytes go in
 * as q + 128 (vpdpbusd takes its weights unsigned) with m = −128d, which
 * takes the offset back out exactly as Q4_0's m does. A token's block is eight
 * vpdpbusd per 16 rows against its 4-byte groups broadcast, then, as the
 * portable matvec_q8 computes a row,
 *   acc += (float)Σ q·xq · (d · dx),   off += m · s,   y = acc + off
 * (the products fused here, so results match it to float rounding, not bit
 * for bit). Tiles of 4 tokens × 32 rows; threads split the panels. */
#include "cpu/kernels.h"
#include "common/common.h"

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MMQ_X86 1
#define MMQ_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#endif

#define MMQ_ROWS 32                              /* rows of a panel */
#define MMQ_TOK 4                                /* tokens of a tile */
#define MMQ_BLOCK_BYTES (8 * MMQ_ROWS * 4)       /* one block's packed nibbles for the panel */

int matmul_q8_supported(uint32_t type, int path) {
    return (type == TT_Q4_0 || type == TT_Q4_1 || type == TT_Q8_0) && path == MATVEC_Q8_VNNI &&
           matvec_q8_path_available(path);
}

static float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* Rows r0 .. r0 + 31 of W (rows past n_out: zero weights) into wq [nb][8][32][4] and dm [nb][2][32]. */
static void pack_panel(const weight_matrix *W, int64_t r0, uint8_t *restrict wq, float *restrict dm) {
    const int64_t nb = W->n_in / 32;
    const int q8 = W->type == TT_Q8_0;
    const size_t bsz = q8 ? 34 : W->type == TT_Q4_1 ? 20 : 18, qoff = W->type == TT_Q4_1 ? 4 : 2;
    for (int i = 0; i < MMQ_ROWS; i++) {
        const int64_t r = r0 + i;
        const uint8_t *w = r < W->n_out ? (const uint8_t *)W->data + (size_t)r * W->row_bytes : NULL;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = wq + (size_t)b * MMQ_BLOCK_BYTES + 4 * (size_t)i;
            float *s = dm + (size_t)b * 2 * MMQ_ROWS;
            if (!w) {
                for (int g = 0; g < 8; g++) memset(o + g * MMQ_ROWS * 4, 0, 4);
                s[i] = s[MMQ_ROWS + i] = 0.0f;
                continue;
            }
            const uint8_t *blk = w + (size_t)b * bsz, *qs = blk + qoff;
            for (int g = 0; g < 4; g++)
                for (int e = 0; e < 4; e++) {
                    if (q8) {   /* k = 4g + e and 16 + 4g + e */
                        o[g * MMQ_ROWS * 4 + e] = (uint8_t)((int8_t)qs[4 * g + e] + 128);
                        o[(4 + g) * MMQ_ROWS * 4 + e] = (uint8_t)((int8_t)qs[16 + 4 * g + e] + 128);
                    } else {
                        o[g * MMQ_ROWS * 4 + e] = qs[4 * g + e] & 15;
                        o[(4 + g) * MMQ_ROWS * 4 + e] = qs[4 * g + e] >> 4;
                    }
                }
            const float d = ld_f16(blk);
            s[i] = d;
            s[MMQ_ROWS + i] = W->type == TT_Q4_1 ? ld_f16(blk + 2) : (q8 ? -128.0f : -8.0f) * d;
        }
    }
}

#ifdef MMQ_X86
static inline int32_t ld_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Tokens xs[0 .. nt−1] (nt <= MMQ_TOK) against the packed panel: Y[t][0 .. nrows−1] (row stride ldy). */
static MMQ_TARGET void tile_vnni(const uint8_t *wq, const float *dm, int64_t nb, const act_q8 *xs, int nt, float *Y,
                                 int64_t ldy, int nrows) {
    __m512 acc[MMQ_TOK][2], off[MMQ_TOK][2];
    for (int t = 0; t < MMQ_TOK; t++)
        for (int h = 0; h < 2; h++) acc[t][h] = off[t][h] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512i *w = (const __m512i *)(wq + (size_t)b * MMQ_BLOCK_BYTES);
        const float *s = dm + (size_t)b * 2 * MMQ_ROWS;
        const __m512 d0 = _mm512_loadu_ps(s), d1 = _mm512_loadu_ps(s + 16);
        const __m512 m0 = _mm512_loadu_ps(s + 32), m1 = _mm512_loadu_ps(s + 48);
        for (int t = 0; t < MMQ_TOK; t++) {
            if (t >= nt) break;
            const int8_t *xb = xs[t].q + 32 * b;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int g = 0; g < 8; g++) {
                const __m512i x = _mm512_set1_epi32(ld_i32(xb + (g < 4 ? 4 * g : 16 + 4 * (g - 4))));
                s0 = _mm512_dpbusd_epi32(s0, _mm512_load_si512(w + 2 * g), x);
                s1 = _mm512_dpbusd_epi32(s1, _mm512_load_si512(w + 2 * g + 1), x);
            }
            const __m512 xd = _mm512_set1_ps(xs[t].d[b]), xsum = _mm512_set1_ps(xs[t].s[b]);
            acc[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, xd), acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, xd), acc[t][1]);
            off[t][0] = _mm512_fmadd_ps(m0, xsum, off[t][0]);
            off[t][1] = _mm512_fmadd_ps(m1, xsum, off[t][1]);
        }
    }
    const __mmask16 k0 = nrows >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nrows) - 1u);
    const __mmask16 k1 = nrows >= 32 ? (__mmask16)0xffff : nrows <= 16 ? 0 : (__mmask16)((1u << (nrows - 16)) - 1u);
    for (int t = 0; t < nt; t++) {
        _mm512_mask_storeu_ps(Y + (size_t)t * ldy, k0, _mm512_add_ps(acc[t][0], off[t][0]));
        _mm512_mask_storeu_ps(Y + (size_t)t * ldy + 16, k1, _mm512_add_ps(acc[t][1], off[t][1]));
    }
}
#endif

int matmul_q8(const weight_matrix *W, const act_q8 *xs, int64_t M, float *Y, int path) {
    if (!matmul_q8_supported(W->type, path) || W->n_in % 32 || W->n_in <= 0 || W->n_out <= 0 || M < 0)
        return STILL_E_ARG;
    for (int64_t t = 0; t < M; t++)
        if (xs[t].n != W->n_in) return STILL_E_ARG;
#ifdef MMQ_X86
    const int64_t nb = W->n_in / 32, np = (W->n_out + MMQ_ROWS - 1) / MMQ_ROWS;
    const size_t wq_bytes = (size_t)nb * MMQ_BLOCK_BYTES, dm_bytes = sizeof(float) * (size_t)nb * 2 * MMQ_ROWS;
    int nth = 1;
#ifdef _OPENMP
    nth = omp_get_max_threads();
#endif
    if (np < nth) nth = (int)np;
    uint8_t *scratch = aligned_alloc(64, (wq_bytes + dm_bytes + 63) / 64 * 64 * (size_t)nth);
    if (!scratch) return STILL_E_NOMEM;
    const size_t per = (wq_bytes + dm_bytes + 63) / 64 * 64;
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        uint8_t *wq = scratch + per * (size_t)me;
        float *dm = (float *)(wq + wq_bytes);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < np; p++) {
            const int64_t r0 = p * MMQ_ROWS;
            const int nrows = W->n_out - r0 < MMQ_ROWS ? (int)(W->n_out - r0) : MMQ_ROWS;
            pack_panel(W, r0, wq, dm);
            for (int64_t t0 = 0; t0 < M; t0 += MMQ_TOK)
                tile_vnni(wq, dm, nb, xs + t0, M - t0 < MMQ_TOK ? (int)(M - t0) : MMQ_TOK, Y + (size_t)t0 * W->n_out + r0,
                          W->n_out, nrows);
        }
    }
    free(scratch);
    return STILL_OK;
#else
    (void)Y;
    return STILL_E_UNSUPPORTED;
#endif
}
