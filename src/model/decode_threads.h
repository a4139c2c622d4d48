/* How many threads a CPU decode step uses: a governor that keeps decode from collapsing when the machine is busy.
 *
 * A decode step is ~150 short OpenMP regions; libgomp's threads spin between them (up to its spin count) before
 * they sleep. With every core free that is fastest; with another process running on one of the cores, a spinning
 * thread holds the core the step's other thread needs, and each region then waits for the scheduler: tg64 at 2
 * threads on 2 cores fell from ~210 t/s to 4–34 t/s beside one `yes` process, llama.cpp's to 7–69
 * (bench/results/2026-12-07-wait-policy-cpu/). Fewer threads than cores do not collapse: 75–79 t/s at 1 thread.
 *
 * The governor times every step and keeps two arms, all the allowed threads (omp_get_max_threads() at the
 * step) and half of them (at least 1); it runs the faster arm by its running average and measures the other
 * once in a while: after 64 steps, then at doubling intervals up to 1,024 while the choice stands, and at once
 * when a step takes more than 2.5 times its arm's average (a load arriving). Idle, the cost is one slower step
 * in 1,024; busy, the step leaves the collapsed arm within a few steps. */
#ifndef STILL_MODEL_DECODE_THREADS_H
#define STILL_MODEL_DECODE_THREADS_H

typedef struct {
    int n_max;          /* the threads allowed when the arms were set up (0: not yet) */
    int arm;            /* the arm in use: 0 all threads, 1 half */
    double avg[2];      /* seconds per step, a running average per arm (0: not measured) */
    int since, interval;/* steps since the other arm was last measured; steps between measurements */
    int explore;        /* the next step measures the other arm */
    int step_arm;       /* the arm of the step in flight */
} decode_threads;

/* The threads for the next step (and the arm it belongs to, kept in g). */
int decode_threads_begin(decode_threads *g, int n_max);
/* The step took `seconds`: update the averages and the choice. */
void decode_threads_end(decode_threads *g, double seconds);

#endif
