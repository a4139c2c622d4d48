/* Tensor type table, fp16/bf16 conversion and row dequantization.
 *
 * Block layouts follow ggml (reference: gguf-py's gguf/quants.py).  All
 * multi-byte fields are little-endian and may be unaligned, so they are read
 * with memcpy.  QK_K super-blocks hold 256 elements.
 *
 * Exactness: for every supported type the products that form a value (fp16
 * scale x small integer x small integer) are exact in float32, so each value
 * is rounded at most once (at the final add of the min/offset).  Therefore
 * the result is the same whether or not the compiler contracts a*b+c into an
 * FMA, and it matches the numpy reference bit for bit. */
#include "format/quant.h"
#include "common/common.h"

#include <math.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK_K 256

/* ------------------------------------------------------------------ */
/* Type table                                                          */
/* ------------------------------------------------------------------ */

typedef struct {
    const char *name;
    uint16_t block_elems;
    uint16_t block_bytes;
    uint8_t supported;
} type_info;

/* Indexed by ggml type id; entries with name == NULL are unknown. */
static const type_info TYPE_TABLE[] = {
    [0]  = {"F32", 1, 4, 1},
    [1]  = {"F16", 1, 2, 1},
    [2]  = {"Q4_0", 32, 18, 1},
    [3]  = {"Q4_1", 32, 20, 1},
    [6]  = {"Q5_0", 32, 22, 1},
    [7]  = {"Q5_1", 32, 24, 1},
    [8]  = {"Q8_0", 32, 34, 1},
    [9]  = {"Q8_1", 32, 36, 1},    /* ggml: half d, half s, int8 qs[32] */
    [10] = {"Q2_K", 256, 84, 1},
    [11] = {"Q3_K", 256, 110, 1},
    [12] = {"Q4_K", 256, 144, 1},
    [13] = {"Q5_K", 256, 176, 1},
    [14] = {"Q6_K", 256, 210, 1},
    [15] = {"Q8_K", 256, 292, 0},
    [16] = {"IQ2_XXS", 256, 66, 0},
    [17] = {"IQ2_XS", 256, 74, 0},
    [18] = {"IQ3_XXS", 256, 98, 0},
    [19] = {"IQ1_S", 256, 50, 0},
    [20] = {"IQ4_NL", 32, 18, 0},
    [21] = {"IQ3_S", 256, 110, 0},
    [22] = {"IQ2_S", 256, 82, 0},
    [23] = {"IQ4_XS", 256, 136, 0},
    [24] = {"I8", 1, 1, 0},
    [25] = {"I16", 1, 2, 0},
    [26] = {"I32", 1, 4, 0},
    [27] = {"I64", 1, 8, 0},
    [28] = {"F64", 1, 8, 0},
    [29] = {"IQ1_M", 256, 56, 0},
    [30] = {"BF16", 1, 2, 1},
    [34] = {"TQ1_0", 256, 54, 0},
    [35] = {"TQ2_0", 256, 66, 0},
    [39] = {"MXFP4", 32, 17, 0},
};

#define TYPE_TABLE_N (sizeof TYPE_TABLE / sizeof TYPE_TABLE[0])

static const type_info *type_lookup(uint32_t t) {
    if (t >= TYPE_TABLE_N || TYPE_TABLE[t].name == NULL) return NULL;
    return &TYPE_TABLE[t];
}

int tensor_type_known(uint32_t t) { return type_lookup(t) != NULL; }

int tensor_type_supported(uint32_t t) {
    const type_info *ti = type_lookup(t);
    return ti != NULL && ti->supported;
}

const char *tensor_type_name(uint32_t t) {
    const type_info *ti = type_lookup(t);
    return ti ? ti->name : "unknown";
}

int64_t tensor_type_block_elems(uint32_t t) {
    const type_info *ti = type_lookup(t);
    return ti ? ti->block_elems : 0;
}

size_t tensor_type_block_bytes(uint32_t t) {
    const type_info *ti = type_lookup(t);
    return ti ? ti->block_bytes : 0;
}

size_t tensor_row_bytes(uint32_t t, int64_t n) {
    const type_info *ti = type_lookup(t);
    if (!ti || n < 0 || n % ti->block_elems != 0) return 0;
    size_t out;
    if (still_mul_overflow((size_t)(n / ti->block_elems), ti->block_bytes, &out)) return 0;
    return out;
}

/* ------------------------------------------------------------------ */
/* Float conversions                                                   */
/* ------------------------------------------------------------------ */

static inline __attribute__((unused)) float bits_to_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline __attribute__((unused)) uint32_t f32_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in float32 */
        float f = (float)man * 0x1p-24f;
        return bits_to_f32(f32_to_bits(f) | sign);
    }
    if (exp == 31) return bits_to_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0));
    return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x = f32_to_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or NaN (NaN stays quiet NaN) */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? (0x200u | ((ax >> 13) & 0x3ffu)) : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   /* rounds to inf */
    if (ax < 0x38800000u) {                                      /* below 2^-14: subnormal */
        if (ax < 0x33000000u) return sign;                       /* <= 2^-25 rounds to 0 */
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;                               /* 14..24 */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = (ax - (112u << 23)) >> 13, rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
#endif
}

float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

static inline float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* ------------------------------------------------------------------ */
/* Per-type block dequantizers                                         */
/* ------------------------------------------------------------------ */

static void dq_f32(const uint8_t *src, float *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void dq_f16(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * i))));
#elif defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
#endif
    for (; i < n; i++) dst[i] = rd_f16(src + 2 * i);
}

static void dq_bf16(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
#endif
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
    }
}

/* Q4_0: half d, 16 bytes qs.  x[j] = d*((qs[j]&15)-8), x[j+16] = d*((qs[j]>>4)-8). */
static void dq_q4_0(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 18, dst += 32) {
        const float d = rd_f16(src);
        const uint8_t *qs = src + 2;
#if defined(__AVX512F__)
        __m128i q = _mm_loadu_si128((const __m128i *)qs);
        __m128i m4 = _mm_set1_epi8(0x0f);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4)));
        __m512 e = _mm512_set1_ps(8.0f), vd = _mm512_set1_ps(d);
        _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_sub_ps(lo, e), vd));
        _mm512_storeu_ps(dst + 16, _mm512_mul_ps(_mm512_sub_ps(hi, e), vd));
#else
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)((int)(qs[j] & 0x0f) - 8);
            dst[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
        }
#endif
    }
}

/* Q4_1: half d, half m, 16 bytes qs.  x = d*q + m. */
static void dq_q4_1(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 20, dst += 32) {
        const float d = rd_f16(src), m = rd_f16(src + 2);
        const uint8_t *qs = src + 4;
#if defined(__AVX512F__)
        __m128i q = _mm_loadu_si128((const __m128i *)qs);
        __m128i m4 = _mm_set1_epi8(0x0f);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4)));
        __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
        /* d*q is exact, so the fused and unfused forms agree */
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(lo, vd, vm));
        _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(hi, vd, vm));
#else
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)(qs[j] & 0x0f) + m;
            dst[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
#endif
    }
}

/* Q5_0: half d, uint32 qh (bit j = 5th bit of element j), 16 bytes qs. x = d*(q-16). */
static void dq_q5_0(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 22, dst += 32) {
        const float d = rd_f16(src);
        uint32_t qh;
        memcpy(&qh, src + 2, 4);
        const uint8_t *qs = src + 6;
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
            int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            dst[j] = d * (float)(lo - 16);
            dst[j + 16] = d * (float)(hi - 16);
        }
    }
}

/* Q5_1: half d, half m, uint32 qh, 16 bytes qs. x = d*q + m. */
static void dq_q5_1(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 24, dst += 32) {
        const float d = rd_f16(src), m = rd_f16(src + 2);
        uint32_t qh;
        memcpy(&qh, src + 4, 4);
        const uint8_t *qs = src + 8;
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
            int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            dst[j] = d * (float)lo + m;
            dst[j + 16] = d * (float)hi + m;
        }
    }
}

/* Q8_0: half d, int8 qs[32].  Q8_1: half d, half s (unused here), int8 qs[32]. */
static void dq_q8(const uint8_t *src, float *dst, int64_t nb, size_t bbytes, size_t qoff) {
    for (int64_t b = 0; b < nb; b++, src += bbytes, dst += 32) {
        const float d = rd_f16(src);
        const uint8_t *qs = src + qoff;
#if defined(__AVX512F__)
        __m512 vd = _mm512_set1_ps(d);
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
        __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
        _mm512_storeu_ps(dst, _mm512_mul_ps(a, vd));
        _mm512_storeu_ps(dst + 16, _mm512_mul_ps(c, vd));
#else
        for (int j = 0; j < 32; j++) dst[j] = d * (float)(int8_t)qs[j];
#endif
    }
}

/* Q2_K: scales[16] (lo nibble: scale, hi: min), qs[64], half d, half dmin.
 * Element e = 128h + 32s + l (h<2, s<4, l<32): q = (qs[32h+l] >> 2s) & 3,
 * sub-block e/16: x = d*sc*q - dmin*mn. */
static void dq_q2_k(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 84, dst += QK_K) {
        const uint8_t *sc = src, *qs = src + 16;
        const float d = rd_f16(src + 80), dmin = rd_f16(src + 82);
        for (int e = 0; e < QK_K; e++) {
            int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
            int q = (qs[32 * h + l] >> (2 * s)) & 3;
            uint8_t scb = sc[e >> 4];
            float dl = d * (float)(scb & 0x0f), ml = dmin * (float)(scb >> 4);
            dst[e] = dl * (float)q - ml;
        }
    }
}

/* Q3_K: hmask[32], qs[64], scales[12] (16 x 6-bit, offset 32), half d.
 * e = 128h + 32s + l: low2 = (qs[32h+l] >> 2s) & 3, hbit = (hmask[l] >> (e/32)) & 1,
 * q = low2 - (hbit ? 0 : 4), x = d*(sc[e/16]-32)*q. */
static void dq_q3_k(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 110, dst += QK_K) {
        const uint8_t *hm = src, *qs = src + 32, *scb = src + 96;
        const float d = rd_f16(src + 108);
        float dl[16];
        for (int i = 0; i < 16; i++) {
            int lo = (scb[i & 7] >> (4 * (i >> 3))) & 0x0f;
            int hi = (scb[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
            dl[i] = d * (float)((lo | (hi << 4)) - 32);
        }
        for (int e = 0; e < QK_K; e++) {
            int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
            int q = (qs[32 * h + l] >> (2 * s)) & 3;
            if (!((hm[l] >> (e >> 5)) & 1)) q -= 4;
            dst[e] = dl[e >> 4] * (float)q;
        }
    }
}

/* 6-bit scales/mins of Q4_K/Q5_K (12 bytes -> 8 scales, 8 mins). */
static void k_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
}

/* Q4_K: half d, half dmin, scales[12], qs[128].  Sub-block i (32 elements):
 * pair p = i/2 uses qs[32p .. 32p+31], low nibbles for even i, high for odd.
 * x = (d*sc[i])*q - dmin*mn[i]. */
static void dq_q4_k(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 144, dst += QK_K) {
        const float d = rd_f16(src), dmin = rd_f16(src + 2);
        uint8_t sc[8], mn[8];
        k_scale_min(src + 4, sc, mn);
        const uint8_t *qs = src + 16;
        for (int i = 0; i < 8; i++) {
            const float dl = d * (float)sc[i], ml = dmin * (float)mn[i];
            const uint8_t *q = qs + 32 * (i >> 1);
            const int sh = 4 * (i & 1);
            float *y = dst + 32 * i;
            for (int l = 0; l < 32; l++) y[l] = dl * (float)((q[l] >> sh) & 0x0f) - ml;
        }
    }
}

/* Q5_K: half d, half dmin, scales[12], qh[32], qs[128]; like Q4_K plus a 5th
 * bit: bit i of qh[l] for element 32i + l. */
static void dq_q5_k(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 176, dst += QK_K) {
        const float d = rd_f16(src), dmin = rd_f16(src + 2);
        uint8_t sc[8], mn[8];
        k_scale_min(src + 4, sc, mn);
        const uint8_t *qh = src + 16, *qs = src + 48;
        for (int i = 0; i < 8; i++) {
            const float dl = d * (float)sc[i], ml = dmin * (float)mn[i];
            const uint8_t *q = qs + 32 * (i >> 1);
            const int sh = 4 * (i & 1);
            float *y = dst + 32 * i;
            for (int l = 0; l < 32; l++) {
                int v = ((q[l] >> sh) & 0x0f) | (((qh[l] >> i) & 1) << 4);
                y[l] = dl * (float)v - ml;
            }
        }
    }
}

/* Q6_K: ql[128], qh[64], int8 scales[16], half d.
 * e = 128h + 32t + l (h<2, t<4, l<32):
 *   q = ((ql[64h + 32(t&1) + l] >> 4(t>>1)) & 15) | (((qh[32h+l] >> 2t) & 3) << 4),
 *   x = (d*scales[e/16]) * (q - 32). */
static void dq_q6_k(const uint8_t *src, float *dst, int64_t nb) {
    for (int64_t b = 0; b < nb; b++, src += 210, dst += QK_K) {
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t *sc = (const int8_t *)(src + 192);
        const float d = rd_f16(src + 208);
        for (int h = 0; h < 2; h++) {
            for (int t = 0; t < 4; t++) {
                const uint8_t *L = ql + 64 * h + 32 * (t & 1);
                const uint8_t *H = qh + 32 * h;
                const int shl = 4 * (t >> 1), shh = 2 * t;
                float *y = dst + 128 * h + 32 * t;
                const float d0 = d * (float)sc[8 * h + 2 * t], d1 = d * (float)sc[8 * h + 2 * t + 1];
                for (int l = 0; l < 32; l++) {
                    int q = ((L[l] >> shl) & 0x0f) | (((H[l] >> shh) & 3) << 4);
                    y[l] = (l < 16 ? d0 : d1) * (float)(q - 32);
                }
            }
        }
    }
}

int quantize_row_q8_0(const float *x, void *dst, int64_t n) {
    if (n < 0 || n % 32) return STILL_E_ARG;
    uint8_t *o = dst;
    for (int64_t b = 0; b < n / 32; b++, o += 34) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            if (!isfinite(xb[j])) return STILL_E_ARG;   /* no 8-bit value: the caller says which input */
            amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        }
        /* a block of subnormals (amax / 127 with no finite inverse) quantizes to zeros, as its f16 scale is 0 */
        const float d = amax / 127.0f, id = d != 0.0f && 1.0f / d < INFINITY ? 1.0f / d : 0.0f;
        const uint16_t dh = f32_to_f16(d);
        memcpy(o, &dh, 2);
        for (int j = 0; j < 32; j++) o[2 + j] = (uint8_t)(int8_t)roundf(xb[j] * id);
    }
    return STILL_OK;
}

int dequantize_row(uint32_t t, const void *src, float *dst, int64_t n, still_err *err) {
    const type_info *ti = type_lookup(t);
    if (!ti || !ti->supported)
        return still_fail(err, STILL_E_UNSUPPORTED, "dequantize: unsupported tensor type %u (%s)",
                          t, tensor_type_name(t));
    if (n < 0 || n % ti->block_elems != 0)
        return still_fail(err, STILL_E_ARG, "dequantize: %lld elements is not a multiple of the %s block size %u",
                          (long long)n, ti->name, ti->block_elems);
    if (n == 0) return STILL_OK;
    if (!src || !dst) return still_fail(err, STILL_E_ARG, "dequantize: NULL buffer");
    const uint8_t *s = src;
    const int64_t nb = n / ti->block_elems;
    switch (t) {
    case TT_F32: dq_f32(s, dst, n); break;
    case TT_F16: dq_f16(s, dst, n); break;
    case TT_BF16: dq_bf16(s, dst, n); break;
    case TT_Q4_0: dq_q4_0(s, dst, nb); break;
    case TT_Q4_1: dq_q4_1(s, dst, nb); break;
    case TT_Q5_0: dq_q5_0(s, dst, nb); break;
    case TT_Q5_1: dq_q5_1(s, dst, nb); break;
    case TT_Q8_0: dq_q8(s, dst, nb, 34, 2); break;
    case TT_Q8_1: dq_q8(s, dst, nb, 36, 4); break;
    case TT_Q2_K: dq_q2_k(s, dst, nb); break;
    case TT_Q3_K: dq_q3_k(s, dst, nb); break;
    case TT_Q4_K: dq_q4_k(s, dst, nb); break;
    case TT_Q5_K: dq_q5_k(s, dst, nb); break;
    case TT_Q6_K: dq_q6_k(s, dst, nb); break;
    default:
        return still_fail(err, STILL_E_UNSUPPORTED, "dequantize: unsupported tensor type %u", t);
    }
    return STILL_OK;
}
