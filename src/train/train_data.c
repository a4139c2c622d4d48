/* Training data: text streams and instruction examples (see train_data.h). */
#include "train/train_data.h"

#include "kinds/attn_common.h"
#include "common/common.h"
#include "text/tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef STILL_NO_CJSON
#include <cjson/cJSON.h>
#endif

uint64_t train_fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

static int read_text(const char *path, char **out, size_t *len, still_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return still_fail(err, STILL_E_IO, "cannot open training data '%s'", path);
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        char *nb = realloc(buf, (cap *= 2) + 1);
        if (!nb) free(buf);
        buf = nb;
    }
    const int bad = ferror(f);
    fclose(f);
    if (!buf) return still_fail(err, STILL_E_NOMEM, "out of memory reading '%s'", path);
    if (bad) {
        free(buf);
        return still_fail(err, STILL_E_IO, "cannot read training data '%s'", path);
    }
    buf[n] = 0;
    *out = buf, *len = n;
    return STILL_OK;
}

static void shuffle(int *a, int n, uint64_t seed) {
    uint64_t s = seed;
    for (int i = n - 1; i > 0; i--) {
        const int j = (int)(attn_rng_next(&s) % (uint64_t)(i + 1));
        const int t = a[i];
        a[i] = a[j], a[j] = t;
    }
}

void train_data_free(train_data *d) {
    free(d->tok), free(d->w), free(d->off), free(d->val), free(d->train), free(d->perm);
    memset(d, 0, sizeof *d);
}

/* A growable token buffer with weights. */
typedef struct {
    int32_t *tok;
    float *w;
    size_t n, cap;
} tokbuf;

static int tb_reserve(tokbuf *b, size_t extra, int with_w, still_err *err) {
    if (b->n + extra <= b->cap) return STILL_OK;
    size_t nc = (b->n + extra) * 2;
    int32_t *t = realloc(b->tok, nc * sizeof *t);
    if (!t) return still_fail(err, STILL_E_NOMEM, "out of memory for the training tokens");
    b->tok = t;
    if (with_w) {
        float *w = realloc(b->w, nc * sizeof *w);
        if (!w) return still_fail(err, STILL_E_NOMEM, "out of memory for the training tokens");
        b->w = w;
    }
    b->cap = nc;
    return STILL_OK;
}

/* Append the tokens of text (special-token text parsed when special) with
 * weight w for predicting each of them (the weight goes on the position before
 * each token: ex->w[i - 1] predicts token i). */
static int tb_add_text(tokbuf *b, const still_model *m, const char *text, size_t len, int special, float w,
                       still_err *err) {
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = still_tokenize(m, text, len, special, &ids, &n, err);
    if (!rc) rc = tb_reserve(b, n, 1, err);
    if (!rc)
        for (size_t i = 0; i < n; i++) {
            if (b->n > 0) b->w[b->n - 1] = w;
            b->tok[b->n] = ids[i], b->w[b->n] = 0;
            b->n++;
        }
    free(ids);
    return rc;
}

#ifndef STILL_NO_CJSON
static const char *json_string(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* One JSONL example into ex (tokens and weights). */
static int render_example(const still_model *m, const char *path, long line, const char *s, size_t len, tokbuf *ex,
                          still_err *err) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(s, len, &end, 0);
    while (root && end && end < s + len && (*end == ' ' || *end == '\t' || *end == '\r')) end++;
    if (root && end && end < s + len) {
        cJSON_Delete(root);
        return still_fail(err, STILL_E_FORMAT, "%s:%ld: text after the JSON object (one object a line)", path, line);
    }
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return still_fail(err, STILL_E_FORMAT, "%s:%ld: not a JSON object", path, line);
    }
    int rc = STILL_OK;
    /* the conversation as (role, content) pairs */
    enum { MAXM = 4096 };
    const char *roles[MAXM], *contents[MAXM];
    char *joined = NULL;
    int n = 0;
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (msgs) {
        if (!cJSON_IsArray(msgs)) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: \"messages\" must be an array", path, line);
        const cJSON *it;
        cJSON_ArrayForEach(it, msgs) {
            if (rc) break;
            const char *r = cJSON_IsObject(it) ? json_string(it, "role") : NULL;
            const char *c = cJSON_IsObject(it) ? json_string(it, "content") : NULL;
            if (!r || !c) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: message %d needs string \"role\" and \"content\"", path, line, n + 1);
            else if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant")) {
                char shown[33];
                size_t k = 0;
                for (; r[k] && k < 32; k++) shown[k] = r[k] >= 0x20 && r[k] < 0x7f ? r[k] : '?';
                shown[k] = 0;
                rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: unknown role '%s' (system, user, assistant)", path, line, shown);
            }
            else if (n >= MAXM) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: more than %d messages", path, line, MAXM);
            else roles[n] = r, contents[n] = c, n++;
        }
    } else {
        const char *ins = json_string(root, "instruction"), *inp = json_string(root, "input"), *out = json_string(root, "output");
        const cJSON *ji = cJSON_GetObjectItemCaseSensitive(root, "input");
        if (!ins || !out)
            rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: expected \"messages\" or string \"instruction\" and \"output\"", path, line);
        else if (ji && !cJSON_IsString(ji) && !cJSON_IsNull(ji))
            rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: \"input\" must be a string", path, line);
        else {
            const char *user = ins;
            if (inp && *inp) {
                size_t a = strlen(ins), b = strlen(inp);
                joined = malloc(a + b + 3);
                if (!joined) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
                else {
                    memcpy(joined, ins, a), memcpy(joined + a, "\n\n", 2), memcpy(joined + a + 2, inp, b + 1);
                    user = joined;
                }
            }
            roles[0] = "user", contents[0] = user, roles[1] = "assistant", contents[1] = out, n = 2;
        }
    }
    int n_answers = 0;
    for (int i = 0; !rc && i < n; i++) n_answers += !strcmp(roles[i], "assistant");
    if (!rc && !n_answers) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: no assistant answer to learn", path, line);
    /* ChatML, the template's markers parsed as special tokens, the contents as text */
    ex->n = 0;
    const char *sys = still_model_default_system(m);
    if (!rc && sys && strcmp(roles[0], "system")) {
        rc = tb_add_text(ex, m, "<|im_start|>system\n", 19, 1, 0, err);
        if (!rc) rc = tb_add_text(ex, m, sys, strlen(sys), 0, 0, err);
        if (!rc) rc = tb_add_text(ex, m, "<|im_end|>\n", 11, 1, 0, err);
    }
    for (int i = 0; !rc && i < n; i++) {
        const float w = !strcmp(roles[i], "assistant") ? 1.0f : 0.0f;
        char head[32];
        const int hl = snprintf(head, sizeof head, "<|im_start|>%s\n", roles[i]);
        rc = tb_add_text(ex, m, head, (size_t)hl, 1, 0, err);
        if (!rc) rc = tb_add_text(ex, m, contents[i], strlen(contents[i]), 0, w, err);
        if (!rc) rc = tb_add_text(ex, m, "<|im_end|>", 10, 1, w, err);
        if (!rc) rc = tb_add_text(ex, m, "\n", 1, 0, 0, err);
    }
    free(joined);
    cJSON_Delete(root);
    return rc;
}
#endif

/* Examples of one JSONL file appended to ex_all (one sequence each). */
static int load_jsonl(const still_model *m, const char *path, const char *text, size_t len, int seq, tokbuf *all,
                      size_t **offs, size_t *n_off, size_t *cap_off, int *n_examples, int *n_dropped, int *n_cut,
                      still_err *err) {
#ifdef STILL_NO_CJSON
    (void)m, (void)text, (void)len, (void)seq, (void)all, (void)offs, (void)n_off, (void)cap_off, (void)n_examples;
    (void)n_dropped, (void)n_cut;
    return still_fail(err, STILL_E_UNSUPPORTED, "'%s': instruction data needs cJSON, which this build lacks", path);
#else
    tokbuf ex = {0};
    int rc = STILL_OK;
    long line = 0;
    for (size_t i = 0; i < len && !rc;) {
        size_t j = i;
        while (j < len && text[j] != '\n') j++;
        line++;
        size_t k = i;
        while (k < j && (text[k] == ' ' || text[k] == '\t' || text[k] == '\r')) k++;
        if (k < j) {   /* blank lines are skipped */
            rc = render_example(m, path, line, text + i, j - i, &ex, err);
            size_t n = ex.n < (size_t)seq ? ex.n : (size_t)seq;
            int learn = 0;
            for (size_t t = 0; !rc && t + 1 < n; t++) learn |= ex.w[t] > 0;
            if (!rc && !learn) ++*n_dropped;
            else if (!rc && n < ex.n) ++*n_cut;
            if (!rc && learn) {   /* an example whose answer lies beyond seq teaches nothing: left out */
                rc = tb_reserve(all, n, 1, err);
                if (!rc && *n_off + 1 >= *cap_off) {
                    size_t nc = *cap_off * 2 + 16;
                    size_t *o = realloc(*offs, nc * sizeof *o);
                    if (!o) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
                    else *offs = o, *cap_off = nc;
                }
                if (!rc) {
                    memcpy(all->tok + all->n, ex.tok, n * sizeof(int32_t));
                    memcpy(all->w + all->n, ex.w, n * sizeof(float));
                    all->w[all->n + n - 1] = 0;   /* the last position predicts nothing */
                    all->n += n;
                    (*offs)[++*n_off] = all->n;
                    ++*n_examples;
                }
            }
        }
        i = j + 1;
    }
    free(ex.tok), free(ex.w);
    return rc;
#endif
}

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

int train_data_load(const still_model *m, const train_data_params *p, train_data *d, still_err *err) {
    memset(d, 0, sizeof *d);
    d->perm_epoch = -1;
    tokbuf text = {0}, ex = {0};
    size_t *offs = NULL, n_off = 0, cap_off = 0;
    int rc = STILL_OK, n_ex = 0;
    for (int f = 0; f < p->n_files && !rc; f++) {
        const char *path = p->files[f];
        char *buf = NULL;
        size_t len = 0;
        if ((rc = read_text(path, &buf, &len, err))) break;
        long long bad = still_utf8_invalid_at(buf, len);
        if (len == 0) rc = still_fail(err, STILL_E_ARG, "training data '%s' is empty", path);
        else if (bad >= 0)
            rc = still_fail(err, STILL_E_ARG, "training data '%s' is not valid UTF-8 (first bad byte at offset %lld)",
                            path, bad);
        else if (p->allow_jsonl && ends_with(path, ".json"))
            rc = still_fail(err, STILL_E_ARG, "'%s': a .json file is not read (instruction data is JSON Lines, one object a "
                                              "line, in a .jsonl file; plain text in any other)", path);
        else if (p->allow_jsonl && ends_with(path, ".jsonl")) {
            if (!offs && !(offs = calloc(cap_off = 64, sizeof *offs))) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
            const int before = n_ex;
            if (!rc) rc = load_jsonl(m, path, buf, len, p->seq, &ex, &offs, &n_off, &cap_off, &n_ex, &d->n_dropped,
                                     &d->n_cut, err);
            if (!rc && n_ex == before) rc = still_fail(err, STILL_E_ARG, "'%s' has no example with an answer within %d tokens", path, p->seq);
        } else {
            int32_t *ids = NULL;
            size_t n_ids = 0;
            rc = still_tokenize(m, buf, len, 0, &ids, &n_ids, err);
            if (!rc) rc = tb_reserve(&text, n_ids, 0, err);
            if (!rc) memcpy(text.tok + text.n, ids, n_ids * sizeof *ids), text.n += n_ids;
            free(ids);
        }
        free(buf);
    }
    const size_t n_text_seq = p->seq > 0 ? text.n / (size_t)p->seq : 0;
    if (!rc && n_text_seq + n_off == 0)
        rc = still_fail(err, STILL_E_ARG, "the training data has %zu tokens, too few for one sequence of %d", text.n, p->seq);
    if (!rc && n_text_seq + n_off >= (1u << 30)) rc = still_fail(err, STILL_E_ARG, "too many training sequences");
    if (rc) {
        free(text.tok), free(ex.tok), free(ex.w), free(offs);
        return rc;
    }
    d->n_seq = (int)(n_text_seq + n_off);
    d->seq = p->seq;
    d->n_tokens = (long long)text.n + (long long)ex.n;
    d->n_examples = n_ex;   /* n_dropped, n_cut counted while reading */
    const size_t n_tok = n_text_seq * (size_t)p->seq + ex.n;
    d->tok = malloc((n_tok ? n_tok : 1) * sizeof(int32_t));
    d->off = malloc(((size_t)d->n_seq + 1) * sizeof(size_t));
    if (n_off) d->w = malloc((n_tok ? n_tok : 1) * sizeof(float));
    if (!d->tok || !d->off || (n_off && !d->w)) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    if (!rc) {
        if (n_text_seq) memcpy(d->tok, text.tok, n_text_seq * (size_t)p->seq * sizeof(int32_t));
        if (ex.n) memcpy(d->tok + n_text_seq * (size_t)p->seq, ex.tok, ex.n * sizeof(int32_t));
        for (size_t i = 0; i <= n_text_seq; i++) d->off[i] = i * (size_t)p->seq;
        for (size_t i = 1; i <= n_off; i++) d->off[n_text_seq + i] = n_text_seq * (size_t)p->seq + offs[i];
        if (d->w) {
            for (size_t s = 0; s < n_text_seq; s++)
                for (size_t t = 0; t < (size_t)p->seq; t++) d->w[s * p->seq + t] = t + 1 < (size_t)p->seq ? 1.0f : 0.0f;
            memcpy(d->w + n_text_seq * (size_t)p->seq, ex.w, ex.n * sizeof(float));
        }
    }
    free(text.tok), free(ex.tok), free(ex.w), free(offs);
    if (rc) {
        train_data_free(d);
        return rc;
    }
    /* text-only data hashes as stage 1 always did (resumable checkpoints keep their fingerprints) */
    d->hash = train_fnv1a(0xcbf29ce484222325ULL, d->tok, n_tok * sizeof(int32_t));
    if (d->w) {
        d->hash = train_fnv1a(d->hash, d->w, n_tok * sizeof(float));
        d->hash = train_fnv1a(d->hash, d->off, ((size_t)d->n_seq + 1) * sizeof(size_t));
    }
    int *all = malloc(sizeof(int) * (size_t)d->n_seq);
    if (!all) {
        train_data_free(d);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    for (int i = 0; i < d->n_seq; i++) all[i] = i;
    shuffle(all, d->n_seq, p->seed ^ 0x7e57da7aULL);
    int nv = p->val_frac > 0 ? (int)ceil(p->val_frac * d->n_seq) : 0;
    if (nv > p->val_max) nv = p->val_max;
    if (nv >= d->n_seq) nv = d->n_seq - 1;   /* keep at least one training sequence */
    d->n_val = nv, d->n_train = d->n_seq - nv;
    d->val = malloc(sizeof(int) * (size_t)(nv ? nv : 1));
    d->train = malloc(sizeof(int) * (size_t)d->n_train);
    d->perm = malloc(sizeof(int) * (size_t)d->n_train);
    if (!d->val || !d->train || !d->perm) {
        free(all);
        train_data_free(d);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    memcpy(d->val, all, sizeof(int) * (size_t)nv);
    memcpy(d->train, all + nv, sizeof(int) * (size_t)d->n_train);
    free(all);
    return STILL_OK;
}

const int32_t *train_data_seq(const train_data *d, int i, const float **w, int *len) {
    if (w) *w = d->w ? d->w + d->off[i] : NULL;
    if (len) *len = (int)(d->off[i + 1] - d->off[i]);
    return d->tok + d->off[i];
}

int train_data_train_index(train_data *d, long long g) {
    const int epoch = (int)(g / d->n_train), i = (int)(g % d->n_train);
    if (epoch != d->perm_epoch) {
        memcpy(d->perm, d->train, sizeof(int) * (size_t)d->n_train);
        shuffle(d->perm, d->n_train, (0x5eedULL + (uint64_t)epoch * 0x9e3779b97f4a7c15ULL) ^ d->hash);
        d->perm_epoch = epoch;
    }
    return d->perm[i];
}
