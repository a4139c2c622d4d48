/* Groups still-small and still-long: stc_still_forward against the double reference of still_ref.hpp per
 * (token, head) row, the selections exactly, every split of a sequence against the one-call run. */
#include "still_harness.cuh"
#include "test_groups.cuh"

static void run_still_case(const still_case &sc, bool all_schedules) {
    stc_still_info info;
    if (!API(stc_still_resolve(&sc.cfg, &info, &g_err))) return;
    const std::string label = still_label(sc, info);
    const still_seq s = make_still_seq(sc.cfg, sc.L);
    const still_ref_result ref = ref_still(sc.cfg, info, s);
    /* saliency routing: the selection also against the spec's explicit formula (not the closed form f(p) that
     * the engines and ref_still use); one schedule, the whole sequence at once */
    const bool vs_spec = sc.cfg.routing == 0;
    const still_ref_result ref_spec = vs_spec ? ref_still(sc.cfg, info, s, true) : still_ref_result();
    stc_still *st = NULL;
    if (!API(stc_still_create(g_ctx, &sc.cfg, &st, &g_err))) return;
    std::vector<std::vector<int>> scheds = {sched_one(sc.L), sched_random(sc.L, sc.cfg.chunk)};
    if (all_schedules) scheds.push_back(sched_singles(sc.L, 0));
    scheds.push_back(sched_singles(sc.L, 1 + g_rng.below(sc.L - 1)));
    /* the single steps once more through the chunk-parallel kernels */
    const size_t n_decode_on = scheds.size();
    scheds.push_back(sched_singles(sc.L, 0));
    std::vector<float> y0;
    for (size_t i = 0; i < scheds.size(); i++) {
        /* the last schedule with decode kernels takes its positions from the device counter */
        const bool dev = i + 1 == n_decode_on, decode_kernels = i < n_decode_on;
        stc_still_set_decode_kernels(st, decode_kernels);
        bool singles = false;
        for (int T : scheds[i]) singles |= T == 1;
        std::vector<float> y;
        std::vector<std::vector<int>> sel;
        const std::string name = label + ", " + sched_name(scheds[i]) + (dev ? " (device positions)" : "") +
                                 (singles && !decode_kernels ? " (chunk-parallel kernels)" : "");
        if (!run_still_gpu(st, s, scheds[i], dev, y, sel)) continue;
        check_rows(name.c_str(), y, ref.y, s.L * s.H, s.D, 1e-2);
        check_selection((name + ": selection").c_str(), sel, ref, info.n_sel_heads);
        if (vs_spec && i == 0)
            check_selection((name + ": selection against the spec's explicit saliency formula").c_str(), sel, ref_spec,
                            info.n_sel_heads);
        if (i == 1 || i + 1 == n_decode_on) {
            /* the same schedule again with the outputs in bf16 from the kernels that finish them: the
             * fp32 run's outputs rounded to bf16 (each within one bf16 step, to allow for a different
             * summation order between two runs; NaN-poisoned first, so an unwritten element fails) */
            std::vector<float> scratch;
            std::vector<std::vector<int>> sel_b;
            std::vector<uint16_t> yb;
            if (run_still_gpu(st, s, scheds[i], dev, scratch, sel_b, &yb)) {
                size_t same = 0, near = 0;
                for (size_t e = 0; e < y.size(); e++) {
                    const uint16_t want = f2bf(y[e]);
                    same += yb[e] == want;
                    const bool nan = (yb[e] & 0x7f80) == 0x7f80 && (yb[e] & 0x7f);
                    near += !nan && (yb[e] == want || (((yb[e] ^ want) & 0x8000) == 0 &&
                                                       (yb[e] > want ? yb[e] - want : want - yb[e]) == 1));
                }
                report(near == y.size(), "%s: bf16 outputs from the kernels vs the fp32 run rounded: %zu of %zu "
                       "bit-identical, %zu more one bf16 step apart", (name + ", bf16 out").c_str(), same, y.size(),
                       near - same);
            }
        }
        if (i == 0 && sc.cfg.sel_q8) {
            /* not vacuous: the 8-bit store moves the exact reference's outputs by far more than the GPU's
             * rounding, and the GPU must sit next to the 8-bit reference, not the exact one */
            stc_still_config ex = sc.cfg;
            ex.sel_q8 = 0;
            const still_ref_result rx = ref_still(ex, info, s);
            double n8 = 0, nx = 0, d = 0;
            for (size_t e = 0; e < y.size(); e++)
                n8 += (y[e] - ref.y[e]) * (y[e] - ref.y[e]), nx += (y[e] - rx.y[e]) * (y[e] - rx.y[e]), d += rx.y[e] * rx.y[e];
            report(n8 * 4 < nx, "%s: whole output against the 8-bit reference %.2e, against the exact one %.2e (at most half)",
                   name.c_str(), sqrt(n8 / d), sqrt(nx / d));
        }
        if (i == 0) {
            y0 = y;
            continue;
        }
        /* splits against the one-call run. Through the chunk-parallel
         * kernels only the gate GEMM's shape differs (cuBLASLt may sum in
         * another order): 1e-4. Single steps through the decode kernels
         * (attn_still_decode.cu) sum the logits and o in another order; a
         * weight that lands on the other side of a half rounding moves by
         * 2^-11: 2e-3, a fifth of the bar against the exact reference. */
        std::vector<double> a(y0.begin(), y0.end());
        size_t same = 0;
        for (size_t e = 0; e < y.size(); e++) same += f2u(y[e]) == f2u(y0[e]);
        char b[64];
        snprintf(b, sizeof b, " vs one call (%.1f%% bit-identical)", 100.0 * same / y.size());
        check_rows((name + b).c_str(), y, a, s.L * s.H, s.D, singles && decode_kernels ? 2e-3 : 1e-4);
    }
    stc_still_set_decode_kernels(st, 1);
    stc_still_free(st);
}

/* SmolLM2: long enough for Sel to hold many entries; then a small budget
 * that fills (the last chunk partially selected) and caps; per KV head. */
void test_still_long(void) {
    run_still_case({"SmolLM2", still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), 1500}, false);
    run_still_case({"SmolLM2 small budget", still_cfg(9, 3, 64, 576, 64, 2 * 64 + 40, 6, 8192), 1500}, false);
    stc_still_config c = still_cfg(9, 3, 64, 576, 64, 896, 6, 8192);
    c.per_kv_head = 1;
    run_still_case({"SmolLM2", c, 900}, false);
    c.gate_den = 1;
    run_still_case({"SmolLM2 gate_den", c, 900}, false);
    c = still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), c.per_kv_head = 1, c.sel_q8 = 1;
    run_still_case({"SmolLM2 q8", c, 1500}, false);
}

/* Small shapes with every option, a shared workspace, the refusals. */
void test_still_small(void) {
    for (const still_case &c : still_small_cases()) run_still_case(c, true);
    run_still_case({"lolcats small", lolcats_cfg(4, 2, 16, 4096), 300}, true);
    run_still_case({"lolcats SmolLM2 shape", lolcats_cfg(9, 3, 64, 8192), 700}, true);

    /* a shared workspace, and the registered bf16 gate matrix */
    {
        const stc_still_config cfg = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096);
        stc_still_info info;
        stc_still *a = NULL, *b = NULL;
        if (API(stc_still_resolve(&cfg, &info, &g_err)) && API(stc_still_create(g_ctx, &cfg, &a, &g_err)) &&
            API(stc_still_create(g_ctx, &cfg, &b, &g_err)) && API(stc_still_share_workspace(b, a, &g_err)) &&
            API(stc_still_reserve(g_ctx, a, 512, &g_err))) {
            const still_seq s = make_still_seq(cfg, 200);
            const still_ref_result ref = ref_still(cfg, info, s);
            const size_t HD = (size_t)cfg.n_head * cfg.head_dim, nwg = HD * cfg.d_model;
            dbuf wg(nwg * 2), wsrc(nwg * 4);
            std::vector<float> w(s.params.begin() + 2 * HD + 2 * HD * cfg.head_dim,
                                 s.params.begin() + 2 * HD + 2 * HD * cfg.head_dim + nwg);
            if (wg.ok() && wsrc.ok() && upload(wsrc, w) &&
                API(stc_f32_to_bf16(g_ctx, wsrc.as<float>(), wg.as<stc_bf16>(), (int64_t)nwg, &g_err))) {
                stc_still_set_gate_bf16(b, wg.as<stc_bf16>());
                std::vector<float> y;
                std::vector<std::vector<int>> sel;
                const std::vector<int> sc = sched_random(200, cfg.chunk);
                if (run_still_gpu(b, s, sc, false, y, sel))
                    check_rows("still: a second state sharing the first's workspace, registered bf16 gate matrix", y,
                               ref.y, s.L * s.H, s.D, 1e-2);
                stc_still_set_gate_bf16(b, NULL);
            }
        }
        stc_still_free(b);
        stc_still_free(a);
    }

    /* refusals */
    still_err e = {};
    stc_still *st = NULL;
    stc_still_config c2 = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096);
    c2.feature_map = 1, c2.feature_dim = 64;
    int rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && strstr(e.msg, "hedgehog"), "still: hedgehog refused: %s", e.msg);
    c2 = still_cfg(4, 2, 96, 96, 16, 56, 3, 4096);
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && strstr(e.msg, "head dim"), "still: head dim 96 refused: %s", e.msg);
    c2 = still_cfg(4, 2, 64, 96, 256, 0, 3, 4096);
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_UNSUPPORTED && strstr(e.msg, "chunk"), "still: chunk 256 refused: %s", e.msg);
    c2 = still_cfg(4, 2, 64, 96, 16, 20, 3, 4096);
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "budget"), "still: budget below 2C refused: %s", e.msg);
    c2 = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096), c2.gate = 0, c2.gate_den = 1;
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "gate-den"), "still: gate_den without the gate refused: %s", e.msg);
    c2 = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096), c2.linear = 0, c2.gate_den = 1;
    rc = stc_still_create(g_ctx, &c2, &st, &e);
    report(rc == STILL_E_ARG && strstr(e.msg, "gate-den"), "still: gate_den without the linear branch refused: %s",
           e.msg);
    c2 = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096);
    if (API(stc_still_create(g_ctx, &c2, &st, &e))) {
        rc = stc_still_forward(g_ctx, st, NULL, NULL, NULL, NULL, NULL, 1, 5, NULL, &e);
        report(rc == STILL_E_STATE && strstr(e.msg, "input starts at 5"), "still: wrong p0 refused: %s", e.msg);
        report(stc_still_state_bytes(st) > 0, "still: state bytes %zu", stc_still_state_bytes(st));
        stc_still_free(st);
    }
}
