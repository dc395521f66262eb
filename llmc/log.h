/*
 * log.h — the per-step console line and the --log JSON-lines file (one object per step and one
 * per evaluation). Numbers are written with enough digits to round-trip.
 */
#ifndef LLMC_LOG_H
#define LLMC_LOG_H

#include <stdio.h>

typedef struct StepLog {
    FILE* f;  // NULL when no --log file
    const char* path;
} StepLog;

typedef struct StepStats {
    int step, steps;
    double loss;
    double norm;
    double lr;
    double ms;
    double tok_s;
    double mfu;     // < 0 when not measured (CPU)
    double bubble;  // fraction of device compute time idle (< 0: not pipelined)
    double host_mib, dev_mib;  // memory in use (< 0: not reported)
} StepStats;

// Resident host memory of this process in MiB (from /proc/self/status; -1 if unavailable).
double log_host_rss_mib(void);

// Open the log file, truncated, or appended to when `append` (a resumed run continues its log);
// "" means no file. -1 + err on failure.
int log_open(StepLog* lg, const char* path, int append, char* err);
void log_close(StepLog* lg);
void log_step(StepLog* lg, const StepStats* s);
void log_eval(StepLog* lg, int step, double val_loss);

#endif  // LLMC_LOG_H
