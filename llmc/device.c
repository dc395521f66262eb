/*
 * device.c — the backend-independent part of device.h: stream names and opening/closing a set of
 * N devices of one implementation (device_cpu.c, device_cuda.c).
 *
 * Invariant: an open DeviceSet has n >= 1 and dev[0..n) all non-NULL; a closed one is all zero,
 * so closing twice is harmless.
 */
#include "device.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// names

// Indexed by StreamKind; used in logs, traces and error messages.
const char* const stream_names[STREAM_COUNT] = {
    [STREAM_COMPUTE] = "compute",
    [STREAM_ACT_UP] = "act_up",
    [STREAM_ACT_DOWN] = "act_down",
    [STREAM_PARAM_UP] = "param_up",
    [STREAM_GRAD_DOWN] = "grad_down",
};

// ----------------------------------------------------------------------------
// device sets

void device_set_open(DeviceSet* set, const DeviceImpl* impl, int n, const DeviceOptions* opt) {
    if (impl == NULL) fatal("device set: no device implementation given");
    if (n < 1) fatal("device set: need at least 1 %s device, got %d", impl->name, n);
    // A NULL opt means "all defaults" (zero fields), so callers that do not care need no struct.
    DeviceOptions defaults;
    memset(&defaults, 0, sizeof defaults);
    if (opt == NULL) opt = &defaults;

    memset(set, 0, sizeof *set);
    set->impl = impl;
    set->dev = calloc_check((size_t)n, sizeof(Device*));
    for (int i = 0; i < n; i++) {
        set->dev[i] = impl->open(i, opt);
        // Backends normally fail inside open with their own message; this catches a silent NULL.
        if (set->dev[i] == NULL) fatal("cannot open device %s:%d of %d", impl->name, i, n);
        set->n = i + 1;  // only opened devices are closed if a later open exits the process
    }
}

void device_set_close(DeviceSet* set) {
    if (set == NULL || set->dev == NULL) return;
    // Every device idle first (work on one device may wait on another's events), then close in
    // reverse order of opening.
    for (int i = 0; i < set->n; i++) set->impl->synchronize(set->dev[i]);
    for (int i = set->n - 1; i >= 0; i--) set->impl->close(set->dev[i]);
    free(set->dev);
    memset(set, 0, sizeof *set);
}
