/* LoRA sets: creation, initialisation, the forward update, GGUF reading and
 * writing (see lora.h for the conventions). */
#include "model/lora.h"

#include "kinds/attn_common.h"
#include "common/common.h"
#include "format/gguf.h"
#include "format/quant.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const OPTION_NAMES[LORA_N_TARGETS] = {"q", "k", "v", "o", "gate", "up", "down"};
static const char *const TENSOR_NAMES[LORA_N_TARGETS] = {"attn_q",   "attn_k", "attn_v",  "attn_output",
                                                         "ffn_gate", "ffn_up", "ffn_down"};

const char *lora_target_option(lora_target t) { return (unsigned)t < LORA_N_TARGETS ? OPTION_NAMES[t] : "?"; }
const char *lora_target_tensor(lora_target t) { return (unsigned)t < LORA_N_TARGETS ? TENSOR_NAMES[t] : "?"; }

int lora_parse_targets(const char *s, unsigned *mask, still_err *err) {
    *mask = 0;
    if (!s || !*s) return still_fail(err, STILL_E_ARG, "--lora-targets: empty list (q, k, v, o, gate, up, down, all)");
    const char *p = s;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        int found = 0;
        if (n == 3 && !memcmp(p, "all", 3)) *mask = (1u << LORA_N_TARGETS) - 1, found = 1;
        for (int t = 0; t < LORA_N_TARGETS && !found; t++)
            if (strlen(OPTION_NAMES[t]) == n && !memcmp(p, OPTION_NAMES[t], n)) *mask |= 1u << t, found = 1;
        if (!found)
            return still_fail(err, STILL_E_ARG, "--lora-targets: unknown target '%.*s' (q, k, v, o, gate, up, down, all)",
                              (int)(n > 32 ? 32 : n), p);
        p += n;
        if (*p == ',') {
            p++;
            if (!*p) return still_fail(err, STILL_E_ARG, "--lora-targets: trailing comma in '%s'", s);
        }
    }
    return STILL_OK;
}

void lora_free(lora_set *s) {
    if (!s) return;
    for (int i = 0; s->A && i < s->n_layer * LORA_N_TARGETS; i++) free(s->A[i]);
    for (int i = 0; s->B && i < s->n_layer * LORA_N_TARGETS; i++) free(s->B[i]);
    free(s->A), free(s->B);
    free(s);
}

/* An empty set of the given shape (no tensors yet). */
static int set_new(const lora_shape *sh, int rank, float alpha, lora_set **out, still_err *err) {
    lora_set *s = calloc(1, sizeof *s);
    const size_t n = (size_t)sh->n_layer * LORA_N_TARGETS;
    if (s) s->A = calloc(n, sizeof(float *)), s->B = calloc(n, sizeof(float *));
    if (!s || !s->A || !s->B) {
        lora_free(s);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    s->n_layer = sh->n_layer, s->rank = rank, s->alpha = alpha, s->user_scale = 1.0f;
    memcpy(s->n_in, sh->n_in, sizeof s->n_in);
    memcpy(s->n_out, sh->n_out, sizeof s->n_out);
    *out = s;
    return STILL_OK;
}

int lora_create(const lora_shape *sh, int rank, float alpha, unsigned targets, lora_set **out, still_err *err) {
    *out = NULL;
    if (!targets || targets >> LORA_N_TARGETS) return still_fail(err, STILL_E_ARG, "LoRA: no targets");
    if (!(alpha > 0) || !isfinite(alpha)) return still_fail(err, STILL_E_ARG, "--lora-alpha must be positive, got %g", alpha);
    for (int t = 0; t < LORA_N_TARGETS; t++) {
        if (!(targets >> t & 1)) continue;
        const int lim = sh->n_in[t] < sh->n_out[t] ? sh->n_in[t] : sh->n_out[t];
        if (rank < 1 || rank > lim)
            return still_fail(err, STILL_E_ARG, "--lora-rank %d out of range for target %s (1 .. %d, its smaller side)",
                              rank, OPTION_NAMES[t], lim);
    }
    lora_set *s;
    int rc = set_new(sh, rank, alpha, &s, err);
    if (rc) return rc;
    s->targets = targets;
    for (int l = 0; l < sh->n_layer; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            if (!(targets >> t & 1)) continue;
            float **a = &s->A[l * LORA_N_TARGETS + t], **b = &s->B[l * LORA_N_TARGETS + t];
            *a = calloc((size_t)rank * sh->n_in[t], sizeof(float));
            *b = calloc((size_t)sh->n_out[t] * rank, sizeof(float));
            if (!*a || !*b) {
                lora_free(s);
                return still_fail(err, STILL_E_NOMEM, "out of memory for the LoRA tensors");
            }
        }
    *out = s;
    return STILL_OK;
}

void lora_init(lora_set *s, uint64_t seed) {
    for (int l = 0; l < s->n_layer; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            float *A = lora_A(s, l, (lora_target)t), *B = lora_B(s, l, (lora_target)t);
            if (!A) continue;
            /* torch.nn.init.kaiming_uniform_(A, a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain·sqrt(3 / fan_in) =
             * 1 / sqrt(fan_in), fan_in = n_in */
            uint64_t st = seed * 0x9e3779b97f4a7c15ULL + (uint64_t)(l * LORA_N_TARGETS + t) * 0x632be59bd9b4e019ULL;
            const double b = 1.0 / sqrt((double)s->n_in[t]);
            for (size_t i = 0; i < (size_t)s->rank * s->n_in[t]; i++)
                A[i] = (float)((2.0 * attn_rng_uniform(&st) - 1.0) * b);
            memset(B, 0, sizeof(float) * (size_t)s->n_out[t] * s->rank);
        }
}

float lora_scale(const lora_set *s) { return (s->alpha > 0 ? s->alpha / (float)s->rank : 1.0f) * s->user_scale; }

size_t lora_target_floats(const lora_set *s, lora_target t) {
    return (size_t)s->rank * ((size_t)s->n_in[t] + (size_t)s->n_out[t]);
}

size_t lora_floats(const lora_set *s) {
    size_t n = 0;
    for (int l = 0; l < s->n_layer; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++)
            if (lora_A(s, l, (lora_target)t)) n += lora_target_floats(s, (lora_target)t);
    return n;
}

/* Up to this many rows, lora_apply runs its own loops instead of two BLAS products. */
#define LORA_LOOP_MAX_T 4

int lora_apply(const lora_set *s, int layer, lora_target t, const float *X, float *Y, int T, float *tmp) {
    if (!s || T <= 0) return STILL_OK;
    const float *A = lora_A(s, layer, t), *B = lora_B(s, layer, t);
    if (!A) return STILL_OK;
    const int r = s->rank, ni = s->n_in[t], no = s->n_out[t];
    if (T <= LORA_LOOP_MAX_T && tmp) {
        /* A decode step's few rows: two small loops. The BLAS calls' set-up costs more than these products:
         * for SmolLM2's 120 targets (rank 8) 0.23 ms a token through cblas_sgemm against 0.08 ms here
         * (bench/results/2026-12-04-lora-decode/). */
        const float sc = lora_scale(s);
        for (int i = 0; i < T; i++) {
            const float *x = X + (size_t)i * ni;
            float *y = Y + (size_t)i * no, *u = tmp + (size_t)i * r;
            for (int j = 0; j < r; j++) {
                const float *a = A + (size_t)j * ni;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int c = 0; c < ni; c++) acc += a[c] * x[c];
                u[j] = sc * acc;
            }
            for (int o = 0; o < no; o++) {
                const float *b = B + (size_t)o * r;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int j = 0; j < r; j++) acc += b[j] * u[j];
                y[o] += acc;
            }
        }
        return STILL_OK;
    }
    float *own = NULL;
    if (!tmp) {
        tmp = own = malloc(sizeof(float) * (size_t)T * r);
        if (!own) return STILL_E_NOMEM;
    }
    /* U = X Aᵀ [T][r]; Y += s U Bᵀ */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, r, ni, 1.0f, X, ni, A, ni, 0.0f, tmp, r);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, no, r, lora_scale(s), tmp, r, B, r, 1.0f, Y, no);
    free(own);
    return STILL_OK;
}

/* ---- GGUF ---------------------------------------------------------------------- */

int lora_present(const gguf_file *f) {
    gguf_str a, b;
    if (gguf_get_str(f, "general.type", &a, NULL) || gguf_get_str(f, "adapter.type", &b, NULL)) return 0;
    return a.len == 7 && !memcmp(a.ptr, "adapter", 7) && b.len == 4 && !memcmp(b.ptr, "lora", 4);
}

/* Copy a float tensor (F32, F16, BF16) into dst after checking it is finite. */
static int read_floats(const gguf_tensor *t, float *dst, size_t n, const char *name, still_err *err) {
    const unsigned char *p = t->data;
    for (size_t i = 0; i < n; i++) {
        float x;
        if (t->type == TT_F32) memcpy(&x, p + 4 * i, 4);
        else {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            x = t->type == TT_F16 ? f16_to_f32(h) : bf16_to_f32(h);
        }
        if (!isfinite(x)) return still_fail(err, STILL_E_FORMAT, "LoRA tensor '%s' contains a non-finite value", name);
        dst[i] = x;
    }
    return STILL_OK;
}

int lora_read(const gguf_file *f, const lora_shape *sh, lora_set **out, still_err *err) {
    *out = NULL;
    if (!lora_present(f))
        return still_fail(err, STILL_E_FORMAT, "not a LoRA adapter (general.type = adapter and adapter.type = lora)");
    if (gguf_find(f, "adapter.alora.invocation_tokens"))
        return still_fail(err, STILL_E_UNSUPPORTED, "activated LoRA (adapter.alora.invocation_tokens) is not supported");
    float alpha = 0;
    if (gguf_find(f, "adapter.lora.alpha") && gguf_get_f32(f, "adapter.lora.alpha", &alpha, err)) return STILL_E_FORMAT;
    if (!isfinite(alpha) || alpha < 0) return still_fail(err, STILL_E_FORMAT, "adapter.lora.alpha = %g is invalid", alpha);
    lora_set *s;
    int rc = set_new(sh, 0, alpha, &s, err);
    if (rc) return rc;
    int n_pairs = 0;
    for (int64_t i = 0; !rc && i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        char name[256];
        if (t->name.len >= sizeof name) {
            rc = still_fail(err, STILL_E_FORMAT, "LoRA tensor name too long");
            break;
        }
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = 0;
        if (strstr(name, ".attn_hybrid.")) continue;   /* the attention plan's, not LoRA's */
        const size_t len = strlen(name);
        /* a fine-tune checkpoint's AdamW moments (still finetune) */
        if (len > 7 && (!strcmp(name + len - 7, ".adam_m") || !strcmp(name + len - 7, ".adam_v"))) continue;
        const int is_a = len > 7 && !strcmp(name + len - 7, ".lora_a"), is_b = len > 7 && !strcmp(name + len - 7, ".lora_b");
        if (!is_a && !is_b) {
            rc = still_fail(err, STILL_E_FORMAT, "LoRA tensor '%s' has an unexpected name (only .lora_a / .lora_b)", name);
            break;
        }
        int layer = -1, consumed = 0, tg = -1;
        char base[64];
        if (sscanf(name, "blk.%d.%63[^.].weight.lora_%*c%n", &layer, base, &consumed) != 2 || (size_t)consumed != len ||
            layer < 0 || layer >= sh->n_layer) {
            rc = still_fail(err, STILL_E_FORMAT, "LoRA tensor '%s' names no layer of this %d-layer model", name,
                            sh->n_layer);
            break;
        }
        for (int k = 0; k < LORA_N_TARGETS; k++)
            if (!strcmp(base, TENSOR_NAMES[k])) tg = k;
        if (tg < 0) {
            rc = still_fail(err, STILL_E_UNSUPPORTED, "LoRA tensor '%s': '%s' is not a supported target", name, base);
            break;
        }
        if (t->type != TT_F32 && t->type != TT_F16 && t->type != TT_BF16) {
            rc = still_fail(err, STILL_E_UNSUPPORTED, "LoRA tensor '%s' has type %s (F32, F16 or BF16 only)", name,
                            tensor_type_name(t->type));
            break;
        }
        /* lora_a: ne = [n_in, rank]; lora_b: ne = [rank, n_out] */
        const int64_t want = is_a ? sh->n_in[tg] : sh->n_out[tg];
        const int64_t r = is_a ? t->ne[1] : t->ne[0];
        if (t->n_dims != 2 || (is_a ? t->ne[0] : t->ne[1]) != want || r < 1 || r > (1 << 16)) {
            rc = still_fail(err, STILL_E_FORMAT,
                            "LoRA tensor '%s' has shape [%lld, %lld]; this model needs %s (was it made for another model?)",
                            name, (long long)t->ne[0], (long long)t->ne[1], is_a ? "[n_in, rank]" : "[rank, n_out]");
            break;
        }
        if (s->rank == 0) s->rank = (int)r;
        if (r != s->rank) {
            rc = still_fail(err, STILL_E_UNSUPPORTED, "LoRA tensor '%s' has rank %lld, others %d (one rank per adapter)",
                            name, (long long)r, s->rank);
            break;
        }
        float **dst = is_a ? &s->A[layer * LORA_N_TARGETS + tg] : &s->B[layer * LORA_N_TARGETS + tg];
        if (*dst) {
            rc = still_fail(err, STILL_E_FORMAT, "LoRA tensor '%s' appears twice", name);
            break;
        }
        const size_t n = (size_t)r * (size_t)want;
        if (!(*dst = malloc(n * sizeof(float)))) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory for the LoRA tensors");
            break;
        }
        rc = read_floats(t, *dst, n, name, err);
        s->targets |= 1u << tg;
        n_pairs += is_b;
    }
    for (int i = 0; !rc && i < sh->n_layer * LORA_N_TARGETS; i++)
        if (!s->A[i] != !s->B[i])
            rc = still_fail(err, STILL_E_FORMAT, "LoRA of blk.%d.%s has only one of lora_a and lora_b",
                            i / LORA_N_TARGETS, TENSOR_NAMES[i % LORA_N_TARGETS]);
    if (!rc && !n_pairs) rc = still_fail(err, STILL_E_FORMAT, "the LoRA adapter holds no tensors");
    if (rc) {
        lora_free(s);
        return rc;
    }
    *out = s;
    return STILL_OK;
}

int lora_write(const lora_set *s, gguf_writer *w, still_err *err) {
    int rc = gguf_writer_set_str(w, "general.type", "adapter", err);
    if (!rc) rc = gguf_writer_set_str(w, "adapter.type", "lora", err);
    if (!rc) rc = gguf_writer_set_f32(w, "adapter.lora.alpha", s->alpha, err);
    for (int l = 0; !rc && l < s->n_layer; l++)
        for (int t = 0; !rc && t < LORA_N_TARGETS; t++) {
            const float *A = lora_A(s, l, (lora_target)t), *B = lora_B(s, l, (lora_target)t);
            if (!A) continue;
            char name[96];
            int64_t nea[2] = {s->n_in[t], s->rank}, neb[2] = {s->rank, s->n_out[t]};
            snprintf(name, sizeof name, "blk.%d.%s.weight.lora_a", l, TENSOR_NAMES[t]);
            rc = gguf_writer_add_tensor(w, name, TT_F32, 2, nea, A, sizeof(float) * (size_t)s->rank * s->n_in[t], err);
            snprintf(name, sizeof name, "blk.%d.%s.weight.lora_b", l, TENSOR_NAMES[t]);
            if (!rc) rc = gguf_writer_add_tensor(w, name, TT_F32, 2, neb, B, sizeof(float) * (size_t)s->n_out[t] * s->rank, err);
        }
    return rc;
}
