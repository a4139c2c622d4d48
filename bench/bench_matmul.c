/* Micro-benchmark for matmul(): GFLOP/s for Q4_1 and Q8_0 weights at the
 * SmolLM2-135M shapes, n_tok = 1 (decode) and 512 (prefill); for n_tok = 1 it
 * also prints the effective weight bandwidth.  It first measures the
 * machine's fp32 FMA peak (one core, register-only loop) for reference.
 *
 * Build (from the repository root):
 *   gcc -std=gnu11 -O3 -march=native -fopenmp -Iinclude -Isrc \
 *       src/common/common.c src/format/quant.c src/cpu/matmul.c bench/bench_matmul.c -lm -o bench_matmul
 *       (add src/cpu/matvec_q8.c for -q)
 * Usage: bench_matmul [-t threads (2)] [-n n_tok list (1,512)] [-q int8 path for n_tok = 1:
 *                     auto, portable, avx2, vnni; the activation's quantization included]
 *                     [-s shapes n_in x n_out list (576x576,576x1536,1536x576,576x49152)]
 *                     [-T type list (Q4_1,Q8_0)] [-r seconds per case (0.5)] */
#include "cpu/kernels.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint64_t rng = 88172645463325252ull;
static uint64_t xorshift(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Peak fp32 FMA throughput of one core (GFLOP/s), 0 if not measurable here. */
static double fma_peak(void) {
#if defined(__AVX512F__) && defined(__x86_64__)
    double best = 1e30;
    /* many short runs, keep the fastest (other load on the machine only
     * ever makes a run slower) */
    const long iters = 100000;
    for (int rep = 0; rep < 300; rep++) {
        long n = iters;
        double t0 = now();
        __asm__ volatile(
            "vxorps %%zmm0, %%zmm0, %%zmm0\n\tvxorps %%zmm1, %%zmm1, %%zmm1\n\t"
            "vxorps %%zmm2, %%zmm2, %%zmm2\n\tvxorps %%zmm3, %%zmm3, %%zmm3\n\t"
            "vxorps %%zmm4, %%zmm4, %%zmm4\n\tvxorps %%zmm5, %%zmm5, %%zmm5\n\t"
            "vxorps %%zmm6, %%zmm6, %%zmm6\n\tvxorps %%zmm7, %%zmm7, %%zmm7\n\t"
            "vxorps %%zmm8, %%zmm8, %%zmm8\n\tvxorps %%zmm9, %%zmm9, %%zmm9\n\t"
            "vxorps %%zmm10, %%zmm10, %%zmm10\n\tvxorps %%zmm11, %%zmm11, %%zmm11\n\t"
            "vxorps %%zmm12, %%zmm12, %%zmm12\n\tvxorps %%zmm13, %%zmm13, %%zmm13\n\t"
            "1:\n\t"
            "vfmadd231ps %%zmm14, %%zmm15, %%zmm0\n\tvfmadd231ps %%zmm14, %%zmm15, %%zmm1\n\t"
            "vfmadd231ps %%zmm14, %%zmm15, %%zmm2\n\tvfmadd231ps %%zmm14, %%zmm15, %%zmm3\n\t"
            "vfmadd231ps %%zmm14, %%zmm15, %%zmm4\n\tvfmadd231ps %%zmm14, %%zmm15, %%zmm5\n\t"
            "vfmadd231ps %%zmm14, %%zmm15, %%zmm6\n\tvfmadd231ps %%zmm14, %%zmm15, %%zmm7\n\t"
            "vfmadd231ps %%zmm14, %%zmm15, %%zmm8\n\tvfmadd231ps %%zmm14, %%zmm15, %%zmm9\n\t"
            "vfmadd231ps %%zmm14, %%zmm15, %%zmm10\n\tvfmadd231ps %%zmm14, %%zmm15, %%zmm11\n\t"
            "vfmadd231ps %%zmm14, %%zmm15, %%zmm12\n\tvfmadd231ps %%zmm14, %%zmm15, %%zmm13\n\t"
            "dec %0\n\tjnz 1b\n\t"
            : "+r"(n)
            :
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
              "xmm11", "xmm12", "xmm13", "cc");
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    return (double)iters * 14.0 * 32.0 / best * 1e-9;
#else
    return 0.0;
#endif
}

/* random blocks with sane fp16 scales */
static void fill_weights(uint32_t t, uint8_t *w, size_t nbytes) {
    for (size_t i = 0; i < nbytes; i++) w[i] = (uint8_t)xorshift();
    const size_t bb = tensor_type_block_bytes(t);
    if (tensor_type_block_elems(t) == 1) { /* float types: small finite values */
        const size_t es = bb;
        for (size_t off = 0; off + es <= nbytes; off += es) {
            float v = (float)((int)(xorshift() % 2001) - 1000) * 1e-5f;
            if (t == TT_F32) memcpy(w + off, &v, 4);
            else if (t == TT_F16) { uint16_t h = f32_to_f16(v); memcpy(w + off, &h, 2); }
            else { uint32_t u; memcpy(&u, &v, 4); uint16_t h = (uint16_t)(u >> 16); memcpy(w + off, &h, 2); }
        }
        return;
    }
    for (size_t off = 0; off + bb <= nbytes; off += bb) {
        uint16_t d = f32_to_f16(0.001f + (float)(xorshift() % 1000) * 1e-5f);
        uint16_t m = f32_to_f16(-0.01f * (float)(xorshift() % 100) * 1e-2f);
        if (t == TT_Q6_K) { memcpy(w + off + 208, &d, 2); continue; }
        if (t == TT_Q2_K) { memcpy(w + off + 80, &d, 2); memcpy(w + off + 82, &d, 2); continue; }
        if (t == TT_Q3_K) { memcpy(w + off + 108, &d, 2); continue; }
        memcpy(w + off, &d, 2);
        if (t == TT_Q4_1 || t == TT_Q5_1 || t == TT_Q4_K || t == TT_Q5_K || t == TT_Q8_1) memcpy(w + off + 2, &m, 2);
    }
}

/* One product: the float path, or the activation quantized and the integer path. */
static void run_once(const weight_matrix *W, const float *x, float *y, int64_t n_tok, act_q8 *xq, int path) {
    if (xq) {
        act_q8_quantize(xq, x, W->n_in);
        matvec_q8(W, xq, y, path);
    } else {
        matmul(W, x, y, n_tok);
    }
}

static uint32_t type_by_name(const char *s) {
    for (uint32_t t = 0; t < 64; t++)
        if (tensor_type_supported(t) && strcmp(tensor_type_name(t), s) == 0) return t;
    fprintf(stderr, "unknown or unsupported type %s\n", s);
    exit(2);
}

int main(int argc, char **argv) {
    int threads = 2;
    char toks_s[256] = "1,512", shapes_s[512] = "576x576,576x1536,1536x576,576x49152", types_s[256] = "Q4_1,Q8_0";
    double secs = 0.5;
    int opt, q8path = -1;   /* -1: float products */
    while ((opt = getopt(argc, argv, "t:n:s:T:r:q:")) != -1) {
        switch (opt) {
        case 'q':
            q8path = !strcmp(optarg, "auto") ? MATVEC_Q8_AUTO : !strcmp(optarg, "portable") ? MATVEC_Q8_PORTABLE
                   : !strcmp(optarg, "avx2") ? MATVEC_Q8_AVX2 : !strcmp(optarg, "vnni") ? MATVEC_Q8_VNNI : !strcmp(optarg, "avxvnni") ? MATVEC_Q8_AVXVNNI : -2;
            if (q8path == -2 || (q8path > 0 && !matvec_q8_path_available(q8path))) {
                fprintf(stderr, "-q: unknown or unavailable path %s\n", optarg);
                return 2;
            }
            break;
        case 't': threads = atoi(optarg); break;
        case 'n': snprintf(toks_s, sizeof toks_s, "%s", optarg); break;
        case 's': snprintf(shapes_s, sizeof shapes_s, "%s", optarg); break;
        case 'T': snprintf(types_s, sizeof types_s, "%s", optarg); break;
        case 'r': secs = atof(optarg); break;
        default:
            fprintf(stderr, "usage: %s [-t threads] [-n 1,512] [-s 576x576,...] [-T Q4_1,Q8_0] [-r secs] [-q path]\n",
                    argv[0]);
            return 2;
        }
    }
    int toks[16], ntoks = 0;
    for (char *p = strtok(toks_s, ","); p && ntoks < 16; p = strtok(NULL, ",")) toks[ntoks++] = atoi(p);
    int64_t shapes[16][2];
    int nshapes = 0;
    for (char *p = strtok(shapes_s, ","); p && nshapes < 16; p = strtok(NULL, ",")) {
        long long a, b;
        if (sscanf(p, "%lldx%lld", &a, &b) != 2) { fprintf(stderr, "bad shape %s\n", p); return 2; }
        shapes[nshapes][0] = a;
        shapes[nshapes][1] = b;
        nshapes++;
    }
    uint32_t types[16];
    int ntypes = 0;
    for (char *p = strtok(types_s, ","); p && ntypes < 16; p = strtok(NULL, ",")) types[ntypes++] = type_by_name(p);

    const double peak1 = fma_peak();
    omp_set_num_threads(threads);
    printf("threads=%d", threads);
    if (peak1 > 0)
        printf("  fp32 FMA peak: %.1f GFLOP/s per core, %.1f GFLOP/s for %d threads", peak1, peak1 * threads, threads);
    printf("\n%-5s %6s %6s %5s %10s %9s %7s %8s\n", "type", "n_in", "n_out", "n_tok", "time(us)", "GFLOP/s", "%peak",
           "GB/s");
    for (int ti = 0; ti < ntypes; ti++) {
        for (int si = 0; si < nshapes; si++) {
            const uint32_t t = types[ti];
            const int64_t n_in = shapes[si][0], n_out = shapes[si][1];
            const size_t rb = tensor_row_bytes(t, n_in), wbytes = rb * (size_t)n_out;
            if (rb == 0) { fprintf(stderr, "n_in %lld not a multiple of the block size\n", (long long)n_in); continue; }
            uint8_t *w = malloc(wbytes);
            fill_weights(t, w, wbytes);
            weight_matrix W = {.type = t, .n_in = n_in, .n_out = n_out, .data = w, .row_bytes = rb};
            for (int a = 0; a < ntoks; a++) {
                const int64_t n_tok = toks[a];
                float *x = malloc(sizeof(float) * (size_t)(n_in * n_tok));
                float *y = malloc(sizeof(float) * (size_t)(n_out * n_tok));
                for (int64_t i = 0; i < n_in * n_tok; i++) x[i] = (float)((int)(xorshift() % 2001) - 1000) * 1e-3f;
                act_q8 xq = {0};
                const int use_q8 = q8path >= 0 && n_tok == 1 && matvec_q8_supported(t);
                if (use_q8 && act_q8_init(&xq, n_in)) { fprintf(stderr, "out of memory\n"); return 1; }
                run_once(&W, x, y, n_tok, use_q8 ? &xq : NULL, q8path); /* warm-up */
                const double flop = 2.0 * (double)n_in * (double)n_out * (double)n_tok;
                /* best single call within `secs` seconds of calls: robust against
                 * other load on the machine */
                double best = 1e30, t_start = now();
                int calls = 0;
                while (calls < 3 || now() - t_start < secs) {
                    double t0 = now();
                    run_once(&W, x, y, n_tok, use_q8 ? &xq : NULL, q8path);
                    double dt = now() - t0;
                    if (dt < best) best = dt;
                    calls++;
                }
                const double gf = flop / best * 1e-9;
                printf("%-5s %6lld %6lld %5lld %10.1f %9.1f %6.0f%%", tensor_type_name(t), (long long)n_in,
                       (long long)n_out, (long long)n_tok, best * 1e6, gf, peak1 > 0 ? 100.0 * gf / (peak1 * threads) : 0.0);
                if (n_tok == 1) printf(" %8.1f\n", (double)wbytes / best * 1e-9);
                else printf(" %8s\n", "-");
                fflush(stdout);
                act_q8_free(&xq);
                free(x);
                free(y);
            }
            free(w);
        }
    }
    return 0;
}
