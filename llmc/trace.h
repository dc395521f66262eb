/*
 * trace.h — a Chrome / Perfetto trace-event recorder (JSON "X" complete events): every stage job,
 * transfer and optimizer step, per device ("process") and stream ("thread"). Load the file in
 * ui.perfetto.dev or chrome://tracing. Thread-safe: stream threads and the optimizer add events
 * concurrently.
 */
#ifndef LLMC_TRACE_H
#define LLMC_TRACE_H

#include <pthread.h>
#include <stddef.h>

typedef struct TraceEvent {
    char name[48];
    int pid, tid;
    double t0, t1;  // seconds (time_now_s clock)
} TraceEvent;

typedef struct Trace {
    pthread_mutex_t mu;
    TraceEvent* ev;
    size_t n, cap;
    size_t max_events;  // recording stops (and says so in the file) beyond this many
    size_t dropped;
    double t_origin;
    int n_pids;
    char (*pid_names)[32];   // process names, e.g. "cpu:0", "host"
    char tid_names[8][32];   // thread (stream) names shared by every process
    int n_tids;
} Trace;

Trace* trace_create(int n_pids, size_t max_events);
// Host bytes a trace of max_events events holds at most (while its buffer grows).
size_t trace_max_bytes(size_t max_events);
void trace_free(Trace* tr);
void trace_name_pid(Trace* tr, int pid, const char* name);
void trace_name_tid(Trace* tr, int tid, const char* name);
// A complete event [t0, t1] (seconds from time_now_s). NULL tr: no-op.
void trace_add(Trace* tr, const char* name, int pid, int tid, double t0, double t1);
// Write {"traceEvents": [...]} atomically. -1 + err on failure.
int trace_write(Trace* tr, const char* path, char* err);

#endif  // LLMC_TRACE_H
