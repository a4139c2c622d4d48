/* `still convert` and `still merge`: linearized-model files. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

static int write_with(int cmd, const char *name, int argc, char **argv) {
    cli_opts o;
    int prc = cli_parse(cmd, name, argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    if (!o.output) {
        fprintf(stderr, "still %s: error: no output file given (use -o FILE)\n", name);
        return 2;
    }
    if (cmd == CMD_MERGE && !o.adapter) {
        fprintf(stderr, "still merge: error: no adapter given (use --adapter FILE)\n");
        return 2;
    }
    if (cmd == CMD_CONVERT && !o.attn_given && !o.adapter) {
        fprintf(stderr, "still convert: error: no attention kind given (use --attn KIND, or --adapter FILE to rewrite one)\n");
        return 2;
    }
    still_model *m;
    const int lrc = cli_load_model(&o, &m);
    if (lrc) return lrc;
    still_err err = {0};
    const int type = o.outtype && !strcmp(o.outtype, "f16") ? STILL_ADAPTER_F16 : STILL_ADAPTER_F32;
    int rc = cmd == CMD_MERGE ? still_model_save_merged(m, o.output, &err)
                              : still_model_save_adapter_as(m, o.output, type, &err);
    if (rc) fprintf(stderr, "still %s: error: %s\n", name, err.msg);
    else {   /* the plan in runs of layers: "layers 0-26 still, 27-28 gdn, 29 swa" */
        char plan[512];
        size_t at = 0;
        const int n = still_model_get_info(m).n_layer;
        for (int l = 0; l < n && at < sizeof plan - 64;) {
            const char *k = still_model_layer_kind(m, l);
            int e = l;
            while (e + 1 < n && !strcmp(still_model_layer_kind(m, e + 1), k)) e++;
            at += (size_t)(e > l ? snprintf(plan + at, sizeof plan - at, "%s%d-%d %s", l ? ", " : "", l, e, k)
                                 : snprintf(plan + at, sizeof plan - at, "%s%d %s", l ? ", " : "", l, k));
            l = e + 1;
        }
        fprintf(stderr, "still %s: wrote %s (layers %s)\n", name, o.output, plan);
    }
    still_model_free(m);
    return rc ? 1 : 0;
}

int cmd_convert(int argc, char **argv) { return write_with(CMD_CONVERT, "convert", argc, argv); }
int cmd_merge(int argc, char **argv) { return write_with(CMD_MERGE, "merge", argc, argv); }
