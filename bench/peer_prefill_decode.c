/* The llama.cpp peer at long depths: one process prefills L random tokens
 * (timed), then generates N tokens one at a time after that context (timed),
 * and prints both as still bench CSV rows (pp L, then tg N @ dL).
 *
 * Why not llama-bench: its tg test at depth L prefills the depth untimed in
 * the same process as the test, and its pp test is another process, so
 * llama.cpp's prefill of a 64K context (most of an hour on 2 threads) would
 * run twice. This program uses the same library (libllama of the peer build)
 * with llama-bench's settings: flash attention on, n_batch 2048, n_ubatch
 * 512, f16 KV cache, random token ids (BOS first if the vocabulary adds one),
 * prefill in n_batch-token calls, one llama_decode + synchronize per
 * generated token, no warm-up run (as bench-long's cells of >= 8K tokens).
 * scripts/bench-long.sh checks it against llama-bench at a short length.
 *
 * Build (scripts/bench-long.sh does it): cc -O2 -I peer/src/llama.cpp/include
 *   -I peer/src/llama.cpp/ggml/include bench/peer_prefill_decode.c
 *   peer/build/src/libllama.a peer/build/ggml/src/libggml.a
 *   peer/build/ggml/src/libggml-cpu.a peer/build/ggml/src/libggml-base.a
 *   -lstdc++ -lgomp -lpthread -lm
 * Usage: peer-prefill-decode MODEL L N THREADS
 * Output: the still bench CSV header, a pp row and a tg row (peak RSS from
 * getrusage after each phase; no state count). Exit 1 on any error. */
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double peak_rss_mib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0;   /* KiB on Linux */
}

static void quiet_log(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int parse_count(const char *s, int lo, int hi, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

int main(int argc, char **argv) {
    int L, N, threads;
    if (argc != 5 || parse_count(argv[2], 1, 1 << 22, &L) || parse_count(argv[3], 1, 1 << 20, &N) ||
        parse_count(argv[4], 1, 1024, &threads)) {
        fprintf(stderr, "usage: peer-prefill-decode MODEL L N THREADS (positive integers)\n");
        return 1;
    }
    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "peer-prefill-decode: error: cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(L + N);
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "peer-prefill-decode: error: cannot create a %d-token context\n", L + N);
        llama_model_free(model);
        return 1;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token *tokens = malloc(sizeof(llama_token) * (size_t)(L > N ? L : N));
    if (!tokens) return 1;
    srand(1);
    for (int i = 0; i < L; i++) tokens[i] = rand() % n_vocab;
    if (llama_vocab_get_add_bos(vocab)) tokens[0] = llama_vocab_bos(vocab);

    int rc = 1;
    double t0 = now();
    for (int done = 0; done < L;) {
        int n = L - done < (int)cp.n_batch ? L - done : (int)cp.n_batch;
        if (llama_decode(ctx, llama_batch_get_one(tokens + done, n))) {
            fprintf(stderr, "peer-prefill-decode: error: prefill failed at token %d\n", done);
            goto out;
        }
        done += n;
    }
    llama_synchronize(ctx);
    const double t_pp = now() - t0, rss_pp = peak_rss_mib();

    for (int i = 0; i < N; i++) tokens[i] = rand() % n_vocab;
    t0 = now();
    for (int i = 0; i < N; i++) {
        if (llama_decode(ctx, llama_batch_get_one(tokens + i, 1))) {
            fprintf(stderr, "peer-prefill-decode: error: decode failed at step %d\n", i);
            goto out;
        }
        llama_synchronize(ctx);
    }
    const double t_tg = now() - t0, rss_tg = peak_rss_mib();

    printf("model,attn,test,n_prompt,n_gen,depth,reps,tps_mean,tps_sd,ms_per_token,peak_rss_mib,state_mib\n");
    printf("%s,llama.cpp,pp%d,%d,0,0,1,%.10g,0,%.10g,%.1f,\n", argv[1], L, L, L / t_pp, 1000.0 * t_pp / L, rss_pp);
    printf("%s,llama.cpp,tg%d @ d%d,0,%d,%d,1,%.10g,0,%.10g,%.1f,\n", argv[1], N, L, N, L, N / t_tg,
           1000.0 * t_tg / N, rss_tg);
    rc = 0;
out:
    free(tokens);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return rc;
}
