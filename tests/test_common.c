/* src/common/common.c's atomic output files under a terminating signal: a child
 * process opens a temporary file for an output, writes to it and is killed
 * (SIGTERM, SIGINT, SIGHUP raised, and SIGTERM sent by the parent while the
 * child waits); the parent checks that the child died of that signal and that
 * the output's folder holds no temporary file, and that an output committed
 * before the signal is left whole. */
#include "check.h"
#include "common/common.h"

#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* Files in dir (not . and ..). */
static int count_files(const char *dir, int *temps) {
    DIR *d = opendir(dir);
    int n = 0;
    *temps = 0;
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        n++;
        if (strstr(e->d_name, ".gguf.")) (*temps)++;
    }
    closedir(d);
    return n;
}

/* The child: with commit_first, writes and commits dir/done.gguf; then opens dir/out.gguf's temporary file,
 * writes, tells the parent through fd `ready` and raises sig (or, sig 0, waits to be killed). */
static void child(const char *dir, int sig, int commit_first, int ready) {
    char out[512], done[512];
    snprintf(out, sizeof out, "%s/out.gguf", dir);
    snprintf(done, sizeof done, "%s/done.gguf", dir);
    FILE *fp;
    char *tmp;
    still_err err = {0};
    if (commit_first) {
        if (still_tmp_open(done, &fp, &tmp, &err) || fputs("whole", fp) < 0 || still_tmp_commit(fp, tmp, done, &err)) _exit(3);
    }
    if (still_tmp_open(out, &fp, &tmp, &err)) _exit(4);
    fputs("partial", fp);
    fflush(fp);
    if (write(ready, "r", 1) != 1) _exit(5);
    if (sig) raise(sig);
    for (;;) pause();
}

static void run_case(const char *what, int sig, int send, int commit_first) {
    char dir[] = "/tmp/still-test-common-XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK(0, "%s: mkdtemp", what);
        return;
    }
    int p[2];
    if (pipe(p) != 0) {
        CHECK(0, "%s: pipe", what);
        return;
    }
    const pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        child(dir, send ? 0 : sig, commit_first, p[1]);
    }
    close(p[1]);
    char c;
    const int got = (int)read(p[0], &c, 1);
    close(p[0]);
    if (send && got == 1) kill(pid, sig);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(got == 1, "%s: the child did not reach its temporary file (status %d)", what, status);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == sig, "%s: the child should die of signal %d (status 0x%x)", what,
          sig, status);
    int temps = 0;
    const int n = count_files(dir, &temps);
    CHECK(temps == 0, "%s: %d temporary file(s) left in %s", what, temps, dir);
    CHECK(n == (commit_first ? 1 : 0), "%s: %d files in %s", what, n, dir);
    if (commit_first) {
        char done[512], buf[16] = {0};
        snprintf(done, sizeof done, "%s/done.gguf", dir);
        FILE *f = fopen(done, "rb");
        const size_t r = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f) fclose(f);
        CHECK(r == 5 && !strcmp(buf, "whole"), "%s: the committed output is not whole", what);
        unlink(done);
    }
    /* clean up whatever a failure left */
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char f[600];
        snprintf(f, sizeof f, "%s/%s", dir, e->d_name);
        unlink(f);
    }
    if (d) closedir(d);
    rmdir(dir);
}

int main(void) {
    run_case("SIGTERM raised", SIGTERM, 0, 0);
    run_case("SIGINT raised", SIGINT, 0, 0);
    run_case("SIGHUP raised", SIGHUP, 0, 0);
    run_case("SIGTERM sent while waiting", SIGTERM, 1, 0);
    run_case("SIGTERM after a committed output", SIGTERM, 0, 1);
    return CHECK_SUMMARY();
}
