/* Times the gdn kind's GPU forward (stc_gdn_forward: the four kernels of cuda/kinds/gdn/attn_gdn.cu) with CUDA
 * events, and writes one prefill's inputs and outputs for scripts/bench-gdn-fla.py, which checks them against
 * flash-linear-attention's chunk_gated_delta_rule (fla, Triton) and times fla on the same shapes.
 *
 *   bench_gdn_cuda OUTDIR [--lengths 1024,8192,...] [--heads 9] [--kv-heads 3] [--dim 64] [--reps 20]
 *
 * Per length L: a prefill of L tokens from a fresh state (the median of --reps calls after 3 untimed ones) and a
 * decode step after it (the median of 200 steps, each one call of one token, launched one by one: no CUDA graph).
 * The inputs are random: q, k, v ~ N(0, 1); β from pre-activations ~ N(0, 1); log α from N(0, 1)
 * pre-activations through the initialisation's a_log and b_α (attn_gdn_rules.h); the output gate wide open
 * (b_g = 30) and w_n = 1, so the output is the raw o = S q̂ through the RMSNorm alone. OUTDIR gets, for the
 * first length only, q.bin [L][H][D], k.bin, v.bin [L][Hk][D], beta.bin, lal.bin [L][Hk] and y.bin [L][H][D]
 * (float32, little-endian) and shape.txt ("L H Hk D"). */
#include "still_cuda.h"
#include "kinds/gdn/attn_gdn_rules.h"

#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

static void die(const char *what, const char *msg) {
    fprintf(stderr, "bench_gdn_cuda: %s: %s\n", what, msg);
    exit(1);
}

#define CK(call)                                                              \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess) die(#call, cudaGetErrorString(e_));            \
    } while (0)
#define API(call)                                                             \
    do {                                                                      \
        if ((call) != 0) die(#call, err.msg);                                 \
    } while (0)

static void write_bin(const std::string &dir, const char *name, const std::vector<float> &v) {
    const std::string p = dir + "/" + name;
    FILE *f = fopen(p.c_str(), "wb");
    if (!f || fwrite(v.data(), sizeof(float), v.size(), f) != v.size() || fclose(f)) die("write", p.c_str());
}

template <class F>
static double median_ms(cudaStream_t s, int warmup, int reps, F f) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < warmup; i++) f();
    std::vector<double> t;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, s));
        f();
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    cudaEventDestroy(a), cudaEventDestroy(b);
    return t[t.size() / 2];
}

int main(int argc, char **argv) {
    if (argc < 2 || argv[1][0] == '-') {
        fprintf(stderr, "usage: bench_gdn_cuda OUTDIR [--lengths L,...] [--heads H] [--kv-heads HK] [--dim D] [--reps N]\n");
        return 2;
    }
    const std::string dir = argv[1];
    std::vector<int> lengths = {1024, 4096, 8192, 32768};
    int H = 9, Hk = 3, D = 64, reps = 20;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--lengths")) {
            lengths.clear();
            for (char *s = argv[i + 1]; *s;) {
                lengths.push_back((int)strtol(s, &s, 10));
                if (*s == ',') s++;
                else if (*s) die("--lengths", "a comma-separated list of token counts");
            }
        } else if (!strcmp(argv[i], "--heads")) H = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kv-heads")) Hk = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dim")) D = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else die(argv[i], "unknown option");
    }
    if (lengths.empty() || H <= 0 || Hk <= 0 || H % Hk || reps < 1) die("arguments", "out of range");
    const int d = 64;   /* the layer input's width: only the parameters' offsets depend on it here */
    still_err err = {};
    stc_ctx *ctx = NULL;
    API(stc_ctx_create(0, &ctx, &err));
    cudaStream_t st = (cudaStream_t)stc_ctx_stream(ctx);
    stc_gdn *g = NULL;
    const int norm = 1;   /* the outputs' RMSNorm, which scripts/bench-gdn-fla.py applies to fla's and its own */
    API(stc_gdn_create(ctx, H, Hk, D, d, norm, 0, &g, &err));
    /* parameters: b_g = 30 (gate open), w_n = 1, the initialisation's decays; the projections unused (pre given) */
    std::vector<float> p(gdn_par_count(H, Hk, d, D), 0.0f);
    for (int hk = 0; hk < Hk; hk++) {
        p[gdn_par_balpha(Hk, d) + hk] = gdn_softplus_inv(gdn_init_dt(hk, Hk));
        p[gdn_par_alog(Hk, d) + hk] = logf(gdn_init_a(hk, Hk));
    }
    for (int x = 0; x < D; x++) p[gdn_par_wnorm(Hk, d) + x] = 1.0f;
    for (size_t i = 0; i < (size_t)H * D; i++) p[gdn_par_bg(H, Hk, d, D) + i] = 30.0f;
    printf("| tokens | prefill ms | prefill Mtok/s | decode step us |\n| ---: | ---: | ---: | ---: |\n");
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t li = 0; li < lengths.size(); li++) {
        const int L = lengths[li];
        const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D, ld = qd + 2 * (size_t)Hk;
        std::vector<float> q((size_t)L * qd), k((size_t)L * kvd), v((size_t)L * kvd), pre((size_t)L * ld, 0.0f);
        std::vector<float> beta((size_t)L * Hk), lal((size_t)L * Hk);
        for (auto &x : q) x = nd(rng);
        for (auto &x : k) x = nd(rng);
        for (auto &x : v) x = nd(rng);
        for (int t = 0; t < L; t++)
            for (int hk = 0; hk < Hk; hk++) {
                const float bp = nd(rng), ap = nd(rng);
                pre[(size_t)t * ld + qd + hk] = bp, pre[(size_t)t * ld + qd + Hk + hk] = ap;
                beta[(size_t)t * Hk + hk] = gdn_beta(bp + p[gdn_par_bbeta(Hk, d) + hk]);
                lal[(size_t)t * Hk + hk] = gdn_log_alpha(ap + p[gdn_par_balpha(Hk, d) + hk], p[gdn_par_alog(Hk, d) + hk]);
            }
        const size_t ws_bytes = stc_gdn_workspace_bytes(H, Hk, D, L);
        float *dq, *dk, *dv, *dpre, *dp, *dy;
        void *ws;
        CK(cudaMalloc(&dq, q.size() * 4));
        CK(cudaMalloc(&dk, k.size() * 4));
        CK(cudaMalloc(&dv, v.size() * 4));
        CK(cudaMalloc(&dpre, pre.size() * 4));
        CK(cudaMalloc(&dp, p.size() * 4));
        CK(cudaMalloc(&dy, q.size() * 4));
        CK(cudaMalloc(&ws, ws_bytes));
        CK(cudaMemcpy(dq, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dk, k.data(), k.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dv, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dpre, pre.data(), pre.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dp, p.data(), p.size() * 4, cudaMemcpyHostToDevice));
        API(stc_gdn_reset(ctx, g, &err));
        API(stc_gdn_forward(ctx, g, dp, dq, dk, dv, dpre, (int)ld, L, ws, ws_bytes, dy, NULL, &err));
        CK(cudaStreamSynchronize(st));
        if (li == 0) {
            std::vector<float> y(q.size());
            CK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
            write_bin(dir, "q.bin", q), write_bin(dir, "k.bin", k), write_bin(dir, "v.bin", v);
            write_bin(dir, "beta.bin", beta), write_bin(dir, "lal.bin", lal), write_bin(dir, "y.bin", y);
            FILE *f = fopen((dir + "/shape.txt").c_str(), "w");
            if (!f) die("write", "shape.txt");
            fprintf(f, "%d %d %d %d\n", L, H, Hk, D);
            fclose(f);
        }
        /* (q and k are normalised in place by the first call: the timed calls see unit vectors, the same work) */
        const double pf = median_ms(st, 3, reps, [&] {
            stc_gdn_reset(ctx, g, &err);
            stc_gdn_forward(ctx, g, dp, dq, dk, dv, dpre, (int)ld, L, ws, ws_bytes, dy, NULL, &err);
        });
        int t = 0;
        const double dc = median_ms(st, 3, 200, [&] {
            stc_gdn_forward(ctx, g, dp, dq + (size_t)t * qd, dk + (size_t)t * kvd, dv + (size_t)t * kvd,
                            dpre + (size_t)t * ld, (int)ld, 1, ws, ws_bytes, dy, NULL, &err);
            t = (t + 1) % L;
        });
        if (err.msg[0]) die("stc_gdn_forward", err.msg);
        printf("| %d | %.3f | %.2f | %.1f |\n", L, pf, L / pf / 1e3, dc * 1e3);
        cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dpre), cudaFree(dp), cudaFree(dy), cudaFree(ws);
    }
    stc_gdn_free(g);
    stc_ctx_free(ctx);
    return 0;
}
