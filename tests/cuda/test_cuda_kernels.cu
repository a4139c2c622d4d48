/* GPU test program for the CUDA backend (cuda/still_cuda.h): every kernel
 * against a CPU reference written here (plain loops, double accumulation),
 * on fresh random inputs of several shapes, odd ones included. Output
 * buffers are filled with 0xFF bytes (NaN in fp32 and in bf16) before each
 * run, so an element a kernel fails to write shows up as NaN, and any NaN or
 * infinity in a result fails its check.
 *
 * Error measure: rel = ||gpu - ref||₂ / ||ref||₂ over the whole output. Limits:
 *   1e-4  fp32 results whose inputs the reference sees exactly (RMSNorm, RoPE,
 *         SwiGLU, GEMM with fp32 output: only fp32 rounding and libm-vs-CUDA
 *         ulps differ);
 *   1e-2  results with bf16 in the way: bf16 outputs (one rounding, 2^-9
 *         relative) and the attention (bf16 Q/K/V, P rounded to bf16 for the
 *         second mma);
 *   exact dequantization (the bf16 rounding of src/format/quant.c's values, bit for
 *         bit), the embedding gathers, residual add, fp32 -> bf16, argmax.
 * The still group (stc_still_forward) is checked per (token, head) row,
 * rel = ||y - ref|| / ||ref|| < 1e-2 for every row, against the double
 * reference of tests/cuda/still_ref.hpp (bf16 in the softmax part and in
 * Sel); the selected positions must equal the reference's exactly; every
 * split of a sequence (one call, random chunk-crossing calls, all single
 * steps, a prefill then single steps, the last with positions from the
 * device counter) must agree with the one-call run per row: to 1e-4 through
 * the chunk-parallel kernels (they should differ only through the gate GEMM,
 * whose cuBLASLt algorithm depends on T; all single steps run once more with
 * the decode kernels off to check it), to 2e-3 where single steps take the
 * decode kernels (attn_still_decode.cu: other summation orders, and half
 * roundings of the weights that land on the other side); the line reports
 * the share of bit-identical values.
 *
 *   test_cuda_kernels [--seed N] [--only NAME] [--device N]
 *   test_cuda_kernels --cpu-selftest      (no GPU needed)
 *
 * --only runs the groups whose name contains NAME (dequant, embed, gemm,
 * rmsnorm, rope, swiglu, gemv, add, convert, argmax, attn, errors, still-small,
 * still-long, liger, flash-train, still-train, still-lm-route; --only still runs the still groups).
 * --cpu-selftest checks the CPU side: the bf16 rounding, the attention
 * kernel's fragment / swizzle index arithmetic (cuda/kinds/attn_layout.cuh) against
 * the PTX ISA's definitions of ldmatrix and mma.m16n8k16, the work
 * decomposition (every visible key of every row exactly once), a CPU
 * emulation of the kernel's tiled online softmax with splits against the
 * double-precision reference, and for still a CPU emulation of the kernels'
 * chunk-parallel schedule (cuda/kinds/still/attn_still_layout.cuh's decomposition) over
 * every kind of split against the still reference, plus the call geometry
 * against a token-by-token simulation.
 *
 * One line per check; the last line is "N passed, N failed"; exit status 1
 * on any failure. */
#include "kinds/attn_layout.cuh"
#include "kinds/still/attn_still_rules.h"
#include "still_cuda.h"
#include "still_ref.hpp"

extern "C" {
#include "format/quant.h"
int stc_c_api_check(void);   /* tests/cuda/c_api_check.c: the header compiled as C11 */
}

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

/* ---- harness ------------------------------------------------------------------------- */

static int g_pass, g_fail;
static const char *g_only;
static stc_ctx *g_ctx;
static still_err g_err;

static void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(bool ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s  ", ok ? "ok  " : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    (ok ? g_pass : g_fail)++;
}

static bool selected(const char *group) { return !g_only || strstr(group, g_only); }

/* A failing API call is a failed check (with still_err's message). */
static bool api_ok(int rc, const char *what) {
    if (rc == 0) return true;
    report(false, "%s returned %d: %s", what, rc, g_err.msg);
    return false;
}
#define API(call) api_ok((call), #call)

/* ---- random numbers ---------------------------------------------------------------------- */

struct rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    double uniform() { return (double)(next() >> 11) * 0x1.0p-53; }
    double normal() {
        const double u1 = 1.0 - uniform(), u2 = uniform();
        return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    }
    int below(int n) { return (int)(next() % (uint64_t)n); }
};
static rng g_rng = {12345};

/* ---- bf16 on the host --------------------------------------------------------------------- */

/* fp32 -> bf16, round to nearest, ties to even (NaN stays a quiet NaN). */
static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float bf2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* fp32 -> IEEE half, round to nearest, ties to even (overflow to inf, subnormals below 2^-14, NaN as CUDA's 0x7fff). */
static uint16_t f2h(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;   /* CUDA's canonical NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;   /* 65520 and up (and inf): inf */
    if (a < 0x38800000u) return sign | (uint16_t)rint(fabs((double)f) * 16777216.0);   /* units of 2^-24 */
    uint32_t r = a - ((uint32_t)(127 - 15) << 23);
    r += 0x0fffu + ((r >> 13) & 1u);
    return sign | (uint16_t)(r >> 13);
}
static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static std::vector<uint16_t> rand_bf16(size_t n, double scale) {
    std::vector<uint16_t> v(n);
    for (auto &x : v) x = f2bf((float)(g_rng.normal() * scale));
    return v;
}
static std::vector<float> rand_f32(size_t n, double scale) {
    std::vector<float> v(n);
    for (auto &x : v) x = (float)(g_rng.normal() * scale);
    return v;
}

/* ---- device buffers ------------------------------------------------------------------------ */

struct dbuf {
    void *p = nullptr;
    size_t bytes = 0;
    explicit dbuf(size_t n) : bytes(n) {
        if (stc_malloc(g_ctx, n, "a test buffer", &p, &g_err)) {
            report(false, "stc_malloc(%zu): %s", n, g_err.msg);
            p = nullptr;
        }
    }
    ~dbuf() { stc_free(g_ctx, p); }
    dbuf(const dbuf &) = delete;
    dbuf &operator=(const dbuf &) = delete;
    template <class T>
    T *as() const { return (T *)p; }
    bool ok() const { return p != nullptr; }
    bool poison() { return API(stc_memset(g_ctx, p, 0xFF, bytes, &g_err)); }
    bool put(const void *src, size_t n) { return API(stc_memcpy_h2d(g_ctx, p, src, n, &g_err)); }
    bool get(void *dst, size_t n) { return API(stc_memcpy_d2h(g_ctx, dst, p, n, &g_err)); }
};

template <class T>
static bool upload(dbuf &d, const std::vector<T> &v) { return d.put(v.data(), v.size() * sizeof(T)); }
template <class T>
static bool download(std::vector<T> &v, dbuf &d) {
    return API(stc_ctx_sync(g_ctx, &g_err)) && d.get(v.data(), v.size() * sizeof(T));
}

/* ---- comparisons --------------------------------------------------------------------------- */

/* rel = ||g - r|| / ||r||; when ||r|| = 0, against zero_scale if one is given (the size of the terms whose sum is
 * exactly zero, e.g. a softmax's gradient with respect to its only key), else the absolute norm; fails on a
 * non-finite g. */
static bool check_rel(const char *name, const std::vector<double> &g, const std::vector<double> &r, double tol,
                      double zero_scale = 0) {
    double num = 0, den = 0, maxd = 0;
    size_t bad = 0, first_bad = 0;
    for (size_t i = 0; i < r.size(); i++) {
        if (!isfinite(g[i])) {
            if (!bad++) first_bad = i;
            continue;
        }
        const double d = g[i] - r[i];
        num += d * d;
        den += r[i] * r[i];
        if (fabs(d) > maxd) maxd = fabs(d);
    }
    const bool scaled = den == 0 && zero_scale > 0;
    const double rel = den > 0 ? sqrt(num / den) : scaled ? sqrt(num) / zero_scale : sqrt(num);
    const bool ok = bad == 0 && rel < tol;
    if (bad)
        report(false, "%s: %zu of %zu values not finite (first at %zu: %g)", name, bad, r.size(), first_bad,
               g[first_bad]);
    else if (scaled)
        report(ok, "%s: reference exactly zero, err %.2e of the cancelling terms' norm %.2e (limit %.0e), max abs err "
                   "%.2e", name, rel, zero_scale, tol, maxd);
    else
        report(ok, "%s: rel err %.2e (limit %.0e), max abs err %.2e", name, rel, tol, maxd);
    return ok;
}

static std::vector<double> to_double(const std::vector<float> &v) { return std::vector<double>(v.begin(), v.end()); }
static std::vector<double> bf_to_double(const std::vector<uint16_t> &v) {
    std::vector<double> d(v.size());
    for (size_t i = 0; i < v.size(); i++) d[i] = bf2f(v[i]);
    return d;
}

/* Bit-exact comparison of 16- or 32-bit words (two NaNs are equal). */
template <class T>
static bool check_exact(const char *name, const std::vector<T> &g, const std::vector<T> &r, bool is_bf16) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < r.size(); i++) {
        if (g[i] == r[i]) continue;
        const float gf = is_bf16 ? bf2f((uint16_t)g[i]) : 0, rf = is_bf16 ? bf2f((uint16_t)r[i]) : 0;
        if (is_bf16 && isnan(gf) && isnan(rf)) continue;
        if (!is_bf16) {
            float a, b;
            uint32_t ga = (uint32_t)g[i], ra = (uint32_t)r[i];
            memcpy(&a, &ga, 4);
            memcpy(&b, &ra, 4);
            if (isnan(a) && isnan(b)) continue;
        }
        if (!bad++) first = i;
    }
    if (bad)
        report(false, "%s: %zu of %zu differ (first at %zu: got 0x%x, expected 0x%x)", name, bad, r.size(), first,
               (unsigned)g[first], (unsigned)r[first]);
    else
        report(true, "%s: %zu values bit-exact", name, r.size());
    return bad == 0;
}

/* ---- CPU references -------------------------------------------------------------------------- */

/* Random raw blocks of `type` for rows × cols elements, with finite scales
 * (some of them fp16 subnormals) and, for the float types, finite values. */
static std::vector<uint8_t> rand_blocks(uint32_t type, int64_t rows, int64_t cols) {
    const size_t rb = tensor_row_bytes(type, cols), n = (size_t)rows * rb;
    std::vector<uint8_t> raw(n);
    for (auto &b : raw) b = (uint8_t)g_rng.next();
    const int64_t n_el = rows * cols;
    auto put16 = [&](size_t off, uint16_t h) { memcpy(&raw[off], &h, 2); };
    if (type == TT_F32) {
        for (int64_t i = 0; i < n_el; i++) {
            const float f = (float)(g_rng.normal() * 3);
            memcpy(&raw[(size_t)i * 4], &f, 4);
        }
        return raw;
    }
    if (type == TT_F16 || type == TT_BF16) {
        for (int64_t i = 0; i < n_el; i++) {
            const float f = (float)(g_rng.normal() * (g_rng.below(8) ? 1.0 : 1e-6));
            put16((size_t)i * 2, type == TT_F16 ? f32_to_f16(f) : f2bf(f));
        }
        return raw;
    }
    std::vector<int> offs;
    switch (type) {
    case TT_Q4_0: case TT_Q5_0: case TT_Q8_0: offs = {0}; break;
    case TT_Q4_1: case TT_Q5_1: case TT_Q8_1: case TT_Q4_K: case TT_Q5_K: offs = {0, 2}; break;
    case TT_Q2_K: offs = {80, 82}; break;
    case TT_Q3_K: offs = {108}; break;
    case TT_Q6_K: offs = {208}; break;
    default: break;
    }
    const size_t bb = tensor_type_block_bytes(type);
    for (size_t blk = 0; blk < n / bb; blk++)
        for (int o : offs) {
            const double scale = g_rng.below(16) ? 0.05 : 1e-6;   /* 1e-6: an fp16 subnormal */
            put16(blk * bb + (size_t)o, f32_to_f16((float)((2 * g_rng.uniform() - 1) * scale)));
        }
    return raw;
}

static std::vector<float> ref_dequant(uint32_t type, const std::vector<uint8_t> &raw, int64_t rows, int64_t cols) {
    std::vector<float> out((size_t)(rows * cols));
    const size_t rb = tensor_row_bytes(type, cols);
    still_err e = {};
    for (int64_t r = 0; r < rows; r++)
        if (dequantize_row(type, raw.data() + r * rb, out.data() + r * cols, cols, &e)) {
            fprintf(stderr, "dequantize_row: %s\n", e.msg);
            exit(2);
        }
    return out;
}

/* C[m][n] = Σ_k A[m][k] W[n][k] + beta C0[m][n], in double. */
static std::vector<double> ref_gemm(int M, int N, int K, const std::vector<uint16_t> &A, const std::vector<uint16_t> &W,
                                    const std::vector<double> &C0, double beta) {
    std::vector<double> a((size_t)M * K), w((size_t)N * K), c((size_t)M * N);
    for (size_t i = 0; i < a.size(); i++) a[i] = bf2f(A[i]);
    for (size_t i = 0; i < w.size(); i++) w[i] = bf2f(W[i]);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0;
            const double *x = &a[(size_t)m * K], *y = &w[(size_t)n * K];
            for (int k = 0; k < K; k++) s += x[k] * y[k];
            c[(size_t)m * N + n] = s + (beta != 0 ? beta * C0[(size_t)m * N + n] : 0.0);
        }
    return c;
}

/* src/model/model.c's rmsnorm(): sum of squares in double, scale rounded to float,
 * (x · scale) · w in float. */
static std::vector<float> ref_rmsnorm(const std::vector<float> &x, const std::vector<float> &w, int T, int n, float eps) {
    std::vector<float> out(x.size());
    for (int t = 0; t < T; t++) {
        const float *xr = &x[(size_t)t * n];
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        const float scale = (float)(1.0 / sqrt(ss / n + eps));
        for (int i = 0; i < n; i++) {
            volatile float xs = xr[i] * scale;   /* keep the two roundings apart */
            out[(size_t)t * n + i] = xs * w[i];
        }
    }
    return out;
}

/* src/model/model.c's rope(): inv_freq rounded to float, the angle (float)pos ·
 * inv_freq rounded to float; here its cos / sin and the rotation in double. */
static void ref_rope(std::vector<double> &v, const std::vector<float> &in, int T, int nh, int D, int p0, float theta) {
    v.assign(in.begin(), in.end());
    for (int t = 0; t < T; t++)
        for (int i = 0; i < D / 2; i++) {
            const float inv = (float)pow((double)theta, -2.0 * i / D);
            const float angle = (float)(p0 + t) * inv;
            const double cs = cos((double)angle), sn = sin((double)angle);
            for (int h = 0; h < nh; h++) {
                const size_t o = ((size_t)t * nh + h) * D + 2 * i;
                const double a = in[o], b = in[o + 1];
                v[o] = a * cs - b * sn;
                v[o + 1] = a * sn + b * cs;
            }
        }
}

/* Causal GQA attention in double from the bf16 inputs: q [T][H][D],
 * k, v [>= p0+T][Hk][D]. */
/* window W > 0: keys pos - W < j <= pos only (swa) */
static std::vector<double> ref_attention(const std::vector<uint16_t> &q, const std::vector<uint16_t> &k,
                                         const std::vector<uint16_t> &v, int T, int p0, int H, int Hk, int D,
                                         int W = 0) {
    const int G = H / Hk, L = p0 + T;
    const double scale = 1.0 / sqrt((double)D);
    std::vector<double> kd((size_t)L * Hk * D), vd(kd.size()), out((size_t)T * H * D);
    for (size_t i = 0; i < kd.size(); i++) kd[i] = bf2f(k[i]), vd[i] = bf2f(v[i]);
    std::vector<double> s(L), qd(D);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const int pos = p0 + t, hk = h / G;
            for (int d = 0; d < D; d++) qd[d] = bf2f(q[((size_t)t * H + h) * D + d]);
            const int j0 = W > 0 && pos - W + 1 > 0 ? pos - W + 1 : 0;
            double mx = -INFINITY;
            for (int j = j0; j <= pos; j++) {
                const double *kr = &kd[((size_t)j * Hk + hk) * D];
                double dot = 0;
                for (int d = 0; d < D; d++) dot += qd[d] * kr[d];
                s[j] = dot * scale;
                if (s[j] > mx) mx = s[j];
            }
            double sum = 0;
            for (int j = j0; j <= pos; j++) sum += (s[j] = exp(s[j] - mx));
            double *o = &out[((size_t)t * H + h) * D];
            for (int d = 0; d < D; d++) o[d] = 0;
            for (int j = j0; j <= pos; j++) {
                const double *vr = &vd[((size_t)j * Hk + hk) * D];
                const double p = s[j] / sum;
                for (int d = 0; d < D; d++) o[d] += p * vr[d];
            }
        }
    return out;
}

/* ---- GPU tests ------------------------------------------------------------------------------ */

static const uint32_t DQ_TYPES[] = {TT_F32, TT_F16, TT_BF16, TT_Q4_0, TT_Q4_1, TT_Q5_0, TT_Q5_1,
                                    TT_Q8_0, TT_Q8_1, TT_Q2_K, TT_Q3_K, TT_Q4_K, TT_Q5_K, TT_Q6_K};

static void test_dequant(void) {
    for (uint32_t type : DQ_TYPES) {
        const int64_t be = tensor_type_block_elems(type);
        const int64_t shapes[][2] = {{1, be}, {3, be * (be == 1 ? 577 : 3)}, {17, be == 256 ? 768 : 576}};
        for (auto &sh : shapes) {
            const int64_t rows = sh[0], cols = sh[1];
            char name[128];
            snprintf(name, sizeof name, "dequant %s %lld x %lld -> bf16", tensor_type_name(type), (long long)rows,
                     (long long)cols);
            if (!stc_type_supported(type)) {
                report(false, "%s: type not supported", name);
                continue;
            }
            const std::vector<uint8_t> raw = rand_blocks(type, rows, cols);
            const std::vector<float> ref = ref_dequant(type, raw, rows, cols);
            std::vector<uint16_t> want(ref.size()), got(ref.size());
            for (size_t i = 0; i < ref.size(); i++) want[i] = f2bf(ref[i]);
            dbuf out(got.size() * 2);
            if (!out.ok() || !out.poison()) continue;
            if (!API(stc_dequant_to_bf16(g_ctx, type, raw.data(), rows, cols, out.as<stc_bf16>(), &g_err))) continue;
            if (!download(got, out)) continue;
            check_exact(name, got, want, true);
        }
    }
}

static void test_embed(void) {
    /* Raw quantized tables: exactly dequantize_row()'s values. */
    const uint32_t types[] = {TT_Q8_0, TT_Q4_1, TT_F32, TT_F16, TT_BF16, TT_Q6_K, TT_Q4_K};
    for (uint32_t type : types) {
        const int64_t n_vocab = 301;
        const int d = tensor_type_block_elems(type) == 256 ? 512 : 576;
        const std::vector<uint8_t> raw = rand_blocks(type, n_vocab, d);
        const std::vector<float> table = ref_dequant(type, raw, n_vocab, d);
        const std::vector<int32_t> tok = {0, 300, 17, 17, 150, 299, 1};
        const int T = (int)tok.size();
        std::vector<uint32_t> want((size_t)T * d), got(want.size());
        for (int t = 0; t < T; t++)
            for (int c = 0; c < d; c++) want[(size_t)t * d + c] = f2u(table[(size_t)tok[t] * d + c]);
        dbuf dt(raw.size()), dtok(tok.size() * 4), out(got.size() * 4);
        if (!dt.ok() || !dtok.ok() || !out.ok() || !upload(dt, raw) || !upload(dtok, tok) || !out.poison()) continue;
        char name[128];
        snprintf(name, sizeof name, "embed_quant %s T=%d d=%d", tensor_type_name(type), T, d);
        if (!API(stc_embed_quant(g_ctx, type, dt.p, n_vocab, d, dtok.as<int32_t>(), T, out.as<float>(), &g_err)))
            continue;
        if (download(got, out)) check_exact(name, got, want, false);
    }
    /* bf16 table -> fp32 rows; tokens out of range give NaN rows. */
    for (int d : {576, 64, 3}) {
        const int64_t n_vocab = 1000;
        const std::vector<uint16_t> table = rand_bf16((size_t)n_vocab * d, 1.0);
        const std::vector<int32_t> tok = {5, 999, 0, 5, -1, 1000, 42};
        const int T = (int)tok.size();
        std::vector<uint32_t> want((size_t)T * d), got(want.size());
        for (int t = 0; t < T; t++)
            for (int c = 0; c < d; c++)
                want[(size_t)t * d + c] = tok[t] >= 0 && tok[t] < n_vocab ? f2u(bf2f(table[(size_t)tok[t] * d + c]))
                                                                          : 0x7fc00000u;
        dbuf dt(table.size() * 2), dtok(tok.size() * 4), out(got.size() * 4);
        if (!dt.ok() || !dtok.ok() || !out.ok() || !upload(dt, table) || !upload(dtok, tok) || !out.poison()) continue;
        char name[128];
        snprintf(name, sizeof name, "embed_bf16 T=%d d=%d (two tokens out of range -> NaN rows)", T, d);
        if (!API(stc_embed_bf16(g_ctx, dt.as<stc_bf16>(), n_vocab, d, dtok.as<int32_t>(), T, out.as<float>(), &g_err)))
            continue;
        if (download(got, out)) check_exact(name, got, want, false);
    }
}

static void test_gemm(void) {
    /* from 1,024 rows the candidates are timed on the first call (cuda/kernels/gemm.cu); {1100, 640, 576} comes
     * first with beta 1 below, so its timing runs must leave the residual in C alone; {1500, 1536, 576}
     * takes the choice {2048, 1536, 576} made for its rows bucket */
    const int shapes[][3] = {{1, 576, 576},  {7, 192, 576},  {64, 1536, 576}, {129, 576, 1536},
                             {300, 100, 72}, {3, 49152, 576}, {1000, 576, 576}, {33, 8, 16},
                             {2048, 1536, 576}, {1100, 640, 576}, {1500, 1536, 576}};
    for (auto &sh : shapes) {
        const int M = sh[0], N = sh[1], K = sh[2];
        const std::vector<uint16_t> A = rand_bf16((size_t)M * K, 1.0), W = rand_bf16((size_t)N * K, 0.05);
        dbuf dA(A.size() * 2), dW(W.size() * 2), dC((size_t)M * N * 4);
        if (!dA.ok() || !dW.ok() || !dC.ok() || !upload(dA, A) || !upload(dW, W)) continue;
        const bool beta_first = M == 1100;
        for (int out_bf16 = 0; out_bf16 < 2; out_bf16++)
            for (int b = 0; b < 2; b++) {
                const int beta = beta_first ? 1 - b : b;
                char name[128];
                snprintf(name, sizeof name, "gemm %d x %d x %d, %s out, beta %d", M, N, K, out_bf16 ? "bf16" : "fp32",
                         beta);
                std::vector<double> c0((size_t)M * N, 0.0);
                if (beta) {   /* C starts as random values (the residual) */
                    if (out_bf16) {
                        std::vector<uint16_t> c = rand_bf16(c0.size(), 1.0);
                        c0 = bf_to_double(c);
                        if (!upload(dC, c)) continue;
                    } else {
                        std::vector<float> c = rand_f32(c0.size(), 1.0);
                        c0 = to_double(c);
                        if (!upload(dC, c)) continue;
                    }
                } else if (!dC.poison()) {
                    continue;
                }
                const std::vector<double> ref = ref_gemm(M, N, K, A, W, c0, beta);
                int rc = out_bf16 ? stc_gemm_bf16_out_bf16(g_ctx, M, N, K, dA.as<stc_bf16>(), dW.as<stc_bf16>(),
                                                           dC.as<stc_bf16>(), (float)beta, &g_err)
                                  : stc_gemm_bf16(g_ctx, M, N, K, dA.as<stc_bf16>(), dW.as<stc_bf16>(), dC.as<float>(),
                                                  (float)beta, &g_err);
                if (!api_ok(rc, name)) continue;
                if (out_bf16) {
                    std::vector<uint16_t> got((size_t)M * N);
                    if (download(got, dC)) check_rel(name, bf_to_double(got), ref, 1e-2);
                } else {
                    std::vector<float> got((size_t)M * N);
                    if (download(got, dC)) check_rel(name, to_double(got), ref, 1e-4);
                }
            }
    }
    /* weight gradients: C[M][N] (+)= Σ_k A[k][M] B[k][N] from fp32, in fp32 and in TF32, against
     * double (the still gate's dWg: 576 x 576 over 896 tokens) */
    const int at_b_shapes[][3] = {{576, 576, 896}, {64, 40, 33}, {8, 576, 1}};
    for (auto &sh : at_b_shapes) {
        const int M = sh[0], N = sh[1], K = sh[2];
        const std::vector<float> A = rand_f32((size_t)K * M, 1.0), B = rand_f32((size_t)K * N, 1.0),
                                 C0 = rand_f32((size_t)M * N, 1.0);
        dbuf dA(A.size() * 4), dB(B.size() * 4), dC(C0.size() * 4);
        if (!dA.ok() || !dB.ok() || !dC.ok() || !upload(dA, A) || !upload(dB, B)) continue;
        for (int tf32 = 0; tf32 < 2; tf32++)
            for (int beta = 0; beta < 2; beta++) {
                std::vector<double> ref((size_t)M * N);
                for (int i = 0; i < M; i++)
                    for (int j = 0; j < N; j++) {
                        double acc = beta ? C0[(size_t)i * N + j] : 0.0;
                        for (int k = 0; k < K; k++) acc += (double)A[(size_t)k * M + i] * B[(size_t)k * N + j];
                        ref[(size_t)i * N + j] = acc;
                    }
                if (beta ? !upload(dC, C0) : !dC.poison()) continue;
                char name[128];
                snprintf(name, sizeof name, "gemm %s A^T B %d x %d over %d, beta %d", tf32 ? "tf32" : "fp32", M, N, K,
                         beta);
                const int rc = (tf32 ? stc_gemm_tf32_at_b : stc_gemm_f32_at_b)(
                    g_ctx, M, N, K, dA.as<float>(), dB.as<float>(), dC.as<float>(), (float)beta, &g_err);
                if (!api_ok(rc, name)) continue;
                std::vector<float> got((size_t)M * N);
                if (download(got, dC)) check_rel(name, to_double(got), ref, tf32 ? 2e-3 : 1e-5);
            }
    }
}

static void test_rmsnorm(void) {
    const int shapes[][2] = {{1, 576}, {7, 576}, {130, 1000}, {3, 64}, {2, 4097}, {9, 2048}, {11, 257}, {1000, 576},
                             {3000, 576}, {2100, 1000}, {2500, 1024}, {300, 640}, {4100, 64}, {5, 1088}};
    for (auto &sh : shapes) {
        const int T = sh[0], n = sh[1];
        std::vector<float> x = rand_f32((size_t)T * n, 2.0), w = rand_f32(n, 1.0);
        const float eps = 1e-5f;
        const std::vector<float> ref = ref_rmsnorm(x, w, T, n, eps);
        std::vector<uint16_t> refb(ref.size());
        for (size_t i = 0; i < ref.size(); i++) refb[i] = f2bf(ref[i]);
        dbuf dx(x.size() * 4), dw(w.size() * 4), of(x.size() * 4), ob(x.size() * 2);
        if (!dx.ok() || !dw.ok() || !of.ok() || !ob.ok() || !upload(dx, x) || !upload(dw, w) || !of.poison() ||
            !ob.poison())
            continue;
        char name[128];
        if (!API(stc_rmsnorm(g_ctx, dx.as<float>(), dw.as<float>(), T, n, eps, of.as<float>(), ob.as<stc_bf16>(),
                             &g_err)))
            continue;
        std::vector<float> gf(x.size());
        std::vector<uint16_t> gb(x.size());
        if (!download(gf, of) || !download(gb, ob)) continue;
        snprintf(name, sizeof name, "rmsnorm T=%d n=%d fp32 out", T, n);
        check_rel(name, to_double(gf), to_double(ref), 1e-4);
        snprintf(name, sizeof name, "rmsnorm T=%d n=%d bf16 out", T, n);
        check_rel(name, bf_to_double(gb), to_double(ref), 1e-2);
        /* in place (out = x), fp32 only */
        if (!API(stc_rmsnorm(g_ctx, dx.as<float>(), dw.as<float>(), T, n, eps, dx.as<float>(), NULL, &g_err))) continue;
        if (!download(gf, dx)) continue;
        snprintf(name, sizeof name, "rmsnorm T=%d n=%d in place", T, n);
        check_rel(name, to_double(gf), to_double(ref), 1e-4);
    }
    /* the same bits whatever the row count: rows of a multiple of 64 floats (576) always by float pairs;
     * others (1000) by the register kernel up to 2,048 rows and the streaming one beyond: 2,049 rows,
     * their first 2,048 again; fp32 and bf16 out, then bf16 out alone (the model's call) */
    for (int n : {576, 1000}) {
        const int T = 2049;
        std::vector<float> x = rand_f32((size_t)T * n, 2.0), w = rand_f32(n, 1.0);
        dbuf dx(x.size() * 4), dw(w.size() * 4), of1(x.size() * 4), ob1(x.size() * 2), of2(x.size() * 4),
            ob2(x.size() * 2), ob3(x.size() * 2);
        if (!dx.ok() || !dw.ok() || !of1.ok() || !ob1.ok() || !of2.ok() || !ob2.ok() || !ob3.ok() || !upload(dx, x) ||
            !upload(dw, w) || !of1.poison() || !ob1.poison() || !of2.poison() || !ob2.poison() || !ob3.poison())
            continue;
        if (!API(stc_rmsnorm(g_ctx, dx.as<float>(), dw.as<float>(), T, n, 1e-5f, of1.as<float>(), ob1.as<stc_bf16>(),
                             &g_err)) ||
            !API(stc_rmsnorm(g_ctx, dx.as<float>(), dw.as<float>(), T - 1, n, 1e-5f, of2.as<float>(),
                             ob2.as<stc_bf16>(), &g_err)) ||
            !API(stc_rmsnorm(g_ctx, dx.as<float>(), dw.as<float>(), T - 1, n, 1e-5f, NULL, ob3.as<stc_bf16>(), &g_err)))
            continue;
        std::vector<uint32_t> f1((size_t)(T - 1) * n), f2(f1.size());
        std::vector<uint16_t> b1(f1.size()), b2(f1.size()), b3(f1.size());
        std::vector<float> t1(x.size()), t2(x.size());
        std::vector<uint16_t> u1(x.size()), u2(x.size()), u3(x.size());
        if (!download(t1, of1) || !download(t2, of2) || !download(u1, ob1) || !download(u2, ob2) || !download(u3, ob3))
            continue;
        for (size_t i = 0; i < f1.size(); i++) f1[i] = f2u(t1[i]), f2[i] = f2u(t2[i]), b1[i] = u1[i], b2[i] = u2[i], b3[i] = u3[i];
        char name[128];
        snprintf(name, sizeof name, "rmsnorm n=%d: 2,048 rows vs 2,049, fp32", n);
        check_exact(name, f2, f1, false);
        snprintf(name, sizeof name, "rmsnorm n=%d: 2,048 rows vs 2,049, bf16", n);
        check_exact(name, b2, b1, true);
        snprintf(name, sizeof name, "rmsnorm n=%d: bf16 out alone", n);
        check_exact(name, b3, b1, true);
    }
}

static void test_rope(void) {
    struct { int T, H, Hk, D, p0; float theta; } cases[] = {
        {1, 9, 3, 64, 0, 10000.0f},    {1, 9, 3, 64, 65535, 100000.0f}, {37, 9, 3, 64, 1000, 10000.0f},
        {130, 8, 2, 128, 5, 500000.0f}, {5, 4, 4, 2, 3, 10000.0f},      {64, 9, 3, 64, 1 << 20, 10000.0f},
    };
    for (auto &c : cases) {
        std::vector<float> q = rand_f32((size_t)c.T * c.H * c.D, 1.0), k = rand_f32((size_t)c.T * c.Hk * c.D, 1.0);
        std::vector<float> v = rand_f32((size_t)c.T * c.Hk * c.D, 3.0);
        std::vector<double> rq, rk;
        ref_rope(rq, q, c.T, c.H, c.D, c.p0, c.theta);
        ref_rope(rk, k, c.T, c.Hk, c.D, c.p0, c.theta);
        dbuf dq(q.size() * 4), dk(k.size() * 4), bq(q.size() * 2), bk(k.size() * 2), dv(v.size() * 4), bv(v.size() * 2);
        if (!dq.ok() || !dk.ok() || !bq.ok() || !bk.ok() || !dv.ok() || !bv.ok() || !upload(dq, q) || !upload(dk, k) ||
            !upload(dv, v) || !bq.poison() || !bk.poison() || !bv.poison())
            continue;
        char name[160];
        snprintf(name, sizeof name, "rope T=%d H=%d Hk=%d D=%d p0=%d theta=%g", c.T, c.H, c.Hk, c.D, c.p0,
                 (double)c.theta);
        if (!api_ok(stc_rope(g_ctx, dq.as<float>(), dk.as<float>(), c.T, c.H, c.Hk, c.D, c.p0, c.theta,
                             bq.as<stc_bf16>(), bk.as<stc_bf16>(), dv.as<float>(), bv.as<stc_bf16>(), &g_err),
                    name))
            continue;
        std::vector<float> gq(q.size()), gk(k.size());
        std::vector<uint16_t> gbq(q.size()), gbk(k.size());
        if (!download(gq, dq) || !download(gk, dk) || !download(gbq, bq) || !download(gbk, bk)) continue;
        std::string base = name;
        check_rel((base + " q").c_str(), to_double(gq), rq, 1e-4);
        check_rel((base + " k").c_str(), to_double(gk), rk, 1e-4);
        check_rel((base + " q bf16 copy").c_str(), bf_to_double(gbq), rq, 1e-2);
        check_rel((base + " k bf16 copy").c_str(), bf_to_double(gbk), rk, 1e-2);
        /* v's copy (not rotated): each element rounded to nearest even, bit for bit */
        std::vector<uint16_t> gbv(v.size()), rbv(v.size());
        if (!download(gbv, bv)) continue;
        for (size_t i = 0; i < v.size(); i++) rbv[i] = f2bf(v[i]);
        check_exact((base + " v bf16 copy").c_str(), gbv, rbv, true);
        /* k alone (q NULL, no v): the same k */
        if (!upload(dk, k) || !bk.poison()) continue;
        if (!api_ok(stc_rope(g_ctx, NULL, dk.as<float>(), c.T, c.H, c.Hk, c.D, c.p0, c.theta, NULL, bk.as<stc_bf16>(),
                             NULL, NULL, &g_err),
                    (base + " k alone").c_str()))
            continue;
        std::vector<float> gk2(k.size());
        std::vector<uint16_t> gbk2(k.size());
        if (!download(gk2, dk) || !download(gbk2, bk)) continue;
        std::vector<uint32_t> u1(k.size()), u2(k.size());
        for (size_t i = 0; i < k.size(); i++) u1[i] = f2u(gk[i]), u2[i] = f2u(gk2[i]);
        check_exact((base + " k alone, as with q").c_str(), u2, u1, false);
        check_exact((base + " k alone, bf16 copy as with q").c_str(), gbk2, gbk, true);
        /* q alone (k NULL), then v's copy alone (q = k = NULL) */
        if (!upload(dq, q) || !bq.poison() || !bv.poison()) continue;
        if (!api_ok(stc_rope(g_ctx, dq.as<float>(), NULL, c.T, c.H, c.Hk, c.D, c.p0, c.theta, bq.as<stc_bf16>(), NULL,
                             NULL, NULL, &g_err),
                    (base + " q alone").c_str()) ||
            !api_ok(stc_rope(g_ctx, NULL, NULL, c.T, c.H, c.Hk, c.D, c.p0, c.theta, NULL, NULL, dv.as<float>(),
                             bv.as<stc_bf16>(), &g_err),
                    (base + " v alone").c_str()))
            continue;
        std::vector<float> gq2(q.size());
        std::vector<uint16_t> gbq2(q.size()), gbv2(v.size());
        if (!download(gq2, dq) || !download(gbq2, bq) || !download(gbv2, bv)) continue;
        std::vector<uint32_t> w1(q.size()), w2(q.size());
        for (size_t i = 0; i < q.size(); i++) w1[i] = f2u(gq[i]), w2[i] = f2u(gq2[i]);
        check_exact((base + " q alone, as with k").c_str(), w2, w1, false);
        check_exact((base + " q alone, bf16 copy as with k").c_str(), gbq2, gbq, true);
        check_exact((base + " v copy alone").c_str(), gbv2, rbv, true);
    }
}

/* stc_rope_at_ld: q and k in the rows of one fused matrix ([T][ld]: q | k | the rest, then padding)
 * rotated as stc_rope_at rotates packed q and k, bit for bit; the rest of each row untouched (row strides
 * of 2 and of 0 mod 4 floats: padding 6 and 8). */
static void test_rope_ld(void) {
    struct { int T, H, Hk, D, p0, pad; } cases[] = {{37, 9, 3, 64, 1000, 6}, {130, 8, 2, 128, 5, 6}, {64, 9, 3, 64, 0, 6},
                                                 {37, 9, 3, 64, 1000, 8}, {130, 8, 2, 128, 5, 8}};
    for (auto &c : cases) {
        const size_t HD = (size_t)c.H * c.D, KD = (size_t)c.Hk * c.D;
        const int64_t ld = (int64_t)(HD + 2 * KD + HD + c.pad);
        std::vector<float> fused = rand_f32((size_t)c.T * ld, 1.0), q(c.T * HD), k(c.T * KD);
        for (int t = 0; t < c.T; t++) {
            memcpy(q.data() + t * HD, fused.data() + t * ld, HD * 4);
            memcpy(k.data() + t * KD, fused.data() + t * ld + HD, KD * 4);
        }
        dbuf df(fused.size() * 4), dq(q.size() * 4), dk(k.size() * 4), dpos(4);
        if (!df.ok() || !dq.ok() || !dk.ok() || !dpos.ok() || !upload(df, fused) || !upload(dq, q) || !upload(dk, k) ||
            !dpos.put(&c.p0, 4))
            continue;
        char name[128];
        snprintf(name, sizeof name, "rope_at_ld T=%d H=%d Hk=%d D=%d p0=%d ld=%lld", c.T, c.H, c.Hk, c.D, c.p0,
                 (long long)ld);
        dbuf dkvh(2 * (size_t)c.T * KD * 2);   /* the half copies of k (rotated) and v: [2][T][Hk·D] */
        if (!dkvh.ok() || !dkvh.poison()) continue;
        if (!api_ok(stc_rope_at_ld(g_ctx, df.as<float>(), df.as<float>() + HD, ld, c.T, c.H, c.Hk, c.D,
                                   dpos.as<int>(), 10000.0f, df.as<float>() + HD + KD, dkvh.as<stc_f16>(),
                                   dkvh.as<stc_f16>() + (size_t)c.T * KD, &g_err), name) ||
            !api_ok(stc_rope_at(g_ctx, dq.as<float>(), dk.as<float>(), c.T, c.H, c.Hk, c.D, dpos.as<int>(), 10000.0f,
                                NULL, NULL, &g_err), name))
            continue;
        std::vector<float> gf(fused.size()), gq(q.size()), gk(k.size());
        if (!download(gf, df) || !download(gq, dq) || !download(gk, dk)) continue;
        std::vector<uint32_t> got, want;
        for (int t = 0; t < c.T; t++)
            for (int64_t e = 0; e < ld; e++) {
                got.push_back(f2u(gf[t * ld + e]));
                const float w = e < (int64_t)HD ? gq[t * HD + e] : e < (int64_t)(HD + KD) ? gk[t * KD + e - HD]
                                                                                         : fused[t * ld + e];
                want.push_back(f2u(w));
            }
        check_exact(name, got, want, false);
        /* the half copies: the rotated k and the (unrotated) v of the fused rows, each rounded to half */
        std::vector<uint16_t> gh(2 * (size_t)c.T * KD), wh(gh.size());
        if (!download(gh, dkvh)) continue;
        for (int t = 0; t < c.T; t++)
            for (size_t e = 0; e < KD; e++) {
                wh[t * KD + e] = f2h(gk[t * KD + e]);
                wh[(c.T + t) * KD + e] = f2h(fused[t * ld + HD + KD + e]);
            }
        std::vector<uint32_t> g32(gh.begin(), gh.end()), w32(wh.begin(), wh.end());
        check_exact((std::string(name) + ", half copies of k and v").c_str(), g32, w32, false);
    }
    still_err e{};
    dbuf d(64 * 4), dpos(4), dh(64 * 2);
    int rc = stc_rope_at_ld(g_ctx, d.as<float>(), d.as<float>() + 8, 9, 1, 2, 1, 4, dpos.as<int>(), 1e4f, NULL, NULL,
                            NULL, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "row stride 9"), "rope_at_ld: an odd row stride refused: %s", e.msg);
    rc = stc_rope_at_ld(g_ctx, d.as<float>(), d.as<float>() + 8, 6, 1, 2, 1, 4, dpos.as<int>(), 1e4f, NULL, NULL,
                        NULL, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "row stride 6"), "rope_at_ld: a stride narrower than q's rows refused: %s",
           e.msg);
    rc = stc_rope_at_ld(g_ctx, d.as<float>(), d.as<float>() + 8, 12, 1, 2, 1, 4, dpos.as<int>(), 1e4f,
                        d.as<float>() + 12, dh.as<stc_f16>(), NULL, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "go together"), "rope_at_ld: v without its half copy refused: %s", e.msg);
}

/* ---- decode-step matrix-vector products (stc_gemv, stc_gemv_swiglu, stc_gemv_qkv) ---------------- */

/* x̂ (RMSNorm(x)·w as ref_rmsnorm, or x), then W·x̂ in double from the bf16 weights. */
static std::vector<double> ref_gemv(const std::vector<float> &x, const std::vector<float> *norm_w, int n_in,
                                    const std::vector<uint16_t> &W, int n_out) {
    const std::vector<float> xn = norm_w ? ref_rmsnorm(x, *norm_w, 1, n_in, 1e-5f) : x;
    std::vector<double> y(n_out);
    for (int r = 0; r < n_out; r++) {
        double s = 0;
        for (int i = 0; i < n_in; i++) s += (double)bf2f(W[(size_t)r * n_in + i]) * xn[i];
        y[r] = s;
    }
    return y;
}

static void test_gemv(void) {
    const int shapes[][2] = {{576, 576}, {576, 1536}, {1536, 576}, {64, 7}, {8, 1}, {576, 49152}, {4096, 333},
                             {12288, 65} /* the largest input: more than 48 KB of shared memory */};
    for (auto &sh : shapes) {
        const int n_in = sh[0], n_out = sh[1];
        std::vector<float> x = rand_f32(n_in, 2.0), w = rand_f32(n_in, 1.0), y0 = rand_f32(n_out, 1.0);
        std::vector<uint16_t> W = rand_bf16((size_t)n_out * n_in, 0.05);
        dbuf dx(x.size() * 4), dw(w.size() * 4), dW(W.size() * 2), dy(y0.size() * 4);
        if (!dx.ok() || !dw.ok() || !dW.ok() || !dy.ok() || !upload(dx, x) || !upload(dw, w) || !upload(dW, W)) continue;
        for (int variant = 0; variant < 2; variant++) {   /* 0: normed input, y = Wx̂; 1: plain input, y += Wx */
            const bool norm = variant == 0;
            std::vector<double> ref = ref_gemv(x, norm ? &w : NULL, n_in, W, n_out);
            if (!norm)
                for (int r = 0; r < n_out; r++) ref[r] += y0[r];
            if (!(norm ? dy.poison() : upload(dy, y0))) continue;
            char name[128];
            snprintf(name, sizeof name, "gemv %d -> %d, %s", n_in, n_out, norm ? "RMSNorm input" : "plain input, beta 1");
            if (!api_ok(stc_gemv(g_ctx, dx.as<float>(), norm ? dw.as<float>() : NULL, 1e-5f, n_in, dW.as<stc_bf16>(),
                                 n_out, dy.as<float>(), norm ? 0.0f : 1.0f, &g_err),
                        name))
                continue;
            std::vector<float> got(n_out);
            if (download(got, dy)) check_rel(name, to_double(got), ref, 1e-4);
        }
    }
    /* SwiGLU: gate and up stacked */
    const int sw[][2] = {{576, 1536}, {64, 5}, {1536, 576}};
    for (auto &sh : sw) {
        const int n_in = sh[0], ff = sh[1];
        std::vector<float> x = rand_f32(n_in, 2.0), w = rand_f32(n_in, 1.0);
        std::vector<uint16_t> W = rand_bf16((size_t)2 * ff * n_in, 0.05);
        std::vector<double> gu = ref_gemv(x, &w, n_in, W, 2 * ff), ref(ff);
        for (int j = 0; j < ff; j++) ref[j] = gu[j] / (1.0 + exp(-gu[j])) * gu[ff + j];
        dbuf dx(x.size() * 4), dw(w.size() * 4), dW(W.size() * 2), dh((size_t)ff * 4);
        if (!dx.ok() || !dw.ok() || !dW.ok() || !dh.ok() || !upload(dx, x) || !upload(dw, w) || !upload(dW, W) ||
            !dh.poison())
            continue;
        char name[128];
        snprintf(name, sizeof name, "gemv_swiglu %d -> %d", n_in, ff);
        if (!api_ok(stc_gemv_swiglu(g_ctx, dx.as<float>(), dw.as<float>(), 1e-5f, n_in, dW.as<stc_bf16>(), ff,
                                    dh.as<float>(), &g_err),
                    name))
            continue;
        std::vector<float> got(ff);
        if (download(got, dh)) check_rel(name, to_double(got), ref, 1e-4);
    }
    /* q | k | v | extra rows with RoPE and bf16 copies, position from the host or the device */
    struct { int H, Hk, D, extra, p0, dev_pos; float theta; } qc[] = {
        {9, 3, 64, 576, 1000, 0, 100000.0f}, {9, 3, 64, 0, 65535, 1, 100000.0f}, {8, 2, 128, 0, 5, 1, 500000.0f},
        {4, 4, 64, 64, 0, 0, 10000.0f},
    };
    for (auto &c : qc) {
        const int n_in = 576, qd = c.H * c.D, kvd = c.Hk * c.D, n_out = qd + 2 * kvd + c.extra;
        std::vector<float> x = rand_f32(n_in, 2.0), w = rand_f32(n_in, 1.0);
        std::vector<uint16_t> W = rand_bf16((size_t)n_out * n_in, 0.05);
        const std::vector<double> y = ref_gemv(x, &w, n_in, W, n_out);
        /* RoPE of the q and k parts (ref_rope rotates float inputs: round the products to float first, as the
         * GPU holds them) */
        std::vector<float> qf(y.begin(), y.begin() + qd), kf(y.begin() + qd, y.begin() + qd + kvd);
        std::vector<double> rq, rk;
        ref_rope(rq, qf, 1, c.H, c.D, c.p0, c.theta);
        ref_rope(rk, kf, 1, c.Hk, c.D, c.p0, c.theta);
        std::vector<double> ref(y);
        std::copy(rq.begin(), rq.end(), ref.begin());
        std::copy(rk.begin(), rk.end(), ref.begin() + qd);
        dbuf dx(x.size() * 4), dw(w.size() * 4), dW(W.size() * 2), dy((size_t)n_out * 4), bq((size_t)qd * 2),
            bk((size_t)kvd * 2), bv((size_t)kvd * 2), dpos(4);
        const int pos_dev = c.p0 - 7, p0_host = c.dev_pos ? 7 : c.p0;
        if (!dx.ok() || !dw.ok() || !dW.ok() || !dy.ok() || !bq.ok() || !bk.ok() || !bv.ok() || !dpos.ok() ||
            !upload(dx, x) || !upload(dw, w) || !upload(dW, W) || !dy.poison() || !bq.poison() || !bk.poison() ||
            !bv.poison() || !dpos.put(&pos_dev, 4))
            continue;
        stc_gemv_rope r;
        memset(&r, 0, sizeof r);
        r.n_head = c.H, r.n_head_kv = c.Hk, r.head_dim = c.D, r.rotate = 1, r.theta = c.theta, r.p0 = p0_host;
        r.p0_dev = c.dev_pos ? dpos.as<int>() : NULL;
        r.q_bf16 = bq.as<stc_bf16>(), r.k_bf16 = bk.as<stc_bf16>(), r.v_bf16 = bv.as<stc_bf16>();
        char name[160];
        snprintf(name, sizeof name, "gemv_qkv H=%d Hk=%d D=%d +%d rows, position %d (%s)", c.H, c.Hk, c.D, c.extra,
                 c.p0, c.dev_pos ? "device" : "host");
        if (!api_ok(stc_gemv_qkv(g_ctx, dx.as<float>(), dw.as<float>(), 1e-5f, n_in, dW.as<stc_bf16>(), n_out,
                                 dy.as<float>(), &r, &g_err),
                    name))
            continue;
        std::vector<float> got(n_out);
        std::vector<uint16_t> gq(qd), gk(kvd), gv(kvd);
        if (!download(got, dy) || !download(gq, bq) || !download(gk, bk) || !download(gv, bv)) continue;
        check_rel(name, to_double(got), ref, 1e-4);
        /* the copies: exactly the bf16 rounding of the fp32 outputs */
        std::vector<uint16_t> eq(qd), ek(kvd), ev(kvd);
        for (int i = 0; i < qd; i++) eq[i] = f2bf(got[i]);
        for (int i = 0; i < kvd; i++) ek[i] = f2bf(got[qd + i]), ev[i] = f2bf(got[qd + kvd + i]);
        std::string base = name;
        check_exact((base + ": q bf16 copy").c_str(), gq, eq, true);
        check_exact((base + ": k bf16 copy").c_str(), gk, ek, true);
        check_exact((base + ": v bf16 copy").c_str(), gv, ev, true);
    }
    still_err e = {};
    int rc = stc_gemv(g_ctx, (float *)16, NULL, 1e-5f, 100, (stc_bf16 *)16, 4, (float *)16, 0.0f, &e);
    report(rc == STILL_E_ARG, "gemv with 100 inputs (not a multiple of 8) refused: %s", e.msg);
}

static void test_swiglu(void) {
    const int shapes[][3] = {{1, 1536, 1536}, {7, 1536, 3072}, {33, 100, 100}, {2, 5, 9}, {3, 102, 102}, {300, 1536, 3072}};
    for (auto &sh : shapes) {
        const int rows = sh[0], cols = sh[1], ld = sh[2];
        /* gate and up as the two halves of one buffer when ld = 2·cols */
        const bool fused = ld >= 2 * cols;
        std::vector<float> gbuf = rand_f32((size_t)rows * ld, 3.0), ubuf = rand_f32((size_t)rows * ld, 1.0);
        const size_t up_off = fused ? (size_t)cols : 0;
        const std::vector<float> &up_src = fused ? gbuf : ubuf;
        std::vector<double> ref((size_t)rows * cols);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                const double g = gbuf[(size_t)r * ld + c], u = up_src[(size_t)r * ld + up_off + c];
                ref[(size_t)r * cols + c] = g / (1.0 + exp(-g)) * u;
            }
        dbuf dg(gbuf.size() * 4), du(ubuf.size() * 4), ob(ref.size() * 2), of(ref.size() * 4);
        if (!dg.ok() || !du.ok() || !ob.ok() || !of.ok() || !upload(dg, gbuf) || !upload(du, ubuf) || !ob.poison() ||
            !of.poison())
            continue;
        const float *gp = dg.as<float>(), *upp = fused ? dg.as<float>() + cols : du.as<float>();
        char name[128];
        snprintf(name, sizeof name, "swiglu %d x %d ld %d%s", rows, cols, ld, fused ? " (fused gate|up)" : "");
        if (!api_ok(stc_swiglu(g_ctx, gp, upp, rows, cols, ld, ob.as<stc_bf16>(), of.as<float>(), &g_err), name))
            continue;
        std::vector<float> gf(ref.size());
        std::vector<uint16_t> gb(ref.size());
        if (!download(gf, of) || !download(gb, ob)) continue;
        std::string base = name;
        check_rel((base + " fp32").c_str(), to_double(gf), ref, 1e-4);
        check_rel((base + " bf16").c_str(), bf_to_double(gb), ref, 1e-2);
        /* bf16 out alone (the model's call): the same bits */
        {
            dbuf ob1(ref.size() * 2);
            std::vector<uint16_t> g1(ref.size());
            if (!ob1.ok() || !ob1.poison() ||
                !api_ok(stc_swiglu(g_ctx, gp, upp, rows, cols, ld, ob1.as<stc_bf16>(), NULL, &g_err),
                        (base + " bf16 out alone").c_str()) ||
                !download(g1, ob1))
                continue;
            check_exact((base + " bf16 out alone").c_str(), g1, gb, true);
        }
        /* the same values one float further into a buffer (gate no longer 16-byte aligned: the scalar
         * kernel where the vector one ran above) give the same bits */
        if (!fused && cols % 4 == 0) {
            std::vector<float> gsh(gbuf.size() + 1, 0.0f);
            std::copy(gbuf.begin(), gbuf.end(), gsh.begin() + 1);
            dbuf dgs(gsh.size() * 4), of1(ref.size() * 4);
            std::vector<float> g1(ref.size());
            if (!dgs.ok() || !of1.ok() || !upload(dgs, gsh) || !of1.poison() ||
                !api_ok(stc_swiglu(g_ctx, dgs.as<float>() + 1, upp, rows, cols, ld, NULL, of1.as<float>(), &g_err),
                        (base + " misaligned gate").c_str()) ||
                !download(g1, of1))
                continue;
            std::vector<uint32_t> w1(ref.size()), w2(ref.size());
            for (size_t i = 0; i < ref.size(); i++) w1[i] = f2u(gf[i]), w2[i] = f2u(g1[i]);
            check_exact((base + " misaligned gate (scalar kernel) vs aligned, fp32").c_str(), w2, w1, false);
        }
        /* stc_swiglu_bf16: the same from bf16 gate and up, against the double reference of the rounded inputs */
        std::vector<uint16_t> gh(gbuf.size()), uh(ubuf.size());
        for (size_t i = 0; i < gbuf.size(); i++) gh[i] = f2bf(gbuf[i]);
        for (size_t i = 0; i < ubuf.size(); i++) uh[i] = f2bf(ubuf[i]);
        const std::vector<uint16_t> &uh_src = fused ? gh : uh;
        std::vector<double> ref_h(ref.size());
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                const double g = bf2f(gh[(size_t)r * ld + c]), u = bf2f(uh_src[(size_t)r * ld + up_off + c]);
                ref_h[(size_t)r * cols + c] = g / (1.0 + exp(-g)) * u;
            }
        dbuf hg(gh.size() * 2), hu(uh.size() * 2);
        if (!hg.ok() || !hu.ok() || !upload(hg, gh) || !upload(hu, uh) || !ob.poison()) continue;
        const stc_bf16 *hgp = hg.as<stc_bf16>(), *hup = fused ? hg.as<stc_bf16>() + cols : hu.as<stc_bf16>();
        if (!api_ok(stc_swiglu_bf16(g_ctx, hgp, hup, rows, cols, ld, ob.as<stc_bf16>(), &g_err), (base + " bf16 in").c_str()))
            continue;
        if (!download(gb, ob)) continue;
        check_rel((base + " bf16 in, bf16 out").c_str(), bf_to_double(gb), ref_h, 1e-2);
    }
}

static void test_add_convert(void) {
    for (int64_t n : {(int64_t)1, (int64_t)1000, (int64_t)576 * 129 + 3}) {
        std::vector<float> x = rand_f32((size_t)n, 1.0), y = rand_f32((size_t)n, 1.0);
        std::vector<uint32_t> want((size_t)n), got((size_t)n);
        for (int64_t i = 0; i < n; i++) want[(size_t)i] = f2u(x[(size_t)i] + y[(size_t)i]);
        dbuf dx(n * 4), dy(n * 4);
        if (!dx.ok() || !dy.ok() || !upload(dx, x) || !upload(dy, y)) continue;
        char name[96];
        snprintf(name, sizeof name, "add n=%lld", (long long)n);
        if (selected("add") && api_ok(stc_add(g_ctx, dx.as<float>(), dy.as<float>(), n, &g_err), name) &&
            download(got, dx))
            check_exact(name, got, want, false);
    }
    if (!selected("convert")) return;
    /* fp32 -> bf16: ties to even, specials, subnormals, overflow to inf */
    std::vector<float> src = {0.0f, -0.0f, 1.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -1.0f - 0x1p-8f,
                              3.4028235e38f, -3.4028235e38f, 1e-40f, -1e-45f, INFINITY, -INFINITY, NAN,
                              1.00390625f, 65504.0f, 0x1.fffffep-127f};
    for (int i = 0; i < 5000; i++) src.push_back((float)(g_rng.normal() * pow(10.0, g_rng.below(20) - 10)));
    std::vector<uint16_t> want(src.size()), got(src.size());
    for (size_t i = 0; i < src.size(); i++) want[i] = f2bf(src[i]);
    dbuf ds(src.size() * 4), dd(src.size() * 2);
    if (!ds.ok() || !dd.ok() || !upload(ds, src) || !dd.poison()) return;
    if (API(stc_f32_to_bf16(g_ctx, ds.as<float>(), dd.as<stc_bf16>(), (int64_t)src.size(), &g_err)) &&
        download(got, dd))
        check_exact("f32_to_bf16 (ties to even, specials, subnormals)", got, want, true);
}

static void test_argmax(void) {
    for (int n : {49152, 1000, 1}) {
        const int rows = 6;
        std::vector<float> x = rand_f32((size_t)rows * n, 5.0);
        std::vector<int32_t> want(rows), got(rows);
        /* row 1: a tie (lowest index wins); row 2: NaNs, one at 0; row 3: all -inf;
         * row 4: all NaN; row 5: the max at the last element */
        if (n > 10) {
            float *r1 = &x[(size_t)n], *r5 = &x[(size_t)5 * n];
            r1[n / 3] = 100.0f, r1[n / 2] = 100.0f;
            float *r2 = &x[(size_t)2 * n];
            r2[0] = NAN, r2[7] = NAN, r2[n - 1] = NAN;
            r5[n - 1] = 1e30f;
        }
        for (int i = 0; i < n; i++) x[(size_t)3 * n + i] = -INFINITY, x[(size_t)4 * n + i] = NAN;
        for (int r = 0; r < rows; r++) {
            int best = -1;
            for (int i = 0; i < n; i++) {
                float v = x[(size_t)r * n + i];
                if (isnan(v)) v = -INFINITY;
                float bv = best < 0 ? 0 : x[(size_t)r * n + best];
                if (best >= 0 && isnan(bv)) bv = -INFINITY;
                if (best < 0 || v > bv) best = i;
            }
            want[r] = best;
        }
        dbuf dx(x.size() * 4), dout(rows * 4);
        if (!dx.ok() || !dout.ok() || !upload(dx, x) || !dout.poison()) continue;
        char name[96];
        snprintf(name, sizeof name, "argmax %d rows of %d (ties, NaN, all -inf, all NaN)", rows, n);
        if (!api_ok(stc_argmax(g_ctx, dx.as<float>(), rows, n, dout.as<int32_t>(), &g_err), name)) continue;
        if (!download(got, dout)) continue;
        std::vector<uint32_t> g32(got.begin(), got.end()), w32(want.begin(), want.end());
        check_exact(name, g32, w32, false);
    }
}

struct attn_case {
    int T, p0, H, Hk, D, splits;   /* splits 0: automatic */
    int window = 0;                /* 0: causal softmax; > 0: swa (stc_attn_softmax_window) */
};

static void run_attn_case(const attn_case &c, bool bf16_out) {
    const int L = c.p0 + c.T, pad = 70;   /* cache rows past L stay NaN: never to be read */
    std::vector<uint16_t> q = rand_bf16((size_t)c.T * c.H * c.D, 2.0);
    std::vector<uint16_t> k = rand_bf16((size_t)(L + pad) * c.Hk * c.D, 1.0);
    std::vector<uint16_t> v = rand_bf16(k.size(), 1.0);
    for (size_t i = (size_t)L * c.Hk * c.D; i < k.size(); i++) k[i] = v[i] = 0xFFFF;
    /* swa: rows before the first query's window are NaN too (never to be read) */
    const int lo = c.window > 0 && c.p0 - c.window + 1 > 0 ? c.p0 - c.window + 1 : 0;
    for (size_t i = 0; i < (size_t)lo * c.Hk * c.D; i++) k[i] = v[i] = 0xFFFF;
    const std::vector<double> ref = ref_attention(q, k, v, c.T, c.p0, c.H, c.Hk, c.D, c.window);
    const int p0v = c.p0 - lo;   /* the kernel's view of the cache starts at row lo */
    const stc_attn::plan p = stc_attn::make_plan(c.T, p0v, c.H, c.Hk, c.D, stc_ctx_sm_count(g_ctx), c.splits);
    char name[192];
    snprintf(name, sizeof name, "attn T=%d p0=%d H=%d Hk=%d D=%d%s%.0d %s out (rows/block %d, splits %d%s)", c.T, c.p0,
             c.H, c.Hk, c.D, c.window ? " window " : "", c.window, bf16_out ? "bf16" : "fp32", p.block_m, p.n_splits,
             c.splits ? " forced" : "");
    dbuf dq(q.size() * 2), dk(k.size() * 2), dv(v.size() * 2), dout(ref.size() * (bf16_out ? 2 : 4));
    if (!dq.ok() || !dk.ok() || !dv.ok() || !dout.ok() || !upload(dq, q) || !upload(dk, k) || !upload(dv, v) ||
        !dout.poison())
        return;
    const int rc =
        c.window ? stc_attn_softmax_window(g_ctx, dq.as<stc_bf16>(), dk.as<stc_bf16>(), dv.as<stc_bf16>(), c.T, c.p0, c.H,
                                           c.Hk, c.D, c.window, bf16_out ? NULL : dout.as<float>(),
                                           bf16_out ? dout.as<stc_bf16>() : NULL, c.splits, &g_err)
                 : stc_attn_softmax_splits(g_ctx, dq.as<stc_bf16>(), dk.as<stc_bf16>(), dv.as<stc_bf16>(), c.T, c.p0,
                                           c.H, c.Hk, c.D, bf16_out ? NULL : dout.as<float>(),
                                           bf16_out ? dout.as<stc_bf16>() : NULL, c.splits, &g_err);
    if (!api_ok(rc, name)) return;
    if (bf16_out) {
        std::vector<uint16_t> got(ref.size());
        if (download(got, dout)) check_rel(name, bf_to_double(got), ref, 1e-2);
    } else {
        std::vector<float> got(ref.size());
        if (download(got, dout)) check_rel(name, to_double(got), ref, 1e-2);
    }
}

static void test_attention(void) {
    const attn_case cases[] = {
        /* decode steps (T = 1), automatic split-K */
        {1, 0, 9, 3, 64, 0},     {1, 1, 9, 3, 64, 0},    {1, 63, 9, 3, 64, 0},   {1, 64, 9, 3, 64, 0},
        {1, 1000, 9, 3, 64, 0},  {1, 4095, 9, 3, 64, 0}, {1, 3000, 8, 1, 64, 0}, {1, 777, 8, 2, 128, 0},
        {1, 1000, 9, 3, 64, 1},  /* one split: the direct path */
        /* prefill chunks, T not a multiple of the tile, p0 > 0 */
        {5, 100, 9, 3, 64, 0},   {37, 0, 9, 3, 64, 0},   {64, 0, 9, 3, 64, 0},   {200, 0, 9, 3, 64, 0},
        {129, 300, 9, 3, 64, 0}, {333, 1500, 9, 3, 64, 0}, {1000, 0, 9, 3, 64, 0},
        {100, 50, 4, 4, 64, 0},  {70, 20, 8, 1, 64, 0},  {150, 100, 8, 2, 128, 0}, {300, 0, 4, 4, 128, 0},
        /* forced splits (the combine path for prefill shapes) */
        {200, 0, 9, 3, 64, 3},   {129, 300, 9, 3, 64, 7}, {37, 2000, 9, 3, 64, 5}, {65, 10, 8, 2, 128, 2},
        /* 128-row blocks (chosen when they alone fill the GPU) */
        {1900, 37, 9, 3, 64, 0}, {600, 0, 32, 32, 64, 0}, {600, 0, 32, 32, 64, 2},
        /* swa windows: decode, prefill from 0 and from p0 > window, windows
         * inside one tile, across tiles, larger than the context; splits */
        {1, 5000, 9, 3, 64, 0, 896}, {1, 300, 9, 3, 64, 0, 896},  {1, 2000, 8, 2, 128, 0, 100},
        {1, 2000, 9, 3, 64, 1, 64},  {1000, 0, 9, 3, 64, 0, 100}, {333, 1500, 9, 3, 64, 0, 64},
        {129, 3000, 9, 3, 64, 0, 1}, {200, 700, 8, 2, 128, 0, 257}, {600, 0, 32, 32, 64, 0, 150},
        {129, 300, 9, 3, 64, 7, 200}, {1900, 37, 9, 3, 64, 0, 896},
    };
    for (const attn_case &c : cases) run_attn_case(c, false);
    const attn_case bf16_cases[] = {{1, 2000, 9, 3, 64, 0}, {257, 100, 9, 3, 64, 0}, {600, 5, 32, 32, 64, 0}};
    for (const attn_case &c : bf16_cases) run_attn_case(c, true);
}

/* Bad arguments come back as errors with messages, not crashes. */
static void test_errors(void) {
    still_err e = {};
    int rc = stc_attn_softmax(g_ctx, NULL, NULL, NULL, 1, 0, 9, 3, 96, NULL, NULL, &e);
    report(rc == STILL_E_UNSUPPORTED && strstr(e.msg, "head dim"), "attention with head dim 96 refused: %s", e.msg);
    rc = stc_attn_softmax(g_ctx, NULL, NULL, NULL, 1, 0, 9, 4, 64, NULL, NULL, &e);
    report(rc == STILL_E_ARG, "attention with 9 heads over 4 KV heads refused: %s", e.msg);
    rc = stc_dequant_to_bf16(g_ctx, TT_Q4_0, "", 1, 31, (stc_bf16 *)16, &e);
    report(rc == STILL_E_ARG, "dequant of 31 Q4_0 columns refused: %s", e.msg);
    rc = stc_dequant_to_bf16(g_ctx, 20 /* IQ4_NL */, "", 1, 32, (stc_bf16 *)16, &e);
    report(rc == STILL_E_UNSUPPORTED, "dequant of an unsupported type refused: %s", e.msg);
    void *p = NULL;
    rc = stc_malloc(g_ctx, (size_t)1 << 50, "a 1 PiB test buffer", &p, &e);
    report(rc == STILL_E_NOMEM && strstr(e.msg, "CUDA out of memory allocating") && strstr(e.msg, "1 PiB test"),
           "out of memory reported: %s", e.msg);
    rc = stc_gemm_bf16(g_ctx, 0, 1, 1, NULL, NULL, NULL, 0, &e);
    report(rc == STILL_E_ARG, "gemm of an empty shape refused: %s", e.msg);
    rc = stc_ctx_sync(g_ctx, &e);
    report(rc == 0, "context still usable after the refusals");
}

/* ---- still attention -------------------------------------------------------------------------- */

/* A configuration and a sequence length to test. */
struct still_case {
    const char *name;
    stc_still_config cfg;
    int L;
};

static stc_still_config still_cfg(int H, int Hk, int D, int d, int C, int budget, int lambda, int n_ctx) {
    stc_still_config c;
    memset(&c, 0, sizeof c);
    c.n_head = H, c.n_head_kv = Hk, c.head_dim = D, c.d_model = d, c.chunk = C, c.budget = budget, c.lambda = lambda;
    c.n_ctx = n_ctx, c.routing = 0, c.linear = 1, c.feature_map = 0, c.gate = 1, c.seed = 7;
    return c;
}

/* Random inputs: q, k, v ~ N(0, 1), x bf16 ~ N(0, 1), NP-Map u ~ N(0, 1) and W
 * kaiming-uniform (as the CPU initialises them), a gate that is neither
 * closed nor saturated (Wg ~ N(0, 1/d), bg ~ N(1, 0.5²)). */
static still_seq make_still_seq(const stc_still_config &c, int L) {
    still_seq s;
    s.L = L, s.H = c.n_head, s.Hk = c.n_head_kv, s.D = c.head_dim, s.d = c.d_model > 0 ? c.d_model : 1;
    const size_t H = s.H, D = s.D, HD = H * D;
    s.q = rand_f32((size_t)L * HD, 1.0);
    s.k = rand_f32((size_t)L * s.Hk * D, 1.0);
    s.v = rand_f32((size_t)L * s.Hk * D, 1.0);
    s.x = rand_bf16((size_t)L * s.d, 1.0);
    if (c.lolcats) {   /* hq_W, hk_W [H][D][D] (kaiming-uniform), w [H] */
        s.params.assign(2 * HD * D + H, 0.0f);
        const double b = sqrt(6.0 / (double)D);
        for (size_t i = 0; i < 2 * HD * D; i++) s.params[i] = (float)((2 * g_rng.uniform() - 1) * b);
        for (size_t i = 0; i < H; i++) s.params[2 * HD * D + i] = (float)(-1.0 + g_rng.normal());
        return s;
    }
    s.params.assign(2 * HD + 2 * HD * D + (c.gate ? HD * s.d + HD : 0), 0.0f);
    float *p = s.params.data();
    for (size_t i = 0; i < 2 * HD; i++) p[i] = (float)g_rng.normal();
    const double b = sqrt(6.0 / (double)(D * D));
    for (size_t i = 0; i < 2 * HD * D; i++) p[2 * HD + i] = (float)((2 * g_rng.uniform() - 1) * b);
    if (c.gate) {
        float *wg = p + 2 * HD + 2 * HD * D, *bg = wg + HD * s.d;
        for (size_t i = 0; i < HD * (size_t)s.d; i++) wg[i] = (float)(g_rng.normal() / sqrt((double)s.d));
        for (size_t i = 0; i < HD; i++) bg[i] = (float)(1.0 + 0.5 * g_rng.normal());
    }
    return s;
}

/* Call schedules (token counts summing to L). */
static std::vector<int> sched_one(int L) { return {L}; }
static std::vector<int> sched_singles(int L, int prefill) {
    std::vector<int> r;
    if (prefill > 0) r.push_back(prefill);
    for (int t = prefill; t < L; t++) r.push_back(1);
    return r;
}
/* random pieces of 1 .. 3C tokens: boundaries anywhere, chunks crossed */
static std::vector<int> sched_random(int L, int C) {
    std::vector<int> r;
    for (int t = 0; t < L;) {
        int n = 1 + g_rng.below(g_rng.below(4) ? 3 * C : 3);
        if (n > L - t) n = L - t;
        r.push_back(n);
        t += n;
    }
    return r;
}
static std::string sched_name(const std::vector<int> &s) {
    if (s.size() == 1) return "one call";
    int ones = 0;
    for (int n : s) ones += n == 1;
    char b[96];
    if (ones == (int)s.size()) snprintf(b, sizeof b, "%zu single steps", s.size());
    else if (ones == (int)s.size() - 1 && s[0] > 1) snprintf(b, sizeof b, "prefill %d + %d single steps", s[0], ones);
    else snprintf(b, sizeof b, "%zu random calls", s.size());
    return b;
}

/* Per (token, head) row: rel = ||g - r|| / ||r||; the worst row must be
 * below tol; also reports the whole-output rel error. Non-finite values fail. */
static bool check_rows(const char *name, const std::vector<float> &g, const std::vector<double> &r, int rows, int D,
                       double tol) {
    double worst = 0, num_all = 0, den_all = 0;
    int worst_row = -1;
    size_t bad = 0;
    for (int i = 0; i < rows; i++) {
        double num = 0, den = 0;
        for (int x = 0; x < D; x++) {
            const double gv = g[(size_t)i * D + x], rv = r[(size_t)i * D + x];
            if (!isfinite(gv)) {
                bad++;
                continue;
            }
            num += (gv - rv) * (gv - rv), den += rv * rv;
        }
        num_all += num, den_all += den;
        const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (rel > worst) worst = rel, worst_row = i;
    }
    if (bad) {
        report(false, "%s: %zu values not finite", name, bad);
        return false;
    }
    const bool ok = worst < tol;
    report(ok, "%s: worst row rel err %.2e (row %d) (limit %.0e), whole output %.2e", name, worst, worst_row, tol,
           den_all > 0 ? sqrt(num_all / den_all) : 0.0);
    return ok;
}

/* Sel positions equal (per selection head, in Sel order); the first
 * difference is printed with the reference's ranking values. */
static bool check_selection(const char *name, const std::vector<std::vector<int>> &got, const still_ref_result &ref,
                            int Hs) {
    int diff = 0, total = 0;
    char first[256] = "";
    for (int hs = 0; hs < Hs; hs++) {
        const std::vector<int> &a = got[hs], &b = ref.sel[hs];
        total += (int)b.size();
        if (a.size() != b.size()) {
            diff += (int)std::max(a.size(), b.size());
            if (!first[0]) snprintf(first, sizeof first, "head %d: %zu entries, expected %zu", hs, a.size(), b.size());
            continue;
        }
        for (size_t i = 0; i < a.size(); i++)
            if (a[i] != b[i]) {
                if (!diff++) {
                    const double va = a[i] >= 0 && a[i] < (int)(ref.rank.size() / Hs) ? ref.rank[(size_t)a[i] * Hs + hs] : NAN;
                    snprintf(first, sizeof first, "head %d entry %zu: position %d (score %.17g), expected %d (score %.17g)",
                             hs, i, a[i], va, b[i], ref.rank[(size_t)b[i] * Hs + hs]);
                }
            }
    }
    report(diff == 0, "%s: %d selected tokens, %d differ from the reference%s%s", name, total, diff, diff ? ": " : "",
           first);
    return diff == 0;
}

/* Runs a schedule on the GPU: outputs y [L][H][D] and the Sel positions;
 * with yb, through stc_still_forward_bf16 and its bf16 outputs into *yb
 * (y then holds the scratch). */
/* qkv non-NULL: the inputs from that fused matrix [L][ld] (q | k | v | gate pre-activations) through
 * stc_still_forward_qkv instead of s's packed q, k, v and x; with kv_f16 ([2][L][Hk·D] half: k, then v)
 * the half copies of k and v too; with tail > 0, each call's outputs wanted for its last tail rows only
 * (out_first = T - tail). */
static bool run_still_gpu(stc_still *st, const still_seq &s, const std::vector<int> &sched,
                          bool device_pos, std::vector<float> &y, std::vector<std::vector<int>> &sel,
                          std::vector<uint16_t> *yb = nullptr, const dbuf *qkv = nullptr, int64_t ld = 0,
                          const dbuf *kv_f16 = nullptr, int tail = 0) {
    const size_t HD = (size_t)s.H * s.D, kvd = (size_t)s.Hk * s.D;
    dbuf dq(s.q.size() * 4), dk(s.k.size() * 4), dv(s.v.size() * 4), dx(s.x.size() * 2), dp(s.params.size() * 4 + 4),
        dout((size_t)s.L * HD * 4), dout_b(yb ? (size_t)s.L * HD * 2 : 2);
    if (!dq.ok() || !dk.ok() || !dv.ok() || !dx.ok() || !dp.ok() || !dout.ok() || !dout_b.ok() || !upload(dq, s.q) ||
        !upload(dk, s.k) || !upload(dv, s.v) || !upload(dx, s.x) || !upload(dp, s.params) || !dout.poison() ||
        !dout_b.poison())
        return false;
    if (!API(stc_still_reset(g_ctx, st, &g_err))) return false;
    int p0 = 0;
    for (int T : sched) {
        /* with device positions, decode steps also keep the promise a graph-recording caller makes:
         * the steps where no chunk leaves skip the leave and scan kernels */
        stc_still_set_decode_no_leave(st, device_pos && T == 1 && stc_still_leaves_at(st, p0, 1) == 0);
        const float *q = dq.as<float>() + (size_t)p0 * HD, *k = dk.as<float>() + (size_t)p0 * kvd,
                    *v = dv.as<float>() + (size_t)p0 * kvd;
        const stc_bf16 *x = dx.as<stc_bf16>() + (size_t)p0 * s.d;
        const int at = device_pos ? STC_STILL_P0_DEVICE : p0;
        const int rc = qkv ? stc_still_forward_qkv(g_ctx, st, dp.as<float>(), qkv->as<float>() + (size_t)p0 * ld, ld, T,
                                                   tail > 0 && T > tail ? T - tail : 0, at,
                                                   dout.as<float>() + (size_t)p0 * HD,
                                                   yb ? dout_b.as<stc_bf16>() + (size_t)p0 * HD : nullptr,
                                                   kv_f16 ? kv_f16->as<stc_f16>() + (size_t)p0 * kvd : nullptr,
                                                   kv_f16 ? kv_f16->as<stc_f16>() + (size_t)(s.L + p0) * kvd : nullptr,
                                                   &g_err)
                       : yb ? stc_still_forward_bf16(g_ctx, st, dp.as<float>(), q, k, v, x, T, at,
                                                   dout.as<float>() + (size_t)p0 * HD,
                                                   dout_b.as<stc_bf16>() + (size_t)p0 * HD, &g_err)
                          : stc_still_forward(g_ctx, st, dp.as<float>(), q, k, v, x, T, at,
                                              dout.as<float>() + (size_t)p0 * HD, &g_err);
        if (!api_ok(rc, "stc_still_forward")) return false;
        p0 += T;
    }
    stc_still_set_decode_no_leave(st, 0);
    y.assign((size_t)s.L * HD, 0.0f);
    if (!download(y, dout)) return false;
    if (yb) {
        yb->assign((size_t)s.L * HD, 0);
        if (!download(*yb, dout_b)) return false;
    }
    stc_still_info info;
    stc_still_get_info(st, &info);
    std::vector<int32_t> pos((size_t)info.n_sel_heads * std::max(info.cap, 1));
    std::vector<int> cnt(info.n_sel_heads);
    if (!API(stc_still_selected(g_ctx, st, pos.data(), cnt.data(), &g_err))) return false;
    sel.assign(info.n_sel_heads, std::vector<int>());
    for (int hs = 0; hs < info.n_sel_heads; hs++)
        for (int i = 0; i < cnt[hs]; i++) sel[hs].push_back(pos[(size_t)hs * info.cap + i]);
    int n = -1;
    if (!API(stc_still_n_seen(g_ctx, st, &n, &g_err))) return false;
    if (n != s.L) {
        report(false, "device position %d after %d tokens", n, s.L);
        return false;
    }
    return true;
}

static const char *const ROUTING_NAMES[] = {"saliency", "random", "keynorm", "qk", "position", "none"};

static std::string still_label(const still_case &c, const stc_still_info &info) {
    const stc_still_config &f = c.cfg;
    char b[256];
    snprintf(b, sizeof b, "still %s: H=%d Hk=%d D=%d C=%d budget %d (cap %d, lambda %d) %s%s%s%s%s%s L=%d", c.name,
             f.n_head, f.n_head_kv, f.head_dim, f.chunk, f.budget, info.cap, info.lambda, ROUTING_NAMES[f.routing],
             f.per_kv_head ? " per-KV-head" : "", f.linear ? "" : " linear off", f.linear && !f.gate ? " gate off" : "",
             f.gate_den ? " gate_den" : "", f.sel_q8 ? " Sel q8" : "", c.L);
    return b;
}

/* The cases both the GPU test and the CPU emulation run (the GPU test adds
 * the long SmolLM2 ones). */
static std::vector<still_case> still_small_cases(void) {
    std::vector<still_case> v;
    auto add = [&](const char *name, stc_still_config c, int L) { v.push_back({name, c, L}); };
    const stc_still_config base = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096);   /* cap 24: full after 8 chunks */
    add("small", base, 300);
    stc_still_config c = base;
    c.per_kv_head = 1;
    add("small", c, 300);
    for (int r = 1; r <= 5; r++) {
        c = base, c.routing = r;
        add("small", c, 260);
    }
    c = base, c.linear = 0;
    add("small", c, 260);
    c = base, c.gate = 0;
    add("small", c, 260);
    /* the gate on the denominator's linear term too (per channel) */
    c = base, c.gate_den = 1;
    add("gate_den", c, 300);
    c = base, c.gate_den = 1, c.per_kv_head = 1;
    add("gate_den", c, 300);
    c = base, c.budget = 0, c.lambda = 2, c.n_ctx = 300;   /* uncapped */
    add("uncapped", c, 300);
    c = base, c.routing = 3, c.per_kv_head = 1;
    add("small", c, 200);
    add("odd chunk", still_cfg(6, 3, 64, 40, 24, 2 * 24 + 30, 4, 4096), 290);
    add("chunk 128", still_cfg(2, 1, 64, 64, 128, 2 * 128 + 64, 8, 8192), 800);
    add("head dim 128", still_cfg(4, 1, 128, 128, 32, 2 * 32 + 40, 4, 4096), 400);
    c = still_cfg(4, 1, 128, 128, 32, 2 * 32 + 40, 4, 4096), c.gate_den = 1;
    add("head dim 128 gate_den", c, 400);
    add("SmolLM2 shape", still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), 420);
    /* Sel in 8 bits (--sel-cache q8): against the reference with Sel's rows read back from 8 bits */
    c = base, c.sel_q8 = 1;
    add("q8", c, 300);
    c = base, c.sel_q8 = 1, c.per_kv_head = 1, c.gate_den = 1;
    add("q8", c, 300);
    c = base, c.sel_q8 = 1, c.linear = 0;
    add("q8", c, 260);
    c = still_cfg(4, 1, 128, 128, 32, 2 * 32 + 40, 4, 4096), c.sel_q8 = 1;
    add("head dim 128 q8", c, 400);
    c = still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), c.sel_q8 = 1, c.per_kv_head = 1;
    add("SmolLM2 shape q8", c, 420);
    return v;
}

static void run_still_case(const still_case &sc, bool all_schedules) {
    stc_still_info info;
    if (!API(stc_still_resolve(&sc.cfg, &info, &g_err))) return;
    const std::string label = still_label(sc, info);
    const still_seq s = make_still_seq(sc.cfg, sc.L);
    const still_ref_result ref = ref_still(sc.cfg, info, s);
    /* saliency routing: the selection also against the spec's explicit formula (not the closed form f(p) that
     * the engines and ref_still use); one schedule, the whole sequence at once */
    const bool vs_spec = sc.cfg.routing == 0;
    const still_ref_result ref_spec = vs_spec ? ref_still(sc.cfg, info, s, true) : still_ref_result();
    stc_still *st = NULL;
    if (!API(stc_still_create(g_ctx, &sc.cfg, &st, &g_err))) return;
    std::vector<std::vector<int>> scheds = {sched_one(sc.L), sched_random(sc.L, sc.cfg.chunk)};
    if (all_schedules) scheds.push_back(sched_singles(sc.L, 0));
    scheds.push_back(sched_singles(sc.L, 1 + g_rng.below(sc.L - 1)));
    /* the single steps once more through the chunk-parallel kernels */
    const size_t n_decode_on = scheds.size();
    scheds.push_back(sched_singles(sc.L, 0));
    std::vector<float> y0;
    for (size_t i = 0; i < scheds.size(); i++) {
        /* the last schedule with decode kernels takes its positions from the device counter */
        const bool dev = i + 1 == n_decode_on, decode_kernels = i < n_decode_on;
        stc_still_set_decode_kernels(st, decode_kernels);
        bool singles = false;
        for (int T : scheds[i]) singles |= T == 1;
        std::vector<float> y;
        std::vector<std::vector<int>> sel;
        const std::string name = label + ", " + sched_name(scheds[i]) + (dev ? " (device positions)" : "") +
                                 (singles && !decode_kernels ? " (chunk-parallel kernels)" : "");
        if (!run_still_gpu(st, s, scheds[i], dev, y, sel)) continue;
        check_rows(name.c_str(), y, ref.y, s.L * s.H, s.D, 1e-2);
        check_selection((name + ": selection").c_str(), sel, ref, info.n_sel_heads);
        if (vs_spec && i == 0)
            check_selection((name + ": selection against the spec's explicit saliency formula").c_str(), sel, ref_spec,
                            info.n_sel_heads);
        if (i == 1 || i + 1 == n_decode_on) {
            /* the same schedule again with the outputs in bf16 from the kernels that finish them: the
             * fp32 run's outputs rounded to bf16 (each within one bf16 step, to allow for a different
             * summation order between two runs; NaN-poisoned first, so an unwritten element fails) */
            std::vector<float> scratch;
            std::vector<std::vector<int>> sel_b;
            std::vector<uint16_t> yb;
            if (run_still_gpu(st, s, scheds[i], dev, scratch, sel_b, &yb)) {
                size_t same = 0, near = 0;
                for (size_t e = 0; e < y.size(); e++) {
                    const uint16_t want = f2bf(y[e]);
                    same += yb[e] == want;
                    const bool nan = (yb[e] & 0x7f80) == 0x7f80 && (yb[e] & 0x7f);
                    near += !nan && (yb[e] == want || (((yb[e] ^ want) & 0x8000) == 0 &&
                                                       (yb[e] > want ? yb[e] - want : want - yb[e]) == 1));
                }
                report(near == y.size(), "%s: bf16 outputs from the kernels vs the fp32 run rounded: %zu of %zu "
                       "bit-identical, %zu more one bf16 step apart", (name + ", bf16 out").c_str(), same, y.size(),
                       near - same);
            }
        }
        if (i == 0 && sc.cfg.sel_q8) {
            /* not vacuous: the 8-bit store moves the exact reference's outputs by far more than the GPU's
             * rounding, and the GPU must sit next to the 8-bit reference, not the exact one */
            stc_still_config ex = sc.cfg;
            ex.sel_q8 = 0;
            const still_ref_result rx = ref_still(ex, info, s);
            double n8 = 0, nx = 0, d = 0;
            for (size_t e = 0; e < y.size(); e++)
                n8 += (y[e] - ref.y[e]) * (y[e] - ref.y[e]), nx += (y[e] - rx.y[e]) * (y[e] - rx.y[e]), d += rx.y[e] * rx.y[e];
            report(n8 * 4 < nx, "%s: whole output against the 8-bit reference %.2e, against the exact one %.2e (at most half)",
                   name.c_str(), sqrt(n8 / d), sqrt(nx / d));
        }
        if (i == 0) {
            y0 = y;
            continue;
        }
        /* splits against the one-call run. Through the chunk-parallel
         * kernels only the gate GEMM's shape differs (cuBLASLt may sum in
         * another order): 1e-4. Single steps through the decode kernels
         * (attn_still_decode.cu) sum the logits and o in another order; a
         * weight that lands on the other side of a half rounding moves by
         * 2^-11: 2e-3, a fifth of the bar against the exact reference. */
        std::vector<double> a(y0.begin(), y0.end());
        size_t same = 0;
        for (size_t e = 0; e < y.size(); e++) same += f2u(y[e]) == f2u(y0[e]);
        char b[64];
        snprintf(b, sizeof b, " vs one call (%.1f%% bit-identical)", 100.0 * same / y.size());
        check_rows((name + b).c_str(), y, a, s.L * s.H, s.D, singles && decode_kernels ? 2e-3 : 1e-4);
    }
    stc_still_set_decode_kernels(st, 1);
    stc_still_free(st);
}

/* SmolLM2: long enough for Sel to hold many entries; then a small budget
 * that fills (the last chunk partially selected) and caps; per KV head. */
static void test_still_long(void) {
    run_still_case({"SmolLM2", still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), 1500}, false);
    run_still_case({"SmolLM2 small budget", still_cfg(9, 3, 64, 576, 64, 2 * 64 + 40, 6, 8192), 1500}, false);
    stc_still_config c = still_cfg(9, 3, 64, 576, 64, 896, 6, 8192);
    c.per_kv_head = 1;
    run_still_case({"SmolLM2", c, 900}, false);
    c.gate_den = 1;
    run_still_case({"SmolLM2 gate_den", c, 900}, false);
    c = still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), c.per_kv_head = 1, c.sel_q8 = 1;
    run_still_case({"SmolLM2 q8", c, 1500}, false);
}

/* Small shapes with every option, a shared workspace, the refusals. */
/* lolcats on the still kernels (GPU only: the CPU emulation of --cpu-selftest is still's) */
static stc_still_config lolcats_cfg(int H, int Hk, int C, int n_ctx) {
    stc_still_config c = still_cfg(H, Hk, 64, 96, C, 0, 0, n_ctx);
    c.routing = 5, c.gate = 0, c.feature_map = 1, c.feature_dim = 64, c.lolcats = 1;
    return c;
}

/* stc_still_forward_qkv: the same kernels reading q, k, v and the gate's
 * pre-activations from the rows of one fused matrix (a prefill's one GEMM),
 * ld floats apart with a few unused floats at the end of each row (filled
 * with NaN: read by mistake, they would show). Against the packed inputs'
 * run of the same schedule: bit for bit without the gate (the same
 * arithmetic on the same values); with it within 1e-4 (the pre-activations
 * come from one GEMM over all rows here, from a GEMM per call there:
 * cuBLASLt may sum in another order). Selections as the CPU reference's. */
static void run_still_fused_case(const still_case &sc) {
    stc_still_info info;
    if (!API(stc_still_resolve(&sc.cfg, &info, &g_err))) return;
    const std::string label = still_label(sc, info) + ", fused q|k|v rows";
    const still_seq s = make_still_seq(sc.cfg, sc.L);
    const still_ref_result ref = ref_still(sc.cfg, info, s);
    const bool gate = sc.cfg.linear && sc.cfg.gate && !sc.cfg.lolcats;
    const size_t L = s.L, HD = (size_t)s.H * s.D, KD = (size_t)s.Hk * s.D;
    const int64_t ld = (int64_t)(HD + 2 * KD + (gate ? HD : 0) + 8);
    /* the gate's pre-activations as the layer computes them: Wg to bf16, then x·Wgᵀ (bf16 GEMM, fp32 out) */
    std::vector<float> pre(gate ? L * HD : 0);
    if (gate) {
        const size_t at = 2 * HD + 2 * HD * s.D;
        dbuf dwg(HD * s.d * 4), dwgb(HD * s.d * 2), dx(s.x.size() * 2), dpre(pre.size() * 4);
        if (!dwg.ok() || !dwgb.ok() || !dx.ok() || !dpre.ok() ||
            !dwg.put(s.params.data() + at, HD * s.d * 4) || !upload(dx, s.x) ||
            !API(stc_f32_to_bf16(g_ctx, dwg.as<float>(), dwgb.as<stc_bf16>(), (int64_t)(HD * s.d), &g_err)) ||
            !API(stc_gemm_bf16(g_ctx, (int)L, (int)HD, s.d, dx.as<stc_bf16>(), dwgb.as<stc_bf16>(), dpre.as<float>(),
                               0.0f, &g_err)) ||
            !download(pre, dpre))
            return;
    }
    std::vector<float> fused(L * ld, NAN);
    for (size_t t = 0; t < L; t++) {
        float *row = fused.data() + t * ld;
        memcpy(row, s.q.data() + t * HD, HD * 4);
        memcpy(row + HD, s.k.data() + t * KD, KD * 4);
        memcpy(row + HD + KD, s.v.data() + t * KD, KD * 4);
        if (gate) memcpy(row + HD + 2 * KD, pre.data() + t * HD, HD * 4);
    }
    dbuf dqkv(fused.size() * 4);
    if (!dqkv.ok() || !upload(dqkv, fused)) return;
    /* k and v rounded to half as stc_rope_at_ld's copies ([2][L][Hk·D]: k, then v) */
    std::vector<uint16_t> kvh(2 * L * KD);
    for (size_t e = 0; e < L * KD; e++) kvh[e] = f2h(s.k[e]), kvh[L * KD + e] = f2h(s.v[e]);
    kvh.resize(kvh.size() + 64 * KD);   /* still_cuda.h: 64 rows past the end of v's copy */
    dbuf dkvh(kvh.size() * 2);
    if (!dkvh.ok() || !upload(dkvh, kvh)) return;
    stc_still *st = NULL;
    if (!API(stc_still_create(g_ctx, &sc.cfg, &st, &g_err))) return;
    const std::vector<std::vector<int>> scheds = {sched_one(sc.L), sched_random(sc.L, sc.cfg.chunk),
                                                  sched_singles(sc.L, sc.L / 2)};
    for (size_t i = 0; i < scheds.size(); i++) {
        const bool dev = i == 1;
        const std::string name = label + ", " + sched_name(scheds[i]) + (dev ? " (device positions)" : "");
        std::vector<float> y_packed, y;
        std::vector<std::vector<int>> sel_packed, sel;
        if (!run_still_gpu(st, s, scheds[i], dev, y_packed, sel_packed) ||
            !run_still_gpu(st, s, scheds[i], dev, y, sel, nullptr, &dqkv, ld))
            continue;
        check_rows(name.c_str(), y, ref.y, s.L * s.H, s.D, 1e-2);
        check_selection((name + ": selection").c_str(), sel, ref, info.n_sel_heads);
        size_t same = 0;
        for (size_t e = 0; e < y.size(); e++) same += f2u(y[e]) == f2u(y_packed[e]);
        /* with the half copies of k and v: the same values in the tiles, so bit for bit the fused run's */
        std::vector<float> y_h;
        std::vector<std::vector<int>> sel_h;
        if (run_still_gpu(st, s, scheds[i], dev, y_h, sel_h, nullptr, &dqkv, ld, &dkvh)) {
            size_t same_h = 0;
            for (size_t e = 0; e < y.size(); e++) same_h += f2u(y_h[e]) == f2u(y[e]);
            report(same_h == y.size() && sel_h == sel, "%s, k and v half copies: %zu of %zu outputs bit-identical, "
                   "selections %s", name.c_str(), same_h, y.size(), sel_h == sel ? "equal" : "differ");
            /* each call's outputs for its last row only (out_first = T - 1, a model's last layer): that row bit
             * for bit, the same selections (the state still takes every token); in a long call the blocks
             * of earlier rows do not run, so some rows keep the poison */
            std::vector<float> y_t;
            std::vector<std::vector<int>> sel_t;
            if (i != 2 && run_still_gpu(st, s, scheds[i], dev, y_t, sel_t, nullptr, &dqkv, ld, &dkvh, 1)) {
                size_t same_t = 0, n_t = 0, skipped = 0;
                int p = 0;
                for (int T : scheds[i]) {
                    const size_t r = (size_t)(p + T - 1) * HD;
                    for (size_t e = 0; e < HD; e++) same_t += f2u(y_t[r + e]) == f2u(y_h[r + e]);
                    n_t += HD, p += T;
                }
                for (size_t r = 0; r < (size_t)s.L; r++) skipped += std::isnan(y_t[r * HD]);
                const bool long_call = scheds[i].size() == 1 && s.L > 128;
                report(same_t == n_t && sel_t == sel_h && (!long_call || skipped > 0),
                       "%s, outputs of each call's last row only: %zu of %zu bit-identical, selections %s, %zu rows "
                       "not computed", name.c_str(), same_t, n_t, sel_t == sel_h ? "equal" : "differ", skipped);
            }
        }
        if (!gate) {
            report(same == y.size(), "%s: vs packed inputs, %zu of %zu bit-identical", name.c_str(), same, y.size());
        } else {
            char b[80];
            snprintf(b, sizeof b, " vs packed inputs (%.1f%% bit-identical)", 100.0 * same / y.size());
            check_rows((name + b).c_str(), y, std::vector<double>(y_packed.begin(), y_packed.end()), s.L * s.H, s.D,
                       1e-4);
        }
        if (i == 0) {   /* bf16 outputs from the fused rows: the fp32 run's rounded, within one bf16 step */
            std::vector<float> scratch;
            std::vector<uint16_t> yb;
            if (run_still_gpu(st, s, scheds[i], dev, scratch, sel, &yb, &dqkv, ld)) {
                size_t near = 0;
                for (size_t e = 0; e < y.size(); e++) {
                    const uint16_t want = f2bf(y[e]);
                    near += yb[e] == want || (((yb[e] ^ want) & 0x8000) == 0 &&
                                              (yb[e] > want ? yb[e] - want : want - yb[e]) == 1);
                }
                report(near == y.size(), "%s, bf16 out: %zu of %zu within one bf16 step of the fp32 run",
                       name.c_str(), near, y.size());
            }
        }
    }
    /* refusals (otherwise valid calls: parameters, outputs, one token): a stride below the row's width,
     * or not a multiple of 4 */
    dbuf dp(s.params.size() * 4 + 4), dout(HD * 4);
    if (dp.ok() && dout.ok() && upload(dp, s.params) && API(stc_still_reset(g_ctx, st, &g_err))) {
        still_err e{};
        int rc = stc_still_forward_qkv(g_ctx, st, dp.as<float>(), dqkv.as<float>(), ld - 12, 1, 0, 0, dout.as<float>(),
                                       nullptr, nullptr, nullptr, &e);
        report(rc == STILL_E_ARG && strstr(e.msg, "row stride"), "%s: stride below the row refused: %s",
               label.c_str(), e.msg);
        rc = stc_still_forward_qkv(g_ctx, st, dp.as<float>(), dqkv.as<float>(), ld + 2, 1, 0, 0, dout.as<float>(),
                                   nullptr, nullptr, nullptr, &e);
        report(rc == STILL_E_ARG && strstr(e.msg, "row stride"), "%s: stride not a multiple of 4 refused: %s",
               label.c_str(), e.msg);
        rc = stc_still_forward_qkv(g_ctx, st, dp.as<float>(), dqkv.as<float>(), ld, 1, 0, 0, dout.as<float>(), nullptr,
                                   dkvh.as<stc_f16>(), nullptr, &e);
        report(rc == STILL_E_ARG && strstr(e.msg, "half copies"), "%s: k's half copy without v's refused: %s",
               label.c_str(), e.msg);
        rc = stc_still_forward_qkv(g_ctx, st, dp.as<float>(), dqkv.as<float>(), ld, 1, 1, 0, dout.as<float>(), nullptr,
                                   nullptr, nullptr, &e);
        report(rc == STILL_E_ARG && strstr(e.msg, "first output row"), "%s: first output row past the call refused: %s",
               label.c_str(), e.msg);
        rc = stc_still_forward_qkv(g_ctx, st, dp.as<float>(), dqkv.as<float>(), ld, 1, 0, 0, dout.as<float>(), nullptr,
                                   nullptr, nullptr, &e);
        report(rc == STILL_OK, "%s: the same call with the right stride runs", label.c_str());
    }
    stc_still_free(st);
}

/* Two runs of the same sequence: their outputs bit for bit and the same selections, or with tol > 0 each
 * output row within tol of the other's, relative to its norm, and the same selections. */
static void report_two_runs(const std::string &label, const std::vector<float> (&y)[2],
                            const std::vector<std::vector<int>> (&sel)[2], size_t D, double tol) {
    size_t same = 0;
    for (size_t e = 0; e < y[0].size(); e++) same += f2u(y[0][e]) == f2u(y[1][e]);
    if (tol > 0.0) {   /* the same values summed in another order: each row within tol (relative to its norm) */
        double worst = 0.0;
        bool finite = true;
        for (size_t r = 0; r < y[0].size() / D; r++) {
            double num = 0.0, den = 0.0;
            for (size_t e = r * D; e < (r + 1) * D; e++) {
                const double d = (double)y[1][e] - y[0][e];
                num += d * d, den += (double)y[0][e] * y[0][e];
                finite = finite && std::isfinite(y[1][e]);
            }
            worst = std::max(worst, den > 0.0 ? std::sqrt(num / den) : std::sqrt(num));
        }
        report(finite && worst < tol && sel[0] == sel[1],
               "%s: worst row relative difference %.3g (< %.0e), %zu of %zu outputs bit-identical, selections %s",
               label.c_str(), worst, tol, same, y[0].size(), sel[0] == sel[1] ? "equal" : "differ");
        return;
    }
    report(same == y[0].size() && sel[0] == sel[1], "%s: %zu of %zu outputs bit-identical, selections %s", label.c_str(),
           same, y[0].size(), sel[0] == sel[1] ? "equal" : "differ");
}

/* A kernel variant that a user may switch off (env = "0"), chosen when the state is created, against the
 * default: the attention on wgmma against mma.sync (STILL_CUDA_ATTN_WGMMA) and the feature maps' z on wgmma
 * against mma.sync (STILL_CUDA_NPMAP_WGMMA), the same products with fp32 sums in the tensor cores' order, so
 * each output row within tol of the other's, relative to its norm, and the same selections (tol 0: bit for
 * bit). The variants that lost their benchmarks are gone (dev/cuda/README.md). */
static void run_variant_case(const still_case &sc, const char *env, const char *what, bool one_call = false,
                             double tol = 0.0) {
    stc_still_info info;
    if (!API(stc_still_resolve(&sc.cfg, &info, &g_err))) return;
    const std::string label = still_label(sc, info) + ", " + what;
    const still_seq s = make_still_seq(sc.cfg, sc.L);
    std::vector<float> y[2];
    std::vector<std::vector<int>> sel[2];
    /* the same calls for both */
    const std::vector<int> sched = one_call ? sched_one(sc.L) : sched_random(sc.L, sc.cfg.chunk);
    const char *old = getenv(env);
    const std::string saved = old ? old : "";
    bool ok = true;
    for (int variant = 0; variant < 2 && ok; variant++) {
        if (!variant) setenv(env, "0", 1);
        else unsetenv(env);
        stc_still *st = NULL;
        ok = API(stc_still_create(g_ctx, &sc.cfg, &st, &g_err));
        if (old) setenv(env, saved.c_str(), 1);   /* as the caller had it */
        else unsetenv(env);
        if (ok) ok = run_still_gpu(st, s, sched, false, y[variant], sel[variant]);
        stc_still_free(st);
    }
    if (ok) report_two_runs(label, y, sel, (size_t)sc.cfg.head_dim, tol);
}

/* One call of 4,096 tokens or more (its scan on the side stream beside the attention kernel, the feature
 * maps' W split once into an image that the leave and linear kernels copy) against the same tokens in calls
 * of at most 1,000 (the scan in line, every block splitting W itself): the same products, roundings and
 * reductions but for the gate GEMM's summation order, which depends on T, so each output row within 1e-4
 * and the same selections. (These paths were compared within one call, bit for bit, through the removed
 * switches STILL_CUDA_SIDE_SCAN and STILL_CUDA_W_IMAGE.) */
static void run_long_call_case(const still_case &sc) {
    stc_still_info info;
    if (!API(stc_still_resolve(&sc.cfg, &info, &g_err))) return;
    const std::string label = still_label(sc, info) + ", one call (scan beside, W's image) vs calls of 1,000";
    const still_seq s = make_still_seq(sc.cfg, sc.L);
    std::vector<int> pieces;   /* no piece of 1 token: those would take the decode kernels */
    for (int t = 0; t < sc.L; t += 1000) pieces.push_back(std::min(1000, sc.L - t));
    std::vector<float> y[2];
    std::vector<std::vector<int>> sel[2];
    stc_still *st = NULL;
    if (!API(stc_still_create(g_ctx, &sc.cfg, &st, &g_err))) return;
    const bool ok = run_still_gpu(st, s, sched_one(sc.L), false, y[0], sel[0]) &&
                    run_still_gpu(st, s, pieces, false, y[1], sel[1]);
    stc_still_free(st);
    if (ok) report_two_runs(label, y, sel, (size_t)sc.cfg.head_dim, 1e-4);
}

/* 1 when this program's own device code is sm_90a machine code (as the library's, built alike). */
__global__ void sm90a_probe_kernel(int *out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *out = 1;
#else
    *out = 0;
#endif
}

static void test_still_fused(void) {
    stc_still_config c = still_cfg(9, 3, 64, 576, 64, 896, 6, 8192);
    c.per_kv_head = 1;
    run_still_fused_case({"SmolLM2", c, 700});
    stc_still_config small = still_cfg(4, 2, 64, 96, 16, 2 * 16 + 24, 2, 4096);
    run_still_fused_case({"small", small, 300});
    small.gate_den = 1;
    run_still_fused_case({"small gate_den", small, 300});
    small.gate_den = 0, small.gate = 0;
    run_still_fused_case({"small", small, 300});
    run_still_fused_case({"lolcats small", lolcats_cfg(4, 2, 16, 4096), 200});
    run_still_fused_case({"chunk 100", still_cfg(4, 2, 64, 96, 100, 2 * 100 + 40, 4, 4096), 500});
    run_still_fused_case({"head dim 128", still_cfg(4, 2, 128, 256, 64, 2 * 64 + 32, 2, 4096), 300});
    stc_still_config kv = still_cfg(9, 3, 64, 576, 64, 896, 6, 8192);
    kv.per_kv_head = 1;
    /* the attention on wgmma against mma.sync: the same half products, fp32 sums in the tensor cores' order.
     * Where this program's code is sm_90a (so is the library's: the default build on a Hopper GPU), the
     * default state must have the wgmma path. */
    {
        stc_still *st = NULL;
        dbuf dflag(4);
        int sm90a = -1;
        if (dflag.ok()) {
            sm90a_probe_kernel<<<1, 1>>>(dflag.as<int>());
            if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
                cudaMemcpy(&sm90a, dflag.as<int>(), sizeof sm90a, cudaMemcpyDeviceToHost) != cudaSuccess)
                sm90a = -1;
        }
        if (sm90a >= 0 && API(stc_still_create(g_ctx, &kv, &st, &g_err))) {
            stc_still_info info;
            stc_still_get_info(st, &info);
            const char *env = getenv("STILL_CUDA_ATTN_WGMMA");
            const bool want = sm90a == 1 && !(env && !strcmp(env, "0"));
            report(info.attn_wgmma == (want ? 1 : 0), "still SmolLM2: attention on wgmma %s (this program's code %s)",
                   info.attn_wgmma ? "on" : "off", sm90a ? "sm_90a" : "not sm_90a");
        } else {
            report(false, "still SmolLM2: the sm_90a probe or the state did not run");
        }
        stc_still_free(st);
    }
    for (const still_case &wc : {still_case{"SmolLM2", kv, 900}, still_case{"SmolLM2", still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), 700},
                                 still_case{"chunk 100", still_cfg(4, 2, 64, 96, 100, 2 * 100 + 40, 4, 4096), 500},
                                 still_case{"chunk 16", still_cfg(6, 2, 64, 96, 16, 2 * 16 + 24, 2, 4096), 300},
                                 still_case{"lolcats small", lolcats_cfg(4, 2, 16, 4096), 300}})
        run_variant_case(wc, "STILL_CUDA_ATTN_WGMMA", "attention on wgmma vs mma.sync", false, 1e-5);
    run_variant_case({"SmolLM2", kv, 4200}, "STILL_CUDA_ATTN_WGMMA", "one call, attention on wgmma vs mma.sync", true,
                     1e-5);
    /* the feature maps' z = x̃ Wᵀ (linear and leave kernels) on wgmma against mma.sync: the same six products
     * of the three-way splits, fp32 sums in the tensor cores' order (sm_90a code; elsewhere both runs take
     * mma.sync and agree bit for bit) */
    for (const still_case &wc : {still_case{"SmolLM2", kv, 900}, still_case{"SmolLM2", still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), 700},
                                 still_case{"chunk 100", still_cfg(4, 2, 64, 96, 100, 2 * 100 + 40, 4, 4096), 500},
                                 still_case{"chunk 16", still_cfg(6, 2, 64, 96, 16, 2 * 16 + 24, 2, 4096), 300},
                                 still_case{"lolcats small", lolcats_cfg(4, 2, 16, 4096), 300}})
        run_variant_case(wc, "STILL_CUDA_NPMAP_WGMMA", "feature maps' z on wgmma vs mma.sync", false, 1e-5);
    run_variant_case({"SmolLM2", kv, 4200}, "STILL_CUDA_NPMAP_WGMMA", "one call, feature maps' z on wgmma vs mma.sync",
                     true, 1e-5);
    /* the paths of long calls (4,096+ tokens) against shorter calls */
    run_long_call_case({"SmolLM2", still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), 4200});
    run_long_call_case({"SmolLM2", kv, 4300});
    run_long_call_case({"small", still_cfg(4, 2, 64, 96, 16, 2 * 16 + 24, 2, 8192), 5000});
    run_long_call_case({"lolcats small", lolcats_cfg(4, 2, 16, 8192), 4500});
    run_long_call_case({"chunk 100", still_cfg(4, 2, 64, 96, 100, 2 * 100 + 40, 4, 8192), 4400});
    run_long_call_case({"head dim 128", still_cfg(4, 2, 128, 256, 64, 2 * 64 + 32, 2, 8192), 4200});
}

/* Keys as a model's are: a common part per (sequence, KV head) beside the random one (rows [B·T][Hk·64]). */
static void add_key_offset(std::vector<float> &k, int B, int T, int Hk, double scale) {
    for (int b = 0; b < B; b++)
        for (int hk = 0; hk < Hk; hk++) {
            std::vector<float> c(64);
            for (auto &x : c) x = (float)(g_rng.normal() * scale);
            for (int t = 0; t < T; t++)
                for (int x = 0; x < 64; x++) k[(((size_t)b * T + t) * Hk + hk) * 64 + x] += c[(size_t)x];
        }
}

/* The fused training attention (cuda/kinds/softmax/attn_softmax_train.cu) against the definition in double on the host:
 * O = softmax(s Q Kᵀ) V (causal, a window for swa, grouped heads), lse, and the backward's dQ, dK, dV for a random
 * dO; bf16 products, so within 2e-2 relative. Run twice: the same bits (no atomics). */
static void test_flash_train(void) {
    struct fcase {
        int B, T, H, Hk, window;
    };
    const fcase cases[] = {{1, 1, 2, 1, 0}, {2, 300, 9, 3, 0}, {1, 1024, 9, 3, 0}, {2, 200, 4, 4, 64},
                           {3, 129, 6, 2, 100}, {1, 700, 9, 3, 1000}};
    const int D = 64;
    for (const fcase &c : cases) {
        const int B = c.B, T = c.T, H = c.H, Hk = c.Hk, G = H / Hk, W = c.window;
        const size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * Hk * D;
        std::vector<float> q = rand_f32(nq, 1.0), k = rand_f32(nk, 1.0), v = rand_f32(nk, 1.0), dO = rand_f32(nq, 1.0);
        add_key_offset(k, B, T, Hk, 1.0);
        char name[128];
        snprintf(name, sizeof name, "flash_train B=%d T=%d H=%d/%d%s%s", B, T, H, Hk, W ? " window " : "",
                 W ? std::to_string(W).c_str() : "");
        dbuf dq_(nq * 4), dk_(nk * 4), dv_(nk * 4), dout(nq * 4), dlse((size_t)B * H * T * 4), ddo(nq * 4),
            ddel((size_t)B * H * T * 4), gq(nq * 4), gk(nk * 4), gv(nk * 4), dkbar((size_t)B * Hk * D * 4);
        if (!dq_.ok() || !dk_.ok() || !dv_.ok() || !dout.ok() || !dlse.ok() || !ddo.ok() || !ddel.ok() || !gq.ok() ||
            !gk.ok() || !gv.ok() || !dkbar.ok() || !upload(dq_, q) || !upload(dk_, k) || !upload(dv_, v) || !upload(ddo, dO))
            continue;
        std::vector<float> o[2], lse[2], gqv[2], gkv[2], gvv[2];
        bool ok = true;
        for (int run = 0; run < 2 && ok; run++) {
            ok = api_ok(stc_flash_train_fwd(g_ctx, dq_.as<float>(), dk_.as<float>(), dv_.as<float>(), B, T, H, Hk, D, W,
                                            dout.as<float>(), dlse.as<float>(), &g_err), name) &&
                 api_ok(stc_flash_train_bwd(g_ctx, dq_.as<float>(), dk_.as<float>(), dv_.as<float>(), dout.as<float>(),
                                            ddo.as<float>(), dlse.as<float>(), B, T, H, Hk, D, W, ddel.as<float>(),
                                            dkbar.as<float>(), gq.as<float>(), gk.as<float>(), gv.as<float>(), &g_err), name);
            o[run].resize(nq), lse[run].resize((size_t)B * H * T), gqv[run].resize(nq), gkv[run].resize(nk),
                gvv[run].resize(nk);
            ok = ok && download(o[run], dout) && download(lse[run], dlse) && download(gqv[run], gq) &&
                 download(gkv[run], gk) && download(gvv[run], gv);
        }
        if (!ok) continue;
        /* the reference */
        std::vector<double> ro(nq, 0.0), rl((size_t)B * H * T), rq(nq, 0.0), rk(nk, 0.0), rv(nk, 0.0);
        const double sc = 1.0 / sqrt((double)D);
        std::vector<double> p((size_t)T), dp((size_t)T);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++) {
                const int hk = h / G;
                for (int i = 0; i < T; i++) {
                    const float *qi = &q[(((size_t)b * T + i) * H + h) * D];
                    const int j0 = W > 0 && i - W + 1 > 0 ? i - W + 1 : 0;
                    double mx = -INFINITY, sum = 0;
                    for (int j = j0; j <= i; j++) {
                        const float *kj = &k[(((size_t)b * T + j) * Hk + hk) * D];
                        double d = 0;
                        for (int x = 0; x < D; x++) d += (double)qi[x] * kj[x];
                        p[(size_t)j] = d * sc, mx = fmax(mx, d * sc);
                    }
                    for (int j = j0; j <= i; j++) sum += (p[(size_t)j] = exp(p[(size_t)j] - mx));
                    rl[((size_t)b * H + h) * T + i] = mx + log(sum);
                    double *oi = &ro[(((size_t)b * T + i) * H + h) * D];
                    const float *di = &dO[(((size_t)b * T + i) * H + h) * D];
                    double delta = 0;
                    for (int j = j0; j <= i; j++) {
                        p[(size_t)j] /= sum;
                        const float *vj = &v[(((size_t)b * T + j) * Hk + hk) * D];
                        for (int x = 0; x < D; x++) oi[x] += p[(size_t)j] * vj[x];
                    }
                    for (int x = 0; x < D; x++) delta += oi[x] * di[x];
                    for (int j = j0; j <= i; j++) {
                        const float *vj = &v[(((size_t)b * T + j) * Hk + hk) * D], *kj = &k[(((size_t)b * T + j) * Hk + hk) * D];
                        double d = 0;
                        for (int x = 0; x < D; x++) d += (double)di[x] * vj[x];
                        const double ds = p[(size_t)j] * (d - delta);
                        double *gkj = &rk[(((size_t)b * T + j) * Hk + hk) * D], *gvj = &rv[(((size_t)b * T + j) * Hk + hk) * D];
                        double *gqi = &rq[(((size_t)b * T + i) * H + h) * D];
                        for (int x = 0; x < D; x++) {
                            gvj[x] += p[(size_t)j] * di[x];
                            gqi[x] += sc * ds * kj[x];
                            gkj[x] += sc * ds * qi[x];
                        }
                    }
                }
            }
        auto dbl = [](const std::vector<float> &x) { return std::vector<double>(x.begin(), x.end()); };
        check_rel((std::string(name) + ": O").c_str(), dbl(o[0]), ro, 2e-2);
        check_rel((std::string(name) + ": lse").c_str(), dbl(lse[0]), rl, 2e-2);
        check_rel((std::string(name) + ": dQ").c_str(), dbl(gqv[0]), rq, 2e-2);
        check_rel((std::string(name) + ": dK").c_str(), dbl(gkv[0]), rk, 2e-2);
        check_rel((std::string(name) + ": dV").c_str(), dbl(gvv[0]), rv, 2e-2);
        const bool same = memcmp(o[0].data(), o[1].data(), nq * 4) == 0 && memcmp(gqv[0].data(), gqv[1].data(), nq * 4) == 0 &&
                          memcmp(gkv[0].data(), gkv[1].data(), nk * 4) == 0 && memcmp(gvv[0].data(), gvv[1].data(), nk * 4) == 0;
        report(same, "%s: two runs give the same bits", name);
    }
}

/* The fused still training attention (cuda/kinds/still/attn_still_train.cu) against the layer's definition in double on the
 * host (cuda/train/train_lm_still.cu's header: the softmax part E over soft(i, j) = j <= i, c(i) < route[j] with the row's
 * maximum m, the linear part L = φq·φk over lin(i, j) = c(i) >= route[j], y = (E V + g ⊙ L V) / (l + b + 1e-6),
 * gate_den: l + g b), and its gradients for the loss Σ dy ⊙ y, written out by hand; the hand-written gradients are
 * themselves checked against central differences of the double forward on a small case. Random routing with
 * values c(j) + 2 (chunk selection), later chunks (global selection's evictions) and never; feature rows made as the
 * maps make them (two softmaxes). bf16 / half products: within 2e-2 relative. Run twice: the same bits. */
struct still_train_ref {
    int B = 0, T = 0, H = 0, Hk = 0, C = 0, per_kv = 0, linear = 0, gate_den = 0;
    const std::vector<float> *q = nullptr, *k = nullptr, *v = nullptr, *phq = nullptr, *phk = nullptr,
                             *gate = nullptr, *dy = nullptr;
    const std::vector<int> *route = nullptr;
    still_train_ref(int B_, int T_, int H_, int Hk_, int C_, int per_kv_, int linear_, int gate_den_)
        : B(B_), T(T_), H(H_), Hk(Hk_), C(C_), per_kv(per_kv_), linear(linear_), gate_den(gate_den_) {}
    /* outputs */
    std::vector<double> y, dq, dk, dv, dphq, dphk, dpre;
    /* the same sums of absolute terms: the size of what cancels where dQ or dK is zero (a row with one key) */
    std::vector<double> dq_mag, dk_mag;
    double loss = 0;

    void run(bool grads) {
        const int D = 64, F = 128, G = H / Hk, Hs = per_kv ? Hk : H, HD = H * D;
        const size_t nq = (size_t)B * T * HD, nk = (size_t)B * T * Hk * D, nf = (size_t)H * B * T * F;
        y.assign(nq, 0.0), dq.assign(nq, 0.0), dk.assign(nk, 0.0), dv.assign(nk, 0.0), dphq.assign(nf, 0.0),
            dphk.assign(nf, 0.0), dpre.assign(nq, 0.0), dq_mag.assign(nq, 0.0), dk_mag.assign(nk, 0.0);
        loss = 0;
        const double sc = 1.0 / 8.0;
        std::vector<double> s((size_t)T), E((size_t)T), L((size_t)T);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++) {
                const int hk = h / G, hs = per_kv ? hk : h;
                const int *rt = &(*route)[((size_t)b * Hs + hs) * T];
                auto Q = [&](int i) { return &(*q)[((size_t)b * T + i) * HD + (size_t)h * D]; };
                auto K = [&](int j) { return &(*k)[((size_t)b * T + j) * Hk * D + (size_t)hk * D]; };
                auto V = [&](int j) { return &(*v)[((size_t)b * T + j) * Hk * D + (size_t)hk * D]; };
                auto PQ = [&](int i) { return &(*phq)[((size_t)h * B * T + (size_t)b * T + i) * F]; };
                auto PK = [&](int j) { return &(*phk)[((size_t)h * B * T + (size_t)b * T + j) * F]; };
                for (int i = 0; i < T; i++) {
                    const int ci = i / C;
                    double m = -INFINITY, l = 0, bb = 0;
                    int am = -1;
                    std::vector<double> A(D, 0.0), a(D, 0.0);
                    for (int j = 0; j <= i; j++) {
                        double d = 0;
                        for (int x = 0; x < D; x++) d += (double)Q(i)[x] * K(j)[x];
                        s[(size_t)j] = d * sc;
                        if (ci < rt[j] && s[(size_t)j] > m) m = s[(size_t)j], am = j;
                    }
                    for (int j = 0; j <= i; j++) {
                        const bool soft = ci < rt[j], lin = linear && ci >= rt[j];
                        E[(size_t)j] = soft ? exp(s[(size_t)j] - m) : 0.0;
                        double lv = 0;
                        if (lin)
                            for (int f = 0; f < F; f++) lv += (double)PQ(i)[f] * PK(j)[f];
                        L[(size_t)j] = lv;
                        l += E[(size_t)j], bb += lv;
                        for (int x = 0; x < D; x++) A[x] += E[(size_t)j] * V(j)[x], a[x] += lv * V(j)[x];
                    }
                    const size_t o = ((size_t)b * T + i) * HD + (size_t)h * D;
                    std::vector<double> den(D), gx(D), dN(D), dAl(D);
                    double dl = 0, db = 0;
                    for (int x = 0; x < D; x++) {
                        gx[x] = linear && gate ? (*gate)[o + x] : 1.0;
                        den[x] = l + (linear && gate && gate_den ? gx[x] * bb : bb) + 1e-6;
                        y[o + x] = (A[x] + gx[x] * a[x]) / den[x];
                        loss += (double)(*dy)[o + x] * y[o + x];
                    }
                    if (!grads) continue;
                    for (int x = 0; x < D; x++) {
                        dN[x] = (*dy)[o + x] / den[x];
                        dAl[x] = dN[x] * gx[x];
                        dl -= dN[x] * y[o + x];
                        db -= linear && gate && gate_den ? dN[x] * y[o + x] * gx[x] : dN[x] * y[o + x];
                        if (linear && gate)
                            dpre[o + x] = (dN[x] * a[x] - (gate_den ? dN[x] * y[o + x] * bb : 0.0)) * gx[x] * (1 - gx[x]);
                    }
                    double rho = 0, rho_mag = 0;
                    std::vector<double> dS((size_t)i + 1, 0.0), dS_mag((size_t)i + 1, 0.0);
                    for (int j = 0; j <= i; j++) {
                        if (E[(size_t)j] != 0.0) {
                            double dp = 0;
                            for (int x = 0; x < D; x++) dp += dN[x] * V(j)[x];
                            dS[(size_t)j] = E[(size_t)j] * (dp + dl);
                            dS_mag[(size_t)j] = E[(size_t)j] * (fabs(dp) + fabs(dl));
                            rho += dS[(size_t)j], rho_mag += dS_mag[(size_t)j];
                            for (int x = 0; x < D; x++) dv[((size_t)b * T + j) * Hk * D + (size_t)hk * D + x] += E[(size_t)j] * dN[x];
                        }
                        if (linear && ci >= rt[j]) {
                            double dL = db;
                            for (int x = 0; x < D; x++) {
                                dL += dAl[x] * V(j)[x];
                                dv[((size_t)b * T + j) * Hk * D + (size_t)hk * D + x] += L[(size_t)j] * dAl[x];
                            }
                            for (int f = 0; f < F; f++) {
                                dphq[((size_t)h * B * T + (size_t)b * T + i) * F + f] += dL * PK(j)[f];
                                dphk[((size_t)h * B * T + (size_t)b * T + j) * F + f] += dL * PQ(i)[f];
                            }
                        }
                    }
                    for (int j = 0; j <= i; j++) {   /* dS_j's terms and rho's, taken absolutely */
                        const double mag = dS_mag[(size_t)j] + (j == am ? rho_mag : 0.0);
                        for (int x = 0; x < D && mag != 0.0; x++) {
                            dq_mag[o + x] += sc * mag * fabs(K(j)[x]);
                            dk_mag[((size_t)b * T + j) * Hk * D + (size_t)hk * D + x] += sc * mag * fabs(Q(i)[x]);
                        }
                    }
                    dS[(size_t)am] -= rho;   /* m = s_am: every E_j carries e^{-m} */
                    for (int j = 0; j <= i; j++) {
                        if (dS[(size_t)j] == 0.0) continue;
                        for (int x = 0; x < D; x++) {
                            dq[o + x] += sc * dS[(size_t)j] * K(j)[x];
                            dk[((size_t)b * T + j) * Hk * D + (size_t)hk * D + x] += sc * dS[(size_t)j] * Q(i)[x];
                        }
                    }
                }
            }
    }
};

static std::vector<float> rand_feature_rows(size_t rows) {
    std::vector<float> p(rows * 128);
    for (size_t r = 0; r < rows; r++)
        for (int half = 0; half < 2; half++) {
            double z[64], mx = -INFINITY, sum = 0;
            for (int f = 0; f < 64; f++) z[f] = g_rng.normal() * 2.0, mx = fmax(mx, z[f]);
            for (int f = 0; f < 64; f++) sum += (z[f] = exp(z[f] - mx));
            for (int f = 0; f < 64; f++) p[r * 128 + half * 64 + f] = (float)fmax(z[f] / sum, 1e-12);
        }
    return p;
}

static void test_still_train(void) {
    struct scase {
        int B, T, H, Hk, C, per_kv, linear, gate, gate_den;
    };
    const scase cases[] = {{2, 300, 9, 3, 64, 1, 1, 1, 0}, {1, 1024, 9, 3, 64, 1, 1, 1, 0}, {2, 200, 4, 2, 16, 0, 1, 1, 1},
                           {3, 129, 6, 2, 48, 1, 1, 0, 0}, {1, 100, 9, 3, 64, 1, 0, 0, 0}, {1, 700, 4, 4, 100, 0, 1, 1, 0},
                           {1, 1, 2, 1, 64, 1, 0, 0, 0}};
    const int D = 64, F = 128;
    /* the hand-written gradients against central differences of the double forward (small case) */
    {
        const int B = 1, T = 70, H = 2, Hk = 1, C = 16;
        std::vector<float> q = rand_f32((size_t)T * H * D, 1.0), k = rand_f32((size_t)T * Hk * D, 1.0),
                           v = rand_f32((size_t)T * Hk * D, 1.0), dy = rand_f32((size_t)T * H * D, 1.0),
                           phq = rand_feature_rows((size_t)H * T), phk = rand_feature_rows((size_t)H * T), gate((size_t)T * H * D);
        for (auto &x : gate) x = (float)(0.2 + 0.6 * g_rng.uniform());
        std::vector<int> route((size_t)T * Hk);
        for (int j = 0; j < T; j++) route[(size_t)j] = g_rng.below(4) ? j / C + 2 + g_rng.below(2) : INT_MAX;
        for (int gd = 0; gd < 2; gd++) {
            still_train_ref R(B, T, H, Hk, C, 1, 1, gd);
            R.q = &q, R.k = &k, R.v = &v, R.phq = &phq, R.phk = &phk, R.gate = &gate, R.dy = &dy, R.route = &route;
            R.run(true);
            double worst = 0;
            struct probe { std::vector<float> *x; const std::vector<double> *g; size_t i; bool pre; };
            std::vector<probe> pr;
            for (int n = 0; n < 12; n++) {
                pr.push_back({&q, &R.dq, (size_t)g_rng.below((int)q.size()), false});
                pr.push_back({&k, &R.dk, (size_t)g_rng.below((int)k.size()), false});
                pr.push_back({&v, &R.dv, (size_t)g_rng.below((int)v.size()), false});
                pr.push_back({&phq, &R.dphq, (size_t)g_rng.below((int)phq.size()), false});
                pr.push_back({&phk, &R.dphk, (size_t)g_rng.below((int)phk.size()), false});
                pr.push_back({&gate, &R.dpre, (size_t)g_rng.below((int)gate.size()), true});
            }
            std::vector<std::pair<double, double>> got;
            for (const probe &p : pr) {
                const float x0 = (*p.x)[p.i];
                /* the gate is probed through its pre-activation z: g = σ(z) */
                const double z0 = p.pre ? log(x0 / (1.0 - x0)) : x0, hstep = 1e-3;
                double f[2];
                for (int sgn = 0; sgn < 2; sgn++) {
                    const double z = z0 + (sgn ? -hstep : hstep);
                    (*p.x)[p.i] = (float)(p.pre ? 1.0 / (1.0 + exp(-z)) : z);
                    still_train_ref S = R;
                    S.run(false);
                    f[sgn] = S.loss;
                }
                (*p.x)[p.i] = x0;
                /* the float input moved by a float-rounded step: divide by the step actually taken */
                const double fd = (f[0] - f[1]) / (2 * hstep);
                got.push_back({(*p.g)[p.i], fd});
            }
            double num = 0, den = 0;
            for (auto &gv : got) num += (gv.first - gv.second) * (gv.first - gv.second), den += gv.second * gv.second;
            worst = sqrt(num / (den > 0 ? den : 1));
            report(worst < 5e-3, "still_train reference%s: hand-written gradients vs central differences, %zu "
                   "coordinates: %.2e relative", gd ? " gate_den" : "", got.size(), worst);
        }
    }
    for (const scase &c : cases) {
        const int B = c.B, T = c.T, H = c.H, Hk = c.Hk, C = c.C, Hs = c.per_kv ? Hk : H, nc = (T + C - 1) / C;
        const size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * Hk * D, nf = (size_t)H * B * T * F,
                     nr = (size_t)B * H * T;
        std::vector<float> q = rand_f32(nq, 1.0), k = rand_f32(nk, 1.0), v = rand_f32(nk, 1.0), dy = rand_f32(nq, 1.0),
                           phq = rand_feature_rows((size_t)H * B * T), phk = rand_feature_rows((size_t)H * B * T), gate(nq);
        add_key_offset(k, B, T, Hk, 1.0);
        for (auto &x : gate) x = (float)(0.05 + 0.9 * g_rng.uniform());
        std::vector<int> route((size_t)B * Hs * T);
        for (size_t e = 0; e < route.size(); e++) {
            const int j = (int)(e % T), cj = j / C;
            const int u = g_rng.below(10);
            route[e] = cj + 2 >= nc || u == 0 ? INT_MAX : u == 1 ? cj + 2 + 1 + g_rng.below(3) : cj + 2;
        }
        char name[160];
        snprintf(name, sizeof name, "still_train B=%d T=%d H=%d/%d C=%d%s%s%s%s", B, T, H, Hk, C,
                 c.per_kv ? " per KV head" : "", c.linear ? "" : " linear off", c.gate ? " gate" : "",
                 c.gate_den ? " gate_den" : "");
        dbuf bq(nq * 4), bk(nk * 4), bv(nk * 4), bdy(nq * 4), bpq(nf * 4), bpk(nf * 4), bg(nq * 4), brt(route.size() * 4),
            by(nq * 4), ba(nq * 4), brows(nr * 4 * 6), bam(nr * 4), bdN(nq * 4), bdA(nq * 4), gq(nq * 4), gk(nk * 4),
            gv(nk * 4), gpq(nf * 4), gpk(nf * 4), gpre(nq * 4), bkbar((size_t)B * Hk * D * 4),
            bfar((size_t)B * Hk * T * 4), bfarn((size_t)B * Hk * 4);
        bool ok = bq.ok() && bk.ok() && bv.ok() && bdy.ok() && bpq.ok() && bpk.ok() && bg.ok() && brt.ok() && by.ok() &&
                  ba.ok() && brows.ok() && bam.ok() && bdN.ok() && bdA.ok() && gq.ok() && gk.ok() && gv.ok() &&
                  gpq.ok() && gpk.ok() && gpre.ok() && bkbar.ok() && bfar.ok() && bfarn.ok() && upload(bq, q) && upload(bk, k) && upload(bv, v) &&
                  upload(bdy, dy) && upload(bpq, phq) && upload(bpk, phk) && upload(bg, gate) && upload(brt, route);
        if (!ok) {
            report(false, "%s: device buffers", name);
            continue;
        }
        stc_still_train_geom geo = {B, T, H, Hk, D, C, c.per_kv, c.linear, c.gate_den, brt.as<int>()};
        float *rw = brows.as<float>();
        stc_still_train_rows rows = {rw, rw + nr, rw + 2 * nr, rw + 3 * nr, rw + 4 * nr, rw + 5 * nr, bkbar.as<float>(),
                                     bam.as<int>(), bfar.as<int>(), bfarn.as<int>()};
        std::vector<float> y[2], dq[2], dk[2], dv[2], dpq[2], dpk[2], dpre[2];
        for (int run = 0; run < 2 && ok; run++) {
            const float *gp = c.gate ? bg.as<float>() : NULL;
            ok = api_ok(stc_still_train_fwd(g_ctx, &geo, bq.as<float>(), bk.as<float>(), bv.as<float>(), bpq.as<float>(),
                                            bpk.as<float>(), gp, by.as<float>(), ba.as<float>(), &rows, &g_err), name) &&
                 api_ok(stc_still_train_bwd(g_ctx, &geo, bq.as<float>(), bk.as<float>(), bv.as<float>(), bpq.as<float>(),
                                            bpk.as<float>(), gp, by.as<float>(), ba.as<float>(), &rows, bdy.as<float>(),
                                            bdN.as<float>(), bdA.as<float>(), gq.as<float>(), gk.as<float>(),
                                            gv.as<float>(), gpq.as<float>(), gpk.as<float>(), gpre.as<float>(), &g_err),
                        name);
            y[run].resize(nq), dq[run].resize(nq), dk[run].resize(nk), dv[run].resize(nk), dpq[run].resize(nf),
                dpk[run].resize(nf), dpre[run].resize(nq);
            ok = ok && download(y[run], by) && download(dq[run], gq) && download(dk[run], gk) && download(dv[run], gv) &&
                 download(dpq[run], gpq) && download(dpk[run], gpk) && download(dpre[run], gpre);
        }
        if (!ok) continue;
        still_train_ref R(B, T, H, Hk, C, c.per_kv, c.linear, c.gate_den);
        R.q = &q, R.k = &k, R.v = &v, R.phq = &phq, R.phk = &phk, R.gate = c.gate ? &gate : NULL, R.dy = &dy,
        R.route = &route;
        R.run(true);
        auto dbl = [](const std::vector<float> &x) { return std::vector<double>(x.begin(), x.end()); };
        check_rel((std::string(name) + ": y").c_str(), dbl(y[0]), R.y, 2e-2);
        auto norm = [](const std::vector<double> &x) {
            double n = 0;
            for (double e : x) n += e * e;
            return sqrt(n);
        };
        check_rel((std::string(name) + ": dQ").c_str(), dbl(dq[0]), R.dq, 2e-2, norm(R.dq_mag));
        check_rel((std::string(name) + ": dK").c_str(), dbl(dk[0]), R.dk, 2e-2, norm(R.dk_mag));
        check_rel((std::string(name) + ": dV").c_str(), dbl(dv[0]), R.dv, 2e-2);
        if (c.linear && T > 2 * C) {
            check_rel((std::string(name) + ": dφq").c_str(), dbl(dpq[0]), R.dphq, 2e-2);
            check_rel((std::string(name) + ": dφk").c_str(), dbl(dpk[0]), R.dphk, 2e-2);
        }
        if (c.gate && c.linear) check_rel((std::string(name) + ": dpre").c_str(), dbl(dpre[0]), R.dpre, 2e-2);
        const bool same = y[0] == y[1] && dq[0] == dq[1] && dk[0] == dk[1] && dv[0] == dv[1] &&
                          (!c.linear || (dpq[0] == dpq[1] && dpk[0] == dpk[1]));
        report(same, "%s: two runs give the same bits", name);
    }
}

/* The GPU fine-tune's routing (stc_still_lm_route, cuda/train/train_lm_still.cu) against the rules written out on the
 * host: the scores, in double, from the definition (p = token j's softmax weight on itself over its window of C
 * keys, f(p) summed over a selection head's query heads), within 1e-5 relative; then the routing from the GPU's own
 * scores by the definitions (chunk: a leaving chunk's best min(λ, C, slots left) stay; global: a key leaves Sel at
 * the first query chunk where cap tokens of the chunks that have left rank above it; higher score first, ties to
 * the lower position), every key equal. Every third query row is zero in some cases: those tokens' p is 1 / C
 * exactly, so their scores tie and the tie rule decides. */
static void test_still_lm_route(void) {
    struct rcase {
        int T, H, Hk, D, C, per_kv, global, lam, capped, cap, zero_rows;
    };
    const rcase cases[] = {
        {1, 9, 3, 64, 64, 1, 1, 6, 0, 384, 0},      {100, 9, 3, 64, 64, 1, 1, 6, 0, 0, 0},
        {1024, 9, 3, 64, 64, 1, 1, 6, 0, 384, 0},   {1024, 9, 3, 64, 64, 1, 1, 6, 0, 384, 1},
        {3000, 9, 3, 64, 48, 0, 1, 6, 0, 896, 1},   {2500, 4, 2, 32, 100, 1, 1, 6, 0, 7, 0},
        {1024, 9, 3, 64, 64, 1, 0, 6, 0, 896, 1},   {3000, 9, 3, 64, 48, 0, 0, 6, 1, 300, 1},
        {700, 4, 4, 64, 256, 1, 0, 40, 1, 600, 0},  {4096, 9, 3, 64, 128, 1, 1, 6, 0, 2048, 1},
    };
    for (const rcase &c : cases) {
        const int T = c.T, H = c.H, Hk = c.Hk, D = c.D, C = c.C, G = H / Hk, Hs = c.per_kv ? Hk : H;
        std::vector<float> q = rand_f32((size_t)T * H * D, 1.0), k = rand_f32((size_t)T * Hk * D, 1.0);
        if (c.zero_rows)
            for (int t = 0; t < T; t += 3) std::fill(q.begin() + (size_t)t * H * D, q.begin() + (size_t)(t + 1) * H * D, 0.0f);
        char name[160];
        snprintf(name, sizeof name, "still_lm_route T=%d H=%d/%d D=%d C=%d %s %s λ%d%s cap %d%s", T, H, Hk, D, C,
                 c.per_kv ? "per KV head" : "per head", c.global ? "global" : "chunk", c.lam, c.capped ? " capped" : "",
                 c.cap, c.zero_rows ? ", ties" : "");
        dbuf dq(q.size() * 4), dk(k.size() * 4), dsc((size_t)Hs * T * 8), dout((size_t)Hs * T * 4);
        if (!dq.ok() || !dk.ok() || !dsc.ok() || !dout.ok() || !upload(dq, q) || !upload(dk, k) || !dout.poison())
            continue;
        if (!api_ok(stc_still_lm_route(g_ctx, dq.as<float>(), dk.as<float>(), T, H, Hk, D, C, c.per_kv, c.global,
                                       c.lam, c.capped, c.cap, dsc.as<double>(), dout.as<int>(), &g_err),
                    name))
            continue;
        std::vector<double> sc((size_t)Hs * T);
        std::vector<int> out((size_t)Hs * T);
        if (!download(sc, dsc) || !download(out, dout)) continue;
        /* the scores by their definition */
        std::vector<double> want((size_t)Hs * T, 0.0);
        for (int hs = 0; hs < Hs; hs++)
            for (int j = 0; j < T; j++) {
                const int lo = j - C + 1 > 0 ? j - C + 1 : 0;
                for (int h = c.per_kv ? hs * G : hs; h < (c.per_kv ? hs * G + G : hs + 1); h++) {
                    std::vector<double> s((size_t)(j - lo + 1));
                    double mx = -INFINITY, sum = 0;
                    for (int l = lo; l <= j; l++) {
                        double d = 0;
                        for (int x = 0; x < D; x++)
                            d += (double)q[((size_t)j * H + h) * D + x] * k[((size_t)l * Hk + h / G) * D + x];
                        s[(size_t)(l - lo)] = d / sqrt((double)D);
                        mx = fmax(mx, s[(size_t)(l - lo)]);
                    }
                    for (double v : s) sum += exp(v - mx);
                    want[(size_t)hs * T + j] += still_saliency_of_p(exp(s.back() - mx) / sum);
                }
            }
        check_rel((std::string(name) + ": scores").c_str(), sc, want, 1e-5);
        /* the routing by its definition, from the GPU's scores */
        const int nc = (T + C - 1) / C;
        int differ = 0, first = -1;
        for (int hs = 0; hs < Hs; hs++) {
            const double *v = sc.data() + (size_t)hs * T;
            auto above = [&](int i, int j) { return v[i] > v[j] || (v[i] == v[j] && i < j); };
            std::vector<int> ref((size_t)T, INT_MAX);
            if (c.global) {
                for (int j = 0; j < T; j++) {
                    const int cj = j / C;
                    if (cj + 2 >= nc) continue;   /* its chunk never leaves Local */
                    if (c.cap == 0) {
                        ref[(size_t)j] = cj + 2;
                        continue;
                    }
                    int n_above = 0;
                    for (int i = 0; i < cj * C; i++) n_above += above(i, j);
                    for (int cq = cj + 2; cq < nc; cq++) {   /* query chunk cq: the chunks <= cq − 2 have left */
                        for (int i = (cq - 2) * C; i < (cq - 1) * C; i++) n_above += above(i, j);
                        if (n_above >= c.cap) {
                            ref[(size_t)j] = cq;
                            break;
                        }
                    }
                }
            } else {
                int used = 0;
                for (int cl = 0; cl + 2 < nc; cl++) {
                    int n = c.lam < C ? c.lam : C;
                    if (c.capped && n > c.cap - used) n = c.cap - used;
                    if (n < 0) n = 0;
                    for (int j = cl * C; j < (cl + 1) * C; j++) {
                        int rank = 0;
                        for (int i = cl * C; i < (cl + 1) * C; i++) rank += above(i, j);
                        if (rank >= n) ref[(size_t)j] = cl + 2;
                    }
                    used += n;
                }
            }
            for (int j = 0; j < T; j++)
                if (out[(size_t)hs * T + j] != ref[(size_t)j] && differ++ == 0) first = hs * T + j;
        }
        report(differ == 0, "%s: routing of %d keys, %d differ from the rule%s", name, Hs * T, differ,
               differ ? (" (first: key " + std::to_string(first % T) + " of head " + std::to_string(first / T) +
                         ", got " + std::to_string(out[(size_t)first]) + ")").c_str()
                      : "");
    }
}

static void test_still_small(void) {
    for (const still_case &c : still_small_cases()) run_still_case(c, true);
    run_still_case({"lolcats small", lolcats_cfg(4, 2, 16, 4096), 300}, true);
    run_still_case({"lolcats SmolLM2 shape", lolcats_cfg(9, 3, 64, 8192), 700}, true);

    /* a shared workspace, and the registered bf16 gate matrix */
    {
        const stc_still_config cfg = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096);
        stc_still_info info;
        stc_still *a = NULL, *b = NULL;
        if (API(stc_still_resolve(&cfg, &info, &g_err)) && API(stc_still_create(g_ctx, &cfg, &a, &g_err)) &&
            API(stc_still_create(g_ctx, &cfg, &b, &g_err)) && API(stc_still_share_workspace(b, a, &g_err)) &&
            API(stc_still_reserve(g_ctx, a, 512, &g_err))) {
            const still_seq s = make_still_seq(cfg, 200);
            const still_ref_result ref = ref_still(cfg, info, s);
            const size_t HD = (size_t)cfg.n_head * cfg.head_dim, nwg = HD * cfg.d_model;
            dbuf wg(nwg * 2), wsrc(nwg * 4);
            std::vector<float> w(s.params.begin() + 2 * HD + 2 * HD * cfg.head_dim,
                                 s.params.begin() + 2 * HD + 2 * HD * cfg.head_dim + nwg);
            if (wg.ok() && wsrc.ok() && upload(wsrc, w) &&
                API(stc_f32_to_bf16(g_ctx, wsrc.as<float>(), wg.as<stc_bf16>(), (int64_t)nwg, &g_err))) {
                stc_still_set_gate_bf16(b, wg.as<stc_bf16>());
                std::vector<float> y;
                std::vector<std::vector<int>> sel;
                const std::vector<int> sc = sched_random(200, cfg.chunk);
                if (run_still_gpu(b, s, sc, false, y, sel))
                    check_rows("still: a second state sharing the first's workspace, registered bf16 gate matrix", y,
                               ref.y, s.L * s.H, s.D, 1e-2);
                stc_still_set_gate_bf16(b, NULL);
            }
        }
        stc_still_free(b);
        stc_still_free(a);
    }

    /* refusals */
    still_err e = {};
    stc_still *st = NULL;
    stc_still_config c2 = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096);
    c2.feature_map = 1, c2.feature_dim = 64;
    int rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && strstr(e.msg, "hedgehog"), "still: hedgehog refused: %s", e.msg);
    c2 = still_cfg(4, 2, 96, 96, 16, 56, 3, 4096);
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && strstr(e.msg, "head dim"), "still: head dim 96 refused: %s", e.msg);
    c2 = still_cfg(4, 2, 64, 96, 256, 0, 3, 4096);
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && strstr(e.msg, "chunk"), "still: chunk 256 refused: %s", e.msg);
    c2 = still_cfg(4, 2, 64, 96, 16, 20, 3, 4096);
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "budget"), "still: budget below 2C refused: %s", e.msg);
    c2 = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096), c2.gate = 0, c2.gate_den = 1;
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "gate_den"), "still: gate_den without the gate refused: %s", e.msg);
    c2 = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096), c2.linear = 0, c2.gate_den = 1;
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "gate_den"), "still: gate_den without the linear branch refused: %s",
           e.msg);
    c2 = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096);
    if (API(stc_still_create(g_ctx, &c2, &st, &e))) {
        rc = stc_still_forward(g_ctx, st, NULL, NULL, NULL, NULL, NULL, 1, 5, NULL, &e);
        report(rc == STILL_E_STATE && strstr(e.msg, "input starts at 5"), "still: wrong p0 refused: %s", e.msg);
        report(stc_still_state_bytes(st) > 0, "still: state bytes %zu", stc_still_state_bytes(st));
        stc_still_free(st);
    }
}

/* ---- liger (the linear branch, stc_liger_forward) ---------------------------------------------- */

/* The liger recurrence in double, token by token (../shared/spec/attention.md):
 * out = 0.5 o_swa + 0.5 φ(q)ᵀ S_t, S_t = diag(σ(k)^{1/16}) S_{t-1} + φ(k) vᵀ. */
static void ref_liger(const std::vector<float> &q, const std::vector<float> &k, const std::vector<float> &v,
                      const std::vector<float> &o_swa, int T, int H, int Hk, int D, std::vector<double> &out,
                      std::vector<double> &S) {
    const int G = H / Hk;
    S.assign((size_t)Hk * D * D, 0.0);
    out.assign((size_t)T * H * D, 0.0);
    std::vector<double> pq(D), pk(D), a(D), o(D);
    auto softmax = [D](const float *x, std::vector<double> &y) {
        double mx = x[0], sum = 0;
        for (int i = 1; i < D; i++) mx = std::max(mx, (double)x[i]);
        for (int i = 0; i < D; i++) sum += (y[i] = exp(x[i] - mx));
        for (int i = 0; i < D; i++) y[i] /= sum;
    };
    for (int t = 0; t < T; t++)
        for (int hk = 0; hk < Hk; hk++) {
            const float *kr = &k[((size_t)t * Hk + hk) * D], *vr = &v[((size_t)t * Hk + hk) * D];
            softmax(kr, pk);
            for (int i = 0; i < D; i++) a[i] = pow(1.0 / (1.0 + exp(-(double)kr[i])), 1.0 / 16);
            double *Sk = &S[(size_t)hk * D * D];
            for (int i = 0; i < D; i++)
                for (int d = 0; d < D; d++) Sk[(size_t)i * D + d] = a[i] * Sk[(size_t)i * D + d] + pk[i] * vr[d];
            for (int g = 0; g < G; g++) {
                const size_t row = (size_t)t * H + hk * G + g;
                softmax(&q[row * D], pq);
                std::fill(o.begin(), o.end(), 0.0);
                for (int i = 0; i < D; i++)
                    for (int d = 0; d < D; d++) o[d] += pq[i] * Sk[(size_t)i * D + d];
                for (int d = 0; d < D; d++) out[row * D + d] = 0.5 * o_swa[row * D + d] + 0.5 * o[d];
            }
        }
}

/* One sequence through a fresh state in calls of sched's sizes, with a
 * workspace of ws_tokens tokens (0: enough for the longest call), against
 * the reference: every (token, head) row and the final state to 1e-4. */
static void run_liger_case(int H, int Hk, int D, int L, const std::vector<int> &sched, int ws_tokens, double kscale) {
    char name[160];
    snprintf(name, sizeof name, "liger H=%d Hk=%d D=%d L=%d, %s%s", H, Hk, D, L, sched_name(sched).c_str(),
             ws_tokens ? ", small workspace" : "");
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D;
    std::vector<float> q = rand_f32((size_t)L * qd, 1.5), k = rand_f32((size_t)L * kvd, kscale),
                       v = rand_f32((size_t)L * kvd, 1.0), o_swa = rand_f32((size_t)L * qd, 0.5);
    std::vector<double> ref, ref_S;
    ref_liger(q, k, v, o_swa, L, H, Hk, D, ref, ref_S);
    int longest = 0;
    for (int n : sched) longest = std::max(longest, n);
    const size_t ws_bytes = stc_liger_workspace_bytes(H, Hk, D, ws_tokens ? ws_tokens : longest);
    dbuf dq(q.size() * 4), dk(k.size() * 4), dv(v.size() * 4), dout(o_swa.size() * 4), dws(ws_bytes);
    stc_liger *st = NULL;
    if (!dq.ok() || !dk.ok() || !dv.ok() || !dout.ok() || !dws.ok()) return;
    if (!API(stc_liger_create(g_ctx, H, Hk, D, &st, &g_err))) return;
    bool ok = upload(dq, q) && upload(dk, k) && upload(dv, v) && upload(dout, o_swa) && dws.poison();
    int t0 = 0;
    for (size_t c = 0; c < sched.size() && ok; c++) {
        ok = API(stc_liger_forward(g_ctx, st, dq.as<float>() + (size_t)t0 * qd, dk.as<float>() + (size_t)t0 * kvd,
                                   dv.as<float>() + (size_t)t0 * kvd, sched[c], dws.p, ws_bytes,
                                   dout.as<float>() + (size_t)t0 * qd, &g_err));
        t0 += sched[c];
    }
    std::vector<float> got(o_swa.size()), S((size_t)Hk * D * D);
    if (ok && download(got, dout) && API(stc_liger_state(g_ctx, st, S.data(), &g_err))) {
        check_rows(name, got, ref, L * H, D, 1e-4);
        std::string sn = std::string(name) + ": final state";
        check_rel(sn.c_str(), to_double(S), ref_S, 1e-4);
        report(stc_liger_n_seen(st) == L, "%s: %d tokens seen", name, stc_liger_n_seen(st));
    }
    stc_liger_free(st);
}

static void test_liger(void) {
    run_liger_case(9, 3, 64, 1000, sched_one(1000), 0, 2.0);
    run_liger_case(9, 3, 64, 1000, sched_random(1000, 64), 0, 2.0);
    run_liger_case(9, 3, 64, 300, sched_singles(300, 200), 0, 2.0);
    run_liger_case(9, 3, 64, 1000, sched_one(1000), 128, 2.0);   /* segments of 128 tokens */
    run_liger_case(9, 3, 64, 20000, sched_one(20000), 0, 1.0);   /* segments of STC_LIGER_SEGMENT */
    run_liger_case(4, 4, 128, 333, sched_one(333), 0, 2.0);
    run_liger_case(4, 4, 128, 333, sched_random(333, 64), 0, 2.0);
    run_liger_case(8, 1, 64, 200, sched_singles(200, 100), 0, 4.0);
    /* shapes it does not take */
    still_err e = {};
    stc_liger *st = NULL;
    int rc = stc_liger_create(g_ctx, 9, 1, 64, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && !st, "liger with 9 query heads per KV head refused: %s", e.msg);
    rc = stc_liger_create(g_ctx, 9, 3, 96, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && !st, "liger with head dim 96 refused: %s", e.msg);
    rc = stc_liger_create(g_ctx, 9, 4, 64, &st, &e);
    report(rc == STILL_E_ARG && !st, "liger with 9 heads over 4 KV heads refused: %s", e.msg);
    if (API(stc_liger_create(g_ctx, 9, 3, 64, &st, &g_err))) {
        dbuf tiny(1024);
        rc = stc_liger_forward(g_ctx, st, (float *)16, (float *)16, (float *)16, 100, tiny.p, 1024, (float *)16, &e);
        report(rc == STILL_E_ARG && strstr(e.msg, "workspace"), "liger with a 1 KiB workspace refused: %s", e.msg);
        stc_liger_free(st);
    }
}

/* ---- CPU self-test ------------------------------------------------------------------------------ */

static void selftest_bf16(void) {
    struct { float f; uint16_t h; } c[] = {
        {1.0f, 0x3f80}, {1.0f + 0x1p-8f, 0x3f80} /* tie -> even */, {1.0f + 3 * 0x1p-8f, 0x3f82} /* tie -> even (up) */,
        {-2.0f, 0xc000}, {3.4028235e38f, 0x7f80} /* rounds to inf */, {INFINITY, 0x7f80}, {0x1p-133f, 0x0001},
        {0x1.01p0f, 0x3f80}, {0x1.018p0f, 0x3f81},
    };
    bool ok = true;
    for (auto &x : c)
        if (f2bf(x.f) != x.h) {
            ok = false;
            printf("  f2bf(%a) = 0x%04x, expected 0x%04x\n", (double)x.f, f2bf(x.f), x.h);
        }
    ok = ok && isnan(bf2f(f2bf(NAN))) && bf2f(0x3f80) == 1.0f;
    report(ok, "selftest: fp32 -> bf16 rounds to nearest, ties to even");
    /* the dequant reference (quant.c) against per-type spot values */
    uint8_t blk[18] = {0};
    const uint16_t d = f32_to_f16(0.5f);
    memcpy(blk, &d, 2);
    blk[2] = 0x9f;   /* element 0: 15 - 8 = 7, element 16: 9 - 8 = 1 */
    float out[32];
    still_err e = {};
    ok = dequantize_row(TT_Q4_0, blk, out, 32, &e) == 0 && out[0] == 3.5f && out[16] == 0.5f && out[1] == -4.0f;
    report(ok, "selftest: the dequant reference (src/format/quant.c) decodes a Q4_0 block");
}

/* The PTX ISA's fragment layouts of mma.m16n8k16 with .bf16 inputs (lane L,
 * groupID g = L/4, threadID_in_group c = L%4), written out independently of
 * cuda/kinds/attn_layout.cuh:
 *   A (16×16, row-major): register i, half j -> row g + 8·(i%2), col 2c + j + 8·(i/2)
 *   B (16×8, "col"):      register i, half j -> k 2c + j + 8·i, n g
 *   C (16×8):             element e          -> row g + 8·(e/2), col 2c + e%2 */
static int spec_a_row(int L, int i) { return L / 4 + 8 * (i % 2); }
static int spec_a_col(int L, int i, int j) { return 2 * (L % 4) + j + 8 * (i / 2); }
static int spec_b_k(int L, int i, int j) { return 2 * (L % 4) + j + 8 * i; }
static int spec_b_n(int L) { return L / 4; }
static int spec_c_row(int L, int e) { return L / 4 + 8 * (e / 2); }
static int spec_c_col(int L, int e) { return 2 * (L % 4) + e % 2; }

/* Shared memory holding, for a tile of `rows` rows × (chunks·8) columns, the
 * id row·256 + col of each element at the swizzled place cp.async writes it. */
static std::vector<uint16_t> swizzled_tile(int rows, int chunks) {
    std::vector<uint16_t> sm((size_t)rows * chunks * 8, 0xFFFF);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++)
            for (int x = 0; x < 8; x++)
                sm[(size_t)stc_attn::swz_off(r, c, chunks) / 2 + x] = (uint16_t)(r * 256 + c * 8 + x);
    return sm;
}

/* ldmatrix.x4 per the PTX ISA: lane 8i+r gives the address (in bytes) of row
 * r of matrix i; lane L receives, in register i, elements (L/4, 2(L%4)+j) of
 * matrix i, or with .trans elements (2(L%4)+j, L/4). Returns [lane][reg][half]. */
static void ldmatrix_x4(const std::vector<uint16_t> &sm, const int addr[32], bool trans, uint16_t out[32][4][2]) {
    for (int L = 0; L < 32; L++)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 2; j++) {
                const int row = trans ? 2 * (L % 4) + j : L / 4, col = trans ? L / 4 : 2 * (L % 4) + j;
                out[L][i][j] = sm[(size_t)addr[8 * i + row] / 2 + col];
            }
}

/* The 8 addresses of each ldmatrix phase fall in distinct 16-byte bank groups. */
static bool conflict_free(const int addr[32]) {
    for (int i = 0; i < 4; i++) {
        int seen = 0;
        for (int r = 0; r < 8; r++) seen |= 1 << ((addr[8 * i + r] / 16) % 8);
        if (seen != 0xff) return false;
    }
    return true;
}

static void selftest_fragments(void) {
    using namespace stc_attn;
    for (int D : {64, 128}) {
        const int CH = D / 8;
        for (int MT : {1, 2}) {
            const int BM = kWarps * 16 * MT;
            bool ok_q = true, ok_k = true, ok_v = true, banks = true;
            /* Q: A fragments of every warp, m-tile and k-step */
            const std::vector<uint16_t> sq = swizzled_tile(BM, CH);
            for (int w = 0; w < kWarps; w++)
                for (int mt = 0; mt < MT; mt++)
                    for (int ks = 0; ks < D / 16; ks++) {
                        int addr[32];
                        uint16_t got[32][4][2];
                        for (int L = 0; L < 32; L++)
                            addr[L] = swz_off(w * MT * 16 + mt * 16 + ldm_rowmajor_row(L), 2 * ks + ldm_rowmajor_chunk(L), CH);
                        banks = banks && conflict_free(addr);
                        ldmatrix_x4(sq, addr, false, got);
                        for (int L = 0; L < 32; L++)
                            for (int i = 0; i < 4; i++)
                                for (int j = 0; j < 2; j++) {
                                    const int row = w * MT * 16 + mt * 16 + spec_a_row(L, i);
                                    const int col = 16 * ks + spec_a_col(L, i, j);
                                    ok_q = ok_q && got[L][i][j] == row * 256 + col;
                                }
                    }
            /* K [key][dim]: B fragments of Q·Kᵀ (n = key, k = dim) */
            const std::vector<uint16_t> skv = swizzled_tile(kBlockN, CH);
            for (int ks = 0; ks < D / 16; ks++)
                for (int np = 0; np < kBlockN / 16; np++) {
                    int addr[32];
                    uint16_t got[32][4][2];
                    for (int L = 0; L < 32; L++) addr[L] = swz_off(np * 16 + ldm_nk_row(L), 2 * ks + ldm_nk_chunk(L), CH);
                    banks = banks && conflict_free(addr);
                    ldmatrix_x4(skv, addr, false, got);
                    for (int L = 0; L < 32; L++)
                        for (int half_tile = 0; half_tile < 2; half_tile++)   /* n-tiles 2np, 2np+1 */
                            for (int i = 0; i < 2; i++)
                                for (int j = 0; j < 2; j++) {
                                    const int key = 16 * np + 8 * half_tile + spec_b_n(L), dim = 16 * ks + spec_b_k(L, i, j);
                                    ok_k = ok_k && got[L][2 * half_tile + i][j] == key * 256 + dim;
                                }
                }
            /* V [key][dim] with .trans: B fragments of P·V (k = key, n = dim) */
            for (int kk = 0; kk < kBlockN / 16; kk++)
                for (int dp = 0; dp < D / 16; dp++) {
                    int addr[32];
                    uint16_t got[32][4][2];
                    for (int L = 0; L < 32; L++)
                        addr[L] = swz_off(kk * 16 + ldm_rowmajor_row(L), 2 * dp + ldm_rowmajor_chunk(L), CH);
                    banks = banks && conflict_free(addr);
                    ldmatrix_x4(skv, addr, true, got);
                    for (int L = 0; L < 32; L++)
                        for (int half_tile = 0; half_tile < 2; half_tile++)   /* dim n-tiles 2dp, 2dp+1 */
                            for (int i = 0; i < 2; i++)
                                for (int j = 0; j < 2; j++) {
                                    const int key = 16 * kk + spec_b_k(L, i, j), dim = 16 * dp + 8 * half_tile + spec_b_n(L);
                                    ok_v = ok_v && got[L][2 * half_tile + i][j] == key * 256 + dim;
                                }
                }
            /* cp.async stores: 8 consecutive threads write 8 distinct bank groups */
            for (int rows : {BM, kBlockN})
                for (int base = 0; base < rows * CH; base += 8) {
                    int seen = 0;
                    for (int t = base; t < base + 8; t++) seen |= 1 << ((swz_off(t / CH, t % CH, CH) / 16) % 8);
                    banks = banks && seen == 0xff;
                }
            report(ok_q, "selftest D=%d MT=%d: ldmatrix of swizzled Q gives the PTX A fragments", D, MT);
            report(ok_k, "selftest D=%d MT=%d: ldmatrix of swizzled K gives the B fragments of Q·Kᵀ", D, MT);
            report(ok_v, "selftest D=%d MT=%d: ldmatrix.trans of swizzled V gives the B fragments of P·V", D, MT);
            report(banks, "selftest D=%d MT=%d: ldmatrix phases and cp.async stores are bank-conflict free", D, MT);
        }
    }
    /* The kernel's swz_off_add (lane part once, then constants) is swz_off. */
    bool ok_add = true;
    for (int CH : {8, 16})
        for (int row = 0; row < 128; row++)
            for (int c = 0; c < CH; c++)
                for (int ra = 0; ra < 256; ra += 8)
                    for (int ca = 0; c + ca < CH; ca += 2)
                        if ((c & ca) == 0)
                            ok_add = ok_add && stc_attn::swz_off_add(row, c, ra, ca, CH) == stc_attn::swz_off(row + ra, c + ca, CH);
    report(ok_add, "selftest: swz_off_add (hoisted lane part) equals swz_off");
    /* P·V's A operand from S's accumulators, and the accumulator helpers */
    bool ok = true;
    for (int L = 0; L < 32; L++) {
        for (int e = 0; e < 4; e++)
            ok = ok && stc_attn::acc_row(L, e) == spec_c_row(L, e) && stc_attn::acc_col(L, e) == spec_c_col(L, e);
        for (int kk = 0; kk < 4; kk++)
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 2; j++) {
                    const int nt = 2 * kk + stc_attn::p_frag_ntile(i), e = stc_attn::p_frag_e(i) + j;
                    /* the S element the kernel packs here, vs what the A fragment must hold */
                    ok = ok && spec_c_row(L, e) == spec_a_row(L, i) && 8 * nt + spec_c_col(L, e) == 16 * kk + spec_a_col(L, i, j);
                }
    }
    report(ok, "selftest: S accumulators repacked as P·V's A fragments match the PTX layouts");
}

/* For a configuration, every row sees every key tile it needs exactly once
 * (over all splits and warps; a warp may also run tiles that are entirely
 * masked for some of its rows, which contribute nothing), tiles without the
 * mask are fully visible to all the warp's rows, and splits_used() counts
 * the splits with work. */
static bool check_decomposition(int T, int p0, int H, int Hk, int D, int sm, int forced) {
    using namespace stc_attn;
    const plan p = make_plan(T, p0, H, Hk, D, sm, forced);
    if (p.n_splits < 1 || p.n_splits > kMaxSplits || p.tiles_per_split * (p.n_splits - 1) >= p.n_key_tiles) return false;
    std::vector<int> count((size_t)p.rows * p.n_key_tiles, 0);
    std::vector<int> used_splits(p.n_row_tiles, 0);
    for (int bx = 0; bx < p.n_row_tiles * Hk; bx++)
        for (int split = 0; split < p.n_splits; split++) {
            int tile, hk, t_lo, t_hi;
            cta_coords(bx, Hk, p.n_row_tiles, &tile, &hk);
            if (tile < 0 || tile >= p.n_row_tiles || hk < 0 || hk >= Hk) return false;
            const int r0 = tile * p.block_m;
            token_range(r0, p.block_m, p.rows, p.G, &t_lo, &t_hi);
            const int n_tiles = key_tiles(p0, t_hi);
            const int jb = split * p.tiles_per_split, je = imin(n_tiles, jb + p.tiles_per_split);
            if (jb >= je) continue;
            if (hk == 0) used_splits[tile]++;
            for (int w = 0; w < kWarps; w++) {
                const int wr0 = r0 + w * p.mt * 16;
                if (wr0 >= p.rows) continue;
                int wt_lo, wt_hi;
                token_range(wr0, p.mt * 16, p.rows, p.G, &wt_lo, &wt_hi);
                for (int j = jb; j < je; j++) {
                    const int kbase = j * kBlockN;
                    if (tile_skipped(kbase, p0, wt_hi)) continue;
                    const bool mask = tile_needs_mask(kbase, p0, wt_lo);
                    for (int r = wr0; r < imin(wr0 + p.mt * 16, p.rows); r++) {
                        const int pos = p0 + r / p.G;
                        if (!mask && kbase + kBlockN - 1 > pos) return false;   /* unmasked but not visible */
                        if (hk == 0) count[(size_t)r * p.n_key_tiles + j]++;
                    }
                }
            }
        }
    for (int r = 0; r < p.rows; r++) {
        const int need = key_tiles(p0, r / p.G);
        for (int j = 0; j < p.n_key_tiles; j++) {
            const int c = count[(size_t)r * p.n_key_tiles + j];
            if (j < need && c != 1) return false;
        }
    }
    for (int tile = 0; tile < p.n_row_tiles; tile++)
        if (used_splits[tile] != splits_used(tile, p.block_m, p.rows, p.G, p0, p.tiles_per_split)) return false;
    return true;
}

/* The kernel's arithmetic on the CPU, row by row: the same decomposition,
 * per-warp skip / mask decisions, zero-filled keys past the block's last
 * one, running max with the -inf guard, exp2 with the folded scale, P
 * rounded to bf16 for P·V, the split partials and their combination. */
static std::vector<double> emulate_attention(const std::vector<uint16_t> &q, const std::vector<uint16_t> &k,
                                             const std::vector<uint16_t> &v, int T, int p0, int H, int Hk, int D,
                                             int sm, int forced) {
    using namespace stc_attn;
    const plan p = make_plan(T, p0, H, Hk, D, sm, forced);
    const float sl2 = (float)(1.4426950408889634 / sqrt((double)D));
    std::vector<double> out((size_t)T * H * D, NAN);
    const size_t n_part = (size_t)p.n_splits * Hk * p.rows;
    std::vector<float> part_o(n_part * D, NAN), part_m(n_part, NAN), part_l(n_part, NAN);
    std::vector<float> s(kBlockN), o(D);
    for (int bx = 0; bx < p.n_row_tiles * Hk; bx++)
        for (int split = 0; split < p.n_splits; split++) {
            int tile, hk, t_lo, t_hi;
            cta_coords(bx, Hk, p.n_row_tiles, &tile, &hk);
            const int r0 = tile * p.block_m;
            token_range(r0, p.block_m, p.rows, p.G, &t_lo, &t_hi);
            const int n_keys = p0 + t_hi + 1, n_tiles = key_tiles(p0, t_hi);
            const int jb = split * p.tiles_per_split, je = imin(n_tiles, jb + p.tiles_per_split);
            if (jb >= je) continue;
            for (int w = 0; w < kWarps; w++) {
                const int wr0 = r0 + w * p.mt * 16;
                if (wr0 >= p.rows) continue;
                int wt_lo, wt_hi;
                token_range(wr0, p.mt * 16, p.rows, p.G, &wt_lo, &wt_hi);
                for (int r = wr0; r < imin(wr0 + p.mt * 16, p.rows); r++) {
                    const int t = r / p.G, h = hk * p.G + r % p.G, pos = p0 + t;
                    const uint16_t *qr = &q[((size_t)t * H + h) * D];
                    float m = -INFINITY, l = 0;
                    for (auto &x : o) x = 0;
                    for (int j = jb; j < je; j++) {
                        const int kbase = j * kBlockN;
                        if (tile_skipped(kbase, p0, wt_hi)) continue;
                        const bool mask = tile_needs_mask(kbase, p0, wt_lo);
                        for (int jj = 0; jj < kBlockN; jj++) {
                            const int key = kbase + jj;
                            float dot = 0;
                            if (key < n_keys)
                                for (int d = 0; d < D; d++)
                                    dot += bf2f(qr[d]) * bf2f(k[((size_t)key * Hk + hk) * D + d]);
                            s[jj] = mask && key > pos ? -INFINITY : dot;
                        }
                        float mx = m;
                        for (float x : s) mx = fmaxf(mx, x);
                        const float msc = mx == -INFINITY ? 0.0f : mx * sl2;
                        const float corr = exp2f(m * sl2 - msc);
                        m = mx;
                        float sum = 0;
                        for (auto &x : o) x *= corr;
                        for (int jj = 0; jj < kBlockN; jj++) {
                            const float pj = exp2f(fmaf(s[jj], sl2, -msc));
                            sum += pj;
                            const int key = kbase + jj;
                            if (key >= n_keys) continue;   /* zero-filled V row */
                            const float pb = bf2f(f2bf(pj));
                            for (int d = 0; d < D; d++) o[d] += pb * bf2f(v[((size_t)key * Hk + hk) * D + d]);
                        }
                        l = l * corr + sum;
                    }
                    if (p.n_splits == 1) {
                        for (int d = 0; d < D; d++) out[((size_t)t * H + h) * D + d] = o[d] / l;
                    } else {
                        const size_t pr = ((size_t)split * Hk + hk) * p.rows + r;
                        for (int d = 0; d < D; d++) part_o[pr * D + d] = o[d];
                        part_m[pr] = m, part_l[pr] = l;
                    }
                }
            }
        }
    if (p.n_splits > 1)
        for (int hk = 0; hk < Hk; hk++)
            for (int r = 0; r < p.rows; r++) {
                const int ns = splits_used(r / p.block_m, p.block_m, p.rows, p.G, p0, p.tiles_per_split);
                float mx = -INFINITY;
                for (int s2 = 0; s2 < ns; s2++) mx = fmaxf(mx, part_m[((size_t)s2 * Hk + hk) * p.rows + r]);
                const int t = r / p.G, h = hk * p.G + r % p.G;
                for (int d = 0; d < D; d++) {
                    float acc = 0, lsum = 0;
                    for (int s2 = 0; s2 < ns; s2++) {
                        const size_t pr = ((size_t)s2 * Hk + hk) * p.rows + r;
                        const float wgt = exp2f((part_m[pr] - mx) * sl2);
                        lsum += part_l[pr] * wgt;
                        acc += part_o[pr * D + d] * wgt;
                    }
                    out[((size_t)t * H + h) * D + d] = acc / lsum;
                }
            }
    return out;
}

static void selftest_decomposition(void) {
    int bad = 0, n = 0;
    /* fixed shapes, then random ones, for several GPU sizes */
    const int fixed[][6] = {{1, 0, 9, 3, 64, 0},    {1, 65535, 9, 3, 64, 0}, {16384, 0, 9, 3, 64, 0},
                            {2000, 37, 9, 3, 64, 0}, {37, 2000, 9, 3, 64, 5}, {1, 4095, 8, 1, 128, 0},
                            {600, 0, 32, 32, 64, 2}, {513, 7, 8, 8, 64, 0},   {3, 1, 8, 2, 128, 300}};
    for (int sm : {132, 8, 1})
        for (auto &f : fixed) {
            n++;
            if (!check_decomposition(f[0], f[1], f[2], f[3], f[4], sm, f[5])) {
                bad++;
                printf("  decomposition wrong: T=%d p0=%d H=%d Hk=%d D=%d sm=%d splits=%d\n", f[0], f[1], f[2], f[3],
                       f[4], sm, f[5]);
            }
        }
    for (int i = 0; i < 300; i++) {
        const int Hk = 1 + g_rng.below(4), G = 1 + g_rng.below(8), T = 1 + g_rng.below(i < 150 ? 300 : 3000);
        const int p0 = g_rng.below(3) ? g_rng.below(5000) : 0, D = g_rng.below(2) ? 64 : 128;
        const int sm = 1 + g_rng.below(200), forced = g_rng.below(3) ? 0 : g_rng.below(40);
        n++;
        if (!check_decomposition(T, p0, G * Hk, Hk, D, sm, forced)) {
            bad++;
            printf("  decomposition wrong: T=%d p0=%d H=%d Hk=%d D=%d sm=%d splits=%d\n", T, p0, G * Hk, Hk, D, sm,
                   forced);
        }
    }
    report(bad == 0, "selftest: %d decompositions: each row gets each visible key tile exactly once (%d wrong)", n, bad);
    /* plan choices the performance depends on */
    const stc_attn::plan big = stc_attn::make_plan(16384, 0, 9, 3, 64, 132, 0);
    const stc_attn::plan dec = stc_attn::make_plan(1, 65535, 9, 3, 64, 132, 0);
    report(big.mt == 2 && big.n_splits == 1 && dec.n_splits >= 64 && dec.block_m == 64,
           "selftest: plans: 16K prefill %d-row blocks, %d split(s); 64K decode %d splits of %d tiles", big.block_m,
           big.n_splits, dec.n_splits, dec.tiles_per_split);
}

static void selftest_emulation(void) {
    const int cases[][7] = {
        /* T, p0, H, Hk, D, sm, forced splits */
        {1, 0, 9, 3, 64, 132, 0},   {1, 700, 9, 3, 64, 132, 0}, {37, 0, 9, 3, 64, 132, 0}, {50, 130, 9, 3, 64, 132, 0},
        {20, 300, 9, 3, 64, 132, 4}, {90, 5, 8, 2, 128, 132, 0}, {200, 0, 8, 8, 64, 3, 0},  {70, 64, 8, 1, 64, 132, 3},
        {200, 0, 9, 3, 64, 132, 4},  /* splits in which some rows see no key yet: the -inf guard */
    };
    for (auto &c : cases) {
        const int T = c[0], p0 = c[1], H = c[2], Hk = c[3], D = c[4], L = p0 + T;
        const std::vector<uint16_t> q = rand_bf16((size_t)T * H * D, 2.0), k = rand_bf16((size_t)L * Hk * D, 1.0),
                                    v = rand_bf16((size_t)L * Hk * D, 1.0);
        const std::vector<double> ref = ref_attention(q, k, v, T, p0, H, Hk, D);
        const std::vector<double> emu = emulate_attention(q, k, v, T, p0, H, Hk, D, c[5], c[6]);
        const stc_attn::plan p = stc_attn::make_plan(T, p0, H, Hk, D, c[5], c[6]);
        char name[160];
        snprintf(name, sizeof name, "selftest: emulated kernel T=%d p0=%d H=%d Hk=%d D=%d (rows/block %d, splits %d) vs reference",
                 T, p0, H, Hk, D, p.block_m, p.n_splits);
        check_rel(name, emu, ref, 1e-2);
    }
    /* the references against each other: GEMM in double vs a float loop */
    const int M = 5, N = 7, K = 300;
    const std::vector<uint16_t> A = rand_bf16((size_t)M * K, 1.0), W = rand_bf16((size_t)N * K, 1.0);
    const std::vector<double> g = ref_gemm(M, N, K, A, W, std::vector<double>((size_t)M * N, 0.0), 0);
    std::vector<double> f((size_t)M * N);
    for (int m = 0; m < M; m++)
        for (int n2 = 0; n2 < N; n2++) {
            float s = 0;
            for (int kk = 0; kk < K; kk++) s += bf2f(A[(size_t)m * K + kk]) * bf2f(W[(size_t)n2 * K + kk]);
            f[(size_t)m * N + n2] = s;
        }
    check_rel("selftest: GEMM reference vs a float loop", f, g, 1e-5);
    /* RoPE reference: rotation preserves each pair's norm, and position 0 is the identity */
    std::vector<float> x = rand_f32(4 * 64, 1.0);
    std::vector<double> y, y0;
    ref_rope(y, x, 2, 2, 64, 1000, 10000.0f);
    ref_rope(y0, x, 1, 4, 64, 0, 10000.0f);   /* one token at position 0 */
    bool ok = true;
    for (size_t i = 0; i < x.size(); i += 2) {
        const double a = hypot((double)x[i], (double)x[i + 1]), b = hypot(y[i], y[i + 1]);
        ok = ok && fabs(a - b) <= 1e-12 * (a + 1) && y0[i] == x[i] && y0[i + 1] == x[i + 1];
    }
    report(ok, "selftest: RoPE reference keeps pair norms, identity at position 0");
    /* RMSNorm reference: unit weights give mean square 1 (eps aside) */
    std::vector<float> xr = rand_f32(3 * 100, 5.0), ones(100, 1.0f);
    const std::vector<float> rn = ref_rmsnorm(xr, ones, 3, 100, 1e-12f);
    ok = true;
    for (int t = 0; t < 3; t++) {
        double ms = 0;
        for (int i = 0; i < 100; i++) ms += (double)rn[t * 100 + i] * rn[t * 100 + i];
        ok = ok && fabs(ms / 100 - 1) < 1e-5;
    }
    report(ok, "selftest: RMSNorm reference gives unit mean square");
    report(stc_c_api_check() == 1, "selftest: still_cuda.h compiles as C11 and links from C");
}

/* still: the CPU emulation of the GPU kernels (tests/cuda/still_ref.hpp)
 * against the double reference, for every split schedule; then the
 * layout's geometry against a token-by-token simulation. */
static void selftest_still(void) {
    for (const still_case &c : still_small_cases()) {
        stc_still_info info;
        still_err e = {};
        if (stc_still_resolve(&c.cfg, &info, &e)) {
            report(false, "stc_still_resolve: %s", e.msg);
            continue;
        }
        const std::string label = "selftest: emulated " + still_label(c, info);
        const still_seq s = make_still_seq(c.cfg, c.L);
        const still_ref_result ref = ref_still(c.cfg, info, s);
        if (c.cfg.routing == 0) {   /* the closed form f(p) selects what the spec's explicit formula selects */
            const still_ref_result spec = ref_still(c.cfg, info, s, true);
            int differ = 0, total = 0;
            double worst = 0;
            for (int hs = 0; hs < info.n_sel_heads; hs++) differ += spec.sel[hs] != ref.sel[hs], total += (int)ref.sel[hs].size();
            for (size_t i = 0; i < ref.rank.size(); i++)
                if (ref.rank[i] == ref.rank[i])
                    worst = std::max(worst, fabs(ref.rank[i] - spec.rank[i]) / std::max(1e-300, fabs(spec.rank[i])));
            /* the closed form drops the ε = 1e-8 inside the logs of the other keys' terms: scores agree to O(ε · C)
             * relative (measured up to 1.4e-7 at C = 128), the selections exactly (the spec's condition) */
            report(differ == 0 && total > 0 && worst < 1e-6,
                   "selftest: %s: the closed-form saliency against the spec's explicit formula: %d selected tokens, "
                   "%d selection heads differ, scores within %.1e relative", still_label(c, info).c_str(), total, differ,
                   worst);
        }
        const std::vector<std::vector<int>> scheds = {sched_one(c.L), sched_random(c.L, c.cfg.chunk),
                                                      sched_singles(c.L, 1 + g_rng.below(c.L - 1))};
        for (const std::vector<int> &sc : scheds) {
            emu_state st = emu_create(c.cfg, info);
            std::vector<double> y((size_t)c.L * s.H * s.D, NAN);
            std::vector<int> written((size_t)c.L * s.H, 0);
            for (int T : sc) emu_call(c.cfg, info, s, st, T, y, written);
            double worst = 0;
            for (size_t r = 0; r < written.size(); r++) {
                double num = 0, den = 0;
                for (int x = 0; x < s.D; x++) {
                    const double d = y[r * s.D + x] - ref.y[r * s.D + x];
                    num += d * d, den += ref.y[r * s.D + x] * ref.y[r * s.D + x];
                }
                const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
                if (!(rel <= worst)) worst = rel;   /* NaN sticks */
            }
            int rows_bad = 0;
            for (int w : written) rows_bad += w != 1;
            const std::vector<std::vector<int>> sel = emu_selected(c.cfg, info, st);
            int sel_bad = 0;
            for (int hs = 0; hs < info.n_sel_heads; hs++) sel_bad += sel[hs] != ref.sel[hs];
            report(worst < 1e-9 && rows_bad == 0 && sel_bad == 0 && st.violations == 0,
                   "%s, %s: worst row rel err %.1e, %d rows not written once, %d selection heads differ, %ld "
                   "broken invariants",
                   label.c_str(), sched_name(sc).c_str(), worst, rows_bad, sel_bad, st.violations);
        }
    }
    /* geometry: a token-by-token simulation of the terrace */
    int bad = 0, n = 0;
    for (int C : {1, 5, 16, 24, 64, 128})
        for (int i = 0; i < 400; i++) {
            const int p0 = g_rng.below(i < 200 ? 4 * C : 50 * C + 1), T = 1 + g_rng.below(i % 3 ? 3 * C + 2 : 300);
            const stillk::call_geom g = stillk::make_geom(p0, T, C);
            /* the kernels' version with the fast division: the same fields */
            const stillk::call_geom gf = stillk::make_geom_fd(p0, T, C, stillk::make_fast_div(C));
            const bool same = g.p0 == gf.p0 && g.T == gf.T && g.c_first == gf.c_first && g.c_last == gf.c_last &&
                              g.leave_first == gf.leave_first && g.n_leaves == gf.n_leaves &&
                              g.ring_lo == gf.ring_lo && g.end_lo == gf.end_lo;
            int first = -1, cnt = 0;
            for (int pos = p0; pos < p0 + T; pos++)
                if (pos % C == 0 && pos / C >= 2) {   /* chunk pos/C - 2 leaves here */
                    if (first < 0) first = pos / C - 2;
                    cnt++;
                }
            bool ok = same && g.n_leaves == cnt && (cnt == 0 || g.leave_first == first) &&
                      g.n_leaves <= stillk::max_leaves(T, C);
            ok = ok && g.c_first == p0 / C && g.c_last == (p0 + T - 1) / C &&
                 g.c_last - g.c_first + 1 <= stillk::max_query_chunks(T, C);
            ok = ok && (p0 + T - 1) / stillk::kScoreRows - p0 / stillk::kScoreRows + 1 <= stillk::max_score_tiles(T);
            /* ring: the chunks not yet left, at most 2C positions, and each query's Local in it or the call */
            ok = ok && g.ring_lo <= p0 && p0 - g.ring_lo <= 2 * C && g.end_lo <= p0 + T && p0 + T - g.end_lo <= 2 * C;
            ok = ok && std::max(0, (p0 / C - 1) * C) >= g.ring_lo && std::max(0, p0 - C + 1) >= g.ring_lo;
            /* each query chunk sees the state after the folds of chunks <= c-2 */
            for (int c = std::max(2, g.c_first); c <= g.c_last; c++) {
                int folds = 0;   /* leaves of the call before chunk c's first token */
                for (int pos = p0; pos < p0 + T; pos++) folds += pos % C == 0 && pos / C >= 2 && pos / C <= c;
                ok = ok && stillk::lin_index(g, c) == folds;
            }
            /* Sel counts: one chunk at a time */
            const int lam = C / 3, cap = 5 * C / 2 + 1;
            int used = 0;
            for (int k = 0; k < 40; k++) {
                ok = ok && stillk::sel_count(k, lam, cap) == used;
                used += std::min(lam, cap - used);
            }
            n++;
            if (!ok) {
                bad++;
                if (bad < 5) printf("  geometry wrong: C=%d p0=%d T=%d\n", C, p0, T);
            }
        }
    report(bad == 0, "selftest: still call geometry against a token-by-token simulation (%d cases, %d wrong)", n, bad);

    /* the kernels' make_geom_fd against make_geom at positions far into a long context */
    int geo_bad = 0, geo_n = 0;
    for (int C : {1, 7, 64, 100, 128})
        for (int i = 0; i < 2000; i++) {
            const int T = 1 + g_rng.below(i % 2 ? 200000 : 64);
            const int p0 = g_rng.below((1 << 28) - T);
            const stillk::call_geom g = stillk::make_geom(p0, T, C);
            const stillk::call_geom f = stillk::make_geom_fd(p0, T, C, stillk::make_fast_div(C));
            geo_n++;
            if (g.c_first != f.c_first || g.c_last != f.c_last || g.leave_first != f.leave_first ||
                g.n_leaves != f.n_leaves || g.ring_lo != f.ring_lo || g.end_lo != f.end_lo) {
                if (geo_bad++ < 5) printf("  make_geom_fd differs: C=%d p0=%d T=%d\n", C, p0, T);
            }
        }
    report(geo_bad == 0, "selftest: make_geom_fd against make_geom up to 2^28 tokens (%d cases, %d wrong)", geo_n,
           geo_bad);

    /* the fast division (make_fast_div, fdiv) against the division: every divisor up to 1,100 and powers of
     * two and their neighbours up to 2^30, each with the edge numerators (0, multiples of d and their
     * neighbours, 2^31 - 1) and random ones */
    long long checked = 0, wrong = 0;
    std::vector<int> divisors;
    for (int d = 1; d <= 1100; d++) divisors.push_back(d);
    for (int e = 11; e <= 30; e++)
        for (int o = -1; o <= 1; o++) divisors.push_back((1 << e) + o);
    for (int d : divisors) {
        const stillk::fast_div f = stillk::make_fast_div(d);
        std::vector<long long> xs = {0, 1, (long long)d - 1, d, (long long)d + 1, 2LL * d - 1, 2LL * d, 2147483647LL,
                                     2147483647LL - 2147483647LL % d, 2147483647LL - 2147483647LL % d - 1};
        for (int i = 0; i < 200; i++) xs.push_back((long long)(g_rng.next() % 2147483648ULL));
        for (long long x : xs) {
            if (x < 0 || x > 2147483647LL) continue;
            checked++;
            if (stillk::fdiv((int)x, f) != (int)(x / d)) {
                if (wrong++ < 5) printf("  fdiv wrong: %lld / %d gave %d\n", x, d, stillk::fdiv((int)x, f));
            }
        }
    }
    report(wrong == 0, "selftest: fast division against the division (%lld cases, %lld wrong)", checked, wrong);
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
    bool selftest = false;
    int device = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cpu-selftest")) selftest = true;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) g_rng.s = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) g_only = argv[++i];
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) device = atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s [--seed N] [--only NAME] [--device N]   GPU kernels against CPU references\n"
                    "       %s --cpu-selftest                          the CPU side only (no GPU)\n",
                    argv[0], argv[0]);
            return 2;
        }
    }
    if (selftest) {
        selftest_bf16();
        selftest_fragments();
        selftest_decomposition();
        selftest_emulation();
        selftest_still();
    } else {
        char info[1024];
        stc_device_info(info, sizeof info);
        printf("%s\n", info);
        if (stc_ctx_create(device, &g_ctx, &g_err)) {
            report(false, "stc_ctx_create(%d): %s", device, g_err.msg);
        } else {
            if (selected("dequant")) test_dequant();
            if (selected("embed")) test_embed();
            if (selected("gemm")) test_gemm();
            if (selected("rmsnorm")) test_rmsnorm();
            if (selected("rope")) test_rope(), test_rope_ld();
            if (selected("swiglu")) test_swiglu();
            if (selected("gemv")) test_gemv();
            if (selected("add") || selected("convert")) test_add_convert();
            if (selected("argmax")) test_argmax();
            if (selected("attn")) test_attention();
            if (selected("errors")) test_errors();
            if (selected("still-small")) test_still_small();
            if (selected("still-lm-route")) test_still_lm_route();
            if (selected("flash-train")) test_flash_train();
            if (selected("still-train")) test_still_train();
            if (selected("still-long")) test_still_long();
            if (selected("still-fused")) test_still_fused();
            if (selected("liger")) test_liger();
            stc_ctx_free(g_ctx);
        }
    }
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
