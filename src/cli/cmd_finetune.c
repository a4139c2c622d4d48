/* `still finetune`: stage-2 LoRA fine-tuning (src/train/finetune.c) from the
 * command line, with a progress bar and the validation loss and perplexity
 * before and after. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int cmd_finetune(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_FINETUNE, "finetune", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    if (!o.output) {
        fprintf(stderr, "still finetune: error: no output file given (use -o FILE)\n");
        return 2;
    }
    if (!o.n_data) {
        fprintf(stderr, "still finetune: error: no training data given (use --data FILE, repeatable)\n");
        return 2;
    }
    for (int i = 0; i < o.n_data; i++)
        if (access(o.data[i], R_OK)) {
            fprintf(stderr, "still finetune: error: cannot read training data '%s'\n", o.data[i]);
            return 1;
        }
    still_finetune_params fp = still_finetune_default_params();
    fp.train = o.tp;
    fp.lora_rank = o.lora_rank, fp.lora_alpha = o.lora_alpha, fp.lora_dropout = o.lora_dropout;
    fp.lora_targets = o.lora_targets, fp.train_attn = o.train_attn, fp.gpu_fp32 = o.fp32;
    fp.train.data_files = o.data;
    fp.train.n_data_files = o.n_data;
    fp.train.out_path = o.output;
    fp.train.device = cli_device(&o);
    if (fp.train.ckpt_every < 0) fp.train.ckpt_every = 10;
    fp.train.adapter_f16 = o.outtype && !strcmp(o.outtype, "f16");
    cli_progress ps = {.tty = isatty(2), .name = "finetune"};
    fp.train.progress = cli_on_progress;
    fp.train.progress_data = &ps;
    still_model *m;
    const int lrc = cli_load_model(&o, &m);
    if (lrc) return lrc;
    fprintf(stderr, "finetune: %s%s%s -> %s, attention %s, LoRA rank %d alpha %g on %s%s, %lld tokens, seq %d, batch %d, "
                    "lr %g, seed %llu\n", o.model, o.adapter ? " + " : "", o.adapter ? o.adapter : "", o.output,
            still_model_layer_kind(m, 0), fp.lora_rank, fp.lora_alpha, fp.lora_targets,
            fp.train_attn ? " + the attention parameters" : "", fp.train.tokens, fp.train.seq, fp.train.batch,
            fp.train.lr, (unsigned long long)fp.train.seed);
    still_finetune_result r;
    still_err err = {0};
    const double t0 = cli_now();
    int rc = still_finetune(m, &fp, &r, &err);
    if (rc) {
        if (ps.tty) fputc('\n', stderr);
        fprintf(stderr, "still finetune: error: %s\n", err.msg);
        still_model_free(m);
        return rc == STILL_E_ARG ? 2 : 1;
    }
    printf("# still finetune: %s\n\n", o.output);
    printf("data: %lld tokens in %d files -> %d training + %d validation sequences (%d instruction examples), seq %d\n",
           r.n_tokens_data, o.n_data, r.n_train_seqs, r.n_val_seqs, r.n_examples, fp.train.seq);
    if (r.n_examples_dropped || r.n_examples_cut)
        printf("instruction examples: %d cut to %d tokens, %d left out (no answer token within %d tokens)\n",
               r.n_examples_cut, fp.train.seq, r.n_examples_dropped, fp.train.seq);
    printf("trained: %zu LoRA parameters%s", r.n_lora_params, r.n_attn_params ? " + " : "\n");
    if (r.n_attn_params) printf("%zu attention parameters\n", r.n_attn_params);
    printf("training: %d steps%s, %lld learnt tokens, %.1f s, %.1f tokens/s, final loss %.4f\n", r.n_steps,
           r.start_step ? " (resumed)" : "", r.n_target_tokens, r.train_seconds, r.tokens_per_s, r.final_loss);
    printf("wall time %.1f s, peak memory %.1f MiB\n\n", cli_now() - t0, cli_peak_rss() / 1048576.0);
    printf("| validation (%.0f learnt tokens) | loss | perplexity |\n|---|---:|---:|\n", r.val_tokens);
    printf("| before | %.4f | %.4f |\n| after | %.4f | %.4f |\n", r.val_loss_before, exp(r.val_loss_before),
           r.val_loss_after, exp(r.val_loss_after));
    still_model_free(m);
    return 0;
}
