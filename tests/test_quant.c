/* Unit tests for src/format/quant.c and src/cpu/matmul.c.
 *
 * - type table and row sizes
 * - f16 / bf16 conversions (exhaustive over all 65536 halves)
 * - dequantize_row for every supported type, against a slow per-element
 *   reference written here straight from the ggml block layouts (random
 *   blocks: random bytes with valid, finite scales), bit-exact
 * - simple reference quantizers for Q4_0 / Q4_1 / Q8_0 round-trip sanity
 * - matmul (n_tok 1, 2, 3, 7, 64, 130; n_out 1, 5, 33; also 100; padded row
 *   strides, unaligned weight data, token chunking) against a double
 *   precision loop over the dequantized weights; error is measured relative
 *   to sum_i |w_i x_i| (the natural scale of a dot product's rounding error)
 *   and must stay below 1e-5.
 *
 * Prints "N passed, N failed" and exits non-zero on failure. */
#include "cpu/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_pass, g_fail;

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (cond) {                                        \
            g_pass++;                                      \
        } else {                                           \
            g_fail++;                                      \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);    \
            printf(__VA_ARGS__);                           \
            printf("\n");                                  \
        }                                                  \
    } while (0)

/* ---------------- deterministic RNG ---------------- */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd64(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rnd_unit(void) { return (double)(rnd64() >> 11) * 0x1p-53; } /* [0,1) */
static double rnd_sym(void) { return 2.0 * rnd_unit() - 1.0; }              /* [-1,1) */

/* ---------------- reference half / bf16 decoding ---------------- */
static double ref_half(uint16_t h) {
    int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0) v = ldexp((double)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexp(1024.0 + m, e - 25);
    return sign ? -v : v;
}
static double ref_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* A random finite half with magnitude roughly in [2^lo, 2^hi], random sign if sgn. */
static uint16_t rnd_half(int lo, int hi, int sgn) {
    int e = lo + (int)(rnd64() % (uint64_t)(hi - lo + 1)) + 15; /* biased exponent */
    if (e < 1) e = 1;
    if (e > 30) e = 30;
    uint16_t h = (uint16_t)((e << 10) | (rnd64() & 1023));
    if (sgn && (rnd64() & 1)) h |= 0x8000;
    return h;
}

/* ---------------- reference dequantizer (per element, double) ---------------- */
/* Straight from the block layouts (gguf-py quants.py / ggml-common.h). */
static double ref_elem(uint32_t t, const uint8_t *blk, int j) {
    switch (t) {
    case TT_F32: { float f; memcpy(&f, blk + 4 * j, 4); return f; }
    case TT_F16: return ref_half(rd16(blk + 2 * j));
    case TT_BF16: return ref_bf16(rd16(blk + 2 * j));
    case TT_Q4_0: { /* d | qs[16] */
        int q = j < 16 ? (blk[2 + j] & 15) : (blk[2 + j - 16] >> 4);
        return ref_half(rd16(blk)) * (q - 8);
    }
    case TT_Q4_1: { /* d | m | qs[16] */
        int q = j < 16 ? (blk[4 + j] & 15) : (blk[4 + j - 16] >> 4);
        return ref_half(rd16(blk)) * q + ref_half(rd16(blk + 2));
    }
    case TT_Q5_0: { /* d | qh (u32) | qs[16] */
        int q = j < 16 ? (blk[6 + j] & 15) : (blk[6 + j - 16] >> 4);
        q |= (int)((rd32(blk + 2) >> j) & 1) << 4;
        return ref_half(rd16(blk)) * (q - 16);
    }
    case TT_Q5_1: { /* d | m | qh | qs[16] */
        int q = j < 16 ? (blk[8 + j] & 15) : (blk[8 + j - 16] >> 4);
        q |= (int)((rd32(blk + 4) >> j) & 1) << 4;
        return ref_half(rd16(blk)) * q + ref_half(rd16(blk + 2));
    }
    case TT_Q8_0: return ref_half(rd16(blk)) * (int8_t)blk[2 + j];
    case TT_Q8_1: return ref_half(rd16(blk)) * (int8_t)blk[4 + j];
    case TT_Q2_K: { /* scales[16] | qs[64] | d | dmin */
        int half = j / 128, shift = (j % 128) / 32, l = j % 32;
        int q = (blk[16 + 32 * half + l] >> (2 * shift)) & 3;
        int sc = blk[j / 16];
        double d = ref_half(rd16(blk + 80)), dmin = ref_half(rd16(blk + 82));
        return d * (sc & 15) * q - dmin * (sc >> 4);
    }
    case TT_Q3_K: { /* hmask[32] | qs[64] | scales[12] | d */
        int half = j / 128, shift = (j % 128) / 32, l = j % 32;
        int q = (blk[32 + 32 * half + l] >> (2 * shift)) & 3;
        int hbit = (blk[l] >> (j / 32)) & 1;
        q -= hbit ? 0 : 4;
        int is = j / 16;
        const uint8_t *s = blk + 96;
        int low = is < 8 ? (s[is] & 15) : (s[is - 8] >> 4);
        int high = (s[8 + is % 4] >> (2 * (is / 4))) & 3;
        int sc = (low | (high << 4)) - 32;
        return ref_half(rd16(blk + 108)) * sc * q;
    }
    case TT_Q4_K:
    case TT_Q5_K: { /* d | dmin | scales[12] | (qh[32]) | qs[128] */
        int is = j / 32, l = j % 32;
        const uint8_t *s = blk + 4;
        int sc, mn;
        if (is < 4) {
            sc = s[is] & 63;
            mn = s[is + 4] & 63;
        } else {
            sc = (s[is + 4] & 15) | ((s[is - 4] >> 6) << 4);
            mn = (s[is + 4] >> 4) | ((s[is] >> 6) << 4);
        }
        const uint8_t *qs = blk + (t == TT_Q4_K ? 16 : 48);
        int q = (qs[32 * (is / 2) + l] >> (4 * (is % 2))) & 15;
        if (t == TT_Q5_K) q |= ((blk[16 + l] >> is) & 1) << 4;
        double d = ref_half(rd16(blk)), dmin = ref_half(rd16(blk + 2));
        return d * sc * q - dmin * mn;
    }
    case TT_Q6_K: { /* ql[128] | qh[64] | scales[16] (int8) | d */
        int half = j / 128, r = j % 128, quarter = r / 32, l = r % 32;
        int lowq = blk[64 * half + 32 * (quarter % 2) + l];
        lowq = quarter < 2 ? (lowq & 15) : (lowq >> 4);
        int highq = (blk[128 + 32 * half + l] >> (2 * quarter)) & 3;
        int q = (lowq | (highq << 4)) - 32;
        return ref_half(rd16(blk + 208)) * (int8_t)blk[192 + j / 16] * q;
    }
    default: return NAN;
    }
}

/* Fill nblocks random valid blocks of type t. */
static void random_blocks(uint32_t t, uint8_t *buf, int64_t nblocks) {
    const size_t bb = tensor_type_block_bytes(t);
    for (size_t i = 0; i < bb * (size_t)nblocks; i++) buf[i] = (uint8_t)rnd64();
    for (int64_t b = 0; b < nblocks; b++) {
        uint8_t *p = buf + (size_t)b * bb;
        switch (t) {
        case TT_F32: { float f = (float)(rnd_sym() * 4.0); memcpy(p, &f, 4); break; }
        case TT_F16: wr16(p, rnd_half(-26, 6, 1)); break;   /* includes subnormals */
        case TT_BF16: { float f = (float)(rnd_sym() * 8.0); uint32_t u; memcpy(&u, &f, 4); wr16(p, (uint16_t)(u >> 16)); break; }
        case TT_Q4_0: case TT_Q5_0: case TT_Q8_0: wr16(p, rnd_half(-12, 0, 1)); break;
        case TT_Q4_1: case TT_Q5_1: case TT_Q8_1:
            wr16(p, rnd_half(-12, 0, 1));
            wr16(p + 2, rnd_half(-10, 1, 1));
            break;
        case TT_Q2_K: wr16(p + 80, rnd_half(-12, 0, 1)); wr16(p + 82, rnd_half(-12, 0, 1)); break;
        case TT_Q3_K: wr16(p + 108, rnd_half(-12, 0, 1)); break;
        case TT_Q4_K: case TT_Q5_K: wr16(p, rnd_half(-12, 0, 1)); wr16(p + 2, rnd_half(-12, 0, 1)); break;
        case TT_Q6_K: wr16(p + 208, rnd_half(-12, 0, 1)); break;
        default: break;
        }
    }
}

static const uint32_t SUPPORTED[] = {TT_F32, TT_F16, TT_BF16, TT_Q4_0, TT_Q4_1, TT_Q5_0, TT_Q5_1,
                                     TT_Q8_0, TT_Q8_1, TT_Q2_K, TT_Q3_K, TT_Q4_K, TT_Q5_K, TT_Q6_K};
#define NSUP (sizeof SUPPORTED / sizeof SUPPORTED[0])

/* ---------------- tests ---------------- */

static void test_type_table(void) {
    static const struct { uint32_t t; const char *name; int64_t be; size_t bb; } exp[] = {
        {TT_F32, "F32", 1, 4}, {TT_F16, "F16", 1, 2}, {TT_Q4_0, "Q4_0", 32, 18},
        {TT_Q4_1, "Q4_1", 32, 20}, {TT_Q5_0, "Q5_0", 32, 22}, {TT_Q5_1, "Q5_1", 32, 24},
        {TT_Q8_0, "Q8_0", 32, 34}, {TT_Q8_1, "Q8_1", 32, 36}, {TT_Q2_K, "Q2_K", 256, 84},
        {TT_Q3_K, "Q3_K", 256, 110}, {TT_Q4_K, "Q4_K", 256, 144}, {TT_Q5_K, "Q5_K", 256, 176},
        {TT_Q6_K, "Q6_K", 256, 210}, {TT_Q8_K, "Q8_K", 256, 292}, {TT_BF16, "BF16", 1, 2},
        {20, "IQ4_NL", 32, 18}, {23, "IQ4_XS", 256, 136},
    };
    for (size_t i = 0; i < sizeof exp / sizeof exp[0]; i++) {
        CHECK(tensor_type_known(exp[i].t), "type %u known", exp[i].t);
        CHECK(strcmp(tensor_type_name(exp[i].t), exp[i].name) == 0, "name of %u: %s", exp[i].t,
              tensor_type_name(exp[i].t));
        CHECK(tensor_type_block_elems(exp[i].t) == exp[i].be, "block elems of %s", exp[i].name);
        CHECK(tensor_type_block_bytes(exp[i].t) == exp[i].bb, "block bytes of %s", exp[i].name);
    }
    for (size_t i = 0; i < NSUP; i++) CHECK(tensor_type_supported(SUPPORTED[i]), "type %u supported", SUPPORTED[i]);
    CHECK(!tensor_type_supported(TT_Q8_K) && !tensor_type_supported(20), "Q8_K / IQ4_NL not supported");
    CHECK(!tensor_type_known(4) && !tensor_type_known(5) && !tensor_type_known(1000) && !tensor_type_known(31),
          "unknown ids");
    CHECK(!tensor_type_supported(4) && !tensor_type_supported(0xffffffffu), "unknown ids unsupported");
    CHECK(tensor_type_block_elems(4) == 0 && tensor_type_block_bytes(4) == 0, "unknown sizes are 0");
    CHECK(tensor_row_bytes(TT_Q4_1, 576) == 18 * 20, "row bytes Q4_1");
    CHECK(tensor_row_bytes(TT_Q8_0, 576) == 18 * 34, "row bytes Q8_0");
    CHECK(tensor_row_bytes(TT_Q4_K, 512) == 2 * 144, "row bytes Q4_K");
    CHECK(tensor_row_bytes(TT_F32, 7) == 28, "row bytes F32");
    CHECK(tensor_row_bytes(TT_Q4_1, 33) == 0, "row bytes non-multiple");
    CHECK(tensor_row_bytes(TT_Q6_K, 128) == 0, "row bytes non-multiple K");
    CHECK(tensor_row_bytes(4, 32) == 0, "row bytes unknown type");
    CHECK(tensor_row_bytes(TT_F32, -4) == 0, "row bytes negative");
    CHECK(tensor_row_bytes(TT_F32, INT64_MAX) == 0, "row bytes overflow");
}

static void test_half(void) {
    int bad = 0, bad_rt = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = f16_to_f32((uint16_t)h);
        double r = ref_half((uint16_t)h);
        if (isnan(r)) {
            if (!isnan(f)) bad++;
            continue;
        }
        if ((double)f != r || !signbit(f) != !signbit(r)) bad++;
        if (f32_to_f16(f) != h) bad_rt++;
    }
    CHECK(bad == 0, "f16_to_f32 mismatches: %d", bad);
    CHECK(bad_rt == 0, "f32_to_f16 round-trip mismatches: %d", bad_rt);
    CHECK(isnan(f16_to_f32(f32_to_f16(NAN))), "NaN stays NaN");
    CHECK(f32_to_f16(INFINITY) == 0x7c00 && f32_to_f16(-INFINITY) == 0xfc00, "inf");
    CHECK(f32_to_f16(65520.0f) == 0x7c00 && f32_to_f16(65519.99f) == 0x7bff, "overflow threshold");
    CHECK(f32_to_f16(1e-9f) == 0 && f32_to_f16(-1e-9f) == 0x8000, "underflow to signed zero");

    /* random floats: result must be the nearest half, ties to even mantissa */
    int bad_rn = 0;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)rnd64();
        /* bias toward the half range: exponents ~ [-30, 17] */
        u = (u & 0x807fffffu) | ((uint32_t)(97 + rnd64() % 48) << 23);
        if (i % 4 == 0) u &= ~0x0fffu; /* produce exact ties more often */
        float f;
        memcpy(&f, &u, 4);
        uint16_t h = f32_to_f16(f);
        double v = ref_half(h), x = f;
        if (isinf(v)) {
            if (fabs(x) < 65520.0) bad_rn++;
            continue;
        }
        /* neighbours (same sign) */
        uint16_t mag = h & 0x7fff;
        double up = (mag < 0x7bff) ? ref_half((uint16_t)((h & 0x8000) | (mag + 1))) : INFINITY;
        double dn = mag > 0 ? ref_half((uint16_t)((h & 0x8000) | (mag - 1))) : -v;
        double e = fabs(x - v);
        if (e > fabs(x - up) || e > fabs(x - dn)) bad_rn++;
        if ((e == fabs(x - up) || e == fabs(x - dn)) && e != 0 && (h & 1)) bad_rn++;
    }
    CHECK(bad_rn == 0, "f32_to_f16 rounding mismatches: %d", bad_rn);
    int bad_bf = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = bf16_to_f32((uint16_t)h);
        uint32_t u;
        memcpy(&u, &f, 4);
        if (u != h << 16) bad_bf++;
    }
    CHECK(bad_bf == 0, "bf16_to_f32 mismatches: %d", bad_bf);
}

static int same_float(float a, double r) {
    if (isnan(r)) return isnan(a);
    return (double)a == (double)(float)r;
}

static void test_dequant(void) {
    for (size_t ti = 0; ti < NSUP; ti++) {
        const uint32_t t = SUPPORTED[ti];
        const int64_t be = tensor_type_block_elems(t);
        const size_t bb = tensor_type_block_bytes(t);
        const int64_t nblocks = be == 1 ? 1000 : (be == 32 ? 400 : 50);
        const int64_t n = nblocks * be;
        uint8_t *buf = malloc(bb * (size_t)nblocks);
        float *out = malloc((size_t)n * sizeof(float));
        random_blocks(t, buf, nblocks);
        for (int64_t i = 0; i < n; i++) out[i] = -12345.0f;
        int rc = dequantize_row(t, buf, out, n, NULL);
        CHECK(rc == STILL_OK, "dequantize_row %s rc=%d", tensor_type_name(t), rc);
        int64_t bad = 0, first = -1;
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *blk = buf + (size_t)(i / be) * bb;
            double r = ref_elem(t, blk, (int)(i % be));
            if (!same_float(out[i], r)) {
                if (first < 0) first = i;
                bad++;
            }
        }
        CHECK(bad == 0, "dequantize %s: %lld mismatches (first at %lld: got %.9g want %.9g)", tensor_type_name(t),
              (long long)bad, (long long)first, first >= 0 ? out[first] : 0.0,
              first >= 0 ? ref_elem(t, buf + (size_t)(first / be) * bb, (int)(first % be)) : 0.0);
        /* partial row starting at a block boundary */
        if (nblocks > 3) {
            float *o2 = malloc((size_t)(2 * be) * sizeof(float));
            dequantize_row(t, buf + 3 * bb, o2, 2 * be, NULL);
            CHECK(memcmp(o2, out + 3 * be, (size_t)(2 * be) * sizeof(float)) == 0, "partial row %s",
                  tensor_type_name(t));
            free(o2);
        }
        if (be > 1) {
            still_err err = {0};
            rc = dequantize_row(t, buf, out, be + 1, &err);
            CHECK(rc == STILL_E_ARG && err.code == STILL_E_ARG && err.msg[0], "bad length for %s", tensor_type_name(t));
        }
        free(buf);
        free(out);
    }
    still_err err = {0};
    float o[32];
    uint8_t z[64] = {0};
    CHECK(dequantize_row(TT_Q8_K, z, o, 256, &err) == STILL_E_UNSUPPORTED && err.msg[0], "Q8_K unsupported");
    CHECK(dequantize_row(5, z, o, 32, &err) == STILL_E_UNSUPPORTED, "type 5 unsupported");
    CHECK(dequantize_row(TT_Q4_0, z, o, 0, &err) == STILL_OK, "n = 0 ok");
}

/* Simple reference quantizers: check that our reading of the layout
 * reproduces the data (within the quantization step). */
static void quant_q8_0(const float *x, uint8_t *blk) {
    double amax = 0;
    for (int j = 0; j < 32; j++) amax = fmax(amax, fabs(x[j]));
    double d = amax / 127.0;
    uint16_t dh = f32_to_f16((float)d);
    double dd = f16_to_f32(dh);
    wr16(blk, dh);
    for (int j = 0; j < 32; j++) {
        long q = dd > 0 ? lround(x[j] / dd) : 0;
        if (q > 127) q = 127;
        if (q < -128) q = -128;
        blk[2 + j] = (uint8_t)(int8_t)q;
    }
}
static void quant_q4_0(const float *x, uint8_t *blk) {
    double amax = 0, mx = 0;
    for (int j = 0; j < 32; j++)
        if (fabs(x[j]) > amax) { amax = fabs(x[j]); mx = x[j]; }
    uint16_t dh = f32_to_f16((float)(mx / -8.0));
    double dd = f16_to_f32(dh);
    wr16(blk, dh);
    memset(blk + 2, 0, 16);
    for (int j = 0; j < 32; j++) {
        long q = dd != 0 ? lround(x[j] / dd) + 8 : 8;
        if (q < 0) q = 0;
        if (q > 15) q = 15;
        blk[2 + (j % 16)] |= (uint8_t)(j < 16 ? q : q << 4);
    }
}
static void quant_q4_1(const float *x, uint8_t *blk) {
    double mn = x[0], mx = x[0];
    for (int j = 1; j < 32; j++) { mn = fmin(mn, x[j]); mx = fmax(mx, x[j]); }
    uint16_t dh = f32_to_f16((float)((mx - mn) / 15.0)), mh = f32_to_f16((float)mn);
    double dd = f16_to_f32(dh), mm = f16_to_f32(mh);
    wr16(blk, dh);
    wr16(blk + 2, mh);
    memset(blk + 4, 0, 16);
    for (int j = 0; j < 32; j++) {
        long q = dd != 0 ? lround((x[j] - mm) / dd) : 0;
        if (q < 0) q = 0;
        if (q > 15) q = 15;
        blk[4 + (j % 16)] |= (uint8_t)(j < 16 ? q : q << 4);
    }
}

static void test_roundtrip(void) {
    enum { NB = 64 };
    float x[NB * 32], y[NB * 32];
    uint8_t q[NB * 34];
    for (int i = 0; i < NB * 32; i++) x[i] = (float)(rnd_sym() * 3.0);
    struct { uint32_t t; void (*fn)(const float *, uint8_t *); double tol; } cases[] = {
        {TT_Q8_0, quant_q8_0, 0.51 / 127.0 * 1.01}, {TT_Q4_0, quant_q4_0, 1.0 / 8.0 * 1.01} /* the most negative value clips */,
        {TT_Q4_1, quant_q4_1, 0.51 / 15.0 * 1.02},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t bb = tensor_type_block_bytes(cases[c].t);
        for (int b = 0; b < NB; b++) cases[c].fn(x + 32 * b, q + bb * (size_t)b);
        dequantize_row(cases[c].t, q, y, NB * 32, NULL);
        double worst = 0;
        for (int b = 0; b < NB; b++) {
            double range = 0;
            for (int j = 0; j < 32; j++) range = fmax(range, fabs(x[32 * b + j]));
            if (cases[c].t == TT_Q4_1) {
                double mn = x[32 * b], mx = x[32 * b];
                for (int j = 0; j < 32; j++) { mn = fmin(mn, x[32 * b + j]); mx = fmax(mx, x[32 * b + j]); }
                range = mx - mn;
            }
            for (int j = 0; j < 32; j++) worst = fmax(worst, fabs(y[32 * b + j] - x[32 * b + j]) / range);
        }
        CHECK(worst <= cases[c].tol + 2e-3, "round trip %s: worst relative error %g", tensor_type_name(cases[c].t),
              worst);
    }
}

/* matmul against a double loop over dequantize_row output */
static void test_matmul_case_at(uint32_t t, int64_t n_in, int64_t n_out, int64_t n_tok, size_t pad, size_t misalign,
                                double *worst) {
    const size_t rb0 = tensor_row_bytes(t, n_in), rb = rb0 + pad;
    const int64_t be = tensor_type_block_elems(t);
    uint8_t *wbuf = malloc(rb * (size_t)n_out + misalign);
    uint8_t *w = wbuf + misalign; /* weights need no alignment */
    for (int64_t r = 0; r < n_out; r++) {
        random_blocks(t, w + (size_t)r * rb, n_in / be);
        memset(w + (size_t)r * rb + rb0, 0xff, pad); /* poison the padding (NaN for float types) */
    }
    float *wf = malloc((size_t)(n_in * n_out) * sizeof(float));
    for (int64_t r = 0; r < n_out; r++) dequantize_row(t, w + (size_t)r * rb, wf + r * n_in, n_in, NULL);
    float *x = malloc((size_t)(n_in * n_tok) * sizeof(float));
    for (int64_t i = 0; i < n_in * n_tok; i++) x[i] = (float)rnd_sym();
    float *y = malloc((size_t)(n_out * n_tok + 1) * sizeof(float));
    for (int64_t i = 0; i < n_out * n_tok + 1; i++) y[i] = -777.0f;
    weight_matrix W = {.type = t, .n_in = n_in, .n_out = n_out, .data = w, .row_bytes = rb};
    matmul(&W, x, y, n_tok);
    int64_t bad = 0;
    double mx = 0;
    for (int64_t tk = 0; tk < n_tok; tk++) {
        for (int64_t o = 0; o < n_out; o++) {
            double s = 0, sa = 0;
            for (int64_t i = 0; i < n_in; i++) {
                double p = (double)wf[o * n_in + i] * (double)x[tk * n_in + i];
                s += p;
                sa += fabs(p);
            }
            double e = fabs((double)y[tk * n_out + o] - s) / (sa > 0 ? sa : 1e-30);
            if (!(e < 1e-5)) {
                if (bad < 3)
                    printf("  %s n_in=%lld n_out=%lld n_tok=%lld y[%lld][%lld]=%.9g want %.9g\n", tensor_type_name(t),
                           (long long)n_in, (long long)n_out, (long long)n_tok, (long long)tk, (long long)o,
                           y[tk * n_out + o], s);
                bad++;
            }
            if (e > mx || isnan(e)) mx = isnan(e) ? INFINITY : e;
        }
    }
    CHECK(bad == 0 && y[n_out * n_tok] == -777.0f, "matmul %s n_in=%lld n_out=%lld n_tok=%lld pad=%zu: %lld bad, max rel err %.3g",
          tensor_type_name(t), (long long)n_in, (long long)n_out, (long long)n_tok, pad, (long long)bad, mx);
    if (mx > *worst) *worst = mx;
    free(wbuf);
    free(wf);
    free(x);
    free(y);
}

static void test_matmul_case(uint32_t t, int64_t n_in, int64_t n_out, int64_t n_tok, size_t pad, double *worst) {
    test_matmul_case_at(t, n_in, n_out, n_tok, pad, 0, worst);
}

static void test_matmul(void) {
    static const int64_t toks[] = {1, 2, 3, 7, 64, 130};
    static const int64_t outs[] = {1, 5, 33};
    for (size_t ti = 0; ti < NSUP; ti++) {
        const uint32_t t = SUPPORTED[ti];
        const int64_t be = tensor_type_block_elems(t);
        double worst = 0;
        /* n_in: a couple of blocks, not a multiple of the dequant chunk for small blocks */
        const int64_t n_in = be == 256 ? 512 : (be == 32 ? 96 : 80);
        for (size_t a = 0; a < sizeof toks / sizeof toks[0]; a++)
            for (size_t b = 0; b < sizeof outs / sizeof outs[0]; b++)
                test_matmul_case(t, n_in, outs[b], toks[a], 0, &worst);
        test_matmul_case(t, n_in, 100, 64, 0, &worst);  /* several panels */
        /* a longer row (several dequant chunks, tail chunk) */
        test_matmul_case(t, be == 256 ? 768 : (be == 32 ? 576 : 300), 50, 1, 0, &worst);
        test_matmul_case(t, be == 256 ? 768 : (be == 32 ? 576 : 300), 50, 9, 0, &worst);
        /* row stride larger than the packed row; unaligned weight data */
        test_matmul_case(t, n_in, 7, 1, 16, &worst);
        test_matmul_case(t, n_in, 7, 10, 16, &worst);
        test_matmul_case_at(t, n_in, 19, 1, 1, 1, &worst);
        test_matmul_case_at(t, n_in, 19, 3, 3, 3, &worst);
        test_matmul_case_at(t, n_in, 19, 12, 1, 1, &worst);
        /* float types: n_in not a multiple of any vector width */
        if (be == 1) {
            test_matmul_case(t, 37, 9, 1, 0, &worst);
            test_matmul_case(t, 37, 9, 11, 0, &worst);
            test_matmul_case(t, 1, 3, 4, 0, &worst);
        }
        printf("  matmul %-5s worst relative error %.3g\n", tensor_type_name(t), worst);
    }
    /* hot shapes of the default model */
    double worst = 0;
    test_matmul_case(TT_Q4_1, 576, 192, 1, 0, &worst);
    test_matmul_case(TT_Q4_1, 1536, 576, 1, 0, &worst);
    test_matmul_case(TT_Q4_1, 576, 1536, 19, 0, &worst);
    test_matmul_case(TT_Q8_0, 576, 1000, 1, 0, &worst);
    test_matmul_case(TT_Q8_0, 576, 300, 17, 0, &worst);
    /* long rows: the token dimension is split into chunks (2 + 64 + 64) */
    test_matmul_case(TT_F32, 65536, 3, 130, 0, &worst);
    test_matmul_case(TT_Q8_0, 65536, 2, 70, 0, &worst);
    printf("  matmul model shapes / long rows worst relative error %.3g\n", worst);

    /* invalid use yields NaN, not garbage */
    uint8_t z[64] = {0};
    float y[4] = {0};
    weight_matrix W = {.type = TT_Q8_K, .n_in = 256, .n_out = 1, .data = z, .row_bytes = 292};
    float x[256] = {0};
    matmul(&W, x, y, 1);
    CHECK(isnan(y[0]), "unsupported type gives NaN");
}

/* Integer decode (matvec_q8): the activation's 8-bit blocks against a
 * double loop written here (d = max|x|/127, q = round(x/d)); y against the
 * double product of the dequantized weights (ref_elem; K-quants:
 * dequantize_row) with that quantized activation, on every path this CPU
 * runs, for odd row counts and widths; and against the float matmul within
 * a stated bar for the 8-bit rounding. The last shape is extreme: rows of
 * all-ones and all-zero quant bytes against activation blocks of ±127 (the
 * largest 16-bit pair sums). */
static void test_matvec_q8(void) {
    const uint32_t types[] = {TT_Q4_0, TT_Q4_1, TT_Q8_0, TT_Q5_0, TT_Q5_1, TT_Q4_K, TT_Q5_K, TT_Q6_K};
    const int64_t shapes32[][2] = {{1, 32}, {37, 96}, {16, 576}, {70, 1536}, {3, 64}, {10, 128}};
    const int64_t shapesK[][2] = {{1, 256}, {37, 768}, {16, 1536}, {70, 512}, {3, 2048}, {10, 512}};
    const size_t n_shapes = sizeof shapes32 / sizeof shapes32[0];
    int paths_run = 0;
    for (int path = MATVEC_Q8_PORTABLE; path <= MATVEC_Q8_LAST; path++) {
        if (!matvec_q8_path_available(path)) {
            printf("matvec_q8: path %s not available on this CPU\n", matvec_q8_path_name(path));
            continue;
        }
        paths_run++;
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
            for (size_t si = 0; si < n_shapes; si++) {
                const uint32_t t = types[ti];
                const int64_t be = tensor_type_block_elems(t);
                const int is_k = be == 256, extreme = si == n_shapes - 1;
                const int64_t n_out = is_k ? shapesK[si][0] : shapes32[si][0];
                const int64_t n_in = is_k ? shapesK[si][1] : shapes32[si][1], nb = n_in / 32;
                const size_t rb = tensor_row_bytes(t, n_in);
                uint8_t *wbuf = malloc(rb * (size_t)n_out + 1);
                float *x = malloc(sizeof(float) * (size_t)n_in), *y = malloc(sizeof(float) * (size_t)n_out);
                float *yf = malloc(sizeof(float) * (size_t)n_out), *wrow = malloc(sizeof(float) * (size_t)n_in);
                uint8_t *wdat = wbuf + 1;   /* unaligned on purpose */
                random_blocks(t, wdat, n_in / be * n_out);
                for (int64_t i = 0; i < n_in; i++) x[i] = (float)(rnd_sym() * (i % 7 == 0 ? 6.0 : 1.0));
                if (si == 0) memset(x, 0, 16 * sizeof(float));   /* a zero half block */
                if (extreme) {
                    for (int64_t i = 0; i < n_in; i++) x[i] = (i / 32) % 2 ? -0.5f : 0.5f;
                    for (int64_t o = 0; o < 2 && o < n_out; o++) {   /* row 0: all bits set, row 1: none */
                        uint8_t *row = wdat + (size_t)o * rb;
                        const uint8_t fill = o == 0 ? 0xFF : 0x00;
                        const size_t bb = tensor_type_block_bytes(t);
                        size_t k0 = 0, k1 = 2;   /* the block's f16 scale bytes [k0, k1) are kept */
                        if (t == TT_Q6_K) k0 = 208, k1 = 210;
                        else if (t == TT_Q4_1 || t == TT_Q5_1 || is_k) k1 = 4;
                        for (int64_t b = 0; b < n_in / be; b++)
                            for (size_t k = 0; k < bb; k++)
                                if (k < k0 || k >= k1) row[(size_t)b * bb + k] = fill;
                    }
                }
                act_q8 a;
                CHECK(act_q8_init(&a, n_in) == STILL_OK, "act_q8_init");
                CHECK(act_q8_quantize(&a, x, n_in) == STILL_OK, "quantize");
                int q_ok = 1;
                for (int64_t b = 0; b < nb; b++) {
                    double amax = 0;
                    for (int i = 0; i < 32; i++) amax = fmax(amax, fabs(x[32 * b + i]));
                    const double d = (float)(amax / 127.0);
                    long sum = 0;
                    for (int i = 0; i < 32; i++) {
                        const long q = d > 0 ? lrint(x[32 * b + i] / d) : 0;
                        if (labs(q - a.q[32 * b + i]) > (d > 0 ? 1 : 0) || labs((long)a.q[32 * b + i]) > 127) q_ok = 0;
                        sum += a.q[32 * b + i];
                    }
                    if (fabs(a.d[b] - d) > 1e-7 * d || fabs(a.s[b] - (float)(a.d[b] * sum)) > 1e-6 * fabs(a.d[b] * sum) + 1e-30)
                        q_ok = 0;
                }
                CHECK(q_ok, "%s: 8-bit activation blocks as the double loop", tensor_type_name(t));
                const weight_matrix W = {.type = t, .n_in = n_in, .n_out = n_out, .data = wdat, .row_bytes = rb};
                CHECK(matvec_q8(&W, &a, y, path) == STILL_OK, "matvec_q8");
                matmul(&W, x, yf, 1);
                double worst = 0, worst_f = 0, norm = 0;
                for (int64_t o = 0; o < n_out; o++) {
                    const uint8_t *row = wdat + (size_t)o * rb;
                    const size_t bb = tensor_type_block_bytes(t);
                    double ref = 0, mag = 0;
                    if (is_k) CHECK(dequantize_row(t, row, wrow, n_in, NULL) == STILL_OK, "dequantize_row");
                    for (int64_t i = 0; i < n_in; i++) {
                        const double w = is_k ? (double)wrow[i] : ref_elem(t, row + (size_t)(i / 32) * bb, (int)(i % 32));
                        ref += w * (double)a.d[i / 32] * a.q[i];
                        mag += fabs(w * x[i]);
                    }
                    worst = fmax(worst, fabs(y[o] - ref) / (mag + 1e-30));
                    worst_f = fmax(worst_f, fabs(y[o] - yf[o]));
                    norm = fmax(norm, mag);
                }
                CHECK(worst < 2e-6, "%s %lldx%lld path %s: |y - exact| / sum|w x| = %.3g (< 2e-6)", tensor_type_name(t),
                      (long long)n_out, (long long)n_in, matvec_q8_path_name(path), worst);
                /* 8-bit activations: each element off by at most d/2 = max|x|/254 of its block */
                CHECK(worst_f < norm / 100.0, "%s %lldx%lld path %s: against the float path %.3g (< 1%% of max sum|w x| %.3g)",
                      tensor_type_name(t), (long long)n_out, (long long)n_in, matvec_q8_path_name(path), worst_f, norm);
                act_q8_free(&a);
                free(wbuf), free(x), free(y), free(yf), free(wrow);
            }
    }
    CHECK(paths_run >= 1, "at least the portable path runs");
    /* several matrices of one input in one parallel region: each row as matvec_q8 computes it */
    for (int cfg = 0; cfg < 2; cfg++) {
        const int64_t n_in = cfg ? 768 : 576, outs[3] = {576, 192, 37};
        const uint32_t ts[3] = {cfg ? TT_Q4_K : TT_Q4_1, cfg ? TT_Q6_K : TT_Q8_0, cfg ? TT_Q5_K : TT_Q4_0};
        uint8_t *wd[3];
        weight_matrix Ws[3];
        float *ys[3], *yo[3], *x = malloc(sizeof(float) * (size_t)n_in);
        for (int64_t i = 0; i < n_in; i++) x[i] = (float)rnd_sym();
        act_q8 a;
        act_q8_init(&a, n_in);
        act_q8_quantize(&a, x, n_in);
        for (int i = 0; i < 3; i++) {
            const size_t rb = tensor_row_bytes(ts[i], n_in);
            wd[i] = malloc(rb * (size_t)outs[i]);
            random_blocks(ts[i], wd[i], n_in / tensor_type_block_elems(ts[i]) * outs[i]);
            Ws[i] = (weight_matrix){.type = ts[i], .n_in = n_in, .n_out = outs[i], .data = wd[i], .row_bytes = rb};
            ys[i] = malloc(sizeof(float) * (size_t)outs[i]), yo[i] = malloc(sizeof(float) * (size_t)outs[i]);
            matvec_q8(&Ws[i], &a, yo[i], MATVEC_Q8_AUTO);
        }
        const weight_matrix *const Wp[3] = {&Ws[0], &Ws[1], &Ws[2]};
        CHECK(matvec_q8_many(Wp, ys, 3, &a, MATVEC_Q8_AUTO) == STILL_OK, "matvec_q8_many");
        int same = 1;
        for (int i = 0; i < 3; i++) same &= !memcmp(ys[i], yo[i], sizeof(float) * (size_t)outs[i]);
        CHECK(same, "matvec_q8_many: every row bit for bit as matvec_q8");
        CHECK(matvec_q8_many(Wp, ys, 0, &a, MATVEC_Q8_AUTO) == STILL_E_ARG, "no matrices refused");
        for (int i = 0; i < 3; i++) free(wd[i]), free(ys[i]), free(yo[i]);
        free(x);
        act_q8_free(&a);
    }
    /* misuse is refused */
    act_q8 a;
    CHECK(act_q8_init(&a, 33) == STILL_E_ARG, "capacity not a multiple of 32");
    CHECK(act_q8_init(&a, 64) == STILL_OK, "init 64");
    float x[96] = {0};
    CHECK(act_q8_quantize(&a, x, 96) == STILL_E_ARG, "more than the capacity");
    CHECK(act_q8_quantize(&a, x, 64) == STILL_OK, "zeros quantize");
    /* a NaN or an infinity has no 8-bit value: refused (the model then takes the float product) */
    const float bad_values[3] = {NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 3; i++) {
        x[45] = bad_values[i];
        CHECK(act_q8_quantize(&a, x, 64) == STILL_E_ARG, "a non-finite activation (%g) refused", bad_values[i]);
    }
    x[45] = 0;
    /* a block of subnormals (found by the adapter fuzzer: 0 · (1 / d) was NaN, d's inverse infinite) quantizes to
     * zeros, in the activations and in quantize_row_q8_0 (whose f16 scale is then 0 too); a non-finite weight is
     * refused there */
    x[3] = 1.33e-43f, x[40] = -7e-44f;
    CHECK(act_q8_quantize(&a, x, 64) == STILL_OK, "subnormal activations quantize");
    int all_zero = 1;
    for (int i = 0; i < 64; i++) all_zero &= a.q[i] == 0;
    CHECK(all_zero && a.s[0] == 0.0f && a.s[1] == 0.0f, "subnormal activations give zeros");
    {
        uint8_t q8[2 * 34];
        memset(q8, 0x5a, sizeof q8);
        CHECK(quantize_row_q8_0(x, q8, 64) == STILL_OK, "subnormal weights quantize");
        float back[64];
        still_err e2 = {0, ""};
        CHECK(dequantize_row(TT_Q8_0, q8, back, 64, &e2) == STILL_OK, "dequantize");
        int zeros = 1;
        for (int i = 0; i < 64; i++) zeros &= back[i] == 0.0f;
        CHECK(zeros, "subnormal weights quantize to zeros");
        for (int i = 0; i < 3; i++) {
            x[45] = bad_values[i];
            CHECK(quantize_row_q8_0(x, q8, 64) == STILL_E_ARG, "a non-finite weight (%g) refused", bad_values[i]);
        }
    }
    x[3] = x[40] = x[45] = 0;
    uint8_t wq[2 * 34] = {0};
    float y[1];
    const weight_matrix Wf = {.type = TT_F32, .n_in = 64, .n_out = 1, .data = wq, .row_bytes = 256};
    CHECK(matvec_q8(&Wf, &a, y, MATVEC_Q8_AUTO) == STILL_E_ARG, "F32 weights refused");
    const weight_matrix Wn = {.type = TT_Q8_0, .n_in = 32, .n_out = 1, .data = wq, .row_bytes = 34};
    CHECK(matvec_q8(&Wn, &a, y, MATVEC_Q8_AUTO) == STILL_E_ARG, "width other than the activation's refused");
    act_q8_free(&a);
    /* K-quants: supported, but only for rows of whole 256-element super-blocks */
    CHECK(matvec_q8_supported(TT_Q4_K) && matvec_q8_supported(TT_Q5_K) && matvec_q8_supported(TT_Q6_K),
          "Q4_K / Q5_K / Q6_K supported");
    CHECK(!matvec_q8_supported(TT_Q2_K) && !matvec_q8_supported(TT_Q3_K) && !matvec_q8_supported(TT_Q8_K),
          "Q2_K / Q3_K / Q8_K not supported");
    {
        float xk[288];
        for (int i = 0; i < 288; i++) xk[i] = (float)rnd_sym();
        uint8_t wk[2 * 210] = {0};
        CHECK(act_q8_init(&a, 512) == STILL_OK, "init 512");
        CHECK(act_q8_quantize(&a, xk, 288) == STILL_OK, "quantize 288");
        const uint32_t kt[3] = {TT_Q4_K, TT_Q5_K, TT_Q6_K};
        for (int i = 0; i < 3; i++) {
            const weight_matrix Wk = {.type = kt[i], .n_in = 288, .n_out = 1, .data = wk, .row_bytes = sizeof wk};
            for (int path = MATVEC_Q8_AUTO; path <= MATVEC_Q8_LAST; path++)
                CHECK(matvec_q8(&Wk, &a, y, path) == STILL_E_ARG, "%s: a 288-wide row (not a multiple of 256) refused on path %s",
                      tensor_type_name(kt[i]), matvec_q8_path_name(path));
            const weight_matrix *const Wkp[1] = {&Wk};
            float *yk[1] = {y};
            CHECK(matvec_q8_many(Wkp, yk, 1, &a, MATVEC_Q8_AUTO) == STILL_E_ARG, "%s: 288 wide refused by matvec_q8_many",
                  tensor_type_name(kt[i]));
        }
        act_q8_free(&a);
    }
    printf("matvec_q8: best path on this CPU: %s\n", matvec_q8_path_name(matvec_q8_best_path()));
}

/* Prefill with 8-bit activations (matmul_q8): M activations quantized as decode does, Q4_0 / Q4_1 / Q8_0 weights, every
 * row and token against the double product of the dequantized weights (ref_elem) with that quantized activation
 * and against the portable matvec_q8 of the same activation; shapes with rows past a 32-row panel and token counts
 * past a 4-token tile; refusals. On a CPU without AVX-512 VNNI matmul_q8_supported is false and the refusal alone
 * runs (said in the output). */
static void test_matmul_q8(void) {
    const uint32_t types[] = {TT_Q4_0, TT_Q4_1, TT_Q8_0};
    const int64_t shapes[][3] = {{1, 32, 1}, {37, 96, 5}, {32, 576, 4}, {70, 1536, 11}, {200, 64, 3}, {33, 128, 9}};
    const int path = MATVEC_Q8_VNNI;
    if (!matmul_q8_supported(TT_Q4_1, path)) {
        printf("matmul_q8: AVX-512 VNNI not available on this CPU: only the refusal is checked\n");
        const weight_matrix W = {.type = TT_Q4_1, .n_in = 32, .n_out = 1, .data = NULL, .row_bytes = 20};
        act_q8 a = {.n = 32};
        float y[1];
        CHECK(matmul_q8(&W, &a, 1, y, path) == STILL_E_ARG, "matmul_q8 refused without its path");
        return;
    }
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const uint32_t t = types[ti];
            const int64_t n_out = shapes[si][0], n_in = shapes[si][1], M = shapes[si][2];
            const size_t rb = tensor_row_bytes(t, n_in), bb = tensor_type_block_bytes(t);
            uint8_t *wbuf = malloc(rb * (size_t)n_out + 1), *wdat = wbuf + 1;   /* unaligned on purpose */
            random_blocks(t, wdat, n_in / 32 * n_out);
            float *x = malloc(sizeof(float) * (size_t)(n_in * M)), *y = malloc(sizeof(float) * (size_t)(n_out * M));
            float *yp = malloc(sizeof(float) * (size_t)n_out);
            act_q8 *a = calloc((size_t)M, sizeof(act_q8));
            for (int64_t i = 0; i < n_in * M; i++) x[i] = (float)(rnd_sym() * (i % 5 == 0 ? 4.0 : 1.0));
            for (int64_t m = 0; m < M; m++) {
                CHECK(act_q8_init(&a[m], n_in) == STILL_OK, "act_q8_init");
                CHECK(act_q8_quantize(&a[m], x + m * n_in, n_in) == STILL_OK, "quantize");
            }
            const weight_matrix W = {.type = t, .n_in = n_in, .n_out = n_out, .data = wdat, .row_bytes = rb};
            CHECK(matmul_q8(&W, a, M, y, path) == STILL_OK, "matmul_q8");
            double worst = 0, worst_p = 0;
            for (int64_t m = 0; m < M; m++) {
                CHECK(matvec_q8(&W, &a[m], yp, MATVEC_Q8_PORTABLE) == STILL_OK, "matvec_q8 portable");
                for (int64_t o = 0; o < n_out; o++) {
                    const uint8_t *row = wdat + (size_t)o * rb;
                    double ref = 0, mag = 0;
                    for (int64_t i = 0; i < n_in; i++) {
                        const double w = ref_elem(t, row + (size_t)(i / 32) * bb, (int)(i % 32));
                        ref += w * (double)a[m].d[i / 32] * a[m].q[i];
                        mag += fabs(w * (double)a[m].d[i / 32] * a[m].q[i]);
                    }
                    const double yo = y[m * n_out + o];
                    worst = fmax(worst, fabs(yo - ref) / (mag + 1e-30));
                    worst_p = fmax(worst_p, fabs(yo - yp[o]) / (mag + 1e-30));
                }
            }
            CHECK(worst < 2e-6 && worst_p < 2e-6, "%s %lldx%lld, %lld tokens: |y - exact| / sum|w x| = %.3g, against "
                  "the portable matvec_q8 %.3g (< 2e-6)", tensor_type_name(t), (long long)n_out, (long long)n_in,
                  (long long)M, worst, worst_p);
            for (int64_t m = 0; m < M; m++) act_q8_free(&a[m]);
            free(a), free(wbuf), free(x), free(y), free(yp);
        }
    /* refusals: a type it does not take, an activation of another width */
    act_q8 a;
    CHECK(act_q8_init(&a, 64) == STILL_OK && act_q8_quantize(&a, (float[64]){0}, 64) == STILL_OK, "act_q8");
    uint8_t blk[80] = {0};
    float y[2];
    const weight_matrix W5 = {.type = TT_Q5_1, .n_in = 64, .n_out = 1, .data = blk, .row_bytes = 48};
    CHECK(matmul_q8(&W5, &a, 1, y, path) == STILL_E_ARG, "matmul_q8: Q5_1 refused");
    const weight_matrix Ww = {.type = TT_Q4_1, .n_in = 32, .n_out = 1, .data = blk, .row_bytes = 20};
    CHECK(matmul_q8(&Ww, &a, 1, y, path) == STILL_E_ARG, "matmul_q8: an activation of another width refused");
    act_q8_free(&a);
}

int main(void) {
    test_type_table();
    test_half();
    test_dequant();
    test_roundtrip();
    test_matmul();
    test_matvec_q8();
    test_matmul_q8();
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
