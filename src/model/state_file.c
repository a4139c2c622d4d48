/* Snapshots of a context's sequence state (still.h: still_context_state_save / _load): every layer's state as its
 * kind lists it (attn.h, state_regions), behind a header that names what it fits and followed by a checksum, so
 * that a damaged, truncated or foreign snapshot is refused before the context is touched.
 *
 *   "STILLSS1"  u32 version  u32 n_layer  i32 n_ctx  i32 n_past  u64 fingerprint
 *   per layer:  i32 n_seen  i32 n_regions  then per region: u64 bytes, the bytes
 *   u64 checksum (FNV-1a 64 of everything after the magic)
 *
 * The fingerprint hashes the model's shape, its file size and tensor count, every layer's plan and the plan's
 * parameters: a state is only meaningful for the model and adapter that made it. Host byte order (a snapshot is a
 * cache, not an interchange format). */
#include "model/model.h"
#include "common/common.h"
#include "kinds/attn.h"
#include "model/lora.h"
#include "model/model_cuda.h"

#include <stdlib.h>
#include <string.h>

enum { SNAP_VERSION = 1, MAX_REGIONS = 4096 };
static const char SNAP_MAGIC[8] = {'S', 'T', 'I', 'L', 'L', 'S', 'S', '1'};

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}
#define FNV0 0xcbf29ce484222325ull

/* The configuration fields that shape a layer's state and its meaning. */
static uint64_t cfg_hash(uint64_t h, const attn_config *c) {
    const int f[] = {c->kind, c->n_head, c->n_head_kv, c->head_dim, c->d_model, c->n_ctx, c->window, c->chunk,
                     c->feature_dim, c->budget, c->lambda, c->per_kv_head, c->sel_global, c->sel_span, c->routing,
                     c->linear, c->feature_map, c->gate, c->gate_den, (int)c->sel_type, c->conv, c->norm,
                     c->index_heads, c->index_dim, c->topk};
    h = fnv(h, f, sizeof f);
    return fnv(h, &c->seed, sizeof c->seed);
}

static uint64_t fingerprint_of(const still_context *ctx) {
    const still_model *m = ctx->m;
    const still_model_info info = still_model_get_info(m);
    const int shape[] = {info.n_layer, info.d_model, info.n_head, info.n_head_kv, info.head_dim, info.d_ff,
                         info.n_vocab};
    uint64_t h = fnv(FNV0, shape, sizeof shape);
    h = fnv(h, &info.file_bytes, sizeof info.file_bytes);
    h = fnv(h, &info.n_params, sizeof info.n_params);
    for (int l = 0; l < m->cfg.n_layer; l++) {
        attn_config ac = ctx->gpu ? m->attn_cfg[l] : ctx->attn[l]->cfg;   /* (a GPU context has no CPU states) */
        if (ctx->gpu) ac.n_ctx = ctx->n_ctx;
        h = cfg_hash(h, &ac);
        const size_t np = attn_kind_get(ac.kind)->param_count(&ac);
        if (np && m->attn_params[l]) h = fnv(h, m->attn_params[l], np * sizeof(float));
    }
    if (ctx->gpu) h = fnv(h, "cuda", 4);   /* a GPU context's state has its own layout (model_cuda.c) */
    const lora_set *lo = m->lora;   /* a LoRA changes every layer's inputs: its values and scale too */
    h = fnv(h, &(int){lo != NULL}, sizeof(int));
    if (lo) {
        h = fnv(h, &lo->rank, sizeof lo->rank), h = fnv(h, &lo->alpha, sizeof lo->alpha);
        h = fnv(h, &lo->user_scale, sizeof lo->user_scale);
        for (int i = 0; i < lo->n_layer * LORA_N_TARGETS; i++) {
            const int t = i % LORA_N_TARGETS;
            if (lo->A[i]) h = fnv(h, lo->A[i], sizeof(float) * (size_t)lo->rank * (size_t)lo->n_in[t]);
            if (lo->B[i]) h = fnv(h, lo->B[i], sizeof(float) * (size_t)lo->rank * (size_t)lo->n_out[t]);
        }
    }
    return h;
}

static uint64_t fingerprint(const still_context *ctx) {
    if (!ctx->snap_fp_ok) {   /* hashing every parameter takes a while: once per context (a cache, not shared) */
        still_context *c = (still_context *)ctx;
        c->snap_fp = fingerprint_of(ctx), c->snap_fp_ok = 1;
    }
    return ctx->snap_fp;
}

typedef struct {
    FILE *f;
    uint64_t sum;
    int bad;
} writer;

static void put(writer *w, const void *p, size_t n) {
    if (w->bad) return;
    w->sum = fnv(w->sum, p, n);
    if (n && fwrite(p, 1, n, w->f) != n) w->bad = 1;
}

static int regions_of(attn_state *s, attn_region *r, int max, still_err *err) {
    const attn_kind *k = attn_kind_get(s->cfg.kind);
    if (!k->state_regions) return still_fail(err, STILL_E_UNSUPPORTED, "state snapshots: kind %s has none", k->name);
    const int n = k->state_regions(s, r, max);
    if (n < 0) return still_fail(err, STILL_E_UNSUPPORTED, "state snapshots: kind %s has too many regions", k->name);
    return n;
}

/* A GPU context's layer l after n_past tokens (model_cuda.h: device regions, and host values). */
static int gpu_regions_of(still_context *ctx, int l, int n_past, gpu_region *r, int max, still_err *err) {
    const int n = gpu_context_state_regions(ctx->gpu, l, n_past, r, max);
    if (n < 0) return still_fail(err, STILL_E_UNSUPPORTED, "state snapshots: layer %d has too many regions", l);
    return n;
}

/* A region's bytes through host memory: a CPU region's own, a GPU region's copied into *stage (grown). */
static int gpu_stage(size_t bytes, void **stage, size_t *cap, still_err *err) {
    if (bytes <= *cap) return STILL_OK;
    void *p = realloc(*stage, bytes);
    if (!p) return still_fail(err, STILL_E_NOMEM, "state snapshot: out of memory staging a GPU region");
    *stage = p, *cap = bytes;
    return STILL_OK;
}

int still_context_state_save(const still_context *ctx, FILE *f, still_err *err) {
    attn_region *r = malloc(sizeof *r * MAX_REGIONS);
    gpu_region *gr = ctx->gpu ? malloc(sizeof *gr * MAX_REGIONS) : NULL;
    void *stage = NULL;
    size_t stage_cap = 0;
    if (!r || (ctx->gpu && !gr)) {
        free(r), free(gr);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    writer w = {.f = f, .sum = FNV0};
    if (fwrite(SNAP_MAGIC, 1, sizeof SNAP_MAGIC, f) != sizeof SNAP_MAGIC) w.bad = 1;
    const uint32_t head[2] = {SNAP_VERSION, (uint32_t)ctx->m->cfg.n_layer};
    const int32_t ctxn[2] = {ctx->n_ctx, ctx->n_past};
    const uint64_t fp = fingerprint(ctx);
    put(&w, head, sizeof head), put(&w, ctxn, sizeof ctxn), put(&w, &fp, sizeof fp);
    int rc = STILL_OK;
    for (int l = 0; l < ctx->m->cfg.n_layer && !rc && !w.bad; l++) {
        const int n = ctx->gpu ? gpu_regions_of((still_context *)ctx, l, ctx->n_past, gr, MAX_REGIONS, err)
                               : regions_of(ctx->attn[l], r, MAX_REGIONS, err);
        if (n < 0) {
            rc = n;
            break;
        }
        const int32_t lh[2] = {ctx->gpu ? ctx->n_past : ctx->attn[l]->n_seen, n};
        put(&w, lh, sizeof lh);
        for (int i = 0; i < n && !rc; i++) {
            const void *p = ctx->gpu ? stage : r[i].p;
            const uint64_t b = ctx->gpu ? gr[i].bytes : r[i].bytes;
            if (ctx->gpu && !(rc = gpu_stage(b, &stage, &stage_cap, err)))
                rc = gpu_region_read(ctx->gpu, &gr[i], stage, err), p = stage;
            if (!rc) put(&w, &b, sizeof b), put(&w, p, b);
        }
    }
    free(r), free(gr), free(stage);
    if (rc) return rc;
    const uint64_t sum = w.sum;
    if (!w.bad && fwrite(&sum, sizeof sum, 1, f) != 1) w.bad = 1;
    if (w.bad || fflush(f)) return still_fail(err, STILL_E_IO, "state snapshot: write failed");
    return STILL_OK;
}

/* Bytes of the snapshot read so far, bounds-checked. */
typedef struct {
    const unsigned char *p;
    size_t n, at;
} reader;

static int take(reader *rd, void *out, size_t n) {
    if (n > rd->n - rd->at) return -1;
    if (out) memcpy(out, rd->p + rd->at, n);
    rd->at += n;
    return 0;
}

int still_context_state_load(still_context *ctx, FILE *f, still_err *err) {
    /* the whole snapshot first: nothing is written into the context before it checks out */
    size_t cap = 1 << 20, n = 0;
    unsigned char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        unsigned char *nb = cap < ((size_t)1 << 40) ? realloc(buf, cap *= 2) : NULL;
        if (!nb) free(buf);
        buf = nb;
    }
    if (!buf) return still_fail(err, STILL_E_NOMEM, "state snapshot: out of memory reading it");
    if (ferror(f)) {
        free(buf);
        return still_fail(err, STILL_E_IO, "state snapshot: read failed");
    }
    attn_region *r = malloc(sizeof *r * 2 * MAX_REGIONS);   /* the second half: the re-listing of pass 0 */
    gpu_region *gr = ctx->gpu ? malloc(sizeof *gr * MAX_REGIONS) : NULL;
    int *seen = malloc(sizeof *seen * (size_t)ctx->m->cfg.n_layer);
    int rc = STILL_OK;
    if (!r || !seen || (ctx->gpu && !gr)) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        goto out;
    }
    uint64_t sum_stored;
    if (n < sizeof SNAP_MAGIC + sizeof sum_stored || memcmp(buf, SNAP_MAGIC, sizeof SNAP_MAGIC)) {
        rc = still_fail(err, STILL_E_FORMAT, "state snapshot: not a still state snapshot (bad magic or too short)");
        goto out;
    }
    memcpy(&sum_stored, buf + n - sizeof sum_stored, sizeof sum_stored);
    if (fnv(FNV0, buf + sizeof SNAP_MAGIC, n - sizeof SNAP_MAGIC - sizeof sum_stored) != sum_stored) {
        rc = still_fail(err, STILL_E_FORMAT, "state snapshot: damaged or truncated (checksum mismatch)");
        goto out;
    }
    reader rd = {buf, n - sizeof sum_stored, sizeof SNAP_MAGIC};
    uint32_t head[2];
    int32_t ctxn[2];
    uint64_t fp;
    if (take(&rd, head, sizeof head) || take(&rd, ctxn, sizeof ctxn) || take(&rd, &fp, sizeof fp)) {
        rc = still_fail(err, STILL_E_FORMAT, "state snapshot: truncated header");
        goto out;
    }
    if (head[0] != SNAP_VERSION) {
        rc = still_fail(err, STILL_E_FORMAT, "state snapshot: version %u (this build reads %d)", head[0], SNAP_VERSION);
        goto out;
    }
    if ((int)head[1] != ctx->m->cfg.n_layer || ctxn[0] != ctx->n_ctx || fp != fingerprint(ctx)) {
        rc = still_fail(err, STILL_E_ARG, "state snapshot: made by another model, plan, adapter or context size "
                        "(snapshot: %u layers, %d tokens of context)", head[1], ctxn[0]);
        goto out;
    }
    if (ctxn[1] < 0 || ctxn[1] > ctx->n_ctx) {
        rc = still_fail(err, STILL_E_FORMAT, "state snapshot: %d tokens in a %d-token context", ctxn[1], ctx->n_ctx);
        goto out;
    }
    /* a dry pass checks every layer's sizes against what this context's states would take, the second copies */
    for (int pass = 0; pass < 2 && !rc; pass++) {
        rd.at = sizeof SNAP_MAGIC + sizeof head + sizeof ctxn + sizeof fp;
        for (int l = 0; l < ctx->m->cfg.n_layer && !rc; l++) {
            int32_t lh[2];
            if (take(&rd, lh, sizeof lh) || lh[0] < 0 || lh[0] > ctx->n_ctx) {
                rc = still_fail(err, STILL_E_FORMAT, "state snapshot: layer %d's header is damaged", l);
                break;
            }
            if (ctx->gpu) {   /* every layer of a GPU context has seen the context's tokens */
                const int k = lh[0] == ctxn[1] ? gpu_regions_of(ctx, l, ctxn[1], gr, MAX_REGIONS, err) : -2;
                if (k == -2) rc = still_fail(err, STILL_E_FORMAT, "state snapshot: layer %d's header is damaged", l);
                else if (k < 0) rc = k;
                else if (k != lh[1])
                    rc = still_fail(err, STILL_E_FORMAT, "state snapshot: layer %d has %d regions, expected %d", l,
                                    lh[1], k);
                for (int i = 0; i < k && !rc; i++) {
                    uint64_t b;
                    const size_t at = rd.at + sizeof b;
                    if (take(&rd, &b, sizeof b) || b != gr[i].bytes || take(&rd, NULL, gr[i].bytes))
                        rc = still_fail(err, STILL_E_FORMAT, "state snapshot: layer %d region %d has the wrong size", l, i);
                    else if (pass)
                        rc = gpu_region_write(ctx->gpu, &gr[i], buf + at, err);
                }
                continue;
            }
            attn_state *s = ctx->attn[l];
            if (pass == 0) seen[l] = s->n_seen;
            s->n_seen = lh[0];   /* region sizes follow n_seen */
            const int k = regions_of(s, r, MAX_REGIONS, err);
            if (pass == 0) {   /* back as it was (a kind may keep its parts' counts in step when listing) */
                s->n_seen = seen[l];
                if (k >= 0) regions_of(s, r + MAX_REGIONS, MAX_REGIONS, NULL);
            }
            if (k < 0) {
                rc = k;
                break;
            }
            if (k != lh[1]) {
                rc = still_fail(err, STILL_E_FORMAT, "state snapshot: layer %d has %d regions, expected %d", l, lh[1], k);
                break;
            }
            for (int i = 0; i < k && !rc; i++) {
                uint64_t b;
                if (take(&rd, &b, sizeof b) || b != r[i].bytes || take(&rd, pass ? r[i].p : NULL, r[i].bytes))
                    rc = still_fail(err, STILL_E_FORMAT, "state snapshot: layer %d region %d has the wrong size", l, i);
            }
        }
        if (!rc && rd.at != rd.n) rc = still_fail(err, STILL_E_FORMAT, "state snapshot: trailing bytes");
    }
    if (!rc && ctx->gpu) rc = gpu_context_state_restored(ctx->gpu, ctxn[1], err);
    if (!rc) ctx->n_past = ctxn[1];
out:
    free(buf), free(r), free(gr), free(seen);
    return rc;
}
