/* Unit test of stage-1 training (src/train/train.c) on a tiny random model, so the
 * trainer also runs under ASan/UBSan: training lowers the validation error
 * of every trained layer for still and lolcats, the adapter it writes loads
 * and records its training, two runs with the same settings give the same
 * bits, and bad input is refused with a one-line error. (Killing and resuming
 * a run is tests/python/test_linearize.py, on the real model.) */
#include "check.h"
#include "test_text.h"
#include "tiny_model.h"

#include <unistd.h>

static char dir[] = "/tmp/still_test_train_XXXXXX";

static void path_in(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }


static still_train_params small(const char *data, const char **files, const char *out) {
    still_train_params p = still_train_default_params();
    files[0] = data;
    p.data_files = files, p.n_data_files = 1;
    p.seq = 40, p.batch = 2, p.tokens = 40 * 2 * 24, p.lr = 3e-2f, p.val_max = 3, p.ckpt_every = 5;
    p.out_path = out;
    return p;
}

static int set_kind(still_model *m, const char *kind) {
    still_attn_params ap = still_attn_default_params();
    ap.kind = kind, ap.chunk = 4, ap.budget = 0, ap.lambda = 1, ap.feature_dim = 8, ap.seed = 5;
    still_err err = {0};
    int rc = still_model_set_attention(m, &ap, &err);
    if (rc) printf("set_attention %s: %s\n", kind, err.msg);
    return rc;
}

static int refused(still_model *m, const still_train_params *p, const char *want) {
    still_train_result r;
    still_err err = {0};
    int rc = still_train(m, p, &r, &err);
    int ok = rc != STILL_OK && err.msg[0] && !strchr(err.msg, '\n') && strstr(err.msg, want);
    if (!ok) printf("  expected an error with '%s', got rc %d: %s\n", want, rc, err.msg);
    return ok;
}

int main(void) {
    if (!mkdtemp(dir)) {
        printf("mkdtemp failed\n");
        return 1;
    }
    char model_path[256], data[256], out[256], out2[256], ckpt[300];
    path_in(model_path, sizeof model_path, "tiny.gguf");
    path_in(data, sizeof data, "train.txt");
    path_in(out, sizeof out, "a.gguf");
    path_in(out2, sizeof out2, "b.gguf");
    ref_weights R;
    write_model(model_path, &R);
    char *text = make_text(6000, 7);
    write_file(data, text, strlen(text));
    free(text);

    still_model *m = NULL;
    still_err err = {0};
    CHECK(!still_model_load(model_path, &m, &err), "load tiny model: %s", err.msg);
    if (!m) return CHECK_SUMMARY();

    const char *kinds[] = {"still", "lolcats"};
    for (int k = 0; k < 2; k++) {
        if (set_kind(m, kinds[k])) continue;
        const char *files[1];
        still_train_params p = small(data, files, out);
        still_train_result r;
        int rc = still_train(m, &p, &r, &err);
        CHECK(!rc, "%s: train: %s", kinds[k], err.msg);
        if (rc) continue;
        double b = 0, a = 0;
        int lower = 0;
        for (int l = 0; l < r.n_layer; l++) {
            b += r.val_mse_before[l], a += r.val_mse_after[l];
            lower += r.val_mse_after[l] < r.val_mse_before[l];
        }
        printf("%s: %d steps, %d train + %d val sequences, val MSE %.5g -> %.5g, %.0f tokens/s\n", kinds[k], r.n_steps,
               r.n_train_seqs, r.n_val_seqs, b / r.n_layer, a / r.n_layer, r.tokens_per_s);
        CHECK(r.n_steps == 24 && r.n_val_seqs == 3 && r.n_train_seqs > 100, "%s: steps and split", kinds[k]);
        CHECK(lower == r.n_layer && a < 0.8 * b, "%s: validation MSE lower after training in every layer", kinds[k]);
        snprintf(ckpt, sizeof ckpt, "%s.ckpt", out);
        CHECK(access(out, F_OK) == 0 && access(ckpt, F_OK) != 0, "%s: adapter written, checkpoint removed", kinds[k]);
        still_train_result_free(&r);

        /* the adapter loads and records its training */
        gguf_file *f = NULL;
        uint32_t steps = 0;
        CHECK(!gguf_open(out, &f, &err) && !gguf_get_u32(f, "still.train.steps", &steps, &err) && steps == 24,
              "%s: adapter records its steps", kinds[k]);
        gguf_close(f);
        still_model *m2 = NULL;
        CHECK(!still_model_load(model_path, &m2, &err) && !still_model_load_adapter(m2, out, &err) &&
                  !strcmp(still_model_layer_kind(m2, 1), kinds[k]),
              "%s: adapter loads: %s", kinds[k], err.msg);
        /* same settings, fresh initialisation: the same bits */
        if (m2 && !set_kind(m2, kinds[k])) {
            still_train_params p2 = small(data, files, out2);
            CHECK(!still_train(m2, &p2, &r, &err), "%s: second run: %s", kinds[k], err.msg);
            still_train_result_free(&r);
            gguf_file *fa = NULL, *fb = NULL;
            int same = !gguf_open(out, &fa, &err) && !gguf_open(out2, &fb, &err);
            for (int l = 0; same && l < 2; l++) {
                char name[64];
                snprintf(name, sizeof name, "blk.%d.attn_hybrid.params", l);
                const gguf_tensor *ta = gguf_find_tensor(fa, name), *tb = gguf_find_tensor(fb, name);
                same = ta && tb && ta->nbytes == tb->nbytes && !memcmp(ta->data, tb->data, ta->nbytes);
            }
            CHECK(same, "%s: two runs with the same settings give the same parameters", kinds[k]);
            gguf_close(fa), gguf_close(fb);
        }
        still_model_free(m2);
    }

    /* bad input */
    {
        const char *files[1];
        char empty[256], bad[256], shortf[256], missing[256], badout[300];
        path_in(empty, sizeof empty, "empty.txt");
        path_in(bad, sizeof bad, "bad.txt");
        path_in(shortf, sizeof shortf, "short.txt");
        path_in(missing, sizeof missing, "missing.txt");
        snprintf(badout, sizeof badout, "%s/no/such/dir/x.gguf", dir);
        write_file(empty, "", 0);
        write_file(bad, "good text \xc3\x28 bad", 16);
        write_file(shortf, "tiny", 4);
        set_kind(m, "still");
        still_train_params p = small(empty, files, out);
        CHECK(refused(m, &p, "empty"), "empty data refused");
        p = small(bad, files, out);
        CHECK(refused(m, &p, "UTF-8"), "invalid UTF-8 refused");
        p = small(shortf, files, out);
        CHECK(refused(m, &p, "too few"), "too little data refused");
        p = small(missing, files, out);
        CHECK(refused(m, &p, "cannot open"), "missing data refused");
        p = small(data, files, out), p.resume = 1, p.ckpt_path = missing;
        CHECK(refused(m, &p, "no checkpoint"), "resume without a checkpoint refused");
        p = small(data, files, out), p.lr = -1;
        CHECK(refused(m, &p, "learning rate"), "negative learning rate refused");
        p = small(data, files, badout), p.tokens = 80;
        CHECK(refused(m, &p, badout), "unwritable output refused");
        set_kind(m, "liger");
        p = small(data, files, out);
        CHECK(refused(m, &p, "nothing to train"), "a kind without parameters refused");
        remove(empty), remove(bad), remove(shortf);
    }
    still_model_free(m);
    free(R.emb), free(R.out_norm);
    for (int l = 0; l < NL; l++) {
        free(R.attn_norm[l]), free(R.ffn_norm[l]), free(R.wq[l]), free(R.wk[l]), free(R.wv[l]), free(R.wo[l]);
        free(R.wg[l]), free(R.wu[l]), free(R.wd[l]);
    }
    remove(model_path), remove(data), remove(out), remove(out2);
    char probe[300];
    snprintf(probe, sizeof probe, "%s/b.gguf.ckpt", dir), remove(probe);
    snprintf(probe, sizeof probe, "%s/a.gguf.ckpt", dir), remove(probe);
    rmdir(dir);
    return CHECK_SUMMARY();
}
