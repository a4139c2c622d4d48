/* Group attn: the softmax attention kernel (stc_attn_softmax_splits, stc_attn_softmax_window) against
 * ref_attention, within 1e-2. */
#include "kinds/attn_layout.cuh"

#include "harness.cuh"
#include "ref.cuh"
#include "test_groups.cuh"

struct attn_case {
    int T, p0, H, Hk, D, splits;   /* splits 0: automatic */
    int window = 0;                /* 0: causal softmax; > 0: swa (stc_attn_softmax_window) */
};

static void run_attn_case(const attn_case &c, bool bf16_out) {
    const int L = c.p0 + c.T, pad = 70;   /* cache rows past L stay NaN: never to be read */
    std::vector<uint16_t> q = rand_bf16((size_t)c.T * c.H * c.D, 2.0);
    std::vector<uint16_t> k = rand_bf16((size_t)(L + pad) * c.Hk * c.D, 1.0);
    std::vector<uint16_t> v = rand_bf16(k.size(), 1.0);
    for (size_t i = (size_t)L * c.Hk * c.D; i < k.size(); i++) k[i] = v[i] = 0xFFFF;
    /* swa: rows before the first query's window are NaN too (never to be read) */
    const int lo = c.window > 0 && c.p0 - c.window + 1 > 0 ? c.p0 - c.window + 1 : 0;
    for (size_t i = 0; i < (size_t)lo * c.Hk * c.D; i++) k[i] = v[i] = 0xFFFF;
    const std::vector<double> ref = ref_attention(q, k, v, c.T, c.p0, c.H, c.Hk, c.D, c.window);
    const int p0v = c.p0 - lo;   /* the kernel's view of the cache starts at row lo */
    const stc_attn::plan p = stc_attn::make_plan(c.T, p0v, c.H, c.Hk, c.D, stc_ctx_sm_count(g_ctx), c.splits);
    char name[192];
    snprintf(name, sizeof name, "attn T=%d p0=%d H=%d Hk=%d D=%d%s%.0d %s out (rows/block %d, splits %d%s)", c.T, c.p0,
             c.H, c.Hk, c.D, c.window ? " window " : "", c.window, bf16_out ? "bf16" : "fp32", p.block_m, p.n_splits,
             c.splits ? " forced" : "");
    dbuf dq(q.size() * 2), dk(k.size() * 2), dv(v.size() * 2), dout(ref.size() * (bf16_out ? 2 : 4));
    if (!dq.ok() || !dk.ok() || !dv.ok() || !dout.ok() || !upload(dq, q) || !upload(dk, k) || !upload(dv, v) ||
        !dout.poison())
        return;
    const int rc =
        c.window ? stc_attn_softmax_window(g_ctx, dq.as<stc_bf16>(), dk.as<stc_bf16>(), dv.as<stc_bf16>(), c.T, c.p0, c.H,
                                           c.Hk, c.D, c.window, bf16_out ? NULL : dout.as<float>(),
                                           bf16_out ? dout.as<stc_bf16>() : NULL, c.splits, &g_err)
                 : stc_attn_softmax_splits(g_ctx, dq.as<stc_bf16>(), dk.as<stc_bf16>(), dv.as<stc_bf16>(), c.T, c.p0,
                                           c.H, c.Hk, c.D, bf16_out ? NULL : dout.as<float>(),
                                           bf16_out ? dout.as<stc_bf16>() : NULL, c.splits, &g_err);
    if (!api_ok(rc, name)) return;
    if (bf16_out) {
        std::vector<uint16_t> got(ref.size());
        if (download(got, dout)) check_rel(name, bf_to_double(got), ref, 1e-2);
    } else {
        std::vector<float> got(ref.size());
        if (download(got, dout)) check_rel(name, to_double(got), ref, 1e-2);
    }
}

void test_attention(void) {
    const attn_case cases[] = {
        /* decode steps (T = 1), automatic split-K */
        {1, 0, 9, 3, 64, 0},     {1, 1, 9, 3, 64, 0},    {1, 63, 9, 3, 64, 0},   {1, 64, 9, 3, 64, 0},
        {1, 1000, 9, 3, 64, 0},  {1, 4095, 9, 3, 64, 0}, {1, 3000, 8, 1, 64, 0}, {1, 777, 8, 2, 128, 0},
        {1, 1000, 9, 3, 64, 1},  /* one split: the direct path */
        /* prefill chunks, T not a multiple of the tile, p0 > 0 */
        {5, 100, 9, 3, 64, 0},   {37, 0, 9, 3, 64, 0},   {64, 0, 9, 3, 64, 0},   {200, 0, 9, 3, 64, 0},
        {129, 300, 9, 3, 64, 0}, {333, 1500, 9, 3, 64, 0}, {1000, 0, 9, 3, 64, 0},
        {100, 50, 4, 4, 64, 0},  {70, 20, 8, 1, 64, 0},  {150, 100, 8, 2, 128, 0}, {300, 0, 4, 4, 128, 0},
        /* forced splits (the combine path for prefill shapes) */
        {200, 0, 9, 3, 64, 3},   {129, 300, 9, 3, 64, 7}, {37, 2000, 9, 3, 64, 5}, {65, 10, 8, 2, 128, 2},
        /* 128-row blocks (chosen when they alone fill the GPU) */
        {1900, 37, 9, 3, 64, 0}, {600, 0, 32, 32, 64, 0}, {600, 0, 32, 32, 64, 2},
        /* swa windows: decode, prefill from 0 and from p0 > window, windows
         * inside one tile, across tiles, larger than the context; splits */
        {1, 5000, 9, 3, 64, 0, 896}, {1, 300, 9, 3, 64, 0, 896},  {1, 2000, 8, 2, 128, 0, 100},
        {1, 2000, 9, 3, 64, 1, 64},  {1000, 0, 9, 3, 64, 0, 100}, {333, 1500, 9, 3, 64, 0, 64},
        {129, 3000, 9, 3, 64, 0, 1}, {200, 700, 8, 2, 128, 0, 257}, {600, 0, 32, 32, 64, 0, 150},
        {129, 300, 9, 3, 64, 7, 200}, {1900, 37, 9, 3, 64, 0, 896},
    };
    for (const attn_case &c : cases) run_attn_case(c, false);
    const attn_case bf16_cases[] = {{1, 2000, 9, 3, 64, 0}, {257, 100, 9, 3, 64, 0}, {600, 5, 32, 32, 64, 0}};
    for (const attn_case &c : bf16_cases) run_attn_case(c, true);
}
