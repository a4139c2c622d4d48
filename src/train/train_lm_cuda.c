/* Stage 2 on the GPU (see train_lm_cuda.h): src/train/train_lm.c's forward and
 * backward with the CUDA backend's products and kernels. */
#include "kinds/attn_rules.h"
#include "train/train_lm_cuda.h"

#include "kinds/attn.h"
#include "kinds/still/attn_still.h"
#include "kinds/still/attn_still_rules.h"
#include "common/common.h"
#include "model/model.h"
#include "cpu/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifndef STILL_HAVE_CUDA

int lm_train_cuda_create(const still_model *m, const lora_set *lora, int max_T, int max_B, float dropout, int exact,
                         lm_train_cuda **out, still_err *err) {
    (void)m, (void)lora, (void)max_T, (void)max_B, (void)dropout, (void)exact;
    *out = NULL;
    return still_fail(err, STILL_E_UNSUPPORTED,
                      "this build has no CUDA backend (build where nvcc is found, or configure with -DSTILL_CUDA=ON)");
}
void lm_train_cuda_free(lm_train_cuda *t) { (void)t; }
int lm_train_cuda_seq(lm_train_cuda *t, const int32_t *tok, const float *w, int T, float scale, uint64_t drop_seed,
                      const lm_grads *g, double *loss_sum, double *w_sum, still_err *err) {
    (void)t, (void)tok, (void)w, (void)T, (void)scale, (void)drop_seed, (void)g, (void)loss_sum, (void)w_sum;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int lm_train_cuda_batch(lm_train_cuda *t, const int32_t *const *tok, const float *const *w, int B, int T, float scale,
                        const uint64_t *drop_seeds, const lm_grads *g, double *loss_sum, double *w_sum, still_err *err) {
    (void)t, (void)tok, (void)w, (void)B, (void)T, (void)scale, (void)drop_seeds, (void)g, (void)loss_sum, (void)w_sum;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}

#else

#include "still_cuda.h"


/* ---- the kinds the GPU fine-tune runs: one row per kind, as src/kinds/attn.c's table is for the CPU ----
 * Three families of kernels: softmax's (softmax and swa: the dense form in exact mode, the flash kernels in bf16
 * mode), the still kernels' (still, and lolcats as their mode: the dense form, or still's fused bf16 form) and
 * gdn's (its chunked forward and reverse recurrence, fp32, a sequence at a time: cuda/kinds/gdn/attn_gdn.cu).
 * The rest of this file asks the table, never the kind. */
typedef enum { LM_FAMILY_NONE = 0, LM_FAMILY_SOFTMAX, LM_FAMILY_STILL, LM_FAMILY_GDN } lm_family;
typedef struct {
    lm_family family;
    int nope;           /* reads q and k before RoPE: its backward's dq, dk are already with respect to them */
    int windowed;       /* softmax family: the layer's window limits the keys (swa) */
    int lolcats_mode;   /* still family: the still kernels' lolcats mode (no selection, Hedgehog maps) */
    int fused_bf16;     /* still family: has a fused form, run in bf16 mode at head dim 64 */
    /* STILL_OK when the GPU fine-tune runs layer l of this kind for sequences of max_T tokens, else a one-line
     * error saying what it does not run */
    int (*check)(const attn_config *ac, int l, int max_T, still_err *err);
    int (*forward)(lm_train_cuda *t, int l, int T, int route_now, still_err *err);
    int (*backward)(lm_train_cuda *t, int l, int T, still_err *err);
} lm_gpu_kind;
static const lm_gpu_kind *lm_gpu_kind_of(int kind);

/* Logit rows per cross-entropy block: about 64 MiB of fp32 logits (as the CPU's ce_rows). */
static int ce_rows_gpu(int n_vocab) {
    int r = (int)((64u << 20) / (sizeof(float) * (size_t)(n_vocab > 0 ? n_vocab : 1)));
    return r < 32 ? 32 : r > 1024 ? 1024 : r;
}

typedef struct {
    void *w[LORA_N_TARGETS];       /* the frozen matrices [n_out][n_in] (bf16, or fp32 when exact), by lora_target */
    float *attn_norm, *ffn_norm;
    float *sparams;                /* a still, lolcats or gdn layer's parameters (fp32), NULL for the other kinds */
    stc_gdn *gdn;                  /* a gdn layer's state and training workspace */
    size_t n_sparams;
    float *sgrad;                  /* --train-attn: their gradient (NULL until a batch asks for it) */
} gpu_train_layer;

/* A recorded batch: its shape and variant. */
typedef struct {
    int T, B, has_w, train, grads, attn, runs;   /* runs: eager runs so far (recorded at the second) */
    stc_graph *graph;
} seq_graph;
enum { N_SEQ_GRAPHS = 8 };

struct lm_train_cuda {
    const still_model *m;
    const lora_set *lora;          /* host: the master weights (read at every batch) */
    int max_T, max_B, ce_rows;
    int B;                         /* the batch being enqueued: B sequences of T tokens, rows b·T + t */
    int nz;                        /* softmax and swa layers: (sequence, KV head) blocks per attention launch */
    int snb;                       /* still and lolcats layers: sequences per launch */
    float dropout;
    int exact;                     /* frozen weights and their products in fp32 (tests) instead of bf16 */
    int use_graphs;                /* record each sequence variant as a CUDA graph at its second run */
    int attn_train;                /* a batch asked for the kinds' parameter gradients: their host copies change, so
                                    * every batch from then on uploads them */
    int attn_grads;                /* the batch being enqueued computes them (into L[l].sgrad) */
    float *sdupart;                /* --train-attn: the NP-Map ∂/∂u's block partials [STC_NPMAP_BLOCKS][head dim] */
    stc_ctx *dev;
    gpu_train_layer *L;
    void *output;                  /* LM head [V][d] (bf16, or fp32 when exact) */
    float *output_norm;
    /* LoRA on the device: A and B of every (layer, target), then their gradients, same layout */
    float *lora_w, *lora_g;
    size_t lora_n, lora_off_a[64 * LORA_N_TARGETS], lora_off_b[64 * LORA_N_TARGETS];
    float *lora_host;              /* lora_n floats: the gradients' download */
    /* activations (every row buffer holds max_B sequences one after another) */
    float *X;                      /* layer inputs [n_layer + 1][max_B · max_T][d] */
    float *h1, *r1, *q, *k, *v, *att, *xm, *h2, *r2, *g, *u, *act;
    float *xd[LORA_N_TARGETS], *U[LORA_N_TARGETS];
    stc_bf16 *xb;                  /* a product's bf16 input [max_T][widest] */
    /* gradients */
    float *dx, *dxm, *dh, *dq, *dk, *dv, *datt, *dact, *dg, *du, *dtmp, *dU;
    /* attention scratch: P and dP (softmax and swa: [nz][G·max_T][max_T]; still: [snb][max_T][max_T]), δ [max_B·H·max_T];
     * softmax and swa: q, k, v, the output and the gradients head-major ([B][H][T][D]) */
    float *P, *dP, *delta;
    /* softmax and swa layers fused (bf16 mode, head dim 64: cuda/kinds/softmax/attn_softmax_train.cu): each row's log-sum-exp
     * [max_B][H][max_T] from the forward (the backward's recomputation) for the backward; no T × T scratch */
    int fused;
    float *lse, *kbar;             /* kbar: the keys' mean per (sequence, KV head) [max_B][Hk][D], the backward's scratch */
    float *Qh, *Kh, *Vh, *Oh, *dOh, *dQh, *dKh, *dVh;
    /* still layers (the layer densely per query head, snb sequences at a time: train_lm_still.cu), each for snb
     * sequences one after another: L and dL [max_T][max_T], φq, φk and their gradients [max_T][2D], a = L V, dN, dA
     * [max_T][D], l, b, dl, db [max_T], the arg-max [max_T], the gate and its pre-activation gradient [max_T][H·D],
     * the routing of every layer and sequence [n_layer][max_B][Hs][max_T] (the forward's, read again by the
     * backward: the same inputs give the same routing); the routing scores of one sequence [Hs][max_T] */
    float *sL, *sdL, *phq, *phk, *dphq, *dphk, *sa, *sdN, *sdA, *sl, *sb, *sdl, *sdb, *sgate, *sdpre;
    int *sam, *route;
    /* still layers fused (bf16 mode, head dim 64: cuda/kinds/still/attn_still_train.cu), the whole batch in one pass: φq, φk
     * and their gradients [H][max_B·max_T][2D], a, dN, dA [max_B·max_T][H·D], the row values m, l, b, dl, db, ρ
     * and the arg-max [max_B][H][max_T] (sm, sl, sb, sdl, sdb, srho, sam); lolcats layers keep the dense form */
    int sfused;
    float *sm, *srho;
    int *sfar, *sfarn;             /* the keys still soft past Local, per (sequence, KV head) [max_B][Hk][max_T] and their counts */
    double *score;
    /* cross-entropy */
    float *logits, *hn, *rn, *dhn, *wdev;
    stc_bf16 *logits_b;
    int32_t *tok_dev;
    double *loss_dev, *loss_host;
    uint64_t *seed_dev;            /* the sequences' dropout seeds [max_B] */
    float *scale_dev;              /* the batch's loss scale */
    seq_graph graphs[N_SEQ_GRAPHS];
    float *x0_host;                /* the embeddings' rows on the host [max_B · max_T][d] */
    float *w_host;                 /* the loss weights [max_B · max_T] */
    void **allocs;                 /* every device allocation above, freed together */
    int n_allocs;
};

static const weight_matrix *layer_matrix(const layer_weights *L, lora_target t) {
    switch (t) {
    case LORA_Q: return &L->wq;
    case LORA_K: return &L->wk;
    case LORA_V: return &L->wv;
    case LORA_O: return &L->wo;
    case LORA_GATE: return &L->w_gate;
    case LORA_UP: return &L->w_up;
    default: return &L->w_down;
    }
}

void lm_train_cuda_free(lm_train_cuda *t) {
    if (!t) return;
    for (int i = 0; i < N_SEQ_GRAPHS; i++) stc_graph_free(t->graphs[i].graph);
    for (int l = 0; t->L && l < t->m->cfg.n_layer; l++) stc_gdn_free(t->L[l].gdn);
    for (int i = 0; i < t->n_allocs; i++) stc_free(t->dev, t->allocs[i]);
    if (t->dev) stc_ctx_free(t->dev);
    free(t->allocs), free(t->L), free(t->lora_host), free(t->loss_host), free(t->x0_host), free(t->w_host);
    free(t);
}

/* A device allocation that lm_train_cuda_free releases. */
static int dalloc(lm_train_cuda *t, size_t bytes, const char *what, void **out, still_err *err) {
    void **a = realloc(t->allocs, sizeof(void *) * (size_t)(t->n_allocs + 1));
    if (!a) return still_fail(err, STILL_E_NOMEM, "out of memory");
    t->allocs = a;
    int rc = stc_malloc(t->dev, bytes ? bytes : 16, what, out, err);
    if (!rc) t->allocs[t->n_allocs++] = *out;
    return rc;
}

/* A frozen matrix on the device: bf16 (dequantized there), or fp32 dequantized here when exact. */
static int upload_matrix(lm_train_cuda *t, const weight_matrix *W, void **out, still_err *err) {
    const size_t n = (size_t)W->n_out * W->n_in;
    int rc = dalloc(t, n * (t->exact ? sizeof(float) : sizeof(stc_bf16)), "frozen weight", out, err);
    if (rc) return rc;
    if (!t->exact) return stc_dequant_to_bf16(t->dev, W->type, W->data, W->n_out, W->n_in, *out, err);
    float *h = malloc(sizeof(float) * n);
    if (!h) return still_fail(err, STILL_E_NOMEM, "out of memory");
    rc = weight_rows_to_f32(W, 0, W->n_out, h, err);
    if (!rc) rc = stc_memcpy_h2d(t->dev, *out, h, sizeof(float) * n, err);
    free(h);
    return rc;
}

int lm_train_cuda_create(const still_model *m, const lora_set *lora, int max_T, int max_B, float dropout, int exact,
                         lm_train_cuda **out, still_err *err) {
    *out = NULL;
    const model_config *c = &m->cfg;
    if (max_T < 2) return still_fail(err, STILL_E_ARG, "training sequences need at least 2 tokens, got %d", max_T);
    if (max_B < 1 || (int64_t)max_B * max_T > INT32_MAX / 64)
        return still_fail(err, STILL_E_ARG, "a batch of %d sequences of %d tokens is out of range", max_B, max_T);
    if (!(dropout >= 0 && dropout < 1)) return still_fail(err, STILL_E_ARG, "--lora-dropout must be in [0, 1), got %g", dropout);
    if (c->n_layer > 64) return still_fail(err, STILL_E_UNSUPPORTED, "the GPU fine-tune takes at most 64 layers");
    for (int l = 0; l < c->n_layer; l++) {
        const int kind = m->attn_cfg[l].kind;
        const lm_gpu_kind *gk = lm_gpu_kind_of(kind);
        if (!gk)
            return still_fail(err, STILL_E_UNSUPPORTED,
                              "still finetune --device cuda: layer %d is '%s'; the GPU fine-tune runs softmax, swa, "
                              "still, lolcats and gdn layers so far (use --device cpu)", l, attn_kind_get(kind)->name);
        int rc = gk->check ? gk->check(&m->attn_cfg[l], l, max_T, err) : STILL_OK;
        if (rc) return rc;
    }
    if (lora && lora->n_layer != c->n_layer) return still_fail(err, STILL_E_ARG, "LoRA of %d layers for a model of %d", lora->n_layer, c->n_layer);
    lm_train_cuda *t = calloc(1, sizeof *t);
    if (!t) return still_fail(err, STILL_E_NOMEM, "out of memory");
    t->m = m, t->lora = lora, t->max_T = max_T, t->max_B = max_B, t->dropout = lora ? dropout : 0;
    t->ce_rows = ce_rows_gpu(c->n_vocab);
    t->exact = exact != 0, t->use_graphs = 1;
    int rc = stc_ctx_create(0, &t->dev, err);
    if (rc) goto fail;
    const size_t T = (size_t)max_T, N = (size_t)max_B * max_T, d = c->d_model, qd = (size_t)c->n_head * c->head_dim,
                 kvd = (size_t)c->n_head_kv * c->head_dim, ff = c->d_ff, V = c->n_vocab, r = lora ? (size_t)lora->rank : 1;
    size_t wide = d > ff ? d : ff;
    wide = wide > qd ? wide : qd;
    /* the frozen weights, as bf16 */
    if (!(t->L = calloc((size_t)c->n_layer, sizeof *t->L))) { rc = still_fail(err, STILL_E_NOMEM, "out of memory"); goto fail; }
    for (int l = 0; l < c->n_layer && !rc; l++) {
        const layer_weights *LW = &m->layers[l];
        for (int tg = 0; tg < LORA_N_TARGETS && !rc; tg++) {
            rc = upload_matrix(t, layer_matrix(LW, (lora_target)tg), &t->L[l].w[tg], err);
        }
        if (!rc) rc = dalloc(t, sizeof(float) * d, "norm", (void **)&t->L[l].attn_norm, err);
        if (!rc) rc = dalloc(t, sizeof(float) * d, "norm", (void **)&t->L[l].ffn_norm, err);
        if (!rc) rc = stc_memcpy_h2d(t->dev, t->L[l].attn_norm, LW->attn_norm, sizeof(float) * d, err);
        if (!rc) rc = stc_memcpy_h2d(t->dev, t->L[l].ffn_norm, LW->ffn_norm, sizeof(float) * d, err);
        const int kd = m->attn_cfg[l].kind;
        const lm_family fam = lm_gpu_kind_of(kd)->family;
        if (!rc && (fam == LM_FAMILY_STILL || fam == LM_FAMILY_GDN)) {
            const size_t np = attn_kind_get(kd)->param_count(&m->attn_cfg[l]);
            if (np && !m->attn_params[l])
                rc = still_fail(err, STILL_E_ARG, "layer %d (%s) has no parameters", l, attn_kind_get(kd)->name);
            if (!rc) rc = dalloc(t, sizeof(float) * np, "attention parameters", (void **)&t->L[l].sparams, err);
            t->L[l].n_sparams = np;
            if (!rc && np) rc = stc_memcpy_h2d(t->dev, t->L[l].sparams, m->attn_params[l], sizeof(float) * np, err);
        }
        if (!rc && fam == LM_FAMILY_GDN) {   /* its state, and the workspace of the longest sequence before any graph */
            const attn_config *a = &m->attn_cfg[l];
            rc = stc_gdn_create(t->dev, a->n_head, a->n_head_kv, a->head_dim, a->d_model, a->norm, a->conv,
                                &t->L[l].gdn, err);
            if (!rc) rc = stc_gdn_train_reserve(t->dev, t->L[l].gdn, max_T, err);
        }
    }
    if (rc) goto fail;
    if ((rc = upload_matrix(t, &m->output, &t->output, err))) goto fail;
    if ((rc = dalloc(t, sizeof(float) * d, "norm", (void **)&t->output_norm, err))) goto fail;
    if ((rc = stc_memcpy_h2d(t->dev, t->output_norm, m->output_norm, sizeof(float) * d, err))) goto fail;
    /* LoRA: A [r][n_in] and B [n_out][r] of each target a layer has */
    if (lora) {
        size_t n = 0;
        for (int l = 0; l < c->n_layer; l++)
            for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
                const int i = l * LORA_N_TARGETS + tg;
                if (!lora_A(lora, l, (lora_target)tg)) continue;
                t->lora_off_a[i] = n, n += (size_t)lora->rank * lora->n_in[tg];
                t->lora_off_b[i] = n, n += (size_t)lora->n_out[tg] * lora->rank;
            }
        t->lora_n = n;
        if ((rc = dalloc(t, sizeof(float) * n, "LoRA", (void **)&t->lora_w, err))) goto fail;
        if ((rc = dalloc(t, sizeof(float) * n, "LoRA gradients", (void **)&t->lora_g, err))) goto fail;
        if (!(t->lora_host = malloc(sizeof(float) * (n ? n : 1)))) { rc = still_fail(err, STILL_E_NOMEM, "out of memory"); goto fail; }
    }
    /* activations and gradients */
    {
        /* softmax and swa attention: as many (sequence, KV head) blocks of G T × T scores per launch as fit in
         * 128 Mi floats (every block of the batch at once up to T = 2,048 for SmolLM2's G = 3), at least one */
        int any_soft = 0;
        for (int l = 0; l < c->n_layer; l++) any_soft |= lm_gpu_kind_of(m->attn_cfg[l].kind)->family == LM_FAMILY_SOFTMAX;
        t->fused = any_soft && !t->exact && c->head_dim == 64;
        if (t->fused) any_soft = 0;   /* none of the dense form's scratch */
        const size_t G = (size_t)(c->n_head / c->n_head_kv), blk = G * T * T, nzmax = (size_t)max_B * c->n_head_kv;
        const size_t nz = any_soft ? ((128u << 20) / blk < 1 ? 1 : (128u << 20) / blk > nzmax ? nzmax : (128u << 20) / blk) : 0;
        t->nz = (int)nz;
        /* still and lolcats layers: as many sequences per launch as fit in 64 Mi floats of T × T (every sequence of
         * the batch up to T = 2,896), at least one */
        const size_t snb = (64u << 20) / (T * T) < 1 ? 1 : (64u << 20) / (T * T) > (size_t)max_B ? (size_t)max_B
                                                                                                   : (64u << 20) / (T * T);
        t->snb = (int)snb;
        /* still layers fused in bf16 mode at head dim 64; lolcats layers (and still ones otherwise) dense */
        int dense_still = 0;
        t->sfused = !t->exact && c->head_dim == 64;
        for (int l = 0; l < c->n_layer; l++)
            dense_still |= lm_gpu_kind_of(m->attn_cfg[l].kind)->family == LM_FAMILY_STILL &&
                           !(lm_gpu_kind_of(m->attn_cfg[l].kind)->fused_bf16 && t->sfused);
        const size_t Ps = dense_still ? snb * T * T : 0, Psz0 = nz * blk > Ps ? nz * blk : Ps, Psz = Psz0 ? Psz0 : 1;
        const size_t hq = any_soft ? N * qd : 1, hk = any_soft ? N * kvd : 1;
        struct { float **p; size_t n; } fl[] = {
            {&t->X, ((size_t)c->n_layer + 1) * N * d},
            {&t->h1, N * d}, {&t->r1, N}, {&t->q, N * qd}, {&t->k, N * kvd}, {&t->v, N * kvd}, {&t->att, N * qd},
            {&t->xm, N * d}, {&t->h2, N * d}, {&t->r2, N}, {&t->g, N * ff}, {&t->u, N * ff}, {&t->act, N * ff},
            {&t->dx, N * d}, {&t->dxm, N * d}, {&t->dh, N * d}, {&t->dq, N * qd}, {&t->dk, N * kvd},
            {&t->dv, N * kvd}, {&t->datt, N * qd}, {&t->dact, N * ff}, {&t->dg, N * ff}, {&t->du, N * ff},
            {&t->dtmp, N * wide}, {&t->dU, N * r},
            {&t->P, Psz}, {&t->dP, Psz}, {&t->delta, N * c->n_head}, {&t->lse, N * c->n_head}, {&t->kbar, kvd * max_B},
            {&t->Qh, hq}, {&t->Kh, hk}, {&t->Vh, hk}, {&t->Oh, hq}, {&t->dOh, hq}, {&t->dQh, hq}, {&t->dKh, hk},
            {&t->dVh, hk},
            {&t->logits, (size_t)t->ce_rows * V}, {&t->hn, (size_t)t->ce_rows * d}, {&t->rn, (size_t)t->ce_rows},
            {&t->dhn, (size_t)t->ce_rows * d}, {&t->wdev, N},
        };
        for (size_t i = 0; i < sizeof fl / sizeof fl[0] && !rc; i++)
            rc = dalloc(t, sizeof(float) * fl[i].n, "training activations", (void **)fl[i].p, err);
        for (int tg = 0; tg < LORA_N_TARGETS && !rc && lora; tg++) {
            if (!(lora->targets >> tg & 1)) continue;
            rc = dalloc(t, sizeof(float) * N * r, "LoRA activations", (void **)&t->U[tg], err);
            if (!rc && t->dropout > 0)
                rc = dalloc(t, sizeof(float) * N * lora->n_in[tg], "LoRA dropout", (void **)&t->xd[tg], err);
        }
        int any_still = 0;
        for (int l = 0; l < c->n_layer; l++)
            any_still |= lm_gpu_kind_of(m->attn_cfg[l].kind)->family == LM_FAMILY_STILL;
        if (any_still && !rc) {
            const size_t P = 2 * (size_t)c->head_dim, Dh = c->head_dim, Hs = c->n_head, ST = snb * T;
            /* the dense form's per-group sizes, or the fused form's whole-batch ones, whichever is larger */
            const size_t FN = t->sfused ? N : 0, SP = ST * P > FN * Hs * P ? ST * P : FN * Hs * P,
                         SD = ST * Dh > FN * qd ? ST * Dh : FN * qd, SR = ST > FN * Hs ? ST : FN * Hs,
                         SG = (ST > FN ? ST : FN) * qd, Ls = dense_still ? Ps : 1;
            struct { float **p; size_t n; } sf[] = {
                {&t->sL, Ls}, {&t->sdL, Ls}, {&t->phq, SP}, {&t->phk, SP}, {&t->dphq, SP},
                {&t->dphk, SP}, {&t->sa, SD}, {&t->sdN, SD}, {&t->sdA, SD}, {&t->sl, SR},
                {&t->sb, SR}, {&t->sdl, SR}, {&t->sdb, SR}, {&t->sgate, SG}, {&t->sdpre, SG},
                {&t->sm, t->sfused ? SR : 1}, {&t->srho, t->sfused ? SR : 1},
            };
            for (size_t i = 0; i < sizeof sf / sizeof sf[0] && !rc; i++)
                rc = dalloc(t, sizeof(float) * sf[i].n, "still training scratch", (void **)sf[i].p, err);
            if (!rc) rc = dalloc(t, sizeof(int) * SR, "still training scratch", (void **)&t->sam, err);
            if (!rc) rc = dalloc(t, sizeof(int) * (t->sfused ? kvd / Dh * N : 1), "still training scratch",
                                 (void **)&t->sfar, err);
            if (!rc) rc = dalloc(t, sizeof(int) * (t->sfused ? kvd / Dh * max_B : 1), "still training scratch",
                                 (void **)&t->sfarn, err);
            /* every layer's routing, kept from the forward for the backward [n_layer][max_B][Hs][max_T] */
            if (!rc)
                rc = dalloc(t, sizeof(int) * (size_t)c->n_layer * max_B * Hs * T, "still routing", (void **)&t->route,
                            err);
            if (!rc) rc = dalloc(t, sizeof(double) * Hs * T, "still routing scores", (void **)&t->score, err);
        }
        if (!rc) rc = dalloc(t, sizeof(stc_bf16) * N * wide, "bf16 inputs", (void **)&t->xb, err);
        if (!rc) rc = dalloc(t, sizeof(stc_bf16) * (size_t)t->ce_rows * V, "bf16 logits", (void **)&t->logits_b, err);
        if (!rc) rc = dalloc(t, sizeof(int32_t) * N, "tokens", (void **)&t->tok_dev, err);
        if (!rc) rc = dalloc(t, sizeof(double) * N, "losses", (void **)&t->loss_dev, err);
        if (!rc) rc = dalloc(t, sizeof(uint64_t) * (size_t)max_B, "seeds", (void **)&t->seed_dev, err);
        if (!rc) rc = dalloc(t, sizeof(float), "scale", (void **)&t->scale_dev, err);
        if (rc) goto fail;
    }
    if (!(t->loss_host = malloc(sizeof(double) * N)) || !(t->x0_host = malloc(sizeof(float) * N * d)) ||
        !(t->w_host = malloc(sizeof(float) * N))) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        goto fail;
    }
    if ((rc = stc_ctx_sync(t->dev, err))) goto fail;
    *out = t;
    return STILL_OK;
fail:
    lm_train_cuda_free(t);
    return rc;
}

/* ---- pieces ---------------------------------------------------------------------------- */

/* Y [T][n_out] = X [T][n_in] Wᵀ (beta 0), or with back, dX [T][n_in] += dY [T][n_out] W: the frozen product,
 * through bf16 copies of X or dY (xb; xb_ready: already there) or, exact, in fp32. */
static int frozen_product(lm_train_cuda *t, const void *W, int back, int T, int ni, int no, const float *x, int xb_ready,
                          float *y, still_err *err) {
    const int n_x = back ? no : ni, n_y = back ? ni : no;
    if (t->exact)
        return back ? stc_gemm_rm(t->dev, 0, 0, T, ni, no, 1.0f, x, no, W, ni, 1.0f, y, ni, 0, 0, err)
                    : stc_gemm_rm(t->dev, 0, 1, T, no, ni, 1.0f, x, ni, W, ni, 0.0f, y, no, 0, 0, err);
    int rc;
    if (!xb_ready && (rc = stc_f32_to_bf16(t->dev, x, t->xb, (int64_t)T * n_x, err))) return rc;
    (void)n_y;
    return back ? stc_gemm_rm(t->dev, 0, 0, T, ni, no, 1.0f, t->xb, no, W, ni, 1.0f, y, ni, 1, 0, err)
                : stc_gemm_rm(t->dev, 0, 1, T, no, ni, 1.0f, t->xb, ni, W, ni, 0.0f, y, no, 1, 0, err);
}

/* The dropout salt of layer l's target tg (src/train/train_lm.c's). */
static uint64_t drop_salt(int l, lora_target tg) { return (uint64_t)(l * LORA_N_TARGETS + tg) + 1; }

/* y [B·T][n_out] = x Wᵀ (+ LoRA); xb_ready: x's bf16 copy is already in t->xb. y NULL: only the LoRA input and
 * U = x̃ Aᵀ (the backward's). */
static int project(lm_train_cuda *t, int l, lora_target tg, const float *x, int xb_ready, float *y, int T, int train,
                   still_err *err) {
    const weight_matrix *W = layer_matrix(&t->m->layers[l], tg);
    const int ni = (int)W->n_in, no = (int)W->n_out, N = t->B * T;
    int rc;
    if (y && (rc = frozen_product(t, t->L[l].w[tg], 0, N, ni, no, x, xb_ready, y, err))) return rc;
    const lora_set *s = t->lora;
    if (!s || !lora_A(s, l, tg)) return STILL_OK;
    const int r = s->rank, i = l * LORA_N_TARGETS + tg;
    const float *xd = x;
    if (t->dropout > 0 && train) {
        if ((rc = stc_dropout(t->dev, x, t->xd[tg], (int64_t)N * ni, (int64_t)T * ni, t->dropout, t->seed_dev,
                              drop_salt(l, tg), err)))
            return rc;
        xd = t->xd[tg];
    }
    const float *A = t->lora_w + t->lora_off_a[i], *B = t->lora_w + t->lora_off_b[i];
    if ((rc = stc_gemm_rm(t->dev, 0, 1, N, r, ni, 1.0f, xd, ni, A, ni, 0.0f, t->U[tg], r, 0, 0, err))) return rc;
    if (y && (rc = stc_gemm_rm(t->dev, 0, 1, N, no, r, lora_scale(s), t->U[tg], r, B, r, 1.0f, y, no, 0, 0, err)))
        return rc;
    return STILL_OK;
}

/* dx [B·T][n_in] += dy W (+ the LoRA's part through the dropout mask); dA, dB into the device gradients. x: the
 * LoRA's undropped input (with dropout the forward's x̃, recomputed with the layer, is used). */
static int project_bwd(lm_train_cuda *t, int l, lora_target tg, const float *x, const float *dy, float *dx, int T,
                       int want_grads, still_err *err) {
    const weight_matrix *W = layer_matrix(&t->m->layers[l], tg);
    const int ni = (int)W->n_in, no = (int)W->n_out, N = t->B * T;
    int rc;
    if ((rc = frozen_product(t, t->L[l].w[tg], 1, N, ni, no, dy, 0, dx, err))) return rc;
    const lora_set *s = t->lora;
    if (!s || !lora_A(s, l, tg)) return STILL_OK;
    const int r = s->rank, i = l * LORA_N_TARGETS + tg;
    const float sc = lora_scale(s);
    const float *A = t->lora_w + t->lora_off_a[i], *B = t->lora_w + t->lora_off_b[i];
    float *dA = t->lora_g + t->lora_off_a[i], *dB = t->lora_g + t->lora_off_b[i];
    const int drop = t->dropout > 0;
    const float *xd = drop ? t->xd[tg] : x;
    /* dB [no][r] += s dyᵀ U;  dU = s dy B [T][r];  dA [r][ni] += dUᵀ x̃ */
    if (want_grads && (rc = stc_gemm_rm(t->dev, 1, 0, no, r, N, sc, dy, no, t->U[tg], r, 1.0f, dB, r, 0, 0, err))) return rc;
    if ((rc = stc_gemm_rm(t->dev, 0, 0, N, r, no, sc, dy, no, B, r, 0.0f, t->dU, r, 0, 0, err))) return rc;
    if (want_grads && (rc = stc_gemm_rm(t->dev, 1, 0, r, ni, N, 1.0f, t->dU, r, xd, ni, 1.0f, dA, ni, 0, 0, err))) return rc;
    if (!drop) return stc_gemm_rm(t->dev, 0, 0, N, ni, r, 1.0f, t->dU, r, A, ni, 1.0f, dx, ni, 0, 0, err);
    if ((rc = stc_gemm_rm(t->dev, 0, 0, N, ni, r, 1.0f, t->dU, r, A, ni, 0.0f, t->dtmp, ni, 0, 0, err))) return rc;
    return stc_dropout_bwd_acc(t->dev, dx, t->dtmp, (int64_t)N * ni, (int64_t)T * ni, t->dropout, t->seed_dev,
                               drop_salt(l, tg), err);
}

/* ---- still layers: the layer densely per query head (cuda/train/train_lm_still.cu) ----
 * With the forward's routing recorded per key (t->route: the first query chunk from which the key has left the
 * softmax part), query head h with KV head g:
 *   E = exp(s Q Kᵀ − m) on the softmax part, L = φq(Q) φk(K)ᵀ on the linear part, l, b their row sums,
 *   y = (E V + g ⊙ L V) / (l + b + 1e-6)   (gate_den: l + g b + 1e-6 per channel)
 * and the backward
 *   dN = dy / den, dA = dN ⊙ g, dl = −Σ dN ⊙ y, db = dl (gate_den: Σ dden ⊙ g), dpre = dN ⊙ a ⊙ g (1 − g) (+ dden b)
 *   dV += Eᵀ dN + Lᵀ dA,  dS = E ⊙ (dN Vᵀ + dl) (the maximum's share to its key),  dQ = s dS K,  dK += s dSᵀ Q
 *   dL = (dA Vᵀ + db) on the linear part,  dφq = dL φk,  dφk = dLᵀ φq,  then the NP-Maps' backward into dQ, dK
 *   and the gate's dx = dpre W_g. */

typedef struct {
    int C, H, Hk, D, G, Hs, linear, gate, gate_den;
    int lolcats;            /* lolcats as the same form: no selection (every key folds), Hedgehog maps, γ, no gate */
    int per_kv;             /* the routing has a row per KV head (else per query head) */
    const int *route;       /* the group's routing [nb][Hs][T] (device) */
    const float *Wg, *bg;   /* device */
} still_geom;

/* Query head h's feature maps (device pointers; u NULL: Hedgehog) and its window factor's parameter (lolcats' w_h,
 * γ = σ(w_h), read on the device so that a recorded graph sees its current value; NULL for still). */
static void head_maps(const lm_train_cuda *t, int l, const still_geom *sg, int h, const float **qu, const float **qW,
                      const float **ku, const float **kW, const float **wfac) {
    const float *sp = t->L[l].sparams;   /* the layout: src/kinds/still/attn_still_rules.h (F = D on the GPU) */
    const int H = sg->H, D = sg->D;
    if (sg->lolcats) {
        *qu = *ku = NULL;
        *qW = sp + lolcats_par_w(H, D, D, 0, h), *kW = sp + lolcats_par_w(H, D, D, 1, h);
        *wfac = sp + lolcats_par_factor(H, D, D, h);
        return;
    }
    *qu = sp + still_par_u(H, D, 0, h), *ku = sp + still_par_u(H, D, 1, h);
    *qW = sp + still_par_w(H, D, D, 0, 0, h), *kW = sp + still_par_w(H, D, D, 0, 1, h);
    *wfac = NULL;
}

/* Sequences b0 .. b0 + nb − 1 of the batch's buffers (the still layers run snb sequences at a time): the first's
 * rows; sequence i's are T rows further on each. */
typedef struct {
    int nb;
    float *q, *k, *v, *att, *datt, *dq, *dk, *dv, *h1, *dh;
} seq_rows;

static seq_rows seq_view(const lm_train_cuda *t, int b0, int nb, int T) {
    const model_config *c = &t->m->cfg;
    const size_t oq = (size_t)b0 * T * c->n_head * c->head_dim, okv = (size_t)b0 * T * c->n_head_kv * c->head_dim,
                 od = (size_t)b0 * T * c->d_model;
    return (seq_rows){.nb = nb, .q = t->q + oq, .k = t->k + okv, .v = t->v + okv, .att = t->att + oq,
                      .datt = t->datt + oq, .dq = t->dq + oq, .dk = t->dk + okv, .dv = t->dv + okv, .h1 = t->h1 + od,
                      .dh = t->dh + od};
}

/* The layer's geometry; with route_now, the routing of the group's sequences (from b0) into layer l's part of
 * t->route ([b][Hs][T]), which the backward (route_now 0) reads again. */
static int still_layer_geom(const lm_train_cuda *t, int l, int T, const seq_rows *sv, int b0, int route_now,
                            still_geom *sg, still_err *err) {
    const attn_config *ac = &t->m->attn_cfg[l];
    int *route = t->route + (size_t)l * t->max_B * t->m->cfg.n_head * T;   /* layer l's, sequence b at b·Hs·T */
    if (lm_gpu_kind_of(ac->kind)->lolcats_mode) {
        const int H = ac->n_head, Hk = ac->n_head_kv, C = ac->chunk, nc = (T + C - 1) / C;
        route += (size_t)b0 * Hk * T;
        *sg = (still_geom){.C = C, .H = H, .Hk = Hk, .D = ac->head_dim, .G = H / Hk, .Hs = Hk, .linear = nc > 2,
                           .lolcats = 1, .per_kv = 1, .route = route};
        return route_now ? stc_still_lm_route_fold(t->dev, T, C, sv->nb * Hk, route, err) : STILL_OK;
    }
    attn_config cfg = *ac;
    cfg.n_ctx = T;
    int lam, capped, cap;
    int rc = attn_still_routing(&cfg, &lam, &capped, &cap, err);
    if (rc) return rc;
    const int H = ac->n_head, Hk = ac->n_head_kv, D = ac->head_dim, C = ac->chunk, nc = (T + C - 1) / C;
    *sg = (still_geom){.C = C, .H = H, .Hk = Hk, .D = D, .G = H / Hk, .Hs = ac->per_kv_head ? Hk : H,
                       .linear = ac->linear && nc > 2, .per_kv = ac->per_kv_head != 0};
    sg->gate = sg->linear && ac->gate, sg->gate_den = sg->gate && ac->gate_den;
    if (sg->gate) {
        /* the gate's place in the parameters, by attn_still.c's own layout (host pointers turned into offsets) */
        const float *Wg, *bg;
        if (!attn_still_gate(ac, t->m->attn_params[l], &Wg, &bg) || ac->d_model != t->m->cfg.d_model)
            return still_fail(err, STILL_E_ARG, "layer %d (still): no gate where the plan has one", l);
        sg->Wg = t->L[l].sparams + (Wg - t->m->attn_params[l]), sg->bg = t->L[l].sparams + (bg - t->m->attn_params[l]);
    }
    route += (size_t)b0 * sg->Hs * T;
    sg->route = route;
    /* the routing of each sequence, once per step: the backward's recomputed q, k are the forward's, bit for bit */
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D;
    for (int i = 0; i < sv->nb && route_now && !rc; i++)
        rc = stc_still_lm_route(t->dev, sv->q + (size_t)i * T * qd, sv->k + (size_t)i * T * kvd, T, H, Hk, D, C,
                                ac->per_kv_head, ac->sel_global, lam, capped, cap, t->score,
                                route + (size_t)i * sg->Hs * T, err);
    return rc;
}

/* Head h of the group's sequences: E (t->P, [nb][T][T]) with l, am; with the linear part φq, φk, L (t->sL) with
 * b, and a = L V (t->sa). */
static int still_head(lm_train_cuda *t, int l, const still_geom *sg, const seq_rows *sv, int h, int T, still_err *err) {
    const int D = sg->D, qd = sg->H * D, kvd = sg->Hk * D, g = h / sg->G, hs = sg->per_kv ? g : h, nb = sv->nb;
    const int tf = !t->exact, P = 2 * D;
    const int64_t TT = (int64_t)T * T, sq = (int64_t)T * qd, skv = (int64_t)T * kvd, sr = (int64_t)sg->Hs * T;
    const int *route = sg->route + (size_t)hs * T;
    const float *qu, *qW, *ku, *kW, *wfac;
    head_maps(t, l, sg, h, &qu, &qW, &ku, &kW, &wfac);
    int rc = stc_gemm_rm_batched(t->dev, 0, 1, T, T, D, attn_logit_scale(D), sv->q + (size_t)h * D, qd, sq,
                                 sv->k + (size_t)g * D, kvd, skv, 0.0f, t->P, T, TT, nb, 0, tf, err);
    if (!rc) rc = stc_still_lm_mask_soft(t->dev, t->P, T, TT, nb, T, sg->C, route, sr, wfac, t->sl, t->sam, err);
    if (rc || !sg->linear) return rc;
    if ((rc = stc_npmap_rows(t->dev, sv->q + (size_t)h * D, qd, nb * T, D, qu, qW, t->phq, err))) return rc;
    if ((rc = stc_npmap_rows(t->dev, sv->k + (size_t)g * D, kvd, nb * T, D, ku, kW, t->phk, err))) return rc;
    if ((rc = stc_gemm_rm_batched(t->dev, 0, 1, T, T, P, 1.0f, t->phq, P, (int64_t)T * P, t->phk, P, (int64_t)T * P,
                                  0.0f, t->sL, T, TT, nb, 0, tf, err)))
        return rc;
    if ((rc = stc_still_lm_mask_lin(t->dev, t->sL, T, TT, nb, T, sg->C, route, sr, t->sb, err))) return rc;
    return stc_gemm_rm_batched(t->dev, 0, 0, T, D, T, 1.0f, t->sL, T, TT, sv->v + (size_t)g * D, kvd, skv, 0.0f, t->sa,
                               D, (int64_t)T * D, nb, 0, tf, err);
}

/* The gate σ(h1 W_gᵀ + b_g) of every head of the group's rows into t->sgate. */
static int still_gate(lm_train_cuda *t, const still_geom *sg, const seq_rows *sv, int T, still_err *err) {
    const int HD = sg->H * sg->D, dm = t->m->cfg.d_model, n = sv->nb * T;
    int rc = stc_gemm_rm(t->dev, 0, 1, n, HD, dm, 1.0f, sv->h1, dm, sg->Wg, dm, 0.0f, t->sgate, HD, 0, !t->exact, err);
    return rc ? rc : stc_sigmoid_bias(t->dev, t->sgate, sg->bg, n, HD, err);
}

/* Sequences b0 .. b0 + nb − 1 of the batch. */
static int still_attn_forward_group(lm_train_cuda *t, int l, int T, int b0, int nb, int route_now,
                                    still_err *err) {
    const seq_rows sv = seq_view(t, b0, nb, T);
    still_geom sg;
    int rc = still_layer_geom(t, l, T, &sv, b0, route_now, &sg, err);
    if (rc) return rc;
    if (sg.gate && (rc = still_gate(t, &sg, &sv, T, err))) return rc;
    const int D = sg.D, qd = sg.H * D, kvd = sg.Hk * D;
    for (int h = 0; h < sg.H && !rc; h++) {
        const int g = h / sg.G;
        if ((rc = still_head(t, l, &sg, &sv, h, T, err))) break;
        if ((rc = stc_gemm_rm_batched(t->dev, 0, 0, T, D, T, 1.0f, t->P, T, (int64_t)T * T, sv.v + (size_t)g * D, kvd,
                                      (int64_t)T * kvd, 0.0f, sv.att + (size_t)h * D, qd, (int64_t)T * qd, nb, 0,
                                      !t->exact, err)))
            break;
        rc = stc_still_lm_out(t->dev, sv.att + (size_t)h * D, qd, sg.linear ? t->sa : NULL, t->sl, t->sb,
                              sg.gate ? t->sgate + (size_t)h * D : NULL, qd, sg.gate_den, nb * T, D, err);
    }
    return rc;
}

/* The group's dq, dk, dv (zeroed by the caller) from datt; the gate's part of the layer input's gradient added to
 * dh. */
static int still_attn_backward_group(lm_train_cuda *t, int l, int T, int b0, int nb, still_err *err) {
    const seq_rows sv = seq_view(t, b0, nb, T);
    still_geom sg;
    int rc = still_layer_geom(t, l, T, &sv, b0, 0, &sg, err);
    if (rc) return rc;
    const int D = sg.D, qd = sg.H * D, kvd = sg.Hk * D, P = 2 * D, tf = !t->exact, dm = t->m->cfg.d_model, n = nb * T;
    const int64_t TT = (int64_t)T * T, sq = (int64_t)T * qd, skv = (int64_t)T * kvd, sr = (int64_t)sg.Hs * T;
    const float scale = attn_logit_scale(D);
    float *pg = t->attn_grads ? t->L[l].sgrad : NULL;   /* --train-attn: this layer's parameter gradient */
    if (sg.gate && (rc = still_gate(t, &sg, &sv, T, err))) return rc;
    const size_t HD = (size_t)sg.H * D;
    for (int h = 0; h < sg.H; h++) {
        const int g = h / sg.G, hs = sg.per_kv ? g : h;
        const size_t oq = (size_t)h * D, okv = (size_t)g * D;
        if ((rc = still_head(t, l, &sg, &sv, h, T, err))) return rc;
        if ((rc = stc_still_lm_bwd_rows(t->dev, sv.datt + oq, qd, sv.att + oq, qd, sg.linear ? t->sa : NULL, t->sl,
                                        t->sb, sg.gate ? t->sgate + oq : NULL, qd, sg.gate_den, n, D, t->sdN, t->sdA,
                                        t->sdl, t->sdb, sg.gate ? t->sdpre + oq : NULL, err)))
            return rc;
        /* the softmax part: dV += Eᵀ dN, dS = E ⊙ (dN Vᵀ + dl) (+ the maximum's share), dQ = s dS K, dK += s dSᵀ Q */
        if ((rc = stc_gemm_rm_batched(t->dev, 1, 0, T, D, T, 1.0f, t->P, T, TT, t->sdN, D, (int64_t)T * D, 1.0f,
                                      sv.dv + okv, kvd, skv, nb, 0, tf, err)))
            return rc;
        if ((rc = stc_gemm_rm_batched(t->dev, 0, 1, T, T, D, 1.0f, t->sdN, D, (int64_t)T * D, sv.v + okv, kvd, skv,
                                      0.0f, t->dP, T, TT, nb, 0, tf, err)))
            return rc;
        /* lolcats' window factor w: Σ dS before the maximum's share is γ ∂L/∂γ; ∂L/∂w = that · (1 − γ) */
        const float *qu, *qW, *ku, *kW, *wfac;
        head_maps(t, l, &sg, h, &qu, &qW, &ku, &kW, &wfac);
        float *dw = pg && wfac ? pg + (wfac - t->L[l].sparams) : NULL;
        if ((rc = stc_still_lm_ds(t->dev, t->dP, t->P, T, TT, nb, T, t->sdl, t->sam, dw, wfac, err))) return rc;
        if ((rc = stc_gemm_rm_batched(t->dev, 0, 0, T, D, T, scale, t->dP, T, TT, sv.k + okv, kvd, skv, 0.0f,
                                      sv.dq + oq, qd, sq, nb, 0, tf, err)))
            return rc;
        if ((rc = stc_gemm_rm_batched(t->dev, 1, 0, T, D, T, scale, t->dP, T, TT, sv.q + oq, qd, sq, 1.0f, sv.dk + okv,
                                      kvd, skv, nb, 0, tf, err)))
            return rc;
        if (!sg.linear) continue;
        /* the linear part: dV += Lᵀ dA, dL = (dA Vᵀ + db) on it, dφq = dL φk, dφk = dLᵀ φq, the NP-Maps' backward */
        const int *route = sg.route + (size_t)hs * T;
        const int64_t sP = (int64_t)T * P, sD = (int64_t)T * D;
        if ((rc = stc_gemm_rm_batched(t->dev, 1, 0, T, D, T, 1.0f, t->sL, T, TT, t->sdA, D, sD, 1.0f, sv.dv + okv, kvd,
                                      skv, nb, 0, tf, err)))
            return rc;
        if ((rc = stc_gemm_rm_batched(t->dev, 0, 1, T, T, D, 1.0f, t->sdA, D, sD, sv.v + okv, kvd, skv, 0.0f, t->sdL,
                                      T, TT, nb, 0, tf, err)))
            return rc;
        if ((rc = stc_still_lm_dlin(t->dev, t->sdL, T, TT, nb, T, sg.C, route, sr, t->sdb, err))) return rc;
        if ((rc = stc_gemm_rm_batched(t->dev, 0, 0, T, P, T, 1.0f, t->sdL, T, TT, t->phk, P, sP, 0.0f, t->dphq, P, sP,
                                      nb, 0, tf, err)))
            return rc;
        if ((rc = stc_gemm_rm_batched(t->dev, 1, 0, T, P, T, 1.0f, t->sdL, T, TT, t->phq, P, sP, 0.0f, t->dphk, P, sP,
                                      nb, 0, tf, err)))
            return rc;
        if (!pg) {
            if ((rc = stc_npmap_bwd(t->dev, sv.q + oq, qd, n, D, qu, qW, t->dphq, sv.dq + oq, qd, err))) return rc;
            if ((rc = stc_npmap_bwd(t->dev, sv.k + okv, kvd, n, D, ku, kW, t->dphk, sv.dk + okv, kvd, err))) return rc;
            continue;
        }
        /* --train-attn: the maps' own gradients, each map's rows' dz0 and x̃ into sdN and sdA (free by now), then
         * dW = dZ0ᵀ X̃ (NP-Map, W [D][D], z0 = W x̃) or X̃ᵀ dZ0 (Hedgehog, W [D][F], z = x W), over all the rows */
        for (int side = 0; side < 2 && !rc; side++) {
            const float *u = side ? ku : qu, *W = side ? kW : qW;
            float *gW = pg + (W - t->L[l].sparams), *gu = u ? pg + (u - t->L[l].sparams) : NULL;
            rc = stc_npmap_bwd_params(t->dev, side ? sv.k + okv : sv.q + oq, side ? kvd : qd, n, D, u, W,
                                      side ? t->dphk : t->dphq, side ? sv.dk + okv : sv.dq + oq, side ? kvd : qd, t->sdN,
                                      t->sdA, gu, t->sdupart, err);
            if (!rc)
                rc = u ? stc_gemm_rm(t->dev, 1, 0, D, D, n, 1.0f, t->sdN, D, t->sdA, D, 1.0f, gW, D, 0, tf, err)
                       : stc_gemm_rm(t->dev, 1, 0, D, D, n, 1.0f, t->sdA, D, t->sdN, D, 1.0f, gW, D, 0, tf, err);
        }
        if (rc) return rc;
    }
    /* the gate's input gradient: dh += dpre W_g; with --train-attn its own: dW_g += dpreᵀ h1, db_g += Σ_t dpre */
    if (sg.gate)
        rc = stc_gemm_rm(t->dev, 0, 0, n, dm, (int)HD, 1.0f, t->sdpre, (int64_t)HD, sg.Wg, dm, 1.0f, sv.dh, dm, 0, tf,
                         err);
    if (!rc && sg.gate && pg) {
        float *gWg = pg + (sg.Wg - t->L[l].sparams), *gbg = pg + (sg.bg - t->L[l].sparams);
        rc = stc_gemm_rm(t->dev, 1, 0, (int)HD, dm, n, 1.0f, t->sdpre, (int64_t)HD, sv.h1, dm, 1.0f, gWg, dm, 0, tf, err);
        if (!rc) rc = stc_colsum_acc(t->dev, t->sdpre, (int64_t)HD, n, (int)HD, gbg, err);
    }
    return rc;
}

/* ---- still layers fused (bf16 mode, head dim 64): the whole batch in one pass (cuda/kinds/still/attn_still_train.cu) ----
 * The same function as the dense form above; every head's feature maps first (φq, φk [H][B·T][2D]), then the
 * fused kernels, then the maps' backward per head from dφq, dφk. */

static stc_still_train_rows still_rows(const lm_train_cuda *t) {
    return (stc_still_train_rows){.m = t->sm, .l = t->sl, .b = t->sb, .dl = t->sdl, .db = t->sdb, .rho = t->srho,
                                  .kbar = t->kbar, .am = t->sam, .far_idx = t->sfar, .far_n = t->sfarn};
}

/* The layer's geometry (with route_now, the routing) and, in the forward (fwd), the gate into t->sgate: the backward
 * runs right after the forward's recomputation, whose gate is still there. */
static int still_fused_prepare(lm_train_cuda *t, int l, int T, int route_now, int fwd, seq_rows *sv, still_geom *sg,
                               stc_still_train_geom *geo, still_err *err) {
    *sv = seq_view(t, 0, t->B, T);
    int rc = still_layer_geom(t, l, T, sv, 0, route_now, sg, err);
    if (rc) return rc;
    *geo = (stc_still_train_geom){.B = t->B, .T = T, .H = sg->H, .Hk = sg->Hk, .D = sg->D, .C = sg->C,
                                  .per_kv = sg->per_kv, .linear = sg->linear, .gate_den = sg->gate_den,
                                  .route = sg->route};
    return sg->gate && fwd ? still_gate(t, sg, sv, T, err) : STILL_OK;
}

static int still_fused_forward(lm_train_cuda *t, int l, int T, int route_now, still_err *err) {
    seq_rows sv;
    still_geom sg;
    stc_still_train_geom geo;
    int rc = still_fused_prepare(t, l, T, route_now, 1, &sv, &sg, &geo, err);
    if (rc) return rc;
    const int D = sg.D, qd = sg.H * D, kvd = sg.Hk * D, n = t->B * T;
    const size_t hp = (size_t)n * 2 * D;   /* one head's feature rows */
    for (int h = 0; h < sg.H && sg.linear && !rc; h++) {
        const float *qu, *qW, *ku, *kW, *wfac;
        head_maps(t, l, &sg, h, &qu, &qW, &ku, &kW, &wfac);
        rc = stc_npmap_rows(t->dev, sv.q + (size_t)h * D, qd, n, D, qu, qW, t->phq + h * hp, err);
        if (!rc) rc = stc_npmap_rows(t->dev, sv.k + (size_t)(h / sg.G) * D, kvd, n, D, ku, kW, t->phk + h * hp, err);
    }
    stc_still_train_rows rows = still_rows(t);
    return rc ? rc : stc_still_train_fwd(t->dev, &geo, sv.q, sv.k, sv.v, t->phq, t->phk, sg.gate ? t->sgate : NULL,
                                         sv.att, t->sa, &rows, err);
}

/* dq, dk, dv (overwritten) from datt, after the forward's recomputation (its φ, a and row values still in place);
 * the gate's part of the layer input's gradient added to dh. */
static int still_fused_backward(lm_train_cuda *t, int l, int T, still_err *err) {
    seq_rows sv;
    still_geom sg;
    stc_still_train_geom geo;
    int rc = still_fused_prepare(t, l, T, 0, 0, &sv, &sg, &geo, err);
    if (rc) return rc;
    const int D = sg.D, qd = sg.H * D, kvd = sg.Hk * D, n = t->B * T, tf = !t->exact, dm = t->m->cfg.d_model;
    const size_t hp = (size_t)n * 2 * D, HD = (size_t)sg.H * D;
    float *pg = t->attn_grads ? t->L[l].sgrad : NULL;   /* --train-attn: this layer's parameter gradient */
    stc_still_train_rows rows = still_rows(t);
    rc = stc_still_train_bwd(t->dev, &geo, sv.q, sv.k, sv.v, t->phq, t->phk, sg.gate ? t->sgate : NULL, sv.att, t->sa,
                             &rows, sv.datt, t->sdN, t->sdA, sv.dq, sv.dk, sv.dv, t->dphq, t->dphk,
                             sg.gate ? t->sdpre : NULL, err);
    for (int h = 0; h < sg.H && sg.linear && !rc; h++) {
        const float *qu, *qW, *ku, *kW, *wfac;
        head_maps(t, l, &sg, h, &qu, &qW, &ku, &kW, &wfac);
        const size_t oq = (size_t)h * D, okv = (size_t)(h / sg.G) * D;
        if (!pg) {
            rc = stc_npmap_bwd(t->dev, sv.q + oq, qd, n, D, qu, qW, t->dphq + h * hp, sv.dq + oq, qd, err);
            if (!rc) rc = stc_npmap_bwd(t->dev, sv.k + okv, kvd, n, D, ku, kW, t->dphk + h * hp, sv.dk + okv, kvd, err);
            continue;
        }
        /* --train-attn: as the dense form (dz0 and x̃ into sdN and sdA, free by now), dW = dZ0ᵀ X̃ */
        for (int side = 0; side < 2 && !rc; side++) {
            const float *u = side ? ku : qu, *W = side ? kW : qW;
            float *gW = pg + (W - t->L[l].sparams), *gu = pg + (u - t->L[l].sparams);
            rc = stc_npmap_bwd_params(t->dev, side ? sv.k + okv : sv.q + oq, side ? kvd : qd, n, D, u, W,
                                      (side ? t->dphk : t->dphq) + h * hp, side ? sv.dk + okv : sv.dq + oq,
                                      side ? kvd : qd, t->sdN, t->sdA, gu, t->sdupart, err);
            if (!rc) rc = stc_gemm_rm(t->dev, 1, 0, D, D, n, 1.0f, t->sdN, D, t->sdA, D, 1.0f, gW, D, 0, tf, err);
        }
    }
    if (!rc && sg.gate)
        rc = stc_gemm_rm(t->dev, 0, 0, n, dm, (int)HD, 1.0f, t->sdpre, (int64_t)HD, sg.Wg, dm, 1.0f, sv.dh, dm, 0, tf,
                         err);
    if (!rc && sg.gate && pg) {
        float *gWg = pg + (sg.Wg - t->L[l].sparams), *gbg = pg + (sg.bg - t->L[l].sparams);
        rc = stc_gemm_rm(t->dev, 1, 0, (int)HD, dm, n, 1.0f, t->sdpre, (int64_t)HD, sv.h1, dm, 1.0f, gWg, dm, 0, tf, err);
        if (!rc) rc = stc_colsum_acc(t->dev, t->sdpre, (int64_t)HD, n, (int)HD, gbg, err);
    }
    return rc;
}

/* ---- softmax and swa layers: every (sequence, KV head) block at once ----
 * q, k, v go head-major ([B][H][T][D]), where the G query heads of a KV head are G·T consecutive rows: block
 * z = b·Hk + g multiplies Q_z [G·T][D] with K_z, V_z [T][D], so one strided-batched product covers all blocks
 * (nz at a time), and in the backward dV_z = P_zᵀ dO_z and dK_z = dS_zᵀ Q_z sum over the G heads by themselves:
 *   P = softmax(s Q Kᵀ) (causal, windowed for swa), O = P V;
 *   dV = Pᵀ dO, dP = dO Vᵀ, δ = rowsum(dO ⊙ O), dS = s P ⊙ (dP − δ), dQ = dS K, dK = dSᵀ Q. */

/* The keys a query sees: the layer's window (swa), or 0 for all of them. */
static int soft_window(const attn_config *ac) { return lm_gpu_kind_of(ac->kind)->windowed ? ac->window : 0; }

/* Blocks z0 .. z0 + nb - 1: their P (recomputed from Qh, Kh). */
static int soft_scores(lm_train_cuda *t, int l, int T, int z0, int nb, still_err *err) {
    const model_config *c = &t->m->cfg;
    const int D = c->head_dim, G = c->n_head / c->n_head_kv;
    const attn_config *ac = &t->m->attn_cfg[l];
    const int64_t GT = (int64_t)G * T, sq = GT * D, skv = (int64_t)T * D, sp = GT * T;
    int rc = stc_gemm_rm_batched(t->dev, 0, 1, (int)GT, T, D, attn_logit_scale(D), t->Qh + z0 * sq, D, sq,
                                 t->Kh + z0 * skv, D, skv, 0.0f, t->P, T, sp, nb, 0, !t->exact, err);
    return rc ? rc : stc_softmax_causal(t->dev, t->P, (int)(nb * GT), T, T, soft_window(ac), err);
}

static int soft_split_qkv(lm_train_cuda *t, int T, still_err *err) {
    const model_config *c = &t->m->cfg;
    const int D = c->head_dim, qd = c->n_head * D, kvd = c->n_head_kv * D;
    int rc = stc_heads_split(t->dev, t->q, qd, t->B, T, c->n_head, D, t->Qh, err);
    if (!rc) rc = stc_heads_split(t->dev, t->k, kvd, t->B, T, c->n_head_kv, D, t->Kh, err);
    if (!rc) rc = stc_heads_split(t->dev, t->v, kvd, t->B, T, c->n_head_kv, D, t->Vh, err);
    return rc;
}

static int soft_attn_forward(lm_train_cuda *t, int l, int T, still_err *err) {
    const model_config *c = &t->m->cfg;
    const attn_config *ac = &t->m->attn_cfg[l];
    if (t->fused)
        return stc_flash_train_fwd(t->dev, t->q, t->k, t->v, t->B, T, c->n_head, c->n_head_kv, c->head_dim,
                                   soft_window(ac), t->att, t->lse, err);
    const int D = c->head_dim, G = c->n_head / c->n_head_kv, Z = t->B * c->n_head_kv;
    const int64_t GT = (int64_t)G * T, sq = GT * D, skv = (int64_t)T * D, sp = GT * T;
    int rc = soft_split_qkv(t, T, err);
    for (int z0 = 0; z0 < Z && !rc; z0 += t->nz) {
        const int nb = Z - z0 < t->nz ? Z - z0 : t->nz;
        if ((rc = soft_scores(t, l, T, z0, nb, err))) break;
        rc = stc_gemm_rm_batched(t->dev, 0, 0, (int)GT, D, T, 1.0f, t->P, T, sp, t->Vh + z0 * skv, D, skv, 0.0f,
                                 t->Oh + z0 * sq, D, sq, nb, 0, !t->exact, err);
    }
    return rc ? rc : stc_heads_merge(t->dev, t->Oh, t->B, T, c->n_head, D, t->att, c->n_head * D, err);
}

/* dq, dk, dv (overwritten) from datt; Oh is the forward's (the layer was just recomputed). */
static int soft_attn_backward(lm_train_cuda *t, int l, int T, still_err *err) {
    const model_config *c = &t->m->cfg;
    const attn_config *ac = &t->m->attn_cfg[l];
    if (t->fused)
        return stc_flash_train_bwd(t->dev, t->q, t->k, t->v, t->att, t->datt, t->lse, t->B, T, c->n_head,
                                   c->n_head_kv, c->head_dim, soft_window(ac), t->delta, t->kbar,
                                   t->dq, t->dk, t->dv, err);
    const int D = c->head_dim, G = c->n_head / c->n_head_kv, Z = t->B * c->n_head_kv;
    const int qd = c->n_head * D, kvd = c->n_head_kv * D, tf = !t->exact;
    const int64_t GT = (int64_t)G * T, sq = GT * D, skv = (int64_t)T * D, sp = GT * T;
    int rc = stc_heads_split(t->dev, t->datt, qd, t->B, T, c->n_head, D, t->dOh, err);
    for (int z0 = 0; z0 < Z && !rc; z0 += t->nz) {
        const int nb = Z - z0 < t->nz ? Z - z0 : t->nz;
        if ((rc = soft_scores(t, l, T, z0, nb, err))) break;
        const float *dO = t->dOh + z0 * sq, *Q = t->Qh + z0 * sq, *K = t->Kh + z0 * skv, *V = t->Vh + z0 * skv;
        if ((rc = stc_gemm_rm_batched(t->dev, 1, 0, T, D, (int)GT, 1.0f, t->P, T, sp, dO, D, sq, 0.0f,
                                      t->dVh + z0 * skv, D, skv, nb, 0, tf, err)))
            break;
        if ((rc = stc_gemm_rm_batched(t->dev, 0, 1, (int)GT, T, D, 1.0f, dO, D, sq, V, D, skv, 0.0f, t->dP, T, sp, nb,
                                      0, tf, err)))
            break;
        float *delta = t->delta + z0 * GT;
        if ((rc = stc_rowdot(t->dev, dO, D, t->Oh + z0 * sq, D, (int)(nb * GT), D, delta, err))) break;
        if ((rc = stc_attn_ds(t->dev, t->dP, t->P, delta, (int)(nb * GT), T, T, attn_logit_scale(D), err))) break;
        if ((rc = stc_gemm_rm_batched(t->dev, 0, 0, (int)GT, D, T, 1.0f, t->dP, T, sp, K, D, skv, 0.0f,
                                      t->dQh + z0 * sq, D, sq, nb, 0, tf, err)))
            break;
        rc = stc_gemm_rm_batched(t->dev, 1, 0, T, D, (int)GT, 1.0f, t->dP, T, sp, Q, D, sq, 0.0f, t->dKh + z0 * skv, D,
                                 skv, nb, 0, tf, err);
    }
    if (!rc) rc = stc_heads_merge(t->dev, t->dQh, t->B, T, c->n_head, D, t->dq, qd, err);
    if (!rc) rc = stc_heads_merge(t->dev, t->dKh, t->B, T, c->n_head_kv, D, t->dk, kvd, err);
    if (!rc) rc = stc_heads_merge(t->dev, t->dVh, t->B, T, c->n_head_kv, D, t->dv, kvd, err);
    return rc;
}

static int soft_forward(lm_train_cuda *t, int l, int T, int route_now, still_err *err) {
    (void)route_now;
    return soft_attn_forward(t, l, T, err);
}

/* route_now: still and lolcats layers route the sequences (the step's forward); 0: the backward's recomputation,
 * which reads the forward's routing. The dense form, a group of sequences at a time. */
static int still_dense_forward(lm_train_cuda *t, int l, int T, int route_now, still_err *err) {
    int rc = STILL_OK;
    for (int b = 0; b < t->B && !rc; b += t->snb)
        rc = still_attn_forward_group(t, l, T, b, t->B - b < t->snb ? t->B - b : t->snb, route_now, err);
    return rc;
}

/* dq, dk, dv from datt (a still gate adds its part to dh). */
static int still_dense_backward(lm_train_cuda *t, int l, int T, still_err *err) {
    const model_config *c = &t->m->cfg;
    const size_t nkv = (size_t)t->B * T * c->n_head_kv * c->head_dim;
    int rc = stc_memset(t->dev, t->dk, 0, sizeof(float) * nkv, err);
    if (!rc) rc = stc_memset(t->dev, t->dv, 0, sizeof(float) * nkv, err);
    for (int b = 0; b < t->B && !rc; b += t->snb)
        rc = still_attn_backward_group(t, l, T, b, t->B - b < t->snb ? t->B - b : t->snb, err);
    return rc;
}

/* still: the fused form in bf16 mode (t->sfused), else the dense form */
static int still_forward(lm_train_cuda *t, int l, int T, int route_now, still_err *err) {
    return t->sfused ? still_fused_forward(t, l, T, route_now, err) : still_dense_forward(t, l, T, route_now, err);
}
static int still_backward(lm_train_cuda *t, int l, int T, still_err *err) {
    return t->sfused ? still_fused_backward(t, l, T, err) : still_dense_backward(t, l, T, err);
}

/* ---- gdn layers: a sequence at a time, each from a fresh state (cuda/kinds/gdn/attn_gdn.cu) ---- */

static int gdn_check(const attn_config *ac, int l, int max_T, still_err *err) {
    (void)max_T;
    if (ac->head_dim != 64 && ac->head_dim != 128)
        return still_fail(err, STILL_E_UNSUPPORTED,
                          "still finetune --device cuda: layer %d (gdn) needs head dim 64 or 128 (got %d; use "
                          "--device cpu)", l, ac->head_dim);
    return STILL_OK;
}

/* att from q, k (rotated: the layer undoes RoPE on its copies), v and the layer's normalised input h1. */
static int gdn_forward(lm_train_cuda *t, int l, int T, int route_now, still_err *err) {
    (void)route_now;
    const model_config *c = &t->m->cfg;
    const size_t qd = (size_t)c->n_head * c->head_dim, kvd = (size_t)c->n_head_kv * c->head_dim, d = c->d_model;
    int rc = STILL_OK;
    for (int b = 0; b < t->B && !rc; b++) {
        const size_t r = (size_t)b * T;
        rc = stc_gdn_train_forward(t->dev, t->L[l].gdn, t->L[l].sparams, t->q + r * qd, t->k + r * kvd, t->v + r * kvd,
                                   t->h1 + r * d, T, c->rope_theta, t->att + r * qd, err);
    }
    return rc;
}

/* dq, dk (before RoPE: the kind's nope flag), dv from datt; the gates' part of the input's gradient added to dh; with
 * --train-attn the parameters' gradient. */
static int gdn_backward(lm_train_cuda *t, int l, int T, still_err *err) {
    const model_config *c = &t->m->cfg;
    const size_t qd = (size_t)c->n_head * c->head_dim, kvd = (size_t)c->n_head_kv * c->head_dim, d = c->d_model;
    float *pg = t->attn_grads ? t->L[l].sgrad : NULL;
    int rc = STILL_OK;
    for (int b = 0; b < t->B && !rc; b++) {
        const size_t r = (size_t)b * T;
        rc = stc_gdn_train_backward(t->dev, t->L[l].gdn, t->L[l].sparams, t->q + r * qd, t->k + r * kvd,
                                    t->v + r * kvd, t->h1 + r * d, T, c->rope_theta, t->datt + r * qd, t->dq + r * qd,
                                    t->dk + r * kvd, t->dv + r * kvd, t->dh + r * d, pg, err);
    }
    return rc;
}

static int lolcats_check(const attn_config *ac, int l, int max_T, still_err *err) {
    (void)max_T;
    if (ac->head_dim != 64 || ac->feature_dim != ac->head_dim || ac->chunk <= 0 || ac->chunk > 256)
        return still_fail(err, STILL_E_UNSUPPORTED,
                          "still finetune --device cuda: layer %d (lolcats) needs head dim 64, a feature dim "
                          "equal to it and a chunk of 1..256 on the GPU (use --device cpu)", l);
    return STILL_OK;
}

static int still_check(const attn_config *ac, int l, int max_T, still_err *err) {
    int lam, capped, cap;
    attn_config cfg = *ac;
    cfg.n_ctx = max_T;
    int rc = attn_still_routing(&cfg, &lam, &capped, &cap, err);
    if (rc) return rc;
    const char *why = ac->head_dim != 64 ? "a head dim other than 64"
                      : ac->linear && ac->feature_map != FMAP_NPMAP ? "a feature map other than NP-Map"
                      : ac->routing != ROUTE_SALIENCY ? "routing other than saliency"
                      : ac->sel_span > 0 ? "--sel-span"
                      : ac->chunk > 256 ? "a chunk longer than 256" : NULL;
    if (why)
        return still_fail(err, STILL_E_UNSUPPORTED,
                          "still finetune --device cuda: layer %d (still) has %s, which the GPU fine-tune does "
                          "not run (use --device cpu)", l, why);
    return STILL_OK;
}

static const lm_gpu_kind LM_GPU_KINDS[ATTN_KIND_COUNT] = {
    [ATTN_SOFTMAX] = {.family = LM_FAMILY_SOFTMAX, .forward = soft_forward, .backward = soft_attn_backward},
    [ATTN_SWA] = {.family = LM_FAMILY_SOFTMAX, .windowed = 1, .forward = soft_forward, .backward = soft_attn_backward},
    [ATTN_LOLCATS] = {.family = LM_FAMILY_STILL, .lolcats_mode = 1, .check = lolcats_check,
                      .forward = still_dense_forward, .backward = still_dense_backward},
    [ATTN_STILL] = {.family = LM_FAMILY_STILL, .fused_bf16 = 1, .check = still_check, .forward = still_forward,
                    .backward = still_backward},
    [ATTN_GDN] = {.family = LM_FAMILY_GDN, .nope = 1, .check = gdn_check, .forward = gdn_forward,
                  .backward = gdn_backward},
    /* liger: not on the GPU (refused at creation) */
};

/* The kind's row; NULL for a kind the GPU fine-tune does not run. */
static const lm_gpu_kind *lm_gpu_kind_of(int kind) {
    return (unsigned)kind < ATTN_KIND_COUNT && LM_GPU_KINDS[kind].family ? &LM_GPU_KINDS[kind] : NULL;
}

static int attn_forward(lm_train_cuda *t, int l, int T, int route_now, still_err *err) {
    return lm_gpu_kind_of(t->m->attn_cfg[l].kind)->forward(t, l, T, route_now, err);
}

/* dq, dk, dv (overwritten) from datt (a still gate adds its part to dh). */
static int attn_backward(lm_train_cuda *t, int l, int T, still_err *err) {
    return lm_gpu_kind_of(t->m->attn_cfg[l].kind)->backward(t, l, T, err);
}

/* ---- one layer --------------------------------------------------------------------------- */

static int layer_forward(lm_train_cuda *t, int l, const float *x, float *xo, int T, int train, still_err *err) {
    const model_config *c = &t->m->cfg;
    const gpu_train_layer *L = &t->L[l];
    const int d = c->d_model, H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, qd = H * D, N = t->B * T;
    const int64_t nd = (int64_t)N * d, nf = (int64_t)N * c->d_ff;
    int rc;
    if ((rc = stc_rmsnorm_r(t->dev, x, L->attn_norm, N, d, c->norm_eps, t->h1, t->r1, err))) return rc;
    if (!t->exact && (rc = stc_f32_to_bf16(t->dev, t->h1, t->xb, nd, err))) return rc;
    if ((rc = project(t, l, LORA_Q, t->h1, 1, t->q, T, train, err))) return rc;
    if ((rc = project(t, l, LORA_K, t->h1, 1, t->k, T, train, err))) return rc;
    if ((rc = project(t, l, LORA_V, t->h1, 1, t->v, T, train, err))) return rc;
    if ((rc = stc_rope_rows(t->dev, t->q, N, T, H, D, c->rope_theta, 0, err))) return rc;
    if ((rc = stc_rope_rows(t->dev, t->k, N, T, Hk, D, c->rope_theta, 0, err))) return rc;
    if ((rc = attn_forward(t, l, T, xo != NULL, err))) return rc;   /* xo NULL: the backward's recomputation */
    if ((rc = project(t, l, LORA_O, t->att, 0, t->xm, T, train, err))) return rc;
    (void)qd;
    if ((rc = stc_axpy(t->dev, t->xm, x, 1.0f, nd, err))) return rc;
    if ((rc = stc_rmsnorm_r(t->dev, t->xm, L->ffn_norm, N, d, c->norm_eps, t->h2, t->r2, err))) return rc;
    if (!t->exact && (rc = stc_f32_to_bf16(t->dev, t->h2, t->xb, nd, err))) return rc;
    if ((rc = project(t, l, LORA_GATE, t->h2, 1, t->g, T, train, err))) return rc;
    if ((rc = project(t, l, LORA_UP, t->h2, 1, t->u, T, train, err))) return rc;
    if ((rc = stc_swiglu_f32(t->dev, t->g, t->u, t->act, nf, err))) return rc;
    if ((rc = project(t, l, LORA_DOWN, t->act, 0, xo, T, train, err))) return rc;
    if (!xo) return STILL_OK;
    return stc_axpy(t->dev, xo, t->xm, 1.0f, nd, err);
}

/* t->dx: ∂/∂(layer output) on entry, ∂/∂(layer input) on return. */
static int layer_backward(lm_train_cuda *t, int l, const float *x, int T, int want_grads, still_err *err) {
    const model_config *c = &t->m->cfg;
    const gpu_train_layer *L = &t->L[l];
    const int d = c->d_model, H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, qd = H * D, N = t->B * T;
    const int64_t nd = (int64_t)N * d, nf = (int64_t)N * c->d_ff;
    int rc;
    if ((rc = stc_memset(t->dev, t->dact, 0, sizeof(float) * nf, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_DOWN, t->act, t->dx, t->dact, T, want_grads, err))) return rc;
    if ((rc = stc_swiglu_bwd(t->dev, t->dact, t->g, t->u, t->dg, t->du, nf, err))) return rc;
    if ((rc = stc_memset(t->dev, t->dh, 0, sizeof(float) * nd, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_GATE, t->h2, t->dg, t->dh, T, want_grads, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_UP, t->h2, t->du, t->dh, T, want_grads, err))) return rc;
    if ((rc = stc_memcpy_d2d(t->dev, t->dxm, t->dx, sizeof(float) * nd, err))) return rc;
    if ((rc = stc_rmsnorm_bwd(t->dev, t->dxm, t->xm, t->r2, L->ffn_norm, t->dh, N, d, err))) return rc;
    if ((rc = stc_memset(t->dev, t->datt, 0, sizeof(float) * (size_t)N * qd, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_O, t->att, t->dxm, t->datt, T, want_grads, err))) return rc;
    if ((rc = stc_memset(t->dev, t->dh, 0, sizeof(float) * nd, err))) return rc;   /* a still gate adds to it */
    if ((rc = attn_backward(t, l, T, err))) return rc;
    if (!lm_gpu_kind_of(t->m->attn_cfg[l].kind)->nope) {   /* back through RoPE (gdn's are before it already) */
        if ((rc = stc_rope_rows(t->dev, t->dq, N, T, H, D, c->rope_theta, 1, err))) return rc;
        if ((rc = stc_rope_rows(t->dev, t->dk, N, T, Hk, D, c->rope_theta, 1, err))) return rc;
    }
    if ((rc = project_bwd(t, l, LORA_Q, t->h1, t->dq, t->dh, T, want_grads, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_K, t->h1, t->dk, t->dh, T, want_grads, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_V, t->h1, t->dv, t->dh, T, want_grads, err))) return rc;
    if ((rc = stc_memcpy_d2d(t->dev, t->dx, t->dxm, sizeof(float) * nd, err))) return rc;
    return stc_rmsnorm_bwd(t->dev, t->dx, x, t->r1, L->attn_norm, t->dh, N, d, err);
}

/* ---- the loss ------------------------------------------------------------------------------- */

/* Every row t < T-1 of every sequence (weight w_t, 0 where the trainer learns nothing: the same sums as the CPU's
 * skipped rows) in blocks of ce_rows; with grad, t->dx (zeroed here) gets ∂(scale · loss)/∂x. Losses per row in
 * loss_dev (row b·T + t; the last of each sequence unused). */
static int cross_entropy(lm_train_cuda *t, const float *x, int T, int has_w, int grad, still_err *err) {
    const model_config *c = &t->m->cfg;
    const int d = c->d_model, V = c->n_vocab, n = T - 1, RB = t->ce_rows;
    int rc;
    if (grad && (rc = stc_memset(t->dev, t->dx, 0, sizeof(float) * (size_t)t->B * T * d, err))) return rc;
    for (int s = 0; s < t->B; s++)
    for (int b0 = 0; b0 < n; b0 += RB) {
        const int nb = n - b0 < RB ? n - b0 : RB;
        const size_t r0 = (size_t)s * T + b0;
        const float *xr = x + r0 * d;
        if ((rc = stc_rmsnorm_r(t->dev, xr, t->output_norm, nb, d, c->norm_eps, t->hn, t->rn, err))) return rc;
        if ((rc = frozen_product(t, t->output, 0, nb, d, V, t->hn, 0, t->logits, err))) return rc;
        if ((rc = stc_ce_rows(t->dev, t->logits, nb, V, t->tok_dev + r0 + 1, has_w ? t->wdev + r0 : NULL, t->scale_dev,
                              grad, t->loss_dev + r0, err)))
            return rc;
        if (!grad) continue;
        if (t->exact) rc = stc_gemm_rm(t->dev, 0, 0, nb, d, V, 1.0f, t->logits, V, t->output, d, 0.0f, t->dhn, d, 0, 0, err);
        else if (!(rc = stc_f32_to_bf16(t->dev, t->logits, t->logits_b, (int64_t)nb * V, err)))
            rc = stc_gemm_rm(t->dev, 0, 0, nb, d, V, 1.0f, t->logits_b, V, t->output, d, 0.0f, t->dhn, d, 1, 0, err);
        if (rc) return rc;
        if ((rc = stc_rmsnorm_bwd(t->dev, t->dx + r0 * d, xr, t->rn, t->output_norm, t->dhn, nb, d, err))) return rc;
    }
    return STILL_OK;
}

/* ---- a batch ------------------------------------------------------------------------------- */

/* Everything between the uploads and the downloads, enqueued on the stream (no host synchronisation: it can be
 * recorded as a graph). */
static int seq_enqueue(lm_train_cuda *t, int T, int has_w, int train, int want_grads, still_err *err) {
    const int NL = t->m->cfg.n_layer;
    const size_t nd = (size_t)t->B * T * t->m->cfg.d_model;
    int rc = STILL_OK;
    if (want_grads) rc = stc_memset(t->dev, t->lora_g, 0, sizeof(float) * t->lora_n, err);
    for (int l = 0; l < NL && !rc && t->attn_grads; l++)
        if (t->L[l].sgrad) rc = stc_memset(t->dev, t->L[l].sgrad, 0, sizeof(float) * t->L[l].n_sparams, err);
    for (int l = 0; l < NL && !rc; l++)
        rc = layer_forward(t, l, t->X + (size_t)l * nd, t->X + (size_t)(l + 1) * nd, T, train, err);
    if (!rc) rc = cross_entropy(t, t->X + (size_t)NL * nd, T, has_w, train, err);
    for (int l = NL - 1; l >= 0 && !rc && train; l--) {
        /* the top layer's activations are still in place from the forward */
        if (l < NL - 1) rc = layer_forward(t, l, t->X + (size_t)l * nd, NULL, T, train, err);
        if (!rc) rc = layer_backward(t, l, t->X + (size_t)l * nd, T, want_grads, err);
    }
    return rc;
}

/* Runs the batch's device work: eagerly at a variant's first run (which also builds the GEMM plans), recorded
 * as a CUDA graph at its second, replayed after that (at most N_SEQ_GRAPHS variants; others run eagerly). */
static int seq_run(lm_train_cuda *t, int T, int has_w, int train, int want_grads, still_err *err) {
    seq_graph *sg = NULL;
    for (int i = 0; i < N_SEQ_GRAPHS && t->use_graphs; i++) {
        seq_graph *e = &t->graphs[i];
        if (e->runs && e->T == T && e->B == t->B && e->has_w == has_w && e->train == train && e->grads == want_grads &&
            e->attn == t->attn_grads) {
            sg = e;
            break;
        }
        if (!e->runs && !sg) sg = e;   /* a free slot, kept unless the variant is found further on */
    }
    if (sg && !sg->runs)
        *sg = (seq_graph){.T = T, .B = t->B, .has_w = has_w, .train = train, .grads = want_grads, .attn = t->attn_grads};
    if (!sg || sg->runs == 0) {
        if (sg) sg->runs = 1;
        return seq_enqueue(t, T, has_w, train, want_grads, err);
    }
    if (!sg->graph) {
        int rc = stc_graph_begin(t->dev, err);
        if (rc) return rc;
        rc = seq_enqueue(t, T, has_w, train, want_grads, err);
        const int rc2 = stc_graph_end(t->dev, rc == STILL_OK, &sg->graph, rc ? NULL : err);
        if (rc || rc2) return rc ? rc : rc2;
    }
    sg->runs++;
    return stc_graph_launch(t->dev, sg->graph, err);
}

int lm_train_cuda_batch(lm_train_cuda *t, const int32_t *const *tok, const float *const *w, int B, int T, float scale,
                        const uint64_t *drop_seeds, const lm_grads *g, double *loss_sum, double *w_sum, still_err *err) {
    const still_model *m = t->m;
    const model_config *c = &m->cfg;
    const int d = c->d_model, NL = c->n_layer;
    *loss_sum = 0, *w_sum = 0;
    if (T < 2 || T > t->max_T) return still_fail(err, STILL_E_ARG, "training sequence of %d tokens (2 .. %d)", T, t->max_T);
    if (B < 1 || B > t->max_B) return still_fail(err, STILL_E_ARG, "a batch of %d sequences (1 .. %d)", B, t->max_B);
    int attn_grads = 0;
    for (int l = 0; g && g->attn && l < NL; l++)
        if (g->attn[l]) {
            if (!t->L[l].sparams || !t->L[l].n_sparams)
                return still_fail(err, STILL_E_ARG, "layer %d (%s) has no parameters to train", l,
                                  attn_kind_get(m->attn_cfg[l].kind)->name);
            if (!t->L[l].sgrad) {   /* once, outside any graph's recording */
                int rc = dalloc(t, sizeof(float) * t->L[l].n_sparams, "attention parameter gradients",
                                (void **)&t->L[l].sgrad, err);
                if (!rc && !t->sdupart)
                    rc = dalloc(t, sizeof(float) * STC_NPMAP_BLOCKS * (size_t)c->head_dim, "NP-Map gradient scratch",
                                (void **)&t->sdupart, err);
                if (rc) return rc;
            }
            attn_grads = 1;
        }
    if (attn_grads) t->attn_train = 1;
    int has_w = 0;
    for (int b = 0; b < B; b++) has_w |= w && w[b];
    for (int b = 0; b < B; b++)
        for (int i = 0; i < T; i++) {
            const int32_t id = tok[b][i];
            if (id < 0 || id >= c->n_vocab) return still_fail(err, STILL_E_ARG, "token id %d out of range (vocab %d)", id, c->n_vocab);
            const uint8_t *row = (const uint8_t *)m->tok_embd.data + (size_t)id * m->tok_embd.row_bytes;
            int rc = dequantize_row(m->tok_embd.type, row, t->x0_host + ((size_t)b * T + i) * d, d, err);
            if (rc) return rc;
            if (has_w) t->w_host[(size_t)b * T + i] = w[b] ? w[b][i] : 1.0f;   /* no weights: every row counts once */
        }
    const lora_set *s = t->lora;
    /* the host's current LoRA, packed as on the device, in one upload */
    for (int l = 0; l < NL && s; l++)
        for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
            const int i = l * LORA_N_TARGETS + tg;
            if (!lora_A(s, l, (lora_target)tg)) continue;
            memcpy(t->lora_host + t->lora_off_a[i], lora_A(s, l, (lora_target)tg), sizeof(float) * (size_t)s->rank * s->n_in[tg]);
            memcpy(t->lora_host + t->lora_off_b[i], lora_B(s, l, (lora_target)tg), sizeof(float) * (size_t)s->n_out[tg] * s->rank);
        }
    const size_t N = (size_t)B * T;
    int rc = stc_memcpy_h2d(t->dev, t->X, t->x0_host, sizeof(float) * N * d, err);
    for (int b = 0; b < B && !rc; b++) rc = stc_memcpy_h2d(t->dev, t->tok_dev + (size_t)b * T, tok[b], sizeof(int32_t) * T, err);
    if (!rc && has_w) rc = stc_memcpy_h2d(t->dev, t->wdev, t->w_host, sizeof(float) * N, err);
    if (!rc && s) rc = stc_memcpy_h2d(t->dev, t->lora_w, t->lora_host, sizeof(float) * t->lora_n, err);
    if (!rc) rc = stc_memcpy_h2d(t->dev, t->seed_dev, drop_seeds, sizeof(uint64_t) * B, err);
    if (!rc) rc = stc_memcpy_h2d(t->dev, t->scale_dev, &scale, sizeof scale, err);
    /* the kinds' parameters change on the host once they train (AdamW there, as for LoRA) */
    for (int l = 0; l < NL && !rc && t->attn_train; l++)
        if (t->L[l].sparams && t->L[l].n_sparams)
            rc = stc_memcpy_h2d(t->dev, t->L[l].sparams, m->attn_params[l], sizeof(float) * t->L[l].n_sparams, err);
    const int train = g != NULL, want_grads = g && g->lora && s;
    t->B = B, t->attn_grads = train && attn_grads;
    if (!rc) rc = seq_run(t, T, has_w, train, want_grads, err);
    if (!rc) rc = stc_memcpy_d2h(t->dev, t->loss_host, t->loss_dev, sizeof(double) * N, err);
    if (!rc && want_grads) rc = stc_memcpy_d2h(t->dev, t->lora_host, t->lora_g, sizeof(float) * t->lora_n, err);
    if (rc) return rc;
    double ls = 0, ws = 0;
    for (int b = 0; b < B; b++)
        for (int i = 0; i + 1 < T; i++) {
            const float wi = has_w ? t->w_host[(size_t)b * T + i] : 1.0f;
            if (has_w && !(wi > 0)) continue;
            ls += t->loss_host[(size_t)b * T + i], ws += wi;
        }
    *loss_sum = ls, *w_sum = ws;
    for (int l = 0; l < NL && t->attn_grads; l++) {
        if (!g->attn[l]) continue;
        const size_t np = t->L[l].n_sparams;
        float *h = malloc(sizeof(float) * np);
        if (!h) return still_fail(err, STILL_E_NOMEM, "out of memory");
        int rc2 = stc_memcpy_d2h(t->dev, h, t->L[l].sgrad, sizeof(float) * np, err);
        if (!rc2)
            for (size_t j = 0; j < np; j++) g->attn[l][j] += h[j];
        free(h);
        if (rc2) return rc2;
    }
    if (!want_grads) return STILL_OK;
    for (int l = 0; l < NL; l++)
        for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
            const int i = l * LORA_N_TARGETS + tg;
            if (!lora_A(s, l, (lora_target)tg)) continue;
            float *dA = lora_A(g->lora, l, (lora_target)tg), *dB = lora_B(g->lora, l, (lora_target)tg);
            const float *ga = t->lora_host + t->lora_off_a[i], *gb = t->lora_host + t->lora_off_b[i];
            const size_t na = (size_t)s->rank * s->n_in[tg], nb = (size_t)s->n_out[tg] * s->rank;
            for (size_t j = 0; j < na; j++) dA[j] += ga[j];
            for (size_t j = 0; j < nb; j++) dB[j] += gb[j];
        }
    return STILL_OK;
}

int lm_train_cuda_seq(lm_train_cuda *t, const int32_t *tok, const float *w, int T, float scale, uint64_t drop_seed,
                      const lm_grads *g, double *loss_sum, double *w_sum, still_err *err) {
    return lm_train_cuda_batch(t, &tok, &w, 1, T, scale, &drop_seed, g, loss_sum, w_sum, err);
}

#endif
