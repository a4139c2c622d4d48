/* Times the bare attention kernel of the CUDA backend (stc_attn_softmax) with
 * CUDA events: causal self-attention over L tokens (prefill: T = L, p0 = 0)
 * and one decode step at depth L (T = 1, p0 = L - 1), for SmolLM2's shape
 * (9 query heads, 3 KV heads, head dim 64) unless told otherwise. Each point
 * is the median of --reps timed calls after --warmup untimed ones. Prints a
 * markdown table; scripts/bench-attn-torch.py prints the same table for
 * PyTorch's scaled_dot_product_attention, to run side by side.
 *
 *   bench_attn_cuda [--lengths 1024,2048,...] [--reps 20] [--warmup 3]
 *                   [--heads 9] [--kv-heads 3] [--dim 64] [--f32] [--device N]
 *
 * TFLOP/s counts the causal products only: 4 · D · H · L(L+1)/2 for a prefill.
 * Decode GB/s counts the K and V bytes read: 2 · L · Hk · D · 2. Output bf16
 * (as SDPA's) unless --f32. */
#include "still_cuda.h"

#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

static void die(const char *what, const char *msg) {
    fprintf(stderr, "bench_attn_cuda: %s: %s\n", what, msg);
    exit(1);
}

#define CK(call)                                                              \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess) die(#call, cudaGetErrorString(e_));            \
    } while (0)

static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Median milliseconds of `reps` timed calls of f() after `warmup` calls. */
template <class F>
static double time_ms(stc_ctx *ctx, int warmup, int reps, F f) {
    cudaStream_t s = (cudaStream_t)stc_ctx_stream(ctx);
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
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main(int argc, char **argv) {
    std::vector<int> lengths = {1024, 2048, 4096, 8192, 16384, 32768, 65536};
    int reps = 20, warmup = 3, H = 9, Hk = 3, D = 64, device = 0;
    bool f32 = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--lengths") && v) {
            lengths.clear();
            for (const char *p = v; *p;) {
                char *end;
                long x = strtol(p, &end, 10);
                if (end == p || x <= 0 || x > (1 << 22)) die("--lengths", "expected positive numbers separated by commas");
                lengths.push_back((int)x);
                p = *end == ',' ? end + 1 : end;
                if (*end && *end != ',') die("--lengths", "expected positive numbers separated by commas");
            }
            i++;
        } else if (!strcmp(a, "--reps") && v) reps = atoi(v), i++;
        else if (!strcmp(a, "--warmup") && v) warmup = atoi(v), i++;
        else if (!strcmp(a, "--heads") && v) H = atoi(v), i++;
        else if (!strcmp(a, "--kv-heads") && v) Hk = atoi(v), i++;
        else if (!strcmp(a, "--dim") && v) D = atoi(v), i++;
        else if (!strcmp(a, "--device") && v) device = atoi(v), i++;
        else if (!strcmp(a, "--f32")) f32 = true;
        else {
            fprintf(stderr, "usage: %s [--lengths 1024,2048,...] [--reps 20] [--warmup 3] [--heads 9] [--kv-heads 3] "
                            "[--dim 64] [--f32] [--device N]\n", argv[0]);
            return 2;
        }
    }
    if (reps < 1 || warmup < 0 || H <= 0 || Hk <= 0 || H % Hk || (D != 64 && D != 128))
        die("arguments", "need reps >= 1, heads a multiple of kv-heads, dim 64 or 128");

    char info[1024];
    stc_device_info(info, sizeof info);
    still_err err = {};
    stc_ctx *ctx = NULL;
    if (stc_ctx_create(device, &ctx, &err)) die("stc_ctx_create", err.msg);

    const int Lmax = *std::max_element(lengths.begin(), lengths.end());
    const size_t nq = (size_t)Lmax * H * D, nkv = (size_t)Lmax * Hk * D;
    void *q, *k, *v, *o;
    if (stc_malloc(ctx, nq * 2, "q", &q, &err) || stc_malloc(ctx, nkv * 2, "k", &k, &err) ||
        stc_malloc(ctx, nkv * 2, "v", &v, &err) || stc_malloc(ctx, nq * (f32 ? 4 : 2), "out", &o, &err))
        die("stc_malloc", err.msg);
    {
        std::vector<uint16_t> h(nq);
        uint64_t s = 42;
        auto normal = [&]() {   /* a cheap approximate normal: sum of 4 uniforms */
            double x = 0;
            for (int i = 0; i < 4; i++) {
                s = s * 6364136223846793005ULL + 1442695040888963407ULL;
                x += (double)(s >> 11) * 0x1.0p-53;
            }
            return (x - 2.0) * 1.7320508;
        };
        for (auto &x : h) x = f2bf((float)normal());
        if (stc_memcpy_h2d(ctx, q, h.data(), nq * 2, &err)) die("upload", err.msg);
        h.resize(nkv);
        for (auto &x : h) x = f2bf((float)normal());
        if (stc_memcpy_h2d(ctx, k, h.data(), nkv * 2, &err)) die("upload", err.msg);
        for (auto &x : h) x = f2bf((float)normal());
        if (stc_memcpy_h2d(ctx, v, h.data(), nkv * 2, &err)) die("upload", err.msg);
    }

    printf("%s\n\n", info);
    printf("still CUDA attention (stc_attn_softmax): causal, %d heads, %d KV heads, head dim %d, bf16 in, %s out; "
           "median of %d after %d warm-up\n\n", H, Hk, D, f32 ? "fp32" : "bf16", reps, warmup);
    printf("| L | prefill ms | prefill TFLOP/s | decode us | decode GB/s |\n");
    printf("| ---: | ---: | ---: | ---: | ---: |\n");
    for (int L : lengths) {
        auto call = [&](int T, int p0) {
            int rc = stc_attn_softmax(ctx, (const stc_bf16 *)q, (const stc_bf16 *)k, (const stc_bf16 *)v, T, p0, H, Hk,
                                      D, f32 ? (float *)o : NULL, f32 ? NULL : (stc_bf16 *)o, &err);
            if (rc) die("stc_attn_softmax", err.msg);
        };
        const int n_rep = L >= 32768 ? (reps + 1) / 2 : reps;
        const double pre = time_ms(ctx, warmup, n_rep, [&] { call(L, 0); });
        const double dec = time_ms(ctx, warmup, reps, [&] { call(1, L - 1); });
        if (stc_ctx_sync(ctx, &err)) die("stc_ctx_sync", err.msg);
        const double flops = 4.0 * D * H * ((double)L * (L + 1) / 2);
        const double kv_bytes = 2.0 * L * Hk * D * 2;
        printf("| %d | %.3f | %.1f | %.1f | %.0f |\n", L, pre, flops / (pre * 1e-3) / 1e12, dec * 1e3,
               kv_bytes / (dec * 1e-3) / 1e9);
        fflush(stdout);
    }
    stc_free(ctx, q);
    stc_free(ctx, k);
    stc_free(ctx, v);
    stc_free(ctx, o);
    stc_ctx_free(ctx);
    return 0;
}
