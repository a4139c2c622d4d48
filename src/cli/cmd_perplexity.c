/* `still perplexity`: the llama-perplexity protocol, so numbers compare
 * directly. The file is tokenized as a whole (no BOS: the model's
 * add_bos_token is false); it is cut into n = n_tokens / c chunks of c
 * tokens; each chunk starts from an empty context; in each chunk only the
 * second half is scored: positions j = c/2 .. c-2 predict token j+1.
 * PPL = exp(mean NLL); the ± is PPL times the standard error of the mean NLL. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void progress(int done, int total, double elapsed, double ppl) {
    int width = 30, fill = total ? done * width / total : width;
    double eta = done ? elapsed / done * (total - done) : 0;
    fprintf(stderr, "\r[%3d/%3d] [", done, total);
    for (int i = 0; i < width; i++) fputc(i < fill ? '#' : '-', stderr);
    fprintf(stderr, "] %5.1f s, ETA %5.1f s, PPL %.4f ", elapsed, eta, ppl);
    fflush(stderr);
}

int cmd_perplexity(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_PERPLEXITY, "perplexity", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    if (!o.file) {
        fprintf(stderr, "still perplexity: error: no text file given (use -f FILE)\n");
        return 2;
    }
    const int n_ctx = o.n_ctx ? o.n_ctx : 512;
    if (n_ctx < 4) {
        fprintf(stderr, "still perplexity: error: context size must be at least 4\n");
        return 2;
    }
    char *text;
    size_t len;
    if (cli_read_file(o.file, &text, &len)) return 1;
    if (len > 0 && text[len - 1] == '\n') text[--len] = 0;   /* as llama-perplexity does */
    still_model *m = NULL;
    still_context *ctx = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    int rc = 1;
    still_err err = {0};
    const int lrc = cli_load_model(&o, &m);
    if (lrc) {
        rc = lrc;
        goto done;
    }
    still_model_info info = still_model_get_info(m);
    size_t n_ids;
    if (still_tokenize(m, text, len, 0, &ids, &n_ids, &err)) {
        fprintf(stderr, "still perplexity: error: %s\n", err.msg);
        goto done;
    }
    int n_chunk = (int)(n_ids / (size_t)n_ctx);
    if (n_chunk == 0) {
        fprintf(stderr, "still perplexity: error: the file has %zu tokens, fewer than one %d-token chunk\n", n_ids,
                n_ctx);
        goto done;
    }
    if (o.chunks > 0 && o.chunks < n_chunk) n_chunk = o.chunks;
    int n_batch = o.n_batch < n_ctx ? o.n_batch : n_ctx;
    still_context_params cp = {.n_ctx = n_ctx, .n_batch = n_batch, .sel_cache = cli_sel_cache(&o), .device = cli_device(&o), .matvec = cli_matvec(&o), .prefill = cli_prefill(&o), .fixed_threads = o.fixed_threads};
    if (still_context_create(m, cp, &ctx, &err)) {
        fprintf(stderr, "still perplexity: error: %s\n", err.msg);
        goto done;
    }
    const int V = info.n_vocab;
    logits = malloc(sizeof(float) * (size_t)n_batch * (size_t)V);
    if (!logits) {
        fprintf(stderr, "still perplexity: error: out of memory\n");
        goto done;
    }
    fprintf(stderr, "perplexity: %zu tokens, %d chunks of %d, scoring the second half of each\n", n_ids, n_chunk,
            n_ctx);
    const int first = n_ctx / 2;
    double nll = 0, nll2 = 0;
    long count = 0;
    double t0 = cli_now();
    for (int c = 0; c < n_chunk; c++) {
        const int32_t *tok = ids + (size_t)c * n_ctx;
        still_context_truncate(ctx, 0, NULL);
        for (int p = 0; p < n_ctx; p += n_batch) {
            int T = n_ctx - p < n_batch ? n_ctx - p : n_batch;
            int want = p + T > first;   /* does this piece contain scored positions? */
            if (still_decode(ctx, tok + p, T, want ? logits : NULL, want, &err)) {
                fprintf(stderr, "\nstill perplexity: error: %s\n", err.msg);
                goto done;
            }
            if (!want) continue;
            for (int j = p > first ? p : first; j < p + T && j < n_ctx - 1; j++) {
                const float *l = logits + (size_t)(j - p) * V;
                double mx = -INFINITY;
                for (int v = 0; v < V; v++) mx = l[v] > mx ? l[v] : mx;
                double sum = 0;
                for (int v = 0; v < V; v++) sum += exp((double)l[v] - mx);
                double lp = (double)l[tok[j + 1]] - mx - log(sum);
                if (!isfinite(lp)) {
                    fprintf(stderr, "\nstill perplexity: error: non-finite log-probability at chunk %d position %d\n",
                            c, j);
                    goto done;
                }
                nll -= lp;
                nll2 += lp * lp;
                count++;
            }
        }
        if (isatty(2) || c + 1 == n_chunk) progress(c + 1, n_chunk, cli_now() - t0, exp(nll / count));
    }
    fprintf(stderr, "\n");
    double mean = nll / count, var = nll2 / count - mean * mean;
    double se = count > 1 && var > 0 ? sqrt(var / (count - 1)) : 0;
    double ppl = exp(mean);
    fprintf(stderr, "%ld tokens scored in %.1f s (%.1f tokens/s processed)\n", count, cli_now() - t0,
            (double)n_chunk * n_ctx / (cli_now() - t0));
    printf("PPL = %.4f +/- %.5f\n", ppl, ppl * se);
    rc = 0;
done:
    free(logits);
    free(ids);
    free(text);
    still_context_free(ctx);
    still_model_free(m);
    return rc;
}
