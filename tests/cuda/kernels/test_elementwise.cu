/* Groups rmsnorm, rope (stc_rope, stc_rope_at_ld), swiglu, add, convert (fp32 -> bf16) and argmax:
 * cuda/kernels/elementwise.cu. */
#include "harness.cuh"
#include "ref.cuh"
#include "test_groups.cuh"

void test_rmsnorm(void) {
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

void test_rope(void) {
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
void test_rope_ld(void) {
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

void test_swiglu(void) {
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

void test_add_convert(void) {
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

void test_argmax(void) {
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
