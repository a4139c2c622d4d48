/* `still bench`: llama-bench-style measurements.
 * pp N: process N prompt tokens after a context of depth d, fed -b tokens a
 * call (default: 512 on the CPU; on the GPU the whole context up to 65536).
 * tg N: generate N tokens one at a time after a context of depth d.
 * -p, -n and -d take comma-separated lists (at most 16 values each; 0 in -p
 * or -n means no such test) and --attn a comma-separated list of kinds, all
 * with the same kind options; every combination runs: for each kind, for each
 * depth, a pp test per nonzero p, then a tg test per nonzero n. The model is
 * loaded once and switched between kinds (still_model_set_attention); without
 * --attn the model's own plan runs (--adapter: the adapter's plan).
 * Each cell gets its own context of exactly depth + the test's tokens (or -c
 * if larger), so the state size is what that cell needs. The test runs once
 * as a warm-up, then r timed repetitions, each from an emptied context (the
 * depth prefill is not timed). Reported per cell: t/s as mean ± sample
 * standard deviation over the repetitions; ms/token as the mean over the
 * repetitions of 1000 · seconds / tokens (so ≥ 1000 / mean t/s, equal when
 * the repetitions agree); the process's peak resident memory so far (after
 * the cell); the attention state's bytes as the engine counts them.
 * --interleave: the tg tests of one kind and one n run at every depth at
 * once, so that all depths see the same machine conditions (this VM's speed
 * drifts by ~15% over hours): one context per depth; each repetition
 * prefills every context to its depth (untimed), then generates n tokens
 * taking one step in each context in turn, timing each step. The pp tests
 * run first, as usual. Peak RSS is then the process's, with all contexts.
 * Output on stdout: a markdown table (default), --csv (a header line, then a
 * line per cell) or --json (an array of objects), with the fields model (the
 * -m path), attn, test, n_prompt, n_gen, depth, reps, tps_mean, tps_sd,
 * ms_per_token, peak_rss_mib, state_mib (JSON: null for a non-finite
 * number), and n_batch last when -b is given. One progress line per finished cell goes to stderr. */
#include "cli.h"
#include "cpu/kernels.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BENCH_MAX_LIST 16
#define BENCH_MAX_TOKENS (1 << 22)   /* the context limit */

enum { FMT_MD, FMT_CSV, FMT_JSON };

/* The sweep, from the command line. kinds point into kind_buf (owned). */
typedef struct {
    int p[BENCH_MAX_LIST], n[BENCH_MAX_LIST], d[BENCH_MAX_LIST];
    int n_p, n_n, n_d;
    char *kind_buf;
    const char *kinds[BENCH_MAX_LIST];
    int n_kinds;           /* 0: the model's own plan */
    int fmt;
} bench_plan;

typedef struct {
    still_context *ctx;
    float *logits;
    int32_t *tokens;   /* pseudo-random token ids, reused */
    int n_tokens;
    double *secs;      /* [reps] timings of the current cell */
    int sel_cache;     /* --sel-cache (STILL_SEL_*) */
    int matvec;        /* --matvec (STILL_MATVEC_*) */
    int prefill;       /* --prefill (STILL_PREFILL_*) */
    int fixed_threads; /* --fixed-threads */
    int device;        /* --device (STILL_DEVICE_*) */
    int n_batch;       /* -b; 0: the device's default */
} bench_state;

/* The prefill chunk of a context of n_ctx tokens: -b if given (at most
 * n_ctx); else 512 tokens on the CPU and, on the GPU, the whole context up
 * to 64K tokens in one call (larger GEMMs, and enough query tiles to fill
 * the GPU's multiprocessors in the attention kernel). */
static int bench_n_batch(const bench_state *b, int n_ctx) {
    if (b->n_batch > 0) return b->n_batch < n_ctx ? b->n_batch : n_ctx;
    return b->device == STILL_DEVICE_CUDA ? (n_ctx < 65536 ? n_ctx : 65536) : 512;
}

/* One cell's results. */
typedef struct {
    const char *attn;
    int n_prompt, n_gen, depth, reps;
    int n_batch;   /* the prefill chunk the context used */
    double tps_mean, tps_sd, ms_per_token, peak_rss_mib, state_mib;
} bench_row;

/* Parse "a,b,c": integers in [0, hi], at most BENCH_MAX_LIST. Returns the
 * count, or -1 (message printed). */
static int parse_list(const char *flag, const char *s, int hi, int *v) {
    int n = 0;
    for (const char *item = s;; item++) {
        const char *end = item;
        while (*end && *end != ',') end++;
        if (end == item) {
            fprintf(stderr, "still bench: error: %s: empty item in '%s'\n", flag, s);
            return -1;
        }
        if (n == BENCH_MAX_LIST) {
            fprintf(stderr, "still bench: error: %s takes at most %d values, got '%s'\n", flag, BENCH_MAX_LIST, s);
            return -1;
        }
        long x = 0;
        for (const char *c = item; c < end && x <= hi; c++) {
            if (*c < '0' || *c > '9') { x = -1; break; }
            x = x * 10 + (*c - '0');
        }
        if (x < 0 || x > hi) {
            fprintf(stderr, "still bench: error: %s expects integers in [0, %d] separated by commas, got '%.*s' in '%s'\n",
                    flag, hi, (int)(end - item), item, s);
            return -1;
        }
        v[n++] = (int)x;
        if (!*end) return n;
        item = end;
    }
}

/* Split --attn's list into plan->kinds (names checked by the engine later). */
static int parse_kinds(const char *s, bench_plan *plan) {
    plan->kind_buf = strdup(s);
    if (!plan->kind_buf) {
        fprintf(stderr, "still bench: error: out of memory\n");
        return -1;
    }
    for (char *item = plan->kind_buf;;) {
        char *end = strchr(item, ',');
        if (end) *end = 0;
        if (!*item) {
            fprintf(stderr, "still bench: error: --attn: empty item in '%s'\n", s);
            return -1;
        }
        if (plan->n_kinds == BENCH_MAX_LIST) {
            fprintf(stderr, "still bench: error: --attn takes at most %d kinds, got '%s'\n", BENCH_MAX_LIST, s);
            return -1;
        }
        plan->kinds[plan->n_kinds++] = item;
        if (!end) return 0;
        item = end + 1;
    }
}

static int max_of(const int *v, int n) {
    int m = 0;
    for (int i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* Check the command line's bench options. Returns 0, or -1 (message printed). */
static int make_plan(const cli_opts *o, bench_plan *plan) {
    memset(plan, 0, sizeof *plan);
    if (o->csv && o->json) {
        fprintf(stderr, "still bench: error: give either --csv or --json, not both\n");
        return -1;
    }
    plan->fmt = o->csv ? FMT_CSV : o->json ? FMT_JSON : FMT_MD;
    if ((plan->n_p = parse_list("-p", o->bench_p, BENCH_MAX_TOKENS, plan->p)) < 0) return -1;
    if ((plan->n_n = parse_list("-n", o->bench_n, BENCH_MAX_TOKENS, plan->n)) < 0) return -1;
    if ((plan->n_d = parse_list("-d", o->bench_d, BENCH_MAX_TOKENS, plan->d)) < 0) return -1;
    int max_p = max_of(plan->p, plan->n_p), max_n = max_of(plan->n, plan->n_n), max_d = max_of(plan->d, plan->n_d);
    if (max_p == 0 && max_n == 0) {
        fprintf(stderr, "still bench: error: nothing to run (every -p and -n value is 0)\n");
        return -1;
    }
    int max_t = max_p > max_n ? max_p : max_n;
    if (max_d > BENCH_MAX_TOKENS - max_t) {
        fprintf(stderr, "still bench: error: depth + test tokens must be at most %d (the context limit), got %d + %d\n",
                BENCH_MAX_TOKENS, max_d, max_t);
        return -1;
    }
    if (o->attn_given && parse_kinds(o->ap.plan ? "plan" : o->ap.kind, plan)) return -1;   /* --plan: one cell */
    return 0;
}

/* The machine's memory read bandwidth with `threads` threads, in GB/s: the best of five passes summing a
 * 256 MiB buffer (each thread reads the part it first wrote). A decode step streams the weights and the
 * attention state once per token, so bytes per token over this bound a decode's speed from above. 0 when
 * the buffer cannot be had. */
static double read_bandwidth_gbs(int threads) {
    const size_t n = ((size_t)256 << 20) / sizeof(uint64_t);
    uint64_t *buf = malloc(n * sizeof *buf);
    if (!buf) return 0.0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; i++) buf[i] = i;
    double best = 0.0;
    volatile uint64_t sink = 0;
    for (int pass = 0; pass < 5; pass++) {
        uint64_t sum = 0;
        const double t0 = omp_get_wtime();
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sum)
        for (size_t i = 0; i < n; i++) sum += buf[i];
        const double dt = omp_get_wtime() - t0;
        sink += sum;
        if (dt > 0 && n * sizeof *buf / dt / 1e9 > best) best = n * sizeof *buf / dt / 1e9;
    }
    (void)sink;
    free(buf);
    return best;
}

/* The kind of the model's plan: the first layer that is not softmax, or softmax. */
static const char *plan_label(const still_model *m, int n_layer) {
    for (int l = 0; l < n_layer; l++) {
        const char *k = still_model_layer_kind(m, l);
        if (k && strcmp(k, "softmax")) return k;
    }
    return "softmax";
}

/* Prefill `depth` tokens (untimed), then time the test. Returns seconds, < 0 on error. */
static double run_once(bench_state *b, int depth, int n_prompt, int n_gen) {
    still_err err = {0};
    if (still_context_truncate(b->ctx, 0, &err)) goto fail;
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

/* t/s mean ± sd and ms/token over the repetitions' timings, and peak RSS. */
static void fill_stats(bench_row *row, const double *secs, int reps, int n_tok) {
    double sum = 0, sum_ms = 0;
    for (int r = 0; r < reps; r++) {
        sum += n_tok / secs[r];
        sum_ms += 1000.0 * secs[r] / n_tok;
    }
    double mean = sum / reps, ss = 0;
    for (int r = 0; r < reps; r++) {
        double dev = n_tok / secs[r] - mean;
        ss += dev * dev;
    }
    row->reps = reps;
    row->tps_mean = mean;
    row->tps_sd = reps > 1 ? sqrt(ss / (reps - 1)) : 0;
    row->ms_per_token = sum_ms / reps;
    row->peak_rss_mib = cli_peak_rss() / 1048576.0;
}

/* One cell: a fresh context of depth + the test's tokens (or min_ctx), a
 * warm-up, r timed repetitions. Fills row's measurements; returns 0 or -1. */
static int run_cell(const still_model *m, bench_state *b, int min_ctx, int reps, int warmup, bench_row *row) {
    const int np = row->n_prompt, ng = row->n_gen, n_tok = np + ng;
    int n_ctx = row->depth + n_tok;
    if (min_ctx > n_ctx) n_ctx = min_ctx;
    still_err err = {0};
    const int n_batch = bench_n_batch(b, n_ctx);
    still_context_params cp = {.n_ctx = n_ctx, .n_batch = n_batch, .sel_cache = b->sel_cache, .device = b->device, .matvec = b->matvec, .prefill = b->prefill, .fixed_threads = b->fixed_threads};
    if (still_context_create(m, cp, &b->ctx, &err)) {
        fprintf(stderr, "still bench: error: %s\n", err.msg);
        return -1;
    }
    int rc = -1;
    if (warmup && run_once(b, row->depth, np, ng) < 0) goto done;   /* warm-up */
    for (int r = 0; r < reps; r++)
        if ((b->secs[r] = run_once(b, row->depth, np, ng)) < 0) goto done;
    fill_stats(row, b->secs, reps, n_tok);
    row->state_mib = still_context_state_bytes(b->ctx) / 1048576.0;
    row->n_batch = n_batch;
    rc = 0;
done:
    still_context_free(b->ctx);
    b->ctx = NULL;
    return rc;
}

/* --interleave: the tg tests rows[0..n_rows) (one n, one depth each), one
 * context each; per repetition every context is prefilled to its depth
 * (untimed), then n tokens are generated one step per context in turn, each
 * step timed on its own. Fills the rows; returns 0 or -1. */
static int run_interleaved(const still_model *m, bench_state *b, int min_ctx, int reps, int warmup, bench_row *rows,
                           int n_rows) {
    if (n_rows < 1) return 0;
    const int n_gen = rows[0].n_gen;
    still_context *ctx[BENCH_MAX_LIST] = {0};
    double *secs = calloc((size_t)n_rows * (size_t)reps, sizeof(double));
    still_err err = {0};
    int rc = -1;
    if (!secs) {
        fprintf(stderr, "still bench: error: out of memory\n");
        return -1;
    }
    for (int j = 0; j < n_rows; j++) {
        int n_ctx = rows[j].depth + n_gen;
        if (min_ctx > n_ctx) n_ctx = min_ctx;
        const int n_batch = bench_n_batch(b, n_ctx);
        still_context_params cp = {.n_ctx = n_ctx, .n_batch = n_batch, .sel_cache = b->sel_cache, .device = b->device, .matvec = b->matvec, .prefill = b->prefill, .fixed_threads = b->fixed_threads};
        rows[j].n_batch = n_batch;
        if (still_context_create(m, cp, &ctx[j], &err)) goto fail;
    }
    for (int r = warmup ? -1 : 0; r < reps; r++) {
        for (int j = 0; j < n_rows; j++) {
            if (still_context_truncate(ctx[j], 0, &err)) goto fail;
            if (rows[j].depth > 0 && still_decode(ctx[j], b->tokens, rows[j].depth, NULL, 0, &err)) goto fail;
        }
        for (int i = 0; i < n_gen; i++)
            for (int j = 0; j < n_rows; j++) {
                int32_t tok = b->tokens[rows[j].depth + i];
                double t0 = cli_now();
                if (still_decode(ctx[j], &tok, 1, b->logits, 0, &err)) goto fail;
                if (r >= 0) secs[(size_t)j * (size_t)reps + (size_t)r] += cli_now() - t0;
            }
    }
    for (int j = 0; j < n_rows; j++) {
        fill_stats(&rows[j], secs + (size_t)j * (size_t)reps, reps, n_gen);
        rows[j].state_mib = still_context_state_bytes(ctx[j]) / 1048576.0;
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "still bench: error: %s\n", err.msg);
done:
    for (int j = 0; j < n_rows; j++) still_context_free(ctx[j]);
    free(secs);
    return rc;
}

static void test_name(const bench_row *row, char *buf, size_t cap) {
    int n = snprintf(buf, cap, "%s%d", row->n_prompt ? "pp" : "tg", row->n_prompt + row->n_gen);
    if (row->depth > 0 && n > 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, " @ d%d", row->depth);
}

static void csv_str(const char *s) {
    if (!strpbrk(s, ",\"\r\n")) {
        fputs(s, stdout);
        return;
    }
    putchar('"');
    for (; *s; s++) {
        if (*s == '"') putchar('"');
        putchar(*s);
    }
    putchar('"');
}

static void json_str(const char *s) {
    putchar('"');
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') printf("\\%c", *c);
        else if (*c < 0x20) printf("\\u%04x", *c);
        else putchar(*c);
    }
    putchar('"');
}

/* A number for CSV / JSON: full precision; JSON has no nan/inf (null). */
static void put_num(double x, int fmt) {
    if (isfinite(x)) printf("%.10g", x);
    else fputs(fmt == FMT_JSON ? "null" : isnan(x) ? "nan" : x > 0 ? "inf" : "-inf", stdout);
}

/* with_batch: -b was given; its column (markdown) or field (CSV, JSON) is
 * printed, last in CSV and JSON so that the default schema stays as it is. */
static void print_header(int fmt, int with_batch) {
    if (fmt == FMT_MD) {
        printf("| model | size | params | backend | attn | threads |%s test | t/s | ms/token | peak RSS so far | attn state |\n",
               with_batch ? " n_batch |" : "");
        printf("| ----- | ---: | -----: | ------- | ---- | ------: |%s ---: | --: | -------: | --------------: | ---------: |\n",
               with_batch ? " ------: |" : "");
    } else if (fmt == FMT_CSV) {
        printf("model,attn,test,n_prompt,n_gen,depth,reps,tps_mean,tps_sd,ms_per_token,peak_rss_mib,state_mib%s\n",
               with_batch ? ",n_batch" : "");
    } else {
        printf("[");
    }
    fflush(stdout);
}

static void print_row(int fmt, const cli_opts *o, const still_model_info *info, int threads, const bench_row *row,
                      int index) {
    char test[64];
    test_name(row, test, sizeof test);
    if (fmt == FMT_MD) {
        char batch[24] = "";
        if (o->bench_b) snprintf(batch, sizeof batch, " %d |", row->n_batch);
        printf("| llama %d-layer d%d | %.2f MiB | %.2f M | %s | %s | %d |%s %s | %.2f ± %.2f | %.3f | %.1f MiB | %.2f MiB |\n",
               info->n_layer, info->d_model, info->file_bytes / 1048576.0, info->n_params / 1e6,
               cli_device(o) == STILL_DEVICE_CUDA ? "CUDA" : cli_matvec(o) == STILL_MATVEC_FLOAT ? "CPU" : "CPU int8",
               row->attn, threads,
               batch, test, row->tps_mean, row->tps_sd, row->ms_per_token, row->peak_rss_mib, row->state_mib);
    } else {
        const int json = fmt == FMT_JSON;
        const double nums[] = {row->tps_mean, row->tps_sd, row->ms_per_token, row->peak_rss_mib, row->state_mib};
        static const char *const num_keys[] = {"tps_mean", "tps_sd", "ms_per_token", "peak_rss_mib", "state_mib"};
        if (json) {
            printf("%s\n  {\"model\": ", index ? "," : "");
            json_str(o->model);
            printf(", \"attn\": ");
            json_str(row->attn);
            printf(", \"test\": ");
            json_str(test);
            printf(", \"n_prompt\": %d, \"n_gen\": %d, \"depth\": %d, \"reps\": %d", row->n_prompt, row->n_gen,
                   row->depth, row->reps);
        } else {
            csv_str(o->model);
            putchar(',');
            csv_str(row->attn);
            putchar(',');
            csv_str(test);
            printf(",%d,%d,%d,%d", row->n_prompt, row->n_gen, row->depth, row->reps);
        }
        for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
            if (json) printf(", \"%s\": ", num_keys[i]);
            else putchar(',');
            put_num(nums[i], fmt);
        }
        if (o->bench_b) printf(json ? ", \"n_batch\": %d" : ",%d", row->n_batch);
        printf(json ? "}" : "\n");
    }
    fflush(stdout);
}

static void print_footer(int fmt) {
    if (fmt == FMT_JSON) printf("\n]\n");
    fflush(stdout);
}

/* Switch every layer to one kind with the command line's kind options;
 * prints the error. */
static int set_kind(still_model *m, const still_attn_params *opts, const char *kind) {
    still_attn_params ap = *opts;
    ap.kind = strcmp(kind, "plan") ? kind : "softmax";   /* "plan": --plan sets every layer */
    still_err err = {0};
    if (still_model_set_attention(m, &ap, &err)) {
        fprintf(stderr, "still bench: error: %s\n", err.msg);
        return -1;
    }
    return 0;
}

/* Print a finished cell (stdout) and a progress line (stderr). */
static void report(const bench_plan *plan, const cli_opts *o, const still_model_info *info, int threads,
                   const bench_row *row, int *cell, int n_cells) {
    print_row(plan->fmt, o, info, threads, row, *cell);
    char test[64];
    test_name(row, test, sizeof test);
    fprintf(stderr, "still bench: [%d/%d] %s %s: %.2f ± %.2f t/s\n", ++*cell, n_cells, row->attn, test, row->tps_mean,
            row->tps_sd);
}

int cmd_bench(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_BENCH, "bench", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    bench_plan plan;
    if (make_plan(&o, &plan)) {
        free(plan.kind_buf);
        return 2;
    }
    /* The kinds are switched here, one at a time (not by the loader). */
    cli_opts load = o;
    load.attn_given = 0;
    still_model *m;
    const int lrc = cli_load_model(&load, &m);
    if (lrc) {
        free(plan.kind_buf);
        return lrc;
    }
    still_model_info info = still_model_get_info(m);
    const int max_p = max_of(plan.p, plan.n_p), max_n = max_of(plan.n, plan.n_n), max_d = max_of(plan.d, plan.n_d);
    bench_state b = {.sel_cache = cli_sel_cache(&o), .device = cli_device(&o), .matvec = cli_matvec(&o), .prefill = cli_prefill(&o), .n_batch = o.bench_b, .fixed_threads = o.fixed_threads};
    b.n_tokens = max_d + (max_p > max_n ? max_p : max_n);
    b.tokens = malloc(sizeof(int32_t) * (size_t)b.n_tokens);
    b.logits = malloc(sizeof(float) * (size_t)info.n_vocab);
    b.secs = malloc(sizeof(double) * (size_t)o.reps);
    int rc = 1, header = 0;
    if (!b.tokens || !b.logits || !b.secs) {
        fprintf(stderr, "still bench: error: out of memory\n");
        goto done;
    }
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    for (int i = 0; i < b.n_tokens; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b.tokens[i] = (int32_t)(x % (uint64_t)info.n_vocab);
    }
    /* Check every kind (and the kind options) before the first measurement;
     * the last one checked stays set. */
    int current = -1;
    for (int k = 0; k < plan.n_kinds; k++) {
        if (set_kind(m, &o.ap, plan.kinds[k])) goto done;
        current = k;
    }
    const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
    int n_tests = 0;
    for (int i = 0; i < plan.n_p; i++) n_tests += plan.p[i] > 0;
    for (int i = 0; i < plan.n_n; i++) n_tests += plan.n[i] > 0;
    const int n_runs = plan.n_kinds > 0 ? plan.n_kinds : 1;
    const int n_cells = n_runs * plan.n_d * n_tests;
    {   /* the machine, so figures from different ones are never mixed up */
        char cpu[256] = "unknown CPU", line[512];
        FILE *f = fopen("/proc/cpuinfo", "r");
        while (f && fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
                snprintf(cpu, sizeof cpu, "%s", strchr(line, ':') + 2);
                cpu[strcspn(cpu, "\n")] = 0;
                break;
            }
        if (f) fclose(f);
        /* the default: int8 by the best path of the CPU, float products with the CUDA device */
        const int mv = cli_matvec(&o) == STILL_MATVEC_DEFAULT && cli_device(&o) == STILL_DEVICE_CUDA ? STILL_MATVEC_FLOAT
                                                                                                   : cli_matvec(&o);
        const int int8_best = mv == STILL_MATVEC_DEFAULT || mv == STILL_MATVEC_INT8;
        fprintf(stderr, "still bench: %s; single-token products: %s", cpu,
                mv == STILL_MATVEC_FLOAT ? "float"
                                         : matvec_q8_path_name(int8_best ? matvec_q8_best_path() : mv - STILL_MATVEC_INT8));
        fprintf(stderr, "; prefill products: %s",
                cli_prefill(&o) == STILL_PREFILL_INT8 && matmul_q8_supported(TT_Q4_1, MATVEC_Q8_VNNI)
                    ? "int8 (avx512-vnni; Q4_0/Q4_1/Q8_0, others float)"
                    : "float");
        if (cli_device(&o) != STILL_DEVICE_CUDA)
            fprintf(stderr, "; memory read %.1f GB/s (%d threads)", read_bandwidth_gbs(threads), threads);
        fprintf(stderr, "\n");
    }
    print_header(plan.fmt, o.bench_b > 0);
    header = 1;
    int cell = 0;
    for (int k = 0; k < n_runs; k++) {
        if (plan.n_kinds > 0 && k != current) {
            if (set_kind(m, &o.ap, plan.kinds[k])) goto done;
            current = k;
        }
        const char *label = plan.n_kinds > 0 ? plan.kinds[k] : plan_label(m, info.n_layer);
        /* --interleave: the pp tests at every depth, then each n's tg tests together */
        const int n_tests_here = o.interleave ? plan.n_p : plan.n_p + plan.n_n;
        for (int di = 0; di < plan.n_d; di++)
            for (int t = 0; t < n_tests_here; t++) {
                bench_row row = {.attn = label, .depth = plan.d[di]};
                if (t < plan.n_p) row.n_prompt = plan.p[t];
                else row.n_gen = plan.n[t - plan.n_p];
                if (row.n_prompt + row.n_gen == 0) continue;
                if (run_cell(m, &b, o.n_ctx, o.reps, !o.no_warmup, &row)) goto done;
                report(&plan, &o, &info, threads, &row, &cell, n_cells);
            }
        for (int t = 0; o.interleave && t < plan.n_n; t++) {
            if (plan.n[t] == 0) continue;
            bench_row rows[BENCH_MAX_LIST];
            for (int di = 0; di < plan.n_d; di++)
                rows[di] = (bench_row){.attn = label, .depth = plan.d[di], .n_gen = plan.n[t]};
            if (run_interleaved(m, &b, o.n_ctx, o.reps, !o.no_warmup, rows, plan.n_d)) goto done;
            for (int di = 0; di < plan.n_d; di++) report(&plan, &o, &info, threads, &rows[di], &cell, n_cells);
        }
    }
    rc = 0;
done:
    if (header) print_footer(plan.fmt);
    free(b.tokens);
    free(b.logits);
    free(b.secs);
    free(plan.kind_buf);
    still_model_free(m);
    return rc;
}
