/* mc_tool MODEL FILE.jsonl [n_ctx] [--matvec float|int8|int8-portable|int8-avx2|int8-vnni]
 * Runs the lm-eval style multiple-choice scorer (src/eval/eval_mc.c) and prints one
 * line per item with the log-likelihood of each choice (%.6f, space
 * separated), then "acc=%.6f acc_norm=%.6f n=%d". n_ctx defaults to 2048
 * (lm-eval's default max_length); --matvec sets the single-token products
 * (default: the engine's, int8 on the CPU). Errors: one line on stderr, exit 1
 * (bad arguments: exit 2). Driven by tests/python/test_eval_mc.py. */
#include "eval/eval.h"
#include "still.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    int matvec = STILL_MATVEC_DEFAULT;
    if (argc >= 5 && !strcmp(argv[argc - 2], "--matvec")) {
        static const char *const names[] = {"float", "int8", "int8-portable", "int8-avx2", "int8-vnni"};
        const char *v = argv[argc - 1];
        matvec = -1;
        for (int k = 0; k < 5; k++)
            if (!strcmp(v, names[k])) matvec = STILL_MATVEC_FLOAT + k;   /* STILL_MATVEC_* in this order */
        if (matvec < 0) {
            fprintf(stderr, "mc_tool: error: --matvec takes float, int8, int8-portable, int8-avx2 or int8-vnni, got '%s'\n", v);
            return 2;
        }
        argc -= 2;
    }
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: mc_tool MODEL FILE.jsonl [n_ctx] [--matvec float|int8|int8-portable|int8-avx2|int8-vnni]\n");
        return 2;
    }
    int n_ctx = 2048;
    if (argc == 4) {
        char *end;
        errno = 0;
        long v = strtol(argv[3], &end, 10);
        if (errno || *end || end == argv[3] || v < 1 || v > (1 << 22)) {
            fprintf(stderr, "mc_tool: error: n_ctx '%s' is not an integer in 1 .. %d\n", argv[3], 1 << 22);
            return 2;
        }
        n_ctx = (int)v;
    }
    still_err err = {0};
    still_model *m = NULL;
    if (still_model_load(argv[1], &m, &err)) {
        fprintf(stderr, "mc_tool: error: %s\n", err.msg);
        return 1;
    }
    eval_mc_result r;
    if (eval_mc_run(m, argv[2], n_ctx, matvec, &r, &err)) {
        fprintf(stderr, "mc_tool: error: %s\n", err.msg);
        still_model_free(m);
        return 1;
    }
    for (int i = 0; i < r.n_items; i++) {
        for (int k = r.item_first_choice[i]; k < r.item_first_choice[i + 1]; k++)
            printf(k > r.item_first_choice[i] ? " %.6f" : "%.6f", r.loglik[k]);
        printf("\n");
    }
    printf("acc=%.6f acc_norm=%.6f n=%d\n", r.acc, r.acc_norm, r.n_items);
    eval_mc_result_free(&r);
    still_model_free(m);
    return fflush(stdout) ? 1 : 0;
}
