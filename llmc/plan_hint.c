/*
 * plan_hint.c — the smallest --device-mem that fits (see plan_hint.h): a bisection over the
 * budget, in ratios, asking the planner at each point.
 */
#include "plan_hint.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

static int fits(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                double budget) {
    char err[ERR_LEN];
    EngineOptions o = *opt;
    o.device_budget = budget;
    return engine_plan_fits(m, act_bytes, n_devices, &o, err) == 0;
}

double plan_hint_min_device_mem(const Model* m, int act_bytes, int n_devices,
                                const EngineOptions* opt, double max_bytes) {
    const double mib = 1024.0 * 1024.0;
    if (!fits(m, act_bytes, n_devices, opt, max_bytes)) return -1;
    // more budget never loses a plan: bisect between a budget that fails and one that fits
    double lo = mib, hi = max_bytes;
    if (fits(m, act_bytes, n_devices, opt, lo)) return lo;
    while (hi / lo > 1.01) {
        const double mid = sqrt(lo * hi);
        if (fits(m, act_bytes, n_devices, opt, mid)) hi = mid;
        else lo = mid;
    }
    const double rounded = ceil(hi / mib) * mib;
    return fits(m, act_bytes, n_devices, opt, rounded) ? rounded : hi;
}

void plan_hint_format(double bytes, char* buf, size_t cap) {
    const double mib = 1024.0 * 1024.0, gib = 1024.0 * mib;
    // whole GiB from 16G up (a few % more is nothing there), whole MiB below
    if (bytes >= 16 * gib) snprintf(buf, cap, "%.0fG", ceil(bytes / gib));
    else snprintf(buf, cap, "%.0fM", ceil(bytes / mib));
}

void plan_hint_append(char* err, const Model* m, int act_bytes, int n_devices,
                      const EngineOptions* opt) {
    if (opt->device_budget <= 0 || fits(m, act_bytes, n_devices, opt, opt->device_budget)) return;
    const double need = plan_hint_min_device_mem(m, act_bytes, n_devices, opt, 0x1p50);
    if (need <= opt->device_budget) return;
    char v[32];
    plan_hint_format(need, v, sizeof v);
    const size_t used = strlen(err);
    if (used < ERR_LEN)
        snprintf(err + used, ERR_LEN - used, "; the smallest --device-mem that fits is %s", v);
}
