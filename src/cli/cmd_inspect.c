/* `still tokenize` and `still info`. */
#include "cli.h"

#include "format/gguf.h"
#include "model/model.h"
#include "format/quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cmd_tokenize(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_TOKENIZE, "tokenize", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    char *text = NULL;
    size_t len;
    int irc = cli_input_text(&o, "tokenize", &text, &len);
    if (irc) return irc;
    still_model *m;
    const int lrc = cli_load_model(&o, &m);
    if (lrc) {
        free(text);
        return lrc;
    }
    still_err err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = 0;
    if (still_tokenize(m, text, len, !o.no_special, &ids, &n, &err)) {
        fprintf(stderr, "still tokenize: error: %s\n", err.msg);
        rc = 1;
    } else if (o.json) {
        putchar('[');
        for (size_t i = 0; i < n; i++) printf(i ? ", %d" : "%d", ids[i]);
        printf("]\n");
    } else {
        for (size_t i = 0; i < n; i++) printf("%d\n", ids[i]);
    }
    free(ids);
    free(text);
    still_model_free(m);
    return rc;
}

/* Print a metadata value; long arrays are abbreviated. */
static void print_value(const gguf_value *v, int depth) {
    switch (v->type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_UINT32: case GGUF_TYPE_UINT64:
        printf("%llu", (unsigned long long)v->v.u64);
        break;
    case GGUF_TYPE_INT8: case GGUF_TYPE_INT16: case GGUF_TYPE_INT32: case GGUF_TYPE_INT64:
        printf("%lld", (long long)v->v.i64);
        break;
    case GGUF_TYPE_FLOAT32: case GGUF_TYPE_FLOAT64:
        printf("%g", v->v.f64);
        break;
    case GGUF_TYPE_BOOL:
        printf("%s", v->v.u64 ? "true" : "false");
        break;
    case GGUF_TYPE_STRING: {
        uint64_t n = v->v.str.len, show = n > 60 ? 60 : n;
        putchar('"');
        for (uint64_t i = 0; i < show; i++) {
            unsigned char ch = (unsigned char)v->v.str.ptr[i];
            if (ch == '\n') printf("\\n");
            else if (ch == '"' || ch == '\\') printf("\\%c", ch);
            else if (ch < 32) printf("\\x%02x", ch);
            else putchar(ch);
        }
        putchar('"');
        if (show < n) printf("... (%llu bytes)", (unsigned long long)n);
        break;
    }
    case GGUF_TYPE_ARRAY: {
        uint64_t n = v->v.arr.n, show = n > 6 ? 6 : n;
        printf("[");
        for (uint64_t i = 0; i < show; i++) {
            if (i) printf(", ");
            if (depth < 3) print_value(&v->v.arr.items[i], depth + 1);
            else printf("...");
        }
        if (show < n) printf(", ... (%llu %s)", (unsigned long long)n, gguf_type_name(v->v.arr.elem_type));
        printf("]");
        break;
    }
    default:
        printf("?");
    }
}

int cmd_info(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_INFO, "info", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    still_model *m;
    const int lrc = cli_load_model(&o, &m);
    if (lrc) return lrc;
    const gguf_file *f = still_model_gguf(m);
    still_model_info mi = still_model_get_info(m);
    printf("file: %s (%zu bytes, GGUF v%u, alignment %u)\n", o.model, gguf_file_size(f), gguf_version(f),
           gguf_alignment(f));
    printf("model: llama, %d layers, d_model %d, %d heads (%d KV), head dim %d, ffn %d, vocab %d, context %d, "
           "rope theta %g, rms eps %g\n\n",
           mi.n_layer, mi.d_model, mi.n_head, mi.n_head_kv, mi.head_dim, mi.d_ff, mi.n_vocab, mi.n_ctx_train,
           mi.rope_theta, mi.norm_eps);
    printf("metadata (%lld keys):\n", (long long)gguf_kv_count(f));
    for (int64_t i = 0; i < gguf_kv_count(f); i++) {
        const gguf_kv *kv = gguf_kv_at(f, i);
        printf("  %-40.*s %-8s ", (int)kv->key.len, kv->key.ptr, gguf_type_name(kv->value.type));
        print_value(&kv->value, 0);
        putchar('\n');
    }
    int64_t nt = gguf_tensor_count(f);
    uint64_t total_elems = 0;
    printf("\ntensors (%lld):\n  %-4s %-28s %-6s %-22s %12s %12s\n", (long long)nt, "#", "name", "type", "shape",
           "offset", "bytes");
    for (int64_t i = 0; i < nt; i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        char shape[64];
        int w = 0;
        uint64_t elems = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            w += snprintf(shape + w, sizeof shape - (size_t)w, d ? " x %lld" : "%lld", (long long)t->ne[d]);
            elems *= (uint64_t)t->ne[d];
        }
        total_elems += elems;
        printf("  %-4lld %-28.*s %-6s %-22s %12llu %12zu\n", (long long)i, (int)t->name.len, t->name.ptr,
               tensor_type_name(t->type), shape, (unsigned long long)t->offset, t->nbytes);
    }
    printf("\n%llu parameters\n", (unsigned long long)total_elems);
    still_model_free(m);
    return 0;
}
