/* `still server`: the command line of the HTTP server (src/serve/). */
#include "cli.h"
#include "serve/server.h"

#include <stdio.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>

/* The plan as KIND:LAYERS groups of consecutive layers, e.g. "gdn:0-6,softmax:7,gdn:8-29". */
static void plan_summary(const still_model *m, char *buf, size_t cap) {
    const int L = still_model_get_info(m).n_layer;
    size_t n = 0;
    buf[0] = 0;
    for (int i = 0; i < L && n < cap;) {
        const char *k = still_model_layer_kind(m, i);
        int j = i;
        while (j + 1 < L && !strcmp(still_model_layer_kind(m, j + 1), k)) j++;
        int w = j > i ? snprintf(buf + n, cap - n, "%s%s:%d-%d", n ? "," : "", k, i, j)
                      : snprintf(buf + n, cap - n, "%s%s:%d", n ? "," : "", k, i);
        if (w < 0) break;
        n += (size_t)w;
        i = j + 1;
    }
}

int cmd_server(int argc, char **argv) {
    cli_opts o;
    const int prc = cli_parse(CMD_SERVER, "server", argc, argv, &o);
    if (prc > 0) return 0;
    if (prc < 0) return 2;
    if (!o.api_key) o.api_key = getenv("STILL_API_KEY");
    if (o.api_key && !o.api_key[0]) {
        fprintf(stderr, "still server: error: the API key is empty\n");
        return 2;
    }
    if (o.n_predict < 1) {
        fprintf(stderr, "still server: error: -n must be at least 1\n");
        return 2;
    }
    struct stat st;
    if (o.state_dir && (stat(o.state_dir, &st) || !S_ISDIR(st.st_mode))) {
        fprintf(stderr, "still server: error: --state-dir '%s' is not a directory\n", o.state_dir);
        return 2;
    }
    still_model *m = NULL;
    const int lrc = cli_load_model(&o, &m);
    if (lrc) return lrc;
    char plan[1024], name[256];
    plan_summary(m, plan, sizeof plan);
    const char *base = strrchr(o.model, '/');
    snprintf(name, sizeof name, "%s", base ? base + 1 : o.model);
    serve_opts so = {
        .host = o.host, .port = o.port, .api_key = o.api_key, .model_name = name, .plan = plan,
        .n_slots = o.n_parallel, .n_ctx = o.n_ctx ? o.n_ctx : 8192, .n_batch = o.n_batch, .queue_max = o.queue_max,
        .device = cli_device(&o), .matvec = cli_matvec(&o), .max_tokens_default = o.n_predict, .max_body = (size_t)8 << 20,
        .threads = o.http_threads, .omp_threads = o.threads, .fixed_threads = o.fixed_threads, .cache_bytes = (size_t)o.cache_mib << 20, .state_dir = o.state_dir,
    };
#ifdef STILL_HAVE_SERVER
    const int rc = serve_run(m, &so);
#else
    (void)so;
    fprintf(stderr, "still server: error: this build has no server (libmicrohttpd was missing when it was built: "
                    "apt-get install libmicrohttpd-dev, then build again)\n");
    const int rc = 1;
#endif
    still_model_free(m);
    return rc;
}
