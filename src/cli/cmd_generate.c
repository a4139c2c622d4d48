/* `still generate` and `still chat`. */
#include "cli.h"
#include "common/common.h"

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
    size_t n_fed;   /* tokens processed so far (prompts, turns and generated tokens) */
} session;

static int session_open(const cli_opts *o, int default_ctx, session *s) {
    memset(s, 0, sizeof *s);
    const int lrc = cli_load_model(o, &s->m);
    if (lrc) return lrc;
    still_err err = {0};
    still_model_info info = still_model_get_info(s->m);
    s->n_vocab = info.n_vocab;
    still_context_params cp = {.n_ctx = o->n_ctx ? o->n_ctx : default_ctx, .n_batch = o->n_batch, .sel_cache = cli_sel_cache(o), .device = cli_device(o), .matvec = cli_matvec(o), .prefill = cli_prefill(o), .fixed_threads = o->fixed_threads};
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
    s->n_fed += n;
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

/* A growable list of token ids. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} id_list;

static int ids_push(id_list *l, const int32_t *ids, size_t n) {
    if (l->n + n > l->cap) {
        size_t cap = l->cap ? l->cap : 64;
        while (cap < l->n + n) cap *= 2;
        int32_t *v = realloc(l->v, cap * sizeof *v);
        if (!v) {
            fprintf(stderr, "still: error: out of memory\n");
            return -1;
        }
        l->v = v, l->cap = cap;
    }
    if (n) memcpy(l->v + l->n, ids, n * sizeof *ids);
    l->n += n;
    return 0;
}

/* Sample and stream up to n_predict tokens. Returns the number generated, or
 * -1 on error. *ended is 1 when an end-of-generation token was sampled (it is
 * fed to the model so the state includes it), -1 when the context held limit
 * tokens (the last token sampled was printed but not fed: it is in *out too). out:
 * NULL, or receives every token generated (an end-of-generation token only
 * when it was fed; *eog_fed says so). */
static int session_generate(session *s, int n_predict, int limit, int *ended, double *t_gen, id_list *out,
                            int *eog_fed) {
    *ended = 0;
    if (eog_fed) *eog_fed = 0;
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
        const int full = still_context_n_past(s->ctx) >= limit;
        if (still_token_is_eog(s->m, id)) {
            *ended = 1;
            if (!full) {
                if (session_feed(s, &id, 1) || (out && ids_push(out, &id, 1))) return -1;
                if (eog_fed) *eog_fed = 1;
            }
            break;
        }
        cli_print_token(s->m, id);
        fflush(stdout);
        if (out && ids_push(out, &id, 1)) return -1;
        if (full) {
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
    int n_gen = session_generate(&s, o.n_predict, s.n_ctx, &ended, &t_gen, NULL, NULL);
    if (n_gen < 0) goto done;
    if (ended < 0)
        fprintf(stderr, "\nstill: context full (%d tokens): generation stopped (use -c to enlarge it)\n", s.n_ctx);
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

enum { kCloseRoom = 4 };   /* tokens kept free for the end of a turn (<|im_end|> and a newline: 2 here) */

/* A chat's transcript as token ids: the system turn, then every finished
 * exchange (user turn + assistant reply + its end). When the context cannot
 * take the next turn with room for a reply, or fills up during a reply, the
 * context is rebuilt from the system turn and the newest exchanges that fit
 * in half of it (as llama.cpp's context shift keeps its first tokens and
 * drops the oldest others): the model forgets the oldest turns, and the chat
 * goes on. */
typedef struct {
    id_list sys;        /* the system turn (empty: none) */
    id_list *turns;     /* finished exchanges, oldest first */
    int n_turns, first_kept;   /* turns[first_kept ..] are in the context */
} chat_log;

static void chat_log_free(chat_log *c) {
    free(c->sys.v);
    for (int i = 0; i < c->n_turns; i++) free(c->turns[i].v);
    free(c->turns);
}

/* Token ids of the pieces, in order: the template's markers with special tokens parsed, text as data. */
static int tokenize_into(session *s, id_list *l, const char *text, int parse_special) {
    still_err err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    if (still_tokenize(s->m, text, strlen(text), parse_special, &ids, &n, &err)) {
        fprintf(stderr, "still: error: %s\n", err.msg);
        return -1;
    }
    int rc = ids_push(l, ids, n);
    free(ids);
    return rc;
}

/* Empty the context and feed the system turn, the newest finished exchanges whose tokens with `tail` stay within
 * budget, then `tail` (the current turn so far). Reports on stderr what was dropped. */
static int chat_rebuild(session *s, chat_log *c, const id_list *tail, size_t budget) {
    still_err err = {0};
    size_t used = c->sys.n + tail->n;
    int keep = c->n_turns;
    while (keep > 0 && used + c->turns[keep - 1].n <= budget) used += c->turns[--keep].n;
    const int dropped = keep - c->first_kept;
    if (still_context_truncate(s->ctx, 0, &err)) {
        fprintf(stderr, "still: error: %s\n", err.msg);
        return -1;
    }
    if (session_feed(s, c->sys.v, c->sys.n)) return -1;
    for (int i = keep; i < c->n_turns; i++)
        if (session_feed(s, c->turns[i].v, c->turns[i].n)) return -1;
    if (session_feed(s, tail->v, tail->n)) return -1;
    c->first_kept = keep;
    if (dropped > 0)
        fprintf(stderr, "\nstill chat: context full (%d tokens): dropped the oldest %d turn%s, kept %d\n", s->n_ctx, dropped,
            dropped == 1 ? "" : "s", c->n_turns - keep);
    return 0;
}

/* One user turn: append the ChatML text of the turn (never re-processing
 * earlier turns while they fit), then generate the assistant's reply. */
static int chat_turn(session *s, const cli_opts *o, chat_log *c, const char *user, int first) {
    /* A system turn comes first: --system, else the template's default (if any). */
    const char *sys = o->system ? o->system : still_model_default_system(s->m);
    /* The user's (and system) text is data: only the template's own markers
     * are parsed as special tokens. */
    const size_t fed_at_start = s->n_fed;
    const char *what = still_utf8_invalid_at(user, strlen(user)) >= 0 ? "the message"
                       : first && sys && still_utf8_invalid_at(sys, strlen(sys)) >= 0 ? "the system prompt" : NULL;
    if (what) {
        fprintf(stderr, "still chat: error: %s is not valid UTF-8\n", what);
        return -1;
    }
    if (first && sys &&
        (tokenize_into(s, &c->sys, "<|im_start|>system\n", 1) || tokenize_into(s, &c->sys, sys, 0) ||
         tokenize_into(s, &c->sys, "<|im_end|>\n", 1) || session_feed(s, c->sys.v, c->sys.n)))
        return -1;
    id_list turn = {0}, tail_ids = {0};
    int rc = -1;
    if (tokenize_into(s, &turn, "<|im_start|>user\n", 1) || tokenize_into(s, &turn, user, 0) ||
        tokenize_into(s, &turn, "<|im_end|>\n<|im_start|>assistant\n", 1))
        goto out;
    /* the turn, a reply token and the end marker must fit beside the system turn */
    const size_t n_ctx = (size_t)s->n_ctx;
    if (c->sys.n + turn.n + 1 + kCloseRoom > n_ctx) {
        fprintf(stderr, "still chat: error: the message (%zu tokens with its markers) does not fit in the context "
                        "(%zu tokens, %zu of them the system turn): use -c to enlarge it\n", turn.n, n_ctx, c->sys.n);
        goto out;
    }
    /* room for the turn, a reply (up to a quarter of the context: a longer one may slide during the reply) and
     * the end marker */
    size_t room = (size_t)o->n_predict < n_ctx / 4 ? (size_t)o->n_predict : n_ctx / 4;
    if ((size_t)still_context_n_past(s->ctx) + turn.n + room + kCloseRoom > n_ctx) {
        if (chat_rebuild(s, c, &turn, n_ctx / 2 > turn.n + c->sys.n ? n_ctx / 2 : turn.n + c->sys.n)) goto out;
    } else if (session_feed(s, turn.v, turn.n)) {
        goto out;
    }
    const size_t reply_at = turn.n, prompt_fed = s->n_fed - fed_at_start;   /* this turn's prompt processing */
    int ended = 0, n_done = 0, eog_fed = 0, cut = 0;
    double t_gen = 0, t_all = 0;
    for (;;) {
        /* generation stops kCloseRoom tokens short of the end, so that a turn cut there still closes */
        int n = session_generate(s, o->n_predict - n_done, s->n_ctx - kCloseRoom, &ended, &t_gen, &turn, &eog_fed);
        if (n < 0) goto out;
        n_done += n, t_all += t_gen;
        if (ended >= 0 || n_done >= o->n_predict) break;
        /* the context filled during the reply (its last token is not in the context yet): rebuild with this turn
         * and the newest exchanges that fit in half the context, then go on; when the turn alone leaves no room
         * for more and the end marker, the reply ends here */
        if (c->sys.n + turn.n + 1 + kCloseRoom > n_ctx) {
            fprintf(stderr, "\nstill chat: context full (%d tokens): the reply was cut after %zu tokens (use -c to "
                            "enlarge the context)\n", s->n_ctx, turn.n - reply_at);
            cut = 1;
            break;
        }
        if (chat_rebuild(s, c, &turn, n_ctx / 2 > turn.n + c->sys.n ? n_ctx / 2 : turn.n + c->sys.n)) goto out;
    }
    /* Close the assistant turn exactly as the template would: after an end-of-generation token (<|im_end|>) a
     * newline, else the whole end marker (an end-of-generation token sampled when the context was full was not
     * fed: the marker stands for it). */
    const char *tail = eog_fed ? "\n" : "<|im_end|>\n";
    printf("\n");
    fflush(stdout);
    if (tokenize_into(s, &tail_ids, tail, 1)) goto out;
    if (c->sys.n + turn.n + tail_ids.n > n_ctx) {   /* cannot happen: generation stopped kCloseRoom short */
        fprintf(stderr, "still chat: error: the turn does not fit in the context with its end marker\n");
        goto out;
    }
    if (ids_push(&turn, tail_ids.v, tail_ids.n)) goto out;
    if (!cut && (size_t)still_context_n_past(s->ctx) + tail_ids.n <= n_ctx) {
        if (session_feed(s, tail_ids.v, tail_ids.n)) goto out;
    } else if (chat_rebuild(s, c, &turn, n_ctx / 2 > turn.n + c->sys.n ? n_ctx / 2 : turn.n + c->sys.n)) {
        goto out;
    }
    rc = 0;
    id_list *t = realloc(c->turns, sizeof *t * (size_t)(c->n_turns + 1));
    if (!t) {
        fprintf(stderr, "still: error: out of memory\n");
        rc = -1;
        goto out;
    }
    c->turns = t;
    c->turns[c->n_turns++] = turn;
    turn = (id_list){0};
    if (o->verbose)
        fprintf(stderr, "[%d tokens, %.1f t/s, context %d tokens, %zu prompt tokens processed]\n", n_done,
                t_all > 0 ? n_done / t_all : 0.0, still_context_n_past(s->ctx), prompt_fed);
out:
    free(turn.v), free(tail_ids.v);
    return rc;
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
    chat_log log = {0};
    if (o.prompt) {
        if (interactive) printf("> %s\n", o.prompt);
        if (chat_turn(&s, &o, &log, o.prompt, first)) goto done;
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
            int bad = chat_turn(&s, &o, &log, line, first);
            first = 0;
            free(line);
            if (bad) goto done;
        } else {
            free(line);
        }
    }
    rc = 0;
done:
    chat_log_free(&log);
    session_close(&s);
    return rc;
}
