/* lm-evaluation-harness style multiple choice (see eval.h).
 *
 * Input: JSONL, one object per line, {"context": str, "choices": [str, ...],
 * "gold": int}; blank (whitespace-only) lines are skipped, other keys are
 * ignored. The whole file is read, validated and tokenized before the model
 * runs, so a bad line fails fast with "FILE:LINE: ..." in the error.
 *
 * Scoring follows lm-eval's loglikelihood requests:
 *   - trailing whitespace of the context moves to the front of the
 *     continuation (lm-eval's _encode_pair; ASCII whitespace here);
 *   - context and continuation are tokenized separately (no special-token
 *     parsing, no BOS): tokens = ids(context) ++ ids(continuation);
 *   - the sequence is left-truncated to its rightmost n_ctx + 1 tokens, of
 *     which the first n_ctx are fed to the model (the last one is only
 *     predicted), exactly like lm-eval's max_length window;
 *   - loglik = sum over the continuation tokens t_i of log_softmax(logits at
 *     position i-1)[t_i], computed in double.
 * acc takes the argmax of loglik, acc_norm the argmax of loglik divided by the
 * choice string's length in bytes (lm-eval divides by characters); ties go to
 * the first index.
 *
 * Not supported (clear error instead): an empty context (lm-eval would feed
 * the end-of-text token as the context), an empty choice string, a
 * continuation longer than n_ctx tokens.
 *
 * Consecutive requests share their prefix in the model state when the
 * attention kind can truncate its state to a prefix (softmax); otherwise every
 * choice is evaluated from an empty state. */
#include "common/common.h"
#include "eval/eval.h"

#ifdef STILL_NO_CJSON
/* Self-contained builds (make static) without a static cJSON: the scorer is
 * left out and says so. */
#include <string.h>
int eval_mc_run(still_model *m, const char *jsonl_path, int n_ctx, int matvec, eval_mc_result *res, still_err *err) {
    (void)m, (void)jsonl_path, (void)n_ctx, (void)matvec;
    memset(res, 0, sizeof *res);
    return still_fail(err, STILL_E_UNSUPPORTED, "multiple-choice scoring is not in this build (built without cJSON)");
}
void eval_mc_result_free(eval_mc_result *r) { (void)r; }
#else
#include <cjson/cJSON.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t *ids;
    size_t n;
} mc_toks;

typedef struct {
    int line;
    int gold;
    int n_choices;
    mc_toks ctx;
    mc_toks *cont;     /* [n_choices] */
    size_t *bytes;     /* [n_choices] length of each choice string */
} mc_item;

typedef struct {
    mc_item *items;
    int n, cap;
} mc_set;

static void item_free(mc_item *it) {
    free(it->ctx.ids);
    if (it->cont)
        for (int c = 0; c < it->n_choices; c++) free(it->cont[c].ids);
    free(it->cont);
    free(it->bytes);
    memset(it, 0, sizeof *it);
}

static void set_free(mc_set *s) {
    for (int i = 0; i < s->n; i++) item_free(&s->items[i]);
    free(s->items);
    memset(s, 0, sizeof *s);
}

/* Strict UTF-8 (no overlong forms, no surrogates, at most U+10FFFF). */
static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) { i++; continue; }
        int len;
        unsigned lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) len = 2;
        else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else return 0;
        if (n - i < (size_t)len) return 0;
        if (s[i + 1] < lo || s[i + 1] > hi) return 0;
        for (int k = 2; k < len; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF) return 0;
        i += (size_t)len;
    }
    return 1;
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

static int tokenize(const still_model *m, const char *s, size_t len, mc_toks *out, still_err *err) {
    out->ids = NULL;
    out->n = 0;
    if (len == 0) return STILL_OK;
    return still_tokenize(m, s, len, 0, &out->ids, &out->n, err);
}

/* Parse, validate and tokenize one non-blank line into it. */
static int parse_line(const still_model *m, const char *path, int lineno, const char *line, size_t len,
                      int n_ctx, mc_item *it, still_err *err) {
    if (memchr(line, '\0', len))
        return still_fail(err, STILL_E_FORMAT, "%s:%d: NUL byte in line", path, lineno);
    if (!utf8_valid((const unsigned char *)line, len))
        return still_fail(err, STILL_E_FORMAT, "%s:%d: invalid UTF-8", path, lineno);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(line, len, &end, 0);
    if (!root) {
        size_t at = end && end >= line && end <= line + len ? (size_t)(end - line) : 0;
        return still_fail(err, STILL_E_FORMAT, "%s:%d: malformed JSON (at byte %zu)", path, lineno, at + 1);
    }
    int rc = STILL_OK;
    size_t used = (size_t)(end - line);
    while (used < len && is_ws(line[used])) used++;
    if (used != len) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: malformed JSON (trailing data at byte %zu)", path, lineno,
                        used + 1);
        goto done;
    }
    if (!cJSON_IsObject(root)) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: expected a JSON object", path, lineno);
        goto done;
    }
    const cJSON *jctx = cJSON_GetObjectItemCaseSensitive(root, "context");
    const cJSON *jch = cJSON_GetObjectItemCaseSensitive(root, "choices");
    const cJSON *jgold = cJSON_GetObjectItemCaseSensitive(root, "gold");
    if (!jctx || !jch || !jgold) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: missing field \"%s\"", path, lineno,
                        !jctx ? "context" : !jch ? "choices" : "gold");
        goto done;
    }
    if (!cJSON_IsString(jctx) || !jctx->valuestring) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: \"context\" must be a string", path, lineno);
        goto done;
    }
    if (!cJSON_IsArray(jch)) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: \"choices\" must be an array of strings", path, lineno);
        goto done;
    }
    int n_choices = cJSON_GetArraySize(jch);
    if (n_choices <= 0) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: \"choices\" is empty", path, lineno);
        goto done;
    }
    if (!cJSON_IsNumber(jgold) || jgold->valuedouble != floor(jgold->valuedouble) ||
        !(fabs(jgold->valuedouble) < 1e9)) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: \"gold\" must be an integer", path, lineno);
        goto done;
    }
    double g = jgold->valuedouble;
    if (g < 0 || g >= n_choices) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: \"gold\" %.0f out of range for %d choices", path, lineno, g,
                        n_choices);
        goto done;
    }
    it->line = lineno;
    it->gold = (int)g;

    /* lm-eval: trailing whitespace of the context belongs to the continuation. */
    const char *ctx = jctx->valuestring;
    size_t ctx_len = strlen(ctx), ctx_keep = ctx_len;
    while (ctx_keep > 0 && is_ws(ctx[ctx_keep - 1])) ctx_keep--;
    if (ctx_keep == 0) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: empty context not supported", path, lineno);
        goto done;
    }
    if (!utf8_valid((const unsigned char *)ctx, ctx_len)) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: invalid UTF-8 in \"context\"", path, lineno);
        goto done;
    }
    it->cont = calloc((size_t)n_choices, sizeof *it->cont);
    it->bytes = calloc((size_t)n_choices, sizeof *it->bytes);
    if (!it->cont || !it->bytes) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        goto done;
    }
    it->n_choices = n_choices;
    rc = tokenize(m, ctx, ctx_keep, &it->ctx, err);
    if (rc) goto done;
    if (it->ctx.n == 0) {
        rc = still_fail(err, STILL_E_FORMAT, "%s:%d: context has no tokens", path, lineno);
        goto done;
    }
    size_t moved = ctx_len - ctx_keep;
    int c = 0;
    const cJSON *jc;
    cJSON_ArrayForEach(jc, jch) {
        if (!cJSON_IsString(jc) || !jc->valuestring) {
            rc = still_fail(err, STILL_E_FORMAT, "%s:%d: choice %d is not a string", path, lineno, c);
            goto done;
        }
        size_t cl = strlen(jc->valuestring);
        if (cl == 0) {
            rc = still_fail(err, STILL_E_FORMAT, "%s:%d: choice %d is empty", path, lineno, c);
            goto done;
        }
        if (!utf8_valid((const unsigned char *)jc->valuestring, cl)) {
            rc = still_fail(err, STILL_E_FORMAT, "%s:%d: invalid UTF-8 in choice %d", path, lineno, c);
            goto done;
        }
        char *cont = malloc(moved + cl);
        if (!cont) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory");
            goto done;
        }
        memcpy(cont, ctx + ctx_keep, moved);
        memcpy(cont + moved, jc->valuestring, cl);
        rc = tokenize(m, cont, moved + cl, &it->cont[c], err);
        free(cont);
        if (rc) goto done;
        if (it->cont[c].n == 0) {
            rc = still_fail(err, STILL_E_FORMAT, "%s:%d: choice %d has no tokens", path, lineno, c);
            goto done;
        }
        if (it->cont[c].n > (size_t)n_ctx) {
            rc = still_fail(err, STILL_E_ARG, "%s:%d: choice %d is %zu tokens, more than the context size %d", path,
                            lineno, c, it->cont[c].n, n_ctx);
            goto done;
        }
        it->bytes[c] = cl;
        c++;
    }
done:
    cJSON_Delete(root);
    return rc;
}

static int read_items(const still_model *m, const char *path, int n_ctx, mc_set *set, still_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return still_fail(err, STILL_E_IO, "cannot open %s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    int lineno = 0, rc = STILL_OK, total_choices = 0;
    while ((got = getline(&line, &cap, f)) >= 0) {
        if (lineno == INT_MAX) {
            rc = still_fail(err, STILL_E_FORMAT, "%s: too many lines", path);
            break;
        }
        lineno++;
        size_t len = (size_t)got, k = 0;
        while (k < len && is_ws(line[k])) k++;
        if (k == len) continue;   /* blank line */
        if (set->n == set->cap) {
            int nc = set->cap ? set->cap * 2 : 64;
            mc_item *ni = nc > 0 ? realloc(set->items, (size_t)nc * sizeof *ni) : NULL;
            if (!ni) {
                rc = still_fail(err, STILL_E_NOMEM, "out of memory");
                break;
            }
            set->items = ni;
            set->cap = nc;
        }
        mc_item *it = &set->items[set->n];
        memset(it, 0, sizeof *it);
        rc = parse_line(m, path, lineno, line, len, n_ctx, it, err);
        if (rc) {
            item_free(it);
            break;
        }
        if (it->n_choices > INT_MAX - total_choices) {
            item_free(it);
            rc = still_fail(err, STILL_E_FORMAT, "%s:%d: too many choices in total", path, lineno);
            break;
        }
        total_choices += it->n_choices;
        set->n++;
    }
    if (!rc && ferror(f)) rc = still_fail(err, STILL_E_IO, "error reading %s: %s", path, strerror(errno));
    free(line);
    fclose(f);
    if (!rc && set->n == 0) rc = still_fail(err, STILL_E_FORMAT, "%s: no items", path);
    return rc;
}

/* Window of one request: the rightmost n_ctx + 1 tokens of ctx ++ cont. */
static void request_window(const mc_toks *ctx, const mc_toks *cont, int n_ctx, size_t *skip, size_t *w) {
    size_t L = ctx->n + cont->n;
    *w = L > (size_t)n_ctx + 1 ? (size_t)n_ctx + 1 : L;
    *skip = L - *w;
}

static int32_t seq_at(const mc_toks *ctx, const mc_toks *cont, size_t i) {
    return i < ctx->n ? ctx->ids[i] : cont->ids[i - ctx->n];
}

int eval_mc_run(still_model *m, const char *jsonl_path, int n_ctx, int matvec, eval_mc_result *res, still_err *err) {
    memset(res, 0, sizeof *res);
    if (!m || !jsonl_path) return still_fail(err, STILL_E_ARG, "eval_mc_run: no model or file");
    if (n_ctx < 1) return still_fail(err, STILL_E_ARG, "context size %d must be at least 1", n_ctx);
    mc_set set = {0};
    int rc = read_items(m, jsonl_path, n_ctx, &set, err);
    if (rc) {
        set_free(&set);
        return rc;
    }

    /* The model state only needs to hold the longest request fed. */
    size_t total = 0, max_fed = 1, max_cont = 1;
    for (int i = 0; i < set.n; i++) {
        const mc_item *it = &set.items[i];
        total += (size_t)it->n_choices;
        for (int c = 0; c < it->n_choices; c++) {
            size_t skip, w;
            request_window(&it->ctx, &it->cont[c], n_ctx, &skip, &w);
            if (w - 1 > max_fed) max_fed = w - 1;
            if (it->cont[c].n > max_cont) max_cont = it->cont[c].n;
        }
    }
    const int V = still_model_get_info(m).n_vocab;
    still_context *ctx = NULL;
    float *logits = NULL;
    int32_t *cache = NULL, *fed = NULL;
    size_t n_cache = 0, n_logits;
    if (still_mul_overflow(max_cont, (size_t)V, &n_logits) || still_mul_overflow(n_logits, sizeof(float), &n_logits)) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        goto out;
    }
    res->n_items = set.n;
    res->loglik = malloc(total * sizeof *res->loglik);
    res->item_first_choice = malloc(((size_t)set.n + 1) * sizeof *res->item_first_choice);
    logits = malloc(n_logits);
    cache = malloc(max_fed * sizeof *cache);
    fed = malloc(max_fed * sizeof *fed);
    if (!res->loglik || !res->item_first_choice || !logits || !cache || !fed) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        goto out;
    }
    still_context_params cp = {.n_ctx = (int)max_fed, .n_batch = 512, .matvec = matvec};
    rc = still_context_create(m, cp, &ctx, err);
    if (rc) goto out;

    size_t k = 0;
    int n_acc = 0, n_acc_norm = 0;
    for (int i = 0; i < set.n; i++) {
        const mc_item *it = &set.items[i];
        res->item_first_choice[i] = (int)k;
        int best = 0, best_norm = 0;
        double best_ll = 0, best_nll = 0;
        for (int c = 0; c < it->n_choices; c++) {
            const mc_toks *cont = &it->cont[c];
            size_t skip, w;
            request_window(&it->ctx, cont, n_ctx, &skip, &w);
            size_t n_fed = w - 1, s = n_fed - cont->n;   /* row s predicts the first choice token */
            for (size_t j = 0; j < n_fed; j++) fed[j] = seq_at(&it->ctx, cont, skip + j);
            /* Reuse the longest prefix of fed[0 .. s) already in the state. */
            size_t keep = 0;
            while (keep < n_cache && keep < s && cache[keep] == fed[keep]) keep++;
            if (keep != n_cache && still_context_truncate(ctx, (int)keep, NULL) != STILL_OK) {
                keep = 0;
                rc = still_context_truncate(ctx, 0, err);
                if (rc) goto out;
            }
            n_cache = keep;
            if (s > keep) {
                rc = still_decode(ctx, fed + keep, (int)(s - keep), NULL, 0, err);
                if (rc) goto fail_line;
            }
            rc = still_decode(ctx, fed + s, (int)(n_fed - s), logits, 1, err);
            if (rc) goto fail_line;
            memcpy(cache, fed, n_fed * sizeof *cache);
            n_cache = n_fed;

            double ll = 0;
            for (size_t r = 0; r < cont->n; r++) {
                const float *row = logits + r * (size_t)V;
                int32_t tok = cont->ids[r];
                if (tok < 0 || tok >= V) {
                    rc = still_fail(err, STILL_E_STATE, "%s:%d: token id %d out of the vocabulary", jsonl_path,
                                    it->line, (int)tok);
                    goto out;
                }
                double mx = row[0];
                for (int v = 1; v < V; v++)
                    if (row[v] > mx) mx = row[v];
                double sum = 0;
                for (int v = 0; v < V; v++) sum += exp((double)row[v] - mx);
                ll += (double)row[tok] - mx - log(sum);
            }
            res->loglik[k++] = ll;
            double nll = ll / (double)it->bytes[c];
            if (c == 0 || ll > best_ll) best_ll = ll, best = c;
            if (c == 0 || nll > best_nll) best_nll = nll, best_norm = c;
        }
        n_acc += best == it->gold;
        n_acc_norm += best_norm == it->gold;
        continue;
    fail_line:;
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err ? err->msg : "");
        still_fail(err, rc, "%s:%d: %s", jsonl_path, it->line, msg);
        goto out;
    }
    res->item_first_choice[set.n] = (int)k;
    res->acc = (double)n_acc / set.n;
    res->acc_norm = (double)n_acc_norm / set.n;

out:
    still_context_free(ctx);
    free(logits);
    free(cache);
    free(fed);
    set_free(&set);
    if (rc) eval_mc_result_free(res);
    return rc;
}

void eval_mc_result_free(eval_mc_result *r) {
    if (!r) return;
    free(r->loglik);
    free(r->item_first_choice);
    memset(r, 0, sizeof *r);
}
#endif /* STILL_NO_CJSON */
