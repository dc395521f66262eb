/*
 * testing.c — helpers shared by the test suites that drive ./train_roundpipe end to end.
 * (No suite here: the runner lists suites explicitly.)
 */
#include <stdlib.h>
#include <sys/wait.h>

#include "../common.h"
#include "testing.h"

int test_run_cli(TestCtx* t, const char* tag, const char* args) {
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "cd '%s' && ./train_roundpipe %s > '%s/%s.out' 2> '%s/%s.err'",
             t->exe_dir, args, t->tmpdir, tag, t->tmpdir, tag);
    int st = system(cmd);
    if (st == -1 || !WIFEXITED(st)) return -1;
    return WEXITSTATUS(st);
}

char* test_read_file(const char* path, size_t* len) {
    char err[ERR_LEN];
    size_t n = 0;
    char* s = file_read_all(path, 64u << 20, &n, err);
    if (len) *len = s ? n : 0;
    return s ? s : calloc_check(1, 1);
}

char* test_read_output(TestCtx* t, const char* tag, const char* ext) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s.%s", t->tmpdir, tag, ext);
    return test_read_file(path, NULL);
}
