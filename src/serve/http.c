/* `still server`'s HTTP side (server.h): libmicrohttpd, a thread per
 * connection; routes, the API key, request limits, OpenAI-shaped responses
 * and server-sent events for streams. The engine (engine.h) does the work. */
#include "serve/server.h"
#include "serve/api.h"
#include "serve/engine.h"
#include "serve/text_out.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <errno.h>
#include <time.h>

extern const char serve_chat_page[];
extern const size_t serve_chat_page_len;

typedef struct {
    still_model *m;
    const serve_opts *o;
    serve_engine *eng;
    api_limits lim;
    atomic_ullong next_id;
    atomic_ullong http_by_class[6];   /* responses by status class: 1xx .. 5xx (index 1..5) */
    atomic_ullong unauthorized, refused_busy;
} server;

/* A connection's request body as it arrives. */
typedef struct {
    char *body;
    size_t n, cap;
    int too_big;
    int answered;   /* a response was queued at the headers (401, 413) */
} conn_body;

/* ---- responses ---------------------------------------------------------- */

static enum MHD_Result send_bytes(server *s, struct MHD_Connection *c, unsigned status, const char *type,
                                  const char *data, size_t n) {
    struct MHD_Response *r = MHD_create_response_from_buffer(n, (void *)data, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    if (status == 503) MHD_add_response_header(r, "Retry-After", "1");
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    const enum MHD_Result rc = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    if (status / 100 >= 1 && status / 100 <= 5) atomic_fetch_add(&s->http_by_class[status / 100], 1);
    return rc;
}

static enum MHD_Result send_json(server *s, struct MHD_Connection *c, unsigned status, cJSON *j) {
    char *t = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!t) return MHD_NO;
    const enum MHD_Result rc = send_bytes(s, c, status, "application/json", t, strlen(t));
    free(t);
    return rc;
}

static enum MHD_Result send_error(server *s, struct MHD_Connection *c, const api_error *e) {
    char *t = api_error_json(e);
    if (!t) return MHD_NO;
    const enum MHD_Result rc = send_bytes(s, c, (unsigned)e->status, "application/json", t, strlen(t));
    free(t);
    return rc;
}

static enum MHD_Result fail(server *s, struct MHD_Connection *c, int status, const char *param, const char *msg) {
    api_error e;
    api_fail(&e, status, param, "%s", msg);
    return send_error(s, c, &e);
}

static const char *finish_name(serve_finish f) {
    return f == FINISH_STOP ? "stop" : f == FINISH_LENGTH ? "length" : NULL;
}

static cJSON *usage_json(const serve_req *r) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", r->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", r->n_generated);
    cJSON_AddNumberToObject(u, "total_tokens", r->n_prompt + r->n_generated);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "prompt_tokens_details"), "cached_tokens", r->n_cached);
    return u;
}

/* The frame every completion response and chunk shares. */
static cJSON *frame(server *s, const char *id, const char *object, long created) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", id);
    cJSON_AddStringToObject(j, "object", object);
    cJSON_AddNumberToObject(j, "created", (double)created);
    cJSON_AddStringToObject(j, "model", s->o->model_name);
    return j;
}

/* One choice: chat's message or delta, or a completion's text; finish_reason null when not finished. */
static cJSON *choice(int chat, int delta, const char *text, const char *role, const char *finish) {
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", 0);
    if (chat) {
        cJSON *m = cJSON_AddObjectToObject(ch, delta ? "delta" : "message");
        if (role) cJSON_AddStringToObject(m, "role", role);
        if (text) cJSON_AddStringToObject(m, "content", text);
    } else {
        cJSON_AddStringToObject(ch, "text", text ? text : "");
        cJSON_AddNullToObject(ch, "logprobs");
    }
    if (finish) cJSON_AddStringToObject(ch, "finish_reason", finish);
    else cJSON_AddNullToObject(ch, "finish_reason");
    return ch;
}

/* Bytes as clean text (text_out: invalid UTF-8 and NUL as U+FFFD), malloc'ed and NUL-terminated; NULL when out of
 * memory. */
static char *clean_text(const char *bytes, size_t n) {
    text_out t;
    text_out_init(&t, NULL, 0);
    size_t k = 0, k2 = 0;
    char *out = NULL;
    const char *p = text_out_push(&t, bytes, n, &k);
    char *head = p ? malloc(k + 1) : NULL;
    if (head) memcpy(head, p, k);
    const char *tail = head ? text_out_flush(&t, &k2) : NULL;
    if (tail && (out = malloc(k + k2 + 1))) {
        memcpy(out, head, k), memcpy(out + k, tail, k2);
        out[k + k2] = 0;
    }
    free(head);
    text_out_free(&t);
    return out;
}

/* A token's bytes (all of them, however long). malloc'ed; *n their count. */
static char *token_bytes(const still_model *m, int32_t id, size_t *n) {
    char small[64];
    *n = still_token_to_piece(m, id, small, sizeof small);
    char *b = malloc(*n + 1);
    if (b && *n <= sizeof small) memcpy(b, small, *n);
    else if (b) still_token_to_piece(m, id, b, *n);
    return b;
}

/* A token's text as a JSON string value (clean_text) and, with_bytes, its bytes as an array of numbers. */
static void add_token_text(const still_model *m, cJSON *o, const char *name, int32_t id, int with_bytes) {
    size_t n;
    char *b = token_bytes(m, id, &n);
    char *t = b ? clean_text(b, n) : NULL;
    cJSON_AddStringToObject(o, name, t ? t : "");
    if (with_bytes) {
        cJSON *arr = cJSON_AddArrayToObject(o, "bytes");
        for (size_t i = 0; b && i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber((unsigned char)b[i]));
    }
    free(t), free(b);
}

/* The log-probabilities of a finished request: chat's {"content": [{token, logprob, bytes, top_logprobs}]}, or the
 * completions API's {tokens, token_logprobs, top_logprobs, text_offset}. */
static cJSON *logprobs_json(const still_model *m, const serve_req *r, int chat) {
    cJSON *j = cJSON_CreateObject();
    if (chat) {
        cJSON *content = cJSON_AddArrayToObject(j, "content");
        for (int i = 0; i < r->n_lp; i++) {
            const serve_logprob *lp = &r->lp[i];
            cJSON *t = cJSON_CreateObject(), *top;
            add_token_text(m, t, "token", lp->id, 1);
            cJSON_AddNumberToObject(t, "logprob", lp->logprob);
            top = cJSON_AddArrayToObject(t, "top_logprobs");
            for (int k = 0; k < lp->n_top; k++) {
                cJSON *a = cJSON_CreateObject();
                add_token_text(m, a, "token", lp->top_id[k], 1);
                cJSON_AddNumberToObject(a, "logprob", lp->top_logprob[k]);
                cJSON_AddItemToArray(top, a);
            }
            cJSON_AddItemToArray(content, t);
        }
        return j;
    }
    cJSON *toks = cJSON_AddArrayToObject(j, "tokens"), *lps = cJSON_AddArrayToObject(j, "token_logprobs");
    cJSON *tops = cJSON_AddArrayToObject(j, "top_logprobs"), *offs = cJSON_AddArrayToObject(j, "text_offset");
    size_t off = 0;
    for (int i = 0; i < r->n_lp; i++) {
        const serve_logprob *lp = &r->lp[i];
        cJSON *holder = cJSON_CreateObject();
        add_token_text(m, holder, "t", lp->id, 0);
        const char *t = cJSON_GetObjectItem(holder, "t")->valuestring;
        cJSON_AddItemToArray(toks, cJSON_CreateString(t));
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
        off += strlen(t);
        cJSON_Delete(holder);
        cJSON_AddItemToArray(lps, cJSON_CreateNumber(lp->logprob));
        cJSON *top = cJSON_CreateObject();
        for (int k = 0; k < lp->n_top; k++) {
            cJSON *h = cJSON_CreateObject();
            add_token_text(m, h, "t", lp->top_id[k], 0);
            const char *tt = cJSON_GetObjectItem(h, "t")->valuestring;
            if (!cJSON_GetObjectItemCaseSensitive(top, tt)) cJSON_AddNumberToObject(top, tt, lp->top_logprob[k]);
            cJSON_Delete(h);
        }
        cJSON_AddItemToArray(tops, top);
    }
    return j;
}

/* ---- streams (server-sent events) --------------------------------------- */

typedef struct {
    server *s;
    serve_req *r;
    int chat, include_usage;
    char id[48];
    long created;
    size_t sent;            /* text bytes of r already in events */
    char *buf;              /* event bytes ready to go */
    size_t n, off, cap;
    int role_sent, ended;
} stream;

static int stream_put(stream *st, const char *data, size_t n) {
    if (st->n + n > st->cap) {
        size_t cap = st->cap ? st->cap : 1024;
        while (cap < st->n + n) cap *= 2;
        char *b = realloc(st->buf, cap);
        if (!b) return -1;
        st->buf = b, st->cap = cap;
    }
    memcpy(st->buf + st->n, data, n);
    st->n += n;
    return 0;
}

static int stream_event(stream *st, cJSON *j) {
    char *t = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!t) return -1;
    const int rc = stream_put(st, "data: ", 6) || stream_put(st, t, strlen(t)) || stream_put(st, "\n\n", 2);
    free(t);
    return rc;
}

static cJSON *chunk(stream *st, const char *text, const char *role, const char *finish) {
    cJSON *j = frame(st->s, st->id, st->chat ? "chat.completion.chunk" : "text_completion", st->created);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(j, "choices"), choice(st->chat, 1, text, role, finish));
    return j;
}

/* Wait for more of the request's text (a second at most: then a comment line, so that a client gone away is
 * noticed even while the request waits for a slot) and turn it into events. */
static int stream_refill(stream *st) {
    serve_req *r = st->r;
    st->n = st->off = 0;
    if (st->chat && !st->role_sent) {
        st->role_sent = 1;
        return stream_event(st, chunk(st, "", "assistant", NULL));
    }
    pthread_mutex_lock(&r->mu);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    while (r->n_text == st->sent && !r->done)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &until)) break;
    char *text = NULL;
    if (r->n_text > st->sent) {
        text = strndup(r->text + st->sent, r->n_text - st->sent);
        st->sent = r->n_text;
    }
    const int done = r->done && st->sent == r->n_text;
    const serve_finish finish = r->finish;
    char error[256];
    snprintf(error, sizeof error, "%s", r->error);
    cJSON *usage = done && st->include_usage ? usage_json(r) : NULL;
    pthread_mutex_unlock(&r->mu);
    int rc = 0;
    if (text) rc = stream_event(st, chunk(st, text, NULL, NULL));
    free(text);
    if (!rc && done) {
        if (finish_name(finish)) {
            rc = stream_event(st, chunk(st, NULL, NULL, finish_name(finish)));
        } else {
            api_error e;
            api_fail(&e, finish == FINISH_CANCELLED ? 503 : 500, NULL, "%s",
                     finish == FINISH_CANCELLED ? "the request was cancelled: the server is shutting down" : error);
            char *t = api_error_json(&e);
            rc = !t || stream_put(st, "data: ", 6) || stream_put(st, t, strlen(t)) || stream_put(st, "\n\n", 2);
            free(t);
        }
        if (!rc && usage) {
            cJSON *j = frame(st->s, st->id, st->chat ? "chat.completion.chunk" : "text_completion", st->created);
            cJSON_AddArrayToObject(j, "choices");
            cJSON_AddItemToObject(j, "usage", usage);
            usage = NULL;
            rc = stream_event(st, j);
        }
        if (!rc) rc = stream_put(st, "data: [DONE]\n\n", 14);
        st->ended = 1;
    }
    cJSON_Delete(usage);
    if (!rc && st->n == 0) rc = stream_put(st, ":\n\n", 3);   /* keep-alive comment */
    return rc;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream *st = cls;
    if (st->off == st->n) {
        if (st->ended) return MHD_CONTENT_READER_END_OF_STREAM;
        if (stream_refill(st)) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t k = st->n - st->off;
    if (k > max) k = max;
    memcpy(buf, st->buf + st->off, k);
    st->off += k;
    return (ssize_t)k;
}

/* The response is over (sent, or the client went away): a request still running is cancelled. */
static void stream_free(void *cls) {
    stream *st = cls;
    pthread_mutex_lock(&st->r->mu);
    if (!st->r->done) st->r->cancelled = 1;
    pthread_mutex_unlock(&st->r->mu);
    serve_req_release(st->r);
    free(st->buf);
    free(st);
}

/* ---- the routes --------------------------------------------------------- */

static enum MHD_Result do_completion(server *s, struct MHD_Connection *c, const conn_body *b, int chat) {
    api_completion ac;
    api_error e;
    if (api_parse_completion(s->m, b->body ? b->body : "", b->n, chat, &s->lim, &ac, &e)) return send_error(s, c, &e);
    serve_req *r = serve_req_new();
    if (!r) {
        api_completion_free(&ac);
        return fail(s, c, 500, NULL, "out of memory");
    }
    const int stream_it = ac.stream, include_usage = ac.include_usage;
    api_completion_into_req(&ac, r);
    char id[48];
    snprintf(id, sizeof id, "%s-%llx", chat ? "chatcmpl" : "cmpl", (unsigned long long)atomic_fetch_add(&s->next_id, 1));
    const long created = (long)time(NULL);
    still_err err = {0};
    if (serve_engine_submit(s->eng, r, &err)) {
        serve_req_release(r);
        if (err.code == STILL_E_STATE) atomic_fetch_add(&s->refused_busy, 1);
        return fail(s, c, err.code == STILL_E_STATE ? 503 : 400, err.code == STILL_E_STATE ? NULL : "prompt", err.msg);
    }
    if (stream_it) {
        stream *st = calloc(1, sizeof *st);
        if (!st) {
            pthread_mutex_lock(&r->mu);
            r->cancelled = 1;
            pthread_mutex_unlock(&r->mu);
            serve_req_release(r);
            return fail(s, c, 500, NULL, "out of memory");
        }
        st->s = s, st->r = r, st->chat = chat, st->include_usage = include_usage, st->created = created;
        snprintf(st->id, sizeof st->id, "%s", id);
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, st,
                                                                      stream_free);
        if (!resp) {
            stream_free(st);
            return MHD_NO;
        }
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        const enum MHD_Result rc = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        atomic_fetch_add(&s->http_by_class[2], 1);
        return rc;
    }
    /* wait for the end, looking every second whether the client is still there: one that went away frees its slot */
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    pthread_mutex_lock(&r->mu);
    while (!r->done) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 1;
        if (pthread_cond_timedwait(&r->cv, &r->mu, &until) && !r->done && ci) {
            char byte;
            const ssize_t k = recv(ci->connect_fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) r->cancelled = 1;
        }
    }
    pthread_mutex_unlock(&r->mu);
    enum MHD_Result rc;
    if (finish_name(r->finish)) {
        cJSON *j = frame(s, id, chat ? "chat.completion" : "text_completion", created);
        cJSON *ch = choice(chat, 0, r->text ? r->text : "", chat ? "assistant" : NULL, finish_name(r->finish));
        if (!r->logprobs && chat) cJSON_AddNullToObject(ch, "logprobs");
        else if (chat) cJSON_AddItemToObject(ch, "logprobs", logprobs_json(s->m, r, chat));
        else if (r->logprobs) cJSON_ReplaceItemInObject(ch, "logprobs", logprobs_json(s->m, r, chat));
        cJSON_AddItemToArray(cJSON_AddArrayToObject(j, "choices"), ch);
        cJSON_AddItemToObject(j, "usage", usage_json(r));
        rc = send_json(s, c, 200, j);
    } else if (r->finish == FINISH_CANCELLED) {
        rc = fail(s, c, 503, NULL, "the request was cancelled: the server is shutting down");
    } else {
        rc = fail(s, c, 500, NULL, r->error[0] ? r->error : "generation failed");
    }
    serve_req_release(r);
    return rc;
}

static enum MHD_Result do_models(server *s, struct MHD_Connection *c) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "object", "list");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", s->o->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "still");
    cJSON *meta = cJSON_AddObjectToObject(m, "meta");
    const still_model_info info = still_model_get_info(s->m);
    cJSON_AddStringToObject(meta, "plan", s->o->plan ? s->o->plan : "");
    cJSON_AddNumberToObject(meta, "n_layer", info.n_layer);
    cJSON_AddNumberToObject(meta, "n_vocab", info.n_vocab);
    cJSON_AddNumberToObject(meta, "n_ctx_slot", s->o->n_ctx);
    cJSON_AddNumberToObject(meta, "slots", s->o->n_slots);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(j, "data"), m);
    return send_json(s, c, 200, j);
}

static enum MHD_Result do_metrics(server *s, struct MHD_Connection *c) {
    serve_stats st;
    serve_engine_stats(s->eng, &st);
    char t[4096];
    int n = snprintf(t, sizeof t,
        "# HELP still_requests_total Completion requests ended, by how.\n# TYPE still_requests_total counter\n"
        "still_requests_total{result=\"done\"} %llu\nstill_requests_total{result=\"cancelled\"} %llu\n"
        "still_requests_total{result=\"failed\"} %llu\n"
        "# HELP still_requests_refused_total Requests refused because the queue was full.\n"
        "# TYPE still_requests_refused_total counter\nstill_requests_refused_total %llu\n"
        "# HELP still_prompt_tokens_total Prompt tokens of the requests started.\n"
        "# TYPE still_prompt_tokens_total counter\nstill_prompt_tokens_total %llu\n"
        "# HELP still_prompt_tokens_cached_total Prompt tokens a slot's state held already (prefix cache hits).\n"
        "# TYPE still_prompt_tokens_cached_total counter\nstill_prompt_tokens_cached_total %llu\n"
        "# HELP still_tokens_generated_total Tokens generated.\n"
        "# TYPE still_tokens_generated_total counter\nstill_tokens_generated_total %llu\n"
        "# HELP still_prompt_seconds_total Time spent processing prompts.\n"
        "# TYPE still_prompt_seconds_total counter\nstill_prompt_seconds_total %.6f\n"
        "# HELP still_generate_seconds_total Time spent generating.\n"
        "# TYPE still_generate_seconds_total counter\nstill_generate_seconds_total %.6f\n"
        "# HELP still_slots Slots (sequences in flight at most).\n# TYPE still_slots gauge\nstill_slots %d\n"
        "# HELP still_slots_busy Slots running a request.\n# TYPE still_slots_busy gauge\nstill_slots_busy %d\n"
        "# HELP still_queue_length Requests waiting for a slot.\n# TYPE still_queue_length gauge\n"
        "still_queue_length %d\n"
        "# HELP still_queue_limit Requests that may wait.\n# TYPE still_queue_limit gauge\nstill_queue_limit %d\n"
        "# HELP still_snapshots Conversation states kept in memory.\n# TYPE still_snapshots gauge\n"
        "still_snapshots %d\n"
        "# HELP still_snapshot_bytes Their size.\n# TYPE still_snapshot_bytes gauge\nstill_snapshot_bytes %zu\n"
        "# HELP still_snapshot_hits_total Requests that started from a kept state.\n"
        "# TYPE still_snapshot_hits_total counter\nstill_snapshot_hits_total %llu\n"
        "# HELP still_snapshots_evicted_total States dropped for the memory limit.\n"
        "# TYPE still_snapshots_evicted_total counter\nstill_snapshots_evicted_total %llu\n"
        "# HELP still_batched_steps_total Decode steps run as one forward for several slots.\n"
        "# TYPE still_batched_steps_total counter\nstill_batched_steps_total %llu\n"
        "# HELP still_batched_tokens_total Tokens generated in those steps.\n"
        "# TYPE still_batched_tokens_total counter\nstill_batched_tokens_total %llu\n"
        "# HELP still_http_responses_total HTTP responses by status class.\n"
        "# TYPE still_http_responses_total counter\n",
        st.requests_done, st.requests_cancelled, st.requests_failed, (unsigned long long)atomic_load(&s->refused_busy),
        st.prompt_tokens, st.prompt_tokens_cached, st.generated_tokens, st.prompt_seconds, st.generate_seconds,
        st.n_slots, st.slots_busy, st.queued, st.queue_max, st.snapshots, st.snapshot_bytes, st.snapshot_hits,
        st.snapshots_evicted, st.batched_steps, st.batched_tokens);
    for (int k = 1; k <= 5 && n > 0 && (size_t)n < sizeof t; k++)
        n += snprintf(t + n, sizeof t - (size_t)n, "still_http_responses_total{class=\"%dxx\"} %llu\n", k,
                      (unsigned long long)atomic_load(&s->http_by_class[k]));
    if (n < 0 || (size_t)n >= sizeof t) return fail(s, c, 500, NULL, "metrics too long");
    return send_bytes(s, c, 200, "text/plain; version=0.0.4", t, (size_t)n);
}

static enum MHD_Result do_tokenize(server *s, struct MHD_Connection *c, const conn_body *b) {
    cJSON *root;
    api_error e;
    if (api_parse_object(b->body ? b->body : "", b->n, &root, &e)) return send_error(s, c, &e);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(root, "content");
    const cJSON *special = cJSON_GetObjectItemCaseSensitive(root, "parse_special");
    if (!cJSON_IsString(content) || (special && !cJSON_IsBool(special))) {
        cJSON_Delete(root);
        return fail(s, c, 400, cJSON_IsString(content) ? "parse_special" : "content",
                    cJSON_IsString(content) ? "'parse_special' must be true or false" : "'content' must be a string");
    }
    int32_t *ids = NULL;
    size_t n = 0;
    still_err err = {0};
    const int rc = still_tokenize(s->m, content->valuestring, strlen(content->valuestring),
                                  special ? cJSON_IsTrue(special) : 1, &ids, &n, &err);
    cJSON_Delete(root);
    if (rc) return fail(s, c, 400, "content", err.msg);
    cJSON *j = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(j, "tokens");
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
    free(ids);
    return send_json(s, c, 200, j);
}

static enum MHD_Result do_detokenize(server *s, struct MHD_Connection *c, const conn_body *b) {
    cJSON *root;
    api_error e;
    if (api_parse_object(b->body ? b->body : "", b->n, &root, &e)) return send_error(s, c, &e);
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(root, "tokens"), *t;
    const int nv = still_model_get_info(s->m).n_vocab;
    if (!cJSON_IsArray(toks)) {
        cJSON_Delete(root);
        return fail(s, c, 400, "tokens", "'tokens' must be an array of token ids");
    }
    char *text = NULL;
    size_t n = 0, cap = 0;
    cJSON_ArrayForEach(t, toks) {
        if (!cJSON_IsNumber(t) || t->valuedouble < 0 || t->valuedouble >= nv ||
            t->valuedouble != (double)(int)t->valuedouble) {
            free(text);
            cJSON_Delete(root);
            char msg[96];
            snprintf(msg, sizeof msg, "'tokens' must hold integers from 0 to %d", nv - 1);
            return fail(s, c, 400, "tokens", msg);
        }
        size_t k;
        char *piece = token_bytes(s->m, (int32_t)t->valuedouble, &k);
        if (piece && n + k + 1 > cap) {
            cap = (n + k + 1) * 2;
            char *nt = realloc(text, cap);
            if (!nt) free(piece), piece = NULL;
            else text = nt;
        }
        if (!piece) {
            free(text);
            cJSON_Delete(root);
            return fail(s, c, 500, NULL, "out of memory");
        }
        memcpy(text + n, piece, k);
        n += k;
        free(piece);
    }
    cJSON_Delete(root);
    char *joined = clean_text(text ? text : "", n);
    free(text);
    cJSON *j = NULL;
    if (joined) {
        j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "content", joined);
        free(joined);
    }
    return j ? send_json(s, c, 200, j) : fail(s, c, 500, NULL, "out of memory");
}

/* POST /slots/ID?action=save|restore|erase, {"filename": NAME} (save, restore): NAME a plain file name in the
 * state directory. */
static enum MHD_Result do_slot(server *s, struct MHD_Connection *c, const char *url, const conn_body *b) {
    char *end;
    const long id = strtol(url + 7, &end, 10);
    if (end == url + 7 || *end || id < 0 || id > 1 << 20) return fail(s, c, 404, NULL, "no such slot");
    const char *action = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "action");
    serve_slot_action a;
    if (action && !strcmp(action, "save")) a = SLOT_SAVE;
    else if (action && !strcmp(action, "restore")) a = SLOT_RESTORE;
    else if (action && !strcmp(action, "erase")) a = SLOT_ERASE;
    else return fail(s, c, 400, "action", "'action' must be save, restore or erase");
    char name[160] = "";
    if (a != SLOT_ERASE) {
        cJSON *root;
        api_error e;
        if (api_parse_object(b->body ? b->body : "", b->n, &root, &e)) return send_error(s, c, &e);
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(root, "filename");
        int ok = cJSON_IsString(fn) && fn->valuestring[0] && fn->valuestring[0] != '.' && strlen(fn->valuestring) < 128;
        for (const char *p = ok ? fn->valuestring : ""; *p && ok; p++)
            ok = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '.' ||
                 *p == '_' || *p == '-';
        if (ok) snprintf(name, sizeof name, "%s", fn->valuestring);
        cJSON_Delete(root);
        if (!ok)
            return fail(s, c, 400, "filename", "'filename' must be a plain file name (letters, digits, '.', '_', '-'; "
                        "not starting with '.'; under 128 bytes)");
    }
    char msg[256];
    int n_tokens = 0;
    const int status = serve_engine_slot_action(s->eng, (int)id, a, name, &n_tokens, msg, sizeof msg);
    static const char *const verb[] = {"save", "restore", "erase"};
    if (status) fprintf(stderr, "still server: slot %ld %s%s%s refused: %s\n", id, verb[a], name[0] ? " " : "", name, msg);
    else fprintf(stderr, "still server: slot %ld %s%s%s: %d tokens\n", id, verb[a], name[0] ? " " : "", name, n_tokens);
    if (status) return fail(s, c, status, status == 400 && !strstr(msg, "state directory") ? "filename" : NULL, msg);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "id_slot", (double)id);
    if (a != SLOT_ERASE) cJSON_AddStringToObject(j, "filename", name);
    cJSON_AddNumberToObject(j, a == SLOT_SAVE ? "n_saved" : a == SLOT_RESTORE ? "n_restored" : "n_erased", n_tokens);
    return send_json(s, c, 200, j);
}

/* Equal in constant time for a given length of the key. */
static int key_matches(const char *given, const char *key) {
    const size_t a = strlen(given), b = strlen(key);
    unsigned char diff = (unsigned char)(a != b);
    for (size_t i = 0; i < b; i++) diff |= (unsigned char)(key[i] ^ (i < a ? given[i] : 0));
    return diff == 0;
}

static int authorized(server *s, struct MHD_Connection *c) {
    if (!s->o->api_key) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncmp(h, "Bearer ", 7)) return 0;
    return key_matches(h + 7, s->o->api_key);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    server *s = cls;
    conn_body *b = *con_cls;
    if (!b) {   /* the headers: the key and the body's announced size are checked before any body is read */
        if (!(b = calloc(1, sizeof *b))) return MHD_NO;
        *con_cls = b;
        if (strcmp(url, "/") && strcmp(url, "/health") && !authorized(s, c)) {
            atomic_fetch_add(&s->unauthorized, 1);
            b->answered = 1;
            return fail(s, c, 401, NULL, "a valid API key is required (Authorization: Bearer KEY)");
        }
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > s->o->max_body) {
            char msg[96];
            snprintf(msg, sizeof msg, "the request body is larger than %zu bytes", s->o->max_body);
            b->answered = 1;
            return fail(s, c, 413, NULL, msg);
        }
        return MHD_YES;
    }
    if (b->answered) {   /* answered at the headers: the rest of the body is not read */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {   /* a piece of the body */
        if (!b->too_big && b->n + *upload_size > s->o->max_body) b->too_big = 1;
        if (!b->too_big) {
            if (b->n + *upload_size + 1 > b->cap) {
                size_t cap = b->cap ? b->cap : 4096;
                while (cap < b->n + *upload_size + 1) cap *= 2;
                char *nb = realloc(b->body, cap);
                if (!nb) return MHD_NO;
                b->body = nb, b->cap = cap;
            }
            memcpy(b->body + b->n, upload, *upload_size);
            b->n += *upload_size;
            b->body[b->n] = 0;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    const int get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/")) {
        if (!get) return fail(s, c, 405, NULL, "use GET for /");
        return send_bytes(s, c, 200, "text/html; charset=utf-8", serve_chat_page, serve_chat_page_len);
    }
    if (!strcmp(url, "/health")) return send_bytes(s, c, 200, "application/json", "{\"status\":\"ok\"}", 15);
    if (!authorized(s, c)) {
        atomic_fetch_add(&s->unauthorized, 1);
        return fail(s, c, 401, NULL, "a valid API key is required (Authorization: Bearer KEY)");
    }
    if (b->too_big) {
        char msg[96];
        snprintf(msg, sizeof msg, "the request body is larger than %zu bytes", s->o->max_body);
        return fail(s, c, 413, NULL, msg);
    }
    static const struct { const char *path; int post; } routes[] = {
        {"/v1/chat/completions", 1}, {"/chat/completions", 1}, {"/v1/completions", 1}, {"/completions", 1},
        {"/v1/models", 0}, {"/models", 0}, {"/metrics", 0}, {"/tokenize", 1}, {"/detokenize", 1},
    };
    int route = -1;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(url, routes[i].path)) route = (int)i;
    if (route < 0 && !strncmp(url, "/slots/", 7)) {
        if (!post) return fail(s, c, 405, NULL, "use POST for /slots/ID?action=...");
        return do_slot(s, c, url, b);
    }
    if (route < 0) return fail(s, c, 404, NULL, "no such endpoint");
    if (routes[route].post ? !post : !get) {
        char msg[96];
        snprintf(msg, sizeof msg, "use %s for %s", routes[route].post ? "POST" : "GET", url);
        return fail(s, c, 405, NULL, msg);
    }
    switch (route) {
    case 0: case 1: return do_completion(s, c, b, 1);
    case 2: case 3: return do_completion(s, c, b, 0);
    case 4: case 5: return do_models(s, c);
    case 6: return do_metrics(s, c);
    case 7: return do_tokenize(s, c, b);
    default: return do_detokenize(s, c, b);
    }
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode why) {
    (void)cls, (void)c, (void)why;
    conn_body *b = *con_cls;
    if (b) free(b->body), free(b);
    *con_cls = NULL;
}

int serve_run(still_model *m, const serve_opts *o) {
    server s = {.m = m, .o = o};
    s.lim = (api_limits){.max_tokens_default = o->max_tokens_default, .max_tokens_limit = o->n_ctx, .n_ctx = o->n_ctx};
    struct sockaddr_in a4 = {0};
    struct sockaddr_in6 a6 = {0};
    struct sockaddr *addr;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD;
    if (inet_pton(AF_INET, o->host, &a4.sin_addr) == 1) {
        a4.sin_family = AF_INET, a4.sin_port = htons((uint16_t)o->port);
        addr = (struct sockaddr *)&a4;
    } else if (inet_pton(AF_INET6, o->host, &a6.sin6_addr) == 1) {
        a6.sin6_family = AF_INET6, a6.sin6_port = htons((uint16_t)o->port);
        addr = (struct sockaddr *)&a6;
        flags |= MHD_USE_IPv6;
    } else {
        fprintf(stderr, "still server: error: --host '%s' is not an IPv4 or IPv6 address\n", o->host);
        return 1;
    }
    /* SIGINT and SIGTERM are taken by sigwait below: every thread started from here on (the engine's, OpenMP's,
     * the HTTP ones) inherits the mask */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT), sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    still_err err = {0};
    serve_engine_params ep = {.n_slots = o->n_slots, .n_ctx = o->n_ctx, .n_batch = o->n_batch,
                              .queue_max = o->queue_max, .device = o->device,
                              .matvec = o->matvec, .cache_bytes = o->cache_bytes, .state_dir = o->state_dir,
                              .threads = o->omp_threads, .fixed_threads = o->fixed_threads};
    if (serve_engine_start(m, &ep, &s.eng, &err)) {
        fprintf(stderr, "still server: error: %s\n", err.msg);
        return 1;
    }
    struct MHD_Daemon *d = MHD_start_daemon(flags, (uint16_t)o->port, NULL, NULL, on_request, &s,
                                            MHD_OPTION_SOCK_ADDR, addr, MHD_OPTION_CONNECTION_LIMIT,
                                            (unsigned)o->threads, MHD_OPTION_CONNECTION_TIMEOUT, 600u,
                                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, NULL, MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "still server: error: cannot listen on %s port %d (in use, or not an address of this "
                        "machine)\n", o->host, o->port);
        serve_engine_free(s.eng);
        return 1;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    const int port = di ? di->port : o->port;
    fprintf(stderr, "still server: listening on http://%s%s%s:%d (%d slot%s of %d tokens; plan %s)\n",
            addr->sa_family == AF_INET6 ? "[" : "", o->host, addr->sa_family == AF_INET6 ? "]" : "", port, o->n_slots,
            o->n_slots == 1 ? "" : "s", o->n_ctx, o->plan ? o->plan : "?");
    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "still server: %s: stopping (running requests are cancelled)\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    MHD_quiesce_daemon(d);      /* no new connections */
    serve_engine_stop(s.eng);   /* every request ends; streams send their last event */
    MHD_stop_daemon(d);         /* the connections' threads finish */
    serve_engine_free(s.eng);
    fprintf(stderr, "still server: stopped\n");
    return 0;
}
