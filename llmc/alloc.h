/*
 * alloc.h — host allocations that name what they hold. When one fails, the user reads what the
 * memory was for and how much ("out of host memory: 1.50 GiB for the optimizer's tensor table")
 * instead of a source line; common.h's malloc_check family reports a file:line. New callers
 * whose allocation can be large or user-sized use these.
 */
#ifndef LLMC_ALLOC_H
#define LLMC_ALLOC_H

#include <stddef.h>

// malloc / calloc(n, size) that exit(1) with "out of host memory: <size> for <what>" and the
// memory the machine has available. what: a phrase ("the token batch", "layer 3's gradients").
void* malloc_named(size_t size, const char* what);
void* calloc_named(size_t n, size_t size, const char* what);

#endif  // LLMC_ALLOC_H
