/* Micro-benchmark for matmul(): GFLOP/s for Q4_1 and Q8_0 weights at the
 * SmolLM2-135M shapes, n_tok = 1 (decode) and 512 (prefill); for n_tok = 1 it
 * also prints the effective weight bandwidth.
 *
 * Build (from the repository root):
 *   gcc -std=gnu11 -O3 -march=native -fopenmp -Iinclude -Isrc \
 *       src/common.c src/quant.c src/matmul.c bench/bench_matmul.c -lm -o bench_matmul
 * Usage: bench_matmul [threads (default 2)] [n_tok list, e.g. 1,512] */
#include "quant.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* random blocks with sane fp16 scales */
static void fill_weights(uint32_t t, uint8_t *w, size_t nbytes) {
    for (size_t i = 0; i < nbytes; i++) w[i] = (uint8_t)xorshift();
    const size_t bb = tensor_type_block_bytes(t);
    for (size_t off = 0; off + bb <= nbytes; off += bb) {
        uint16_t d = f32_to_f16(0.001f + (float)(xorshift() % 1000) * 1e-5f);
        uint16_t m = f32_to_f16(-0.01f * (float)(xorshift() % 100) * 1e-2f);
        memcpy(w + off, &d, 2);
        if (t == TT_Q4_1) memcpy(w + off + 2, &m, 2);
    }
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    int toks[8] = {1, 512}, ntoks = 2;
    if (argc > 2) {
        ntoks = 0;
        for (char *p = strtok(argv[2], ","); p && ntoks < 8; p = strtok(NULL, ",")) toks[ntoks++] = atoi(p);
    }
    omp_set_num_threads(threads);
    static const int64_t shapes[][2] = {{576, 576}, {576, 1536}, {1536, 576}, {576, 49152}};
    static const uint32_t types[] = {TT_Q4_1, TT_Q8_0};
    printf("threads=%d\n", threads);
    printf("%-5s %6s %6s %5s %10s %9s %8s\n", "type", "n_in", "n_out", "n_tok", "time(us)", "GFLOP/s", "GB/s");
    for (size_t ti = 0; ti < 2; ti++) {
        for (size_t si = 0; si < 4; si++) {
            const uint32_t t = types[ti];
            const int64_t n_in = shapes[si][0], n_out = shapes[si][1];
            const size_t rb = tensor_row_bytes(t, n_in), wbytes = rb * (size_t)n_out;
            uint8_t *w = malloc(wbytes);
            fill_weights(t, w, wbytes);
            weight_matrix W = {.type = t, .n_in = n_in, .n_out = n_out, .data = w, .row_bytes = rb};
            for (int a = 0; a < ntoks; a++) {
                const int64_t n_tok = toks[a];
                float *x = malloc(sizeof(float) * (size_t)(n_in * n_tok));
                float *y = malloc(sizeof(float) * (size_t)(n_out * n_tok));
                for (int64_t i = 0; i < n_in * n_tok; i++) x[i] = (float)((int)(xorshift() % 2001) - 1000) * 1e-3f;
                matmul(&W, x, y, n_tok); /* warm-up */
                /* about 0.5 s of calls in total */
                double flop = 2.0 * (double)n_in * (double)n_out * (double)n_tok;
                int reps = 1;
                double t0 = now();
                matmul(&W, x, y, n_tok);
                double one = now() - t0;
                reps = one > 0 ? (int)(0.1 / one) + 1 : 1000;
                /* best single call over >= 5 batches: robust against other
                 * load on the machine */
                double best = 1e30;
                for (int batch = 0; batch < 5; batch++) {
                    for (int r = 0; r < reps; r++) {
                        t0 = now();
                        matmul(&W, x, y, n_tok);
                        double dt = now() - t0;
                        if (dt < best) best = dt;
                    }
                }
                if (n_tok == 1)
                    printf("%-5s %6lld %6lld %5lld %10.1f %9.1f %8.1f\n", tensor_type_name(t), (long long)n_in,
                           (long long)n_out, (long long)n_tok, best * 1e6, flop / best * 1e-9, (double)wbytes / best * 1e-9);
                else
                    printf("%-5s %6lld %6lld %5lld %10.1f %9.1f %8s\n", tensor_type_name(t), (long long)n_in,
                           (long long)n_out, (long long)n_tok, best * 1e6, flop / best * 1e-9, "-");
                fflush(stdout);
                free(x);
                free(y);
            }
            free(w);
        }
    }
    return 0;
}
