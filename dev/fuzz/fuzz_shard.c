/*
 * fuzz_shard.c — libFuzzer target for the llm.c token-shard reader (header, size, token ids, batching, resume state).
 * Built and run by `make fuzz` (clang -fsanitize=fuzzer,address,undefined); the entry point is
 * shared with the fuzz smoke test of `make test` (fuzz_entries.h).
 */
#include "fuzz_entries.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fuzz_shard(data, size);
    return 0;
}
