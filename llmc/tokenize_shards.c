/*
 * tokenize_shards.c — text / JSONL into llm.c token shards (tokenize_shards.h): reading documents,
 * parallel tokenization in chunks, the validation split, shard writing, the progress line, and
 * the --tokenize command line.
 */
#include "tokenize_shards.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "dataloader.h"
#include "json.h"
#include "threads.h"

#define BATCH_BYTES ((size_t)32 << 20)  // text tokenized per pool run
#define BATCH_DOCS 16384
#define CHUNK_BYTES ((size_t)1 << 20)   // documents are cut into pieces of about this size
#define MAX_TEXT_FILE ((size_t)1 << 34)

// ----------------------------------------------------------------------------
// parallel tokenization: jobs (pieces of documents) on a pool, one encoder per thread

typedef struct EncoderPool {
    const Tokenizer* tok;
    ThreadPool* pool;
    TokEncoder* enc;
    int* free_list;  // indices of idle encoders
    int n_free;
    pthread_mutex_t mu;
} EncoderPool;

typedef struct Job {
    const char* text;
    size_t len;
    TokIds ids;
} Job;

typedef struct JobRun {
    EncoderPool* ep;
    Job* jobs;
} JobRun;

static void encoder_pool_init(EncoderPool* ep, const Tokenizer* tok, int threads) {
    memset(ep, 0, sizeof *ep);
    ep->tok = tok;
    ep->pool = threadpool_create(threads);
    int n = ep->pool->n_threads;
    ep->enc = malloc_check((size_t)n * sizeof(TokEncoder));
    ep->free_list = malloc_check((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) {
        tokenizer_encoder_init(&ep->enc[i], tok);
        ep->free_list[i] = i;
    }
    ep->n_free = n;
    pthread_check(pthread_mutex_init(&ep->mu, NULL));
}

static void encoder_pool_free(EncoderPool* ep) {
    for (int i = 0; i < ep->pool->n_threads; i++) tokenizer_encoder_free(&ep->enc[i]);
    threadpool_destroy(ep->pool);
    free(ep->enc);
    free(ep->free_list);
    pthread_check(pthread_mutex_destroy(&ep->mu));
}

static void job_run(void* arg, int64_t i) {
    JobRun* r = arg;
    EncoderPool* ep = r->ep;
    // at most n_threads jobs run at once, so an idle encoder is always there
    pthread_check(pthread_mutex_lock(&ep->mu));
    int k = ep->free_list[--ep->n_free];
    pthread_check(pthread_mutex_unlock(&ep->mu));
    Job* j = &r->jobs[i];
    tokenizer_encode(&ep->enc[k], j->text, j->len, 0, &j->ids);
    pthread_check(pthread_mutex_lock(&ep->mu));
    ep->free_list[ep->n_free++] = k;
    pthread_check(pthread_mutex_unlock(&ep->mu));
}

// Where text may be cut without changing its tokens: 1 when the tokenizer allows cuts at all.
// A cut goes after a newline that follows a printable ASCII character and precedes an ASCII
// letter: every split regex ends a piece there whatever comes after ("x\n" + "Y", "}\n" + "Y"),
// NFC never reaches across ASCII, and no added token can straddle it when none holds a newline
// or swallows whitespace. A prefix space would be added at every cut, so none then.
static int tokenizer_can_cut(const Tokenizer* tok) {
    if (tok->add_prefix_space) return 0;
    for (int i = 0; i < tok->n_added; i++) {
        const TokAdded* a = &tok->added[i];
        if (a->lstrip || a->rstrip || memchr(tok->added_text + a->off, '\n', a->len)) return 0;
    }
    return 1;
}

// The first cut at or after `from` (len when there is none).
static size_t next_cut(const char* s, size_t len, size_t from) {
    if (from < 2) from = 2;
    while (from < len) {
        const char* nl = memchr(s + from - 1, '\n', len - (from - 1));
        if (!nl) return len;
        size_t p = (size_t)(nl - s) + 1;  // just after the newline
        if (p >= len) return len;
        unsigned char before = (unsigned char)s[p - 2], after = (unsigned char)s[p];
        if (p >= 2 && before > 0x20 && before < 0x7f &&
            ((after >= 'a' && after <= 'z') || (after >= 'A' && after <= 'Z')))
            return p;
        from = p + 1;
    }
    return len;
}

// Jobs for text[0..len): pieces of about chunk bytes (one piece when cutting is not allowed).
static void add_jobs(const char* text, size_t len, size_t chunk, int can_cut, Job** jobs, size_t* n,
                     size_t* cap) {
    size_t start = 0;
    do {
        size_t end = can_cut && len - start > chunk ? next_cut(text, len, start + chunk) : len;
        if (*n == *cap) {
            *cap = *cap ? 2 * *cap : 64;
            *jobs = realloc_check(*jobs, *cap * sizeof(Job));
        }
        (*jobs)[(*n)++] = (Job){text + start, end - start, {0}};
        start = end;
    } while (start < len);
}

void tokenize_parallel(const Tokenizer* tok, const char* text, size_t len, size_t chunk_bytes,
                       int threads, TokIds* out) {
    EncoderPool ep;
    encoder_pool_init(&ep, tok, threads);
    Job* jobs = NULL;
    size_t n = 0, cap = 0;
    add_jobs(text, len, chunk_bytes ? chunk_bytes : CHUNK_BYTES, tokenizer_can_cut(tok), &jobs, &n,
             &cap);
    JobRun run = {&ep, jobs};
    threadpool_run(ep.pool, (int64_t)n, job_run, &run);
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < jobs[i].ids.n; k++) tokenizer_ids_push(out, jobs[i].ids.ids[k]);
        tokenizer_ids_free(&jobs[i].ids);
    }
    free(jobs);
    encoder_pool_free(&ep);
}

// ----------------------------------------------------------------------------
// reading documents

typedef struct Doc {
    char* text;  // owned
    size_t len;
} Doc;

typedef struct Reader {
    const TokenizeShardsArgs* a;
    int file;       // index of the current input
    FILE* jsonl;    // open .jsonl, or NULL
    int64_t line;
    char* buf;
    size_t buf_cap;
    int64_t bytes;  // input bytes consumed
} Reader;

// The next document: 1, or 0 at the end, or -1 with err.
static int reader_next(Reader* r, Doc* d, char* err) {
    const TokenizeShardsArgs* a = r->a;
    for (;;) {
        if (r->file >= a->n_inputs) return 0;
        const char* path = a->inputs[r->file];
        if (!str_ends_with(path, ".jsonl")) {
            d->text = file_read_all(path, MAX_TEXT_FILE, &d->len, err);
            if (!d->text) return -1;
            r->bytes += (int64_t)d->len;
            r->file++;
            return 1;
        }
        if (!r->jsonl) {
            r->jsonl = fopen(path, "rb");
            if (!r->jsonl) return errorf(err, "%s: cannot open: %s", path, strerror(errno));
            r->line = 0;
        }
        ssize_t n = getline(&r->buf, &r->buf_cap, r->jsonl);
        if (n < 0) {
            int bad = ferror(r->jsonl);
            fclose(r->jsonl);
            r->jsonl = NULL;
            if (bad) return errorf(err, "%s: read error", path);
            r->file++;
            continue;
        }
        r->line++;
        r->bytes += n;
        size_t k = 0;
        while (k < (size_t)n && (r->buf[k] == ' ' || r->buf[k] == '\t' || r->buf[k] == '\n' ||
                                 r->buf[k] == '\r'))
            k++;
        if (k == (size_t)n) continue;  // a blank line
        JsonDoc j;
        char jerr[ERR_LEN];
        if (json_parse(r->buf, (size_t)n, &j, jerr) != 0)
            return errorf(err, "%s:%lld: invalid JSON: %s", path, (long long)r->line, jerr);
        const JsonValue* v = json_get(&j.root, a->text_field);
        if (!v || v->type != JSON_STRING) {
            json_free(&j);
            return errorf(err, "%s:%lld: no string field \"%s\"", path, (long long)r->line,
                          a->text_field);
        }
        d->text = malloc_check(v->str_len + 1);
        memcpy(d->text, v->str, v->str_len);
        d->len = v->str_len;
        json_free(&j);
        return 1;
    }
}

static void reader_close(Reader* r) {
    if (r->jsonl) fclose(r->jsonl);
    free(r->buf);
}

// ----------------------------------------------------------------------------
// shard writing: tokens stream into <prefix>_<split>_<index>.bin.tmp (an AtomicFile); the header
// is written and the file committed (fsync'd and renamed) when it is full or at the end

typedef struct ShardOut {
    const char* prefix;
    const char* split;  // "val" or "train"
    int index;          // of the next shard
    int token_bytes;
    int64_t limit;      // tokens per shard
    AtomicFile af;      // the open shard (af.f NULL: none)
    char path[4096];
    int64_t n;          // tokens in the open shard
    int n_shards;
    int quiet;
    int* progress_shown;  // a progress line is on the terminal (cleared before printing)
} ShardOut;

static int shard_close(ShardOut* s, char* err) {
    if (!s->af.f) return 0;
    int32_t header[SHARD_HEADER_INTS] = {0};
    header[0] = s->token_bytes == 2 ? SHARD_MAGIC_U16 : SHARD_MAGIC_U32;
    header[1] = s->token_bytes == 2 ? SHARD_VERSION_U16 : SHARD_VERSION_U32;
    header[2] = (int32_t)s->n;
    if (fseeko(s->af.f, 0, SEEK_SET) != 0) {
        atomic_file_abort(&s->af);
        return errorf(err, "%s: cannot write: %s", s->path, strerror(errno));
    }
    if (atomic_file_write(&s->af, header, sizeof header, err) != 0) {
        atomic_file_abort(&s->af);
        return -1;
    }
    if (atomic_file_commit(&s->af, err) != 0) return -1;
    s->n_shards++;
    if (!s->quiet) {
        if (*s->progress_shown) fprintf(stderr, "\r\033[K");
        *s->progress_shown = 0;
        printf("wrote %s: %lld tokens\n", s->path, (long long)s->n);
    }
    return 0;
}

static int shard_open(ShardOut* s, char* err) {
    snprintf(s->path, sizeof s->path, "%s_%s_%06d.bin", s->prefix, s->split, s->index++);
    if (atomic_file_open(&s->af, s->path, err) != 0) return -1;
    static const int32_t zeros[SHARD_HEADER_INTS];  // the header, written last
    if (atomic_file_write(&s->af, zeros, sizeof zeros, err) != 0) return -1;
    s->n = 0;
    return 0;
}

static int shard_put(ShardOut* s, const int32_t* ids, size_t n, char* err) {
    uint8_t buf[4096];
    size_t i = 0;
    while (i < n) {
        if (!s->af.f && shard_open(s, err)) return -1;
        size_t room = (size_t)(s->limit - s->n);
        size_t k = n - i < room ? n - i : room;
        if (k > sizeof buf / (size_t)s->token_bytes) k = sizeof buf / (size_t)s->token_bytes;
        for (size_t j = 0; j < k; j++) {
            uint32_t v = (uint32_t)ids[i + j];  // little-endian, as the loader reads it
            buf[j * s->token_bytes] = (uint8_t)v;
            buf[j * s->token_bytes + 1] = (uint8_t)(v >> 8);
            if (s->token_bytes == 4) {
                buf[j * 4 + 2] = (uint8_t)(v >> 16);
                buf[j * 4 + 3] = (uint8_t)(v >> 24);
            }
        }
        if (atomic_file_write(&s->af, buf, (size_t)s->token_bytes * k, err) != 0) return -1;
        s->n += (int64_t)k;
        i += k;
        if (s->n == s->limit && shard_close(s, err)) return -1;
    }
    return 0;
}

static void shard_abort(ShardOut* s) {
    if (s->af.f) atomic_file_abort(&s->af);
}

// ----------------------------------------------------------------------------
// the run

void tokenize_shards_defaults(TokenizeShardsArgs* a) {
    memset(a, 0, sizeof *a);
    a->val_frac = 0.01;
    a->shard_tokens = 100000000;
    a->text_field = "text";
    a->eot = "";
    a->progress = isatty(STDERR_FILENO);
}

static void progress_line(const Reader* r, int64_t total_bytes, int64_t docs, int64_t tokens,
                          double t0, int* shown) {
    double dt = time_now_s() - t0;
    char done[32], all[32];
    format_bytes((double)r->bytes, done, sizeof done);
    format_bytes((double)total_bytes, all, sizeof all);
    fprintf(stderr, "\r\033[Ktokenize: %s of %s (%.1f%%), %lld docs, %.1fM tokens, %.1f MB/s",
            done, all, total_bytes > 0 ? 100.0 * (double)r->bytes / (double)total_bytes : 100.0,
            (long long)docs, (double)tokens / 1e6, dt > 0 ? (double)r->bytes / dt / 1e6 : 0.0);
    fflush(stderr);
    *shown = 1;
}

static int run(const TokenizeShardsArgs* a, const Tokenizer* tok, TokenizeShardsStats* st,
               char* err) {
    memset(st, 0, sizeof *st);
    if (a->n_inputs < 1) return errorf(err, "--tokenize: no input files");
    if (!(a->val_frac >= 0.0 && a->val_frac < 1.0))
        return errorf(err, "--val-frac %g: must be in [0, 1)", a->val_frac);
    if (a->shard_tokens < 1 || a->shard_tokens > INT32_MAX)
        return errorf(err, "--shard-size %lld: must be in [1, 2^31)", (long long)a->shard_tokens);
    int64_t total_bytes = 0;
    for (int i = 0; i < a->n_inputs; i++) {
        struct stat sb;
        if (stat(a->inputs[i], &sb) != 0 || !S_ISREG(sb.st_mode))
            return errorf(err, "%s: not a readable file", a->inputs[i]);
        total_bytes += (int64_t)sb.st_size;
    }
    // the document token
    int32_t eot = a->eot && a->eot[0] ? tokenizer_find(tok, a->eot, strlen(a->eot))
                                      : tokenizer_document_token(tok);
    if (eot < 0)
        return errorf(err, a->eot && a->eot[0] ? "--eot '%s' is not a token of the tokenizer"
                                               : "%s: the tokenizer names no BOS or EOS token to "
                                                 "start documents with; give one with --eot TEXT",
                      a->eot && a->eot[0] ? a->eot : a->tokenizer);
    const int token_bytes = tok->n_vocab <= 65536 ? 2 : 4;
    st->token_bytes = token_bytes;
    {
        // the output directory
        char dir[4096];
        str_copy(dir, sizeof dir, a->out_prefix);
        char* slash = strrchr(dir, '/');
        if (slash && slash != dir) {
            *slash = '\0';
            if (mkdir_p(dir, err) != 0) return -1;
        }
    }
    int shown = 0;
    ShardOut val = {.prefix = a->out_prefix, .split = "val", .index = 0, .token_bytes = token_bytes,
                    .limit = a->shard_tokens, .quiet = a->quiet, .progress_shown = &shown};
    ShardOut train = val;
    train.split = "train";
    train.index = 1;
    if (!a->quiet)
        printf("tokenize: %d input file(s), vocab %d, documents start with token %d, %s tokens\n",
               a->n_inputs, tok->n_vocab, eot, token_bytes == 2 ? "uint16" : "uint32");

    EncoderPool ep;
    encoder_pool_init(&ep, tok, a->threads);
    const int can_cut = tokenizer_can_cut(tok);
    Reader r = {.a = a};
    Doc* docs = malloc_check(BATCH_DOCS * sizeof(Doc));
    size_t* first_job = malloc_check((BATCH_DOCS + 1) * sizeof(size_t));
    Job* jobs = NULL;
    size_t jobs_cap = 0;
    double t0 = time_now_s();
    int rc = 0, more = 1;
    while (more && rc == 0) {
        // a batch of documents
        size_t nd = 0, bytes = 0;
        while (nd < BATCH_DOCS && bytes < BATCH_BYTES) {
            int k = reader_next(&r, &docs[nd], err);
            if (k < 0) rc = -1;
            if (k <= 0) {
                more = 0;
                break;
            }
            bytes += docs[nd++].len;
        }
        if (rc || nd == 0) {
            for (size_t d = 0; d < nd; d++) free(docs[d].text);
            break;
        }
        size_t nj = 0;
        for (size_t d = 0; d < nd; d++) {
            first_job[d] = nj;
            if (docs[d].len) add_jobs(docs[d].text, docs[d].len, CHUNK_BYTES, can_cut, &jobs, &nj, &jobs_cap);
        }
        first_job[nd] = nj;
        JobRun jr = {&ep, jobs};
        threadpool_run(ep.pool, (int64_t)nj, job_run, &jr);
        // in input order: the split, then the tokens
        for (size_t d = 0; d < nd && rc == 0; d++) {
            int64_t n = 1;
            for (size_t j = first_job[d]; j < first_job[d + 1]; j++) n += (int64_t)jobs[j].ids.n;
            int to_val = (double)(st->val_tokens + n) <= a->val_frac * (double)(st->tokens + n);
            ShardOut* out = to_val ? &val : &train;
            rc = shard_put(out, &eot, 1, err);
            for (size_t j = first_job[d]; j < first_job[d + 1] && rc == 0; j++)
                rc = shard_put(out, jobs[j].ids.ids, jobs[j].ids.n, err);
            st->docs++;
            st->tokens += n;
            st->bytes += (int64_t)docs[d].len;
            if (to_val) {
                st->val_docs++;
                st->val_tokens += n;
            }
        }
        for (size_t j = 0; j < nj; j++) tokenizer_ids_free(&jobs[j].ids);
        for (size_t d = 0; d < nd; d++) free(docs[d].text);
        if (a->progress) progress_line(&r, total_bytes, st->docs, st->tokens, t0, &shown);
    }
    if (rc == 0) rc = shard_close(&val, err);
    if (rc == 0) rc = shard_close(&train, err);
    shard_abort(&val);
    shard_abort(&train);
    if (shown) fprintf(stderr, "\r\033[K");
    free(jobs);
    free(first_job);
    free(docs);
    reader_close(&r);
    encoder_pool_free(&ep);
    st->seconds = time_now_s() - t0;
    st->n_val_shards = val.n_shards;
    st->n_train_shards = train.n_shards;
    return rc;
}

int tokenize_shards_run(const TokenizeShardsArgs* a, const Tokenizer* tok, TokenizeShardsStats* st,
                        char* err) {
    TokenizeShardsStats local;
    if (!st) st = &local;
    if (tok) return run(a, tok, st, err);
    Tokenizer own;
    if (tokenizer_load(&own, a->tokenizer, err) != 0) return -1;
    int rc = run(a, &own, st, err);
    tokenizer_free(&own);
    return rc;
}

// ----------------------------------------------------------------------------
// command line

int tokenize_shards_requested(int argc, char** argv) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--tokenize") == 0) return 1;
    return 0;
}

static void usage(FILE* f) {
    fprintf(f,
            "usage: train_roundpipe --tokenize IN... --tokenizer FILE --out-shards PREFIX [options]\n"
            "\n"
            "Tokenize text into llm.c token shards: PREFIX_val_000000.bin, ... and\n"
            "PREFIX_train_000001.bin, ... Each .txt input is one document, each line of a .jsonl\n"
            "input one document (its \"text\" field); every document starts with the document token.\n"
            "\n"
            "  --tokenize IN...      input files (.txt or .jsonl)\n"
            "  --tokenizer FILE      tokenizer.json, a model directory holding one, or a .gguf\n"
            "  --out-shards PREFIX   output path prefix (directories are created)\n"
            "  --val-frac X          share of tokens, whole documents, for validation (default 0.01)\n"
            "  --shard-size N        tokens per shard (default 100000000, below 2^31)\n"
            "  --text-field NAME     JSONL field holding the text (default text)\n"
            "  --eot TEXT            the token starting every document (default: BOS, else EOS)\n"
            "  --threads N           tokenizer threads (default 0 = all CPUs)\n");
}

int tokenize_shards_main(int argc, char** argv) {
    TokenizeShardsArgs a;
    tokenize_shards_defaults(&a);
    const char** inputs = malloc_check((size_t)argc * sizeof(char*));
    int n_inputs = 0;
    for (int i = 1; i < argc; i++) {
        const char* f = argv[i];
        const char* v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t iv;
        if (strcmp(f, "-h") == 0 || strcmp(f, "--help") == 0) {
            usage(stdout);
            free(inputs);
            return 0;
        }
        if (strcmp(f, "--tokenize") == 0) {
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) inputs[n_inputs++] = argv[++i];
            continue;
        }
        if (!v) {
            fprintf(stderr, "train_roundpipe: error: %s: missing value (or unknown flag); see "
                            "--tokenize --help\n", f);
            free(inputs);
            return 2;
        }
        int bad = 0;
        if (strcmp(f, "--tokenizer") == 0) a.tokenizer = v;
        else if (strcmp(f, "--out-shards") == 0) a.out_prefix = v;
        else if (strcmp(f, "--val-frac") == 0) bad = parse_double(v, &a.val_frac);
        else if (strcmp(f, "--shard-size") == 0) bad = parse_int64(v, &a.shard_tokens);
        else if (strcmp(f, "--text-field") == 0) a.text_field = v;
        else if (strcmp(f, "--eot") == 0) a.eot = v;
        else if (strcmp(f, "--threads") == 0) {
            bad = parse_int64(v, &iv) || iv < 0 || iv > 4096;
            a.threads = (int)iv;
        } else {
            fprintf(stderr, "train_roundpipe: error: unknown flag '%s' with --tokenize; see "
                            "--tokenize --help\n", f);
            free(inputs);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "train_roundpipe: error: %s '%s': not a valid value\n", f, v);
            free(inputs);
            return 2;
        }
        i++;
    }
    if (!a.tokenizer || !a.out_prefix || n_inputs == 0) {
        fprintf(stderr, "train_roundpipe: error: --tokenize needs input files, --tokenizer FILE and "
                        "--out-shards PREFIX\n");
        free(inputs);
        return 2;
    }
    a.inputs = inputs;
    a.n_inputs = n_inputs;
    char err[ERR_LEN];
    TokenizeShardsStats st;
    int rc = tokenize_shards_run(&a, NULL, &st, err);
    free(inputs);
    if (rc != 0) {
        fprintf(stderr, "train_roundpipe: error: %s\n", err);
        return 1;
    }
    char size[32];
    format_bytes((double)st.bytes, size, sizeof size);
    printf("%lld documents (%lld val), %lld tokens (%lld val) in %d train + %d val shards; %s in "
           "%.1fs (%.1f MB/s)\n",
           (long long)st.docs, (long long)st.val_docs, (long long)st.tokens,
           (long long)st.val_tokens, st.n_train_shards, st.n_val_shards, size, st.seconds,
           st.seconds > 0 ? (double)st.bytes / st.seconds / 1e6 : 0.0);
    if (st.val_docs == 0 && a.val_frac > 0)
        fprintf(stderr, "warning: the validation split is empty (it takes whole documents: %lld "
                        "document(s) here); split the text into more documents or use JSONL\n",
                (long long)st.docs);
    return 0;
}
