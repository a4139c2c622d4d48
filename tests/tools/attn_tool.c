/* Helper for tests/python/test_attn_kinds.py (not a test itself): runs any
 * attention kind of src/kinds/attn.h over one sequence.
 *
 *   attn_tool IN OUT
 *
 * IN starts with one ASCII header line of space-separated key=value pairs,
 * terminated by '\n':
 *   kind=NAME L= H= Hk= D=            (required)
 *   d=        layer input width        (default H*D)
 *   n_ctx=    state capacity           (default L)
 *   window= chunk= F= budget= lambda= per_kv_head=0|1 sel_global=0|1 sel_span=R
 *   routing=saliency|random|keynorm|qk|position|none linear=0|1
 *   feature_map=npmap|hedgehog gate=0|1 gate_den=0|1 seed=
 *             (defaults 64 64 64 0 -1 0 saliency 1 npmap 1 0)
 *   sel_type=f32|f16|q8  still's Sel storage (default f32)
 *   splits=a,b,c  token counts of consecutive forward calls, summing to L
 *                 (default L: one call)
 *   threads=N     OpenMP threads (default: OpenMP's)
 *   check_truncate=1  afterwards truncate to n_seen (must succeed) and to 0,
 *                 run the splits again and require bit-identical outputs
 *   params_out=PATH   write the parameters used (float32) to PATH
 *   grad_out=PATH     also run the kind's backward_inputs over the whole
 *                 sequence: the data then holds dout [L][H*D] after x (before
 *                 the optional params), and PATH gets float32 dq [L][H*D],
 *                 dk [L][Hk*D], dv [L][Hk*D], dq_nope [L][H*D], dk_nope
 *                 [L][Hk*D], dx [L][d], dparams [param_count] (zeros where the
 *                 kind does not use an input)
 *   grad_params=0|1   with grad_out: also the parameters' gradient (default 1)
 * followed by raw little-endian float32 arrays: q [L][H*D] (after RoPE),
 * k [L][Hk*D], v [L][Hk*D], q_nope [L][H*D], k_nope [L][Hk*D], x [L][d], then
 * optionally params [kind->param_count(cfg)] (absent: kind->param_init with
 * the seed).
 *
 * Writes y [L][H*D] float32 to OUT and prints `state_bytes=N param_count=P`.
 * Exit status 0 on success, 1 on any error (one line on stderr). */
#include "kinds/attn.h"
#include "common/common.h"

#include <errno.h>
#include <limits.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "read_file.h"

static int write_file(const char *path, const void *data, size_t len, still_err *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return still_fail(err, STILL_E_IO, "cannot create %s: %s", path, strerror(errno));
    size_t w = len ? fwrite(data, 1, len, f) : 0;
    if (fclose(f) != 0 || w != len) return still_fail(err, STILL_E_IO, "cannot write %s", path);
    return STILL_OK;
}

static int parse_int(const char *key, const char *s, long long lo, long long hi, long long *out, still_err *err) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return still_fail(err, STILL_E_ARG, "bad value '%s' for %s (an integer in %lld..%lld)", s, key, lo, hi);
    *out = v;
    return STILL_OK;
}

typedef struct {
    char kind[64];
    int L, H, Hk, D, d, n_ctx, window, chunk, F, budget, lambda, per_kv_head, sel_global, sel_span, linear, gate, gate_den, threads, check_truncate;
    int grad_params;
    char grad_out[1024];
    attn_routing routing;
    attn_feature_map feature_map;
    attn_sel_type sel_type;
    uint64_t seed;
    int *splits, n_splits;
    char params_out[1024];
} header;

static const char *const ROUTINGS[] = {"saliency", "random", "keynorm", "qk", "position", "none"};

static int parse_header(char *line, header *h, still_err *err) {
    memset(h, 0, sizeof *h);
    h->L = h->H = h->Hk = h->D = h->d = h->n_ctx = -1;
    h->window = 64, h->chunk = 64, h->F = 64, h->budget = 0, h->lambda = -1;
    h->routing = ROUTE_SALIENCY, h->linear = 1, h->feature_map = FMAP_NPMAP, h->gate = 1, h->grad_params = 1;
    char *splits = NULL;
    for (char *tok = strtok(line, " \t\r"); tok; tok = strtok(NULL, " \t\r")) {
        char *eq = strchr(tok, '=');
        if (!eq || eq == tok) return still_fail(err, STILL_E_FORMAT, "header: expected key=value, got '%s'", tok);
        *eq = 0;
        const char *key = tok, *val = eq + 1;
        long long v = 0;
        int rc = STILL_OK;
        struct { const char *name; int *dst; long long lo, hi; } ints[] = {
            {"L", &h->L, 1, INT_MAX},          {"H", &h->H, 1, 4096},          {"Hk", &h->Hk, 1, 4096},
            {"D", &h->D, 1, 4096},             {"d", &h->d, 0, 1 << 20},       {"n_ctx", &h->n_ctx, 0, INT_MAX},
            {"window", &h->window, INT_MIN, INT_MAX}, {"chunk", &h->chunk, INT_MIN, INT_MAX},
            {"F", &h->F, INT_MIN, INT_MAX},    {"budget", &h->budget, INT_MIN, INT_MAX},
            {"lambda", &h->lambda, INT_MIN, INT_MAX}, {"per_kv_head", &h->per_kv_head, 0, 1},
            {"sel_global", &h->sel_global, 0, 1},     {"sel_span", &h->sel_span, INT_MIN, INT_MAX},
            {"linear", &h->linear, 0, 1},      {"gate", &h->gate, 0, 1}, {"gate_den", &h->gate_den, 0, 1},       {"threads", &h->threads, 1, 4096},
            {"check_truncate", &h->check_truncate, 0, 1}, {"grad_params", &h->grad_params, 0, 1},
        };
        int found = 0;
        for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
            if (!strcmp(key, ints[i].name)) {
                found = 1;
                if (!(rc = parse_int(key, val, ints[i].lo, ints[i].hi, &v, err))) *ints[i].dst = (int)v;
            }
        if (found) {
            if (rc) return rc;
        } else if (!strcmp(key, "kind")) {
            if (strlen(val) >= sizeof h->kind) return still_fail(err, STILL_E_ARG, "kind name too long");
            strcpy(h->kind, val);
        } else if (!strcmp(key, "seed")) {
            char *end;
            errno = 0;
            unsigned long long s = strtoull(val, &end, 10);
            if (errno || end == val || *end || val[0] == '-')
                return still_fail(err, STILL_E_ARG, "bad value '%s' for seed", val);
            h->seed = s;
        } else if (!strcmp(key, "routing")) {
            int r = -1;
            for (int i = 0; i < (int)(sizeof ROUTINGS / sizeof ROUTINGS[0]); i++)
                if (!strcmp(val, ROUTINGS[i])) r = i;
            if (r < 0) return still_fail(err, STILL_E_ARG, "unknown routing '%s'", val);
            h->routing = (attn_routing)r;
        } else if (!strcmp(key, "feature_map")) {
            if (!strcmp(val, "npmap")) h->feature_map = FMAP_NPMAP;
            else if (!strcmp(val, "hedgehog")) h->feature_map = FMAP_HEDGEHOG;
            else return still_fail(err, STILL_E_ARG, "unknown feature_map '%s'", val);
        } else if (!strcmp(key, "sel_type")) {
            if (!strcmp(val, "f32")) h->sel_type = SEL_F32;
            else if (!strcmp(val, "f16")) h->sel_type = SEL_F16;
            else if (!strcmp(val, "q8")) h->sel_type = SEL_Q8;
            else return still_fail(err, STILL_E_ARG, "unknown sel_type '%s'", val);
        } else if (!strcmp(key, "splits")) {
            splits = (char *)val;
        } else if (!strcmp(key, "params_out")) {
            if (strlen(val) >= sizeof h->params_out) return still_fail(err, STILL_E_ARG, "params_out path too long");
            strcpy(h->params_out, val);
        } else if (!strcmp(key, "grad_out")) {
            if (strlen(val) >= sizeof h->grad_out) return still_fail(err, STILL_E_ARG, "grad_out path too long");
            strcpy(h->grad_out, val);
        } else {
            return still_fail(err, STILL_E_ARG, "header: unknown key '%s'", key);
        }
    }
    if (!h->kind[0]) return still_fail(err, STILL_E_ARG, "header: kind= missing");
    if (h->L < 0 || h->H < 0 || h->Hk < 0 || h->D < 0)
        return still_fail(err, STILL_E_ARG, "header: L, H, Hk and D are required");
    if (h->d < 0) h->d = h->H * h->D;
    if (h->n_ctx < 0) h->n_ctx = h->L;
    /* splits */
    int n = 1;
    if (splits)
        for (const char *p = splits; *p; p++) n += *p == ',';
    h->splits = malloc(sizeof(int) * (size_t)n);
    if (!h->splits) return still_fail(err, STILL_E_NOMEM, "out of memory");
    h->n_splits = n;
    if (!splits) {
        h->splits[0] = h->L;
        return STILL_OK;
    }
    long long sum = 0;
    char *save = NULL;
    int i = 0;
    for (char *p = strtok_r(splits, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
        long long v = 0;
        int rc = parse_int("splits", p, 0, INT_MAX, &v, err);
        if (rc) return rc;
        h->splits[i++] = (int)v;
        sum += v;
    }
    if (i != n) return still_fail(err, STILL_E_ARG, "splits: empty entry");
    if (sum != h->L) return still_fail(err, STILL_E_ARG, "splits sum to %lld, not L = %d", sum, h->L);
    return STILL_OK;
}

/* Run every split; y [L][H*D]. */
static int run_splits(const attn_kind *k, attn_state *st, const header *h, const float *params, const float *q,
                      const float *kk, const float *v, const float *qn, const float *kn, const float *x, float *y,
                      still_err *err) {
    const size_t qd = (size_t)h->H * h->D, kvd = (size_t)h->Hk * h->D;
    int p = 0;
    for (int i = 0; i < h->n_splits; i++) {
        const int T = h->splits[i];
        attn_io io = {
            .q = q + (size_t)p * qd, .k = kk + (size_t)p * kvd, .v = v + (size_t)p * kvd,
            .q_nope = qn + (size_t)p * qd, .k_nope = kn + (size_t)p * kvd,
            .x = h->d > 0 ? x + (size_t)p * h->d : NULL, .p0 = p, .T = T,
        };
        int rc = k->forward(st, params, &io, y + (size_t)p * qd, err);
        if (rc) return rc;
        if (st->n_seen != p + T)
            return still_fail(err, STILL_E_STATE, "after the call at %d (%d tokens) the state holds %d tokens", p, T,
                              st->n_seen);
        p += T;
    }
    return STILL_OK;
}

static int run(const char *in_path, const char *out_path, still_err *err) {
    char *buf = NULL;
    size_t len = 0;
    int rc = read_file(in_path, (void **)&buf, &len, err);
    if (rc) return rc;
    char *nl = memchr(buf, '\n', len);
    if (!nl) {
        free(buf);
        return still_fail(err, STILL_E_FORMAT, "%s: no header line", in_path);
    }
    *nl = 0;
    for (const char *p = buf; p < nl; p++)
        if (*p < 0x20 && *p != '\t' && *p != '\r') {
            free(buf);
            return still_fail(err, STILL_E_FORMAT, "%s: header is not ASCII text", in_path);
        }
    header h;
    rc = parse_header(buf, &h, err);
    attn_state *st = NULL;
    float *data = NULL, *y = NULL, *y2 = NULL, *own_params = NULL, *grads = NULL;
    attn_kind_id id = ATTN_SOFTMAX;
    const attn_kind *k = NULL;
    if (rc) goto done;
    k = attn_kind_find(h.kind, &id);
    if (!k) {
        rc = still_fail(err, STILL_E_ARG, "unknown attention kind '%s'", h.kind);
        goto done;
    }
    if (h.H % h.Hk) {
        rc = still_fail(err, STILL_E_ARG, "H = %d is not a multiple of Hk = %d", h.H, h.Hk);
        goto done;
    }
    if (h.threads > 0) omp_set_num_threads(h.threads);
    attn_config cfg = {
        .kind = id, .n_head = h.H, .n_head_kv = h.Hk, .head_dim = h.D, .d_model = h.d, .n_ctx = h.n_ctx,
        .window = h.window, .chunk = h.chunk, .feature_dim = h.F, .budget = h.budget, .lambda = h.lambda,
        .per_kv_head = h.per_kv_head, .sel_global = h.sel_global, .sel_span = h.sel_span, .routing = h.routing, .linear = h.linear, .feature_map = h.feature_map,
        .gate = h.gate, .gate_den = h.gate_den, .seed = h.seed, .sel_type = h.sel_type,
    };
    const size_t L = (size_t)h.L, qd = (size_t)h.H * h.D, kvd = (size_t)h.Hk * h.D;
    const size_t n_in = L * (2 * qd + 3 * kvd + (size_t)h.d) + (h.grad_out[0] ? L * qd : 0);
    const size_t P = k->param_count(&cfg);
    const size_t have = len - (size_t)(nl + 1 - buf);
    if (have % sizeof(float) || (have != n_in * sizeof(float) && have != (n_in + P) * sizeof(float))) {
        rc = still_fail(err, STILL_E_FORMAT,
                        "%s: %zu data bytes; expected %zu (inputs) or %zu (inputs and %zu parameters) for %s", in_path,
                        have, n_in * sizeof(float), (n_in + P) * sizeof(float), P, h.kind);
        goto done;
    }
    data = malloc(have + sizeof(float));
    y = calloc(L * qd + 1, sizeof(float));
    if (!data || !y) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        goto done;
    }
    memcpy(data, nl + 1, have);
    const float *q = data, *kk = q + L * qd, *v = kk + L * kvd, *qn = v + L * kvd, *kn = qn + L * qd,
                *x = kn + L * kvd;
    const float *dout = h.grad_out[0] ? x + L * (size_t)h.d : NULL;
    const float *params = x + L * (size_t)h.d + (dout ? L * qd : 0);
    if (have == n_in * sizeof(float) && P > 0) {
        own_params = malloc(P * sizeof(float));
        if (!own_params) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory");
            goto done;
        }
        k->param_init(&cfg, own_params, h.seed);
        params = own_params;
    } else if (P == 0) {
        params = NULL;
    }
    if (h.params_out[0] && (rc = write_file(h.params_out, params, P * sizeof(float), err))) goto done;
    if ((rc = k->state_create(&cfg, &st, err))) goto done;
    if ((rc = run_splits(k, st, &h, params, q, kk, v, qn, kn, x, y, err))) goto done;
    if (h.check_truncate) {
        if ((rc = k->state_truncate(st, st->n_seen, err)) || (rc = k->state_truncate(st, 0, err))) goto done;
        if (st->n_seen != 0) {
            rc = still_fail(err, STILL_E_STATE, "truncate to 0 left %d tokens", st->n_seen);
            goto done;
        }
        y2 = calloc(L * qd + 1, sizeof(float));
        if (!y2) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory");
            goto done;
        }
        if ((rc = run_splits(k, st, &h, params, q, kk, v, qn, kn, x, y2, err))) goto done;
        if (memcmp(y, y2, L * qd * sizeof(float))) {
            rc = still_fail(err, STILL_E_STATE, "outputs after truncating to 0 differ from the first run");
            goto done;
        }
    }
    if ((rc = write_file(out_path, y, L * qd * sizeof(float), err))) goto done;
    if (dout) {
        if (!k->backward_inputs) {
            rc = still_fail(err, STILL_E_UNSUPPORTED, "kind '%s' has no backward_inputs", h.kind);
            goto done;
        }
        const size_t n_g = L * (2 * qd + 3 * kvd + (size_t)h.d) + P;
        grads = calloc(n_g + 1, sizeof(float));
        if (!grads) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory");
            goto done;
        }
        attn_grads g = {.dq = grads, .dk = grads + L * qd, .dv = grads + L * (qd + kvd),
                        .dq_nope = grads + L * (qd + 2 * kvd), .dk_nope = grads + L * (2 * qd + 2 * kvd),
                        .dx = h.d > 0 ? grads + L * (2 * qd + 3 * kvd) : NULL,
                        .dparams = h.grad_params && P ? grads + L * (2 * qd + 3 * kvd + (size_t)h.d) : NULL};
        attn_io io = {.q = q, .k = kk, .v = v, .q_nope = qn, .k_nope = kn, .x = h.d > 0 ? x : NULL, .p0 = 0,
                      .T = h.L};
        if ((rc = k->backward_inputs(&cfg, params, &io, dout, &g, err))) goto done;
        if ((rc = write_file(h.grad_out, grads, n_g * sizeof(float), err))) goto done;
    }
    printf("state_bytes=%zu param_count=%zu\n", k->state_bytes(st), P);
done:
    if (st) k->state_free(st);
    free(h.splits), free(buf), free(data), free(y), free(y2), free(own_params), free(grads);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 1;
    }
    still_err err = {0};
    if (run(argv[1], argv[2], &err)) {
        fprintf(stderr, "attn_tool: %s\n", err.msg);
        return 1;
    }
    return 0;
}
