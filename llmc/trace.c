/*
 * trace.c — the trace-event buffer and its JSON writer.
 */
#include "trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "json.h"

Trace* trace_create(int n_pids, size_t max_events) {
    Trace* tr = calloc_check(1, sizeof(Trace));
    pthread_check(pthread_mutex_init(&tr->mu, NULL));
    tr->max_events = max_events;
    tr->t_origin = time_now_s();
    tr->n_pids = n_pids;
    tr->pid_names = calloc_check((size_t)n_pids, sizeof *tr->pid_names);
    return tr;
}

void trace_free(Trace* tr) {
    if (!tr) return;
    pthread_check(pthread_mutex_destroy(&tr->mu));
    free(tr->ev);
    free(tr->pid_names);
    free(tr);
}

void trace_name_pid(Trace* tr, int pid, const char* name) {
    if (tr && pid >= 0 && pid < tr->n_pids) str_copy(tr->pid_names[pid], sizeof tr->pid_names[pid], name);
}

void trace_name_tid(Trace* tr, int tid, const char* name) {
    if (!tr || tid < 0 || tid >= 8) return;
    str_copy(tr->tid_names[tid], sizeof tr->tid_names[tid], name);
    if (tid + 1 > tr->n_tids) tr->n_tids = tid + 1;
}

void trace_add(Trace* tr, const char* name, int pid, int tid, double t0, double t1) {
    if (!tr) return;
    pthread_check(pthread_mutex_lock(&tr->mu));
    if (tr->n >= tr->max_events) {
        tr->dropped++;
    } else {
        if (tr->n == tr->cap) {
            tr->cap = tr->cap ? 2 * tr->cap : 4096;
            tr->ev = realloc_check(tr->ev, tr->cap * sizeof(TraceEvent));
        }
        TraceEvent* e = &tr->ev[tr->n++];
        str_copy(e->name, sizeof e->name, name);
        e->pid = pid;
        e->tid = tid;
        e->t0 = t0;
        e->t1 = t1;
    }
    pthread_check(pthread_mutex_unlock(&tr->mu));
}

int trace_write(Trace* tr, const char* path, char* err) {
    AtomicFile af;
    char aerr[ERR_LEN];
    if (atomic_file_open(&af, path, aerr) != 0) return errorf(err, "--trace: %s", aerr);
    FILE* f = af.f;  // fprintf errors are sticky: atomic_file_commit reports them
    pthread_check(pthread_mutex_lock(&tr->mu));
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    int first = 1;
    for (int p = 0; p < tr->n_pids; p++) {
        fprintf(f, "%s{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":",
                first ? "" : ",\n", p);
        json_write_string(f, tr->pid_names[p]);
        fprintf(f, "}}");
        first = 0;
        for (int t = 0; t < tr->n_tids; t++) {
            fprintf(f, ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":", p, t);
            json_write_string(f, tr->tid_names[t]);
            fprintf(f, "}}");
        }
    }
    for (size_t i = 0; i < tr->n; i++) {
        const TraceEvent* e = &tr->ev[i];
        fprintf(f, "%s{\"ph\":\"X\",\"name\":", first ? "" : ",\n");
        json_write_string(f, e->name);
        fprintf(f, ",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}", e->pid, e->tid,
                (e->t0 - tr->t_origin) * 1e6, (e->t1 - e->t0) * 1e6);
        first = 0;
    }
    if (tr->dropped)
        fprintf(f, "%s{\"ph\":\"i\",\"s\":\"g\",\"name\":\"%zu events dropped (limit reached)\","
                   "\"pid\":0,\"tid\":0,\"ts\":0}", first ? "" : ",\n", tr->dropped);
    fprintf(f, "\n]}\n");
    pthread_check(pthread_mutex_unlock(&tr->mu));
    if (atomic_file_commit(&af, aerr) != 0) return errorf(err, "--trace: %s", aerr);
    return 0;
}
