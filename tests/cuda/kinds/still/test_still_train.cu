/* Group still-train: the fused still training attention (stc_still_train_fwd / _bwd). */
#include "harness.cuh"
#include "test_groups.cuh"

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

void test_still_train(void) {
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
