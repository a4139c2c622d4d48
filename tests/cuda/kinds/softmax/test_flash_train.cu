/* Group flash-train: the fused softmax training attention (stc_flash_train_fwd / _bwd). */
#include "harness.cuh"
#include "test_groups.cuh"

/* The fused training attention (cuda/kinds/softmax/attn_softmax_train.cu) against the definition in double on the host:
 * O = softmax(s Q Kᵀ) V (causal, a window for swa, grouped heads), lse, and the backward's dQ, dK, dV for a random
 * dO; bf16 products, so within 2e-2 relative. Run twice: the same bits (no atomics). */
void test_flash_train(void) {
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
