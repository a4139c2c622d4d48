/* gguf_seed OUTDIR: write a few small, valid GGUF files with still's writer.
 * They seed the fuzzer (tests/run_fuzz.sh) and are cross-checked against
 * gguf-py by tests/python/test_gguf_reader.py.
 *
 *   seed_types.gguf  every value type, arrays of each, nested arrays, tensors
 *   seed_align.gguf  general.alignment = 64, K-quant and legacy-quant tensors
 *   seed_vocab.gguf  llama-like metadata with a small tokenizer vocabulary
 *   seed_empty.gguf  no kv, no tensors */
#include "format/gguf.h"
#include "format/quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(x)                                                          \
    do {                                                                \
        if ((x) != STILL_OK) {                                          \
            fprintf(stderr, "gguf_seed: %s\n", err.msg);                \
            gguf_writer_free(w);                                        \
            return 1;                                                   \
        }                                                               \
    } while (0)

static int add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                      const int64_t *ne, still_err *err) {
    int64_t rows = 1;
    for (uint32_t d = 1; d < n_dims; d++) rows *= ne[d];
    size_t nbytes = tensor_row_bytes(type, ne[0]) * (size_t)rows;
    unsigned char *data = malloc(nbytes ? nbytes : 1);
    if (!data) {
        snprintf(err->msg, sizeof err->msg, "out of memory");
        return STILL_E_NOMEM;
    }
    /* small, finite values whatever the type: 0x3c00 is 1.0 in f16 */
    for (size_t i = 0; i < nbytes; i++) data[i] = (unsigned char)(i & 1 ? 0x3c : (i * 7) & 0x3f);
    int rc = gguf_writer_add_tensor(w, name, type, n_dims, ne, data, nbytes, err);
    free(data);
    return rc;
}

static int write_types(const char *dir) {
    still_err err = { 0, "" };
    gguf_writer *w = NULL;
    char path[4096];
    if (gguf_writer_create(&w, &err) != STILL_OK) {
        fprintf(stderr, "gguf_seed: %s\n", err.msg);
        return 1;
    }
    TRY(gguf_writer_set_str(w, "general.architecture", "llama", &err));
    TRY(gguf_writer_set_str(w, "general.name", "seed \"types\"\n\xc3\xa9", &err));
    static const gguf_type scal[] = { GGUF_TYPE_UINT8, GGUF_TYPE_INT8, GGUF_TYPE_UINT16,
                                      GGUF_TYPE_INT16, GGUF_TYPE_UINT32, GGUF_TYPE_INT32,
                                      GGUF_TYPE_FLOAT32, GGUF_TYPE_BOOL, GGUF_TYPE_UINT64,
                                      GGUF_TYPE_INT64, GGUF_TYPE_FLOAT64 };
    for (size_t k = 0; k < sizeof scal / sizeof scal[0]; k++) {
        gguf_value v = { .type = scal[k] };
        gguf_value items[4];
        char key[64];
        switch (scal[k]) {
        case GGUF_TYPE_FLOAT32: case GGUF_TYPE_FLOAT64: v.v.f64 = -2.5; break;
        case GGUF_TYPE_BOOL: v.v.u64 = 1; break;
        case GGUF_TYPE_INT8: case GGUF_TYPE_INT16: case GGUF_TYPE_INT32: case GGUF_TYPE_INT64:
            v.v.i64 = -7;
            break;
        default: v.v.u64 = 200; break;
        }
        snprintf(key, sizeof key, "seed.scalar.%s", gguf_type_name(scal[k]));
        TRY(gguf_writer_set(w, key, &v, &err));
        for (int j = 0; j < 4; j++) {
            items[j] = v;
            if (scal[k] == GGUF_TYPE_FLOAT32 || scal[k] == GGUF_TYPE_FLOAT64)
                items[j].v.f64 = 0.25 * j;
            else if (scal[k] == GGUF_TYPE_BOOL)
                items[j].v.u64 = (uint64_t)(j & 1);
            else
                items[j].v.u64 = (uint64_t)j * 3;
        }
        gguf_value arr = { .type = GGUF_TYPE_ARRAY, .v.arr = { scal[k], 4, items } };
        snprintf(key, sizeof key, "seed.array.%s", gguf_type_name(scal[k]));
        TRY(gguf_writer_set(w, key, &arr, &err));
    }
    gguf_value strs[3] = { { .type = GGUF_TYPE_STRING, .v.str = { 5, "hello" } },
                           { .type = GGUF_TYPE_STRING, .v.str = { 0, "" } },
                           { .type = GGUF_TYPE_STRING, .v.str = { 4, "\xe2\x96\x81x" } } };
    gguf_value astr = { .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_STRING, 3, strs } };
    TRY(gguf_writer_set(w, "seed.array.string", &astr, &err));
    gguf_value aempty = { .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_UINT32, 0, NULL } };
    TRY(gguf_writer_set(w, "seed.array.empty", &aempty, &err));
    gguf_value ints[3] = { { GGUF_TYPE_INT32, { .i64 = 1 } }, { GGUF_TYPE_INT32, { .i64 = -2 } },
                           { GGUF_TYPE_INT32, { .i64 = 3 } } };
    gguf_value rows[2] = { { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_INT32, 3, ints } } },
                           { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_INT32, 1, ints + 2 } } } };
    gguf_value nested = { .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_ARRAY, 2, rows } };
    TRY(gguf_writer_set(w, "seed.nested.int32", &nested, &err));
    gguf_value srows[2] = { { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_STRING, 2, strs } } },
                            { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_STRING, 1, strs + 2 } } } };
    gguf_value nested_s = { .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_ARRAY, 2, srows } };
    TRY(gguf_writer_set(w, "seed.nested.string", &nested_s, &err));

    int64_t ne_a[2] = { 8, 3 }, ne_b[1] = { 5 }, ne_c[2] = { 64, 2 }, ne_d[3] = { 32, 2, 2 };
    TRY(add_tensor(w, "token_embd.weight", TT_F32, 2, ne_a, &err));
    TRY(add_tensor(w, "output_norm.weight", TT_F16, 1, ne_b, &err));
    TRY(add_tensor(w, "blk.0.attn_q.weight", TT_Q4_0, 2, ne_c, &err));
    TRY(add_tensor(w, "blk.0.ffn_up.weight", TT_Q8_0, 3, ne_d, &err));
    snprintf(path, sizeof path, "%s/seed_types.gguf", dir);
    TRY(gguf_writer_write(w, path, &err));
    gguf_writer_free(w);
    return 0;
}

static int write_align(const char *dir) {
    still_err err = { 0, "" };
    gguf_writer *w = NULL;
    char path[4096];
    if (gguf_writer_create(&w, &err) != STILL_OK) return 1;
    TRY(gguf_writer_set_u32(w, "general.alignment", 64, &err));
    TRY(gguf_writer_set_str(w, "general.architecture", "llama", &err));
    int64_t ne_k[2] = { 256, 2 }, ne_q[2] = { 32, 3 }, ne_f[4] = { 3, 1, 2, 1 };
    TRY(add_tensor(w, "blk.0.ffn_down.weight", TT_Q6_K, 2, ne_k, &err));
    TRY(add_tensor(w, "blk.0.ffn_gate.weight", TT_Q4_K, 2, ne_k, &err));
    TRY(add_tensor(w, "blk.0.attn_k.weight", TT_Q4_1, 2, ne_q, &err));
    TRY(add_tensor(w, "blk.0.attn_norm.weight", TT_F32, 4, ne_f, &err));
    snprintf(path, sizeof path, "%s/seed_align.gguf", dir);
    TRY(gguf_writer_write(w, path, &err));
    gguf_writer_free(w);
    return 0;
}

static int write_vocab(const char *dir) {
    still_err err = { 0, "" };
    gguf_writer *w = NULL;
    char path[4096];
    if (gguf_writer_create(&w, &err) != STILL_OK) return 1;
    static const char *toks[] = { "<unk>", "<s>", "</s>", "\xc4\xa0", "a", "b", "ab",
                                  "\xc4\xa0\x61\x62", "<|im_start|>", "<|im_end|>" };
    enum { NT = sizeof toks / sizeof toks[0] };
    gguf_value tv[NT], sv[NT], yv[NT];
    for (int i = 0; i < NT; i++) {
        tv[i] = (gguf_value){ .type = GGUF_TYPE_STRING, .v.str = { strlen(toks[i]), toks[i] } };
        sv[i] = (gguf_value){ .type = GGUF_TYPE_FLOAT32, .v.f64 = -(double)i };
        yv[i] = (gguf_value){ .type = GGUF_TYPE_INT32, .v.i64 = i < 3 || i >= 8 ? 3 : 1 };
    }
    gguf_value merges[2] = { { .type = GGUF_TYPE_STRING, .v.str = { 3, "a b" } },
                             { .type = GGUF_TYPE_STRING, .v.str = { 5, "\xc4\xa0 ab" } } };
    gguf_value v;
    TRY(gguf_writer_set_str(w, "general.architecture", "llama", &err));
    TRY(gguf_writer_set_u32(w, "llama.context_length", 2048, &err));
    TRY(gguf_writer_set_u32(w, "llama.embedding_length", 8, &err));
    TRY(gguf_writer_set_u32(w, "llama.block_count", 1, &err));
    TRY(gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f, &err));
    TRY(gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f, &err));
    TRY(gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2", &err));
    v = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_STRING, NT, tv } };
    TRY(gguf_writer_set(w, "tokenizer.ggml.tokens", &v, &err));
    v = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_FLOAT32, NT, sv } };
    TRY(gguf_writer_set(w, "tokenizer.ggml.scores", &v, &err));
    v = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_INT32, NT, yv } };
    TRY(gguf_writer_set(w, "tokenizer.ggml.token_type", &v, &err));
    v = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_STRING, 2, merges } };
    TRY(gguf_writer_set(w, "tokenizer.ggml.merges", &v, &err));
    TRY(gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1, &err));
    TRY(gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false, &err));
    int64_t ne[2] = { 8, NT };
    TRY(add_tensor(w, "token_embd.weight", TT_F16, 2, ne, &err));
    snprintf(path, sizeof path, "%s/seed_vocab.gguf", dir);
    TRY(gguf_writer_write(w, path, &err));
    gguf_writer_free(w);
    return 0;
}

static int write_empty(const char *dir) {
    still_err err = { 0, "" };
    gguf_writer *w = NULL;
    char path[4096];
    if (gguf_writer_create(&w, &err) != STILL_OK) return 1;
    snprintf(path, sizeof path, "%s/seed_empty.gguf", dir);
    TRY(gguf_writer_write(w, path, &err));
    gguf_writer_free(w);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: gguf_seed OUTDIR\n");
        return 2;
    }
    if (write_types(argv[1]) || write_align(argv[1]) || write_vocab(argv[1]) ||
        write_empty(argv[1]))
        return 1;
    return 0;
}
