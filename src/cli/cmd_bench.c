/* `still bench`: llama-bench-style measurements.
 * pp N: process N prompt tokens (chunks of 512) after a context of depth d.
 * tg N: generate N tokens one at a time after a context of depth d.
 * Each test runs once as a warm-up, then r timed repetitions, each from a
 * fresh context (the depth prefill is not timed); t/s is reported as
 * mean ± sample standard deviation over the repetitions. */
#include "cli.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    still_context *ctx;
    float *logits;
    int32_t *tokens;   /* pseudo-random token ids, reused */
    int n_tokens;
} bench_state;

/* Prefill `depth` tokens (untimed), then time the test. Returns seconds, < 0 on error. */
static double run_once(bench_state *b, int depth, int n_prompt, int n_gen) {
    still_err err = {0};
    still_context_truncate(b->ctx, 0, NULL);
    if (depth > 0 && still_decode(b->ctx, b->tokens, depth, NULL, 0, &err)) goto fail;
    double t0 = cli_now();
    if (n_prompt > 0 && still_decode(b->ctx, b->tokens + depth, n_prompt, b->logits, 0, &err)) goto fail;
    for (int i = 0; i < n_gen; i++) {
        int32_t tok = b->tokens[depth + i];
        if (still_decode(b->ctx, &tok, 1, b->logits, 0, &err)) goto fail;
    }
    return cli_now() - t0;
fail:
    fprintf(stderr, "still bench: error: %s\n", err.msg);
    return -1;
}

int cmd_bench(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_BENCH, "bench", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    still_model *m;
    if (cli_load_model(&o, &m)) return 1;
    still_model_info info = still_model_get_info(m);
    int n_max = o.n_prompt > o.n_gen ? o.n_prompt : o.n_gen;
    bench_state b = {0};
    b.n_tokens = o.depth + n_max;
    b.tokens = malloc(sizeof(int32_t) * (size_t)(b.n_tokens > 0 ? b.n_tokens : 1));
    b.logits = malloc(sizeof(float) * (size_t)info.n_vocab);
    int rc = 1;
    still_err err = {0};
    if (!b.tokens || !b.logits) goto done;
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    for (int i = 0; i < b.n_tokens; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b.tokens[i] = (int32_t)(x % (uint64_t)info.n_vocab);
    }
    /* The context holds depth + the test's tokens, or -c if larger (to see
     * how the attention state scales with the configured context). */
    int n_ctx = b.n_tokens > 0 ? b.n_tokens : 1;
    if (o.n_ctx > n_ctx) n_ctx = o.n_ctx;
    still_context_params cp = {.n_ctx = n_ctx, .n_batch = 512};
    if (still_context_create(m, cp, &b.ctx, &err)) {
        fprintf(stderr, "still bench: error: %s\n", err.msg);
        goto done;
    }
    int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
    printf("| model | size | params | backend | attn | threads | test | t/s | peak RSS | attn state |\n");
    printf("| ----- | ---: | -----: | ------- | ---- | ------: | ---: | --: | -------: | ---------: |\n");
    for (int which = 0; which < 2; which++) {
        int np = which == 0 ? o.n_prompt : 0, ng = which == 1 ? o.n_gen : 0;
        if (np + ng == 0) continue;
        if (run_once(&b, o.depth, np, ng) < 0) goto done;   /* warm-up */
        double sum = 0, sum2 = 0;
        for (int r = 0; r < o.reps; r++) {
            double t = run_once(&b, o.depth, np, ng);
            if (t < 0) goto done;
            double tps = (np + ng) / t;
            sum += tps;
            sum2 += tps * tps;
        }
        double mean = sum / o.reps;
        double sd = o.reps > 1 ? sqrt(fmax(0.0, (sum2 - o.reps * mean * mean) / (o.reps - 1))) : 0;
        char test[64];
        if (o.depth > 0) snprintf(test, sizeof test, "%s%d @ d%d", np ? "pp" : "tg", np + ng, o.depth);
        else snprintf(test, sizeof test, "%s%d", np ? "pp" : "tg", np + ng);
        printf("| llama %d-layer d%d | %.2f MiB | %.2f M | CPU | %s | %d | %s | %.2f ± %.2f | %.1f MiB | %.2f MiB |\n",
               info.n_layer, info.d_model, info.file_bytes / 1048576.0,
               info.n_params / 1e6, o.ap.kind, threads, test, mean, sd, cli_peak_rss() / 1048576.0,
               still_context_state_bytes(b.ctx) / 1048576.0);
        fflush(stdout);
    }
    rc = 0;
done:
    still_context_free(b.ctx);
    free(b.tokens);
    free(b.logits);
    still_model_free(m);
    return rc;
}
