/* gguf_dump FILE: open a GGUF file with still's reader and print a JSON
 * description of it on stdout (every kv with its full value, every tensor's
 * name, type, dims, offset and size). On failure prints one line
 * "gguf_dump: <message>" on stderr and exits 1.
 * Used by tests/python/test_gguf_reader.py to compare against gguf-py. */
#include "format/gguf.h"
#include "format/quant.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static void put_json_str(FILE *o, const char *p, uint64_t len) {
    fputc('"', o);
    for (uint64_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)p[i];
        switch (c) {
        case '"': fputs("\\\"", o); break;
        case '\\': fputs("\\\\", o); break;
        case '\n': fputs("\\n", o); break;
        case '\r': fputs("\\r", o); break;
        case '\t': fputs("\\t", o); break;
        default:
            if (c < 0x20 || c == 0x7f) fprintf(o, "\\u%04x", c);
            else fputc(c, o);   /* UTF-8 bytes pass through */
        }
    }
    fputc('"', o);
}

static void put_float(FILE *o, double d) {
    if (isnan(d)) fputs("NaN", o);
    else if (isinf(d)) fputs(d > 0 ? "Infinity" : "-Infinity", o);
    else fprintf(o, "%.17g", d);
}

static void put_value(FILE *o, const gguf_value *v) {
    switch (v->type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_UINT32: case GGUF_TYPE_UINT64:
        fprintf(o, "%llu", (unsigned long long)v->v.u64);
        break;
    case GGUF_TYPE_INT8: case GGUF_TYPE_INT16: case GGUF_TYPE_INT32: case GGUF_TYPE_INT64:
        fprintf(o, "%lld", (long long)v->v.i64);
        break;
    case GGUF_TYPE_FLOAT32: case GGUF_TYPE_FLOAT64: put_float(o, v->v.f64); break;
    case GGUF_TYPE_BOOL: fputs(v->v.u64 ? "true" : "false", o); break;
    case GGUF_TYPE_STRING: put_json_str(o, v->v.str.ptr, v->v.str.len); break;
    case GGUF_TYPE_ARRAY:
        fputc('[', o);
        for (uint64_t i = 0; i < v->v.arr.n; i++) {
            if (i) fputc(',', o);
            put_value(o, &v->v.arr.items[i]);
        }
        fputc(']', o);
        break;
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: gguf_dump FILE.gguf\n");
        return 2;
    }
    gguf_file *f = NULL;
    still_err err = { 0, "" };
    if (gguf_open(argv[1], &f, &err) != STILL_OK) {
        fprintf(stderr, "gguf_dump: %s\n", err.msg);
        return 1;
    }
    FILE *o = stdout;
    fprintf(o, "{\"version\":%u,\"alignment\":%u,\"data_offset\":%llu,\"file_size\":%zu,\n",
            gguf_version(f), gguf_alignment(f), (unsigned long long)gguf_data_offset(f),
            gguf_file_size(f));
    fputs("\"kv\":[", o);
    for (int64_t i = 0; i < gguf_kv_count(f); i++) {
        const gguf_kv *kv = gguf_kv_at(f, i);
        fputs(i ? ",\n" : "\n", o);
        fputs("{\"key\":", o);
        put_json_str(o, kv->key.ptr, kv->key.len);
        fprintf(o, ",\"type\":\"%s\"", gguf_type_name(kv->value.type));
        if (kv->value.type == GGUF_TYPE_ARRAY)
            fprintf(o, ",\"elem_type\":\"%s\"", gguf_type_name(kv->value.v.arr.elem_type));
        fputs(",\"value\":", o);
        put_value(o, &kv->value);
        fputc('}', o);
    }
    fputs("],\n\"tensors\":[", o);
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        fputs(i ? ",\n" : "\n", o);
        fputs("{\"name\":", o);
        put_json_str(o, t->name.ptr, t->name.len);
        fprintf(o, ",\"type\":%u,\"type_name\":\"%s\",\"dims\":[", t->type,
                tensor_type_name(t->type));
        for (uint32_t d = 0; d < t->n_dims; d++)
            fprintf(o, "%s%lld", d ? "," : "", (long long)t->ne[d]);
        fprintf(o, "],\"offset\":%llu,\"nbytes\":%zu}", (unsigned long long)t->offset,
                t->nbytes);
    }
    fputs("]}\n", o);
    gguf_close(f);
    if (fflush(o) != 0 || ferror(o)) {
        fprintf(stderr, "gguf_dump: error writing output\n");
        return 1;
    }
    return 0;
}
