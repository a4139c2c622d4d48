/* GGUF v3 reader (mmap, bounds-checked) and writer. */
#ifndef STILL_GGUF_H
#define STILL_GGUF_H

#include "still.h"
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Metadata value types, numbered as in the GGUF specification. */
typedef enum {
    GGUF_TYPE_UINT8 = 0, GGUF_TYPE_INT8 = 1, GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3, GGUF_TYPE_UINT32 = 4, GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6, GGUF_TYPE_BOOL = 7, GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9, GGUF_TYPE_UINT64 = 10, GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
} gguf_type;

/* A string that points into the mapped file (or into writer-owned memory);
 * not NUL-terminated. */
typedef struct { uint64_t len; const char *ptr; } gguf_str;

typedef struct gguf_value gguf_value;
struct gguf_value {
    gguf_type type;
    union {
        uint64_t u64; int64_t i64; double f64;   /* every integer/float/bool type is widened here */
        gguf_str str;
        struct {
            gguf_type elem_type;
            uint64_t n;
            gguf_value *items;                  /* n decoded elements (nested arrays allowed) */
        } arr;
    } v;
};

typedef struct {
    gguf_str key;
    gguf_value value;
} gguf_kv;

#define GGUF_MAX_DIMS 4
typedef struct {
    gguf_str name;
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];   /* ne[0] is the contiguous (row) dimension; unused dims are 1 */
    uint32_t type;               /* ggml tensor type (see quant.h) */
    uint64_t offset;             /* relative to the data section */
    const void *data;            /* pointer into the mapping, bounds-checked */
    size_t nbytes;
} gguf_tensor;

typedef struct gguf_file gguf_file;

/* Open and fully validate a GGUF file (mmap). On any malformation returns
 * STILL_E_FORMAT (or STILL_E_IO / STILL_E_NOMEM) with a one-line message. */
int gguf_open(const char *path, gguf_file **out, still_err *err);
/* Same, from a memory buffer (not copied; must outlive the gguf_file). */
int gguf_open_memory(const void *data, size_t size, gguf_file **out, still_err *err);
void gguf_close(gguf_file *f);

uint32_t gguf_version(const gguf_file *f);
uint32_t gguf_alignment(const gguf_file *f);
size_t gguf_file_size(const gguf_file *f);
/* Absolute file offset of the data section (tensor offsets are relative to it). */
uint64_t gguf_data_offset(const gguf_file *f);

int64_t gguf_kv_count(const gguf_file *f);
const gguf_kv *gguf_kv_at(const gguf_file *f, int64_t i);
const gguf_value *gguf_find(const gguf_file *f, const char *key);   /* NULL if absent */

/* Typed getters: return STILL_OK, or STILL_E_FORMAT if the key is missing or of
 * an incompatible type (message names the key). Integer getters accept any
 * integer type whose value fits; the float getter accepts FLOAT32/FLOAT64. */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, still_err *err);
int gguf_get_f32(const gguf_file *f, const char *key, float *out, still_err *err);
int gguf_get_bool(const gguf_file *f, const char *key, bool *out, still_err *err);
int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, still_err *err);
/* Array of a given element type (e.g. GGUF_TYPE_STRING); n and items out. */
int gguf_get_arr(const gguf_file *f, const char *key, gguf_type elem_type,
                 const gguf_value **items, uint64_t *n, still_err *err);

int64_t gguf_tensor_count(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

const char *gguf_type_name(gguf_type t);

/* ---- writer ---------------------------------------------------------- */
typedef struct gguf_writer gguf_writer;
int gguf_writer_create(gguf_writer **out, still_err *err);
void gguf_writer_free(gguf_writer *w);
/* Values are deep-copied. */
int gguf_writer_set(gguf_writer *w, const char *key, const gguf_value *v, still_err *err);
int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v, still_err *err);
int gguf_writer_set_f32(gguf_writer *w, const char *key, float v, still_err *err);
int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v, still_err *err);
int gguf_writer_set_str(gguf_writer *w, const char *key, const char *s, still_err *err);
/* Tensor data is copied. ne has n_dims entries. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type,
                           uint32_t n_dims, const int64_t *ne,
                           const void *data, size_t nbytes, still_err *err);
/* Writes to path.tmp then renames to path atomically. */
int gguf_writer_write(gguf_writer *w, const char *path, still_err *err);

#endif
