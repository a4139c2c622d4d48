/* Token sampling: repetition penalty -> top-k -> top-p -> min-p ->
 * temperature -> draw (or greedy argmax when temp <= 0). Deterministic given
 * the seed (PCG32 random generator owned by the sampler). */
#include "common/common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct still_sampler {
    still_sampler_params p;
    int n_vocab;
    uint64_t rng_state, rng_inc;
    int32_t *recent;       /* ring buffer of the last repeat_last_n accepted tokens */
    int n_recent, recent_head;
    int32_t *idx;          /* n_vocab candidate ids */
    float *prob;           /* n_vocab candidate weights */
};

still_sampler_params still_sampler_default_params(void) {
    still_sampler_params p = {
        .temp = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
        .repeat_penalty = 1.0f, .repeat_last_n = 64, .seed = 42,
    };
    return p;
}

static uint32_t pcg32(still_sampler *s) {
    uint64_t old = s->rng_state;
    s->rng_state = old * 6364136223846793005ULL + s->rng_inc;
    uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u);
    uint32_t rot = (uint32_t)(old >> 59u);
    return (xorshifted >> rot) | (xorshifted << ((32 - rot) & 31));
}

/* Uniform in [0, 1) with 32 random bits. */
static double uniform01(still_sampler *s) { return pcg32(s) / 4294967296.0; }

int still_sampler_create(still_sampler_params p, int n_vocab, still_sampler **out, still_err *err) {
    *out = NULL;
    if (n_vocab <= 0) return still_fail(err, STILL_E_ARG, "vocabulary size must be positive");
    if (!isfinite(p.temp) || !isfinite(p.top_p) || !isfinite(p.min_p) || !isfinite(p.repeat_penalty))
        return still_fail(err, STILL_E_ARG, "sampling parameters must be finite numbers");
    if (p.top_p <= 0) return still_fail(err, STILL_E_ARG, "--top-p must be in (0, 1], got %g", p.top_p);
    if (p.min_p > 1) return still_fail(err, STILL_E_ARG, "--min-p must be in [0, 1], got %g", p.min_p);
    if (p.repeat_penalty <= 0)
        return still_fail(err, STILL_E_ARG, "--repeat-penalty must be positive, got %g", p.repeat_penalty);
    if (p.repeat_last_n < 0)
        return still_fail(err, STILL_E_ARG, "--repeat-last-n must be >= 0, got %d", p.repeat_last_n);
    still_sampler *s = calloc(1, sizeof *s);
    if (!s) return still_fail(err, STILL_E_NOMEM, "out of memory");
    s->p = p;
    s->n_vocab = n_vocab;
    s->recent = malloc(sizeof(int32_t) * (size_t)(p.repeat_last_n > 0 ? p.repeat_last_n : 1));
    s->idx = malloc(sizeof(int32_t) * (size_t)n_vocab);
    s->prob = malloc(sizeof(float) * (size_t)n_vocab);
    if (!s->recent || !s->idx || !s->prob) {
        still_sampler_free(s);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    s->rng_inc = (p.seed << 1u) | 1u;
    s->rng_state = 0;
    pcg32(s);
    s->rng_state += p.seed ^ 0x853c49e6748fea9bULL;
    pcg32(s);
    *out = s;
    return STILL_OK;
}

void still_sampler_free(still_sampler *s) {
    if (!s) return;
    free(s->recent);
    free(s->idx);
    free(s->prob);
    free(s);
}

void still_sampler_accept(still_sampler *s, int32_t id) {
    if (s->p.repeat_last_n <= 0) return;
    s->recent[s->recent_head] = id;
    s->recent_head = (s->recent_head + 1) % s->p.repeat_last_n;
    if (s->n_recent < s->p.repeat_last_n) s->n_recent++;
}

static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *w = ctx;
    float x = w[*(const int32_t *)a], y = w[*(const int32_t *)b];
    if (x > y) return -1;
    if (x < y) return 1;
    return *(const int32_t *)a - *(const int32_t *)b;   /* ties: lower id first, deterministic */
}

int32_t still_sampler_sample(still_sampler *s, float *logits) {
    const int V = s->n_vocab;
    /* Repetition penalty (each distinct recent token once). */
    if (s->p.repeat_penalty != 1.0f && s->n_recent > 0) {
        for (int i = 0; i < s->n_recent; i++) {
            int32_t id = s->recent[i];
            if (id < 0 || id >= V) continue;
            int seen = 0;
            for (int j = 0; j < i; j++) seen |= s->recent[j] == id;
            if (seen) continue;
            float *l = &logits[id];
            *l = *l > 0 ? *l / s->p.repeat_penalty : *l * s->p.repeat_penalty;
        }
    }
    /* NaN logits never win. */
    int32_t best = -1;
    for (int i = 0; i < V; i++) {
        if (isnan(logits[i])) logits[i] = -INFINITY;
        if (best < 0 || logits[i] > logits[best]) best = i;
    }
    if (s->p.temp <= 0 || s->p.top_k == 1) return best;

    /* Candidates sorted by logit, truncated by top-k. */
    int n = 0;
    for (int i = 0; i < V; i++)
        if (logits[i] > -INFINITY) s->idx[n++] = i;
    if (n == 0) return best;
    qsort_r(s->idx, (size_t)n, sizeof(int32_t), cmp_desc, logits);
    if (s->p.top_k > 0 && s->p.top_k < n) n = s->p.top_k;

    /* Probabilities at temperature 1 for top-p / min-p (as llama.cpp applies
     * temperature last), then the temperature for the draw. */
    float mx = logits[s->idx[0]];
    double sum = 0;
    for (int i = 0; i < n; i++) {
        s->prob[i] = expf(logits[s->idx[i]] - mx);
        sum += s->prob[i];
    }
    if (s->p.top_p < 1.0f) {
        double cum = 0;
        for (int i = 0; i < n; i++) {
            cum += s->prob[i] / sum;
            if (cum >= s->p.top_p) { n = i + 1; break; }
        }
    }
    if (s->p.min_p > 0) {
        float thresh = s->p.min_p * s->prob[0];   /* prob[0] is the max, = 1 before normalisation */
        int keep = 1;
        while (keep < n && s->prob[keep] >= thresh) keep++;
        n = keep;
    }
    sum = 0;
    for (int i = 0; i < n; i++) {
        s->prob[i] = expf((logits[s->idx[i]] - mx) / s->p.temp);
        sum += s->prob[i];
    }
    double r = uniform01(s) * sum, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += s->prob[i];
        if (r < acc) return s->idx[i];
    }
    return s->idx[n - 1];
}
