/*
 * dataloader.h — llm.c token shards: validation, memory mapping, batching, shuffling, resume.
 *
 * Shard format: a 256 x int32 header (magic, version, token count, zeros), then the tokens:
 * magic 20240520 version 1 = uint16 tokens, magic 20240801 version 7 = uint32 tokens.
 * All shards of one loader must share the token width.
 *
 * A batch is B independent windows of T+1 consecutive tokens: inputs are the first T of each
 * window, targets the last T. Windows never cross a shard boundary; shard s holds
 * floor(ntok_s / (T+1)) windows, the trailing partial window is dropped. Windows are numbered
 * globally in shard order (the glob's sorted order). With shuffle off, window i of the stream
 * starts at token i*(T+1) of its shard, so the first batch is the first B*(T+1) tokens. With
 * shuffle on, each epoch visits every window exactly once in an order drawn from an mt19937
 * seeded by (seed, epoch); a batch may span the end of an epoch (it continues into the next).
 */
#ifndef LLMC_DATALOADER_H
#define LLMC_DATALOADER_H

#include <stddef.h>
#include <stdint.h>

#include "rng.h"

#define SHARD_HEADER_INTS 256
#define SHARD_MAGIC_U16 20240520
#define SHARD_VERSION_U16 1
#define SHARD_MAGIC_U32 20240801
#define SHARD_VERSION_U32 7

typedef struct Shard {
    char* path;
    const uint8_t* map;  // whole file mmap
    size_t map_size;
    int64_t ntok;
    int64_t n_windows;
    int64_t first_window;  // global index of this shard's first window
} Shard;

typedef struct DataLoader {
    int B, T;
    int token_bytes;  // 2 or 4
    int shuffle;
    uint32_t seed;
    int vocab_size;
    int n_shards;
    Shard* shards;
    int64_t n_windows;  // total over all shards
    // position (the resume state)
    int64_t epoch;
    int64_t cursor;     // next position within the epoch's window order, in [0, n_windows)
    uint64_t* order;    // permutation of [0, n_windows) for this epoch (NULL when not shuffling)
} DataLoader;

// Open every shard matching the glob pattern (sorted), validate header, size, token width and a
// sample of token ids (< vocab_size), and require at least B windows in total.
// Returns -1 with a one-line error naming the file (and offset for a bad token).
int dataloader_open(DataLoader* dl, const char* pattern, int B, int T, int shuffle, uint32_t seed,
                    int vocab_size, char* err);
void dataloader_close(DataLoader* dl);
// Fill tokens[B*(T+1)] with the next B windows (row b = window b of the batch).
// Returns -1 with err if a token id >= vocab_size is met (names file and offset).
int dataloader_next_batch(DataLoader* dl, int32_t* tokens, char* err);
// Back to epoch 0, cursor 0 (used for evaluation passes).
void dataloader_reset(DataLoader* dl);
// Number of full batches in one epoch: n_windows / B.
int64_t dataloader_batches_per_epoch(const DataLoader* dl);

// Resume state: a small fixed-size blob (epoch, cursor, seed, shape, shard count and total windows
// as a consistency check). restore() rejects a blob from a different dataset or shape.
#define DATALOADER_STATE_BYTES 64
void dataloader_state_save(const DataLoader* dl, uint8_t state[DATALOADER_STATE_BYTES]);
int dataloader_state_restore(DataLoader* dl, const uint8_t state[DATALOADER_STATE_BYTES], char* err);

// Write a shard file (used by tests and tools). token_bytes 2 or 4; tokens are checked to fit.
int shard_write(const char* path, const uint32_t* tokens, int64_t ntok, int token_bytes, char* err);

#endif  // LLMC_DATALOADER_H
