/* libFuzzer target for the GGUF reader: parse arbitrary bytes with
 * gguf_open_memory and, when accepted, touch every kv, array element, string
 * byte and the first/last byte of every tensor, and exercise every lookup.
 * Any inconsistency aborts (reported by libFuzzer as a crash).
 * Built by tests/run_fuzz.sh (or CMake when the compiler is clang). */
#include "format/gguf.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t walk(const gguf_value *v) {
    uint64_t h = (uint64_t)v->type;
    switch (v->type) {
    case GGUF_TYPE_STRING:
        for (uint64_t i = 0; i < v->v.str.len; i++) h = h * 131 + (unsigned char)v->v.str.ptr[i];
        break;
    case GGUF_TYPE_ARRAY:
        if (v->v.arr.n && !v->v.arr.items) abort();
        for (uint64_t i = 0; i < v->v.arr.n; i++) {
            if (v->v.arr.items[i].type != v->v.arr.elem_type) abort();
            h = h * 131 + walk(&v->v.arr.items[i]);
        }
        break;
    default: h = h * 131 + v->v.u64; break;
    }
    return h;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gguf_file *f = NULL;
    still_err err = { 0, "" };
    int rc = gguf_open_memory(data, size, &f, &err);
    if (rc != STILL_OK) {
        /* failures must be reported cleanly: no object, a one-line message */
        if (f || err.code != rc || err.msg[0] == '\0' || strchr(err.msg, '\n')) abort();
        return 0;
    }
    volatile uint64_t sink = gguf_version(f) + gguf_alignment(f) + gguf_data_offset(f);
    if (gguf_file_size(f) != size) abort();

    char *name = NULL;
    size_t name_cap = 0;
    for (int64_t i = 0; i < gguf_kv_count(f); i++) {
        const gguf_kv *kv = gguf_kv_at(f, i);
        if (!kv) abort();
        sink += walk(&kv->value);
        if (kv->key.len + 1 > name_cap) {
            name_cap = (size_t)kv->key.len + 1;
            free(name);
            name = malloc(name_cap);
            if (!name) abort();
        }
        memcpy(name, kv->key.ptr, (size_t)kv->key.len);
        name[kv->key.len] = '\0';
        if (gguf_find(f, name) != &kv->value) abort();
        uint32_t u;
        float fl;
        bool b;
        gguf_str s;
        const gguf_value *items;
        uint64_t n;
        sink += (uint64_t)gguf_get_u32(f, name, &u, &err);
        sink += (uint64_t)gguf_get_f32(f, name, &fl, &err);
        sink += (uint64_t)gguf_get_bool(f, name, &b, &err);
        sink += (uint64_t)gguf_get_str(f, name, &s, &err);
        sink += (uint64_t)gguf_get_arr(f, name, GGUF_TYPE_STRING, &items, &n, &err);
    }
    const uint8_t *end = data + size;
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (!t || t->nbytes == 0 || t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS) abort();
        const uint8_t *d = t->data;
        if (d < data || d > end || t->nbytes > (size_t)(end - d)) abort();
        sink += d[0] + d[t->nbytes - 1];
        if (t->name.len + 1 > name_cap) {
            name_cap = (size_t)t->name.len + 1;
            free(name);
            name = malloc(name_cap);
            if (!name) abort();
        }
        memcpy(name, t->name.ptr, (size_t)t->name.len);
        name[t->name.len] = '\0';
        if (gguf_find_tensor(f, name) != t) abort();
    }
    (void)sink;
    free(name);
    gguf_close(f);
    return 0;
}
