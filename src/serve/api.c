/* OpenAI-shaped requests (api.h). */
#include "serve/api.h"
#include "serve/text_out.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void api_fail(api_error *e, int status, const char *param, const char *fmt, ...) {
    e->status = status;
    e->type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error"
              : status == 503 ? "server_busy" : status >= 500 ? "server_error" : "invalid_request_error";
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
}

char *api_error_json(const api_error *e) {
    cJSON *root = cJSON_CreateObject(), *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", e->msg);
    cJSON_AddStringToObject(err, "type", e->type ? e->type : "invalid_request_error");
    if (e->param[0]) cJSON_AddStringToObject(err, "param", e->param);
    else cJSON_AddNullToObject(err, "param");
    cJSON_AddNullToObject(err, "code");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

int api_parse_object(const char *body, size_t n, cJSON **out, api_error *e) {
    *out = NULL;
    if (!utf8_valid(body, n)) {
        api_fail(e, 400, NULL, "the request body is not valid UTF-8");
        return -1;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, n, &end, 0);
    if (!root) {
        api_fail(e, 400, NULL, "the request body is not valid JSON (near byte %ld)",
                 end ? (long)(end - body) : 0L);
        return -1;
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        api_fail(e, 400, NULL, "the request body must be a JSON object");
        return -1;
    }
    *out = root;
    return 0;
}

/* An optional number field in [lo, hi] (null counts as absent); integral when asked. 1: given, 0: absent, -1: bad. */
static int number_field(const cJSON *o, const char *name, double lo, double hi, int integral, double *v, api_error *e) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!f || cJSON_IsNull(f)) return 0;
    if (!cJSON_IsNumber(f)) {
        api_fail(e, 400, name, "'%s' must be a number", name);
        return -1;
    }
    const double x = f->valuedouble;
    if (!isfinite(x) || x < lo || x > hi || (integral && x != floor(x))) {
        api_fail(e, 400, name, "'%s' must be %s between %g and %g", name, integral ? "an integer" : "a number", lo, hi);
        return -1;
    }
    *v = x;
    return 1;
}

static int bool_field(const cJSON *o, const char *name, int *v, api_error *e) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!f || cJSON_IsNull(f)) return 0;
    if (!cJSON_IsBool(f)) {
        api_fail(e, 400, name, "'%s' must be true or false", name);
        return -1;
    }
    *v = cJSON_IsTrue(f);
    return 1;
}

/* Token ids appended to a growing list. */
typedef struct {
    int32_t *v;
    int n, cap;
} ids;

static int ids_add_text(const still_model *m, ids *l, const char *text, int parse_special, api_error *e) {
    still_err err = {0};
    int32_t *t = NULL;
    size_t k = 0;
    if (still_tokenize(m, text, strlen(text), parse_special, &t, &k, &err)) {
        api_fail(e, 400, NULL, "cannot tokenize the prompt: %s", err.msg);
        return -1;
    }
    if ((size_t)l->n + k > (size_t)l->cap) {
        size_t cap = l->cap ? (size_t)l->cap : 256;
        while (cap < (size_t)l->n + k) cap *= 2;
        int32_t *v = cap <= (size_t)1 << 30 ? realloc(l->v, cap * sizeof *v) : NULL;
        if (!v) {
            free(t);
            api_fail(e, 500, NULL, "out of memory");
            return -1;
        }
        l->v = v, l->cap = (int)cap;
    }
    if (k) memcpy(l->v + l->n, t, k * sizeof *t);
    l->n += (int)k;
    free(t);
    return 0;
}

/* A message's content: a string, or an array of {"type": "text", "text": ...} parts (joined). malloc'ed. */
static char *message_content(const cJSON *msg, int i, api_error *e) {
    char param[64];
    snprintf(param, sizeof param, "messages[%d].content", i);
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(msg, "content");
    if (cJSON_IsString(c)) return strdup(c->valuestring);
    if (cJSON_IsArray(c)) {
        size_t n = 0;
        const cJSON *part;
        cJSON_ArrayForEach(part, c) {
            const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
            const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
            if (!cJSON_IsObject(part) || !cJSON_IsString(type) || strcmp(type->valuestring, "text") ||
                !cJSON_IsString(text)) {
                api_fail(e, 400, param, "'%s' parts must be {\"type\": \"text\", \"text\": STRING} (no other part "
                         "types are supported)", param);
                return NULL;
            }
            n += strlen(text->valuestring);
        }
        char *s = malloc(n + 1);
        if (!s) return api_fail(e, 500, NULL, "out of memory"), NULL;
        size_t o = 0;
        cJSON_ArrayForEach(part, c) {
            const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
            memcpy(s + o, t, strlen(t));
            o += strlen(t);
        }
        s[o] = 0;
        return s;
    }
    api_fail(e, 400, param, "'%s' must be a string or an array of text parts", param);
    return NULL;
}

/* The chat's ChatML prompt: every message as <|im_start|>ROLE\nCONTENT<|im_end|>\n (the markers parsed as special
 * tokens, the contents as plain text, each piece on its own, as still chat does, so that a conversation's turns
 * tokenize the same way every time and the prefix cache finds them), the model's default system turn first when
 * the messages bring none, then the assistant's turn opened. */
static int chat_prompt(const still_model *m, const cJSON *msgs, ids *out, api_error *e) {
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0) {
        api_fail(e, 400, "messages", "'messages' must be a non-empty array");
        return -1;
    }
    const cJSON *first_role = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(msgs, 0), "role");
    const char *sys = still_model_default_system(m);
    if (sys && !(cJSON_IsString(first_role) && !strcmp(first_role->valuestring, "system")) &&
        (ids_add_text(m, out, "<|im_start|>system\n", 1, e) || ids_add_text(m, out, sys, 0, e) ||
         ids_add_text(m, out, "<|im_end|>\n", 1, e)))
        return -1;
    int i = 0;
    const cJSON *msg;
    cJSON_ArrayForEach(msg, msgs) {
        char param[64];
        snprintf(param, sizeof param, "messages[%d].role", i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(msg, "role");
        if (!cJSON_IsObject(msg)) {
            snprintf(param, sizeof param, "messages[%d]", i);
            api_fail(e, 400, param, "'%s' must be an object with 'role' and 'content'", param);
            return -1;
        }
        if (!cJSON_IsString(role) || (strcmp(role->valuestring, "system") && strcmp(role->valuestring, "user") &&
                                      strcmp(role->valuestring, "assistant"))) {
            api_fail(e, 400, param, "'%s' must be \"system\", \"user\" or \"assistant\"", param);
            return -1;
        }
        char *content = message_content(msg, i, e);
        if (!content) return -1;
        char head[64];
        snprintf(head, sizeof head, "<|im_start|>%s\n", role->valuestring);
        const int rc = ids_add_text(m, out, head, 1, e) || ids_add_text(m, out, content, 0, e) ||
                       ids_add_text(m, out, "<|im_end|>\n", 1, e);
        free(content);
        if (rc) return -1;
        i++;
    }
    return ids_add_text(m, out, "<|im_start|>assistant\n", 1, e);
}

/* /v1/completions' prompt: a string (special tokens parsed, as llama-server does), an array of one string, or an
 * array of token ids. */
static int completion_prompt(const still_model *m, const cJSON *p, ids *out, api_error *e) {
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0)))
        p = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsString(p)) return ids_add_text(m, out, p->valuestring, 1, e);
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) > 0) {
        const int nv = still_model_get_info(m).n_vocab, n = cJSON_GetArraySize(p);
        out->v = malloc(sizeof *out->v * (size_t)n);
        if (!out->v) return api_fail(e, 500, NULL, "out of memory"), -1;
        const cJSON *t;
        cJSON_ArrayForEach(t, p) {
            if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
                t->valuedouble >= nv) {
                api_fail(e, 400, "prompt", "'prompt' as an array must hold token ids (integers from 0 to %d) or "
                         "one string", nv - 1);
                return -1;
            }
            out->v[out->n++] = (int32_t)t->valuedouble;
        }
        out->cap = n;
        return 0;
    }
    api_fail(e, 400, "prompt", "'prompt' must be a string, an array of one string, or an array of token ids");
    return -1;
}

int api_parse_completion(const still_model *m, const char *body, size_t n, int chat, const api_limits *lim,
                         api_completion *out, api_error *e) {
    memset(out, 0, sizeof *out);
    out->chat = chat;
    out->sp = still_sampler_default_params();
    cJSON *root;
    if (api_parse_object(body, n, &root, e)) return -1;
    int rc = -1;
    double v;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (model && !cJSON_IsNull(model) && !cJSON_IsString(model)) {
        api_fail(e, 400, "model", "'model' must be a string");
        goto out;
    }
    int k;
    if ((k = number_field(root, "n", 1, 1, 1, &v, e)) < 0) {
        api_fail(e, 400, "n", "'n' must be 1 (one choice per request)");
        goto out;
    }
    out->max_tokens = lim->max_tokens_default;
    const char *mt_name = chat && cJSON_GetObjectItemCaseSensitive(root, "max_completion_tokens")
                              ? "max_completion_tokens" : "max_tokens";
    if ((k = number_field(root, mt_name, 1, lim->max_tokens_limit, 1, &v, e)) < 0) goto out;
    if (k) out->max_tokens = (int)v;
    if ((k = number_field(root, "temperature", 0, 100, 0, &v, e)) < 0) goto out;
    if (k) out->sp.temp = (float)v;
    if ((k = number_field(root, "top_p", 0, 1, 0, &v, e)) < 0) goto out;
    if (k) out->sp.top_p = v > 0 ? (float)v : 1e-9f;
    if ((k = number_field(root, "top_k", 0, 1 << 30, 1, &v, e)) < 0) goto out;
    if (k) out->sp.top_k = (int)v;
    if ((k = number_field(root, "min_p", 0, 1, 0, &v, e)) < 0) goto out;
    if (k) out->sp.min_p = (float)v;
    if ((k = number_field(root, "repeat_penalty", 1e-6, 100, 0, &v, e)) < 0) goto out;
    if (k) out->sp.repeat_penalty = (float)v;
    if ((k = number_field(root, "seed", 0, 9007199254740991.0, 1, &v, e)) < 0) goto out;
    if (k) {
        out->sp.seed = (uint64_t)v;
    } else {   /* no seed: a fresh one per request, as OpenAI and llama-server sample */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        static _Atomic unsigned long long counter;
        out->sp.seed = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)ts.tv_sec ^ ++counter;
    }
    if (bool_field(root, "stream", &out->stream, e) < 0) goto out;
    if (bool_field(root, "ignore_eos", &out->ignore_eos, e) < 0) goto out;
    if (chat) {   /* logprobs: true, top_logprobs: N */
        if (bool_field(root, "logprobs", &out->logprobs, e) < 0) goto out;
        if ((k = number_field(root, "top_logprobs", 0, SERVE_MAX_TOP_LOGPROBS, 1, &v, e)) < 0) goto out;
        if (k && !out->logprobs) {
            api_fail(e, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
            goto out;
        }
        if (k) out->top_logprobs = (int)v;
    } else {      /* logprobs: N alternatives (0 .. 5 in OpenAI's API; up to 20 here) */
        if ((k = number_field(root, "logprobs", 0, SERVE_MAX_TOP_LOGPROBS, 1, &v, e)) < 0) goto out;
        if (k) out->logprobs = 1, out->top_logprobs = (int)v;
    }
    if (out->logprobs && out->stream) {
        api_fail(e, 400, "logprobs", "log-probabilities come in non-streamed responses only: drop 'stream' or "
                 "'logprobs'");
        goto out;
    }
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (so && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so)) {
            api_fail(e, 400, "stream_options", "'stream_options' must be an object");
            goto out;
        }
        if (bool_field(so, "include_usage", &out->include_usage, e) < 0) goto out;
    }
    const cJSON *stop = cJSON_GetObjectItemCaseSensitive(root, "stop");
    if (stop && !cJSON_IsNull(stop)) {
        const int n_stop = cJSON_IsString(stop) ? 1 : cJSON_IsArray(stop) ? cJSON_GetArraySize(stop) : -1;
        if (n_stop < 0 || n_stop > SERVE_MAX_STOP) {
            api_fail(e, 400, "stop", "'stop' must be a string or an array of up to %d strings", SERVE_MAX_STOP);
            goto out;
        }
        for (int i = 0; i < n_stop; i++) {
            const cJSON *s = cJSON_IsString(stop) ? stop : cJSON_GetArrayItem(stop, i);
            if (!cJSON_IsString(s) || !s->valuestring[0] || strlen(s->valuestring) > 256) {
                api_fail(e, 400, "stop", "'stop' strings must be strings of 1 to 256 bytes");
                goto out;
            }
            if (!(out->stop[out->n_stop++] = strdup(s->valuestring))) {
                api_fail(e, 500, NULL, "out of memory");
                goto out;
            }
        }
    }
    ids prompt = {0};
    if (chat) {
        if (cJSON_GetObjectItemCaseSensitive(root, "prompt")) {
            api_fail(e, 400, "prompt", "chat completions take 'messages', not 'prompt'");
            goto out;
        }
        k = chat_prompt(m, cJSON_GetObjectItemCaseSensitive(root, "messages"), &prompt, e);
    } else {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
        if (!p) {
            api_fail(e, 400, "prompt", "'prompt' is required");
            goto out;
        }
        k = completion_prompt(m, p, &prompt, e);
    }
    out->prompt = prompt.v, out->n_prompt = prompt.n;
    if (k) goto out;
    if (out->n_prompt == 0) {
        api_fail(e, 400, chat ? "messages" : "prompt", "the prompt is empty (no tokens)");
        goto out;
    }
    if (out->n_prompt >= lim->n_ctx) {
        api_fail(e, 400, chat ? "messages" : "prompt",
                 "the prompt has %d tokens; the context holds %d, with room for one generated token at least",
                 out->n_prompt, lim->n_ctx);
        goto out;
    }
    rc = 0;
out:
    cJSON_Delete(root);
    if (rc) api_completion_free(out);
    return rc;
}

void api_completion_into_req(api_completion *c, serve_req *r) {
    r->prompt = c->prompt, r->n_prompt = c->n_prompt;
    r->max_tokens = c->max_tokens;
    r->sp = c->sp;
    for (int i = 0; i < c->n_stop; i++) r->stop[i] = c->stop[i];
    r->n_stop = c->n_stop;
    r->logprobs = c->logprobs, r->top_logprobs = c->top_logprobs;
    r->ignore_eos = c->ignore_eos;
    c->prompt = NULL, c->n_prompt = 0, c->n_stop = 0;
}

void api_completion_free(api_completion *c) {
    free(c->prompt);
    for (int i = 0; i < c->n_stop; i++) free(c->stop[i]);
    c->prompt = NULL, c->n_stop = 0;
}
