/*
 * dataloader.c — llm.c token shards: open and validate, map, cut into windows, batch, shuffle,
 * save/restore the position.
 *
 * Every shard is mmap'd read-only for the life of the loader; batches copy tokens out of the maps,
 * so the page cache does the buffering. All offsets are 64-bit (llm.c's int fseek offsets break
 * on shards over 2 GiB).
 *
 * Invariants:
 *  - windows are numbered globally in shard order; shard s owns [first_window, first_window +
 *    n_windows) and window w of shard s starts at token (w - first_window) * (T+1) of that shard;
 *  - the position is (epoch, cursor) with 0 <= cursor < n_windows; `order` always holds the
 *    permutation of the current epoch when shuffling, so (epoch, cursor) alone is the resume state;
 *  - the permutation of epoch e depends only on (seed, e): restoring rebuilds it exactly.
 */
#include "dataloader.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"

#define SHARD_HEADER_BYTES (SHARD_HEADER_INTS * 4)
// Token-id check at open: shards up to this many tokens are checked entirely; larger ones on their
// first SAMPLE_HEAD tokens plus SAMPLE_SPREAD evenly spaced positions. A denser spread would fault
// in (with readahead) every page of a 100M-token shard and make start-up read the whole dataset;
// every batch is checked again in dataloader_next_batch anyway.
#define SAMPLE_FULL_MAX (4 * 1024 * 1024)
#define SAMPLE_HEAD (1024 * 1024)
#define SAMPLE_SPREAD 4096

#define STATE_MAGIC 0x534c4c44u  // "DLLS" little-endian
#define STATE_VERSION 1u

// ----------------------------------------------------------------------------
// little-endian helpers (the shard format and the state blob are LE whatever the host)

static uint32_t le_get_u32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t le_get_u64(const uint8_t* p) {
    return (uint64_t)le_get_u32(p) | ((uint64_t)le_get_u32(p + 4) << 32);
}

static void le_put_u32(uint8_t* p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static void le_put_u64(uint8_t* p, uint64_t v) {
    le_put_u32(p, (uint32_t)v);
    le_put_u32(p + 4, (uint32_t)(v >> 32));
}

// Token i of a shard (i < ntok, checked by the caller).
static uint32_t shard_token(const Shard* s, int token_bytes, int64_t i) {
    const uint8_t* p = s->map + SHARD_HEADER_BYTES + (size_t)i * (size_t)token_bytes;
    if (token_bytes == 2) return (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    return le_get_u32(p);
}

static const char* width_name(int token_bytes) { return token_bytes == 2 ? "uint16" : "uint32"; }

// ----------------------------------------------------------------------------
// opening one shard

// Map one shard and validate its header and size. Sets *token_bytes from the magic.
// On failure nothing stays mapped.
static int shard_map(Shard* s, const char* path, int* token_bytes, char* err) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return errorf(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return errorf(err, "%s: cannot stat: %s", path, strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return errorf(err, "%s: not a regular file", path);
    }
    if (st.st_size < SHARD_HEADER_BYTES) {
        close(fd);
        return errorf(err, "%s: file is %lld bytes, smaller than the %d-byte shard header", path,
                      (long long)st.st_size, SHARD_HEADER_BYTES);
    }
    void* map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);  // the mapping keeps the file alive
    if (map == MAP_FAILED) return errorf(err, "%s: cannot mmap: %s", path, strerror(map_errno));
    s->map = map;
    s->map_size = (size_t)st.st_size;

    uint32_t magic = le_get_u32(s->map), version = le_get_u32(s->map + 4);
    int32_t ntok = (int32_t)le_get_u32(s->map + 8);
    int tb = 0;
    if (magic == SHARD_MAGIC_U16 && version == SHARD_VERSION_U16) tb = 2;
    else if (magic == SHARD_MAGIC_U32 && version == SHARD_VERSION_U32) tb = 4;
    int rc = 0;
    if (tb == 0) {
        rc = errorf(err,
                    "%s: header magic %u version %u is not a token shard; accepted: magic %d "
                    "version %d (uint16 tokens) or magic %d version %d (uint32 tokens)",
                    path, magic, version, SHARD_MAGIC_U16, SHARD_VERSION_U16, SHARD_MAGIC_U32,
                    SHARD_VERSION_U32);
    } else if (ntok < 0) {
        rc = errorf(err, "%s: header token count %d is negative", path, ntok);
    } else {
        int64_t expected = SHARD_HEADER_BYTES + (int64_t)ntok * tb;  // ntok < 2^31: no overflow
        if ((int64_t)st.st_size != expected)
            rc = errorf(err,
                        "%s: file is %lld bytes, expected %lld (%d-byte header + %d %s tokens)",
                        path, (long long)st.st_size, (long long)expected, SHARD_HEADER_BYTES, ntok,
                        width_name(tb));
    }
    if (rc != 0) {
        munmap((void*)s->map, s->map_size);
        s->map = NULL;
        s->map_size = 0;
        return rc;
    }
    s->ntok = ntok;
    *token_bytes = tb;
    return 0;
}

// Check token ids < vocab_size: all of a small shard, head + evenly spaced sample of a large one.
// Positions are visited in increasing order so the first bad one found is the first reported.
static int shard_check_tokens(const Shard* s, int token_bytes, int vocab_size, char* err) {
    int64_t head = s->ntok <= SAMPLE_FULL_MAX ? s->ntok : SAMPLE_HEAD;
    for (int64_t i = 0; i < head; i++) {
        uint32_t tok = shard_token(s, token_bytes, i);
        if (tok >= (uint32_t)vocab_size)
            return errorf(err, "%s: token %u at index %lld >= vocab size %d", s->path, tok,
                          (long long)i, vocab_size);
    }
    if (head == s->ntok) return 0;
    for (int64_t k = 0; k < SAMPLE_SPREAD; k++) {
        int64_t i = head + (s->ntok - 1 - head) * k / (SAMPLE_SPREAD - 1);  // < 2^31 * 2^12
        uint32_t tok = shard_token(s, token_bytes, i);
        if (tok >= (uint32_t)vocab_size)
            return errorf(err, "%s: token %u at index %lld >= vocab size %d", s->path, tok,
                          (long long)i, vocab_size);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// epoch order

// Build the window order of dl->epoch (only when shuffling). Depends on (seed, epoch) only.
static void dataloader_build_order(DataLoader* dl) {
    if (!dl->shuffle) return;
    Rng rng;
    rng_seed(&rng, dl->seed ^ (0x9e3779b9u * (uint32_t)(dl->epoch + 1)));
    for (int64_t i = 0; i < dl->n_windows; i++) dl->order[i] = (uint64_t)i;
    rng_shuffle_u64(&rng, dl->order, (uint64_t)dl->n_windows);
}

// Shard owning global window w: the last shard whose first_window <= w (shards without windows
// share first_window with their successor, so the last such shard is the one with windows).
static const Shard* dataloader_find_shard(const DataLoader* dl, int64_t w) {
    int lo = 0, hi = dl->n_shards - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (dl->shards[mid].first_window <= w) lo = mid;
        else hi = mid - 1;
    }
    return &dl->shards[lo];
}

// ----------------------------------------------------------------------------
// open / close

int dataloader_open(DataLoader* dl, const char* pattern, int B, int T, int shuffle, uint32_t seed,
                    int vocab_size, char* err) {
    memset(dl, 0, sizeof *dl);
    if (B < 1 || T < 1 || T == INT_MAX || vocab_size < 1)
        return errorf(err, "%s: invalid loader shape B=%d T=%d vocab size %d", pattern, B, T,
                      vocab_size);
    size_t batch_tokens;
    if (size_mul((size_t)B, (size_t)T + 1, &batch_tokens) != 0 || batch_tokens > (size_t)INT_MAX)
        return errorf(err, "%s: batch of B=%d windows of T+1=%lld tokens is too large", pattern,
                      B, (long long)T + 1);
    dl->B = B;
    dl->T = T;
    dl->shuffle = shuffle ? 1 : 0;
    dl->seed = seed;
    dl->vocab_size = vocab_size;

    glob_t g;
    int grc = glob(pattern, 0, NULL, &g);  // sorted unless GLOB_NOSORT
    if (grc == GLOB_NOMATCH) {
        globfree(&g);
        return errorf(err, "no shard matches '%s'", pattern);
    }
    if (grc != 0) {
        globfree(&g);
        return errorf(err, "%s: glob failed (%s)", pattern,
                      grc == GLOB_ABORTED ? "read error" : "out of memory");
    }
    if (g.gl_pathc > (size_t)INT_MAX) {
        globfree(&g);
        return errorf(err, "%s: too many shards (%zu)", pattern, g.gl_pathc);
    }

    dl->shards = calloc_check(g.gl_pathc, sizeof(Shard));
    int64_t total_tokens = 0;
    for (size_t i = 0; i < g.gl_pathc; i++) {
        Shard* s = &dl->shards[i];
        const char* path = g.gl_pathv[i];
        s->path = malloc_check(strlen(path) + 1);
        memcpy(s->path, path, strlen(path) + 1);
        dl->n_shards = (int)i + 1;  // close() releases this one too from here on
        int tb = 0;
        if (shard_map(s, path, &tb, err) != 0) goto fail;
        if (dl->token_bytes == 0) {
            dl->token_bytes = tb;
        } else if (tb != dl->token_bytes) {
            errorf(err, "%s: %s tokens but %s has %s tokens; all shards must share the token width",
                   path, width_name(tb), dl->shards[0].path, width_name(dl->token_bytes));
            goto fail;
        }
        if (shard_check_tokens(s, tb, vocab_size, err) != 0) goto fail;
        s->n_windows = s->ntok / ((int64_t)T + 1);
        s->first_window = dl->n_windows;
        dl->n_windows += s->n_windows;
        total_tokens += s->ntok;
    }
    globfree(&g);

    if (dl->n_windows < B) {
        errorf(err, "%s: %lld tokens give only %lld windows of T+1=%d tokens; need at least %d "
                    "(batch)",
               pattern, (long long)total_tokens, (long long)dl->n_windows, T + 1, B);
        dataloader_close(dl);
        return -1;
    }
    if (dl->shuffle) {
        size_t bytes;
        if (size_mul((size_t)dl->n_windows, sizeof(uint64_t), &bytes) != 0) {
            errorf(err, "%s: %lld windows are too many to shuffle", pattern,
                   (long long)dl->n_windows);
            dataloader_close(dl);
            return -1;
        }
        dl->order = malloc_check(bytes);
    }
    dataloader_build_order(dl);
    return 0;

fail:
    globfree(&g);
    dataloader_close(dl);
    return -1;
}

void dataloader_close(DataLoader* dl) {
    for (int i = 0; i < dl->n_shards; i++) {
        if (dl->shards[i].map) munmap((void*)dl->shards[i].map, dl->shards[i].map_size);
        free(dl->shards[i].path);
    }
    free(dl->shards);
    free(dl->order);
    memset(dl, 0, sizeof *dl);
}

// ----------------------------------------------------------------------------
// batches

int dataloader_next_batch(DataLoader* dl, int32_t* tokens, char* err) {
    const int64_t W = (int64_t)dl->T + 1;
    for (int b = 0; b < dl->B; b++) {
        int64_t w = dl->shuffle ? (int64_t)dl->order[dl->cursor] : dl->cursor;
        const Shard* s = dataloader_find_shard(dl, w);
        int64_t start = (w - s->first_window) * W;
        int32_t* row = tokens + (size_t)b * (size_t)W;
        for (int64_t j = 0; j < W; j++) {
            uint32_t tok = shard_token(s, dl->token_bytes, start + j);
            // the open-time check only sampled large shards; this one is exhaustive and cheap.
            // On failure the position has advanced: the caller is expected to stop.
            if (tok >= (uint32_t)dl->vocab_size)
                return errorf(err, "%s: token %u at index %lld >= vocab size %d", s->path, tok,
                              (long long)(start + j), dl->vocab_size);
            row[j] = (int32_t)tok;
        }
        // advance eagerly so that cursor < n_windows always holds and the saved state of a
        // finished epoch already names the next one
        if (++dl->cursor == dl->n_windows) {
            dl->cursor = 0;
            dl->epoch++;
            dataloader_build_order(dl);
        }
    }
    return 0;
}

void dataloader_reset(DataLoader* dl) {
    int rebuild = dl->epoch != 0;
    dl->epoch = 0;
    dl->cursor = 0;
    if (rebuild) dataloader_build_order(dl);
}

int64_t dataloader_batches_per_epoch(const DataLoader* dl) { return dl->n_windows / dl->B; }

// ----------------------------------------------------------------------------
// resume state
//
// Blob layout (little-endian):
//   0 magic u32 | 4 version u32 | 8 epoch i64 | 16 cursor i64 | 24 n_windows i64 | 32 seed u32 |
//   36 B i32 | 40 T i32 | 44 shuffle i32 | 48 n_shards i32 | 52 token_bytes i32 | 56..63 zero

void dataloader_state_save(const DataLoader* dl, uint8_t state[DATALOADER_STATE_BYTES]) {
    memset(state, 0, DATALOADER_STATE_BYTES);
    le_put_u32(state + 0, STATE_MAGIC);
    le_put_u32(state + 4, STATE_VERSION);
    le_put_u64(state + 8, (uint64_t)dl->epoch);
    le_put_u64(state + 16, (uint64_t)dl->cursor);
    le_put_u64(state + 24, (uint64_t)dl->n_windows);
    le_put_u32(state + 32, dl->seed);
    le_put_u32(state + 36, (uint32_t)dl->B);
    le_put_u32(state + 40, (uint32_t)dl->T);
    le_put_u32(state + 44, (uint32_t)dl->shuffle);
    le_put_u32(state + 48, (uint32_t)dl->n_shards);
    le_put_u32(state + 52, (uint32_t)dl->token_bytes);
}

// Compare one field of the blob with the loader; names the field on mismatch.
static int state_check_field(const char* field, int64_t saved, int64_t now, char* err) {
    if (saved == now) return 0;
    return errorf(err, "dataloader state: %s is %lld in the saved state but %lld in this run",
                  field, (long long)saved, (long long)now);
}

int dataloader_state_restore(DataLoader* dl, const uint8_t state[DATALOADER_STATE_BYTES],
                             char* err) {
    uint32_t magic = le_get_u32(state), version = le_get_u32(state + 4);
    if (magic != STATE_MAGIC)
        return errorf(err, "dataloader state: bad magic 0x%08x (expected 0x%08x)", magic,
                      STATE_MAGIC);
    if (version != STATE_VERSION)
        return errorf(err, "dataloader state: version %u, this build reads version %u", version,
                      STATE_VERSION);
    for (int i = 56; i < DATALOADER_STATE_BYTES; i++)
        if (state[i] != 0) return errorf(err, "dataloader state: reserved byte %d is not zero", i);
    int64_t epoch = (int64_t)le_get_u64(state + 8);
    int64_t cursor = (int64_t)le_get_u64(state + 16);
    int64_t n_windows = (int64_t)le_get_u64(state + 24);
    uint32_t seed = le_get_u32(state + 32);
    int32_t B = (int32_t)le_get_u32(state + 36), T = (int32_t)le_get_u32(state + 40);
    int32_t shuffle = (int32_t)le_get_u32(state + 44), n_shards = (int32_t)le_get_u32(state + 48);
    int32_t token_bytes = (int32_t)le_get_u32(state + 52);
    // every check happens before the loader is touched: a rejected blob leaves it as it was
    if (state_check_field("batch size B", B, dl->B, err) != 0) return -1;
    if (state_check_field("sequence length T", T, dl->T, err) != 0) return -1;
    if (state_check_field("shuffle", shuffle, dl->shuffle, err) != 0) return -1;
    // without shuffling the seed has no effect on the order, so a different one is harmless
    if (dl->shuffle && state_check_field("seed", seed, dl->seed, err) != 0) return -1;
    if (state_check_field("shard count", n_shards, dl->n_shards, err) != 0) return -1;
    if (state_check_field("token width (bytes)", token_bytes, dl->token_bytes, err) != 0) return -1;
    if (state_check_field("window count", n_windows, dl->n_windows, err) != 0) return -1;
    if (epoch < 0) return errorf(err, "dataloader state: epoch %lld is negative", (long long)epoch);
    if (cursor < 0 || cursor >= dl->n_windows)
        return errorf(err, "dataloader state: cursor %lld outside [0, %lld)", (long long)cursor,
                      (long long)dl->n_windows);
    dl->epoch = epoch;
    dl->cursor = cursor;
    dataloader_build_order(dl);
    return 0;
}

// ----------------------------------------------------------------------------
// writing shards

int shard_write(const char* path, const uint32_t* tokens, int64_t ntok, int token_bytes,
                char* err) {
    if (token_bytes != 2 && token_bytes != 4)
        return errorf(err, "%s: token width %d bytes is not 2 or 4", path, token_bytes);
    if (ntok < 0 || ntok > INT32_MAX)
        return errorf(err, "%s: token count %lld outside [0, 2^31)", path, (long long)ntok);
    if (token_bytes == 2) {
        for (int64_t i = 0; i < ntok; i++)
            if (tokens[i] > 0xffffu)
                return errorf(err,
                              "%s: token %u at index %lld does not fit in uint16 (write 4-byte "
                              "tokens, magic %d)",
                              path, tokens[i], (long long)i, SHARD_MAGIC_U32);
    }

    AtomicFile af;
    if (atomic_file_open(&af, path, err) != 0) return -1;
    uint8_t header[SHARD_HEADER_BYTES] = {0};
    le_put_u32(header + 0, token_bytes == 2 ? SHARD_MAGIC_U16 : SHARD_MAGIC_U32);
    le_put_u32(header + 4, token_bytes == 2 ? SHARD_VERSION_U16 : SHARD_VERSION_U32);
    le_put_u32(header + 8, (uint32_t)ntok);
    int rc = atomic_file_write(&af, header, sizeof header, err);
    // tokens go out through a fixed chunk so a big shard never needs a second full-size buffer
    enum { CHUNK = 16384 };
    uint8_t buf[CHUNK * 4];
    for (int64_t i = 0; rc == 0 && i < ntok; i += CHUNK) {
        int64_t n = ntok - i < CHUNK ? ntok - i : CHUNK;
        for (int64_t j = 0; j < n; j++) {
            uint32_t v = tokens[i + j];
            if (token_bytes == 2) {
                buf[2 * j] = (uint8_t)v;
                buf[2 * j + 1] = (uint8_t)(v >> 8);
            } else {
                le_put_u32(buf + 4 * j, v);
            }
        }
        rc = atomic_file_write(&af, buf, (size_t)n * (size_t)token_bytes, err);
    }
    if (rc != 0) {
        atomic_file_abort(&af);
        return -1;
    }
    return atomic_file_commit(&af, err);
}
