/*
 * plan_hint.h — the number to put in an error about the device memory budget: the smallest
 * --device-mem with which the engine finds a plan for a run, found by asking the planner
 * (engine_plan_fits) itself, so it can never disagree with it. Used when a budget is too small
 * for even one layer, its scratch and its hand-offs ("the smallest --device-mem that fits is
 * 9M"). It only reads the planner; it plans nothing itself.
 */
#ifndef LLMC_PLAN_HINT_H
#define LLMC_PLAN_HINT_H

#include <stddef.h>

#include "engine.h"
#include "model.h"

// The smallest device budget in bytes (within 1%, rounded up to whole MiB) with which
// engine_plan_fits finds a plan for opt (its other settings unchanged), or -1 when not even
// max_bytes is enough. act_bytes, n_devices: as engine_plan_fits takes them.
double plan_hint_min_device_mem(const Model* m, int act_bytes, int n_devices,
                                const EngineOptions* opt, double max_bytes);
// A budget as a --device-mem value, rounded up: "9M", "1536M", "14G".
void plan_hint_format(double bytes, char* buf, size_t cap);
// After a failed engine_create or engine_plan_print with opt: when opt's budget is too small for
// any plan, append "; the smallest --device-mem that fits is 9M" to err (ERR_LEN bytes).
void plan_hint_append(char* err, const Model* m, int act_bytes, int n_devices,
                      const EngineOptions* opt);

#endif  // LLMC_PLAN_HINT_H
