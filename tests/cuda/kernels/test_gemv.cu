/* Group gemv: the decode step's matrix-vector products (stc_gemv, stc_gemv_swiglu, stc_gemv_qkv). */
#include "harness.cuh"
#include "ref.cuh"
#include "test_groups.cuh"

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

void test_gemv(void) {
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
