/* Group still-fused: stc_still_forward_qkv (q, k, v and the gate's pre-activations from one fused matrix),
 * the kernel variants a user may switch off, the paths of long calls. */
#include "still_harness.cuh"
#include "test_groups.cuh"

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

void test_still_fused(void) {
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
