/*
 * threads.h — a fixed pool of worker threads running "parallel for" over task indices.
 *
 * threadpool_run(pool, n_tasks, fn, arg) calls fn(arg, i) for every i in [0, n_tasks) and returns
 * when all calls are done. The calling thread takes part. Results are deterministic whatever the
 * number of threads as long as each task's work depends only on its index (never on which thread
 * runs it): callers split work into a fixed number of tasks, not "one task per thread".
 */
#ifndef LLMC_THREADS_H
#define LLMC_THREADS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

typedef void (*TaskFn)(void* arg, int64_t task);

typedef struct ThreadPool {
    int n_threads;  // including the caller
    pthread_t* threads;
    pthread_mutex_t mu;
    pthread_cond_t cv_work;  // workers wait for a new generation of work
    pthread_cond_t cv_done;  // the caller waits for all tasks to finish
    TaskFn fn;
    void* arg;
    int64_t n_tasks;
    _Atomic int64_t next_task;  // next task index to hand out
    int active;                 // workers inside the current generation (under mu)
    uint64_t generation;
    int shutdown;
} ThreadPool;

// n_threads <= 0 means "number of online CPUs".
ThreadPool* threadpool_create(int n_threads);
void threadpool_destroy(ThreadPool* pool);
// Run fn(arg, i) for i in [0, n_tasks). Not re-entrant: one run at a time per pool.
void threadpool_run(ThreadPool* pool, int64_t n_tasks, TaskFn fn, void* arg);
int threads_online_cpus(void);

#endif  // LLMC_THREADS_H
