/*
 * profile.cu — the op profile of a CUDA context (--profile-ops): device time per op and shape,
 * measured with a pair of CUDA events around every compute op on the context's stream.
 *
 * Each op wrapper of ops_cuda.cu calls prof_begin / prof_end. Event pairs come from a pool of
 * PROF_POOL; when it is full the oldest results are harvested (the calling thread waits for the
 * last recorded event, so the GPU may run dry for a moment: the per-op times stay exact, the
 * run's total time does not). Ops of one context are issued by one thread at a time (the device's
 * issue thread), so there is no locking. Off (cx->prof == NULL) it costs one branch per op.
 *
 * Phases (ops_cuda_profile_phase; the generator marks its prefill and the parts of a decode
 * step): a pair of events around each call of a phase gives its device span, and the ops issued
 * inside it add up to its op time; span - op time is the device idle inside the phase (launch
 * gaps, host work the stream waited for).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "kernels.h"

#define PROF_POOL 1024     // event pairs in flight before a harvest
#define PROF_MAX_KEYS 256  // distinct op/shape keys (further shapes fold into "other")
#define PROF_KEY_LEN 96
#define PROF_PHASE_POOL 256  // phase event pairs in flight before a harvest
#define PROF_MAX_PHASES 16

typedef struct ProfEntry {
    char key[PROF_KEY_LEN];
    long long calls;
    double ms;
    double flop, bytes;  // per call, as passed (0: not counted)
} ProfEntry;

typedef struct ProfPhase {
    char name[PROF_KEY_LEN];
    long long calls;
    double span_ms, op_ms;  // device span of its calls, and the ops' time inside them
} ProfPhase;

struct OpProfile {
    ProfEntry entries[PROF_MAX_KEYS];
    int n_entries;
    cudaEvent_t ev[PROF_POOL][2];
    int entry_of[PROF_POOL];
    int phase_of[PROF_POOL];  // the phase open when the op began (-1: none)
    int n_pending;
    int open;  // prof_begin without its prof_end yet
    ProfPhase phases[PROF_MAX_PHASES];
    int n_phases;
    int cur_phase;  // -1: none open
    cudaEvent_t phase_ev[PROF_PHASE_POOL][2];
    int phase_entry[PROF_PHASE_POOL];
    int n_phase_pending;  // closed phase calls not yet harvested (an open one is at this index)
};

extern "C" void ops_cuda_profile_enable(void* ctx) {
    CudaCtx* cx = (CudaCtx*)ctx;
    if (cx->prof) return;
    cuda_ctx_enter(cx);
    OpProfile* p = (OpProfile*)calloc_check(1, sizeof(OpProfile));
    for (int i = 0; i < PROF_POOL; i++)
        for (int k = 0; k < 2; k++) cuda_check(cudaEventCreate(&p->ev[i][k]));
    for (int i = 0; i < PROF_PHASE_POOL; i++)
        for (int k = 0; k < 2; k++) cuda_check(cudaEventCreate(&p->phase_ev[i][k]));
    p->cur_phase = -1;
    cx->prof = p;
}

static void prof_harvest(OpProfile* p) {
    if (p->n_pending == 0) return;
    cuda_check(cudaEventSynchronize(p->ev[p->n_pending - 1][1]));
    for (int i = 0; i < p->n_pending; i++) {
        float ms = 0.0f;
        cuda_check(cudaEventElapsedTime(&ms, p->ev[i][0], p->ev[i][1]));
        p->entries[p->entry_of[i]].ms += ms;
        if (p->phase_of[i] >= 0) p->phases[p->phase_of[i]].op_ms += ms;
    }
    p->n_pending = 0;
}

// The closed phase calls' spans (called only while no phase is open).
static void prof_harvest_phases(OpProfile* p) {
    if (p->n_phase_pending == 0) return;
    cuda_check(cudaEventSynchronize(p->phase_ev[p->n_phase_pending - 1][1]));
    for (int i = 0; i < p->n_phase_pending; i++) {
        float ms = 0.0f;
        cuda_check(cudaEventElapsedTime(&ms, p->phase_ev[i][0], p->phase_ev[i][1]));
        p->phases[p->phase_entry[i]].span_ms += ms;
    }
    p->n_phase_pending = 0;
}

// Ends the open phase (if any), then opens `name` (NULL: none).
extern "C" void ops_cuda_profile_phase(void* ctx, const char* name) {
    CudaCtx* cx = (CudaCtx*)ctx;
    OpProfile* p = cx->prof;
    if (!p) return;
    cuda_ctx_enter(cx);
    if (p->cur_phase >= 0) {
        cuda_check(cudaEventRecord(p->phase_ev[p->n_phase_pending][1], cx->stream));
        p->n_phase_pending++;
        p->cur_phase = -1;
    }
    if (!name) return;
    if (p->n_phase_pending == PROF_PHASE_POOL) prof_harvest_phases(p);
    int k = 0;
    while (k < p->n_phases && strcmp(p->phases[k].name, name) != 0) k++;
    if (k == p->n_phases) {
        if (p->n_phases == PROF_MAX_PHASES) return;  // (more phases than any caller marks)
        snprintf(p->phases[p->n_phases++].name, PROF_KEY_LEN, "%s", name);
    }
    p->phases[k].calls++;
    p->phase_entry[p->n_phase_pending] = k;
    cuda_check(cudaEventRecord(p->phase_ev[p->n_phase_pending][0], cx->stream));
    p->cur_phase = k;
}

static int prof_find(const OpProfile* p, const char* key) {
    for (int i = 0; i < p->n_entries; i++)
        if (strcmp(p->entries[i].key, key) == 0) return i;
    return -1;
}

// The entry of a key; once all but one are taken, new keys share the last ("other shapes", whose
// calls differ in work, so it gets no rates).
static int prof_entry(OpProfile* p, const char* key, double flop, double bytes) {
    int i = prof_find(p, key);
    if (i >= 0) return i;
    if (p->n_entries >= PROF_MAX_KEYS - 1) {
        key = "other shapes";
        flop = bytes = 0;
        if ((i = prof_find(p, key)) >= 0) return i;
    }
    i = p->n_entries++;
    snprintf(p->entries[i].key, PROF_KEY_LEN, "%s", key);
    p->entries[i].flop = flop;
    p->entries[i].bytes = bytes;
    return i;
}

void prof_begin(CudaCtx* cx, double flop, double bytes, const char* fmt, ...) {
    OpProfile* p = cx->prof;
    if (!p) return;
    if (p->open) fatal("op profile: %s begins inside another op", fmt);
    if (p->n_pending == PROF_POOL) prof_harvest(p);
    char key[PROF_KEY_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(key, sizeof key, fmt, ap);
    va_end(ap);
    const int e = prof_entry(p, key, flop, bytes);
    p->entries[e].calls++;
    p->entry_of[p->n_pending] = e;
    p->phase_of[p->n_pending] = p->cur_phase;
    cuda_check(cudaEventRecord(p->ev[p->n_pending][0], cx->stream));
    p->open = 1;
}

void prof_end(CudaCtx* cx) {
    OpProfile* p = cx->prof;
    if (!p) return;
    cuda_check(cudaEventRecord(p->ev[p->n_pending][1], cx->stream));
    p->n_pending++;
    p->open = 0;
}

static int prof_by_time(const void* a, const void* b) {
    const double x = ((const ProfEntry*)a)->ms, y = ((const ProfEntry*)b)->ms;
    return x < y ? 1 : x > y ? -1 : 0;
}

extern "C" void ops_cuda_profile_report(void* ctx, FILE* f) {
    CudaCtx* cx = (CudaCtx*)ctx;
    OpProfile* p = cx->prof;
    if (!p) return;
    cuda_ctx_enter(cx);
    prof_harvest(p);
    ops_cuda_profile_phase(ctx, NULL);
    prof_harvest_phases(p);
    ProfEntry* sorted = (ProfEntry*)malloc_check((size_t)(p->n_entries ? p->n_entries : 1) *
                                                 sizeof(ProfEntry));
    memcpy(sorted, p->entries, (size_t)p->n_entries * sizeof(ProfEntry));
    qsort(sorted, (size_t)p->n_entries, sizeof(ProfEntry), prof_by_time);
    double total = 0.0;
    for (int i = 0; i < p->n_entries; i++) total += sorted[i].ms;
    fprintf(f, "op profile of cuda:%d: %.1f ms of device time in ops\n", cx->device + 1, total);
    fprintf(f, "  share      total ms     calls   us/call  TFLOP/s     GB/s  op\n");
    for (int i = 0; i < p->n_entries; i++) {
        const ProfEntry* e = &sorted[i];
        const double s = e->ms * 1e-3;
        char tf[16] = "-", gb[16] = "-";
        if (e->flop > 0 && s > 0) snprintf(tf, sizeof tf, "%.1f", e->flop * e->calls / s / 1e12);
        if (e->bytes > 0 && s > 0) snprintf(gb, sizeof gb, "%.0f", e->bytes * e->calls / s / 1e9);
        fprintf(f, "  %5.1f%%  %12.1f  %8lld  %8.1f  %7s  %7s  %s\n",
                total > 0 ? 100.0 * e->ms / total : 0.0, e->ms, e->calls,
                e->calls ? 1e3 * e->ms / (double)e->calls : 0.0, tf, gb, e->key);
    }
    // the same per op (the key up to its first shape field)
    ProfEntry* ops = (ProfEntry*)calloc_check((size_t)(p->n_entries ? p->n_entries : 1),
                                              sizeof(ProfEntry));
    int n_ops = 0;
    for (int i = 0; i < p->n_entries; i++) {
        char name[PROF_KEY_LEN];
        snprintf(name, sizeof name, "%s", sorted[i].key);
        char* eq = strchr(name, '=');
        if (eq) {
            *eq = 0;
            char* sp = strrchr(name, ' ');
            if (sp) *sp = 0;
        }
        int k = 0;
        while (k < n_ops && strcmp(ops[k].key, name) != 0) k++;
        if (k == n_ops) snprintf(ops[n_ops++].key, PROF_KEY_LEN, "%s", name);
        ops[k].ms += sorted[i].ms;
        ops[k].calls += sorted[i].calls;
        ops[k].flop += sorted[i].flop * (double)sorted[i].calls;  // totals here
        ops[k].bytes += sorted[i].bytes * (double)sorted[i].calls;
    }
    qsort(ops, (size_t)n_ops, sizeof(ProfEntry), prof_by_time);
    fprintf(f, "  per op:\n");
    for (int k = 0; k < n_ops; k++) {
        const double s = ops[k].ms * 1e-3;
        char tf[16] = "-", gb[16] = "-";
        if (ops[k].flop > 0 && s > 0) snprintf(tf, sizeof tf, "%.1f", ops[k].flop / s / 1e12);
        if (ops[k].bytes > 0 && s > 0) snprintf(gb, sizeof gb, "%.0f", ops[k].bytes / s / 1e9);
        fprintf(f, "  %5.1f%%  %12.1f  %8lld  %8.1f  %7s  %7s  %s\n",
                total > 0 ? 100.0 * ops[k].ms / total : 0.0, ops[k].ms, ops[k].calls,
                ops[k].calls ? 1e3 * ops[k].ms / (double)ops[k].calls : 0.0, tf, gb, ops[k].key);
    }
    if (p->n_phases > 0)
        fprintf(f, "  phases (device span of each call, the ops' time inside it, the gaps: the "
                "device idle between them):\n"
                "     calls   span ms    ops ms   gaps ms   us/call  phase\n");
    for (int k = 0; k < p->n_phases; k++) {
        const ProfPhase* ph = &p->phases[k];
        fprintf(f, "  %8lld  %8.1f  %8.1f  %8.1f  %8.1f  %s\n", ph->calls, ph->span_ms, ph->op_ms,
                ph->span_ms - ph->op_ms, ph->calls ? 1e3 * ph->span_ms / (double)ph->calls : 0.0,
                ph->name);
    }
    free(ops);
    free(sorted);
}

void prof_destroy(CudaCtx* cx) {
    OpProfile* p = cx->prof;
    if (!p) return;
    for (int i = 0; i < PROF_POOL; i++)
        for (int k = 0; k < 2; k++) cuda_check(cudaEventDestroy(p->ev[i][k]));
    for (int i = 0; i < PROF_PHASE_POOL; i++)
        for (int k = 0; k < 2; k++) cuda_check(cudaEventDestroy(p->phase_ev[i][k]));
    free(p);
    cx->prof = NULL;
}
