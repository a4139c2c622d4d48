/* The harness of test_cuda_kernels (the program: test_main.cu): the pass / fail count and --only's groups,
 * random numbers, bf16 and half on the host, device buffers, the comparisons, call schedules. Defined in
 * harness.cu; the conversions and the templates here. Every file of the program includes this first. */
#ifndef STILL_TESTS_CUDA_HARNESS_CUH
#define STILL_TESTS_CUDA_HARNESS_CUH

#include "still_cuda.h"

extern "C" {
#include "format/quant.h"
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

extern int g_pass, g_fail;
extern const char *g_only;   /* --only NAME */
extern stc_ctx *g_ctx;
extern still_err g_err;

/* One line per check: "ok  " or "FAIL", then the text; counts it. */
void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Whether --only selects the group (no --only: all). */
bool selected(const char *group);
/* A failing API call is a failed check (with still_err's message). */
bool api_ok(int rc, const char *what);
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
extern rng g_rng;   /* seed 12345, or --seed N */

/* ---- bf16 on the host --------------------------------------------------------------------- */

/* fp32 -> bf16, round to nearest, ties to even (NaN stays a quiet NaN). */
inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
inline float bf2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* fp32 -> IEEE half, round to nearest, ties to even (overflow to inf, subnormals below 2^-14, NaN as CUDA's 0x7fff). */
inline uint16_t f2h(float f) {
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
inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

std::vector<uint16_t> rand_bf16(size_t n, double scale);
std::vector<float> rand_f32(size_t n, double scale);
/* Keys as a model's are: a common part per (sequence, KV head) beside the random one (rows [B·T][Hk·64]). */
void add_key_offset(std::vector<float> &k, int B, int T, int Hk, double scale);

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

/* rel = ||g - r|| / ||r|| (zero_scale: see harness.cu); fails on a non-finite g. */
bool check_rel(const char *name, const std::vector<double> &g, const std::vector<double> &r, double tol,
               double zero_scale = 0);
std::vector<double> to_double(const std::vector<float> &v);
std::vector<double> bf_to_double(const std::vector<uint16_t> &v);

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

/* Per (token, head) row of D values: the worst row's rel error must be below tol. */
bool check_rows(const char *name, const std::vector<float> &g, const std::vector<double> &r, int rows, int D,
                double tol);

/* ---- call schedules (token counts summing to L: the still and liger groups) ------------------------ */

std::vector<int> sched_one(int L);
std::vector<int> sched_singles(int L, int prefill);
/* random pieces of 1 .. 3C tokens: boundaries anywhere, chunks crossed */
std::vector<int> sched_random(int L, int C);
std::string sched_name(const std::vector<int> &s);

#endif
