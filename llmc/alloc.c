/*
 * alloc.c — named host allocations (see alloc.h).
 */
#include "alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

// MemAvailable of /proc/meminfo in bytes, or -1.
static double mem_available(void) {
    FILE* f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    double kib = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "MemAvailable:", 13) == 0) {
            kib = atof(line + 13);
            break;
        }
    fclose(f);
    return kib < 0 ? -1 : kib * 1024.0;
}

static void out_of_memory(double bytes, const char* what) {
    char need[32], avail[32];
    format_bytes(bytes, need, sizeof need);
    const double av = mem_available();
    if (av >= 0) {
        format_bytes(av, avail, sizeof avail);
        fatal("out of host memory: %s for %s (the machine has %s available)", need, what, avail);
    }
    fatal("out of host memory: %s for %s", need, what);
}

void* malloc_named(size_t size, const char* what) {
    void* p = malloc(size ? size : 1);
    if (!p) out_of_memory((double)size, what);
    return p;
}

void* calloc_named(size_t n, size_t size, const char* what) {
    void* p = calloc(n ? n : 1, size ? size : 1);
    if (!p) out_of_memory((double)n * (double)size, what);
    return p;
}
