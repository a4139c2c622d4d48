/* still on the GPU: configuration, the device state and workspace, and
 * stc_still_forward's sequence of kernels (cuda/kinds/still/attn_still_internal.cuh
 * lists them; cuda/kinds/still/attn_still_layout.cuh has the index arithmetic).
 *
 * Configuration rules follow src/kinds/still/attn_still.c's still_check: λ = the given
 * lambda, else (m - 2C) / ceil(n_ctx / C) with a budget, else C / 16;
 * routing none forces λ = 0; λ <= C. Budget mode caps Sel at m - 2C per
 * selection head; uncapped mode sizes it for n_ctx. */
#include "kinds/attn_rules.h"
#include "kinds/still/attn_still_internal.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

using namespace stillk;

namespace {

/* still_check's rules plus this backend's limits; fills info. */
int resolve(const stc_still_config *c, stc_still_info *info, still_err *err) {
    if (!c) return stc_fail(err, STILL_E_ARG, "still: NULL configuration");
    const still_plan_fields f = {c->head_dim, c->n_head,    c->n_head_kv, c->d_model,     c->n_ctx,
                                 c->chunk,    c->budget,    c->routing,   c->sel_span,    c->sel_global,
                                 c->linear,   c->feature_map, c->feature_dim, c->gate, c->gate_den};
    char msg[160];
    const int bad = still_plan_check(&f, msg, sizeof msg);   /* attn_still_rules.h: the CPU's rules */
    if (bad) return stc_fail(err, bad == STILL_PLAN_UNSUPPORTED ? STILL_E_UNSUPPORTED : STILL_E_ARG, "%s", msg);
    /* this backend's limits */
    if (c->head_dim != 64 && c->head_dim != 128)
        return stc_fail(err, STILL_E_UNSUPPORTED, "still on the GPU: head dim %d (64 or 128 supported)", c->head_dim);
    if (c->chunk > kMaxChunk)
        return stc_fail(err, STILL_E_UNSUPPORTED, "still on the GPU: chunk %d (at most %d supported)", c->chunk, kMaxChunk);
    if (c->lolcats) {
        if (c->feature_map != STILL_FMAP_HEDGEHOG || c->feature_dim != c->head_dim || !c->linear || c->gate || c->per_kv_head ||
            c->routing != R_NONE)
            return stc_fail(err, STILL_E_UNSUPPORTED,
                            "lolcats on the GPU: Hedgehog map with feature dim = head dim (%d, got %d), linear on, "
                            "no gate, no selection", c->head_dim, c->feature_dim);
    } else if (c->feature_map == STILL_FMAP_HEDGEHOG && c->linear) {
        return stc_fail(err, STILL_E_UNSUPPORTED,
                        "still on the GPU: the hedgehog feature map is not supported (NP-Map only)");
    }
    if (c->n_ctx > (1 << 28)) return stc_fail(err, STILL_E_ARG, "still: n_ctx %d too large", c->n_ctx);
    if (c->sel_span > 0 && !c->sel_global && c->routing != R_POSITION && c->routing != R_NONE)
        return stc_fail(err, STILL_E_UNSUPPORTED, "still on the GPU: --sel-span with global selection only");
    if (c->sel_global) {
        if (c->lolcats) return stc_fail(err, STILL_E_ARG, "lolcats: no selection, so no global selection");
        if (c->budget - 2 * c->chunk > kGlobalMaxCap)
            return stc_fail(err, STILL_E_UNSUPPORTED, "still on the GPU: global selection keeps at most %d tokens per "
                            "head (budget %d)", kGlobalMaxCap, kGlobalMaxCap + 2 * c->chunk);
    }
    const int C = c->chunk;
    /* λ and the capacity: src/kinds/still/attn_still_rules.h, as the CPU */
    int l = still_lambda(c->routing == R_NONE, c->lambda, c->budget, C, c->n_ctx);
    if (c->sel_global) l = C;   /* every leaving token takes a free slot while there is one: sel_count(k) = min(kC, cap) */
    const long long cp = still_capacity(c->budget, C, c->n_ctx, l);
    if (cp > (1 << 30)) return stc_fail(err, STILL_E_ARG, "still: selected store too large (%lld tokens)", cp);
    const int cap = (int)cp;
    info->lambda = l;
    info->cap = cap;
    info->n_sel_heads = c->per_kv_head ? c->n_head_kv : c->n_head;
    info->attn_wgmma = 0;   /* (a state's: stc_still_get_info) */
    info->feat = 2 * c->head_dim;
    const size_t H = (size_t)c->n_head, D = (size_t)c->head_dim;
    info->param_count = c->lolcats ? lolcats_par_count((int)H, (int)D, (int)D)
                                   : still_par_count((int)H, (int)D, (int)D, 0, c->gate, c->d_model);
    return STILL_OK;
}

/* Calls at least this long have the feature maps' W split once into an image (launch_wimage) that the
 * leave and linear kernels copy, instead of every block splitting it: a prefill. (Not below: training's
 * 1,024-token sequences run many calls per step, each would add a launch.) */
enum { kWImageMinTokens = 4096 };

/* Workspace bytes a call of T tokens needs, per buffer. */
void ws_needs(const stc_still *s, int T, size_t need[WS_COUNT]) {
    const size_t H = (size_t)s->H, D = (size_t)s->D, P = (size_t)s->P;
    const bool lin = s->cfg.linear, gate = lin && s->cfg.gate;
    need[WS_SC] = uses_token_scores(s->cfg.routing) ? H * (size_t)T * sizeof(double) : 0;
    need[WS_SLOTS] = lin ? (size_t)max_leaves(T, s->C) * H * P * (D + 1) * sizeof(float) : 0;
    need[WS_LBUF] = lin ? (size_t)T * H * sizeof(float) : 0;
    need[WS_PRE] = gate ? (size_t)T * H * D * sizeof(float) : 0;
    need[WS_WG] = gate && !s->wg_user ? H * D * (size_t)s->d * sizeof(stc_bf16) : 0;
    /* decode partials: for every T, so that a reservation covers the decode
     * steps recorded in a CUDA graph later */
    /* partials, linear numerators, the step's position */
    need[WS_PART] = H * ((size_t)decode_splits(s->cap, s->C, s->decode_split) * (D + 2) + (D + 1)) * sizeof(float) + 16;
    need[WS_WIMG] = lin && T >= kWImageMinTokens ? (D == 64 ? 2 : 1) * H * wimg_bytes(s->D) : 0;
    for (int i = WS_TY; i < WS_COUNT; i++) need[i] = 0;   /* stc_still_distill grows these itself */
}

const char *const WS_NAMES[WS_COUNT] = {"still routing scores", "still linear-state prefix sums",
                                        "still softmax denominators", "still gate pre-activations",
                                        "still bf16 gate matrix", "still decode partials", "still feature-map image",
                                        "still training outputs", "still training gate gradients",
                                        "still training state gradients", "still training selection flags"};

int ws_reserve(stc_ctx *ctx, stc_still *s, int T, still_err *err) {
    size_t need[WS_COUNT];
    ws_needs(s, T, need);
    stc_still_ws *w = s->ws;
    for (int i = 0; i < WS_COUNT; i++) {
        if (w->bytes[i] >= need[i]) continue;
        stc_free(ctx, w->buf[i]);   /* waits for the kernels that may still use it */
        w->buf[i] = NULL;
        w->bytes[i] = 0;
        int rc = stc_malloc(ctx, need[i], WS_NAMES[i], &w->buf[i], err);
        if (rc) return rc;
        w->bytes[i] = need[i];
    }
    return STILL_OK;
}

void ws_release(stc_ctx *ctx, stc_still_ws *w) {
    if (!w || --w->refs > 0) return;
    for (int i = 0; i < WS_COUNT; i++) stc_free(ctx, w->buf[i]);
    free(w);
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

}   // namespace

int stc_still_resolve(const stc_still_config *cfg, stc_still_info *out, still_err *err) {
    stc_still_info tmp;
    return resolve(cfg, out ? out : &tmp, err);
}

void stc_still_free(stc_still *s) {
    if (!s) return;
    stc_ctx *ctx = s->ctx;
    void *bufs[] = {s->ring_k, s->ring_v, s->ring_sc, s->sel_k, s->sel_v, s->sel_pos, s->lin, s->n_seen_dev, s->done_dev,
                    s->sel_sc, s->sel_order, s->ev_k, s->ev_v, s->ev_n, s->g_picked,
                    s->sel_k8, s->sel_v8, s->sel_ks, s->sel_vs, s->ev_k8, s->ev_v8, s->ev_ks, s->ev_vs};
    for (void *b : bufs) stc_free(ctx, b);
    ws_release(ctx, s->ws);
    free(s);
}

int stc_still_create(stc_ctx *ctx, const stc_still_config *cfg, stc_still **out, still_err *err) {
    if (!out) return stc_fail(err, STILL_E_ARG, "stc_still_create: NULL output");
    *out = NULL;
    STC_ENTER(ctx, err);
    stc_still_info info;
    int rc = resolve(cfg, &info, err);
    if (rc) return rc;
    stc_still *s = (stc_still *)calloc(1, sizeof *s);
    stc_still_ws *w = (stc_still_ws *)calloc(1, sizeof *w);
    if (!s || !w) {
        free(s), free(w);
        return stc_fail(err, STILL_E_NOMEM, "still: out of host memory");
    }
    w->refs = 1;
    s->ctx = ctx, s->cfg = *cfg, s->info = info, s->ws = w;
    s->H = cfg->n_head, s->Hk = cfg->n_head_kv, s->G = s->H / s->Hk, s->D = cfg->head_dim, s->C = cfg->chunk;
    s->P = 2 * s->D, s->Hs = info.n_sel_heads, s->d = cfg->d_model, s->lam = info.lambda, s->cap = info.cap;
    s->sel_rows = info.cap > 0 ? info.cap : 1;
    s->grad_tf32 = stc_env_on("STILL_CUDA_GRAD_TF32");
    {   /* keys per decode block: 32, 64 or 128, or "auto": the smallest that gives a head <= 48 splits, so that a
         * large store is read by fewer, fuller blocks and the merge has fewer partials */
        const char *split = getenv("STILL_CUDA_DECODE_SPLIT");
        s->decode_split = split && (atoi(split) == 64 || atoi(split) == 128) ? atoi(split) : 32;
        if (split && !strcmp(split, "auto"))
            while (s->decode_split < 128 && decode_splits(s->cap, s->C, s->decode_split) > 48) s->decode_split *= 2;
    }
    s->npmap_wg = stc_env_on("STILL_CUDA_NPMAP_WGMMA");
    /* a decode grid has a row per split plus two: larger splits where the rows would pass CUDA's 65535 */
    while (s->decode_split < 128 && decode_splits(s->cap, s->C, s->decode_split) + 2 > 65535) s->decode_split *= 2;
    if (decode_splits(s->cap, s->C, s->decode_split) + 2 > 65535) {
        stc_still_free(s);
        return stc_fail(err, STILL_E_UNSUPPORTED, "still: a selection budget of %d tokens needs more key splits than "
                        "a decode step's grid holds (65,533 of 128 keys)", info.cap);
    }
    const size_t C2 = 2 * (size_t)s->C, D = (size_t)s->D, H = (size_t)s->H, Hk = (size_t)s->Hk, Hs = (size_t)s->Hs;
    const size_t P = (size_t)s->P, rows = (size_t)s->sel_rows;
    s->sel_q8 = cfg->sel_q8 != 0;
    const size_t q8 = s->sel_q8 ? 1 : 0, f16 = 1 - q8;
    struct { void **p; size_t bytes; const char *what; } a[] = {
        {(void **)&s->ring_k, C2 * Hk * D * sizeof(float), "still ring keys"},
        {(void **)&s->ring_v, C2 * Hk * D * sizeof(float), "still ring values"},
        {(void **)&s->ring_sc, H * C2 * sizeof(double), "still ring scores"},
        /* a tile of rows past the end: the attention kernel's zero-filled copies of rows without an entry
         * take their would-be address, at most a tile past the last entry (attn_still_attn.cu) */
        {(void **)&s->sel_k, f16 * (Hs * rows + kKeys) * D * sizeof(__half), "still selected keys"},
        {(void **)&s->sel_v, f16 * (Hs * rows + kKeys) * D * sizeof(__half), "still selected values"},
        /* --sel-cache q8: bytes and a scale per row (no padding needed: the 8-bit tiles are loaded in line) */
        {(void **)&s->sel_k8, q8 * Hs * rows * D, "still selected keys (8-bit)"},
        {(void **)&s->sel_v8, q8 * Hs * rows * D, "still selected values (8-bit)"},
        {(void **)&s->sel_ks, q8 * Hs * rows * sizeof(float), "still selected key scales"},
        {(void **)&s->sel_vs, q8 * Hs * rows * sizeof(float), "still selected value scales"},
        {(void **)&s->sel_pos, Hs * rows * sizeof(int32_t), "still selected positions"},
        {(void **)&s->lin, H * P * (D + 1) * sizeof(float), "still linear state"},
        {(void **)&s->n_seen_dev, sizeof(int), "still position"},
        {(void **)&s->done_dev, sizeof(int), "still block counter"},
    };
    for (auto &x : a) {
        if (!x.bytes) continue;   /* the other storage's buffers */
        rc = stc_malloc(ctx, x.bytes, x.what, x.p, err);
        if (rc) {
            stc_still_free(s);
            return rc;
        }
        s->state_bytes += x.bytes;
    }
    if (cfg->sel_global) {   /* the slots' scores and order (state); a leave's evicted entries and picks (scratch) */
        struct { void **p; size_t bytes; const char *what; int state; } g[] = {
            {(void **)&s->sel_sc, Hs * rows * sizeof(double), "still selected scores", 1},
            {(void **)&s->sel_order, Hs * rows * sizeof(int32_t), "still selection order", 1},
            {(void **)&s->ev_k, f16 * Hs * (size_t)s->C * D * sizeof(__half), "still evicted keys", 0},
            {(void **)&s->ev_v, f16 * Hs * (size_t)s->C * D * sizeof(__half), "still evicted values", 0},
            {(void **)&s->ev_k8, q8 * Hs * (size_t)s->C * D, "still evicted keys (8-bit)", 0},
            {(void **)&s->ev_v8, q8 * Hs * (size_t)s->C * D, "still evicted values (8-bit)", 0},
            {(void **)&s->ev_ks, q8 * Hs * (size_t)s->C * sizeof(float), "still evicted key scales", 0},
            {(void **)&s->ev_vs, q8 * Hs * (size_t)s->C * sizeof(float), "still evicted value scales", 0},
            {(void **)&s->ev_n, Hs * sizeof(int), "still eviction counts", 0},
            {(void **)&s->g_picked, Hs * (size_t)s->C * sizeof(int), "still leave picks", 0},
        };
        for (auto &x : g) {
            if (!x.bytes) continue;
            rc = stc_malloc(ctx, x.bytes, x.what, x.p, err);
            if (rc) {
                stc_still_free(s);
                return rc;
            }
            if (x.state) s->state_bytes += x.bytes;
        }
    }
    size_t need = std::max(std::max(smem_score(s->D, s->C), smem_leave(s->D, s->C)), std::max(smem_attn(s->D), smem_linear(s->D)));
    if (cfg->sel_global) need = std::max(need, smem_global(s->D, s->C, s->cap));
    if (need > ctx->smem_optin) {
        stc_still_free(s);
        return stc_fail(err, STILL_E_UNSUPPORTED, "still: %zu bytes of shared memory needed (head dim %d, chunk %d), the device allows %zu",
                        need, cfg->head_dim, cfg->chunk, ctx->smem_optin);
    }
    if ((rc = prepare_score(s->D, err)) || (rc = prepare_leave(s->D, ctx->smem_optin, err)) || (rc = prepare_attn(s->D, err)) ||
        (rc = prepare_linear(s->D, err)) || (rc = prepare_decode(s->D, err)) ||
        (s->D == 64 && stc_env_on("STILL_CUDA_ATTN_WGMMA") && (rc = attn_wg_available(ctx, &s->attn_wg, err))) ||
        (cfg->sel_global && (rc = prepare_global(s->D, s->C, s->cap, err))) ||
        (rc = stc_still_reset(ctx, s, err))) {
        stc_still_free(s);
        return rc;
    }
    *out = s;
    return STILL_OK;
}

int stc_still_reset(stc_ctx *ctx, stc_still *s, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_still_reset: NULL state");
    /* Sel, the ring and its scores need no clearing: only entries written
     * for the current sequence are ever read. */
    const size_t lin = (size_t)s->H * s->P * (s->D + 1) * sizeof(float);
    STC_CUDA(err, cudaMemsetAsync(s->lin, 0, lin, ctx->stream));
    STC_CUDA(err, cudaMemsetAsync(s->ring_sc, 0, (size_t)s->H * 2 * s->C * sizeof(double), ctx->stream));
    STC_CUDA(err, cudaMemsetAsync(s->n_seen_dev, 0, sizeof(int), ctx->stream));
    STC_CUDA(err, cudaMemsetAsync(s->done_dev, 0, sizeof(int), ctx->stream));
    s->n_seen = 0;
    return STILL_OK;
}

size_t stc_still_state_bytes(const stc_still *s) { return s ? s->state_bytes : 0; }

int stc_still_regions(stc_still *s, stc_region *out, int max) {
    if (!s) return 0;
    const size_t C2 = 2 * (size_t)s->C, D = (size_t)s->D, H = (size_t)s->H, Hk = (size_t)s->Hk, Hs = (size_t)s->Hs;
    const size_t rows = Hs * (size_t)s->sel_rows;   /* Sel without the padding tile */
    const stc_region all[] = {
        {s->ring_k, C2 * Hk * D * sizeof(float)}, {s->ring_v, C2 * Hk * D * sizeof(float)},
        {s->ring_sc, H * C2 * sizeof(double)},
        {s->sel_k, s->sel_k ? rows * D * sizeof(__half) : 0}, {s->sel_v, s->sel_v ? rows * D * sizeof(__half) : 0},
        {s->sel_k8, s->sel_k8 ? rows * D : 0}, {s->sel_v8, s->sel_v8 ? rows * D : 0},
        {s->sel_ks, s->sel_ks ? rows * sizeof(float) : 0}, {s->sel_vs, s->sel_vs ? rows * sizeof(float) : 0},
        {s->sel_pos, rows * sizeof(int32_t)},
        {s->sel_sc, s->sel_sc ? rows * sizeof(double) : 0}, {s->sel_order, s->sel_order ? rows * sizeof(int32_t) : 0},
        {s->lin, H * (size_t)s->P * (D + 1) * sizeof(float)}, {s->n_seen_dev, sizeof(int)},
    };
    int n = 0;
    for (const stc_region &r : all) {
        if (!r.dev || !r.bytes) continue;   /* the other storage's buffers, local selection's */
        if (n == max) return -1;
        out[n++] = r;
    }
    return n;
}

void stc_still_get_info(const stc_still *s, stc_still_info *out) {
    if (s && out) {
        *out = s->info;
        out->attn_wgmma = s->attn_wg;
    }
}

int stc_still_reserve(stc_ctx *ctx, stc_still *s, int T_max, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s || T_max < 1) return stc_fail(err, STILL_E_ARG, "stc_still_reserve: NULL state or T_max %d < 1", T_max);
    return ws_reserve(ctx, s, T_max, err);
}

int stc_still_share_workspace(stc_still *s, stc_still *owner, still_err *err) {
    if (!s || !owner) return stc_fail(err, STILL_E_ARG, "stc_still_share_workspace: NULL state");
    if (s->ctx != owner->ctx) return stc_fail(err, STILL_E_ARG, "stc_still_share_workspace: states of different contexts");
    if (s->ws == owner->ws) return STILL_OK;
    ws_release(s->ctx, s->ws);
    s->ws = owner->ws;
    s->ws->refs++;
    return STILL_OK;
}

void stc_still_set_gate_bf16(stc_still *s, const stc_bf16 *wg_dev) {
    if (s) s->wg_user = wg_dev;
}

void stc_still_set_decode_gate_pre(stc_still *s, const float *pre_dev) {
    if (s) s->decode_pre = pre_dev;
}

void stc_still_set_decode_kernels(stc_still *s, int on) {
    if (s) s->no_decode_kernels = !on;
}

void stc_still_set_position(stc_still *s, int n_seen) {
    if (s) s->n_seen = n_seen;
}

void stc_still_set_decode_no_leave(stc_still *s, int on) {
    if (s) s->decode_no_leave = on != 0;
}

int stc_still_leaves_at(const stc_still *s, int p0, int T) {
    if (!s || p0 < 0 || T < 1) return 0;
    return make_geom(p0, T, s->C).n_leaves;
}

const int *stc_still_n_seen_dev(const stc_still *s) { return s ? s->n_seen_dev : NULL; }

int stc_still_n_seen(stc_ctx *ctx, stc_still *s, int *out, still_err *err) {
    if (!s || !out) return stc_fail(err, STILL_E_ARG, "stc_still_n_seen: NULL argument");
    int n = 0;
    int rc = stc_memcpy_d2h(ctx, &n, s->n_seen_dev, sizeof n, err);
    if (rc) return rc;
    s->n_seen = n;
    *out = n;
    return STILL_OK;
}

int stc_still_selected(stc_ctx *ctx, stc_still *s, int32_t *pos_host, int *count_host, still_err *err) {
    if (!s || !pos_host || !count_host) return stc_fail(err, STILL_E_ARG, "stc_still_selected: NULL argument");
    int n = 0;
    int rc = stc_still_n_seen(ctx, s, &n, err);
    if (rc) return rc;
    const int cnt = sel_count(n_left(n, s->C), s->lam, s->cap);
    for (int hs = 0; hs < s->Hs; hs++) {
        count_host[hs] = cnt;
        if (cnt > 0 &&
            (rc = stc_memcpy_d2h(ctx, pos_host + (size_t)hs * s->cap, s->sel_pos + (size_t)hs * s->sel_rows,
                                 (size_t)cnt * sizeof(int32_t), err)))
            return rc;
    }
    return STILL_OK;
}

/* The inputs' row strides (floats per token) and, when the caller computed them, the gate's
 * pre-activations (else NULL: the gate GEMM runs here from x). */
struct input_rows {
    size_t ldq, ldkv, ldpre;
    const float *pre;
    const __half *k_f16, *v_f16;   /* the call's k and v in half, packed rows (NULL: none) */
    int out_first;                 /* the first call row whose outputs are wanted */
};

enum { kSideScanMinTokens = 4096 };   /* calls at least this long fork the scan (still_forward) */

static int still_forward(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *q, const float *k,
                         const float *v, const stc_bf16 *x_bf16, int T, int p0, float *out, stc_bf16 *out_bf16,
                         const input_rows *rows, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_still_forward: NULL state");
    if (T < 0) return stc_fail(err, STILL_E_ARG, "still: negative token count %d", T);
    if (T == 0) return STILL_OK;
    const stc_still_config *cfg = &s->cfg;
    if (p0 != STC_STILL_P0_DEVICE) {
        if (s->n_seen < 0)
            return stc_fail(err, STILL_E_STATE,
                            "still: the state's position is only known on the device (after STC_STILL_P0_DEVICE "
                            "calls); read it with stc_still_n_seen");
        if (p0 != s->n_seen)
            return stc_fail(err, STILL_E_STATE, "still: state holds %d tokens, input starts at %d", s->n_seen, p0);
        if (T > cfg->n_ctx - p0)
            return stc_fail(err, STILL_E_STATE, "still: state full (%d + %d > %d tokens)", p0, T, cfg->n_ctx);
    } else if (T > cfg->n_ctx) {
        return stc_fail(err, STILL_E_STATE, "still: %d tokens exceed n_ctx %d", T, cfg->n_ctx);
    }
    if (!q || !k || !v || !out) return stc_fail(err, STILL_E_ARG, "still: q, k, v and out are required");
    if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out))
        return stc_fail(err, STILL_E_ARG, "still: q, k, v and out must be 16-byte aligned");
    if (out_bf16 && (uintptr_t)out_bf16 % 4)
        return stc_fail(err, STILL_E_ARG, "still: the bf16 outputs must be 4-byte aligned");
    if (cfg->linear && !params_dev) return stc_fail(err, STILL_E_ARG, "still: parameters required");
    if (params_dev && !aligned16(params_dev)) return stc_fail(err, STILL_E_ARG, "still: parameters must be 16-byte aligned");
    if (cfg->linear && cfg->gate && !x_bf16 && !(rows && rows->pre))
        return stc_fail(err, STILL_E_ARG, "still: the gate needs the layer input x");

    /* global selection: one leave per call, at its first position (attn_still_global.cu); a longer call runs
     * as segments cut at chunk boundaries */
    if (cfg->sel_global && T > 1) {
        const int hp = p0 != STC_STILL_P0_DEVICE ? p0 : s->n_seen;   /* (stc_still_set_position) */
        if (hp < 0)
            return stc_fail(err, STILL_E_UNSUPPORTED,
                            "still: global selection runs a call of several tokens at a position the host knows "
                            "(stc_still_set_position)");
        const call_geom g = make_geom(hp, T, s->C);
        const bool at_first = hp % s->C == 0 && hp >= 2 * s->C;   /* a chunk leaves at the call's first position */
        if (g.n_leaves > 1 || (g.n_leaves == 1 && !at_first)) {
            const size_t ldq = rows ? rows->ldq : (size_t)s->H * s->D, ldkv = rows ? rows->ldkv : (size_t)s->Hk * s->D;
            const size_t HD = (size_t)s->H * s->D, KD = (size_t)s->Hk * s->D;
            for (int t0 = 0; t0 < T;) {
                const int n = std::min(s->C - (hp + t0) % s->C, T - t0);
                input_rows seg{};
                if (rows) {
                    seg = *rows;
                    if (seg.pre) seg.pre += (size_t)t0 * seg.ldpre;
                    if (seg.k_f16) seg.k_f16 += (size_t)t0 * KD, seg.v_f16 += (size_t)t0 * KD;
                    seg.out_first = std::min(std::max(rows->out_first - t0, 0), n - 1);
                }
                if (p0 == STC_STILL_P0_DEVICE) s->n_seen = hp + t0;
                const int rc = still_forward(ctx, s, params_dev, q + (size_t)t0 * ldq, k + (size_t)t0 * ldkv,
                                             v + (size_t)t0 * ldkv, x_bf16 ? x_bf16 + (size_t)t0 * s->d : NULL, n,
                                             p0 == STC_STILL_P0_DEVICE ? p0 : p0 + t0, out + (size_t)t0 * HD, out_bf16 ? out_bf16 + (size_t)t0 * HD : NULL,
                                             rows ? &seg : NULL, err);
                if (rc) return rc;
                t0 += n;
            }
            return STILL_OK;
        }
    }

    int rc = ws_reserve(ctx, s, T, err);
    if (rc) return rc;
    stc_still_ws *w = s->ws;

    args a;
    memset(&a, 0, sizeof a);
    a.H = s->H, a.Hk = s->Hk, a.G = s->G, a.D = s->D, a.C = s->C, a.P = s->P, a.Hs = s->Hs, a.d = s->d;
    a.lam = s->lam, a.cap = s->cap, a.sel_rows = s->sel_rows;
    a.fd_c = make_fast_div(s->C), a.fd_rt = make_fast_div(row_tiles(s->C));
    a.per_kv = cfg->per_kv_head != 0, a.routing = cfg->routing, a.linear = cfg->linear != 0;
    a.gate = cfg->linear && cfg->gate;
    a.gate_den = a.gate && cfg->gate_den;
    a.lolcats = cfg->lolcats != 0;
    a.seed = cfg->seed;
    a.scale = attn_logit_scale(s->D);
    a.scale_log2 = attn_logit_scale_log2(s->D);
    a.slot_floats = (size_t)s->H * s->P * (s->D + 1);
    a.T = T;
    a.n_seen = s->n_seen_dev;
    a.done = s->done_dev;
    a.decode_split = s->decode_split;
    a.npmap_wg = s->npmap_wg;
    a.attn_wg = s->attn_wg;
    a.q = q, a.k = k, a.v = v, a.params = params_dev, a.out = out;
    a.ldq = rows ? rows->ldq : (size_t)s->H * s->D;
    a.ldkv = rows ? rows->ldkv : (size_t)s->Hk * s->D;
    a.ldpre = rows && rows->pre ? rows->ldpre : (size_t)s->H * s->D;
    a.k_f16 = rows ? rows->k_f16 : NULL, a.v_f16 = rows ? rows->v_f16 : NULL;
    a.out_first = rows ? rows->out_first : 0;
    a.ring_k = s->ring_k, a.ring_v = s->ring_v, a.lin = s->lin, a.ring_sc = s->ring_sc;
    a.sel_k = s->sel_k, a.sel_v = s->sel_v, a.sel_pos = s->sel_pos;
    a.sel_q8 = s->sel_q8;
    a.sel_k8 = s->sel_k8, a.sel_v8 = s->sel_v8, a.sel_ks = s->sel_ks, a.sel_vs = s->sel_vs;
    a.ev_k8 = s->ev_k8, a.ev_v8 = s->ev_v8, a.ev_ks = s->ev_ks, a.ev_vs = s->ev_vs;
    a.sel_global = cfg->sel_global != 0;
    a.sel_span = cfg->sel_span;
    a.sel_sc = s->sel_sc, a.sel_order = s->sel_order, a.ev_k = s->ev_k, a.ev_v = s->ev_v, a.ev_n = s->ev_n;
    a.g_picked = s->g_picked;
    a.sc = (double *)w->buf[WS_SC], a.slots = (float *)w->buf[WS_SLOTS], a.lbuf = (float *)w->buf[WS_LBUF];
    a.pre = (const float *)w->buf[WS_PRE];

    /* 1. gate pre-activations: x · Wgᵀ (bf16 GEMM, fp32 out); the bias and σ come in the linear kernel
     * (a decode step: computed by the caller, if it said where) */
    if (a.gate && rows && rows->pre) {
        a.pre = rows->pre;
    } else if (a.gate && T == 1 && s->decode_pre) {
        if ((uintptr_t)s->decode_pre % 8)   /* the linear kernel reads pairs */
            return stc_fail(err, STILL_E_ARG, "still: the decode gate pre-activations must be 8-byte aligned");
        a.pre = s->decode_pre;
    } else if (a.gate) {
        const int HD = s->H * s->D;
        const stc_bf16 *wg = s->wg_user;
        if (!wg) {
            wg = (const stc_bf16 *)w->buf[WS_WG];
            rc = stc_f32_to_bf16(ctx, params_dev + par_wg(a), (stc_bf16 *)wg, (int64_t)HD * s->d, err);
            if (rc) return rc;
        }
        rc = stc_gemm_bf16(ctx, T, HD, s->d, x_bf16, wg, (float *)a.pre, 0.0f, err);
        if (rc) return rc;
    }
    /* 2. routing scores (qk adds into zeroed scores; none needed when nothing is ever selected) */
    const bool decode = T == 1 && !s->no_decode_kernels;
    a.out_bf16 = decode ? NULL : (bf16 *)out_bf16;   /* a decode step converts after its kernel */
    if (s->lam > 0 && !(decode && decode_fuses_score(a))) {
        if (a.routing == R_QK) STC_CUDA(err, cudaMemsetAsync(a.sc, 0, (size_t)s->H * T * sizeof(double), ctx->stream));
        if ((rc = decode ? launch_score_decode(ctx, a, err) : launch_score(ctx, a, err))) return rc;
    }
    /* 3, 4. leaving chunks: selection and folds; prefix sums (a decode step: unless the caller said no
     * chunk leaves, the kernels find out themselves and return) */
    /* (a long chunk-parallel call with the linear branch: the scan runs on the side stream beside the
     * attention kernel, which reads neither the folds nor the prefix slots; joined before the linear kernel.
     * Prefill at 16K: +2%. Not for shorter calls: training's 1,024-token sequences already run several
     * layers' students side by side, and the fork there measured 219.8k against 231.5k tokens/s.) */
    const bool fork = !decode && a.linear && T >= kSideScanMinTokens;
    /* a long call: the feature maps' W split once for the leave and linear kernels' blocks */
    if (!decode && a.linear && T >= kWImageMinTokens) {
        unsigned char *img = (unsigned char *)w->buf[WS_WIMG];
        if ((rc = launch_wimage(ctx, a, img, err))) return rc;
        a.wimg = img;
    }
    if (!(decode && s->decode_no_leave)) {
        if (a.sel_global) {
            if ((rc = launch_global_leave(ctx, a, err))) return rc;
        } else if ((s->lam > 0 || a.linear) && (rc = launch_leave(ctx, a, err))) {
            return rc;
        }
        if (fork) {
            STC_CUDA(err, cudaEventRecord(ctx->fork_ev, ctx->stream));
            STC_CUDA(err, cudaStreamWaitEvent(ctx->side, ctx->fork_ev, 0));
            /* from here on the side stream is joined back whatever fails (a graph capture must end joined,
             * and the caller's clean-up waits on the main stream only) */
            rc = launch_scan(ctx, a, err, ctx->side);
            const cudaError_t e = cudaEventRecord(ctx->join_ev, ctx->side);
            if (!rc) rc = launch_attn(ctx, a, err);
            const cudaError_t e2 = e == cudaSuccess ? cudaStreamWaitEvent(ctx->stream, ctx->join_ev, 0) : e;
            if (rc) return rc;
            if (e2 != cudaSuccess) return stc_cuda_fail(err, e2, "cudaEventRecord / cudaStreamWaitEvent (still scan join)",
                                                        __FILE__, __LINE__);
        } else if (a.linear && (rc = launch_scan(ctx, a, err))) {
            return rc;
        }
    }
    /* 5, 6, 7. outputs, then the state update and the position (a decode step: in its last kernel) */
    if (decode) {
        if ((rc = launch_attn_linear_decode(ctx, a, (float *)w->buf[WS_PART], err))) return rc;
        if (out_bf16 && (rc = stc_f32_to_bf16(ctx, out, out_bf16, (int64_t)s->H * s->D, err))) return rc;
    } else {
        if (!fork && (rc = launch_attn(ctx, a, err))) return rc;   /* (forked: launched beside the scan above) */
        if (a.linear && (rc = launch_linear(ctx, a, err))) return rc;
        if ((rc = launch_finish(ctx, a, err))) return rc;
    }
    s->n_seen = p0 == STC_STILL_P0_DEVICE ? -1 : s->n_seen + T;
    return STILL_OK;
}

int stc_still_forward(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *q, const float *k,
                      const float *v, const stc_bf16 *x_bf16, int T, int p0, float *out, still_err *err) {
    return still_forward(ctx, s, params_dev, q, k, v, x_bf16, T, p0, out, NULL, NULL, err);
}

int stc_still_forward_bf16(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *q, const float *k,
                           const float *v, const stc_bf16 *x_bf16, int T, int p0, float *out, stc_bf16 *out_bf16,
                           still_err *err) {
    if (!out_bf16 && T > 0) return stc_fail(err, STILL_E_ARG, "stc_still_forward_bf16: NULL bf16 outputs");
    return still_forward(ctx, s, params_dev, q, k, v, x_bf16, T, p0, out, out_bf16, NULL, err);
}

int stc_still_forward_qkv(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *qkv, int64_t ld, int T,
                          int out_first, int p0, float *out, stc_bf16 *out_bf16, const stc_f16 *k_f16,
                          const stc_f16 *v_f16, still_err *err) {
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_still_forward_qkv: NULL state");
    if (T > 0 && (out_first < 0 || out_first >= T))
        return stc_fail(err, STILL_E_ARG, "stc_still_forward_qkv: first output row %d of %d", out_first, T);
    const int64_t HD = (int64_t)s->H * s->D, KD = (int64_t)s->Hk * s->D;
    const bool gate = s->cfg.linear && s->cfg.gate;
    const int64_t width = HD + 2 * KD + (gate ? HD : 0);
    if (ld < width || ld % 4 || HD % 4 || KD % 4)
        return stc_fail(err, STILL_E_ARG,
                        "stc_still_forward_qkv: row stride %lld (needs a multiple of 4, at least q|k|v%s = %lld)",
                        (long long)ld, gate ? "|gate" : "", (long long)width);
    if (!qkv) return stc_fail(err, STILL_E_ARG, "stc_still_forward_qkv: NULL input");
    if ((!k_f16) != (!v_f16))
        return stc_fail(err, STILL_E_ARG, "stc_still_forward_qkv: the half copies of k and v go together (one is NULL)");
    if (!aligned16(k_f16) || !aligned16(v_f16))
        return stc_fail(err, STILL_E_ARG, "stc_still_forward_qkv: the half copies of k and v must be 16-byte aligned");
    const input_rows rows = {(size_t)ld, (size_t)ld, (size_t)ld, gate ? qkv + HD + 2 * KD : NULL,
                             (const __half *)k_f16, (const __half *)v_f16, out_first};
    return still_forward(ctx, s, params_dev, qkv, qkv + HD, qkv + HD + KD, NULL, T, p0, out, out_bf16, &rows, err);
}
