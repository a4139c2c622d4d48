/* Group still-lm-route: the GPU fine-tune's routing (stc_still_lm_route). */
#include "kinds/still/attn_still_rules.h"

#include "harness.cuh"
#include "test_groups.cuh"

/* The GPU fine-tune's routing (stc_still_lm_route, cuda/train/train_lm_still.cu) against the rules written out on the
 * host: the scores, in double, from the definition (p = token j's softmax weight on itself over its window of C
 * keys, f(p) summed over a selection head's query heads), within 1e-5 relative; then the routing from the GPU's own
 * scores by the definitions (chunk: a leaving chunk's best min(λ, C, slots left) stay; global: a key leaves Sel at
 * the first query chunk where cap tokens of the chunks that have left rank above it; higher score first, ties to
 * the lower position), every key equal. Every third query row is zero in some cases: those tokens' p is 1 / C
 * exactly, so their scores tie and the tie rule decides. */
void test_still_lm_route(void) {
    struct rcase {
        int T, H, Hk, D, C, per_kv, global, lam, capped, cap, zero_rows;
    };
    const rcase cases[] = {
        {1, 9, 3, 64, 64, 1, 1, 6, 0, 384, 0},      {100, 9, 3, 64, 64, 1, 1, 6, 0, 0, 0},
        {1024, 9, 3, 64, 64, 1, 1, 6, 0, 384, 0},   {1024, 9, 3, 64, 64, 1, 1, 6, 0, 384, 1},
        {3000, 9, 3, 64, 48, 0, 1, 6, 0, 896, 1},   {2500, 4, 2, 32, 100, 1, 1, 6, 0, 7, 0},
        {1024, 9, 3, 64, 64, 1, 0, 6, 0, 896, 1},   {3000, 9, 3, 64, 48, 0, 0, 6, 1, 300, 1},
        {700, 4, 4, 64, 256, 1, 0, 40, 1, 600, 0},  {4096, 9, 3, 64, 128, 1, 1, 6, 0, 2048, 1},
    };
    for (const rcase &c : cases) {
        const int T = c.T, H = c.H, Hk = c.Hk, D = c.D, C = c.C, G = H / Hk, Hs = c.per_kv ? Hk : H;
        std::vector<float> q = rand_f32((size_t)T * H * D, 1.0), k = rand_f32((size_t)T * Hk * D, 1.0);
        if (c.zero_rows)
            for (int t = 0; t < T; t += 3) std::fill(q.begin() + (size_t)t * H * D, q.begin() + (size_t)(t + 1) * H * D, 0.0f);
        char name[160];
        snprintf(name, sizeof name, "still_lm_route T=%d H=%d/%d D=%d C=%d %s %s λ%d%s cap %d%s", T, H, Hk, D, C,
                 c.per_kv ? "per KV head" : "per head", c.global ? "global" : "chunk", c.lam, c.capped ? " capped" : "",
                 c.cap, c.zero_rows ? ", ties" : "");
        dbuf dq(q.size() * 4), dk(k.size() * 4), dsc((size_t)Hs * T * 8), dout((size_t)Hs * T * 4);
        if (!dq.ok() || !dk.ok() || !dsc.ok() || !dout.ok() || !upload(dq, q) || !upload(dk, k) || !dout.poison())
            continue;
        if (!api_ok(stc_still_lm_route(g_ctx, dq.as<float>(), dk.as<float>(), T, H, Hk, D, C, c.per_kv, c.global,
                                       c.lam, c.capped, c.cap, dsc.as<double>(), dout.as<int>(), &g_err),
                    name))
            continue;
        std::vector<double> sc((size_t)Hs * T);
        std::vector<int> out((size_t)Hs * T);
        if (!download(sc, dsc) || !download(out, dout)) continue;
        /* the scores by their definition */
        std::vector<double> want((size_t)Hs * T, 0.0);
        for (int hs = 0; hs < Hs; hs++)
            for (int j = 0; j < T; j++) {
                const int lo = j - C + 1 > 0 ? j - C + 1 : 0;
                for (int h = c.per_kv ? hs * G : hs; h < (c.per_kv ? hs * G + G : hs + 1); h++) {
                    std::vector<double> s((size_t)(j - lo + 1));
                    double mx = -INFINITY, sum = 0;
                    for (int l = lo; l <= j; l++) {
                        double d = 0;
                        for (int x = 0; x < D; x++)
                            d += (double)q[((size_t)j * H + h) * D + x] * k[((size_t)l * Hk + h / G) * D + x];
                        s[(size_t)(l - lo)] = d / sqrt((double)D);
                        mx = fmax(mx, s[(size_t)(l - lo)]);
                    }
                    for (double v : s) sum += exp(v - mx);
                    want[(size_t)hs * T + j] += still_saliency_of_p(exp(s.back() - mx) / sum);
                }
            }
        check_rel((std::string(name) + ": scores").c_str(), sc, want, 1e-5);
        /* the routing by its definition, from the GPU's scores */
        const int nc = (T + C - 1) / C;
        int differ = 0, first = -1;
        for (int hs = 0; hs < Hs; hs++) {
            const double *v = sc.data() + (size_t)hs * T;
            auto above = [&](int i, int j) { return v[i] > v[j] || (v[i] == v[j] && i < j); };
            std::vector<int> ref((size_t)T, INT_MAX);
            if (c.global) {
                for (int j = 0; j < T; j++) {
                    const int cj = j / C;
                    if (cj + 2 >= nc) continue;   /* its chunk never leaves Local */
                    if (c.cap == 0) {
                        ref[(size_t)j] = cj + 2;
                        continue;
                    }
                    int n_above = 0;
                    for (int i = 0; i < cj * C; i++) n_above += above(i, j);
                    for (int cq = cj + 2; cq < nc; cq++) {   /* query chunk cq: the chunks <= cq − 2 have left */
                        for (int i = (cq - 2) * C; i < (cq - 1) * C; i++) n_above += above(i, j);
                        if (n_above >= c.cap) {
                            ref[(size_t)j] = cq;
                            break;
                        }
                    }
                }
            } else {
                int used = 0;
                for (int cl = 0; cl + 2 < nc; cl++) {
                    int n = c.lam < C ? c.lam : C;
                    if (c.capped && n > c.cap - used) n = c.cap - used;
                    if (n < 0) n = 0;
                    for (int j = cl * C; j < (cl + 1) * C; j++) {
                        int rank = 0;
                        for (int i = cl * C; i < (cl + 1) * C; i++) rank += above(i, j);
                        if (rank >= n) ref[(size_t)j] = cl + 2;
                    }
                    used += n;
                }
            }
            for (int j = 0; j < T; j++)
                if (out[(size_t)hs * T + j] != ref[(size_t)j] && differ++ == 0) first = hs * T + j;
        }
        report(differ == 0, "%s: routing of %d keys, %d differ from the rule%s", name, Hs * T, differ,
               differ ? (" (first: key " + std::to_string(first % T) + " of head " + std::to_string(first / T) +
                         ", got " + std::to_string(out[(size_t)first]) + ")").c_str()
                      : "");
    }
}
