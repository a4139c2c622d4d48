/* A tiny random Llama model written with still's GGUF writer, shared by
 * the C tests (test_model.c, test_train.c): byte-level vocabulary (256 byte
 * tokens + 2 control tokens), quantized and float weights, and the same
 * weights dequantized for a reference. */
#ifndef STILL_TEST_TINY_MODEL_H
#define STILL_TEST_TINY_MODEL_H

#include "format/gguf.h"
#include "format/quant.h"
#include "still.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Shape of the tiny model; test_model_hd64.c includes this file with a head
 * dimension of 64 (the specialised attention path). */
#ifndef TINY_DM
#define TINY_DM 64
#define TINY_NH 4
#define TINY_NHK 2
#endif
enum { NL = 2, DM = TINY_DM, NH = TINY_NH, NHK = TINY_NHK, HD = DM / NH, FF = 96, NV = 258, CTX = 300 };
static const float THETA = 10000.0f, EPS = 1e-5f;

static uint64_t rng = 12345;
static float frand(void) {   /* uniform in [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* ---- building the model file ------------------------------------------- */

/* Random weights in `type`, n_out rows of n_in; also returns them dequantized. */
static void *make_weights(uint32_t type, int n_in, int n_out, float scale, size_t *nbytes, float *deq) {
    size_t rb = tensor_row_bytes(type, n_in);
    uint8_t *buf = malloc(rb * (size_t)n_out);
    for (int o = 0; o < n_out; o++) {
        uint8_t *row = buf + rb * (size_t)o;
        if (type == TT_F32) {
            for (int i = 0; i < n_in; i++) ((float *)row)[i] = frand() * scale;
        } else if (type == TT_Q8_0) {   /* blocks: fp16 d, 32 x int8 */
            for (int b = 0; b < n_in / 32; b++) {
                uint8_t *blk = row + (size_t)b * 34;
                uint16_t d = f32_to_f16(scale / 127.0f * (0.5f + 0.5f * fabsf(frand())));
                memcpy(blk, &d, 2);
                for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)(frand() * 127);
            }
        } else if (type == TT_Q4_1) {   /* blocks: fp16 d, fp16 m, 16 bytes of nibbles */
            for (int b = 0; b < n_in / 32; b++) {
                uint8_t *blk = row + (size_t)b * 20;
                uint16_t d = f32_to_f16(scale / 8.0f), m = f32_to_f16(-scale * (0.8f + 0.2f * frand()));
                memcpy(blk, &d, 2);
                memcpy(blk + 2, &m, 2);
                for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t)(rng = rng * 6364136223846793005ULL + 1, rng >> 56);
            }
        }
        dequantize_row(type, row, deq + (size_t)o * n_in, n_in, NULL);
    }
    *nbytes = rb * (size_t)n_out;
    return buf;
}

typedef struct {
    float *emb;                                      /* NV x DM */
    float *attn_norm[NL], *ffn_norm[NL], *out_norm;
    float *wq[NL], *wk[NL], *wv[NL], *wo[NL], *wg[NL], *wu[NL], *wd[NL];
} ref_weights;

static void add(gguf_writer *w, const char *name, uint32_t type, int n_in, int n_out, float scale, float **deq) {
    size_t nb;
    *deq = malloc(sizeof(float) * (size_t)n_in * n_out);
    void *data = make_weights(type, n_in, n_out, scale, &nb, *deq);
    int64_t ne[2] = {n_in, n_out};
    still_err err = {0};
    if (gguf_writer_add_tensor(w, name, type, n_out == 1 ? 1 : 2, ne, data, nb, &err)) {
        printf("add_tensor %s: %s\n", name, err.msg);
        exit(1);
    }
    free(data);
}

/* GPT-2 byte -> unicode code point, UTF-8 encoded into out; returns length. */
static int byte_token(int b, char *out) {
    int cp = b;
    if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))) {
        int n = 0;
        for (int x = 0; x < b; x++)
            if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
        cp = 256 + n;
    }
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

static void write_model(const char *path, ref_weights *R) {
    still_err err = {0};
    gguf_writer *w;
    gguf_writer_create(&w, &err);
    gguf_writer_set_str(w, "general.architecture", "llama", &err);
    gguf_writer_set_u32(w, "llama.block_count", NL, &err);
    gguf_writer_set_u32(w, "llama.embedding_length", DM, &err);
    gguf_writer_set_u32(w, "llama.feed_forward_length", FF, &err);
    gguf_writer_set_u32(w, "llama.attention.head_count", NH, &err);
    gguf_writer_set_u32(w, "llama.attention.head_count_kv", NHK, &err);
    gguf_writer_set_u32(w, "llama.context_length", CTX, &err);
    gguf_writer_set_f32(w, "llama.rope.freq_base", THETA, &err);
    gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", EPS, &err);
    gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2", &err);
    gguf_writer_set_str(w, "tokenizer.ggml.pre", "smollm", &err);
    /* Vocabulary: the 256 byte tokens, then two control tokens. */
    gguf_value toks = {.type = GGUF_TYPE_ARRAY}, types = {.type = GGUF_TYPE_ARRAY}, merges = {.type = GGUF_TYPE_ARRAY};
    static char strs[NV][16];
    toks.v.arr.elem_type = GGUF_TYPE_STRING, toks.v.arr.n = NV, toks.v.arr.items = calloc(NV, sizeof(gguf_value));
    types.v.arr.elem_type = GGUF_TYPE_INT32, types.v.arr.n = NV, types.v.arr.items = calloc(NV, sizeof(gguf_value));
    for (int i = 0; i < NV; i++) {
        int len = i < 256 ? byte_token(i, strs[i]) : (int)strlen(strcpy(strs[i], i == 256 ? "<|im_start|>" : "<|im_end|>"));
        toks.v.arr.items[i] = (gguf_value){.type = GGUF_TYPE_STRING, .v.str = {(uint64_t)len, strs[i]}};
        types.v.arr.items[i] = (gguf_value){.type = GGUF_TYPE_INT32, .v.i64 = i < 256 ? 1 : 3};
    }
    merges.v.arr.elem_type = GGUF_TYPE_STRING, merges.v.arr.n = 0, merges.v.arr.items = NULL;
    gguf_writer_set(w, "tokenizer.ggml.tokens", &toks, &err);
    gguf_writer_set(w, "tokenizer.ggml.token_type", &types, &err);
    gguf_writer_set(w, "tokenizer.ggml.merges", &merges, &err);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 256, &err);
    gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 257, &err);
    free(toks.v.arr.items);
    free(types.v.arr.items);

    add(w, "token_embd.weight", TT_Q8_0, DM, NV, 1.0f, &R->emb);
    add(w, "output_norm.weight", TT_F32, DM, 1, 1.0f, &R->out_norm);
    for (int l = 0; l < NL; l++) {
        char n[64];
#define T(field, suffix, type, nin, nout, sc) snprintf(n, sizeof n, "blk.%d." suffix ".weight", l); add(w, n, type, nin, nout, sc, &R->field[l]);
        T(attn_norm, "attn_norm", TT_F32, DM, 1, 1.0f)
        T(ffn_norm, "ffn_norm", TT_F32, DM, 1, 1.0f)
        T(wq, "attn_q", TT_Q4_1, DM, NH * HD, 0.3f)
        T(wk, "attn_k", TT_Q4_1, DM, NHK * HD, 0.3f)
        T(wv, "attn_v", TT_Q8_0, DM, NHK * HD, 0.5f)
        T(wo, "attn_output", TT_F32, NH * HD, DM, 0.2f)
        T(wg, "ffn_gate", TT_Q4_1, DM, FF, 0.3f)
        T(wu, "ffn_up", TT_Q8_0, DM, FF, 0.3f)
        T(wd, "ffn_down", TT_Q4_1, FF, DM, 0.2f)
#undef T
    }
    if (gguf_writer_write(w, path, &err)) {
        printf("write: %s\n", err.msg);
        exit(1);
    }
    gguf_writer_free(w);
}


/* The reference weights write_model returned. */
static inline void ref_weights_free(ref_weights *R) {
    for (int l = 0; l < NL; l++) {
        free(R->attn_norm[l]), free(R->ffn_norm[l]), free(R->wq[l]), free(R->wk[l]), free(R->wv[l]);
        free(R->wo[l]), free(R->wg[l]), free(R->wu[l]), free(R->wd[l]);
    }
    free(R->emb), free(R->out_norm);
}

#endif
