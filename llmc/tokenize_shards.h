/*
 * tokenize_shards.h — `train_roundpipe --tokenize`: text files and JSONL into llm.c token shards
 * with the C tokenizer, in parallel, without Python (data/tokenize.py does the same with HF
 * transformers).
 *
 * Every input .txt file is one document; every line of a .jsonl file is one (its string field
 * `text_field`). Each document is preceded by the document token (--eot, else the tokenizer's
 * BOS, else its EOS), as llm.c and data/tokenize.py do. Documents are tokenized in batches on a
 * thread pool (large documents in chunks cut after a newline before a letter, where every split
 * regex ends a piece anyway), and written in input order: the output does not depend on the
 * number of threads.
 *
 * The validation split takes whole documents: document i goes to it when that keeps the
 * validation share of tokens at or below val_frac (so val documents are spread evenly through
 * the input). Files: <prefix>_val_000000.bin, _val_000001.bin, ... and <prefix>_train_000001.bin,
 * ... (data/tokenize.py's names), each at most shard_tokens tokens; uint16 tokens when every id
 * fits, else uint32 (llm.c's two shard formats, see dataloader.h). Shards are written to
 * <name>.tmp and renamed.
 */
#ifndef LLMC_TOKENIZE_SHARDS_H
#define LLMC_TOKENIZE_SHARDS_H

#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

typedef struct TokenizeShardsArgs {
    const char* const* inputs;  // .txt (one document) or .jsonl (one document per line)
    int n_inputs;
    const char* tokenizer;      // tokenizer.json, its directory, or a GGUF file
    const char* out_prefix;
    double val_frac;            // [0, 1): share of tokens (whole documents) for validation
    int64_t shard_tokens;       // tokens per shard, [1, 2^31)
    const char* text_field;     // JSONL field
    const char* eot;            // text of the document token ("" = BOS, else EOS)
    int threads;                // 0 = all CPUs
    int progress;               // 1: a progress line on stderr (set when stderr is a TTY)
    int quiet;                  // 1: no "wrote ..." lines
} TokenizeShardsArgs;

typedef struct TokenizeShardsStats {
    int64_t docs, val_docs;
    int64_t tokens, val_tokens;  // document tokens included
    int64_t bytes;               // input text bytes
    int n_train_shards, n_val_shards;
    int token_bytes;             // 2 or 4
    double seconds;
} TokenizeShardsStats;

void tokenize_shards_defaults(TokenizeShardsArgs* a);
// Tokenize with the tokenizer `tok` (or, when tok is NULL, the one a->tokenizer names).
// Returns -1 with a one-line err (naming the file and line) on bad input or a failed write.
int tokenize_shards_run(const TokenizeShardsArgs* a, const Tokenizer* tok, TokenizeShardsStats* st,
                        char* err);

// The command line: 1 if argv has --tokenize (main dispatches here before the training flags).
int tokenize_shards_requested(int argc, char** argv);
// Parse the --tokenize flags and run; returns the process exit status (0, 1 error, 2 usage).
int tokenize_shards_main(int argc, char** argv);

// Tokenize text[0..len) as tokenize_shards does: in chunks of about chunk_bytes on a pool of
// `threads` (0 = all CPUs) when the tokenizer allows safe cuts, else whole. For tests and bench.
void tokenize_parallel(const Tokenizer* tok, const char* text, size_t len, size_t chunk_bytes,
                       int threads, TokIds* out);

#endif  // LLMC_TOKENIZE_SHARDS_H
