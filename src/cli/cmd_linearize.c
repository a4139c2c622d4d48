/* `still linearize`: stage-1 attention transfer (src/train/train.c) from the
 * command line, with a progress bar and a per-layer validation table. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int cmd_linearize(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_LINEARIZE, "linearize", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    if (!o.output) {
        fprintf(stderr, "still linearize: error: no output file given (use -o FILE)\n");
        return 2;
    }
    if (!o.n_data) {
        fprintf(stderr, "still linearize: error: no training data given (use --data FILE, repeatable)\n");
        return 2;
    }
    if (!o.attn_given && !o.adapter) {
        fprintf(stderr, "still linearize: error: no attention kind given (use --attn KIND)\n");
        return 2;
    }
    for (int i = 0; i < o.n_data; i++)
        if (access(o.data[i], R_OK)) {
            fprintf(stderr, "still linearize: error: cannot read training data '%s'\n", o.data[i]);
            return 1;
        }
    /* Fail on an unwritable output before hours of training. */
    {
        char probe[4096];
        if (snprintf(probe, sizeof probe, "%s.probe", o.output) >= (int)sizeof probe) {
            fprintf(stderr, "still linearize: error: output path too long\n");
            return 2;
        }
        FILE *f = fopen(probe, "wb");
        if (!f) {
            fprintf(stderr, "still linearize: error: cannot write the output '%s'\n", o.output);
            return 1;
        }
        fclose(f);
        remove(probe);
    }
    still_model *m;
    const int lrc = cli_load_model(&o, &m);
    if (lrc) return lrc;
    o.tp.data_files = o.data;
    o.tp.n_data_files = o.n_data;
    o.tp.out_path = o.output;
    o.tp.device = cli_device(&o);
    /* a checkpoint (adapter + AdamW moments, ~150 MB for still on SmolLM2) every 10 steps suits the CPU's
     * minutes per step; the GPU takes about a tenth of a second per step */
    if (o.tp.ckpt_every < 0) o.tp.ckpt_every = o.tp.device == STILL_DEVICE_CUDA ? 500 : 10;
    o.tp.adapter_f16 = o.outtype && !strcmp(o.outtype, "f16");
    cli_progress ps = {.tty = isatty(2), .name = "linearize"};
    o.tp.progress = cli_on_progress;
    o.tp.progress_data = &ps;
    fprintf(stderr, "linearize: %s -> %s, attention %s, %lld tokens, seq %d, batch %d, lr %g, seed %llu\n", o.model,
            o.output, still_model_layer_kind(m, 0), o.tp.tokens, o.tp.seq, o.tp.batch, o.tp.lr,
            (unsigned long long)o.tp.seed);
    still_train_result r;
    still_err err = {0};
    const double t0 = cli_now();
    int rc = still_train(m, &o.tp, &r, &err);
    if (rc) {
        if (ps.tty) fputc('\n', stderr);
        fprintf(stderr, "still linearize: error: %s\n", err.msg);
        still_model_free(m);
        return 1;
    }
    printf("# still linearize: %s\n\n", o.output);
    printf("data: %lld tokens in %d files -> %d training + %d validation sequences of %d tokens\n", r.n_tokens_data,
           o.n_data, r.n_train_seqs, r.n_val_seqs, o.tp.seq);
    printf("training: %d steps%s, %lld tokens, %.1f s, %.1f tokens/s, final loss %.4f\n", r.n_steps,
           r.start_step ? " (resumed)" : "", (long long)(r.n_steps - r.start_step) * o.tp.seq * o.tp.batch,
           r.train_seconds, r.tokens_per_s, r.final_loss);
    printf("wall time %.1f s, peak memory %.1f MiB\n\n", cli_now() - t0, cli_peak_rss() / 1048576.0);
    printf("| layer | kind | val MSE before | val MSE after |\n|---:|---|---:|---:|\n");
    double sb = 0, sa = 0;
    int nb = 0, na = 0;
    for (int l = 0; l < r.n_layer; l++) {
        const double b = r.val_mse_before[l], a = r.val_mse_after[l];
        if (isnan(b) && isnan(a)) continue;
        printf("| %d | %s | %.6g | %.6g |\n", l, still_model_layer_kind(m, l), b, a);
        if (!isnan(b)) sb += b, nb++;
        if (!isnan(a)) sa += a, na++;
    }
    if (na) printf("| mean | | %.6g | %.6g |\n", nb ? sb / nb : NAN, sa / na);
    still_train_result_free(&r);
    still_model_free(m);
    return 0;
}
