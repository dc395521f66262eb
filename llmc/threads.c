/*
 * threads.c — the worker pool behind threadpool_run. Tasks are handed out through an atomic
 * counter; a generation number wakes the workers for each run.
 */
#include "threads.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

int threads_online_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

int threads_allowed_cpus(int* cpus, int cap) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
    int n = 0;
    for (int c = 0; c < CPU_SETSIZE && n < cap; c++)
        if (CPU_ISSET(c, &set)) cpus[n++] = c;
    return n;
}

int threads_pin_self(const int* cpus, int n) {
    if (n <= 0) return 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < n; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &set);
    return sched_setaffinity(0, sizeof set, &set) == 0 ? 0 : -1;  // 0: the calling thread
}

int threads_split_cpus(int* cpus, int cap, int n_keep, int min_rest) {
    const int n = threads_allowed_cpus(cpus, cap);
    if (n < n_keep + min_rest || threads_pin_self(cpus + n - n_keep, n_keep) != 0) return 0;
    return n - n_keep;
}

// Claim and run tasks of the current generation until none are left; returns how many ran.
static int64_t run_tasks(ThreadPool* pool, TaskFn fn, void* arg, int64_t n_tasks) {
    int64_t ran = 0;
    for (;;) {
        int64_t i = atomic_fetch_add(&pool->next_task, 1);
        if (i >= n_tasks) break;
        fn(arg, i);
        ran++;
    }
    return ran;
}

static void* worker_main(void* p) {
    ThreadPool* pool = p;
    (void)threads_pin_self(pool->cpus, pool->n_cpus);  // a refusal leaves the worker unpinned
    uint64_t seen = 0;
    for (;;) {
        pthread_check(pthread_mutex_lock(&pool->mu));
        while (!pool->shutdown && pool->generation == seen)
            pthread_check(pthread_cond_wait(&pool->cv_work, &pool->mu));
        if (pool->shutdown) {
            pthread_check(pthread_mutex_unlock(&pool->mu));
            return NULL;
        }
        // Take the generation's work description and register as active in one critical
        // section: the caller never resets the task counter while a worker is active, so a
        // worker can never run a new generation's indices with an old generation's fn.
        seen = pool->generation;
        TaskFn fn = pool->fn;
        void* arg = pool->arg;
        int64_t n_tasks = pool->n_tasks;
        pool->active++;
        pthread_check(pthread_mutex_unlock(&pool->mu));

        run_tasks(pool, fn, arg, n_tasks);

        pthread_check(pthread_mutex_lock(&pool->mu));
        pool->active--;
        if (pool->active == 0) pthread_check(pthread_cond_broadcast(&pool->cv_done));
        pthread_check(pthread_mutex_unlock(&pool->mu));
    }
}

ThreadPool* threadpool_create(int n_threads) { return threadpool_create_on(n_threads, NULL, 0); }

ThreadPool* threadpool_create_on(int n_threads, const int* cpus, int n_cpus) {
    if (n_threads <= 0) n_threads = threads_online_cpus();
    ThreadPool* pool = calloc_check(1, sizeof(ThreadPool));
    pool->n_threads = n_threads;
    if (cpus && n_cpus > 0) {
        pool->cpus = malloc_check((size_t)n_cpus * sizeof(int));
        memcpy(pool->cpus, cpus, (size_t)n_cpus * sizeof(int));
        pool->n_cpus = n_cpus;
    }
    pthread_check(pthread_mutex_init(&pool->mu, NULL));
    pthread_check(pthread_cond_init(&pool->cv_work, NULL));
    pthread_check(pthread_cond_init(&pool->cv_done, NULL));
    pool->threads = calloc_check((size_t)n_threads, sizeof(pthread_t));
    for (int i = 1; i < n_threads; i++)
        pthread_check(pthread_create(&pool->threads[i], NULL, worker_main, pool));
    return pool;
}

void threadpool_destroy(ThreadPool* pool) {
    if (!pool) return;
    pthread_check(pthread_mutex_lock(&pool->mu));
    pool->shutdown = 1;
    pthread_check(pthread_cond_broadcast(&pool->cv_work));
    pthread_check(pthread_mutex_unlock(&pool->mu));
    for (int i = 1; i < pool->n_threads; i++) pthread_check(pthread_join(pool->threads[i], NULL));
    pthread_check(pthread_mutex_destroy(&pool->mu));
    pthread_check(pthread_cond_destroy(&pool->cv_work));
    pthread_check(pthread_cond_destroy(&pool->cv_done));
    free(pool->cpus);
    free(pool->threads);
    free(pool);
}

void threadpool_run(ThreadPool* pool, int64_t n_tasks, TaskFn fn, void* arg) {
    if (n_tasks <= 0) return;
    if (pool == NULL || pool->n_threads == 1 || n_tasks == 1) {
        for (int64_t i = 0; i < n_tasks; i++) fn(arg, i);
        return;
    }
    pthread_check(pthread_mutex_lock(&pool->mu));
    // A worker that woke late for the previous generation may still be draining its (empty)
    // counter; wait for it before resetting the counter.
    while (pool->active > 0) pthread_check(pthread_cond_wait(&pool->cv_done, &pool->mu));
    pool->fn = fn;
    pool->arg = arg;
    pool->n_tasks = n_tasks;
    atomic_store(&pool->next_task, 0);
    pool->generation++;
    pthread_check(pthread_cond_broadcast(&pool->cv_work));
    pthread_check(pthread_mutex_unlock(&pool->mu));

    run_tasks(pool, fn, arg, n_tasks);

    // Every task is claimed once the caller's loop ends; claimed tasks are finished once no
    // worker is active.
    pthread_check(pthread_mutex_lock(&pool->mu));
    while (pool->active > 0) pthread_check(pthread_cond_wait(&pool->cv_done, &pool->mu));
    pthread_check(pthread_mutex_unlock(&pool->mu));
}
