/* The OpenAI-shaped request bodies the server accepts: parsed with cJSON,
 * every field checked for its type and range, the prompt made into token ids
 * (chat messages through the model's ChatML template). Errors name the field,
 * as OpenAI's do. */
#ifndef STILL_SERVE_API_H
#define STILL_SERVE_API_H

#include "still.h"
#include "serve/engine.h"

#include <cjson/cJSON.h>

typedef struct {
    int status;          /* HTTP status (400, 401, 404, ...) */
    const char *type;    /* "invalid_request_error", ... */
    char param[64];      /* the offending field, or empty */
    char msg[400];
} api_error;

typedef struct {
    int chat;                 /* /v1/chat/completions (1) or /v1/completions (0) */
    int stream, include_usage;
    int max_tokens;
    still_sampler_params sp;
    char *stop[SERVE_MAX_STOP];
    int n_stop;
    int32_t *prompt;
    int n_prompt;
    int ignore_eos;               /* llama-server's extension: never stop at an end-of-generation token */
    int logprobs, top_logprobs;   /* chat: logprobs (bool) and top_logprobs; completions: logprobs = N alternatives */
} api_completion;

/* Limits of the server's requests. */
typedef struct {
    int max_tokens_default;   /* when the request names none */
    int max_tokens_limit;     /* the most a request may ask for */
    int n_ctx;                /* a prompt must leave room for a token */
} api_limits;

/* Parse a completion request's body (valid UTF-8 checked first). 0, or -1 with e filled. */
int api_parse_completion(const still_model *m, const char *body, size_t n, int chat, const api_limits *lim,
                         api_completion *out, api_error *e);
/* Move the prompt and the stop strings into r (the request owns them then) and free what is left. */
void api_completion_into_req(api_completion *c, serve_req *r);
void api_completion_free(api_completion *c);

/* A parsed JSON object body (never NULL on success); -1 with e filled. */
int api_parse_object(const char *body, size_t n, cJSON **out, api_error *e);
void api_fail(api_error *e, int status, const char *param, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* {"error": {"message", "type", "param", "code"}} as a malloc'ed string. */
char *api_error_json(const api_error *e);

#endif
