/* CPU references of the kernels (ref.cuh). */
#include "ref.cuh"

/* ---- CPU references -------------------------------------------------------------------------- */

/* Random raw blocks of `type` for rows × cols elements, with finite scales
 * (some of them fp16 subnormals) and, for the float types, finite values. */
std::vector<uint8_t> rand_blocks(uint32_t type, int64_t rows, int64_t cols) {
    const size_t rb = tensor_row_bytes(type, cols), n = (size_t)rows * rb;
    std::vector<uint8_t> raw(n);
    for (auto &b : raw) b = (uint8_t)g_rng.next();
    const int64_t n_el = rows * cols;
    auto put16 = [&](size_t off, uint16_t h) { memcpy(&raw[off], &h, 2); };
    if (type == TT_F32) {
        for (int64_t i = 0; i < n_el; i++) {
            const float f = (float)(g_rng.normal() * 3);
            memcpy(&raw[(size_t)i * 4], &f, 4);
        }
        return raw;
    }
    if (type == TT_F16 || type == TT_BF16) {
        for (int64_t i = 0; i < n_el; i++) {
            const float f = (float)(g_rng.normal() * (g_rng.below(8) ? 1.0 : 1e-6));
            put16((size_t)i * 2, type == TT_F16 ? f32_to_f16(f) : f2bf(f));
        }
        return raw;
    }
    std::vector<int> offs;
    switch (type) {
    case TT_Q4_0: case TT_Q5_0: case TT_Q8_0: offs = {0}; break;
    case TT_Q4_1: case TT_Q5_1: case TT_Q8_1: case TT_Q4_K: case TT_Q5_K: offs = {0, 2}; break;
    case TT_Q2_K: offs = {80, 82}; break;
    case TT_Q3_K: offs = {108}; break;
    case TT_Q6_K: offs = {208}; break;
    default: break;
    }
    const size_t bb = tensor_type_block_bytes(type);
    for (size_t blk = 0; blk < n / bb; blk++)
        for (int o : offs) {
            const double scale = g_rng.below(16) ? 0.05 : 1e-6;   /* 1e-6: an fp16 subnormal */
            put16(blk * bb + (size_t)o, f32_to_f16((float)((2 * g_rng.uniform() - 1) * scale)));
        }
    return raw;
}

std::vector<float> ref_dequant(uint32_t type, const std::vector<uint8_t> &raw, int64_t rows, int64_t cols) {
    std::vector<float> out((size_t)(rows * cols));
    const size_t rb = tensor_row_bytes(type, cols);
    still_err e = {};
    for (int64_t r = 0; r < rows; r++)
        if (dequantize_row(type, raw.data() + r * rb, out.data() + r * cols, cols, &e)) {
            fprintf(stderr, "dequantize_row: %s\n", e.msg);
            exit(2);
        }
    return out;
}

/* C[m][n] = Σ_k A[m][k] W[n][k] + beta C0[m][n], in double. */
std::vector<double> ref_gemm(int M, int N, int K, const std::vector<uint16_t> &A, const std::vector<uint16_t> &W,
                                    const std::vector<double> &C0, double beta) {
    std::vector<double> a((size_t)M * K), w((size_t)N * K), c((size_t)M * N);
    for (size_t i = 0; i < a.size(); i++) a[i] = bf2f(A[i]);
    for (size_t i = 0; i < w.size(); i++) w[i] = bf2f(W[i]);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0;
            const double *x = &a[(size_t)m * K], *y = &w[(size_t)n * K];
            for (int k = 0; k < K; k++) s += x[k] * y[k];
            c[(size_t)m * N + n] = s + (beta != 0 ? beta * C0[(size_t)m * N + n] : 0.0);
        }
    return c;
}

/* src/model/model.c's rmsnorm(): sum of squares in double, scale rounded to float,
 * (x · scale) · w in float. */
std::vector<float> ref_rmsnorm(const std::vector<float> &x, const std::vector<float> &w, int T, int n, float eps) {
    std::vector<float> out(x.size());
    for (int t = 0; t < T; t++) {
        const float *xr = &x[(size_t)t * n];
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        const float scale = (float)(1.0 / sqrt(ss / n + eps));
        for (int i = 0; i < n; i++) {
            volatile float xs = xr[i] * scale;   /* keep the two roundings apart */
            out[(size_t)t * n + i] = xs * w[i];
        }
    }
    return out;
}

/* src/model/model.c's rope(): inv_freq rounded to float, the angle (float)pos ·
 * inv_freq rounded to float; here its cos / sin and the rotation in double. */
void ref_rope(std::vector<double> &v, const std::vector<float> &in, int T, int nh, int D, int p0, float theta) {
    v.assign(in.begin(), in.end());
    for (int t = 0; t < T; t++)
        for (int i = 0; i < D / 2; i++) {
            const float inv = (float)pow((double)theta, -2.0 * i / D);
            const float angle = (float)(p0 + t) * inv;
            const double cs = cos((double)angle), sn = sin((double)angle);
            for (int h = 0; h < nh; h++) {
                const size_t o = ((size_t)t * nh + h) * D + 2 * i;
                const double a = in[o], b = in[o + 1];
                v[o] = a * cs - b * sn;
                v[o + 1] = a * sn + b * cs;
            }
        }
}

/* Causal GQA attention in double from the bf16 inputs: q [T][H][D],
 * k, v [>= p0+T][Hk][D]. */
/* window W > 0: keys pos - W < j <= pos only (swa) */
std::vector<double> ref_attention(const std::vector<uint16_t> &q, const std::vector<uint16_t> &k,
                                         const std::vector<uint16_t> &v, int T, int p0, int H, int Hk, int D,
                                         int W) {
    const int G = H / Hk, L = p0 + T;
    const double scale = 1.0 / sqrt((double)D);
    std::vector<double> kd((size_t)L * Hk * D), vd(kd.size()), out((size_t)T * H * D);
    for (size_t i = 0; i < kd.size(); i++) kd[i] = bf2f(k[i]), vd[i] = bf2f(v[i]);
    std::vector<double> s(L), qd(D);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const int pos = p0 + t, hk = h / G;
            for (int d = 0; d < D; d++) qd[d] = bf2f(q[((size_t)t * H + h) * D + d]);
            const int j0 = W > 0 && pos - W + 1 > 0 ? pos - W + 1 : 0;
            double mx = -INFINITY;
            for (int j = j0; j <= pos; j++) {
                const double *kr = &kd[((size_t)j * Hk + hk) * D];
                double dot = 0;
                for (int d = 0; d < D; d++) dot += qd[d] * kr[d];
                s[j] = dot * scale;
                if (s[j] > mx) mx = s[j];
            }
            double sum = 0;
            for (int j = j0; j <= pos; j++) sum += (s[j] = exp(s[j] - mx));
            double *o = &out[((size_t)t * H + h) * D];
            for (int d = 0; d < D; d++) o[d] = 0;
            for (int j = j0; j <= pos; j++) {
                const double *vr = &vd[((size_t)j * Hk + hk) * D];
                const double p = s[j] / sum;
                for (int d = 0; d < D; d++) o[d] += p * vr[d];
            }
        }
    return out;
}
