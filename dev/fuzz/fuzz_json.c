/*
 * fuzz_json.c — libFuzzer target for the JSON parser (config.json, safetensors headers, index files).
 * Built and run by `make fuzz` (clang -fsanitize=fuzzer,address,undefined); the entry point is
 * shared with the fuzz smoke test of `make test` (fuzz_entries.h).
 */
#include "fuzz_entries.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fuzz_json(data, size);
    return 0;
}
