/* The still groups' shared parts (still_harness.cuh). */
#include "still_harness.cuh"

/* ---- still attention -------------------------------------------------------------------------- */

stc_still_config still_cfg(int H, int Hk, int D, int d, int C, int budget, int lambda, int n_ctx) {
    stc_still_config c;
    memset(&c, 0, sizeof c);
    c.n_head = H, c.n_head_kv = Hk, c.head_dim = D, c.d_model = d, c.chunk = C, c.budget = budget, c.lambda = lambda;
    c.n_ctx = n_ctx, c.routing = 0, c.linear = 1, c.feature_map = 0, c.gate = 1, c.seed = 7;
    return c;
}

/* lolcats on the still kernels (GPU only: the CPU emulation of --cpu-selftest is still's) */
stc_still_config lolcats_cfg(int H, int Hk, int C, int n_ctx) {
    stc_still_config c = still_cfg(H, Hk, 64, 96, C, 0, 0, n_ctx);
    c.routing = 5, c.gate = 0, c.feature_map = 1, c.feature_dim = 64, c.lolcats = 1;
    return c;
}

/* Random inputs: q, k, v ~ N(0, 1), x bf16 ~ N(0, 1), NP-Map u ~ N(0, 1) and W
 * kaiming-uniform (as the CPU initialises them), a gate that is neither
 * closed nor saturated (Wg ~ N(0, 1/d), bg ~ N(1, 0.5²)). */
still_seq make_still_seq(const stc_still_config &c, int L) {
    still_seq s;
    s.L = L, s.H = c.n_head, s.Hk = c.n_head_kv, s.D = c.head_dim, s.d = c.d_model > 0 ? c.d_model : 1;
    const size_t H = s.H, D = s.D, HD = H * D;
    s.q = rand_f32((size_t)L * HD, 1.0);
    s.k = rand_f32((size_t)L * s.Hk * D, 1.0);
    s.v = rand_f32((size_t)L * s.Hk * D, 1.0);
    s.x = rand_bf16((size_t)L * s.d, 1.0);
    if (c.lolcats) {   /* hq_W, hk_W [H][D][D] (kaiming-uniform), w [H] */
        s.params.assign(2 * HD * D + H, 0.0f);
        const double b = sqrt(6.0 / (double)D);
        for (size_t i = 0; i < 2 * HD * D; i++) s.params[i] = (float)((2 * g_rng.uniform() - 1) * b);
        for (size_t i = 0; i < H; i++) s.params[2 * HD * D + i] = (float)(-1.0 + g_rng.normal());
        return s;
    }
    s.params.assign(2 * HD + 2 * HD * D + (c.gate ? HD * s.d + HD : 0), 0.0f);
    float *p = s.params.data();
    for (size_t i = 0; i < 2 * HD; i++) p[i] = (float)g_rng.normal();
    const double b = sqrt(6.0 / (double)(D * D));
    for (size_t i = 0; i < 2 * HD * D; i++) p[2 * HD + i] = (float)((2 * g_rng.uniform() - 1) * b);
    if (c.gate) {
        float *wg = p + 2 * HD + 2 * HD * D, *bg = wg + HD * s.d;
        for (size_t i = 0; i < HD * (size_t)s.d; i++) wg[i] = (float)(g_rng.normal() / sqrt((double)s.d));
        for (size_t i = 0; i < HD; i++) bg[i] = (float)(1.0 + 0.5 * g_rng.normal());
    }
    return s;
}

/* Sel positions equal (per selection head, in Sel order); the first
 * difference is printed with the reference's ranking values. */
bool check_selection(const char *name, const std::vector<std::vector<int>> &got, const still_ref_result &ref,
                            int Hs) {
    int diff = 0, total = 0;
    char first[256] = "";
    for (int hs = 0; hs < Hs; hs++) {
        const std::vector<int> &a = got[hs], &b = ref.sel[hs];
        total += (int)b.size();
        if (a.size() != b.size()) {
            diff += (int)std::max(a.size(), b.size());
            if (!first[0]) snprintf(first, sizeof first, "head %d: %zu entries, expected %zu", hs, a.size(), b.size());
            continue;
        }
        for (size_t i = 0; i < a.size(); i++)
            if (a[i] != b[i]) {
                if (!diff++) {
                    const double va = a[i] >= 0 && a[i] < (int)(ref.rank.size() / Hs) ? ref.rank[(size_t)a[i] * Hs + hs] : NAN;
                    snprintf(first, sizeof first, "head %d entry %zu: position %d (score %.17g), expected %d (score %.17g)",
                             hs, i, a[i], va, b[i], ref.rank[(size_t)b[i] * Hs + hs]);
                }
            }
    }
    report(diff == 0, "%s: %d selected tokens, %d differ from the reference%s%s", name, total, diff, diff ? ": " : "",
           first);
    return diff == 0;
}

/* Runs a schedule on the GPU: outputs y [L][H][D] and the Sel positions;
 * with yb, through stc_still_forward_bf16 and its bf16 outputs into *yb
 * (y then holds the scratch). */
/* qkv non-NULL: the inputs from that fused matrix [L][ld] (q | k | v | gate pre-activations) through
 * stc_still_forward_qkv instead of s's packed q, k, v and x; with kv_f16 ([2][L][Hk·D] half: k, then v)
 * the half copies of k and v too; with tail > 0, each call's outputs wanted for its last tail rows only
 * (out_first = T - tail). */
bool run_still_gpu(stc_still *st, const still_seq &s, const std::vector<int> &sched,
                          bool device_pos, std::vector<float> &y, std::vector<std::vector<int>> &sel,
                          std::vector<uint16_t> *yb, const dbuf *qkv, int64_t ld,
                          const dbuf *kv_f16, int tail) {
    const size_t HD = (size_t)s.H * s.D, kvd = (size_t)s.Hk * s.D;
    dbuf dq(s.q.size() * 4), dk(s.k.size() * 4), dv(s.v.size() * 4), dx(s.x.size() * 2), dp(s.params.size() * 4 + 4),
        dout((size_t)s.L * HD * 4), dout_b(yb ? (size_t)s.L * HD * 2 : 2);
    if (!dq.ok() || !dk.ok() || !dv.ok() || !dx.ok() || !dp.ok() || !dout.ok() || !dout_b.ok() || !upload(dq, s.q) ||
        !upload(dk, s.k) || !upload(dv, s.v) || !upload(dx, s.x) || !upload(dp, s.params) || !dout.poison() ||
        !dout_b.poison())
        return false;
    if (!API(stc_still_reset(g_ctx, st, &g_err))) return false;
    int p0 = 0;
    for (int T : sched) {
        /* with device positions, decode steps also keep the promise a graph-recording caller makes:
         * the steps where no chunk leaves skip the leave and scan kernels */
        stc_still_set_decode_no_leave(st, device_pos && T == 1 && stc_still_leaves_at(st, p0, 1) == 0);
        const float *q = dq.as<float>() + (size_t)p0 * HD, *k = dk.as<float>() + (size_t)p0 * kvd,
                    *v = dv.as<float>() + (size_t)p0 * kvd;
        const stc_bf16 *x = dx.as<stc_bf16>() + (size_t)p0 * s.d;
        const int at = device_pos ? STC_STILL_P0_DEVICE : p0;
        const int rc = qkv ? stc_still_forward_qkv(g_ctx, st, dp.as<float>(), qkv->as<float>() + (size_t)p0 * ld, ld, T,
                                                   tail > 0 && T > tail ? T - tail : 0, at,
                                                   dout.as<float>() + (size_t)p0 * HD,
                                                   yb ? dout_b.as<stc_bf16>() + (size_t)p0 * HD : nullptr,
                                                   kv_f16 ? kv_f16->as<stc_f16>() + (size_t)p0 * kvd : nullptr,
                                                   kv_f16 ? kv_f16->as<stc_f16>() + (size_t)(s.L + p0) * kvd : nullptr,
                                                   &g_err)
                       : yb ? stc_still_forward_bf16(g_ctx, st, dp.as<float>(), q, k, v, x, T, at,
                                                   dout.as<float>() + (size_t)p0 * HD,
                                                   dout_b.as<stc_bf16>() + (size_t)p0 * HD, &g_err)
                          : stc_still_forward(g_ctx, st, dp.as<float>(), q, k, v, x, T, at,
                                              dout.as<float>() + (size_t)p0 * HD, &g_err);
        if (!api_ok(rc, "stc_still_forward")) return false;
        p0 += T;
    }
    stc_still_set_decode_no_leave(st, 0);
    y.assign((size_t)s.L * HD, 0.0f);
    if (!download(y, dout)) return false;
    if (yb) {
        yb->assign((size_t)s.L * HD, 0);
        if (!download(*yb, dout_b)) return false;
    }
    stc_still_info info;
    stc_still_get_info(st, &info);
    std::vector<int32_t> pos((size_t)info.n_sel_heads * std::max(info.cap, 1));
    std::vector<int> cnt(info.n_sel_heads);
    if (!API(stc_still_selected(g_ctx, st, pos.data(), cnt.data(), &g_err))) return false;
    sel.assign(info.n_sel_heads, std::vector<int>());
    for (int hs = 0; hs < info.n_sel_heads; hs++)
        for (int i = 0; i < cnt[hs]; i++) sel[hs].push_back(pos[(size_t)hs * info.cap + i]);
    int n = -1;
    if (!API(stc_still_n_seen(g_ctx, st, &n, &g_err))) return false;
    if (n != s.L) {
        report(false, "device position %d after %d tokens", n, s.L);
        return false;
    }
    return true;
}

static const char *const ROUTING_NAMES[] = {"saliency", "random", "keynorm", "qk", "position", "none"};

std::string still_label(const still_case &c, const stc_still_info &info) {
    const stc_still_config &f = c.cfg;
    char b[256];
    snprintf(b, sizeof b, "still %s: H=%d Hk=%d D=%d C=%d budget %d (cap %d, lambda %d) %s%s%s%s%s%s L=%d", c.name,
             f.n_head, f.n_head_kv, f.head_dim, f.chunk, f.budget, info.cap, info.lambda, ROUTING_NAMES[f.routing],
             f.per_kv_head ? " per-KV-head" : "", f.linear ? "" : " linear off", f.linear && !f.gate ? " gate off" : "",
             f.gate_den ? " gate_den" : "", f.sel_q8 ? " Sel q8" : "", c.L);
    return b;
}

/* The cases both the GPU test and the CPU emulation run (the GPU test adds
 * the long SmolLM2 ones). */
std::vector<still_case> still_small_cases(void) {
    std::vector<still_case> v;
    auto add = [&](const char *name, stc_still_config c, int L) { v.push_back({name, c, L}); };
    const stc_still_config base = still_cfg(4, 2, 64, 96, 16, 56, 3, 4096);   /* cap 24: full after 8 chunks */
    add("small", base, 300);
    stc_still_config c = base;
    c.per_kv_head = 1;
    add("small", c, 300);
    for (int r = 1; r <= 5; r++) {
        c = base, c.routing = r;
        add("small", c, 260);
    }
    c = base, c.linear = 0;
    add("small", c, 260);
    c = base, c.gate = 0;
    add("small", c, 260);
    /* the gate on the denominator's linear term too (per channel) */
    c = base, c.gate_den = 1;
    add("gate_den", c, 300);
    c = base, c.gate_den = 1, c.per_kv_head = 1;
    add("gate_den", c, 300);
    c = base, c.budget = 0, c.lambda = 2, c.n_ctx = 300;   /* uncapped */
    add("uncapped", c, 300);
    c = base, c.routing = 3, c.per_kv_head = 1;
    add("small", c, 200);
    add("odd chunk", still_cfg(6, 3, 64, 40, 24, 2 * 24 + 30, 4, 4096), 290);
    add("chunk 128", still_cfg(2, 1, 64, 64, 128, 2 * 128 + 64, 8, 8192), 800);
    add("head dim 128", still_cfg(4, 1, 128, 128, 32, 2 * 32 + 40, 4, 4096), 400);
    c = still_cfg(4, 1, 128, 128, 32, 2 * 32 + 40, 4, 4096), c.gate_den = 1;
    add("head dim 128 gate_den", c, 400);
    add("SmolLM2 shape", still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), 420);
    /* Sel in 8 bits (--sel-cache q8): against the reference with Sel's rows read back from 8 bits */
    c = base, c.sel_q8 = 1;
    add("q8", c, 300);
    c = base, c.sel_q8 = 1, c.per_kv_head = 1, c.gate_den = 1;
    add("q8", c, 300);
    c = base, c.sel_q8 = 1, c.linear = 0;
    add("q8", c, 260);
    c = still_cfg(4, 1, 128, 128, 32, 2 * 32 + 40, 4, 4096), c.sel_q8 = 1;
    add("head dim 128 q8", c, 400);
    c = still_cfg(9, 3, 64, 576, 64, 896, 6, 8192), c.sel_q8 = 1, c.per_kv_head = 1;
    add("SmolLM2 shape q8", c, 420);
    return v;
}
