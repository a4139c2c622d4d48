/* The harness of test_cuda_kernels (harness.cuh). */
#include "harness.cuh"

/* ---- harness ------------------------------------------------------------------------- */

int g_pass, g_fail;
const char *g_only;
stc_ctx *g_ctx;
still_err g_err;

void report(bool ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s  ", ok ? "ok  " : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    (ok ? g_pass : g_fail)++;
}

bool selected(const char *group) { return !g_only || strstr(group, g_only); }

/* A failing API call is a failed check (with still_err's message). */
bool api_ok(int rc, const char *what) {
    if (rc == 0) return true;
    report(false, "%s returned %d: %s", what, rc, g_err.msg);
    return false;
}

/* ---- random numbers ---------------------------------------------------------------------- */

rng g_rng = {12345};

std::vector<uint16_t> rand_bf16(size_t n, double scale) {
    std::vector<uint16_t> v(n);
    for (auto &x : v) x = f2bf((float)(g_rng.normal() * scale));
    return v;
}
std::vector<float> rand_f32(size_t n, double scale) {
    std::vector<float> v(n);
    for (auto &x : v) x = (float)(g_rng.normal() * scale);
    return v;
}

/* Keys as a model's are: a common part per (sequence, KV head) beside the random one (rows [B·T][Hk·64]). */
void add_key_offset(std::vector<float> &k, int B, int T, int Hk, double scale) {
    for (int b = 0; b < B; b++)
        for (int hk = 0; hk < Hk; hk++) {
            std::vector<float> c(64);
            for (auto &x : c) x = (float)(g_rng.normal() * scale);
            for (int t = 0; t < T; t++)
                for (int x = 0; x < 64; x++) k[(((size_t)b * T + t) * Hk + hk) * 64 + x] += c[(size_t)x];
        }
}

/* ---- comparisons --------------------------------------------------------------------------- */

/* rel = ||g - r|| / ||r||; when ||r|| = 0, against zero_scale if one is given (the size of the terms whose sum is
 * exactly zero, e.g. a softmax's gradient with respect to its only key), else the absolute norm; fails on a
 * non-finite g. */
bool check_rel(const char *name, const std::vector<double> &g, const std::vector<double> &r, double tol,
                      double zero_scale) {
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

std::vector<double> to_double(const std::vector<float> &v) { return std::vector<double>(v.begin(), v.end()); }
std::vector<double> bf_to_double(const std::vector<uint16_t> &v) {
    std::vector<double> d(v.size());
    for (size_t i = 0; i < v.size(); i++) d[i] = bf2f(v[i]);
    return d;
}

/* Per (token, head) row: rel = ||g - r|| / ||r||; the worst row must be
 * below tol; also reports the whole-output rel error. Non-finite values fail. */
bool check_rows(const char *name, const std::vector<float> &g, const std::vector<double> &r, int rows, int D,
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

/* ---- call schedules -------------------------------------------------------------------------- */

/* Call schedules (token counts summing to L). */
std::vector<int> sched_one(int L) { return {L}; }
std::vector<int> sched_singles(int L, int prefill) {
    std::vector<int> r;
    if (prefill > 0) r.push_back(prefill);
    for (int t = prefill; t < L; t++) r.push_back(1);
    return r;
}
/* random pieces of 1 .. 3C tokens: boundaries anywhere, chunks crossed */
std::vector<int> sched_random(int L, int C) {
    std::vector<int> r;
    for (int t = 0; t < L;) {
        int n = 1 + g_rng.below(g_rng.below(4) ? 3 * C : 3);
        if (n > L - t) n = L - t;
        r.push_back(n);
        t += n;
    }
    return r;
}
std::string sched_name(const std::vector<int> &s) {
    if (s.size() == 1) return "one call";
    int ones = 0;
    for (int n : s) ones += n == 1;
    char b[96];
    if (ones == (int)s.size()) snprintf(b, sizeof b, "%zu single steps", s.size());
    else if (ones == (int)s.size() - 1 && s[0] > 1) snprintf(b, sizeof b, "prefill %d + %d single steps", s[0], ones);
    else snprintf(b, sizeof b, "%zu random calls", s.size());
    return b;
}
