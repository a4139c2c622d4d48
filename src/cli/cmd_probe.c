/* `still probe`: where a retrieval prompt's needle goes in a linearized
 * model, layer by layer (still_probe in still.h). The prompt is one sample of
 * a `still eval` task (built-in or --tasks FILE) or your own text with
 * --needle and --answer; the keys are the tokens of the answer's value in the
 * prompt, the queries the positions that predict the answer's tokens
 * (teacher-forced). Per layer: the teacher's attention mass on the needle at
 * its strongest head, what the plan gives that head through its softmax part
 * and its linear state, the shares of Local, Sel and the linear state in its
 * denominator, and where the needle's tokens went with their self-saliency
 * ranks; the linear state's share against what exact softmax would give the
 * tokens it stands for (also for --ordinary N other queries); then a summary
 * over the heads the teacher retrieves with. */
#include "cli.h"
#include "eval/eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The tokens of ids whose bytes overlap text[a, b) of the decoded sequence. */
static int token_span(const still_model *m, const int32_t *ids, int n, size_t a, size_t b, int *keys, int cap) {
    size_t at = 0;
    int k = 0;
    char buf[256];
    for (int i = 0; i < n; i++) {
        const size_t len = still_token_to_piece(m, ids[i], buf, sizeof buf);
        if (at < b && at + len > a && k < cap) keys[k++] = i;
        at += len;
    }
    return k;
}

static char *decode_all(const still_model *m, const int32_t *ids, int n) {
    size_t cap = 1024, len = 0;
    char *s = malloc(cap), buf[256];
    for (int i = 0; s && i < n; i++) {
        size_t k = still_token_to_piece(m, ids[i], buf, sizeof buf);
        if (k > sizeof buf) k = sizeof buf;
        if (len + k + 1 > cap) {
            char *t = realloc(s, cap = (len + k + 1) * 2);
            if (!t) free(s);
            s = t;
        }
        if (s) memcpy(s + len, buf, k), len += k;
    }
    if (s) s[len] = 0;
    return s;
}

int cmd_probe(int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(CMD_PROBE, "probe", argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    const int from_task = o.probe_task || o.task_file;
    if (from_task == !!o.file || (o.file && (!o.needle || !o.answer))) {
        fprintf(stderr, "still probe: error: give --task NAME (or --tasks FILE.jsonl) [--length N --sample I], or -f "
                        "PROMPT --needle VALUE --answer VALUE\n");
        return 2;
    }
    char *hay = NULL, *text = NULL;
    size_t hay_len = 0, text_len = 0;
    const char *hay_path = o.haystack;
    if (!hay_path && !o.file) hay_path = "../shared/data/corpus/austen/emma.txt";
    if (hay_path && !o.file && cli_read_file(hay_path, &hay, &hay_len)) return 1;
    if (o.file && cli_read_file(o.file, &text, &text_len)) return 1;
    still_model *m;
    const int lrc = cli_load_model(&o, &m);
    if (lrc) {
        free(hay), free(text);
        return lrc;
    }
    cli_prompt_counter cnt = {.m = m, .system = still_model_default_system(m)};
    int rc = 1;
    eval_prompt p = {0};
    eval_item_set items = {0};
    int32_t *ids = NULL, *ans = NULL, *all = NULL;
    int *keys = NULL, *qs = NULL;
    char *full = NULL;
    still_probe_result r = {0};
    still_err err = {0};
    const char *value = o.answer;
    const int length = o.probe_length > 0 ? o.probe_length : 4096;
    if (o.probe_task) {
        if (eval_make_prompt(o.probe_task, o.tp.seed * 1000003ULL + (uint64_t)o.probe_sample, length, hay, hay_len,
                             cli_chat_count, &cnt, &p, &err)) {
            fprintf(stderr, "still probe: error: %s\n", err.msg);
            goto done;
        }
    } else if (o.task_file) {
        if (eval_items_load(o.task_file, &items, &err) ||
            eval_make_prompt_item(&items.items[o.probe_sample % items.n_items], o.tp.seed * 1000003ULL + (uint64_t)o.probe_sample,
                                  length, hay, hay_len, cli_chat_count, &cnt, &p, &err)) {
            fprintf(stderr, "still probe: error: %s\n", err.msg);
            goto done;
        }
    }
    size_t n_ids = 0, n_ans = 0;
    if (from_task) {
        if (!value) value = p.refs[0];
        if (cli_chat_ids(m, cnt.system, p.user, p.answer_prefix, &ids, &n_ids)) goto done;
    } else if (still_tokenize(m, text, text_len, 1, &ids, &n_ids, &err)) {
        fprintf(stderr, "still probe: error: %s\n", err.msg);
        goto done;
    }
    /* the answer as it would be generated after the prompt */
    {
        char *a = malloc(strlen(value) + 2);
        if (!a) goto done;
        a[0] = ' ', strcpy(a + 1, value);
        rc = still_tokenize(m, a, strlen(a), 0, &ans, &n_ans, &err);
        free(a);
        if (rc) {
            fprintf(stderr, "still probe: error: %s\n", err.msg);
            rc = 1;
            goto done;
        }
        rc = 1;
    }
    const int n = (int)(n_ids + n_ans);
    all = malloc(sizeof(int32_t) * (size_t)n);
    keys = malloc(sizeof(int) * 256), qs = malloc(sizeof(int) * (n_ans + 1));
    if (!all || !keys || !qs) goto done;
    memcpy(all, ids, sizeof(int32_t) * n_ids), memcpy(all + n_ids, ans, sizeof(int32_t) * n_ans);
    /* the needle: the (last) occurrence of the needle text in the prompt */
    full = decode_all(m, ids, (int)n_ids);
    const char *needle = o.needle ? o.needle : value, *hit = NULL;
    for (const char *s = full; s && (s = strstr(s, needle)); s++) hit = s;
    if (!hit) {
        fprintf(stderr, "still probe: error: the needle '%.60s' is not in the prompt\n", needle);
        goto done;
    }
    const int nk = token_span(m, ids, (int)n_ids, (size_t)(hit - full), (size_t)(hit - full) + strlen(needle), keys, 256);
    int nq = 0;
    for (int i = 0; i < (int)n_ans; i++) qs[nq++] = (int)n_ids - 1 + i;
    if ((rc = still_probe(m, all, n, keys, nk, qs, nq, o.probe_ordinary, &r, &err))) {
        fprintf(stderr, "still probe: error: %s\n", err.msg);
        rc = 1;
        goto done;
    }
    rc = 1;
    const int L = r.n_layer, H = r.n_head, Hs = r.n_sel_head;
    printf("# still probe: %s%s%s\n\n", o.model, o.adapter ? " + " : "", o.adapter ? o.adapter : "");
    printf("prompt %zu tokens%s%s; needle '%s': %d tokens at %d..%d (depth %.2f); answer %zu tokens; queries %d..%d\n\n",
           n_ids, o.probe_task ? ", task " : "", o.probe_task ? o.probe_task : "", needle, nk, keys[0],
           keys[nk - 1], (double)keys[0] / (double)n_ids, n_ans, qs[0], qs[nq - 1]);
    printf("| layer | kind | teacher head | teacher mass | plan: softmax | plan: linear | Local / Sel / linear shares "
           "| needle in Local / Sel / linear (all selection heads) | best saliency rank | linear share / exact | "
           "ordinary queries: linear share / exact |\n");
    printf("|---:|---|---:|---:|---:|---:|---|---|---:|---|---|\n");
    double lo_a = 0, le_a = 0, lo_o = 0, le_o = 0;
    int n_fold = 0;
    double rt = 0, rs = 0, rl = 0;
    int n_ret = 0;
    for (int l = 0; l < L; l++) {
        int hb = 0;
        for (int h = 1; h < H; h++) hb = r.teacher[(size_t)l * H + h] > r.teacher[(size_t)l * H + hb] ? h : hb;
        const size_t a = (size_t)l * H + hb;
        int cnt_r[4] = {0}, best = 0, is_still = 0;
        for (int hs = 0; hs < Hs; hs++)
            for (int i = 0; i < nk; i++) {
                const size_t o2 = ((size_t)l * Hs + hs) * nk + i;
                if (r.route[o2] < 0) continue;
                is_still = 1;
                cnt_r[r.route[o2]]++;
                if (r.rank[o2] && (!best || r.rank[o2] < best)) best = r.rank[o2];
            }
        printf("| %d | %s | %d | %.3f | %.3f | %.3f |", l, still_model_layer_kind(m, l), hb, r.teacher[a],
               isnan(r.soft[a]) ? 0.0 : r.soft[a], isnan(r.lin[a]) ? 0.0 : r.lin[a]);
        if (is_still) printf(" %.2f / %.2f / %.2f | %d / %d / %d%s |", r.local[a], r.sel[a], r.fold[a], cnt_r[0],
                             cnt_r[1], cnt_r[2], cnt_r[3] ? " (+dropped)" : "");
        else printf(" — | — |");
        if (best) printf(" %d |", best);
        else printf(" — |");
        if (is_still) printf(" %.2f / %.2f |", r.fold[a], r.exact[a]);
        else printf(" — |");
        if (is_still && r.n_ordinary) printf(" %.2f / %.2f |\n", r.ord_fold[a], r.ord_exact[a]);
        else printf(" — |\n");
        for (int h = 0; is_still && h < H; h++) {   /* every head of the layers that leave tokens out */
            const size_t b = (size_t)l * H + h;
            if (!(r.exact[b] > 0) && !(r.fold[b] > 0)) continue;
            lo_a += r.fold[b], le_a += r.exact[b], n_fold++;
            if (r.n_ordinary) lo_o += r.ord_fold[b], le_o += r.ord_exact[b];
        }
        for (int h = 0; h < H; h++) {   /* the heads the teacher retrieves with */
            const size_t b = (size_t)l * H + h;
            if (r.teacher[b] < 0.1) continue;
            rt += r.teacher[b], rs += isnan(r.soft[b]) ? 0 : r.soft[b], rl += isnan(r.lin[b]) ? 0 : r.lin[b];
            n_ret++;
        }
    }
    printf("\nheads where the teacher puts >= 0.1 of its attention on the needle: %d of %d; their mean mass: teacher "
           "%.3f, plan %.3f through softmax + %.3f through the linear state\n",
           n_ret, L * H, n_ret ? rt / n_ret : 0.0, n_ret ? rs / n_ret : 0.0, n_ret ? rl / n_ret : 0.0);
    if (n_fold)
        printf("heads that leave tokens out of Local ∪ Sel: %d; their mean share of those tokens, linear state against "
               "exact softmax: %.3f / %.3f at the answer's queries%s", n_fold, lo_a / n_fold, le_a / n_fold,
               r.n_ordinary ? "" : "\n");
    if (n_fold && r.n_ordinary)
        printf(", %.3f / %.3f at %d ordinary queries\n", lo_o / n_fold, le_o / n_fold, r.n_ordinary);
    int n_dsa = 0;
    for (int l = 0; l < L; l++) n_dsa += !isnan(r.recall[l]);
    if (n_dsa) {
        printf("\ndsa layers: the indexer against the teacher over the %d queries%s that select (more than topk "
               "positions before them)\n\n| layer | indexer recall of the teacher's best topk − 64 older positions | "
               "teacher's older-position attention kept |\n|---:|---:|---:|\n",
               nq, r.n_ordinary ? " and the ordinary ones" : "");
        double sr = 0, sk = 0;
        for (int l = 0; l < L; l++) {
            if (isnan(r.recall[l])) continue;
            printf("| %d | %.3f | %.3f |\n", l, r.recall[l], r.kept[l]);
            sr += r.recall[l], sk += r.kept[l];
        }
        printf("| mean | %.3f | %.3f |\n", sr / n_dsa, sk / n_dsa);
    }
    rc = 0;
done:
    still_probe_result_free(&r);
    eval_prompt_free(&p);
    eval_items_free(&items);
    free(ids), free(ans), free(all), free(keys), free(qs), free(full), free(hay), free(text);
    still_model_free(m);
    return rc;
}
