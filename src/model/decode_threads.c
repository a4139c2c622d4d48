/* The decode-step thread governor (decode_threads.h). */
#include "model/decode_threads.h"

enum { GOV_FIRST = 64, GOV_MAX = 1024 };
#define GOV_SPIKE 2.5      /* a step this many times its arm's average: measure the other arm now */
#define GOV_SWITCH 0.8     /* the other arm must be this much faster to take over */

static int arm_threads(int n_max, int arm) { return arm == 0 ? n_max : (n_max / 2 > 0 ? n_max / 2 : 1); }

int decode_threads_begin(decode_threads *g, int n_max) {
    if (n_max != g->n_max) {
        const decode_threads fresh = {.n_max = n_max, .interval = GOV_FIRST};
        *g = fresh;
    }
    if (n_max <= 1) return g->step_arm = 0, n_max > 0 ? n_max : 1;
    g->step_arm = g->explore ? 1 - g->arm : g->arm;
    return arm_threads(n_max, g->step_arm);
}

void decode_threads_end(decode_threads *g, double seconds) {
    if (g->n_max <= 1 || !(seconds > 0)) return;
    const int a = g->step_arm;
    if (a != g->arm) {   /* a measurement of the other arm: take it over if clearly faster */
        g->avg[a] = seconds;
        g->explore = 0, g->since = 0;
        if (seconds < GOV_SWITCH * g->avg[g->arm]) g->arm = a, g->interval = GOV_FIRST;
        else g->interval = g->interval * 2 < GOV_MAX ? g->interval * 2 : GOV_MAX;
        return;
    }
    const double prev = g->avg[a];
    g->avg[a] = prev > 0 ? 0.75 * prev + 0.25 * seconds : seconds;
    if (prev > 0 && seconds > GOV_SPIKE * prev) g->explore = 1;
    if (++g->since >= g->interval) g->explore = 1;
}
