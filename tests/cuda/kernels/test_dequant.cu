/* Groups dequant (stc_dequant_to_bf16, every supported type: bit for bit the bf16 rounding of
 * src/format/quant.c's values) and embed (stc_embed_quant, stc_embed_bf16: exact gathers). */
#include "harness.cuh"
#include "ref.cuh"
#include "test_groups.cuh"

static const uint32_t DQ_TYPES[] = {TT_F32, TT_F16, TT_BF16, TT_Q4_0, TT_Q4_1, TT_Q5_0, TT_Q5_1,
                                    TT_Q8_0, TT_Q8_1, TT_Q2_K, TT_Q3_K, TT_Q4_K, TT_Q5_K, TT_Q6_K};

void test_dequant(void) {
    for (uint32_t type : DQ_TYPES) {
        const int64_t be = tensor_type_block_elems(type);
        const int64_t shapes[][2] = {{1, be}, {3, be * (be == 1 ? 577 : 3)}, {17, be == 256 ? 768 : 576}};
        for (auto &sh : shapes) {
            const int64_t rows = sh[0], cols = sh[1];
            char name[128];
            snprintf(name, sizeof name, "dequant %s %lld x %lld -> bf16", tensor_type_name(type), (long long)rows,
                     (long long)cols);
            if (!stc_type_supported(type)) {
                report(false, "%s: type not supported", name);
                continue;
            }
            const std::vector<uint8_t> raw = rand_blocks(type, rows, cols);
            const std::vector<float> ref = ref_dequant(type, raw, rows, cols);
            std::vector<uint16_t> want(ref.size()), got(ref.size());
            for (size_t i = 0; i < ref.size(); i++) want[i] = f2bf(ref[i]);
            dbuf out(got.size() * 2);
            if (!out.ok() || !out.poison()) continue;
            if (!API(stc_dequant_to_bf16(g_ctx, type, raw.data(), rows, cols, out.as<stc_bf16>(), &g_err))) continue;
            if (!download(got, out)) continue;
            check_exact(name, got, want, true);
        }
    }
}

void test_embed(void) {
    /* Raw quantized tables: exactly dequantize_row()'s values. */
    const uint32_t types[] = {TT_Q8_0, TT_Q4_1, TT_F32, TT_F16, TT_BF16, TT_Q6_K, TT_Q4_K};
    for (uint32_t type : types) {
        const int64_t n_vocab = 301;
        const int d = tensor_type_block_elems(type) == 256 ? 512 : 576;
        const std::vector<uint8_t> raw = rand_blocks(type, n_vocab, d);
        const std::vector<float> table = ref_dequant(type, raw, n_vocab, d);
        const std::vector<int32_t> tok = {0, 300, 17, 17, 150, 299, 1};
        const int T = (int)tok.size();
        std::vector<uint32_t> want((size_t)T * d), got(want.size());
        for (int t = 0; t < T; t++)
            for (int c = 0; c < d; c++) want[(size_t)t * d + c] = f2u(table[(size_t)tok[t] * d + c]);
        dbuf dt(raw.size()), dtok(tok.size() * 4), out(got.size() * 4);
        if (!dt.ok() || !dtok.ok() || !out.ok() || !upload(dt, raw) || !upload(dtok, tok) || !out.poison()) continue;
        char name[128];
        snprintf(name, sizeof name, "embed_quant %s T=%d d=%d", tensor_type_name(type), T, d);
        if (!API(stc_embed_quant(g_ctx, type, dt.p, n_vocab, d, dtok.as<int32_t>(), T, out.as<float>(), &g_err)))
            continue;
        if (download(got, out)) check_exact(name, got, want, false);
    }
    /* bf16 table -> fp32 rows; tokens out of range give NaN rows. */
    for (int d : {576, 64, 3}) {
        const int64_t n_vocab = 1000;
        const std::vector<uint16_t> table = rand_bf16((size_t)n_vocab * d, 1.0);
        const std::vector<int32_t> tok = {5, 999, 0, 5, -1, 1000, 42};
        const int T = (int)tok.size();
        std::vector<uint32_t> want((size_t)T * d), got(want.size());
        for (int t = 0; t < T; t++)
            for (int c = 0; c < d; c++)
                want[(size_t)t * d + c] = tok[t] >= 0 && tok[t] < n_vocab ? f2u(bf2f(table[(size_t)tok[t] * d + c]))
                                                                          : 0x7fc00000u;
        dbuf dt(table.size() * 2), dtok(tok.size() * 4), out(got.size() * 4);
        if (!dt.ok() || !dtok.ok() || !out.ok() || !upload(dt, table) || !upload(dtok, tok) || !out.poison()) continue;
        char name[128];
        snprintf(name, sizeof name, "embed_bf16 T=%d d=%d (two tokens out of range -> NaN rows)", T, d);
        if (!API(stc_embed_bf16(g_ctx, dt.as<stc_bf16>(), n_vocab, d, dtok.as<int32_t>(), T, out.as<float>(), &g_err)))
            continue;
        if (download(got, out)) check_exact(name, got, want, false);
    }
}
