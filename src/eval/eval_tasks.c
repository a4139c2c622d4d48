/* Long-context task prompts for `still eval` (after RULER and BABILong):
 * needle tasks, variable tracking, pass-key retrieval and bAbI stories in
 * long prose, each fitted to a target length in tokens of the rendered chat
 * prompt. Deterministic in the seed.
 *
 * Fitting: the haystack is a run of words taken from a random offset of the
 * haystack text (noise: the repeated five sentences). The items (needles,
 * assignments, facts) go in at sentence boundaries, at their drawn depths,
 * and the number of haystack words is the largest whose whole prompt
 * (template, instruction, context, question, answer prefix) still fits the
 * target, found by a search on the token count (interpolating between the
 * nearest counts, every third step halving). */
#include "eval/eval.h"
#include "kinds/attn_common.h"
#include "common/common.h"

#ifndef STILL_NO_CJSON
#include <cjson/cJSON.h>
#endif
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";

static const char *const WORDS[] = {
    "apple",   "harbor",  "lantern", "meadow",  "pebble",  "quartz",  "saddle",  "thimble", "violin",  "walnut",
    "anchor",  "blossom", "candle",  "dolphin", "ember",   "falcon",  "glacier", "hammock", "island",  "jasmine",
    "kettle",  "lemon",   "marble",  "nectar",  "orchard", "parrot",  "quiver",  "ribbon",  "sparrow", "tulip",
    "umbrella", "velvet", "willow",  "yonder",  "zephyr",  "basket",  "copper",  "dragon",  "engine",  "feather",
    "garden",  "helmet",  "igloo",   "jacket",  "kingdom", "ladder",  "mirror",  "needle",  "oyster",  "pepper",
    "rocket",  "silver",  "timber",  "unicorn", "vessel",  "wagon",   "beacon",  "cactus",  "dune",    "fountain",
};
#define N_WORDS (int)(sizeof WORDS / sizeof WORDS[0])

const char *const EVAL_TASKS[] = {"niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                                  "niah_multivalue", "niah_multiquery", "vt", "passkey",
                                  "qa1", "qa2", "qa3", "qa4", "qa5"};
const int EVAL_N_TASKS = (int)(sizeof EVAL_TASKS / sizeof EVAL_TASKS[0]);

void eval_prompt_free(eval_prompt *p) {
    if (!p) return;
    free(p->user), free(p->answer_prefix);
    for (int i = 0; i < p->n_refs; i++) free(p->refs[i]);
    free(p->refs);
    free(p->item_pos);
    memset(p, 0, sizeof *p);
}

/* ---- small helpers ---------------------------------------------------------------- */

static char *xstrdup_printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *s = malloc((size_t)n + 1);
    if (!s) return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return s;
}

typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = (b->n + n + 1) * 2;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np, b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

static uint64_t rng_u(uint64_t *s, uint64_t n) { return n ? attn_rng_next(s) % n : 0; }

/* ---- the haystack ------------------------------------------------------------------ */

/* Word starts of a text (indices of the first byte of each whitespace-separated word). */
typedef struct {
    const char *text;
    size_t len;
    size_t *start;
    size_t n;
} words;

static int words_index(const char *text, size_t len, words *w, still_err *err) {
    w->text = text, w->len = len, w->n = 0;
    size_t cap = len / 4 + 16;
    w->start = malloc(cap * sizeof(size_t));
    if (!w->start) return still_fail(err, STILL_E_NOMEM, "out of memory");
    for (size_t i = 0; i < len; i++)
        if (!isspace((unsigned char)text[i]) && (i == 0 || isspace((unsigned char)text[i - 1]))) {
            if (w->n == cap) {
                size_t *ns = realloc(w->start, (cap *= 2) * sizeof(size_t));
                if (!ns) return still_fail(err, STILL_E_NOMEM, "out of memory");
                w->start = ns;
            }
            w->start[w->n++] = i;
        }
    if (w->n == 0) return still_fail(err, STILL_E_ARG, "the haystack text has no words");
    return STILL_OK;
}

/* n words from word index w0, wrapping around; whitespace collapsed to one
 * space, except that paragraph breaks stay "\n". */
static void words_take(const words *w, size_t w0, size_t n, sbuf *out) {
    for (size_t k = 0; k < n; k++) {
        const size_t i = (w0 + k) % w->n;
        const size_t a = w->start[i];
        size_t b = a;
        while (b < w->len && !isspace((unsigned char)w->text[b])) b++;
        if (k) {
            /* the separator before this word in the original */
            int para = 0;
            if (i > 0)
                for (size_t j = w->start[i - 1]; j < a; j++) para += w->text[j] == '\n';
            sb_str(out, para >= 2 ? "\n" : " ");
        }
        sb_add(out, w->text + a, b - a);
    }
}

/* The sentence boundary of s nearest to depth · len: an offset just after
 * ". ", "? ", "! ", ".\n" (or 0). */
static size_t nearest_boundary(const char *s, size_t len, double depth) {
    const size_t want = (size_t)(depth * (double)len);
    size_t best = 0, bd = want;
    for (size_t i = 1; i + 1 < len; i++) {
        if ((s[i - 1] == '.' || s[i - 1] == '?' || s[i - 1] == '!' || s[i - 1] == '"') &&
            (s[i] == ' ' || s[i] == '\n')) {
            const size_t pos = i + 1, d = pos > want ? pos - want : want - pos;
            if (d < bd) best = pos, bd = d;
        }
    }
    return best;   /* never the cut end: the haystack may stop mid-sentence */
}

/* ---- one task's pieces ---------------------------------------------------------------- */

typedef struct {
    char *instruction;   /* before the context */
    char *question;      /* after the context */
    char *answer_prefix;
    char **items;        /* inserted sentences, in order of depth */
    double *depth;
    int n_items;
    char **refs;
    int n_refs;
    int noise;           /* noise haystack (else the essay) */
    int fixed;           /* user task with its own context: used whole, no random start, no fitting */
    const char *own_hay; /* user task: its own haystack or context text (else the command's haystack) */
    int any_ref;         /* user task: a sample scores 1 when the output holds any of the refs */
    int babi;            /* context in <context> tags, first-sentence scoring */
    int max_new;
} task_parts;

static void parts_free(task_parts *t) {
    free(t->instruction), free(t->question), free(t->answer_prefix);
    for (int i = 0; i < t->n_items; i++) free(t->items[i]);
    for (int i = 0; i < t->n_refs; i++) free(t->refs[i]);
    free(t->items), free(t->depth), free(t->refs);
    memset(t, 0, sizeof *t);
}

static int parts_alloc(task_parts *t, int n_items, int n_refs) {
    t->items = calloc((size_t)(n_items ? n_items : 1), sizeof(char *));
    t->depth = calloc((size_t)(n_items ? n_items : 1), sizeof(double));
    t->refs = calloc((size_t)(n_refs ? n_refs : 1), sizeof(char *));
    t->n_items = n_items, t->n_refs = n_refs;
    return t->items && t->depth && t->refs ? 0 : -1;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void number7(uint64_t *s, char *out) { snprintf(out, 16, "%07llu", (unsigned long long)(1000000 + rng_u(s, 9000000))); }

static void uuid(uint64_t *s, char *out) {
    static const char *hex = "0123456789abcdef";
    int k = 0;
    for (int i = 0; i < 32; i++) {
        if (i == 8 || i == 12 || i == 16 || i == 20) out[k++] = '-';
        out[k++] = hex[rng_u(s, 16)];
    }
    out[k] = 0;
}

/* Distinct random words. */
static void pick_words(uint64_t *s, int n, int *out) {
    for (int i = 0; i < n; i++) {
        int w, dup;
        do {
            w = (int)rng_u(s, N_WORDS);
            dup = 0;
            for (int j = 0; j < i; j++) dup |= out[j] == w;
        } while (dup);
        out[i] = w;
    }
}

static int build_task(const char *task, uint64_t seed, task_parts *t, still_err *err) {
    memset(t, 0, sizeof *t);
    uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 0x5eed;
    for (const char *c = task; *c; c++) s = (s ^ (unsigned char)*c) * 0x100000001b3ULL;
    char val[64];
    const char *niah_instr = "Some special magic %s are hidden within the following text. Make sure to memorize "
                             "them. I will quiz you about the %s afterwards.";
    int oom = 0;
    t->max_new = 48;
    if (!strncmp(task, "niah_", 5)) {
        const int uuid_v = !strcmp(task, "niah_single_3");
        const char *kind = uuid_v ? "uuids" : "numbers";
        int n_keys = 1, n_vals = 1, n_query = 1;
        if (!strcmp(task, "niah_multikey_1")) n_keys = 4;
        else if (!strcmp(task, "niah_multivalue")) n_vals = 4;
        else if (!strcmp(task, "niah_multiquery")) n_keys = 4, n_query = 4;
        else if (strcmp(task, "niah_single_1") && strcmp(task, "niah_single_2") && !uuid_v)
            return still_fail(err, STILL_E_ARG, "unknown task '%s'", task);
        t->noise = !strcmp(task, "niah_single_1");
        int keys[8];
        pick_words(&s, n_keys, keys);
        if (parts_alloc(t, n_keys * n_vals, n_query * n_vals)) return still_fail(err, STILL_E_NOMEM, "out of memory");
        for (int i = 0; i < t->n_items; i++) t->depth[i] = attn_rng_uniform(&s);
        qsort(t->depth, (size_t)t->n_items, sizeof(double), cmp_double);
        /* needles in random order over the depths */
        int order[32];
        for (int i = 0; i < t->n_items; i++) order[i] = i;
        for (int i = t->n_items - 1; i > 0; i--) {
            int j = (int)rng_u(&s, (uint64_t)i + 1), x = order[i];
            order[i] = order[j], order[j] = x;
        }
        for (int k = 0; k < n_keys; k++)
            for (int v = 0; v < n_vals; v++) {
                if (uuid_v) uuid(&s, val);
                else number7(&s, val);
                const int slot = order[k * n_vals + v];
                t->items[slot] = xstrdup_printf("One of the special magic %s for %s is: %s.", kind, WORDS[keys[k]], val);
                oom |= !t->items[slot];
                if (k < n_query) oom |= !(t->refs[k * n_vals + v] = strdup(val));
            }
        char qk[256] = "";
        for (int k = 0; k < n_query; k++)
            snprintf(qk + strlen(qk), sizeof qk - strlen(qk), "%s%s", k ? (k == n_query - 1 ? " and " : ", ") : "",
                     WORDS[keys[k]]);
        t->instruction = xstrdup_printf(niah_instr, kind, kind);
        if (n_vals > 1 || n_query > 1) {
            t->question = xstrdup_printf("What are all the special magic %s for %s mentioned in the provided text?",
                                         kind, qk);
            t->answer_prefix = xstrdup_printf("The special magic %s for %s mentioned in the provided text are", kind, qk);
            t->max_new = 96;
        } else {
            t->question = xstrdup_printf("What is the special magic %.*s for %s mentioned in the provided text?",
                                         (int)strlen(kind) - 1, kind, qk);
            t->answer_prefix = xstrdup_printf("The special magic %.*s for %s mentioned in the provided text is",
                                              (int)strlen(kind) - 1, kind, qk);
        }
    } else if (!strcmp(task, "vt")) {
        const int hops = 4;
        char var[8][8];
        int used[8];
        for (int i = 0; i <= hops; i++) {
            int dup;
            do {
                for (int c = 0; c < 5; c++) var[i][c] = (char)('A' + rng_u(&s, 26));
                var[i][5] = 0;
                dup = 0;
                for (int j = 0; j < i; j++) dup |= !strcmp(var[i], var[j]);
            } while (dup);
            used[i] = 1;
        }
        (void)used;
        number7(&s, val);
        t->noise = 1;
        if (parts_alloc(t, hops + 1, hops + 1)) return still_fail(err, STILL_E_NOMEM, "out of memory");
        for (int i = 0; i <= hops; i++) t->depth[i] = attn_rng_uniform(&s);
        qsort(t->depth, (size_t)t->n_items, sizeof(double), cmp_double);
        for (int i = 0; i <= hops; i++) {
            t->items[i] = i == 0 ? xstrdup_printf("VAR %s = %s.", var[0], val) : xstrdup_printf("VAR %s = VAR %s.", var[i], var[i - 1]);
            oom |= !t->items[i] || !(t->refs[i] = strdup(var[i]));
        }
        t->instruction = strdup("Memorize and track the chain(s) of variable assignment hidden in the following text.");
        t->question = xstrdup_printf("Question: Find all variables that are assigned the value %s in the text above.", val);
        t->answer_prefix = xstrdup_printf(
            "Answer: According to the chain(s) of variable assignment in the text above, %d variables are assigned the "
            "value %s, they are:",
            hops + 1, val);
        t->max_new = 48;
    } else if (!strcmp(task, "passkey")) {
        snprintf(val, sizeof val, "%05llu", (unsigned long long)(10000 + rng_u(&s, 90000)));
        t->noise = 1;
        if (parts_alloc(t, 1, 1)) return still_fail(err, STILL_E_NOMEM, "out of memory");
        t->depth[0] = attn_rng_uniform(&s);
        t->items[0] = xstrdup_printf("The pass key is %s. Remember it. %s is the pass key.", val, val);
        oom |= !t->items[0] || !(t->refs[0] = strdup(val));
        t->instruction = strdup("There is an important info hidden inside a lot of irrelevant text. Find it and "
                                "memorize it. I will quiz you about the important information there.");
        t->question = strdup("What is the pass key?");
        t->answer_prefix = strdup("The pass key is");
        t->max_new = 16;
    } else if (task[0] == 'q' && task[1] == 'a' && task[2] >= '1' && task[2] <= '5' && !task[3]) {
        babi_story st = {0};
        int rc = babi_generate(task[2] - '0', seed, 10, &st, err);
        if (rc) return rc;
        if (parts_alloc(t, st.n_facts, 1)) {
            babi_story_free(&st);
            return still_fail(err, STILL_E_NOMEM, "out of memory");
        }
        for (int i = 0; i < st.n_facts; i++) t->depth[i] = attn_rng_uniform(&s);
        qsort(t->depth, (size_t)t->n_items, sizeof(double), cmp_double);
        for (int i = 0; i < st.n_facts; i++) oom |= !(t->items[i] = strdup(st.facts[i]));
        oom |= !(t->refs[0] = strdup(st.answer));
        t->babi = 1;
        t->instruction = strdup("I will give you context with the facts about positions of objects and people hidden "
                                "in some random text and a question. You need to answer the question based only on "
                                "the information from the facts. Answer with one word.");
        t->question = xstrdup_printf("Question: %s", st.question);
        t->answer_prefix = strdup("Answer:");
        t->max_new = 16;
        babi_story_free(&st);
    } else {
        return still_fail(err, STILL_E_ARG, "unknown task '%s'", task);
    }
    if (oom || !t->instruction || !t->question || !t->answer_prefix) {
        parts_free(t);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    return STILL_OK;
}

/* The user message for n haystack words; item_pos (may be NULL) gets each
 * item's byte offset within the context, *ctx_off and *ctx_len the context's. */
static int render_user(const task_parts *t, const words *hay, size_t w0, size_t n_words, sbuf *out, size_t *item_pos,
                       size_t *ctx_off, size_t *ctx_len) {
    sbuf h = {0};
    words_take(hay, w0, n_words, &h);
    const char *hs = h.p ? h.p : "";
    size_t hlen = h.n;
    out->n = 0;
    sb_str(out, t->instruction);
    sb_str(out, t->babi ? "\n\n<context>\n" : "\n\n");
    *ctx_off = out->n;
    size_t at = 0;
    for (int i = 0; i < t->n_items; i++) {
        size_t b = nearest_boundary(hs, hlen, t->depth[i]);
        if (b < at) b = at;
        sb_add(out, hs + at, b - at);
        if (out->n > *ctx_off && out->p[out->n - 1] != ' ' && out->p[out->n - 1] != '\n') sb_str(out, " ");
        if (item_pos) item_pos[i] = out->n - *ctx_off;
        sb_str(out, t->items[i]);
        sb_str(out, " ");
        at = b;
        while (at < hlen && hs[at] == ' ') at++;
    }
    sb_add(out, hs + at, hlen - at);
    *ctx_len = out->n - *ctx_off;
    sb_str(out, t->babi ? "\n</context>\n\n" : "\n\n");
    sb_str(out, t->question);
    free(h.p);
    return out->oom || h.oom ? -1 : 0;
}

/* Fit task t (its parts; freed here) to target_tokens and fill out. */
static int fit_prompt(task_parts *tp, const char *task, uint64_t seed, int target_tokens, const char *haystack,
                      size_t haystack_len, eval_count_fn count, void *count_data, eval_prompt *out, still_err *err) {
    task_parts t = *tp;
    int rc = STILL_OK;
    if (t.own_hay) haystack = t.own_hay, haystack_len = strlen(t.own_hay);
    if (t.fixed) target_tokens = 0;
    words hay = {0};
    if (t.noise) rc = words_index(NOISE, strlen(NOISE), &hay, err);
    else if (!haystack || !haystack_len)
        rc = still_fail(err, STILL_E_ARG, "task '%s' needs a haystack text (--haystack FILE)", task);
    else rc = words_index(haystack, haystack_len, &hay, err);
    sbuf u = {0};
    size_t coff = 0, clen = 0;
    uint64_t s = seed ^ 0xfeedULL;
    /* essay: start at a random word after a paragraph break */
    size_t w0 = 0;
    if (!rc && !t.noise && !t.fixed) {
        w0 = (size_t)rng_u(&s, hay.n);
        for (size_t k = 0; k < hay.n; k++) {
            const size_t i = (w0 + k) % hay.n;
            if (i > 0 && memchr(hay.text + hay.start[i - 1], '\n', hay.start[i] - hay.start[i - 1])) {
                w0 = i;
                break;
            }
        }
    }
    /* bisection on the number of haystack words (a fixed context: all of them) */
    size_t lo = t.fixed ? hay.n : 0, hi = 1;
    int n_tok = 0;
    if (!rc) {
        if (render_user(&t, &hay, w0, 0, &u, NULL, &coff, &clen)) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        else if ((n_tok = count(count_data, u.p, t.answer_prefix)) < 0) rc = still_fail(err, STILL_E_ARG, "tokenizing failed");
        else if (n_tok > target_tokens && target_tokens > 0)
            rc = still_fail(err, STILL_E_ARG, "task '%s' needs %d tokens without any haystack, more than the target %d",
                            task, n_tok, target_tokens);
    }
    if (!rc && target_tokens > 0) {
        /* The largest number of words whose prompt fits: the token count grows with the words, so there is
         * one boundary, lo (fits) next to hi (does not). Each count tokenizes the whole prompt, so the next
         * guess interpolates between the two nearest counts (a few counts instead of a doubling and a
         * bisection's ~25 at 8K); the same boundary, so the same prompt, as any search finds. */
        long c_lo = n_tok, c_hi = -1;   /* c_hi < 0: no overshoot seen yet */
        hi = 0;
        for (int it = 0; !rc && (c_hi < 0 || hi - lo > 1); it++) {
            size_t guess;
            if (c_hi < 0) {   /* extrapolate from 0 words and lo at the measured tokens per word (1 at first) */
                const double per_word = lo > 0 && c_lo > n_tok ? (double)(c_lo - n_tok) / (double)lo : 1.0;
                const double more = (double)(target_tokens - c_lo) / per_word;
                guess = lo + (size_t)(more < 1 ? 1 : more + 1);
                if (guess > (size_t)target_tokens * 4 + 1) guess = (size_t)target_tokens * 4 + 1;
            } else {   /* interpolate for target + 1/2 inside (lo, hi), or halve every third try */
                const double f = ((double)target_tokens + 0.5 - (double)c_lo) / (double)(c_hi - c_lo);
                guess = it % 3 == 2 ? lo + (hi - lo) / 2 : lo + (size_t)(f * (double)(hi - lo) + 0.5);
                if (guess <= lo) guess = lo + 1;
                if (guess >= hi) guess = hi - 1;
            }
            if (render_user(&t, &hay, w0, guess, &u, NULL, &coff, &clen)) {
                rc = still_fail(err, STILL_E_NOMEM, "out of memory");
                break;
            }
            const long c = count(count_data, u.p, t.answer_prefix);
            if (c < 0) rc = still_fail(err, STILL_E_ARG, "tokenizing failed");
            else if (c <= target_tokens && guess > (size_t)target_tokens * 4) lo = guess, hi = guess + 1, c_hi = c;
            else if (c <= target_tokens) lo = guess, c_lo = c;
            else hi = guess, c_hi = c;
        }
    }
    if (!rc) {
        out->item_pos = calloc((size_t)(t.n_items ? t.n_items : 1), sizeof(size_t));
        if (!out->item_pos || render_user(&t, &hay, w0, lo, &u, out->item_pos, &coff, &clen))
            rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    if (!rc) {
        out->n_tokens = count(count_data, u.p, t.answer_prefix);
        out->user = u.p, u.p = NULL;
        out->answer_prefix = t.answer_prefix, t.answer_prefix = NULL;
        out->refs = t.refs, out->n_refs = t.n_refs, t.refs = NULL, t.n_refs = 0;
        out->n_items = t.n_items;
        out->context_off = coff, out->context_len = clen;
        out->first_sentence = t.babi;
        out->any_ref = t.any_ref;
        out->max_new = t.max_new;
        out->depth = t.n_items ? t.depth[0] : -1;
    }
    free(u.p);
    free(hay.start);
    parts_free(&t);
    if (rc) eval_prompt_free(out);
    return rc;
}

int eval_make_prompt(const char *task, uint64_t seed, int target_tokens, const char *haystack, size_t haystack_len,
                     eval_count_fn count, void *count_data, eval_prompt *out, still_err *err) {
    memset(out, 0, sizeof *out);
    task_parts t;
    int rc = build_task(task, seed, &t, err);
    if (rc) return rc;
    return fit_prompt(&t, task, seed, target_tokens, haystack, haystack_len, count, count_data, out, err);
}

/* ---- scoring ------------------------------------------------------------------------ */

static int is_word_byte(unsigned char c) { return c < 0x80 && isalnum(c); }

/* needle in hay[0..n) ignoring ASCII case, as a whole word at its edges: where the needle starts (ends) with an ASCII
 * letter or digit, the byte before (after) the match must not be one (" 46098322." does not hold 4609832, "yes"
 * is not in "yesterday"; "4609832." and "(4609832)" hold it). */
static int contains_ci(const char *hay, size_t n, const char *needle) {
    const size_t m = strlen(needle);
    if (!m) return 1;
    const int word_start = is_word_byte((unsigned char)needle[0]), word_end = is_word_byte((unsigned char)needle[m - 1]);
    for (size_t i = 0; i + m <= n; i++) {
        size_t k = 0;
        while (k < m && tolower((unsigned char)hay[i + k]) == tolower((unsigned char)needle[k])) k++;
        if (k < m) continue;
        if (word_start && i > 0 && is_word_byte((unsigned char)hay[i - 1])) continue;
        if (word_end && i + m < n && is_word_byte((unsigned char)hay[i + m])) continue;
        return 1;
    }
    return 0;
}

double eval_score(const eval_prompt *p, const char *output) {
    if (!p->n_refs) return 0;
    size_t n = strlen(output);
    if (p->first_sentence) {   /* BABILong: the answer must be in the first sentence */
        const char *o = output;
        while (*o == ' ' || *o == '\n') o++;
        n = strcspn(o, ".!?\n");
        output = o;
    }
    int found = 0;
    for (int i = 0; i < p->n_refs; i++) found += contains_ci(output, n, p->refs[i]);
    if (p->any_ref) return found > 0;
    return (double)found / p->n_refs;
}

/* ---- user tasks --------------------------------------------------------------------- */

static void item_free(eval_item *it) {
    free(it->task), free(it->instruction), free(it->context), free(it->haystack), free(it->question);
    free(it->answer_prefix), free(it->depth);
    for (int i = 0; i < it->n_needles; i++) free(it->needles[i]);
    for (int i = 0; i < it->n_answers; i++) free(it->answers[i]);
    free(it->needles), free(it->answers);
    memset(it, 0, sizeof *it);
}

void eval_items_free(eval_item_set *s) {
    for (int i = 0; i < s->n_items; i++) item_free(&s->items[i]);
    free(s->items);
    memset(s, 0, sizeof *s);
}

int eval_make_prompt_item(const eval_item *it, uint64_t seed, int target_tokens, const char *haystack,
                          size_t haystack_len, eval_count_fn count, void *count_data, eval_prompt *out,
                          still_err *err) {
    memset(out, 0, sizeof *out);
    task_parts t;
    memset(&t, 0, sizeof t);
    if (parts_alloc(&t, it->n_needles, it->n_answers)) return still_fail(err, STILL_E_NOMEM, "out of memory");
    uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 0x75e7;
    for (const char *c = it->question; *c; c++) s = (s ^ (unsigned char)*c) * 0x100000001b3ULL;
    int oom = 0;
    for (int i = 0; i < it->n_needles; i++) {
        t.depth[i] = it->depth ? it->depth[i] : attn_rng_uniform(&s);
        oom |= !(t.items[i] = strdup(it->needles[i]));
    }
    /* needles in the given order, at the depths in increasing order */
    qsort(t.depth, (size_t)t.n_items, sizeof(double), cmp_double);
    for (int i = 0; i < it->n_answers; i++) oom |= !(t.refs[i] = strdup(it->answers[i]));
    t.instruction = strdup(it->instruction ? it->instruction : "");
    t.question = strdup(it->question);
    t.answer_prefix = strdup(it->answer_prefix ? it->answer_prefix : "");
    t.fixed = it->context != NULL;
    t.own_hay = it->context ? it->context : it->haystack;
    t.any_ref = !it->all_answers;
    t.max_new = it->max_new > 0 ? it->max_new : 48;
    if (oom || !t.instruction || !t.question || !t.answer_prefix) {
        parts_free(&t);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    return fit_prompt(&t, it->task, seed, target_tokens, haystack, haystack_len, count, count_data, out, err);
}

#ifdef STILL_NO_CJSON
int eval_items_load(const char *path, eval_item_set *out, still_err *err) {
    memset(out, 0, sizeof *out);
    return still_fail(err, STILL_E_UNSUPPORTED, "'%s': task files need cJSON, which this build lacks", path);
}
#else
/* A string field (NULL when absent); a present non-string is an error. */
static int j_str(const cJSON *o, const char *key, char **dst, const char *path, long line, still_err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v) return STILL_OK;
    if (!cJSON_IsString(v)) return still_fail(err, STILL_E_FORMAT, "%s:%ld: \"%s\" must be a string", path, line, key);
    if (!(*dst = strdup(v->valuestring))) return still_fail(err, STILL_E_NOMEM, "out of memory");
    return STILL_OK;
}

/* A string or an array of strings (non-empty each). */
static int j_strs(const cJSON *v, const char *key, char ***dst, int *n, const char *path, long line, still_err *err) {
    if (cJSON_IsString(v)) {
        *dst = calloc(1, sizeof(char *));
        if (!*dst || !(**dst = strdup(v->valuestring))) return still_fail(err, STILL_E_NOMEM, "out of memory");
        *n = 1;
    } else if (cJSON_IsArray(v) && cJSON_GetArraySize(v) > 0) {
        const int k = cJSON_GetArraySize(v);
        if (!(*dst = calloc((size_t)k, sizeof(char *)))) return still_fail(err, STILL_E_NOMEM, "out of memory");
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (!cJSON_IsString(e)) return still_fail(err, STILL_E_FORMAT, "%s:%ld: \"%s\" must hold strings", path, line, key);
            if (!((*dst)[(*n)++] = strdup(e->valuestring))) return still_fail(err, STILL_E_NOMEM, "out of memory");
        }
    } else
        return still_fail(err, STILL_E_FORMAT, "%s:%ld: \"%s\" must be a string or a non-empty array of strings", path,
                          line, key);
    for (int i = 0; i < *n; i++)
        if (!(*dst)[i][0]) return still_fail(err, STILL_E_FORMAT, "%s:%ld: \"%s\" holds an empty string", path, line, key);
    return STILL_OK;
}

static int parse_item(const char *path, const char *base, long line, const char *s, size_t len, eval_item *it,
                      still_err *err) {
    memset(it, 0, sizeof *it);
    cJSON *o = cJSON_ParseWithLengthOpts(s, len, NULL, 0);
    if (!o || !cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return still_fail(err, STILL_E_FORMAT, "%s:%ld: not a JSON object", path, line);
    }
    static const char *const keys[] = {"task", "instruction", "context", "haystack", "needle", "needles", "depth",
                                       "question", "answers", "answer_prefix", "all_answers", "max_new"};
    int rc = STILL_OK;
    const cJSON *e;
    cJSON_ArrayForEach(e, o) {
        int known = 0;
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) known |= e->string && !strcmp(e->string, keys[i]);
        if (!known) {
            rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: unknown key \"%.40s\"", path, line, e->string ? e->string : "");
            break;
        }
    }
    if (!rc) rc = j_str(o, "task", &it->task, path, line, err);
    if (!rc) rc = j_str(o, "instruction", &it->instruction, path, line, err);
    if (!rc) rc = j_str(o, "context", &it->context, path, line, err);
    if (!rc) rc = j_str(o, "haystack", &it->haystack, path, line, err);
    if (!rc) rc = j_str(o, "question", &it->question, path, line, err);
    if (!rc) rc = j_str(o, "answer_prefix", &it->answer_prefix, path, line, err);
    if (!rc && !it->task && !(it->task = strdup(base))) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    if (!rc && (!it->question || !it->question[0]))
        rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: a non-empty \"question\" is required", path, line);
    if (!rc && it->context && it->haystack)
        rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: give \"context\" or \"haystack\", not both", path, line);
    const cJSON *ans = cJSON_GetObjectItemCaseSensitive(o, "answers");
    if (!rc && !ans) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: \"answers\" is required", path, line);
    if (!rc) rc = j_strs(ans, "answers", &it->answers, &it->n_answers, path, line, err);
    const cJSON *nd = cJSON_GetObjectItemCaseSensitive(o, "needle"), *nds = cJSON_GetObjectItemCaseSensitive(o, "needles");
    if (!rc && nd && nds) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: give \"needle\" or \"needles\", not both", path, line);
    if (!rc && (nd || nds)) rc = j_strs(nd ? nd : nds, nd ? "needle" : "needles", &it->needles, &it->n_needles, path, line, err);
    if (!rc && it->n_needles > 64) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: at most 64 needles", path, line);
    const cJSON *dp = cJSON_GetObjectItemCaseSensitive(o, "depth");
    if (!rc && dp) {
        const int nd_ = cJSON_IsArray(dp) ? cJSON_GetArraySize(dp) : 1;
        if (!it->n_needles) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: \"depth\" without a needle", path, line);
        else if (nd_ != it->n_needles || (!cJSON_IsArray(dp) && !cJSON_IsNumber(dp)))
            rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: \"depth\" must be a number or one number per needle", path, line);
        else if (!(it->depth = calloc((size_t)nd_, sizeof(double)))) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        for (int i = 0; !rc && i < nd_; i++) {
            const cJSON *x = cJSON_IsArray(dp) ? cJSON_GetArrayItem(dp, i) : dp;
            if (!cJSON_IsNumber(x) || !(x->valuedouble >= 0 && x->valuedouble <= 1))
                rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: depths must be numbers in [0, 1]", path, line);
            else it->depth[i] = x->valuedouble;
        }
    }
    const cJSON *aa = cJSON_GetObjectItemCaseSensitive(o, "all_answers"), *mn = cJSON_GetObjectItemCaseSensitive(o, "max_new");
    if (!rc && aa && !cJSON_IsBool(aa)) rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: \"all_answers\" must be true or false", path, line);
    if (!rc && aa) it->all_answers = cJSON_IsTrue(aa);
    if (!rc && mn && (!cJSON_IsNumber(mn) || mn->valuedouble != floor(mn->valuedouble) || mn->valuedouble < 1 ||
                      mn->valuedouble > 4096))
        rc = still_fail(err, STILL_E_FORMAT, "%s:%ld: \"max_new\" must be an integer in 1..4096", path, line);
    if (!rc && mn) it->max_new = (int)mn->valuedouble;
    cJSON_Delete(o);
    if (rc) item_free(it);
    return rc;
}

int eval_items_load(const char *path, eval_item_set *out, still_err *err) {
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f) return still_fail(err, STILL_E_IO, "cannot open the task file '%s'", path);
    sbuf b = {0};
    char chunk[65536];
    size_t k;
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0) sb_add(&b, chunk, k);
    const int bad = ferror(f);
    fclose(f);
    if (bad || b.oom) {
        free(b.p);
        return still_fail(err, bad ? STILL_E_IO : STILL_E_NOMEM, "cannot read the task file '%s'", path);
    }
    /* the default task name: the file's base name without .jsonl */
    char base[128];
    const char *sl = strrchr(path, '/');
    snprintf(base, sizeof base, "%s", sl ? sl + 1 : path);
    char *dot = strstr(base, ".jsonl");
    if (dot && !dot[6]) *dot = 0;
    int rc = STILL_OK, cap = 0;
    long line = 0;
    for (size_t i = 0; i < b.n && !rc;) {
        size_t j = i;
        while (j < b.n && b.p[j] != '\n') j++;
        line++;
        size_t q = i;
        while (q < j && (b.p[q] == ' ' || b.p[q] == '\t' || b.p[q] == '\r')) q++;
        if (q < j) {
            if (out->n_items == cap) {
                cap = cap * 2 + 16;
                eval_item *ni = realloc(out->items, sizeof *ni * (size_t)cap);
                if (!ni) {
                    rc = still_fail(err, STILL_E_NOMEM, "out of memory");
                    break;
                }
                out->items = ni;
            }
            rc = parse_item(path, base, line, b.p + i, j - i, &out->items[out->n_items], err);
            if (!rc) out->n_items++;
        }
        i = j + 1;
    }
    free(b.p);
    if (!rc && !out->n_items) rc = still_fail(err, STILL_E_FORMAT, "the task file '%s' holds no task", path);
    if (rc) eval_items_free(out);
    return rc;
}
#endif
