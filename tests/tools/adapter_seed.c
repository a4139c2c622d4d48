/* adapter_seed OUTDIR: write valid adapters for the tiny model of tests/tiny_model.h (the model itself too, as
 * OUTDIR/model.gguf): each kind's plan with its parameters at their initial values, a still plan with a mix of
 * softmax layers, and a softmax plan with a random LoRA on every target, in f32 and f16. They seed the adapter
 * fuzzer (tests/run_fuzz.sh). */
#include "model/lora.h"
#include "model/model.h"
#include "../tiny_model.h"

#include <stdio.h>

static int save(still_model *m, const char *dir, const char *name, int f16, still_err *err) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s%s.gguf", dir, name, f16 ? "-f16" : "");
    return still_model_save_adapter_as(m, path, f16 ? STILL_ADAPTER_F16 : STILL_ADAPTER_F32, err);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
        return 2;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/model.gguf", argv[1]);
    ref_weights R;
    write_model(path, &R);
    ref_weights_free(&R);
    still_err err = {0, ""};
    still_model *m = NULL;
    if (still_model_load(path, &m, &err)) goto fail;
    static const char *kinds[] = {"swa", "lolcats", "liger", "still"};
    for (int k = 0; k < 4; k++) {
        still_attn_params ap = still_attn_default_params();
        ap.kind = kinds[k];
        if (still_model_set_attention(m, &ap, &err)) goto fail;
        for (int f16 = 0; f16 < 2; f16++)
            if (save(m, argv[1], kinds[k], f16, &err)) goto fail;
    }
    still_attn_params ap = still_attn_default_params();
    ap.kind = "still", ap.softmax_layers = "1";
    if (still_model_set_attention(m, &ap, &err) || save(m, argv[1], "still-mixed", 0, &err)) goto fail;
    ap = still_attn_default_params();
    if (still_model_set_attention(m, &ap, &err)) goto fail;
    const lora_shape sh = model_lora_shape(m);
    lora_set *s = NULL;
    if (lora_create(&sh, 4, 8, (1u << LORA_N_TARGETS) - 1, &s, &err)) goto fail;
    for (int l = 0; l < m->cfg.n_layer; l++)
        for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
            float *A = lora_A(s, l, (lora_target)tg), *B = lora_B(s, l, (lora_target)tg);
            for (int i = 0; i < s->rank * s->n_in[tg]; i++) A[i] = 0.1f * frand();
            for (int i = 0; i < s->n_out[tg] * s->rank; i++) B[i] = 0.02f * frand();
        }
    model_set_lora(m, s);
    for (int f16 = 0; f16 < 2; f16++)
        if (save(m, argv[1], "softmax-lora", f16, &err)) goto fail;
    still_model_free(m);
    return 0;
fail:
    fprintf(stderr, "adapter_seed: %s\n", err.msg);
    still_model_free(m);
    return 1;
}
