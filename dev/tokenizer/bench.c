/*
 * bench.c — encode speed of the C tokenizer (llmc/tokenizer.c): MB/s of input text on one core
 * (a cold piece cache, then warm), and with tokenize_parallel on N threads, as the shard tool
 * runs it. dev/tokenizer/bench.sh builds it, makes an English corpus and tokenizers, and runs it.
 *
 *   bench_tokenizer TOKENIZER TEXT [--threads N] [--dump IDS.bin]
 *
 * --dump writes the ids of the one-core pass (int32, little-endian) for comparison with HF.
 * Speeds are per CPU second (the thread's or the process's CPU time), so that a busy machine
 * does not understate them; wall-clock speed is printed beside.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../llmc/common.h"
#include "../../llmc/threads.h"
#include "../../llmc/tokenize_shards.h"
#include "../../llmc/tokenizer.h"

static double cpu_s(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s TOKENIZER TEXT [--threads N] [--dump IDS.bin]\n", argv[0]);
        return 2;
    }
    int threads = threads_online_cpus();
    const char* dump = NULL;
    for (int i = 3; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--threads") == 0) threads = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--dump") == 0) dump = argv[i + 1];
    }
    char err[ERR_LEN];
    Tokenizer tok;
    double t0 = time_now_s();
    if (tokenizer_load(&tok, argv[1], err) != 0) fatal("%s", err);
    double t_load = time_now_s() - t0;
    size_t len;
    char* text = file_read_all(argv[2], (size_t)1 << 34, &len, err);
    if (!text) fatal("%s", err);
    const double mb = (double)len / 1e6;
    printf("tokenizer %s: %d ids, %d merges, load %.2fs\n", argv[1], tok.n_vocab, tok.n_merges, t_load);
    printf("text %s: %.1f MB\n", argv[2], mb);

    TokEncoder e;
    tokenizer_encoder_init(&e, &tok);
    TokIds ids = {0};
    t0 = time_now_s();
    double c0 = cpu_s(CLOCK_THREAD_CPUTIME_ID);
    tokenizer_encode(&e, text, len, 0, &ids);
    double t_cold = time_now_s() - t0, c_cold = cpu_s(CLOCK_THREAD_CPUTIME_ID) - c0;
    printf("1 core, cold cache: %8.1f MB/s per CPU second (%.1f MB/s wall; %zu tokens, %.2f "
           "bytes/token, cache hits %.1f%%)\n", mb / c_cold, mb / t_cold, ids.n,
           (double)len / (double)ids.n, 100.0 * (double)e.hits / (double)(e.hits + e.misses));
    if (dump) {
        FILE* f = fopen_check(dump, "wb");
        fwrite_check(ids.ids, sizeof(int32_t), ids.n, f, dump);
        fclose_check(f, dump);
    }
    size_t n_first = ids.n;
    ids.n = 0;
    t0 = time_now_s();
    c0 = cpu_s(CLOCK_THREAD_CPUTIME_ID);
    tokenizer_encode(&e, text, len, 0, &ids);
    double t_warm = time_now_s() - t0, c_warm = cpu_s(CLOCK_THREAD_CPUTIME_ID) - c0;
    printf("1 core, warm cache: %8.1f MB/s per CPU second (%.1f MB/s wall)\n", mb / c_warm,
           mb / t_warm);
    if (ids.n != n_first) fatal("the warm pass gave %zu tokens, the cold one %zu", ids.n, n_first);
    tokenizer_encoder_free(&e);

    TokIds par = {0};
    t0 = time_now_s();
    c0 = cpu_s(CLOCK_PROCESS_CPUTIME_ID);
    tokenize_parallel(&tok, text, len, 0, threads, &par);
    double t_par = time_now_s() - t0, c_par = cpu_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    printf("%d threads:          %8.1f MB/s wall, %.1f MB/s per CPU second%s\n", threads,
           mb / t_par, mb / c_par,
           par.n == ids.n && memcmp(par.ids, ids.ids, ids.n * sizeof(int32_t)) == 0 ? ""
                                                                                 : "  IDS DIFFER");
    tokenizer_ids_free(&par);
    tokenizer_ids_free(&ids);
    free(text);
    tokenizer_free(&tok);
    return 0;
}
