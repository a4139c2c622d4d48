/* Times the still attention kind on the GPU (stc_still_forward) with CUDA
 * events, for SmolLM2's shape unless told otherwise (9 query heads, 3 KV
 * heads, head dim 64, d 576, chunk 64, budget 896, λ 6, saliency routing,
 * NP-Map, gate and linear on): a prefill of L tokens in one call on a fresh
 * state, and decode steps (T = 1) at depth L. Each prefill point is the
 * median of --reps timed calls (the state reset, untimed, before each) after
 * --warmup; decode: the median of --reps consecutive steps after --warmup
 * steps, starting at depth L (so about one step in C includes a leaving
 * chunk: selection and fold), each a separate stc_still_forward call (host
 * launch overhead included), then the same step captured once in a CUDA
 * graph and replayed (the graph-ready path: positions from the device
 * counter). Prints a markdown table with the per-layer time and the 30-layer
 * total of the attention alone.
 *
 *   bench_still_cuda [--lengths 1024,2048,...] [--reps 10] [--warmup 3]
 *                    [--heads 9] [--kv-heads 3] [--dim 64] [--d-model 576]
 *                    [--chunk 64] [--budget 896] [--lambda 6]
 *                    [--routing saliency|random|keynorm|qk|position|none]
 *                    [--per-kv-head] [--no-linear] [--no-gate]
 *                    [--convert-gate] [--no-decode-kernels] [--layers 30]
 *                    [--device N]
 *
 * --convert-gate: let stc_still_forward convert Wg to bf16 on every call
 * (default: a bf16 copy registered once, as an engine would).
 * --no-decode-kernels: decode steps through the chunk-parallel kernels of a
 * prefill instead of attn_still_decode.cu's (for comparison). */
#include "still_cuda.h"

#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

static void die(const char *what, const char *msg) {
    fprintf(stderr, "bench_still_cuda: %s: %s\n", what, msg);
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

static uint64_t g_s = 42;
static double uni(void) {
    g_s = g_s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(g_s >> 11) * 0x1.0p-53;
}
static double normal(void) {   /* a cheap approximate normal: sum of 4 uniforms */
    double x = 0;
    for (int i = 0; i < 4; i++) x += uni();
    return (x - 2.0) * 1.7320508;
}

static void *dev_alloc(stc_ctx *ctx, size_t bytes, const char *what) {
    void *p = NULL;
    still_err err = {};
    if (stc_malloc(ctx, bytes, what, &p, &err)) die("stc_malloc", err.msg);
    return p;
}
static void upload(stc_ctx *ctx, void *dst, const void *src, size_t bytes) {
    still_err err = {};
    if (stc_memcpy_h2d(ctx, dst, src, bytes, &err)) die("upload", err.msg);
}

static double median(std::vector<double> t) {
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main(int argc, char **argv) {
    std::vector<int> lengths = {1024, 2048, 4096, 8192, 16384, 32768, 65536};
    int reps = 10, warmup = 3, device = 0, layers = 30;
    stc_still_config c;
    memset(&c, 0, sizeof c);
    c.n_head = 9, c.n_head_kv = 3, c.head_dim = 64, c.d_model = 576, c.chunk = 64, c.budget = 896, c.lambda = 6;
    c.routing = 0, c.linear = 1, c.gate = 1, c.feature_map = 0, c.seed = 1;
    bool convert_gate = false, decode_kernels = true;
    static const char *const routings[] = {"saliency", "random", "keynorm", "qk", "position", "none"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--lengths") && v) {
            lengths.clear();
            for (const char *p = v; *p;) {
                char *end;
                long x = strtol(p, &end, 10);
                if (end == p || x <= 0 || x > (1 << 22) || (*end && *end != ','))
                    die("--lengths", "expected positive numbers separated by commas");
                lengths.push_back((int)x);
                p = *end == ',' ? end + 1 : end;
            }
            i++;
        } else if (!strcmp(a, "--reps") && v) reps = atoi(v), i++;
        else if (!strcmp(a, "--warmup") && v) warmup = atoi(v), i++;
        else if (!strcmp(a, "--heads") && v) c.n_head = atoi(v), i++;
        else if (!strcmp(a, "--kv-heads") && v) c.n_head_kv = atoi(v), i++;
        else if (!strcmp(a, "--dim") && v) c.head_dim = atoi(v), i++;
        else if (!strcmp(a, "--d-model") && v) c.d_model = atoi(v), i++;
        else if (!strcmp(a, "--chunk") && v) c.chunk = atoi(v), i++;
        else if (!strcmp(a, "--budget") && v) c.budget = atoi(v), i++;
        else if (!strcmp(a, "--lambda") && v) c.lambda = atoi(v), i++;
        else if (!strcmp(a, "--layers") && v) layers = atoi(v), i++;
        else if (!strcmp(a, "--device") && v) device = atoi(v), i++;
        else if (!strcmp(a, "--routing") && v) {
            c.routing = -1;
            for (int r = 0; r < 6; r++)
                if (!strcmp(v, routings[r])) c.routing = r;
            if (c.routing < 0) die("--routing", "saliency, random, keynorm, qk, position or none");
            i++;
        } else if (!strcmp(a, "--per-kv-head")) c.per_kv_head = 1;
        else if (!strcmp(a, "--no-linear")) c.linear = 0;
        else if (!strcmp(a, "--no-gate")) c.gate = 0;
        else if (!strcmp(a, "--convert-gate")) convert_gate = true;
        else if (!strcmp(a, "--no-decode-kernels")) decode_kernels = false;
        else {
            fprintf(stderr,
                    "usage: %s [--lengths 1024,2048,...] [--reps 10] [--warmup 3] [--heads 9] [--kv-heads 3] [--dim 64]\n"
                    "          [--d-model 576] [--chunk 64] [--budget 896] [--lambda 6] [--routing NAME] [--per-kv-head]\n"
                    "          [--no-linear] [--no-gate] [--convert-gate] [--no-decode-kernels] [--layers 30]\n"
                    "          [--device N]\n",
                    argv[0]);
            return 2;
        }
    }
    if (reps < 1 || warmup < 0) die("arguments", "need reps >= 1, warmup >= 0");
    const int Lmax = *std::max_element(lengths.begin(), lengths.end());
    c.n_ctx = Lmax + 2 * (warmup + reps) + 1;   /* λ is given, so n_ctx only sizes the state */

    char info[1024];
    stc_device_info(info, sizeof info);
    still_err err = {};
    stc_ctx *ctx = NULL;
    if (stc_ctx_create(device, &ctx, &err)) die("stc_ctx_create", err.msg);
    stc_still_info si;
    if (stc_still_resolve(&c, &si, &err)) die("stc_still_resolve", err.msg);
    stc_still *st = NULL;
    if (stc_still_create(ctx, &c, &st, &err)) die("stc_still_create", err.msg);
    stc_still_set_decode_kernels(st, decode_kernels);
    if (stc_still_reserve(ctx, st, Lmax, &err)) die("stc_still_reserve", err.msg);

    const int H = c.n_head, Hk = c.n_head_kv, D = c.head_dim, dm = c.d_model > 0 ? c.d_model : 1;
    const size_t HD = (size_t)H * D, kvd = (size_t)Hk * D, n_tok = (size_t)c.n_ctx;
    float *q = (float *)dev_alloc(ctx, n_tok * HD * 4, "q");
    float *k = (float *)dev_alloc(ctx, n_tok * kvd * 4, "k");
    float *v = (float *)dev_alloc(ctx, n_tok * kvd * 4, "v");
    float *o = (float *)dev_alloc(ctx, n_tok * HD * 4, "out");
    stc_bf16 *x = (stc_bf16 *)dev_alloc(ctx, n_tok * dm * 2, "x");
    float *par = (float *)dev_alloc(ctx, si.param_count * 4 + 4, "parameters");
    stc_bf16 *wg = (stc_bf16 *)dev_alloc(ctx, HD * dm * 2 + 2, "bf16 Wg");
    {
        std::vector<float> h(n_tok * HD);
        for (auto &e : h) e = (float)normal();
        upload(ctx, q, h.data(), n_tok * HD * 4);
        for (size_t i = 0; i < n_tok * kvd; i++) h[i] = (float)normal();
        upload(ctx, k, h.data(), n_tok * kvd * 4);
        for (size_t i = 0; i < n_tok * kvd; i++) h[i] = (float)normal();
        upload(ctx, v, h.data(), n_tok * kvd * 4);
        std::vector<uint16_t> xb(n_tok * dm);
        for (auto &e : xb) e = f2bf((float)normal());
        upload(ctx, x, xb.data(), xb.size() * 2);
        std::vector<float> p(si.param_count);
        const double b = sqrt(6.0 / (double)(D * D));
        for (size_t i = 0; i < p.size(); i++)
            p[i] = i < 2 * HD ? (float)normal() : i < 2 * HD + 2 * HD * D ? (float)((2 * uni() - 1) * b)
                                                                            : (float)(0.04 * normal());
        upload(ctx, par, p.data(), p.size() * 4);
        if (c.gate && c.linear && stc_f32_to_bf16(ctx, par + 2 * HD + 2 * HD * D, wg, (int64_t)(HD * dm), &err))
            die("stc_f32_to_bf16", err.msg);
    }
    if (!convert_gate) stc_still_set_gate_bf16(st, wg);

    cudaStream_t s = (cudaStream_t)stc_ctx_stream(ctx);
    cudaEvent_t ea, eb;
    CK(cudaEventCreate(&ea));
    CK(cudaEventCreate(&eb));
    auto fwd = [&](int p0, int T, bool device_pos = false) {
        if (stc_still_forward(ctx, st, par, q + (size_t)p0 * HD, k + (size_t)p0 * kvd, v + (size_t)p0 * kvd,
                              x + (size_t)p0 * dm, T, device_pos ? STC_STILL_P0_DEVICE : p0, o + (size_t)p0 * HD, &err))
            die("stc_still_forward", err.msg);
    };
    auto timed = [&](int p0, int T) {
        CK(cudaEventRecord(ea, s));
        fwd(p0, T);
        CK(cudaEventRecord(eb, s));
        CK(cudaEventSynchronize(eb));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, ea, eb));
        return (double)ms;
    };

    printf("%s\n\n", info);
    printf("still attention on the GPU (stc_still_forward): %d heads, %d KV heads, head dim %d, d %d, chunk %d, "
           "budget %d (cap %d), lambda %d, %s routing%s%s%s, gate matrix %s; median of %d after %d warm-up\n\n",
           H, Hk, D, dm, c.chunk, c.budget, si.cap, si.lambda, routings[c.routing], c.per_kv_head ? ", per KV head" : "",
           c.linear ? "" : ", linear off", c.linear && !c.gate ? ", gate off" : "",
           convert_gate ? "converted per call" : "bf16, registered", reps, warmup);
    printf("| L | prefill ms/layer | prefill Mtok/s | x%d layers ms | decode us/layer (depth L) | x%d layers us | "
           "decode us/layer, CUDA graph |\n",
           layers, layers);
    printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (int L : lengths) {
        std::vector<double> t;
        for (int i = 0; i < warmup + reps; i++) {
            if (stc_still_reset(ctx, st, &err)) die("stc_still_reset", err.msg);
            const double ms = timed(0, L);
            if (i >= warmup) t.push_back(ms);
        }
        const double pre = median(t);
        /* decode: the state holds L tokens now */
        t.clear();
        for (int i = 0; i < warmup + reps; i++) {
            const double ms = timed(L + i, 1);
            if (i >= warmup) t.push_back(ms);
        }
        const double dec = median(t);
        /* the same decode step captured once in a CUDA graph (positions from the
         * device counter; the graph reuses one input row, which does not matter
         * for the time) and replayed */
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
        fwd(L + warmup + reps, 1, true);
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        t.clear();
        for (int i = 0; i < warmup + reps; i++) {
            CK(cudaEventRecord(ea, s));
            CK(cudaGraphLaunch(exec, s));
            CK(cudaEventRecord(eb, s));
            CK(cudaEventSynchronize(eb));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, ea, eb));
            if (i >= warmup) t.push_back(ms);
        }
        const double dec_graph = median(t);
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
        if (stc_ctx_sync(ctx, &err)) die("stc_ctx_sync", err.msg);
        printf("| %d | %.3f | %.1f | %.2f | %.1f | %.0f | %.1f |\n", L, pre, L / (pre * 1e-3) / 1e6, pre * layers,
               dec * 1e3, dec * 1e3 * layers, dec_graph * 1e3);
        fflush(stdout);
    }
    CK(cudaEventDestroy(ea));
    CK(cudaEventDestroy(eb));
    stc_still_free(st);
    void *bufs[] = {q, k, v, o, x, par, wg};
    for (void *b : bufs) stc_free(ctx, b);
    stc_ctx_free(ctx);
    return 0;
}
