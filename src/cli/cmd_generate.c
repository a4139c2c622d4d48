/* `still generate` and `still chat`. */
#include "cli.h"
#include "../common.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PARSE_OR_RETURN(cmd, name)                        \
    cli_opts o;                                           \
    int prc = cli_parse(cmd, name, argc, argv, &o);       \
    if (prc > 0) return 0;                                \
    if (prc < 0) return 2;

typedef struct {
    still_model *m;
    still_context *ctx;
    still_sampler *smp;
    float *logits;
    int n_vocab, n_ctx;
} session;

static int session_open(const cli_opts *o, int default_ctx, session *s) {
    memset(s, 0, sizeof *s);
    const int lrc = cli_load_model(o, &s->m);
    if (lrc) return lrc;
    still_err err = {0};
    still_model_info info = still_model_get_info(s->m);
    s->n_vocab = info.n_vocab;
    still_context_params cp = {.n_ctx = o->n_ctx ? o->n_ctx : default_ctx, .n_batch = o->n_batch, .sel_cache = cli_sel_cache(o), .device = cli_device(o), .matvec = cli_matvec(o)};
    s->n_ctx = cp.n_ctx;
    if (still_context_create(s->m, cp, &s->ctx, &err) || still_sampler_create(o->sp, info.n_vocab, &s->smp, &err)) {
        fprintf(stderr, "still: error: %s\n", err.msg);
        return -1;
    }
    s->logits = malloc(sizeof(float) * (size_t)info.n_vocab);
    if (!s->logits) {
        fprintf(stderr, "still: error: out of memory\n");
        return -1;
    }
    return 0;
}

static void session_close(session *s) {
    free(s->logits);
    still_sampler_free(s->smp);
    still_context_free(s->ctx);
    still_model_free(s->m);
}

/* Feed tokens; s->logits then holds the last token's logits. */
static int session_feed(session *s, const int32_t *ids, size_t n) {
    still_err err = {0};
    if (n == 0) return 0;
    if (still_decode(s->ctx, ids, (int)n, s->logits, 0, &err)) {
        fprintf(stderr, "\nstill: error: %s\n", err.msg);
        return -1;
    }
    for (size_t i = 0; i < n; i++) still_sampler_accept(s->smp, ids[i]);
    return 0;
}

static int session_feed_text(session *s, const char *text, size_t len, int parse_special) {
    still_err err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    if (still_tokenize(s->m, text, len, parse_special, &ids, &n, &err)) {
        fprintf(stderr, "still: error: %s\n", err.msg);
        return -1;
    }
    int rc = session_feed(s, ids, n);
    free(ids);
    return rc;
}

/* Sample and stream up to n_predict tokens. Returns the number generated, or
 * -1 on error. *ended is 1 when an end-of-generation token was sampled (it is
 * fed to the model so the state includes it), -1 when the context filled up. */
static int session_generate(session *s, int n_predict, int *ended, double *t_gen) {
    *ended = 0;
    double t0 = cli_now();
    int n = 0;
    const int nv = still_model_get_info(s->m).n_vocab;
    while (n < n_predict) {
        for (int j = 0; j < nv; j++)
            if (!isfinite(s->logits[j])) {
                fprintf(stderr, "\nstill: error: the model gave a non-finite logit (token %d, after %d generated "
                                "tokens): a damaged model or adapter file\n", j, n);
                return -1;
            }
        int32_t id = still_sampler_sample(s->smp, s->logits);
        n++;
        const int full = still_context_n_past(s->ctx) >= s->n_ctx;
        if (still_token_is_eog(s->m, id)) {
            *ended = 1;
            if (!full && session_feed(s, &id, 1)) return -1;
            break;
        }
        cli_print_token(s->m, id);
        fflush(stdout);
        if (full) {
            fprintf(stderr, "\nstill: context full (%d tokens): generation stopped (use -c to enlarge it)\n", s->n_ctx);
            *ended = -1;
            break;
        }
        if (session_feed(s, &id, 1)) return -1;
    }
    *t_gen = cli_now() - t0;
    return n;
}

int cmd_generate(int argc, char **argv) {
    PARSE_OR_RETURN(CMD_GENERATE, "generate")
    char *text = NULL;
    size_t len;
    int irc = cli_input_text(&o, "generate", &text, &len);
    if (irc) return irc;
    const long long bad = still_utf8_invalid_at(text, len);
    if (bad >= 0) {
        fprintf(stderr, "still generate: error: the prompt is not valid UTF-8 (first bad byte at offset %lld)\n", bad);
        free(text);
        return 1;
    }
    session s;
    int rc = session_open(&o, 4096, &s);
    if (rc) {
        rc = rc > 0 ? rc : 1;
        goto done;
    }
    rc = 1;
    const char *prompt = text;
    double t0 = cli_now();
    if (session_feed_text(&s, prompt, len, !o.no_special)) goto done;
    double t_prompt = cli_now() - t0;
    int n_prompt = still_context_n_past(s.ctx);
    if (n_prompt == 0) {   /* nothing to continue from (SmolLM2 adds no BOS), as llama.cpp refuses it */
        fprintf(stderr, "still generate: error: the prompt is empty (no tokens)\n");
        goto done;
    }
    if (!o.no_display_prompt) fwrite(prompt, 1, len, stdout);
    fflush(stdout);
    int ended;
    double t_gen = 0;
    int n_gen = session_generate(&s, o.n_predict, &ended, &t_gen);
    if (n_gen < 0) goto done;
    printf("\n");
    fflush(stdout);
    if (o.verbose)
        fprintf(stderr, "prompt: %d tokens in %.3f s (%.1f t/s); generated %d tokens in %.3f s (%.1f t/s); "
                        "peak RSS %.1f MiB; attention state %.2f MiB\n",
                n_prompt, t_prompt, n_prompt / t_prompt, n_gen, t_gen, t_gen > 0 ? n_gen / t_gen : 0.0,
                cli_peak_rss() / 1048576.0, still_context_state_bytes(s.ctx) / 1048576.0);
    rc = 0;
done:
    session_close(&s);
    free(text);
    return rc;
}

/* Read one line from stdin into a malloc'ed buffer (without the newline). */
static char *read_line(void) {
    size_t cap = 256, n = 0;
    char *buf = malloc(cap);
    int ch;
    while (buf && (ch = getchar()) != EOF && ch != '\n') {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) { free(buf); return NULL; }
            buf = nb;
        }
        buf[n++] = (char)ch;
    }
    if (!buf || (n == 0 && ch == EOF)) { free(buf); return NULL; }
    buf[n] = 0;
    return buf;
}

/* One user turn: append the ChatML text of the turn (never re-processing
 * earlier turns), then generate the assistant's reply. */
static int chat_turn(session *s, const cli_opts *o, const char *user, int first) {
    /* A system turn comes first: --system, else the template's default (if any). */
    const char *sys = o->system ? o->system : still_model_default_system(s->m);
    /* The user's (and system) text is data: only the template's own markers
     * are parsed as special tokens. */
    const char *what = still_utf8_invalid_at(user, strlen(user)) >= 0 ? "the message"
                       : first && sys && still_utf8_invalid_at(sys, strlen(sys)) >= 0 ? "the system prompt" : NULL;
    if (what) {
        fprintf(stderr, "still chat: error: %s is not valid UTF-8\n", what);
        return -1;
    }
    int rc = 0;
    if (first && sys)
        rc = session_feed_text(s, "<|im_start|>system\n", 19, 1) || session_feed_text(s, sys, strlen(sys), 0) ||
             session_feed_text(s, "<|im_end|>\n", 11, 1);
    const char *pre = "<|im_start|>user\n", *post = "<|im_end|>\n<|im_start|>assistant\n";
    if (!rc)
        rc = session_feed_text(s, pre, strlen(pre), 1) || session_feed_text(s, user, strlen(user), 0) ||
             session_feed_text(s, post, strlen(post), 1);
    if (rc) return -1;
    int ended;
    double t_gen;
    int n = session_generate(s, o->n_predict, &ended, &t_gen);
    if (n < 0 || ended < 0) return -1;   /* error, or the context is full */
    /* Close the assistant turn exactly as the template would. */
    const char *tail = ended ? "\n" : "<|im_end|>\n";
    printf("\n");
    fflush(stdout);
    if (session_feed_text(s, tail, strlen(tail), 1)) return -1;
    if (o->verbose)
        fprintf(stderr, "[%d tokens, %.1f t/s, context %d tokens]\n", n, t_gen > 0 ? n / t_gen : 0.0,
                still_context_n_past(s->ctx));
    return 0;
}

int cmd_chat(int argc, char **argv) {
    PARSE_OR_RETURN(CMD_CHAT, "chat")
    session s;
    int rc = session_open(&o, 8192, &s);
    if (rc) {
        rc = rc > 0 ? rc : 1;
        goto done;
    }
    rc = 1;
    int interactive = isatty(0);
    int first = 1;
    if (o.prompt) {
        if (interactive) printf("> %s\n", o.prompt);
        if (chat_turn(&s, &o, o.prompt, first)) goto done;
        first = 0;
    }
    for (;;) {
        if (interactive) {
            printf("> ");
            fflush(stdout);
        }
        char *line = read_line();
        if (!line) break;
        if (line[0]) {
            int bad = chat_turn(&s, &o, line, first);
            first = 0;
            free(line);
            if (bad) goto done;
        } else {
            free(line);
        }
    }
    rc = 0;
done:
    session_close(&s);
    return rc;
}
