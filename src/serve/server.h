/* `still server`: an OpenAI-compatible HTTP server over the engine
 * (engine.h), with libmicrohttpd. */
#ifndef STILL_SERVE_SERVER_H
#define STILL_SERVE_SERVER_H

#include "still.h"

typedef struct {
    const char *host;        /* address to bind (default 127.0.0.1) */
    int port;                /* 0: any free port (printed) */
    const char *api_key;     /* NULL: no key asked */
    const char *model_name;  /* what /v1/models and the responses call the model */
    const char *plan;        /* the attention plan, for /v1/models and the page */
    int n_slots, n_ctx, n_batch, queue_max, device, matvec;
    int max_tokens_default;  /* a request that names no max_tokens */
    size_t max_body;         /* request bodies larger than this: 413 */
    int threads;             /* HTTP connections served at once */
    int omp_threads;         /* the engine's OpenMP threads (-t; 0: OpenMP's default) */
    int fixed_threads;       /* decode steps always on all of them (no governor) */
    size_t cache_bytes;      /* finished conversations' states kept in memory at most */
    const char *state_dir;   /* slot files (NULL: none) */
} serve_opts;

/* Serve until SIGINT or SIGTERM; the model stays the caller's. Returns 0, or 1 with a message printed. */
int serve_run(still_model *m, const serve_opts *o);

#endif
