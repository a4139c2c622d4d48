/* Group liger: the linear branch (stc_liger_forward) against its recurrence in double. */
#include "harness.cuh"
#include "test_groups.cuh"

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

void test_liger(void) {
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
