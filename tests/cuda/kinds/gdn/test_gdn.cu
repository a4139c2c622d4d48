/* Group gdn: the gdn kind's forward on the GPU (stc_gdn_forward) against tests/ref/attn_gdn_ref.c, the float64
 * token-by-token reference written from the spec (the explicit matrix I − β k̂ k̂ᵀ, the output's norm and gate). */
#include "harness.cuh"
#include "test_groups.cuh"

extern "C" {
#include "attn_gdn_ref.h"
#include "kinds/gdn/attn_gdn_rules.h"
}

/* Random parameters in the rules' layout, scaled so that β and α spread over (0, 1) and the gate varies. */
static std::vector<double> rand_params(int H, int Hk, int d, int D, int conv) {
    std::vector<float> r = rand_f32(gdn_par_count_conv(H, Hk, d, D, conv), 1.0);
    std::vector<double> p(r.size());
    for (size_t i = 0; i < r.size(); i++) p[i] = r[i] * 0.3;
    for (int hk = 0; hk < Hk; hk++) {
        p[gdn_par_balpha(Hk, d) + hk] = gdn_softplus_inv(gdn_init_dt(hk, Hk)) + r[hk];
        p[gdn_par_alog(Hk, d) + hk] = log(gdn_init_a(hk, Hk));
    }
    for (int x = 0; x < D; x++) p[gdn_par_wnorm(Hk, d) + x] = 1.0 + r[x] * 0.5;
    for (size_t i = 0; conv > 0 && i < (size_t)conv * (H + 2 * Hk) * D; i++)   /* the identity, every tap moved */
        p[gdn_par_conv(H, Hk, d, D) + i] = (i % conv == (size_t)conv - 1 ? 1.0 : 0.0) + 0.4 * r[i];
    return p;
}

/* One sequence of L tokens through a fresh state in calls of sched's sizes, with a workspace of ws_tokens
 * tokens (0: enough for the longest call): every (token, head) row of the fp32 output to 2e-4 of the
 * reference, and the bf16 output's rows to bf16 rounding. */
static void run_gdn_case(int H, int Hk, int D, int d, int L, const std::vector<int> &sched, int ws_tokens,
                         double kscale, int norm, int conv = 0) {
    char name[160];
    snprintf(name, sizeof name, "gdn H=%d Hk=%d D=%d d=%d L=%d, %s%s%s", H, Hk, D, d, L, sched_name(sched).c_str(),
             ws_tokens ? ", small workspace" : "", norm ? "" : ", no output norm");
    if (conv) snprintf(name + strlen(name), sizeof name - strlen(name), ", conv %d", conv);
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D, ld = qd + 2 * (size_t)Hk;
    std::vector<float> q = rand_f32((size_t)L * qd, 1.5), k = rand_f32((size_t)L * kvd, kscale),
                       v = rand_f32((size_t)L * kvd, 1.0), x = rand_f32((size_t)L * d, 1.0);
    const std::vector<double> p = rand_params(H, Hk, d, D, conv);
    /* the caller's products: W_g x | w_β x | w_α x per token (without biases) */
    std::vector<float> pre((size_t)L * ld), pf(p.size());
    for (size_t i = 0; i < p.size(); i++) pf[i] = (float)p[i];
    for (int t = 0; t < L; t++)
        for (size_t r = 0; r < ld; r++) {
            const double *w = r < qd ? &p[gdn_par_wg(Hk, d, D) + r * d]
                              : r < qd + Hk ? &p[gdn_par_wbeta(Hk, d) + (r - qd) * d]
                                            : &p[gdn_par_walpha(Hk, d) + (r - qd - Hk) * d];
            double s = 0;
            for (int i = 0; i < d; i++) s += w[i] * x[(size_t)t * d + i];
            pre[(size_t)t * ld + r] = (float)s;
        }
    std::vector<double> ref((size_t)L * qd);
    attn_config c = {};
    c.kind = ATTN_GDN, c.n_head = H, c.n_head_kv = Hk, c.head_dim = D, c.d_model = d, c.n_ctx = L, c.norm = norm, c.conv = conv;
    attn_io io = {};
    io.q_nope = q.data(), io.k_nope = k.data(), io.v = v.data(), io.x = x.data(), io.T = L;
    attn_gdn_forward_ref(&c, p.data(), &io, ref.data());
    int longest = 0;
    for (int n : sched) longest = std::max(longest, n);
    const size_t ws_bytes = stc_gdn_workspace_bytes(H, Hk, D, ws_tokens ? ws_tokens : longest);
    dbuf dq(q.size() * 4), dk(k.size() * 4), dv(v.size() * 4), dpre(pre.size() * 4), dp(pf.size() * 4),
        dout(q.size() * 4), dob(q.size() * 2), dws(ws_bytes);
    stc_gdn *st = NULL;
    if (!dq.ok() || !dk.ok() || !dv.ok() || !dpre.ok() || !dp.ok() || !dout.ok() || !dob.ok() || !dws.ok()) return;
    if (!API(stc_gdn_create(g_ctx, H, Hk, D, d, norm, conv, &st, &g_err))) return;
    bool ok = upload(dq, q) && upload(dk, k) && upload(dv, v) && upload(dpre, pre) && upload(dp, pf) && dws.poison();
    int t0 = 0;
    for (size_t i = 0; i < sched.size() && ok; i++) {
        ok = API(stc_gdn_forward(g_ctx, st, dp.as<float>(), dq.as<float>() + (size_t)t0 * qd,
                                 dk.as<float>() + (size_t)t0 * kvd, dv.as<float>() + (size_t)t0 * kvd,
                                 dpre.as<float>() + (size_t)t0 * ld, (int)ld, sched[i], dws.p, ws_bytes,
                                 dout.as<float>() + (size_t)t0 * qd, (stc_bf16 *)dob.p + (size_t)t0 * qd, &g_err));
        t0 += sched[i];
    }
    std::vector<float> got(q.size());
    std::vector<uint16_t> gotb(q.size());
    if (ok && download(got, dout) && download(gotb, dob)) {
        check_rows(name, got, ref, L * H, D, 2e-4);
        std::vector<float> fb(gotb.size());
        for (size_t i = 0; i < gotb.size(); i++) fb[i] = bf2f(gotb[i]);
        std::string bn = std::string(name) + ": bf16 output";
        check_rows(bn.c_str(), fb, ref, L * H, D, 8e-3);
        report(stc_gdn_n_seen(st) == L, "%s: %d tokens seen", name, stc_gdn_n_seen(st));
    }
    stc_gdn_free(st);
}

void test_gdn(void) {
    run_gdn_case(9, 3, 64, 96, 300, sched_one(300), 0, 1.0, 1);            /* the model's heads; chunks and a tail */
    run_gdn_case(9, 3, 64, 96, 300, sched_random(300, 64), 0, 1.0, 1);     /* calls of any length */
    run_gdn_case(9, 3, 64, 96, 150, sched_singles(150, 70), 0, 1.0, 1);    /* decode steps after a prefill */
    run_gdn_case(9, 3, 64, 96, 400, sched_one(400), 128, 1.0, 1);          /* segments of 128 tokens */
    run_gdn_case(4, 2, 128, 64, 200, sched_random(200, 64), 0, 1.0, 1);    /* head dim 128 */
    run_gdn_case(8, 1, 64, 32, 130, sched_one(130), 0, 0.0, 1);            /* zero keys: the L2 norm's floor */
    run_gdn_case(9, 3, 64, 96, 300, sched_random(300, 64), 0, 1.0, 0);     /* without the output norm (plan key norm) */
    run_gdn_case(9, 3, 64, 96, 150, sched_singles(150, 70), 0, 1.0, 0);
    run_gdn_case(9, 3, 64, 96, 300, sched_one(300), 0, 1.0, 0, 4);          /* the short convolution: one call, */
    run_gdn_case(9, 3, 64, 96, 300, sched_random(300, 64), 0, 1.0, 0, 4);   /* its history across calls, */
    run_gdn_case(9, 3, 64, 96, 150, sched_singles(150, 70), 0, 1.0, 1, 3);  /* decode steps, */
    run_gdn_case(9, 3, 64, 96, 400, sched_one(400), 128, 1.0, 0, 4);        /* segments */
    /* shapes and arguments it does not take */
    still_err e = {};
    stc_gdn *st = NULL;
    int rc = stc_gdn_create(g_ctx, 9, 3, 96, 576, 1, 0, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && !st, "gdn with head dim 96 refused: %s", e.msg);
    rc = stc_gdn_create(g_ctx, 9, 4, 64, 576, 1, 0, &st, &e);
    report(rc == STILL_E_ARG && !st, "gdn with 9 heads over 4 KV heads refused: %s", e.msg);
    rc = stc_gdn_create(g_ctx, 9, 3, 64, 576, 1, 9, &st, &e);
    report(rc == STILL_E_ARG && !st && strstr(e.msg, "conv"), "gdn with a convolution of width 9 refused: %s", e.msg);
    if (API(stc_gdn_create(g_ctx, 9, 3, 64, 576, 1, 0, &st, &g_err))) {
        dbuf tiny(1024);
        rc = stc_gdn_forward(g_ctx, st, (float *)16, (float *)16, (float *)16, (float *)16, (float *)16, 582, 100,
                             tiny.p, 1024, (float *)16, NULL, &e);
        report(rc == STILL_E_ARG && strstr(e.msg, "workspace"), "gdn with a 1 KiB workspace refused: %s", e.msg);
        rc = stc_gdn_forward(g_ctx, st, (float *)16, (float *)16, (float *)16, (float *)16, (float *)16, 500, 1,
                             tiny.p, 1024, (float *)16, NULL, &e);
        report(rc == STILL_E_ARG && strstr(e.msg, "pre-activation"), "gdn with short pre-activation rows refused: %s",
               e.msg);
        stc_gdn_free(st);
    }
}
