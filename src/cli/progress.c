/* The training commands' progress line (linearize, finetune): a bar at a
 * terminal, a log line per step otherwise. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static void fmt_time(double s, char *buf, size_t cap) {
    if (!(s >= 0) || s > 1e7) snprintf(buf, cap, "--");
    else if (s >= 3600) snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
    else if (s >= 60) snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else snprintf(buf, cap, "%.0fs", s);
}

void cli_on_progress(void *data, const still_train_progress *p) {
    cli_progress *st = data;
    char el[32], eta[32];
    fmt_time(p->elapsed_s, el, sizeof el);
    fmt_time(p->eta_s, eta, sizeof eta);
    if (!strcmp(p->phase, "data")) {
        fprintf(stderr, "%s: reading and tokenizing the training data\n", st->name);
        return;
    }
    if (!strcmp(p->phase, "done")) {
        if (st->tty) fputc('\n', stderr);
        fprintf(stderr, "%s: done in %s\n", st->name, el);
        return;
    }
    const int train = !strcmp(p->phase, "train");
    const int last = p->done == p->total;
    const double frac = p->total ? (double)p->done / p->total : 1;
    char line[256];
    if (train)
        snprintf(line, sizeof line, "step %d/%d  %lld tok  %.0f tok/s  loss %.4f  |g| %.3g  lr %.2e  ETA %s", p->step,
                 p->n_steps, p->tokens_done, p->tokens_per_s, p->loss, p->grad_norm, p->lr, eta);
    else
        snprintf(line, sizeof line, "%s %d/%d sequences  loss %.4f  (%s)", p->phase, p->done, p->total, p->loss, el);
    if (st->tty) {
        char bar[31];
        const int w = 30, fill = (int)(frac * w + 0.5);
        for (int i = 0; i < w; i++) bar[i] = i < fill ? '=' : ' ';
        bar[w] = 0;
        fprintf(stderr, "\r\033[K[%s] %5.1f%% %s", bar, 100 * frac, line);
        if (last && !train) fputc('\n', stderr);
    } else {
        /* a log line per step, and per validation pass */
        if (train || last) fprintf(stderr, "%s: %s\n", st->name, line);
    }
    fflush(stderr);
}

