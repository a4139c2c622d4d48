/* The server's engine: one thread owns the model and every slot's context,
 * takes requests from a bounded queue and runs them side by side (a step of
 * each active slot in turn: a prompt chunk, or one generated token), and hands
 * their text back through the request. The HTTP side (http.c) only builds
 * requests, waits on them and formats what they produce. Public API only
 * (include/still.h). */
#ifndef STILL_SERVE_ENGINE_H
#define STILL_SERVE_ENGINE_H

#include "still.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

enum { SERVE_MAX_STOP = 4, SERVE_MAX_TOP_LOGPROBS = 20 };

/* A generated token's log-probability under the model (the log-softmax of its logits, before any sampling
 * setting) and the most likely alternatives at that step. */
typedef struct {
    int32_t id;
    float logprob;
    int n_top;
    int32_t top_id[SERVE_MAX_TOP_LOGPROBS];
    float top_logprob[SERVE_MAX_TOP_LOGPROBS];
} serve_logprob;

typedef enum { FINISH_NONE = 0, FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR } serve_finish;

/* One completion request. The HTTP side fills the input part, submits it and
 * from then on touches only the shared part, under mu. Two owners (the HTTP
 * side and the engine) hold a reference each; the last release frees it. */
typedef struct serve_req {
    /* input: read-only once submitted */
    int32_t *prompt;           /* malloc'ed token ids */
    int n_prompt;
    int max_tokens;            /* generated tokens at most */
    still_sampler_params sp;
    char *stop[SERVE_MAX_STOP];/* stop strings (malloc'ed), not part of the text returned */
    int n_stop;
    int logprobs;              /* record each generated token's log-probability */
    int top_logprobs;          /* and this many alternatives (0 .. SERVE_MAX_TOP_LOGPROBS) */
    int ignore_eos;            /* end-of-generation tokens are never sampled (llama-server's ignore_eos) */
    /* shared, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char *text;                /* text produced so far: whole UTF-8 characters, stop strings held back and cut */
    size_t n_text, cap_text;
    int done;                  /* finished: finish says why */
    serve_finish finish;
    char error[256];           /* FINISH_ERROR: what went wrong */
    int n_generated;           /* tokens sampled */
    serve_logprob *lp;         /* logprobs: one per token sampled */
    int n_lp, cap_lp;
    int n_cached;              /* prompt tokens a slot's state already held (not processed again) */
    int slot;                  /* the slot that ran it (-1 before) */
    int cancelled;             /* the client went away: the engine stops it at its next step */
    int refs;
} serve_req;

serve_req *serve_req_new(void);
/* Drop one reference (under the request's lock); frees the request with the last. */
void serve_req_release(serve_req *r);

typedef struct serve_engine serve_engine;

typedef struct {
    int n_slots;        /* sequences in flight at most */
    int n_ctx;          /* tokens per slot's context */
    int n_batch;        /* prompt tokens per step of a slot (the others step between its chunks) */
    int queue_max;      /* requests waiting for a slot at most; beyond: refused (503) */
    int device;         /* STILL_DEVICE_* */
    int matvec;         /* STILL_MATVEC_* (decode steps' products on the CPU) */
    size_t cache_bytes; /* snapshots of finished conversations kept in memory at most (0: none) */
    const char *state_dir; /* slot save / restore files live here (NULL: the actions are refused) */
    int threads;        /* OpenMP threads of the engine's forwards (0: OpenMP's default) */
    int fixed_threads;  /* still_context_params.fixed_threads */
} serve_engine_params;

/* Counters for /metrics (a snapshot, taken under the engine's lock). */
typedef struct {
    unsigned long long requests_done, requests_cancelled, requests_failed;
    unsigned long long prompt_tokens, prompt_tokens_cached, generated_tokens;
    unsigned long long snapshot_hits, snapshots_saved, snapshots_evicted;
    unsigned long long batched_steps, batched_tokens;   /* decode steps run as one forward for several slots */
    size_t snapshot_bytes;
    int snapshots;
    double prompt_seconds, generate_seconds;
    int slots_busy, queued, n_slots, queue_max;
} serve_stats;

/* Creates the slots' contexts and starts the engine thread. */
int serve_engine_start(still_model *m, const serve_engine_params *p, serve_engine **out, still_err *err);
/* Queue a request (the engine takes a reference). STILL_E_STATE: the queue is full or the engine stopping;
 * STILL_E_ARG: the prompt does not fit a slot's context (err says so). */
int serve_engine_submit(serve_engine *e, serve_req *r, still_err *err);
/* Wait until r is done (or the engine stops it). */
void serve_req_wait(serve_req *r);
void serve_engine_stats(serve_engine *e, serve_stats *s);
/* A slot's state to or from a file of the state directory (llama-server's POST /slots/ID?action=save|restore), or
 * its state forgotten (erase): run by the engine thread between steps, once the slot is idle (a busy slot's action
 * waits for its request to end). 0, or an HTTP status (400, 404, 500, 503) with msg set. *n_tokens: the tokens the
 * state holds (save, restore) or held (erase). */
typedef enum { SLOT_SAVE, SLOT_RESTORE, SLOT_ERASE } serve_slot_action;
int serve_engine_slot_action(serve_engine *e, int slot, serve_slot_action a, const char *filename, int *n_tokens,
                             char *msg, size_t cap);
int serve_engine_n_slots(const serve_engine *e);
int serve_engine_n_ctx(const serve_engine *e);
/* Finish every request (cancelled) and stop the thread; later submissions are refused. */
void serve_engine_stop(serve_engine *e);
/* Stop (if not yet) and free the slots. */
void serve_engine_free(serve_engine *e);

#endif
