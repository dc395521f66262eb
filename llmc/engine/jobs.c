/*
 * jobs.c — the bookkeeping under every other engine file: the micro-batch closures (MbJob) that
 * live until their iteration parity's device work is done, and the trace labels of the work items
 * queued on the streams. Touches only e->arena[ip] and e->labels[ip] (and the device's label
 * hook); no events, no protocol flags. dispatch.c and transfer.c allocate from it; engine.c frees
 * a parity once its iteration is collected.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

// ----------------------------------------------------------------------------
// arena of closures

MbJob* jobs_new(Engine* e, int ip) {
    JobBlock* blk = e->arena[ip];
    if (!blk || blk->used == (int)(sizeof blk->jobs / sizeof blk->jobs[0])) {
        JobBlock* nb = calloc_check(1, sizeof(JobBlock));
        nb->next = blk;
        e->arena[ip] = nb;
        blk = nb;
    }
    return &blk->jobs[blk->used++];
}

static void arena_free(JobBlock* b) {
    while (b) {
        JobBlock* n = b->next;
        free(b);
        b = n;
    }
}

static void labels_free(LabelBlock* b) {
    while (b) {
        LabelBlock* n = b->next;
        free(b);
        b = n;
    }
}

// The closures and labels of iteration parity ip (its device work must be done).
void jobs_free(Engine* e, int ip) {
    arena_free(e->arena[ip]);
    e->arena[ip] = NULL;
    labels_free(e->labels[ip]);
    e->labels[ip] = NULL;
}

// Name the next work item queued on stream s of a device (only when tracing).
void jobs_label(Engine* e, int ip, DevState* ds, StreamKind s, const char* fmt, ...) {
    if (!e->trace) return;
    LabelBlock* blk = e->labels[ip];
    if (!blk || blk->used == (int)(sizeof blk->names / sizeof blk->names[0])) {
        LabelBlock* nb = calloc_check(1, sizeof(LabelBlock));
        nb->next = blk;
        e->labels[ip] = nb;
        blk = nb;
    }
    char* name = blk->names[blk->used++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof blk->names[0], fmt, ap);
    va_end(ap);
    e->impl->label(ds->d, s, name);
}
