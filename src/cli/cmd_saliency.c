/* `still saliency`: the STILL paper's local–global consistency analysis on
 * real text, with the model's own (softmax) attention.
 *
 * For each layer and query head, every token j gets its self-saliency score
 * over its rolling window R(j) = max(0, j-C+1) .. j (spec formula, explicit).
 * For every chunk c that has far-away future queries F(c) = { t : c(t) >= c+2 }
 * (beyond the local terrace), the global importance of its key j is
 *   G_j = mean over t in F(c) of softmax_t(j)        (full causal attention)
 * and three selections of k tokens of the chunk are compared:
 *   saliency (top-k by score), oracle (top-k by G), random (seeded);
 * captured mass = sum of G over the selection / sum of G over the chunk,
 * overlap = |selection ∩ oracle| / k. Reported per layer (mean over heads and
 * chunks) and overall; then the tokens selected most often. */
#include "cli.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int n_layer, H, Hk, D, L;
    float *q, *k;   /* [layer][L][H*D], [layer][L][Hk*D] */
} capture;

static void observe(void *data, int layer, int p0, int T, const float *x, const float *q, const float *k, const float *v,
                    const float *out) {
    (void)x, (void)v, (void)out;
    capture *c = data;
    memcpy(c->q + ((size_t)layer * c->L + p0) * c->H * c->D, q, sizeof(float) * (size_t)T * c->H * c->D);
    memcpy(c->k + ((size_t)layer * c->L + p0) * c->Hk * c->D, k, sizeof(float) * (size_t)T * c->Hk * c->D);
}

/* Self-saliency score of token j for one head (explicit formula, ε = 1e-8). */
static double self_saliency(const float *q, const float *k, int qstride, int kstride, int j, int C, int D,
                            double *s) {
    const double eps = 1e-8, scale = 1.0 / sqrt((double)D);
    int lo = j - C + 1 > 0 ? j - C + 1 : 0, n = j - lo + 1;
    double mx = -INFINITY, mx_nd = -INFINITY;
    for (int l = lo; l <= j; l++) {
        double d = 0;
        for (int i = 0; i < D; i++) d += (double)q[(size_t)j * qstride + i] * k[(size_t)l * kstride + i];
        s[l - lo] = d * scale;
        if (s[l - lo] > mx) mx = s[l - lo];
        if (l < j && s[l - lo] > mx_nd) mx_nd = s[l - lo];
    }
    double z = 0, z_nd = 0;
    for (int i = 0; i < n; i++) {
        z += exp(s[i] - mx);
        if (i < n - 1) z_nd += exp(s[i] - mx_nd);
    }
    double score = 0;
    for (int i = 0; i < n; i++) {
        double a = exp(s[i] - mx) / z;
        double b = i < n - 1 ? exp(s[i] - mx_nd) / z_nd : 0;
        score += a * log((a + eps) / (b + eps));
    }
    return score;
}

/* Indices of the k largest values of v[0..n) (ties: lower index first). */
static void top_k(const double *v, int n, int k, int *out) {
    char used[1024] = {0};
    for (int r = 0; r < k; r++) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (!used[i] && (best < 0 || v[i] > v[best])) best = i;
        used[best] = 1;
        out[r] = best;
    }
}

typedef struct { int32_t id; long selected, seen; } tok_count;

static int by_selected(const void *a, const void *b) {
    const tok_count *x = a, *y = b;
    if (x->selected != y->selected) return x->selected < y->selected ? 1 : -1;
    return x->id - y->id;
}

int cmd_saliency(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_SALIENCY, "saliency", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    if (!o.file) {
        fprintf(stderr, "still saliency: error: no text file given (use -f FILE)\n");
        return 2;
    }
    const int C = o.ap.chunk, K = o.topk;
    if (K < 1 || K > C || C > 1024) {
        fprintf(stderr, "still saliency: error: need 1 <= --top-k (%d) <= --chunk (%d) <= 1024\n", K, C);
        return 2;
    }
    char *text;
    size_t len;
    if (cli_read_file(o.file, &text, &len)) return 1;
    still_model *m = NULL;
    still_context *ctx = NULL;
    int32_t *ids = NULL;
    capture cap = {0};
    int rc = 1;
    still_err err = {0};
    const int lrc = cli_load_model(&o, &m);
    if (lrc) {
        rc = lrc;
        goto done;
    }
    still_model_info mi = still_model_get_info(m);
    size_t n_ids;
    if (still_tokenize(m, text, len, 0, &ids, &n_ids, &err)) {
        fprintf(stderr, "still saliency: error: %s\n", err.msg);
        goto done;
    }
    int L = o.n_ctx ? o.n_ctx : 2048;
    if ((size_t)L > n_ids) L = (int)n_ids;
    if (L < 3 * C) {
        if (o.n_ctx && o.n_ctx < 3 * C)
            fprintf(stderr, "still saliency: error: -c %d holds fewer than 3 chunks of %d tokens (give -c %d or more, or a "
                            "smaller --chunk)\n", o.n_ctx, C, 3 * C);
        else
            fprintf(stderr, "still saliency: error: need at least 3 chunks of text (%d tokens), the file has %zu\n",
                    3 * C, n_ids);
        goto done;
    }
    cap = (capture){.n_layer = mi.n_layer, .H = mi.n_head, .Hk = mi.n_head_kv, .D = mi.head_dim, .L = L};
    cap.q = malloc(sizeof(float) * (size_t)mi.n_layer * L * mi.n_head * mi.head_dim);
    cap.k = malloc(sizeof(float) * (size_t)mi.n_layer * L * mi.n_head_kv * mi.head_dim);
    still_context_params cp = {.n_ctx = L, .n_batch = o.n_batch};
    if (!cap.q || !cap.k || still_context_create(m, cp, &ctx, &err)) {
        fprintf(stderr, "still saliency: error: %s\n", cap.q && cap.k ? err.msg : "out of memory");
        goto done;
    }
    still_context_set_observer(ctx, observe, &cap);
    if (still_decode(ctx, ids, L, NULL, 0, &err)) {
        fprintf(stderr, "still saliency: error: %s\n", err.msg);
        goto done;
    }
    const int H = mi.n_head, D = mi.head_dim, G = H / mi.n_head_kv, n_chunks = L / C;
    const int n_sel_chunks = n_chunks - 2;   /* chunks with far-away future queries */
    long *sel_count = calloc((size_t)mi.n_vocab, sizeof(long));
    double (*layer_stats)[5] = calloc((size_t)mi.n_layer, sizeof *layer_stats);
    if (!sel_count || !layer_stats) goto done;
    fprintf(stderr, "saliency: %d tokens, %d layers x %d heads, chunk %d, top-%d of each of %d chunks\n", L,
            mi.n_layer, H, C, K, n_sel_chunks);
    uint64_t rng_seed = 0x5eed ^ o.ap.seed;
    for (int layer = 0; layer < mi.n_layer; layer++) {
        double stats[5] = {0};   /* captured: saliency, oracle, random; overlap: saliency, random */
#pragma omp parallel
        {
            double *s = malloc(sizeof(double) * (size_t)L);
            double *score = malloc(sizeof(double) * (size_t)L), *g = malloc(sizeof(double) * (size_t)L);
            double local[5] = {0};
#pragma omp for schedule(dynamic, 1)
            for (int h = 0; h < H; h++) {
                const float *q = cap.q + (size_t)layer * L * H * D + (size_t)h * D;
                const float *k = cap.k + (size_t)layer * L * mi.n_head_kv * D + (size_t)(h / G) * D;
                const int qs = H * D, ks = mi.n_head_kv * D;
                for (int j = 0; j < L; j++) score[j] = self_saliency(q, k, qs, ks, j, C, D, s);
                /* G: far queries' attention on each key, averaged per chunk. */
                memset(g, 0, sizeof(double) * (size_t)L);
                for (int t = 2 * C; t < L; t++) {
                    int lim = (t / C - 1) * C;   /* keys of chunks <= c(t) - 2 */
                    double mx = -INFINITY, z = 0;
                    for (int j = 0; j <= t; j++) {
                        double d = 0;
                        for (int i = 0; i < D; i++) d += (double)q[(size_t)t * qs + i] * k[(size_t)j * ks + i];
                        s[j] = d / sqrt((double)D);
                        if (s[j] > mx) mx = s[j];
                    }
                    for (int j = 0; j <= t; j++) z += s[j] = exp(s[j] - mx);
                    for (int j = 0; j < lim; j++) g[j] += s[j] / z;
                }
                uint64_t r = rng_seed + (uint64_t)layer * 1000 + (uint64_t)h;
                for (int c = 0; c < n_sel_chunks; c++) {
                    const double *sc = score + c * C, *gc = g + c * C;
                    int sal[1024], ora[1024], rnd[1024];
                    top_k(sc, C, K, sal);
                    top_k(gc, C, K, ora);
                    double rv[1024];
                    for (int i = 0; i < C; i++) {
                        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
                        rv[i] = (double)(r >> 11);
                    }
                    top_k(rv, C, K, rnd);
                    double total = 0, cs = 0, co = 0, cr = 0;
                    int ov_s = 0, ov_r = 0;
                    for (int i = 0; i < C; i++) total += gc[i];
                    for (int a = 0; a < K; a++) {
                        cs += gc[sal[a]], co += gc[ora[a]], cr += gc[rnd[a]];
                        for (int b = 0; b < K; b++) ov_s += sal[a] == ora[b], ov_r += rnd[a] == ora[b];
#pragma omp atomic
                        sel_count[ids[c * C + sal[a]]]++;
                    }
                    if (total > 0) local[0] += cs / total, local[1] += co / total, local[2] += cr / total;
                    local[3] += (double)ov_s / K, local[4] += (double)ov_r / K;
                }
            }
#pragma omp critical
            for (int i = 0; i < 5; i++) stats[i] += local[i];
            free(s), free(score), free(g);
        }
        for (int i = 0; i < 5; i++) layer_stats[layer][i] = stats[i] / ((double)H * n_sel_chunks);
        fprintf(stderr, "\rlayer %d/%d", layer + 1, mi.n_layer);
    }
    fprintf(stderr, "\n");
    printf("Local-global consistency: %d tokens of %s, chunk C=%d, top-%d per chunk, far queries t with c(t) >= c+2\n\n",
           L, o.file, C, K);
    printf("| layer | mass captured: saliency | oracle top-%d | random | overlap with oracle: saliency | random |\n", K);
    printf("| ---: | ---: | ---: | ---: | ---: | ---: |\n");
    double mean[5] = {0};
    for (int l = 0; l < mi.n_layer; l++) {
        printf("| %d | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %.1f%% |\n", l, 100 * layer_stats[l][0],
               100 * layer_stats[l][1], 100 * layer_stats[l][2], 100 * layer_stats[l][3], 100 * layer_stats[l][4]);
        for (int i = 0; i < 5; i++) mean[i] += layer_stats[l][i] / mi.n_layer;
    }
    printf("| mean | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %.1f%% |\n\n", 100 * mean[0], 100 * mean[1], 100 * mean[2],
           100 * mean[3], 100 * mean[4]);
    /* Most often selected tokens, with how often they occur in the text. */
    tok_count *tc = calloc((size_t)mi.n_vocab, sizeof *tc);
    if (tc) {
        for (int i = 0; i < mi.n_vocab; i++) tc[i].id = i, tc[i].selected = sel_count[i];
        for (int j = 0; j < n_sel_chunks * C; j++) tc[ids[j]].seen++;
        qsort(tc, (size_t)mi.n_vocab, sizeof *tc, by_selected);
        long heads = (long)mi.n_layer * H;
        printf("Tokens selected most often (over %d layers x %d heads):\n\n| token | selected | occurrences | selected per occurrence and head |\n| --- | ---: | ---: | ---: |\n",
               mi.n_layer, H);
        for (int i = 0; i < 30 && tc[i].selected > 0; i++) {
            char raw[48], piece[160];
            size_t n = still_token_to_piece(m, tc[i].id, raw, sizeof raw);
            if (n > sizeof raw) n = sizeof raw;
            size_t w = 0;   /* make whitespace and markdown specials visible */
            for (size_t b = 0; b < n && w + 4 < sizeof piece; b++) {
                unsigned char ch = (unsigned char)raw[b];
                if (ch == '\n') piece[w++] = '\\', piece[w++] = 'n';
                else if (ch == ' ') piece[w++] = '_';
                else if (ch == '|' || ch == '`') piece[w++] = '\\', piece[w++] = (char)ch;
                else if (ch < 32) w += (size_t)snprintf(piece + w, sizeof piece - w, "\\x%02x", ch);
                else piece[w++] = (char)ch;
            }
            piece[w] = 0;
            printf("| `%s` | %ld | %ld | %.2f |\n", piece, tc[i].selected, tc[i].seen,
                   (double)tc[i].selected / ((double)tc[i].seen * heads));
        }
        free(tc);
    }
    free(sel_count);
    free(layer_stats);
    rc = 0;
done:
    free(cap.q), free(cap.k), free(ids), free(text);
    still_context_free(ctx);
    still_model_free(m);
    return rc;
}
