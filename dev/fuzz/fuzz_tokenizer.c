/*
 * fuzz_tokenizer.c — libFuzzer target for the tokenizer: the tokenizer.json loader, then the
 * encoder and decoder on text that follows a NUL byte. Built and run by `make fuzz`; the entry
 * point is shared with the fuzz smoke test of `make test` (fuzz_tokenizer.h).
 */
#include "fuzz_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fuzz_tokenizer(data, size);
    return 0;
}
