/* Helper for tests/python/test_finetune_grad.py (not a test itself): the
 * stage-2 loss and gradients of one sequence through the whole model
 * (src/train/train_lm.c), with given LoRA tensors and attention parameters.
 *
 *   finetune_tool --write-tiny PATH     write tests/tiny_model.h's model
 *   finetune_tool MODEL IN OUT
 *
 * IN starts with one ASCII header line of space-separated key=value pairs:
 *   T=                  tokens (required)
 *   kind= window= chunk= F= budget= lambda= per_kv_head= routing= linear=
 *   feature_map= gate=  the attention plan of every layer (default softmax)
 *   rank= alpha= targets=q,k,v,o,...   the LoRA (default 4, 8, all)
 *   train_attn=0|1      also the attention parameters' gradient (default 0)
 *   dropout= drop_seed= LoRA dropout (default 0)
 *   threads=N
 * followed by little-endian int32 tokens [T], float32 weights [T] (position t
 * predicts token t+1), the LoRA tensors as float32 (per layer, per target in
 * the order q, k, v, o, gate, up, down, when targeted: A [rank][n_in] then B
 * [n_out][rank]), then every layer's attention parameters (param_count
 * floats each, in layer order) when the kind has any.
 *
 * OUT gets float32: the gradients of the loss (Σ w_t CE_t) in the same order
 * as the LoRA tensors, then (train_attn) the attention parameters'. Prints
 * `loss=L wsum=W n_lora=N n_attn=M`. Exit 1 on any error (one line). */
#include "kinds/attn.h"
#include "common/common.h"
#include "model/lora.h"
#include "model/model.h"
#include "train/train_lm.h"

#include <errno.h>
#include <limits.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "read_file.h"
#include "../tiny_model.h"

static const char *const ROUTINGS[] = {"saliency", "random", "keynorm", "qk", "position", "none"};

static int parse_int(const char *key, const char *s, long lo, long hi, int *out, still_err *err) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return still_fail(err, STILL_E_ARG, "bad value '%s' for %s", s, key);
    *out = (int)v;
    return STILL_OK;
}

static int run(const char *model, const char *in, const char *out, still_err *err) {
    char *buf = NULL;
    size_t len = 0;
    int rc = read_file(in, (void **)&buf, &len, err);
    if (rc) return rc;
    char *nl = memchr(buf, '\n', len);
    if (!nl) {
        free(buf);
        return still_fail(err, STILL_E_FORMAT, "%s: no header line", in);
    }
    *nl = 0;
    still_attn_params ap = still_attn_default_params();
    static char kind[32] = "softmax", routing[32] = "saliency", fmap[32] = "npmap", targets[128] = "all";
    int T = -1, rank = 4, train_attn = 0, threads = 0, drop_seed = 0;
    float alpha = 8, dropout = 0;
    for (char *tok = strtok(buf, " \t\r"); tok && !rc; tok = strtok(NULL, " \t\r")) {
        char *eq = strchr(tok, '=');
        if (!eq) {
            rc = still_fail(err, STILL_E_FORMAT, "header: expected key=value, got '%s'", tok);
            break;
        }
        *eq = 0;
        const char *k = tok, *v = eq + 1;
        if (!strcmp(k, "T")) rc = parse_int(k, v, 2, 1 << 20, &T, err);
        else if (!strcmp(k, "kind")) snprintf(kind, sizeof kind, "%s", v);
        else if (!strcmp(k, "routing")) snprintf(routing, sizeof routing, "%s", v);
        else if (!strcmp(k, "feature_map")) snprintf(fmap, sizeof fmap, "%s", v);
        else if (!strcmp(k, "targets")) snprintf(targets, sizeof targets, "%s", v);
        else if (!strcmp(k, "window")) rc = parse_int(k, v, 1, 1 << 20, &ap.window, err);
        else if (!strcmp(k, "chunk")) rc = parse_int(k, v, 1, 1 << 16, &ap.chunk, err);
        else if (!strcmp(k, "F")) rc = parse_int(k, v, 1, 4096, &ap.feature_dim, err);
        else if (!strcmp(k, "budget")) rc = parse_int(k, v, 0, 1 << 22, &ap.budget, err);
        else if (!strcmp(k, "lambda")) rc = parse_int(k, v, -1, 1 << 16, &ap.lambda, err);
        else if (!strcmp(k, "per_kv_head")) rc = parse_int(k, v, 0, 1, &ap.per_kv_head, err);
        else if (!strcmp(k, "linear")) rc = parse_int(k, v, 0, 1, &ap.linear, err);
        else if (!strcmp(k, "gate")) rc = parse_int(k, v, 0, 1, &ap.gate, err);
        else if (!strcmp(k, "rank")) rc = parse_int(k, v, 1, 4096, &rank, err);
        else if (!strcmp(k, "train_attn")) rc = parse_int(k, v, 0, 1, &train_attn, err);
        else if (!strcmp(k, "threads")) rc = parse_int(k, v, 1, 4096, &threads, err);
        else if (!strcmp(k, "drop_seed")) rc = parse_int(k, v, 0, INT_MAX, &drop_seed, err);
        else if (!strcmp(k, "alpha")) alpha = strtof(v, NULL);
        else if (!strcmp(k, "dropout")) dropout = strtof(v, NULL);
        else rc = still_fail(err, STILL_E_ARG, "header: unknown key '%s'", k);
    }
    (void)ROUTINGS;
    if (!rc && T < 0) rc = still_fail(err, STILL_E_ARG, "header: T= missing");
    if (threads > 0) omp_set_num_threads(threads);
    still_model *m = NULL;
    lora_set *lo = NULL, *grad = NULL;
    lm_train *tr = NULL;
    float **ag = NULL, *gout = NULL;
    if (!rc) rc = still_model_load(model, &m, err);
    if (!rc) {
        ap.kind = kind, ap.routing = routing, ap.feature_map = fmap;
        rc = still_model_set_attention(m, &ap, err);
    }
    unsigned mask = 0;
    if (!rc) rc = lora_parse_targets(targets, &mask, err);
    const lora_shape sh = m ? model_lora_shape(m) : (lora_shape){0};
    if (!rc) rc = lora_create(&sh, rank, alpha, mask, &lo, err);
    if (!rc) rc = lora_create(&sh, rank, alpha, mask, &grad, err);
    const int NLy = m ? m->cfg.n_layer : 0;
    size_t n_attn = 0;
    for (int l = 0; !rc && l < NLy; l++) n_attn += attn_kind_get(m->attn_cfg[l].kind)->param_count(&m->attn_cfg[l]);
    const size_t n_lora = lo ? lora_floats(lo) : 0;
    const size_t want = (size_t)T * 8 + (n_lora + n_attn) * 4, have = len - (size_t)(nl + 1 - buf);
    if (!rc && have != want) rc = still_fail(err, STILL_E_FORMAT, "%s: %zu data bytes, expected %zu", in, have, want);
    if (!rc) {
        const unsigned char *p = (const unsigned char *)nl + 1;
        const int32_t *tok = (const int32_t *)p;
        const float *w = (const float *)(p + 4 * (size_t)T);
        const float *f = w + T;
        for (int l = 0; l < NLy; l++)
            for (int t = 0; t < LORA_N_TARGETS; t++) {
                float *A = lora_A(lo, l, (lora_target)t), *B = lora_B(lo, l, (lora_target)t);
                if (!A) continue;
                memcpy(A, f, sizeof(float) * (size_t)rank * lo->n_in[t]), f += (size_t)rank * lo->n_in[t];
                memcpy(B, f, sizeof(float) * (size_t)lo->n_out[t] * rank), f += (size_t)lo->n_out[t] * rank;
            }
        ag = calloc((size_t)NLy, sizeof *ag);
        if (!ag) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        for (int l = 0; !rc && l < NLy; l++) {
            const size_t n = attn_kind_get(m->attn_cfg[l].kind)->param_count(&m->attn_cfg[l]);
            if (!n) continue;
            memcpy(m->attn_params[l], f, sizeof(float) * n), f += n;
            if (train_attn && !(ag[l] = calloc(n, sizeof(float)))) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        }
        if (!rc) rc = lm_train_create(m, lo, T, dropout, &tr, err);
        double loss = 0, ws = 0;
        const lm_grads g = {.lora = grad, .attn = train_attn ? ag : NULL};
        if (!rc) rc = lm_train_seq(tr, tok, w, T, 1.0f, (uint64_t)drop_seed, &g, &loss, &ws, err);
        if (!rc) {
            const size_t n_out = n_lora + (train_attn ? n_attn : 0);
            gout = malloc(sizeof(float) * (n_out + 1));
            if (!gout) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
            float *o = gout;
            for (int l = 0; !rc && l < NLy; l++)
                for (int t = 0; t < LORA_N_TARGETS; t++) {
                    const float *A = lora_A(grad, l, (lora_target)t), *B = lora_B(grad, l, (lora_target)t);
                    if (!A) continue;
                    memcpy(o, A, sizeof(float) * (size_t)rank * lo->n_in[t]), o += (size_t)rank * lo->n_in[t];
                    memcpy(o, B, sizeof(float) * (size_t)lo->n_out[t] * rank), o += (size_t)lo->n_out[t] * rank;
                }
            for (int l = 0; !rc && train_attn && l < NLy; l++) {
                const size_t n = attn_kind_get(m->attn_cfg[l].kind)->param_count(&m->attn_cfg[l]);
                if (n) memcpy(o, ag[l], sizeof(float) * n), o += n;
            }
            FILE *fo = rc ? NULL : fopen(out, "wb");
            if (!rc && (!fo || fwrite(gout, sizeof(float), n_out, fo) != n_out)) rc = still_fail(err, STILL_E_IO, "cannot write %s", out);
            if (fo) fclose(fo);
            if (!rc) printf("loss=%.17g wsum=%.17g n_lora=%zu n_attn=%zu\n", loss, ws, n_lora, n_attn);
        }
    }
    for (int l = 0; ag && l < NLy; l++) free(ag[l]);
    free(ag), free(gout);
    lm_train_free(tr);
    lora_free(lo), lora_free(grad);
    still_model_free(m);
    free(buf);
    return rc;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--write-tiny")) {
        ref_weights R;
        write_model(argv[2], &R);
        return 0;
    }
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL IN OUT | --write-tiny PATH\n", argv[0]);
        return 1;
    }
    still_err err = {0};
    if (run(argv[1], argv[2], argv[3], &err)) {
        fprintf(stderr, "finetune_tool: %s\n", err.msg);
        return 1;
    }
    return 0;
}
