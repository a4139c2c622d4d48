/* Helper for tests/python/test_dequant.py (not a test itself).
 *
 *   dequant_tool TYPE IN OUT
 *       IN holds raw blocks of ggml type id TYPE; writes the dequantized
 *       values to OUT as float32 (little-endian, native).
 *   dequant_tool quant8 IN OUT
 *       IN holds float32 values (a multiple of 32); writes them as Q8_0 blocks
 *       (quantize_row_q8_0).
 *   dequant_tool matmul TYPE N_IN N_OUT N_TOK W X OUT
 *       W: N_OUT rows of raw TYPE blocks (N_IN elements each), X: N_TOK x N_IN
 *       float32; writes Y = X W^T (N_TOK x N_OUT float32) computed by matmul().
 *
 * Exit status 0 on success, 1 on any error (message on stderr). */
#include "cpu/kernels.h"
#include "common/common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "read_file.h"

static int write_file(const char *path, const void *data, size_t len, still_err *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return still_fail(err, STILL_E_IO, "cannot create %s: %s", path, strerror(errno));
    size_t w = len ? fwrite(data, 1, len, f) : 0;
    if (fclose(f) != 0 || w != len) return still_fail(err, STILL_E_IO, "cannot write %s", path);
    return STILL_OK;
}

static int parse_i64(const char *s, int64_t *out, still_err *err) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < 0) return still_fail(err, STILL_E_ARG, "bad number '%s'", s);
    *out = v;
    return STILL_OK;
}

static int run_dequant(const char *type_s, const char *in, const char *out, still_err *err) {
    int64_t t;
    int rc = parse_i64(type_s, &t, err);
    if (rc) return rc;
    if (!tensor_type_supported((uint32_t)t))
        return still_fail(err, STILL_E_UNSUPPORTED, "type %lld not supported", (long long)t);
    uint8_t *buf;
    size_t len;
    if ((rc = read_file(in, (void **)&buf, &len, err))) return rc;
    const size_t bb = tensor_type_block_bytes((uint32_t)t);
    if (len % bb) {
        free(buf);
        return still_fail(err, STILL_E_FORMAT, "%s: %zu bytes is not a whole number of %zu-byte blocks", in, len, bb);
    }
    const int64_t n = (int64_t)(len / bb) * tensor_type_block_elems((uint32_t)t);
    float *dst = malloc((size_t)n * sizeof(float) + 1);
    if (!dst) {
        free(buf);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    rc = dequantize_row((uint32_t)t, buf, dst, n, err);
    if (!rc) rc = write_file(out, dst, (size_t)n * sizeof(float), err);
    free(buf);
    free(dst);
    return rc;
}

static int run_quant8(const char *in, const char *out, still_err *err) {
    uint8_t *buf;
    size_t len;
    int rc = read_file(in, (void **)&buf, &len, err);
    if (rc) return rc;
    const int64_t n = (int64_t)(len / sizeof(float));
    uint8_t *dst = malloc((size_t)(n / 32) * 34 + 1);
    if (!dst) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    else if (len % (32 * sizeof(float)) || quantize_row_q8_0((const float *)(const void *)buf, dst, n))
        rc = still_fail(err, STILL_E_ARG, "%s: not a whole number of 32-float blocks", in);
    else rc = write_file(out, dst, (size_t)(n / 32) * 34, err);
    free(buf), free(dst);
    return rc;
}

static int run_matmul(char **a, still_err *err) {
    int64_t t, n_in, n_out, n_tok;
    int rc;
    if ((rc = parse_i64(a[0], &t, err)) || (rc = parse_i64(a[1], &n_in, err)) || (rc = parse_i64(a[2], &n_out, err)) ||
        (rc = parse_i64(a[3], &n_tok, err)))
        return rc;
    if (!tensor_type_supported((uint32_t)t))
        return still_fail(err, STILL_E_UNSUPPORTED, "type %lld not supported", (long long)t);
    const size_t rb = tensor_row_bytes((uint32_t)t, n_in);
    if (rb == 0 || n_out <= 0 || n_tok <= 0) return still_fail(err, STILL_E_ARG, "bad shape");
    uint8_t *w = NULL, *x = NULL;
    size_t wl, xl;
    if ((rc = read_file(a[4], (void **)&w, &wl, err))) return rc;
    if ((rc = read_file(a[5], (void **)&x, &xl, err))) {
        free(w);
        return rc;
    }
    float *y = NULL;
    if (wl != rb * (size_t)n_out || xl != (size_t)(n_tok * n_in) * sizeof(float)) {
        rc = still_fail(err, STILL_E_FORMAT, "input sizes do not match the shape");
    } else if (!(y = malloc((size_t)(n_tok * n_out) * sizeof(float)))) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    } else {
        /* x is read into a malloc'd buffer, so it is suitably aligned */
        weight_matrix W = {.type = (uint32_t)t, .n_in = n_in, .n_out = n_out, .data = w, .row_bytes = rb};
        matmul(&W, (const float *)(const void *)x, y, n_tok);
        rc = write_file(a[6], y, (size_t)(n_tok * n_out) * sizeof(float), err);
    }
    free(w);
    free(x);
    free(y);
    return rc;
}

int main(int argc, char **argv) {
    still_err err = {0};
    int rc;
    if (argc == 4 && strcmp(argv[1], "quant8") == 0) {
        rc = run_quant8(argv[2], argv[3], &err);
    } else if (argc == 4) {
        rc = run_dequant(argv[1], argv[2], argv[3], &err);
    } else if (argc == 9 && strcmp(argv[1], "matmul") == 0) {
        rc = run_matmul(argv + 2, &err);
    } else {
        fprintf(stderr,
                "usage: %s TYPE IN OUT\n"
                "       %s quant8 IN OUT\n"
                "       %s matmul TYPE N_IN N_OUT N_TOK W X OUT\n",
                argv[0], argv[0], argv[0]);
        return 1;
    }
    if (rc) {
        fprintf(stderr, "dequant_tool: %s\n", err.msg);
        return 1;
    }
    return 0;
}
