/* Sequence-state snapshots (still_context_state_save / _load) on a tiny random model, for every attention kind
 * and the still variants whose state differs (chunk and global selection, 8-bit Sel, gdn with its convolution,
 * dsa): a context that takes a snapshot after A tokens and goes on for B more gives the same logits, bit for bit,
 * as a fresh context that loads the snapshot and is fed the same B tokens; and damaged, truncated or foreign
 * snapshots are refused with the context left as it was. */
#include "check.h"
#include "tiny_model.h"

#include <unistd.h>

static int32_t tok[CTX];

/* Logits of tokens a .. n-1 fed one chunk at a time (chunk 1: decode steps). */
static int feed(still_context *c, int a, int n, int chunk, float *lg, still_err *err) {
    for (int t = a; t < n; t += chunk) {
        const int k = n - t < chunk ? n - t : chunk;
        if (still_decode(c, tok + t, k, lg, 0, err)) return -1;
    }
    return 0;
}

static void check_plan(still_model *m, const char *plan, const char *extra_kind) {
    still_err err = {0};
    still_attn_params p = still_attn_default_params();
    p.plan = plan;
    p.budget = 96, p.chunk = 16;
    if (extra_kind && !strcmp(extra_kind, "global")) p.selection = "global";
    if (extra_kind && !strcmp(extra_kind, "q8")) p.sel_cache = "q8";
    CHECK(still_model_set_attention(m, &p, &err) == STILL_OK, "%s: plan: %s", plan, err.msg);
    if (err.code) return;
    const int A = 150, B = 40;
    const int matvecs[] = {STILL_MATVEC_FLOAT, STILL_MATVEC_DEFAULT};
    for (int mv = 0; mv < 2; mv++) {
        still_context_params cp = {.n_ctx = CTX, .n_batch = 32, .matvec = matvecs[mv]};
        still_context *a, *b;
        CHECK(still_context_create(m, cp, &a, &err) == STILL_OK, "%s: context: %s", plan, err.msg);
        CHECK(still_context_create(m, cp, &b, &err) == STILL_OK, "%s: context: %s", plan, err.msg);
        float la[NV], lb[NV];
        /* some prompt chunks, then decode steps; snapshot; then both contexts the same way */
        CHECK(feed(a, 0, A - 10, 32, la, &err) == 0 && feed(a, A - 10, A, 1, la, &err) == 0, "%s: feed: %s", plan, err.msg);
        FILE *f = tmpfile();
        CHECK(still_context_state_save(a, f, &err) == STILL_OK, "%s: save: %s", plan, err.msg);
        const long size = ftell(f);
        rewind(f);
        CHECK(still_decode(b, tok, 3, NULL, 0, &err) == STILL_OK, "%s: b's own tokens", plan);   /* overwritten */
        CHECK(still_context_state_load(b, f, &err) == STILL_OK, "%s: load: %s", plan, err.msg);
        CHECK(still_context_n_past(b) == A, "%s: n_past %d after load", plan, still_context_n_past(b));
        CHECK(feed(a, A, A + B, 7, la, &err) == 0 && feed(b, A, A + B, 7, lb, &err) == 0, "%s: continue", plan);
        CHECK(!memcmp(la, lb, sizeof la), "%s (matvec %d): logits after a snapshot differ from the original's", plan,
              matvecs[mv]);
        CHECK(feed(a, A + B, A + B + 5, 1, la, &err) == 0 && feed(b, A + B, A + B + 5, 1, lb, &err) == 0 &&
              !memcmp(la, lb, sizeof la), "%s: decode steps after the snapshot differ", plan);
        /* damaged: one flipped byte in the middle, and a cut */
        unsigned char *bytes = malloc((size_t)size);
        rewind(f);
        CHECK(fread(bytes, 1, (size_t)size, f) == (size_t)size, "read back");
        for (int dmg = 0; dmg < 3; dmg++) {
            FILE *g = tmpfile();
            size_t n = (size_t)size;
            if (dmg == 0) bytes[size / 2] ^= 0x10;
            if (dmg == 1) bytes[size / 2] ^= 0x10, n = (size_t)size - 9;
            if (dmg == 2) n = 0;
            fwrite(bytes, 1, n, g);
            rewind(g);
            const int before = still_context_n_past(b);
            err = (still_err){0};
            CHECK(still_context_state_load(b, g, &err) == STILL_E_FORMAT && err.msg[0], "%s: damage %d accepted", plan, dmg);
            CHECK(still_context_n_past(b) == before, "%s: a refused snapshot changed the context", plan);
            fclose(g);
        }
        /* the context still runs as before the refused loads */
        CHECK(feed(a, A + B + 5, A + B + 8, 1, la, &err) == 0 && feed(b, A + B + 5, A + B + 8, 1, lb, &err) == 0 &&
              !memcmp(la, lb, sizeof la), "%s: logits after refused loads differ", plan);
        free(bytes);
        fclose(f);
        /* a context of another size refuses it */
        still_context *c;
        still_context_params cp2 = cp;
        cp2.n_ctx = CTX - 1;
        CHECK(still_context_create(m, cp2, &c, &err) == STILL_OK, "context");
        f = tmpfile();
        still_context_state_save(a, f, &err);
        rewind(f);
        err = (still_err){0};
        CHECK(still_context_state_load(c, f, &err) == STILL_E_ARG && strstr(err.msg, "another"), "%s: foreign: %s",
              plan, err.msg);
        fclose(f);
        still_context_free(c);
        still_context_free(a), still_context_free(b);
    }
}

/* still_decode_batch: three sequences at different depths stepped together give, token after token, the logits
 * that each one stepped alone gives (twins made with snapshots), bit for bit. */
static void check_batch(still_model *m, const char *plan) {
    still_err err = {0};
    still_attn_params p = still_attn_default_params();
    p.plan = plan;
    p.budget = 96, p.chunk = 16;
    CHECK(still_model_set_attention(m, &p, &err) == STILL_OK, "%s: plan: %s", plan, err.msg);
    enum { NS = 6 };   /* more than the four activations the eight-row kernels take at once */
    const int depth[NS] = {40, 7, 130, 3, 64, 90};
    /* the 8-bit paths this CPU has (the default is its best), and float products */
    const int matvecs[] = {STILL_MATVEC_FLOAT, STILL_MATVEC_DEFAULT, STILL_MATVEC_INT8_AVX2, STILL_MATVEC_INT8_PORTABLE};
    for (int mv = 0; mv < 4; mv++) {
        if (mv == 2 && !__builtin_cpu_supports("avx2")) continue;
        still_context_params cp = {.n_ctx = CTX, .n_batch = 32, .matvec = matvecs[mv]};
        still_context *a[NS], *b[NS];
        for (int j = 0; j < NS; j++) {
            CHECK(still_context_create(m, cp, &a[j], &err) == STILL_OK && still_context_create(m, cp, &b[j], &err) == STILL_OK,
                  "context");
            CHECK(still_decode(a[j], tok + 11 * j, depth[j], NULL, 0, &err) == STILL_OK, "prefill: %s", err.msg);
            FILE *f = tmpfile();
            still_context_state_save(a[j], f, &err);
            rewind(f);
            CHECK(still_context_state_load(b[j], f, &err) == STILL_OK, "twin: %s", err.msg);
            fclose(f);
        }
        float *la = malloc(sizeof(float) * NS * NV), lb[NV];
        int same = 1;
        for (int step = 0; step < 20; step++) {
            int32_t t[NS];
            for (int j = 0; j < NS; j++) t[j] = tok[(7 * step + 31 * j) % CTX];
            CHECK(still_decode_batch(a, NS, t, la, &err) == STILL_OK, "%s: batch: %s", plan, err.msg);
            for (int j = 0; j < NS; j++) {
                CHECK(still_decode(b[j], &t[j], 1, lb, 0, &err) == STILL_OK, "single");
                same &= !memcmp(la + (size_t)j * NV, lb, sizeof lb);
            }
        }
        CHECK(same, "%s (matvec %d): a batched step differs from the same step alone", plan, matvecs[mv]);
        for (int j = 0; j < NS; j++)
            CHECK(still_context_n_past(a[j]) == depth[j] + 20, "n_past after batched steps");
        still_context *dup[2] = {a[0], a[0]};
        int32_t t2[2] = {1, 2};
        CHECK(still_decode_batch(dup, 2, t2, la, &err) == STILL_E_ARG, "a context twice accepted");
        free(la);
        for (int j = 0; j < NS; j++) still_context_free(a[j]), still_context_free(b[j]);
    }
}

int main(void) {
    char path[] = "/tmp/still_test_snapshot_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return 1;
    close(fd);
    ref_weights R;
    write_model(path, &R);
    still_err err = {0};
    still_model *m;
    CHECK(still_model_load(path, &m, &err) == STILL_OK, "load: %s", err.msg);
    if (n_fail) return 1;
    for (int i = 0; i < CTX; i++) tok[i] = (int32_t)((frand() + 1) * 0.5 * 256) % 256;
    check_plan(m, "softmax:*", NULL);
    check_plan(m, "swa/window=24:*", NULL);
    check_plan(m, "lolcats:*", NULL);
    check_plan(m, "liger/window=24:*", NULL);
    check_plan(m, "still:*", NULL);
    check_plan(m, "still:*", "global");
    check_plan(m, "still:*", "q8");
    check_plan(m, "gdn/conv=4:*", NULL);
    check_plan(m, "gdn:0,softmax:1", NULL);
    check_plan(m, "dsa/topk=80:*", NULL);
    check_batch(m, "softmax:*");
    check_batch(m, "still:*");
    check_batch(m, "gdn/conv=4:0,lolcats:1");
    check_batch(m, "liger/window=24:0,dsa/topk=80:1");
    /* a snapshot of one plan does not load into another plan's context */
    {
        still_attn_params p = still_attn_default_params();
        p.plan = "softmax:*";
        still_model_set_attention(m, &p, &err);
        still_context_params cp = {.n_ctx = CTX, .n_batch = 32};
        still_context *a, *b;
        still_context_create(m, cp, &a, &err);
        still_decode(a, tok, 20, NULL, 0, &err);
        FILE *f = tmpfile();
        still_context_state_save(a, f, &err);
        still_context_free(a);
        p.plan = "swa/window=24:*";
        still_model_set_attention(m, &p, &err);
        still_context_create(m, cp, &b, &err);
        rewind(f);
        err = (still_err){0};
        CHECK(still_context_state_load(b, f, &err) == STILL_E_ARG, "another plan's snapshot loaded: %s", err.msg);
        fclose(f);
        still_context_free(b);
    }
    still_model_free(m);
    unlink(path);
    free(R.emb), free(R.out_norm);
    for (int l = 0; l < NL; l++) {
        free(R.attn_norm[l]), free(R.ffn_norm[l]), free(R.wq[l]), free(R.wk[l]), free(R.wv[l]);
        free(R.wo[l]), free(R.wg[l]), free(R.wu[l]), free(R.wd[l]);
    }
    return CHECK_SUMMARY();
}
