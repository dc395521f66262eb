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
    int* cpus;  // workers run on these CPUs only (NULL: anywhere)
    int n_cpus;
} ThreadPool;

// n_threads <= 0 means "number of online CPUs".
ThreadPool* threadpool_create(int n_threads);
// The same with the workers restricted to CPUs cpus[0..n_cpus) (n_cpus <= 0: anywhere; the
// calling thread, which takes part in every run, is not touched: see threads_pin_self).
ThreadPool* threadpool_create_on(int n_threads, const int* cpus, int n_cpus);
void threadpool_destroy(ThreadPool* pool);
// Run fn(arg, i) for i in [0, n_tasks). Not re-entrant: one run at a time per pool.
void threadpool_run(ThreadPool* pool, int64_t n_tasks, TaskFn fn, void* arg);
int threads_online_cpus(void);
// The CPUs this process may run on (its affinity mask), ascending, at most cap of them; returns
// how many (0 when the system does not say).
int threads_allowed_cpus(int* cpus, int cap);
// Restrict the calling thread to CPUs cpus[0..n) (n <= 0: no change). 0, or -1 when the system
// refuses (the thread then keeps running where it did).
int threads_pin_self(const int* cpus, int n);
// Split the CPUs this process may run on (the first cap of its affinity mask, ascending): the
// calling thread is pinned to the last n_keep of them (threads it creates afterwards inherit
// that), and the others go to cpus[0..return) for a pool (threadpool_create_on). 0, with nothing
// pinned, when fewer than n_keep + min_rest CPUs are allowed or the system refuses.
int threads_split_cpus(int* cpus, int cap, int n_keep, int min_rest);

#endif  // LLMC_THREADS_H
