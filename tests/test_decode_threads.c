/* The decode-step thread governor (src/model/decode_threads.h) driven by a simulated machine: each arm's step
 * time is given per phase (idle: all threads fastest; busy: all threads collapsed), and the governor must keep
 * or find the faster arm with few steps spent on the slower one. */
#include "model/decode_threads.h"

#include <stdio.h>

#include "check.h"

/* Run n steps on a machine whose step takes t_all (all threads) or t_half seconds; count the steps per arm and
 * return the total time. */
static double run(decode_threads *g, int n_max, int n, double t_all, double t_half, int *on_all, int *on_half) {
    double total = 0;
    *on_all = *on_half = 0;
    for (int i = 0; i < n; i++) {
        const int t = decode_threads_begin(g, n_max);
        const double s = t == n_max ? t_all : t_half;
        if (t == n_max) ++*on_all;
        else ++*on_half;
        CHECK(t >= 1 && t <= n_max, "threads %d of %d", t, n_max);
        decode_threads_end(g, s);
        total += s;
    }
    return total;
}

int main(void) {
    decode_threads g = {0};
    int a, h;
    /* idle, 2 threads: all threads (5 ms) beat one (11 ms); the other arm is measured rarely */
    double tot = run(&g, 2, 4096, 0.005, 0.011, &a, &h);
    CHECK(h <= 8, "idle: %d of 4096 steps on half the threads (at most 8)", h);
    CHECK(tot < 4096 * 0.005 * 1.01, "idle: %.4f s against %.4f s on all threads (within 1%%)", tot, 4096 * 0.005);
    /* a load arrives: all threads collapse to 150 ms a step, one thread takes 13 ms */
    run(&g, 2, 3, 0.150, 0.013, &a, &h);
    CHECK(a <= 2, "busy: %d of the first 3 steps on the collapsed arm (at most 2)", a);
    tot = run(&g, 2, 2048, 0.150, 0.013, &a, &h);
    CHECK(a <= 6, "busy: %d of 2048 steps on the collapsed arm (at most 6)", a);
    CHECK(tot < 2048 * 0.013 * 1.05, "busy: %.3f s against %.3f s on one thread (within 5%%)", tot, 2048 * 0.013);
    /* the load leaves: back to all threads within the measuring interval (at most 1,024 steps) */
    run(&g, 2, 1100, 0.005, 0.011, &a, &h);
    tot = run(&g, 2, 512, 0.005, 0.011, &a, &h);
    CHECK(h <= 2, "idle again: %d of 512 steps on half the threads after the first 1,100 (at most 2)", h);
    /* noise on all threads (a step in 16 at 2x) does not send the governor to the slower arm */
    decode_threads n = {0};
    int on_half = 0;
    for (int i = 0; i < 4096; i++) {
        const int t = decode_threads_begin(&n, 8);
        on_half += t != 8;
        decode_threads_end(&n, t == 8 ? (i % 16 == 0 ? 0.010 : 0.005) : 0.008);
    }
    CHECK(on_half <= 40, "noisy idle, 8 threads: %d of 4096 steps on 4 threads (at most 40)", on_half);
    /* one thread allowed: always 1; a change of the allowed threads starts over on all of them */
    decode_threads o = {0};
    CHECK(decode_threads_begin(&o, 1) == 1, "one thread allowed: one thread");
    decode_threads_end(&o, 0.01);
    CHECK(decode_threads_begin(&o, 4) == 4, "four allowed after one: four");
    return CHECK_SUMMARY();
}
