/* --cpu-selftest, still's side. */
#include "still_harness.cuh"
#include "test_groups.cuh"

/* still: the CPU emulation of the GPU kernels (tests/cuda/still_ref.hpp)
 * against the double reference, for every split schedule; then the
 * layout's geometry against a token-by-token simulation. */
void selftest_still(void) {
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
