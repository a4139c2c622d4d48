/* Unit test of stage 2 (src/train/finetune.c, train_lm.c, lora.c, train_data.c) on
 * a tiny random model, so the fine-tune also runs under ASan/UBSan:
 *   - the training forward is the inference forward: its loss equals the
 *     cross-entropy of still_decode's logits with the same LoRA applied, for
 *     softmax and still plans;
 *   - fine-tuning on text and on JSONL lowers the held-out loss; the adapter
 *     it writes loads back with the same LoRA (llama.cpp's layout) and the
 *     plan; two runs give the same bits;
 *   - bad input is refused with a one-line error;
 *   - lora_apply's two paths (its own loops for a decode step's few rows, BLAS
 *     beyond) against a double-precision loop, and one token at a time through
 *     still_decode against the whole prompt at once, with a LoRA.
 * (The gradients against finite differences: tests/python/test_finetune_grad.py;
 * SIGKILL and resume on the real model: tests/python/test_finetune.py.) */
#include "check.h"
#include "test_text.h"
#include "tiny_model.h"

#include "model/lora.h"
#include "model/model.h"
#include "train/train_data.h"
#include "train/train_lm.h"

#include <unistd.h>

static char dir[] = "/tmp/still_test_finetune_XXXXXX";

static void path_in(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }


static int set_plan(still_model *m, const char *kind) {
    still_attn_params ap = still_attn_default_params();
    ap.kind = kind, ap.chunk = 8, ap.budget = 0, ap.lambda = 2, ap.seed = 3;
    still_err err = {0};
    int rc = still_model_set_attention(m, &ap, &err);
    if (rc) printf("set_attention %s: %s\n", kind, err.msg);
    return rc;
}

/* A LoRA on every target with random A and B (B nonzero: the update matters). */
static lora_set *random_lora(const still_model *m, int rank) {
    const lora_shape sh = model_lora_shape(m);
    lora_set *s = NULL;
    still_err err = {0};
    if (lora_create(&sh, rank, 2.0f * rank, (1u << LORA_N_TARGETS) - 1, &s, &err)) {
        printf("lora_create: %s\n", err.msg);
        exit(1);
    }
    for (int l = 0; l < s->n_layer; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            float *A = lora_A(s, l, (lora_target)t), *B = lora_B(s, l, (lora_target)t);
            for (int i = 0; i < rank * s->n_in[t]; i++) A[i] = frand() * 0.3f;
            for (int i = 0; i < s->n_out[t] * rank; i++) B[i] = frand() * 0.2f;
        }
    return s;
}

/* Σ_t CE(logits_t, tok_{t+1}) from still_decode's logits (the inference path). */
static double decode_loss(const still_model *m, const int32_t *tok, int T) {
    still_context *ctx = NULL;
    still_err err = {0};
    still_context_params cp = {.n_ctx = T, .n_batch = 16};
    if (still_context_create(m, cp, &ctx, &err)) {
        printf("context: %s\n", err.msg);
        return NAN;
    }
    float *lg = malloc(sizeof(float) * (size_t)T * NV);
    double loss = NAN;
    if (!still_decode(ctx, tok, T, lg, 1, &err)) {
        loss = 0;
        for (int t = 0; t + 1 < T; t++) {
            const float *r = lg + (size_t)t * NV;
            double mx = r[0], s = 0;
            for (int j = 1; j < NV; j++) mx = r[j] > mx ? r[j] : mx;
            for (int j = 0; j < NV; j++) s += exp(r[j] - mx);
            loss += mx + log(s) - r[tok[t + 1]];
        }
    } else
        printf("decode: %s\n", err.msg);
    free(lg);
    still_context_free(ctx);
    return loss;
}

static void test_train_forward_is_inference(const char *model_path) {
    for (int k = 0; k < 2; k++) {
        const char *kind = k ? "still" : "softmax";
        still_model *m;
        still_err err = {0};
        if (still_model_load(model_path, &m, &err) || set_plan(m, kind)) {
            CHECK(0, "load: %s", err.msg);
            continue;
        }
        lora_set *lo = random_lora(m, 3);
        model_set_lora(m, lo);
        const int T = 70;
        int32_t tok[70];
        for (int t = 0; t < T; t++) tok[t] = (int32_t)((t * 37 + 11) % 256);
        lm_train *tr = NULL;
        double ls = 0, ws = 0;
        int rc = lm_train_create(m, lo, T, 0, &tr, &err);
        if (!rc) rc = lm_train_seq(tr, tok, NULL, T, 1, 0, NULL, &ls, &ws, &err);
        CHECK(!rc, "%s: lm_train_seq: %s", kind, err.msg);
        const double ref = decode_loss(m, tok, T);
        CHECK(fabs(ls - ref) < 1e-4 * fabs(ref) && ws == T - 1, "%s: training loss %.7f vs inference %.7f (w %g)", kind,
              ls, ref, ws);
        /* a gradient step against the gradient lowers the loss */
        lora_set *g = NULL;
        const lora_shape sh = model_lora_shape(m);
        rc = lora_create(&sh, lo->rank, lo->alpha, lo->targets, &g, &err);
        const lm_grads lg = {.lora = g};
        double l2, w2;
        if (!rc) rc = lm_train_seq(tr, tok, NULL, T, 1, 0, &lg, &l2, &w2, &err);
        CHECK(!rc && l2 == ls, "%s: the loss with gradients %.9g vs without %.9g", kind, l2, ls);
        double gn = 0;
        for (int l = 0; l < lo->n_layer; l++)
            for (int t = 0; t < LORA_N_TARGETS; t++)
                for (size_t i = 0; i < (size_t)lo->rank * lo->n_in[t]; i++)
                    gn += (double)lora_A(g, l, (lora_target)t)[i] * lora_A(g, l, (lora_target)t)[i];
        const float step = (float)(1e-3 / sqrt(gn));
        for (int l = 0; l < lo->n_layer; l++)
            for (int t = 0; t < LORA_N_TARGETS; t++)
                for (size_t i = 0; i < (size_t)lo->rank * lo->n_in[t]; i++)
                    lora_A(lo, l, (lora_target)t)[i] -= step * lora_A(g, l, (lora_target)t)[i];
        if (!rc) rc = lm_train_seq(tr, tok, NULL, T, 1, 0, NULL, &l2, &w2, &err);
        CHECK(!rc && l2 < ls, "%s: a step down the gradient: %.9g -> %.9g", kind, ls, l2);
        lora_free(g);
        lm_train_free(tr);
        still_model_free(m);
    }
}

static int run_finetune(const char *model_path, const char *kind, const char *data, const char *out, int train_attn,
                        still_finetune_result *r, still_err *err) {
    still_model *m;
    if (still_model_load(model_path, &m, err)) return -1;
    if (kind && set_plan(m, kind)) {
        still_model_free(m);
        return -1;
    }
    still_finetune_params p = still_finetune_default_params();
    const char *files[1] = {data};
    p.train.data_files = files, p.train.n_data_files = 1;
    p.train.seq = 48, p.train.batch = 2, p.train.tokens = 48 * 2 * 12, p.train.lr = 1e-2f, p.train.val_max = 2;
    p.train.ckpt_every = 5, p.train.out_path = out;
    p.lora_rank = 4, p.lora_alpha = 8, p.lora_targets = "all", p.train_attn = train_attn, p.lora_dropout = 0.05f;
    int rc = still_finetune(m, &p, r, err);
    still_model_free(m);
    return rc;
}

static void test_finetune_runs(const char *model_path) {
    char text_path[256], jsonl_path[256], out[256], out2[256];
    path_in(text_path, sizeof text_path, "train.txt");
    path_in(jsonl_path, sizeof jsonl_path, "train.jsonl");
    path_in(out, sizeof out, "ft.gguf");
    path_in(out2, sizeof out2, "ft2.gguf");
    char *text = make_text(6000, 11);
    write_file(text_path, text, strlen(text));
    char *jl = malloc(64 * 1024);
    size_t n = 0;
    for (int i = 0; i < 40; i++)
        n += (size_t)snprintf(jl + n, 64 * 1024 - n,
                              i % 2 ? "{\"instruction\": \"Say %d.\", \"input\": \"\", \"output\": \"It is %d.\"}\n"
                                    : "{\"messages\": [{\"role\": \"user\", \"content\": \"%d?\"}, "
                                      "{\"role\": \"assistant\", \"content\": \"yes %d\"}]}\n",
                              i, i);
    write_file(jsonl_path, jl, n);
    for (int k = 0; k < 2; k++) {
        still_finetune_result r;
        still_err err = {0};
        const char *data = k ? jsonl_path : text_path;
        int rc = run_finetune(model_path, "still", data, out, 1, &r, &err);
        CHECK(!rc, "finetune %s: %s", data, err.msg);
        if (rc) continue;
        CHECK(r.val_loss_after < r.val_loss_before, "%s: validation loss %g -> %g", data, r.val_loss_before,
              r.val_loss_after);
        CHECK(r.n_lora_params > 0 && r.n_attn_params > 0 && (k == 0 || r.n_examples == 40),
              "%s: %zu LoRA and %zu attention parameters, %d examples", data, r.n_lora_params, r.n_attn_params,
              r.n_examples);
        /* the adapter loads back with its LoRA, and a second run gives the same file */
        still_model *m;
        if (still_model_load(model_path, &m, &err) || still_model_load_adapter(m, out, &err)) {
            CHECK(0, "reload: %s", err.msg);
            continue;
        }
        CHECK(m->lora && m->lora->rank == 4 && m->lora->targets == (1u << LORA_N_TARGETS) - 1 &&
                  !strcmp(still_model_layer_kind(m, 0), "still"),
              "the adapter's LoRA or plan did not load");
        still_model_free(m);
        still_finetune_result r2;
        rc = run_finetune(model_path, "still", data, out2, 1, &r2, &err);
        CHECK(!rc && r2.val_loss_after == r.val_loss_after, "a second run: %g vs %g", r2.val_loss_after,
              r.val_loss_after);
        FILE *a = fopen(out, "rb"), *b = fopen(out2, "rb");
        int same = a && b;
        for (int ca = 0, cb = 0; same && (ca = fgetc(a)) != EOF;) same = (cb = fgetc(b)) == ca;
        if (same) same = fgetc(b) == EOF;
        if (a) fclose(a);
        if (b) fclose(b);
        CHECK(same, "%s: two runs wrote different adapters", data);
    }
    free(text), free(jl);
    unlink(text_path), unlink(jsonl_path), unlink(out), unlink(out2);
}

static void test_refusals(const char *model_path) {
    char bad[256], out[256];
    path_in(bad, sizeof bad, "bad.jsonl");
    path_in(out, sizeof out, "never.gguf");
    const char *cases[][2] = {
        {"{\"instruction\": \"a\", \"output\": \"b\"}\n[1, 2]\n", ":2: not a JSON object"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n", "no assistant answer"},
        {"{\"messages\": {\"role\": \"user\"}}\n", "must be an array"},
        {"{\"instruction\": 3, \"output\": \"b\"}\n", "expected \"messages\""},
        {"{\"messages\": [{\"role\": \"assistant\", \"content\": 5}]}\n", "needs string"},
        {"\xff\xfe\n", "not valid UTF-8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_file(bad, cases[i][0], strlen(cases[i][0]));
        still_finetune_result r;
        still_err err = {0};
        int rc = run_finetune(model_path, NULL, bad, out, 0, &r, &err);
        CHECK(rc && strstr(err.msg, cases[i][1]) && !strchr(err.msg, '\n'), "case %zu: rc %d, '%s'", i, rc, err.msg);
    }
    still_finetune_result r;
    still_err err = {0};
    char text_path[256];
    path_in(text_path, sizeof text_path, "t.txt");
    write_file(text_path, "short", 5);
    CHECK(run_finetune(model_path, NULL, text_path, out, 0, &r, &err) && strstr(err.msg, "too few"), "%s", err.msg);
    /* --train-attn on a plan without parameters */
    char *text = make_text(3000, 11);
    write_file(text_path, text, strlen(text));
    free(text);
    CHECK(run_finetune(model_path, NULL, text_path, out, 1, &r, &err) && strstr(err.msg, "no parameters"), "%s", err.msg);
    CHECK(access(out, F_OK) != 0, "a refused run wrote its output");
    unlink(bad), unlink(text_path);
}

/* JSONL weights: exactly the positions that predict an answer's tokens and
 * its <|im_end|> (the tiny model's byte vocabulary: 256 <|im_start|>, 257
 * <|im_end|>, no default system prompt). */
static void test_jsonl_weights(const char *model_path) {
    char path[256];
    path_in(path, sizeof path, "w.jsonl");
    const char *jl = "{\"instruction\": \"hi\", \"output\": \"abc\"}\n"
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"xy\"},"
                     " {\"role\": \"user\", \"content\": \"r\"}, {\"role\": \"assistant\", \"content\": \"\"}]}\n";
    write_file(path, jl, strlen(jl));
    still_model *m;
    still_err err = {0};
    if (still_model_load(model_path, &m, &err)) {
        CHECK(0, "load: %s", err.msg);
        return;
    }
    const char *files[1] = {path};
    train_data d;
    train_data_params dp = {.files = files, .n_files = 1, .seq = 256, .allow_jsonl = 1, .val_frac = 0, .seed = 1};
    int rc = train_data_load(m, &dp, &d, &err);
    CHECK(!rc && d.n_seq == 2 && d.n_examples == 2 && d.w, "load: %s", err.msg);
    int total_answers = 0;
    for (int i = 0; !rc && i < d.n_seq; i++) {
        const float *w;
        int len;
        const int32_t *tok = train_data_seq(&d, i, &w, &len);
        /* expected: after each "<|im_start|>assistant\n", every token up to and including <|im_end|> is learnt */
        char *want = calloc((size_t)len, 1);
        int answers = 0;
        for (int t = 0; t + 10 < len; t++) {
            if (tok[t] != 256 || memcmp((const char[]){'a', 's', 's', 'i', 's', 't', 'a', 'n', 't', '\n'}, (char[]){
                    (char)tok[t + 1], (char)tok[t + 2], (char)tok[t + 3], (char)tok[t + 4], (char)tok[t + 5],
                    (char)tok[t + 6], (char)tok[t + 7], (char)tok[t + 8], (char)tok[t + 9], (char)tok[t + 10]}, 10))
                continue;
            answers++;
            for (int j = t + 11; j < len; j++) {
                want[j - 1] = 1;   /* position j-1 predicts token j */
                if (tok[j] == 257) break;
            }
        }
        int bad = 0;
        for (int t = 0; t < len; t++) bad += (w[t] == 1.0f) != want[t] || (w[t] != 0 && w[t] != 1);
        total_answers += answers;
        CHECK(!bad, "sequence %d: %d positions weighted wrongly", i, bad);
        free(want);
    }
    CHECK(rc || total_answers == 3, "%d answers found in the two examples (3 expected)", total_answers);
    if (!rc) train_data_free(&d);
    still_model_free(m);
    unlink(path);
}

/* lora_apply against Y + s (X Aᵀ) Bᵀ in double, for row counts on both sides of its loop/BLAS switch. */
static void test_lora_apply_paths(const char *model_path) {
    still_model *m = NULL;
    still_err err = {0};
    if (still_model_load(model_path, &m, &err)) {
        CHECK(0, "load: %s", err.msg);
        return;
    }
    lora_set *s = random_lora(m, 3);
    const int rows[] = {1, 2, 4, 5, 9};
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            const int T = rows[k], ni = s->n_in[t], no = s->n_out[t], r = s->rank;
            float *X = malloc(sizeof(float) * (size_t)T * ni), *Y = malloc(sizeof(float) * (size_t)T * no);
            float *tmp = malloc(sizeof(float) * (size_t)T * r);
            double *ref = malloc(sizeof(double) * (size_t)T * no);
            for (int i = 0; i < T * ni; i++) X[i] = frand();
            for (int i = 0; i < T * no; i++) ref[i] = Y[i] = frand();
            const float *A = lora_A(s, 1, (lora_target)t), *B = lora_B(s, 1, (lora_target)t);
            for (int i = 0; i < T; i++)
                for (int o = 0; o < no; o++) {
                    double acc = 0;
                    for (int j = 0; j < r; j++) {
                        double u = 0;
                        for (int c = 0; c < ni; c++) u += (double)A[j * ni + c] * X[i * ni + c];
                        acc += (double)B[o * r + j] * u;
                    }
                    ref[i * no + o] += lora_scale(s) * acc;
                }
            int rc = lora_apply(s, 1, (lora_target)t, X, Y, T, tmp);
            double worst = 0;
            for (int i = 0; i < T * no; i++) {
                const double e = fabs(Y[i] - ref[i]) / (1.0 + fabs(ref[i]));
                worst = e > worst ? e : worst;
            }
            CHECK(!rc && worst < 1e-5, "lora_apply T=%d target %d: worst error %.2e", T, t, worst);
            free(X), free(Y), free(tmp), free(ref);
        }
    /* with the LoRA: one token at a time (the loops) = the whole prompt at once (BLAS), to float rounding */
    model_set_lora(m, s);
    if (set_plan(m, "softmax")) {
        still_model_free(m);
        return;
    }
    enum { T = 24 };
    int32_t tok[T];
    for (int i = 0; i < T; i++) tok[i] = (int32_t)((i * 7 + 3) % NV);
    still_context *a = NULL, *b = NULL;
    /* float single-token products, so that only the LoRA's two paths differ */
    still_context_params cp = {.n_ctx = T, .n_batch = T, .matvec = STILL_MATVEC_FLOAT};
    float *la = malloc(sizeof(float) * (size_t)T * NV), *lb = malloc(sizeof(float) * NV);
    int rc = still_context_create(m, cp, &a, &err) || still_context_create(m, cp, &b, &err) ||
             still_decode(a, tok, T, la, 1, &err);
    double worst = 0;
    for (int i = 0; !rc && i < T; i++) {
        rc = still_decode(b, tok + i, 1, lb, 0, &err);
        for (int j = 0; !rc && j < NV; j++) {
            const double e = fabs(lb[j] - la[(size_t)i * NV + j]) / (1.0 + fabs(la[(size_t)i * NV + j]));
            worst = e > worst ? e : worst;
        }
    }
    CHECK(!rc && worst < 1e-4, "with a LoRA, token by token vs the whole prompt: worst logit error %.2e (%s)", worst,
          rc ? err.msg : "ok");
    free(la), free(lb);
    still_context_free(a), still_context_free(b);
    still_model_free(m);
}

int main(void) {
    if (!mkdtemp(dir)) {
        printf("mkdtemp failed\n");
        return 1;
    }
    char model_path[256];
    path_in(model_path, sizeof model_path, "tiny.gguf");
    ref_weights R;
    write_model(model_path, &R);
    free(R.emb), free(R.out_norm);
    for (int l = 0; l < NL; l++) {
        free(R.attn_norm[l]), free(R.ffn_norm[l]), free(R.wq[l]), free(R.wk[l]), free(R.wv[l]), free(R.wo[l]);
        free(R.wg[l]), free(R.wu[l]), free(R.wd[l]);
    }
    test_train_forward_is_inference(model_path);
    test_finetune_runs(model_path);
    test_refusals(model_path);
    test_jsonl_weights(model_path);
    test_lora_apply_paths(model_path);
    unlink(model_path);
    rmdir(dir);
    return CHECK_SUMMARY();
}
