/* Sampler tests: each filter against a direct computation of what it must
 * keep, empirical frequencies against the softmax distribution, determinism. */
#include "still.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

enum { V = 50 };

static still_sampler *make(still_sampler_params p) {
    still_sampler *s;
    still_err err = {0};
    if (still_sampler_create(p, V, &s, &err)) {
        printf("create failed: %s\n", err.msg);
        exit(1);
    }
    return s;
}

static void fill_logits(float *l, unsigned seed) {
    srand(seed);
    for (int i = 0; i < V; i++) l[i] = (float)(rand() % 1000) / 100.0f - 5.0f;
}

/* Draw many samples and return counts. */
static void histogram(still_sampler_params p, const float *base, int n, int *counts) {
    still_sampler *s = make(p);
    float l[V];
    memset(counts, 0, sizeof(int) * V);
    for (int i = 0; i < n; i++) {
        memcpy(l, base, sizeof l);
        int id = still_sampler_sample(s, l);
        if (id >= 0 && id < V) counts[id]++;
    }
    still_sampler_free(s);
}

/* Probabilities at temperature t over the set allowed[]. */
static void expected(const float *base, const int *allowed, float t, double *p) {
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < V; i++) if (allowed[i] && base[i] > mx) mx = base[i];
    for (int i = 0; i < V; i++) { p[i] = allowed[i] ? exp((base[i] - mx) / t) : 0; sum += p[i]; }
    for (int i = 0; i < V; i++) p[i] /= sum;
}

static void check_freq(const char *what, const int *counts, const double *p, int n) {
    double worst = 0;
    int leaked = 0;
    for (int i = 0; i < V; i++) {
        if (p[i] == 0 && counts[i] > 0) leaked++;
        double sd = sqrt(n * p[i] * (1 - p[i])) + 1;
        double z = fabs(counts[i] - n * p[i]) / sd;
        if (z > worst) worst = z;
    }
    CHECK(leaked == 0, "%s: %d tokens outside the allowed set were drawn", what, leaked);
    CHECK(worst < 5.5, "%s: frequency deviates %.1f sd from the expected distribution", what, worst);
}

int main(void) {
    float base[V], l[V];
    fill_logits(base, 1);
    int argmax = 0;
    for (int i = 1; i < V; i++) if (base[i] > base[argmax]) argmax = i;

    /* Greedy. */
    still_sampler_params p = still_sampler_default_params();
    p.temp = 0;
    still_sampler *s = make(p);
    memcpy(l, base, sizeof l);
    CHECK(still_sampler_sample(s, l) == argmax, "greedy must return the argmax");
    still_sampler_free(s);

    /* NaN logits never win. */
    p.temp = 0;
    s = make(p);
    memcpy(l, base, sizeof l);
    l[3] = NAN;
    int g = still_sampler_sample(s, l);
    CHECK(g != 3 && g >= 0, "NaN logit must not be chosen");
    still_sampler_free(s);

    int counts[V], allowed[V];
    double prob[V];
    const int N = 200000;

    /* Plain temperature sampling, no filters. */
    p = still_sampler_default_params();
    p.top_k = 0, p.top_p = 1, p.min_p = 0, p.temp = 1.5f;
    histogram(p, base, N, counts);
    for (int i = 0; i < V; i++) allowed[i] = 1;
    expected(base, allowed, 1.5f, prob);
    check_freq("temperature", counts, prob, N);

    /* top-k: exactly the k largest. */
    p.temp = 1, p.top_k = 5;
    histogram(p, base, N, counts);
    for (int i = 0; i < V; i++) {
        int rank = 0;
        for (int j = 0; j < V; j++) rank += base[j] > base[i] || (base[j] == base[i] && j < i);
        allowed[i] = rank < 5;
    }
    expected(base, allowed, 1, prob);
    check_freq("top-k", counts, prob, N);

    /* top-p: the smallest prefix (by probability) whose mass reaches p. */
    p.top_k = 0, p.top_p = 0.6f;
    histogram(p, base, N, counts);
    {
        double full[V];
        for (int i = 0; i < V; i++) allowed[i] = 1;
        expected(base, allowed, 1, full);
        for (int i = 0; i < V; i++) {
            double above = 0;   /* mass of tokens ranked before i */
            for (int j = 0; j < V; j++)
                if (base[j] > base[i] || (base[j] == base[i] && j < i)) above += full[j];
            allowed[i] = above < 0.6;
        }
    }
    expected(base, allowed, 1, prob);
    check_freq("top-p", counts, prob, N);

    /* min-p: tokens with p >= min_p * p_max. */
    p.top_p = 1, p.min_p = 0.2f;
    histogram(p, base, N, counts);
    for (int i = 0; i < V; i++) allowed[i] = exp(base[i] - base[argmax]) >= 0.2;
    expected(base, allowed, 1, prob);
    check_freq("min-p", counts, prob, N);

    /* Repetition penalty lowers a repeated token's logit as specified. */
    p = still_sampler_default_params();
    p.temp = 0, p.repeat_penalty = 1000.0f, p.repeat_last_n = 4;
    s = make(p);
    still_sampler_accept(s, argmax);
    memcpy(l, base, sizeof l);
    int after = still_sampler_sample(s, l);
    CHECK(after != argmax, "penalised argmax must lose");
    CHECK(fabsf(l[argmax] - (base[argmax] > 0 ? base[argmax] / 1000 : base[argmax] * 1000)) < 1e-6f,
          "penalty formula");
    /* After 4 more accepted tokens the window has forgotten it. */
    for (int i = 1; i <= 4; i++) still_sampler_accept(s, (argmax + i) % V);
    memcpy(l, base, sizeof l);
    CHECK(still_sampler_sample(s, l) == argmax, "a token older than repeat_last_n must not be penalised");
    still_sampler_free(s);

    /* Same seed, same sequence; different seed, different sequence. */
    p = still_sampler_default_params();
    p.top_k = 0, p.top_p = 1, p.min_p = 0, p.temp = 1, p.seed = 7;
    int a[64], b[64], c[64];
    still_sampler *s1 = make(p), *s2 = make(p);
    p.seed = 8;
    still_sampler *s3 = make(p);
    int differ = 0;
    for (int i = 0; i < 64; i++) {
        memcpy(l, base, sizeof l); a[i] = still_sampler_sample(s1, l);
        memcpy(l, base, sizeof l); b[i] = still_sampler_sample(s2, l);
        memcpy(l, base, sizeof l); c[i] = still_sampler_sample(s3, l);
        differ += a[i] != c[i];
    }
    CHECK(memcmp(a, b, sizeof a) == 0, "same seed must give the same draws");
    CHECK(differ > 0, "different seeds should give different draws");
    still_sampler_free(s1), still_sampler_free(s2), still_sampler_free(s3);

    /* Invalid parameters are rejected with a message. */
    still_err err = {0};
    p = still_sampler_default_params();
    p.top_p = 0;
    CHECK(still_sampler_create(p, V, &s, &err) != STILL_OK && err.msg[0], "top_p = 0 must be rejected");
    p = still_sampler_default_params();
    p.temp = NAN;
    CHECK(still_sampler_create(p, V, &s, &err) != STILL_OK, "NaN temperature must be rejected");

    return CHECK_SUMMARY();
}
