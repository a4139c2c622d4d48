/* `still eval TASK[,TASK...]`: long-context tasks (src/eval/eval_tasks.c) at
 * several lengths, for one attention configuration or several side by side
 * (--compare), greedy decoding, a markdown table on stdout and JSON. */
#include "cli.h"
#include "common/common.h"
#include "eval/eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_CONFIGS 16
#define MAX_LENGTHS 16

/* Length of the valid UTF-8 sequence at s (n bytes left), 0 if invalid. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (s[0] < 0x80) return 1;
    else if (s[0] >= 0xC2 && s[0] <= 0xDF) len = 2;
    else if (s[0] >= 0xE0 && s[0] <= 0xEF) len = 3, lo = s[0] == 0xE0 ? 0xA0 : 0x80, hi = s[0] == 0xED ? 0x9F : 0xBF;
    else if (s[0] >= 0xF0 && s[0] <= 0xF4) len = 4, lo = s[0] == 0xF0 ? 0x90 : 0x80, hi = s[0] == 0xF4 ? 0x8F : 0xBF;
    else return 0;
    if (n < len || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

/* A JSON string; invalid UTF-8 (generation can stop inside a character)
 * becomes U+FFFD. */
static void json_str(FILE *f, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    fputc('"', f);
    for (size_t i = 0; i < n;) {
        const unsigned char c = u[i];
        const size_t len = utf8_seq(u + i, n - i);
        if (!len) fputs("\\ufffd", f), i++;
        else if (len > 1) fwrite(u + i, 1, len, f), i += len;
        else {
            if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
            else if (c == '\n') fputs("\\n", f);
            else if (c < 0x20) fprintf(f, "\\u%04x", c);
            else fputc(c, f);
            i++;
        }
    }
    fputc('"', f);
}

/* "1k,2k,4096" -> lengths */
static int parse_lengths(const char *s, int *out, int *n) {
    *n = 0;
    while (s && *s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s) return -1;
        if (*end == 'k' || *end == 'K') v *= 1024, end++;
        if (v < 16 || v > (1 << 22) || *n >= MAX_LENGTHS || (*end && *end != ',')) return -1;
        out[(*n)++] = (int)v;
        s = *end ? end + 1 : end;
    }
    return *n ? 0 : -1;
}

/* Split "a b  c" into argv words (in place). */
static int split_words(char *s, char **argv, int cap) {
    int n = 0;
    for (char *t = strtok(s, " \t"); t && n < cap; t = strtok(NULL, " \t")) argv[n++] = t;
    return n;
}

typedef struct {
    char name[64];
    cli_opts o;      /* attention options of this configuration */
    char *buf;       /* owns the strings o points into */
} config;

static int apply_config(still_model *m, const config *c) {
    still_err err = {0};
    int rc;
    still_model_drop_lora(m);   /* each configuration's own: an adapter's, or --lora's, or none */
    if (c->o.adapter) rc = still_model_load_adapter_with(m, c->o.adapter, &c->o.ap, c->o.plan_given, &err);
    else {
        still_attn_params ap = c->o.ap;
        if (!c->o.attn_given) ap.kind = "softmax";
        rc = still_model_set_attention(m, &ap, &err);
    }
    if (!rc && c->o.lora) rc = still_model_load_lora(m, c->o.lora, c->o.lora_scale, &err);
    if (rc) fprintf(stderr, "still eval: error: configuration '%s': %s\n", c->name, err.msg);
    return rc;
}

/* Greedy generation after the prompt; returns the text (malloc'ed) or NULL. */
static char *generate(still_model *m, still_context *ctx, const int32_t *ids, size_t n, int max_new, float *logits,
                      int n_vocab) {
    still_err err = {0};
    if (still_context_truncate(ctx, 0, &err) || still_decode(ctx, ids, (int)n, logits, 0, &err)) {
        fprintf(stderr, "still eval: error: %s\n", err.msg);
        return NULL;
    }
    size_t cap = 256, len = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    out[0] = 0;
    for (int i = 0; i < max_new; i++) {
        int best = 0;
        for (int v = 1; v < n_vocab; v++) best = logits[v] > logits[best] ? v : best;
        if (still_token_is_eog(m, best)) break;
        char piece[256];
        size_t k = still_token_to_piece(m, best, piece, sizeof piece);
        if (k > sizeof piece) k = sizeof piece;
        if (len + k + 1 > cap) {
            char *no = realloc(out, cap = (len + k + 1) * 2);
            if (!no) {
                free(out);
                return NULL;
            }
            out = no;
        }
        memcpy(out + len, piece, k);
        out[len += k] = 0;
        if (i + 1 == max_new) break;
        int32_t t = best;
        if (still_decode(ctx, &t, 1, logits, 0, &err)) {
            fprintf(stderr, "still eval: error: %s\n", err.msg);
            free(out);
            return NULL;
        }
    }
    return out;
}

/* One table row: a task at a length (0: a user task's own fixed contexts). */
typedef struct {
    const char *task;
    int length;
    const eval_item *const *items;   /* user task: its items (NULL: built-in) */
    int n_items;
    int samples;
} cell;

static int cell_prompt(const cell *c, int si, uint64_t seed0, const char *hay, size_t hay_len, cli_prompt_counter *cnt,
                       eval_prompt *p, still_err *err) {
    const uint64_t seed = seed0 * 1000003ULL + (uint64_t)si;
    if (!c->items) return eval_make_prompt(c->task, seed, c->length, hay, hay_len, cli_chat_count, cnt, p, err);
    return eval_make_prompt_item(c->items[si % c->n_items], seed, c->length, hay, hay_len, cli_chat_count, cnt, p, err);
}

/* 95% interval of a cell's mean score: Wilson's for 0/1 scores, else the
 * normal approximation with the sample's standard deviation (clipped to [0, 1]). */
static void interval95(const double *x, int n, double *lo, double *hi) {
    double m = 0, v = 0;
    int binary = 1;
    for (int i = 0; i < n; i++) m += x[i], binary &= x[i] == 0 || x[i] == 1;
    m /= n > 0 ? n : 1;
    const double z = 1.959963984540054;
    if (n <= 0) {
        *lo = 0, *hi = 1;
        return;
    }
    if (binary) {
        const double d = 1 + z * z / n, c = (m + z * z / (2 * n)) / d, h = z * sqrt(m * (1 - m) / n + z * z / (4.0 * n * n)) / d;
        *lo = c - h, *hi = c + h;
    } else {
        for (int i = 0; i < n; i++) v += (x[i] - m) * (x[i] - m);
        const double se = n > 1 ? sqrt(v / (n - 1) / n) : 0.5;
        *lo = m - z * se, *hi = m + z * se;
    }
    if (*lo < 0) *lo = 0;
    if (*hi > 1) *hi = 1;
}

int cmd_eval(int argc, char **argv) {
    const char *tasks_arg = NULL;
    if (argc > 0 && argv[0][0] != '-') tasks_arg = argv[0], argc--, argv++;
    cli_opts o;
    int prc = cli_parse(CMD_EVAL, "eval", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    if (!tasks_arg && !o.task_file) {
        fprintf(stderr, "still eval: error: no task given (still eval TASK[,TASK...] -m MODEL, or --tasks FILE.jsonl; tasks: "
                        "niah_single_1, niah_single_2, niah_single_3, niah_multikey_1, niah_multivalue, niah_multiquery, vt, "
                        "passkey, qa1..qa5, or all)\n");
        return 2;
    }
    /* tasks */
    const char *tasks[64];
    int n_tasks = 0;
    char *tcopy = strdup(tasks_arg ? tasks_arg : "");
    for (char *t = strtok(tcopy, ","); t; t = strtok(NULL, ",")) {
        if (!strcmp(t, "all")) {
            for (int i = 0; i < EVAL_N_TASKS && n_tasks < 64; i++) tasks[n_tasks++] = EVAL_TASKS[i];
            continue;
        }
        int ok = 0;
        for (int i = 0; i < EVAL_N_TASKS; i++) ok |= !strcmp(t, EVAL_TASKS[i]);
        if (!ok || n_tasks >= 64) {
            fprintf(stderr, "still eval: error: unknown task '%s'\n", t);
            free(tcopy);
            return 2;
        }
        tasks[n_tasks++] = t;
    }
    int lengths[MAX_LENGTHS], n_len;
    if (parse_lengths(o.lengths ? o.lengths : "1k,2k,4k,8k", lengths, &n_len)) {
        fprintf(stderr, "still eval: error: --lengths expects a list like 1k,2k,4096 (each 16 .. 4M), got '%s'\n",
                o.lengths);
        free(tcopy);
        return 2;
    }
    int max_len = 0;
    for (int i = 0; i < n_len; i++) max_len = lengths[i] > max_len ? lengths[i] : max_len;
    const int samples = o.samples > 0 ? o.samples : 10;
    /* user tasks: items grouped by their "task" */
    eval_item_set items = {0};
    const eval_item **by_task = NULL;
    if (o.task_file) {
        still_err err = {0};
        if (eval_items_load(o.task_file, &items, &err)) {
            fprintf(stderr, "still eval: error: %s\n", err.msg);
            free(tcopy);
            return 1;
        }
        by_task = malloc(sizeof *by_task * (size_t)items.n_items);
        if (!by_task) {
            fprintf(stderr, "still eval: error: out of memory\n");
            eval_items_free(&items);
            free(tcopy);
            return 1;
        }
    }
    cell *cells = calloc((size_t)(n_tasks * n_len + (items.n_items + 1) * n_len), sizeof *cells);
    int n_cells = 0;
    for (int ti = 0; cells && ti < n_tasks; ti++)
        for (int li = 0; li < n_len; li++) cells[n_cells++] = (cell){.task = tasks[ti], .length = lengths[li], .samples = samples};
    {   /* user tasks in file order of first appearance */
        int placed = 0;
        for (int i = 0; cells && i < items.n_items; i++) {
            int seen = 0;
            for (int j = 0; j < i; j++) seen |= !strcmp(items.items[j].task, items.items[i].task);
            if (seen) continue;
            const eval_item **grp = by_task + placed;
            int n = 0, fixed = 0, random = 0;
            for (int j = i; j < items.n_items; j++)
                if (!strcmp(items.items[j].task, items.items[i].task)) {
                    grp[n++] = &items.items[j];
                    fixed += items.items[j].context != NULL;
                    random |= items.items[j].n_needles && !items.items[j].depth;
                }
            placed += n;
            if (fixed && fixed != n) {
                fprintf(stderr, "still eval: error: task '%s' in %s mixes fixed contexts and haystacks (give them two names)\n",
                        items.items[i].task, o.task_file);
                free(cells), cells = NULL;
                break;
            }
            if (fixed)   /* one cell at the prompts' own length; a fixed prompt repeats only when it has random depths */
                cells[n_cells++] = (cell){.task = items.items[i].task, .items = grp, .n_items = n,
                                          .samples = random || samples < n ? samples : n};
            else
                for (int li = 0; li < n_len; li++)
                    cells[n_cells++] = (cell){.task = items.items[i].task, .length = lengths[li], .items = grp,
                                              .n_items = n, .samples = samples};
        }
    }
    if (!cells) {
        if (!by_task || items.n_items) fprintf(stderr, "still eval: error: out of memory or bad task file\n");
        eval_items_free(&items), free(by_task), free(tcopy);
        return 1;
    }
    int max_samples = 0;
    for (int c = 0; c < n_cells; c++) max_samples = cells[c].samples > max_samples ? cells[c].samples : max_samples;

    /* configurations: the command line's own, or each --compare NAME=ARGS */
    config cfgs[MAX_CONFIGS];
    int n_cfg = 0, rc = 1;
    memset(cfgs, 0, sizeof cfgs);
    if (o.n_data && (o.adapter || o.attn_given || o.lora)) {
        fprintf(stderr, "still eval: error: with --compare, give --attn / --adapter / --lora inside each configuration\n");
        goto done;
    }
    if (!o.n_data) {
        snprintf(cfgs[0].name, sizeof cfgs[0].name, "%s", o.adapter ? "adapter" : o.attn_given ? o.ap.kind : "softmax");
        cfgs[0].o = o;
        n_cfg = 1;
    }
    cli_opts dflt;   /* what a configuration without context options parses to */
    char *dav[2] = {"-m", (char *)o.model};
    if (o.n_data && cli_parse(CMD_EVAL, "eval --compare", 2, dav, &dflt)) goto done;
    for (int i = 0; i < o.n_data && n_cfg < MAX_CONFIGS; i++) {
        config *c = &cfgs[n_cfg];
        const char *spec = o.data[i], *eq = strchr(spec, '=');
        if (!eq || eq == spec || (size_t)(eq - spec) >= sizeof c->name) {
            fprintf(stderr, "still eval: error: --compare expects NAME=OPTIONS, e.g. 'swa=--attn swa --window 896', got '%s'\n",
                    spec);
            goto done;
        }
        memcpy(c->name, spec, (size_t)(eq - spec));
        c->buf = strdup(eq + 1);
        char *av[64];
        av[0] = "-m", av[1] = (char *)o.model;
        int ac = 2 + split_words(c->buf, av + 2, 60);
        if (cli_parse(CMD_EVAL, "eval --compare", ac, av, &c->o)) goto done;
        /* the contexts of every configuration share the main command line's device, products and batch: said
         * inside a configuration they would be ignored */
        if (c->o.device || c->o.matvec || c->o.prefill || c->o.n_batch != dflt.n_batch || c->o.threads != dflt.threads) {
            fprintf(stderr, "still eval: error: --compare '%s': --device, --matvec, --prefill, -b and -t apply to every "
                    "configuration; give them outside --compare\n", c->name);
            goto done;
        }
        n_cfg++;
    }

    /* haystack for the essay tasks */
    char *hay = NULL;
    size_t hay_len = 0;
    const char *hay_path = o.haystack;
    if (!hay_path && access("../shared/data/corpus/austen/emma.txt", R_OK) == 0)
        hay_path = "../shared/data/corpus/austen/emma.txt";
    int need_hay = 0;
    for (int i = 0; i < n_tasks; i++)
        need_hay |= strcmp(tasks[i], "niah_single_1") && strcmp(tasks[i], "vt") && strcmp(tasks[i], "passkey");
    for (int i = 0; i < items.n_items; i++) need_hay |= !items.items[i].context && !items.items[i].haystack;
    if (need_hay) {
        if (!hay_path) {
            fprintf(stderr, "still eval: error: these tasks need a haystack text: give --haystack FILE\n");
            goto done;
        }
        if (cli_read_file(hay_path, &hay, &hay_len)) goto done;
    }

    still_model *m;
    const int lrc = cli_load_model(&o, &m);
    if (lrc) {
        rc = lrc;
        goto done;
    }
    still_model_info info = still_model_get_info(m);
    cli_prompt_counter cnt = {.m = m, .system = still_model_default_system(m)};
    FILE *dump = NULL;
    if (o.dump) {
        dump = !strcmp(o.dump, "-") ? stdout : fopen(o.dump, "w");
        if (!dump) {
            fprintf(stderr, "still eval: error: cannot write '%s'\n", o.dump);
            still_model_free(m);
            goto done;
        }
    }
    /* fixed user contexts: the context must hold the longest */
    int ctx_len = max_len;
    for (int c = 0; c < n_cells; c++) {
        if (cells[c].length) continue;
        for (int si = 0; si < cells[c].samples; si++) {
            eval_prompt p;
            still_err err = {0};
            if (cell_prompt(&cells[c], si, o.tp.seed, hay, hay_len, &cnt, &p, &err)) {
                fprintf(stderr, "still eval: error: %s\n", err.msg);
                still_model_free(m);
                goto done;
            }
            ctx_len = p.n_tokens > ctx_len ? p.n_tokens : ctx_len;
            eval_prompt_free(&p);
        }
    }
    const size_t per_cfg = (size_t)n_cells * max_samples;
    double *score = calloc((size_t)n_cfg * per_cfg, sizeof(double));
    char **outs = calloc((size_t)n_cfg * per_cfg, sizeof(char *)); /* generated text per sample */
    int *ntok = calloc(per_cfg, sizeof(int));
    float *logits = malloc(sizeof(float) * (size_t)info.n_vocab);
    double *state_mib = calloc((size_t)n_cfg, sizeof(double));   /* each configuration's attention state */
    if (!score || !outs || !ntok || !logits || !state_mib) {
        fprintf(stderr, "still eval: error: out of memory\n");
        goto run_done;
    }
#define AT(ci, c, si) (((size_t)(ci) * n_cells + (size_t)(c)) * max_samples + (size_t)(si))
    const int tty = isatty(2);
    const double t0 = cli_now();
    int total = 0, done_n = 0;
    for (int c = 0; c < n_cells; c++) total += n_cfg * cells[c].samples;
    for (int ci = 0; ci < n_cfg && !o.dry_run; ci++) {
        if (apply_config(m, &cfgs[ci])) goto run_done;
        still_context *ctx = NULL;
        still_err err = {0};
        if (still_context_create(m, (still_context_params){.n_ctx = ctx_len + 160, .n_batch = o.n_batch, .sel_cache = cli_sel_cache(&o), .device = cli_device(&o), .matvec = cli_matvec(&o), .prefill = cli_prefill(&o), .fixed_threads = o.fixed_threads}, &ctx, &err)) {
            fprintf(stderr, "still eval: error: %s\n", err.msg);
            goto run_done;
        }
        /* (fixed-size kinds: the size at any length; a KV cache: allocated for the longest prompt) */
        state_mib[ci] = (double)still_context_state_bytes(ctx) / (1024.0 * 1024.0);
        fprintf(stderr, "eval: %s: attention state %.2f MiB\n", cfgs[ci].name, state_mib[ci]);
        for (int c = 0; c < n_cells; c++)
            for (int si = 0; si < cells[c].samples; si++) {
                eval_prompt p;
                if (cell_prompt(&cells[c], si, o.tp.seed, hay, hay_len, &cnt, &p, &err)) {
                    fprintf(stderr, "still eval: error: %s\n", err.msg);
                    still_context_free(ctx);
                    goto run_done;
                }
                int32_t *ids;
                size_t n_ids;
                char *outp = NULL;
                if (!cli_chat_ids(m, cnt.system, p.user, p.answer_prefix, &ids, &n_ids)) {
                    outp = generate(m, ctx, ids, n_ids, p.max_new, logits, info.n_vocab);
                    free(ids);
                }
                if (!outp) {
                    eval_prompt_free(&p);
                    still_context_free(ctx);
                    goto run_done;
                }
                const double sc = eval_score(&p, outp);
                score[AT(ci, c, si)] = sc;
                ntok[(size_t)c * max_samples + si] = p.n_tokens;
                if (o.verbose)
                    fprintf(stderr, "[%s %s %d #%d] %.2f: %s\n", cfgs[ci].name, cells[c].task, cells[c].length, si, sc, outp);
                outs[AT(ci, c, si)] = outp;
                eval_prompt_free(&p);
                done_n++;
                const double el = cli_now() - t0;
                if (tty)
                    fprintf(stderr, "\r\033[K[%d/%d] %s %s %d  %.0fs elapsed, ETA %.0fs", done_n, total, cfgs[ci].name,
                            cells[c].task, cells[c].length, el, el / done_n * (total - done_n));
                else if (si == cells[c].samples - 1)
                    fprintf(stderr, "eval: %s %s %d done (%d/%d, %.0fs)\n", cfgs[ci].name, cells[c].task,
                            cells[c].length, done_n, total, el);
            }
        still_context_free(ctx);
    }
    if (tty && !o.dry_run) fputc('\n', stderr);

    /* prompts only (tests, inspection): one JSON object per line */
    if (dump) {
        for (int c = 0; c < n_cells; c++)
            for (int si = 0; si < cells[c].samples; si++) {
                eval_prompt p;
                still_err err = {0};
                if (cell_prompt(&cells[c], si, o.tp.seed, hay, hay_len, &cnt, &p, &err)) {
                    fprintf(stderr, "still eval: error: %s\n", err.msg);
                    goto run_done;
                }
                fputs("{\"task\": ", dump);
                json_str(dump, cells[c].task, strlen(cells[c].task));
                fprintf(dump, ", \"length\": %d, \"sample\": %d, \"n_tokens\": %d, \"depth\": %.6f, "
                              "\"context_off\": %zu, \"context_len\": %zu, \"item_pos\": [",
                        cells[c].length, si, p.n_tokens, p.depth, p.context_off, p.context_len);
                for (int i = 0; i < p.n_items; i++) fprintf(dump, "%s%zu", i ? ", " : "", p.item_pos[i]);
                fprintf(dump, "], \"refs\": [");
                for (int i = 0; i < p.n_refs; i++) {
                    if (i) fputs(", ", dump);
                    json_str(dump, p.refs[i], strlen(p.refs[i]));
                }
                fprintf(dump, "], \"any_ref\": %d, \"first_sentence\": %d, \"user\": ", p.any_ref, p.first_sentence);
                json_str(dump, p.user, strlen(p.user));
                fputs(", \"answer_prefix\": ", dump);
                json_str(dump, p.answer_prefix, strlen(p.answer_prefix));
                fputs("}\n", dump);
                eval_prompt_free(&p);
            }
    }
    if (o.dry_run) {
        rc = 0;
        goto run_done;
    }

    /* markdown table: mean score and its 95% interval per cell */
    printf("| task | length | n |");
    for (int ci = 0; ci < n_cfg; ci++) printf(" %s |", cfgs[ci].name);
    printf("\n|---|---:|---:|");
    for (int ci = 0; ci < n_cfg; ci++) printf("---:|");
    printf("\n");
    for (int c = 0; c < n_cells; c++) {
        const int ns = cells[c].samples;
        if (cells[c].length) printf("| %s | %d | %d |", cells[c].task, cells[c].length, ns);
        else {   /* a fixed context: its prompts' mean length */
            double t = 0;
            for (int si = 0; si < ns; si++) t += ntok[(size_t)c * max_samples + si];
            printf("| %s | ~%.0f | %d |", cells[c].task, ns ? t / ns : 0.0, ns);
        }
        for (int ci = 0; ci < n_cfg; ci++) {
            double sum = 0, lo, hi;
            for (int si = 0; si < ns; si++) sum += score[AT(ci, c, si)];
            interval95(score + AT(ci, c, 0), ns, &lo, &hi);
            printf(" %.1f [%.0f–%.0f] |", 100.0 * sum / ns, 100 * lo, 100 * hi);
        }
        printf("\n");
    }
    printf("\nscores in %% (mean over n samples per cell and its 95%% interval: Wilson's for 0/1 scores, else the "
           "normal approximation; seed %llu, greedy decoding)\n", (unsigned long long)o.tp.seed);

    /* JSON, written to a temporary file and renamed */
    {
        const char *jpath = o.json_out ? o.json_out : "still-eval.json";
        char *tmp = NULL;
        FILE *f = NULL;
        still_err werr = {0};
        if (still_tmp_open(jpath, &f, &tmp, &werr)) {
            fprintf(stderr, "still eval: error: %s\n", werr.msg);
            goto run_done;
        }
        fprintf(f, "{\"model\": ");
        json_str(f, o.model, strlen(o.model));
        fprintf(f, ", \"seed\": %llu, \"samples\": %d, \"results\": [", (unsigned long long)o.tp.seed, samples);
        int first = 1;
        for (int ci = 0; ci < n_cfg; ci++)
            for (int c = 0; c < n_cells; c++) {
                const int ns = cells[c].samples;
                fprintf(f, "%s\n  {\"config\": ", first ? "" : ",");
                first = 0;
                json_str(f, cfgs[ci].name, strlen(cfgs[ci].name));
                const char *spec = ci < o.n_data ? strchr(o.data[ci], '=') + 1 : NULL;
                fputs(", \"options\": ", f);
                if (spec) json_str(f, spec, strlen(spec));
                else fputs("null", f);
                double sum = 0, lo, hi;
                const double *sc = score + AT(ci, c, 0);
                for (int si = 0; si < ns; si++) sum += sc[si];
                interval95(sc, ns, &lo, &hi);
                fputs(", \"task\": ", f);
                json_str(f, cells[c].task, strlen(cells[c].task));
                fprintf(f, ", \"length\": %d, \"n\": %d, \"score\": %.6f, \"ci95\": [%.6f, %.6f], \"state_mib\": %.4f, \"n_tokens\": [",
                        cells[c].length, ns, ns ? sum / ns : 0.0, lo, hi, state_mib[ci]);
                for (int si = 0; si < ns; si++) fprintf(f, "%s%d", si ? ", " : "", ntok[(size_t)c * max_samples + si]);
                fprintf(f, "], \"scores\": [");
                for (int si = 0; si < ns; si++) fprintf(f, "%s%.4f", si ? ", " : "", sc[si]);
                fprintf(f, "], \"outputs\": [");
                char *const *out = outs + AT(ci, c, 0);
                for (int si = 0; si < ns; si++) {
                    if (si) fputs(", ", f);
                    json_str(f, out[si] ? out[si] : "", out[si] ? strlen(out[si]) : 0);
                }
                fprintf(f, "]}");
            }
        fprintf(f, "\n]}\n");
        if (still_tmp_commit(f, tmp, jpath, &werr)) {
            fprintf(stderr, "still eval: error: %s\n", werr.msg);
            goto run_done;
        }
        fprintf(stderr, "eval: wrote %s\n", jpath);
    }
    rc = 0;
run_done:
    if (dump && dump != stdout) fclose(dump);
    if (outs)
        for (size_t i = 0; i < (size_t)n_cfg * per_cfg; i++) free(outs[i]);
    free(outs);
    free(score), free(logits), free(ntok), free(state_mib);
    still_model_free(m);
done:
    for (int i = 0; i < n_cfg; i++) free(cfgs[i].buf);
    free(hay);
    free(tcopy);
    free(cells), free(by_task);
    eval_items_free(&items);
    return rc;
}
