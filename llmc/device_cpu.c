/*
 * device_cpu.c — the CPU emulation of device.h: N "devices" made of threads, so that the RoundPipe
 * scheduler, transfer engine and consistency protocol run (and are tested, under ThreadSanitizer)
 * without a GPU.
 *
 * Model:
 *  - A Device owns STREAM_COUNT streams. A stream is one pthread draining a FIFO of work items
 *    (a function call, a copy, a memset, an event-record marker or an event-wait marker) strictly
 *    in submission order. Different streams, and streams of different devices, run concurrently.
 *  - A DevEvent is a pair of sequence numbers under a mutex:
 *      recorded  = sequence of the latest device_event_record CALL (0 = never recorded);
 *      completed = highest sequence whose record marker a stream thread has executed.
 *    Recording bumps `recorded` on the calling thread and enqueues a marker carrying that number;
 *    the marker sets completed = max(completed, seq) when its stream reaches it. A wait snapshots
 *    target = recorded at CALL time and later blocks until completed >= target, so it waits for
 *    the capture of the most recent record made before the wait call (CUDA semantics), and a
 *    wait on a never-recorded event (target 0) is a no-op. Events carry no device, so waits work
 *    across devices.
 *  - Events are reference counted: the creator holds one reference and every queued marker
 *    another, so device_event_destroy with markers still in flight is safe (as in CUDA).
 *  - Device memory is host memory with a 64-byte header (size, owner) for accounting; the optional
 *    limit (DeviceOptions.mem_limit) makes the emulation run out of memory like a real device.
 *  - Fault injection (DeviceOptions.max_delay_us > 0): each stream thread sleeps a random
 *    0..max_delay_us microseconds before every item, from its own Rng seeded by (delay_seed,
 *    device index, stream). Code that is correct only for one timing fails under it.
 *
 * Invariants: a stream thread only exits when its queue is empty and close was requested, so
 * closing a device drains all submitted work; nothing may be submitted to a device after close.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "device.h"
#include "ops.h"
#include "rng.h"
#include "trace.h"

// ----------------------------------------------------------------------------
// types

struct DevEvent {
    pthread_mutex_t mu;
    pthread_cond_t cv;     // broadcast whenever `completed` grows
    uint64_t recorded;     // sequence of the latest record call (0 = never recorded)
    uint64_t completed;    // highest sequence whose record marker has executed
    double t_completed;    // when `completed` last grew (time_now_s)
    int refs;              // the creator's reference + one per queued marker (under mu)
};

typedef enum {
    ITEM_CALL,    // fn(arg)
    ITEM_COPY,    // memcpy(dst, src, bytes)
    ITEM_MEMSET,  // memset(dst, 0, bytes)
    ITEM_RECORD,  // event->completed = max(event->completed, seq)
    ITEM_WAIT,    // block until event->completed >= seq
} ItemKind;

typedef struct WorkItem {
    ItemKind kind;
    DevWorkFn fn;
    void* arg;
    void* dst;
    const void* src;
    size_t bytes;
    DevEvent* event;
    uint64_t seq;
    const char* label;      // trace name (NULL: not traced)
    struct WorkItem* next;  // FIFO link
} WorkItem;

typedef struct Stream {
    struct Device* dev;
    StreamKind kind;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;   // signalled when an item is queued or close is requested
    WorkItem* head;      // next item to run (under mu)
    WorkItem* tail;      // last queued item (under mu)
    int closing;         // set by close: exit once the queue is empty (under mu)
    // statistics (under mu)
    uint64_t bytes;      // bytes of copies submitted to this stream
    double busy_s;       // time spent running calls, copies and memsets
    const char* pending_label;  // label for the next call/copy/memset (under mu)
    // fault injection: touched only by the stream thread
    int max_delay_us;
    Rng delay_rng;
} Stream;

struct Device {
    int index;
    void* ops_ctx;  // ops_cpu context; only the compute stream's work should use it
    Stream streams[STREAM_COUNT];
    pthread_mutex_t mem_mu;
    size_t mem_limit;   // 0 = unlimited
    size_t mem_in_use;  // (under mem_mu)
    size_t mem_peak;    // (under mem_mu)
    struct Trace* trace;  // set before work is queued (set_trace), read by the stream threads
    int trace_pid;
};

// Device allocations carry this header just before the returned pointer. 64 bytes keep the
// returned pointer 64-byte aligned.
#define MEM_HEADER 64
#define MEM_MAGIC 0x64657663u  // "devc"

typedef struct MemHeader {
    uint32_t magic;
    int owner;     // device index (catches freeing on the wrong device)
    size_t bytes;  // requested size, for accounting
} MemHeader;

// ----------------------------------------------------------------------------
// events

static DevEvent* cpu_event_create(Device* d) {
    (void)d;  // events are not tied to a device: any stream of the set may record or wait
    DevEvent* e = calloc_check(1, sizeof(DevEvent));
    pthread_check(pthread_mutex_init(&e->mu, NULL));
    pthread_check(pthread_cond_init(&e->cv, NULL));
    e->refs = 1;
    return e;
}

// Drop one reference; the last one frees the event. Nobody else can hold a pointer then: the
// creator has destroyed it and no marker refers to it any more.
static void event_unref(DevEvent* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    int last = (--e->refs == 0);
    pthread_check(pthread_mutex_unlock(&e->mu));
    if (!last) return;
    pthread_check(pthread_cond_destroy(&e->cv));
    pthread_check(pthread_mutex_destroy(&e->mu));
    free(e);
}

static void cpu_event_destroy(DevEvent* e) {
    if (e) event_unref(e);
}

// Block the calling thread until the capture with sequence `target` has completed.
static void event_wait_seq(DevEvent* e, uint64_t target) {
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->completed < target) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

static void cpu_event_synchronize(DevEvent* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    uint64_t target = e->recorded;  // the most recent record at call time; 0 = return at once
    pthread_check(pthread_mutex_unlock(&e->mu));
    event_wait_seq(e, target);
}

static int cpu_event_query(DevEvent* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    int done = e->completed >= e->recorded;
    pthread_check(pthread_mutex_unlock(&e->mu));
    return done;
}

// ----------------------------------------------------------------------------
// streams: the queue and its thread

static void stream_push(Stream* st, WorkItem* it) {
    it->next = NULL;
    pthread_check(pthread_mutex_lock(&st->mu));
    if (st->closing)
        fatal("device cpu:%d: work submitted to stream %s after the device was closed",
              st->dev->index, stream_names[st->kind]);
    if (it->kind == ITEM_CALL || it->kind == ITEM_COPY || it->kind == ITEM_MEMSET) {
        it->label = st->pending_label;
        st->pending_label = NULL;
    }
    if (st->tail) st->tail->next = it;
    else st->head = it;
    st->tail = it;
    if (it->kind == ITEM_COPY) st->bytes += it->bytes;
    pthread_check(pthread_cond_signal(&st->cv));
    pthread_check(pthread_mutex_unlock(&st->mu));
}

// The stream s of d; a bad StreamKind is a programming error, caught here rather than as memory
// corruption.
static Stream* device_stream(Device* d, StreamKind s) {
    if ((int)s < 0 || (int)s >= STREAM_COUNT) fatal("device cpu:%d: no stream %d", d->index, (int)s);
    return &d->streams[s];
}

static WorkItem* item_new(ItemKind kind) {
    WorkItem* it = calloc_check(1, sizeof(WorkItem));
    it->kind = kind;
    return it;
}

static void stream_inject_delay(Stream* st) {
    if (st->max_delay_us <= 0) return;
    uint64_t us = rng_below(&st->delay_rng, (uint64_t)st->max_delay_us + 1);
    if (us == 0) return;
    struct timespec ts = {.tv_sec = (time_t)(us / 1000000), .tv_nsec = (long)(us % 1000000) * 1000};
    // An interrupted sleep just means a shorter delay: any delay is a valid schedule.
    nanosleep(&ts, NULL);
}

// Run one item on the stream thread. Waiting on an event is not counted as busy time.
static void stream_run_item(Stream* st, WorkItem* it) {
    if (it->kind == ITEM_RECORD) {
        // max(): two records of one event on different streams may complete out of order; the
        // event is complete only once the newest record's marker has run.
        pthread_check(pthread_mutex_lock(&it->event->mu));
        if (it->seq > it->event->completed) {
            it->event->completed = it->seq;
            it->event->t_completed = time_now_s();
            pthread_check(pthread_cond_broadcast(&it->event->cv));
        }
        pthread_check(pthread_mutex_unlock(&it->event->mu));
        event_unref(it->event);
        return;
    }
    if (it->kind == ITEM_WAIT) {
        event_wait_seq(it->event, it->seq);
        event_unref(it->event);
        return;
    }
    double t0 = time_now_s();
    if (it->kind == ITEM_CALL) it->fn(it->arg);
    else if (it->kind == ITEM_COPY && it->bytes > 0) memcpy(it->dst, it->src, it->bytes);
    else if (it->kind == ITEM_MEMSET && it->bytes > 0) memset(it->dst, 0, it->bytes);
    double t1 = time_now_s(), dt = t1 - t0;
    if (it->label && st->dev->trace)
        trace_add(st->dev->trace, it->label, st->dev->trace_pid, (int)st->kind, t0, t1);
    pthread_check(pthread_mutex_lock(&st->mu));
    st->busy_s += dt;
    pthread_check(pthread_mutex_unlock(&st->mu));
}

static void* stream_main(void* p) {
    Stream* st = p;
    for (;;) {
        pthread_check(pthread_mutex_lock(&st->mu));
        while (st->head == NULL && !st->closing) pthread_check(pthread_cond_wait(&st->cv, &st->mu));
        WorkItem* it = st->head;
        if (it == NULL) {  // closing and drained
            pthread_check(pthread_mutex_unlock(&st->mu));
            break;
        }
        st->head = it->next;
        if (st->head == NULL) st->tail = NULL;
        pthread_check(pthread_mutex_unlock(&st->mu));

        stream_inject_delay(st);
        stream_run_item(st, it);
        free(it);
    }
    return NULL;
}

// A well-mixed 32-bit hash (for seeding the per-stream delay generators from small integers).
static uint32_t hash_u32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// ----------------------------------------------------------------------------
// lifecycle

static Device* cpu_open(int index, const DeviceOptions* opt) {
    if (opt->max_delay_us < 0)
        fatal("device cpu:%d: max_delay_us must be >= 0, got %d", index, opt->max_delay_us);
    Device* d = calloc_check(1, sizeof(Device));
    d->index = index;
    d->ops_ctx = ops_cpu_create(opt->threads);
    d->mem_limit = opt->mem_limit;
    pthread_check(pthread_mutex_init(&d->mem_mu, NULL));
    for (int s = 0; s < STREAM_COUNT; s++) {
        Stream* st = &d->streams[s];
        st->dev = d;
        st->kind = (StreamKind)s;
        st->max_delay_us =
            opt->delay_streams == 0 || (opt->delay_streams >> s) & 1u ? opt->max_delay_us : 0;
        uint32_t stream_id = (uint32_t)index * STREAM_COUNT + (uint32_t)s;
        rng_seed(&st->delay_rng, hash_u32(opt->delay_seed ^ hash_u32(stream_id + 1u)));
        pthread_check(pthread_mutex_init(&st->mu, NULL));
        pthread_check(pthread_cond_init(&st->cv, NULL));
        pthread_check(pthread_create(&st->thread, NULL, stream_main, st));
    }
    return d;
}

static void cpu_close(Device* d) {
    if (d == NULL) return;
    // Ask every stream to finish first, then join: the streams drain concurrently, so work on one
    // stream waiting on an event recorded on another stream of this device still completes.
    for (int s = 0; s < STREAM_COUNT; s++) {
        Stream* st = &d->streams[s];
        pthread_check(pthread_mutex_lock(&st->mu));
        st->closing = 1;
        pthread_check(pthread_cond_signal(&st->cv));
        pthread_check(pthread_mutex_unlock(&st->mu));
    }
    for (int s = 0; s < STREAM_COUNT; s++) {
        Stream* st = &d->streams[s];
        pthread_check(pthread_join(st->thread, NULL));
        pthread_check(pthread_cond_destroy(&st->cv));
        pthread_check(pthread_mutex_destroy(&st->mu));
    }
    ops_cpu_destroy(d->ops_ctx);
    pthread_check(pthread_mutex_destroy(&d->mem_mu));
    free(d);
}

static const Ops* cpu_ops(Device* d) {
    (void)d;
    return &ops_cpu;
}

static void* cpu_ops_ctx(Device* d) { return d->ops_ctx; }

// ----------------------------------------------------------------------------
// memory

static void* cpu_alloc(Device* d, size_t bytes) {
    size_t total;
    if (size_add(bytes, MEM_HEADER, &total) != 0)
        fatal("device cpu:%d: allocation of %zu bytes overflows", d->index, bytes);

    pthread_check(pthread_mutex_lock(&d->mem_mu));
    size_t in_use = d->mem_in_use;
    if (d->mem_limit > 0 && (bytes > d->mem_limit || in_use > d->mem_limit - bytes)) {
        pthread_check(pthread_mutex_unlock(&d->mem_mu));
        fatal("device cpu:%d out of memory: allocating %zu bytes with %zu of %zu bytes in use "
              "(peak %zu). HINT: raise the emulated device memory limit, or use fewer/shorter "
              "sequences per micro-batch or more devices",
              d->index, bytes, in_use, d->mem_limit, d->mem_peak);
    }
    d->mem_in_use = in_use + bytes;
    if (d->mem_in_use > d->mem_peak) d->mem_peak = d->mem_in_use;
    pthread_check(pthread_mutex_unlock(&d->mem_mu));

    unsigned char* base = aligned_alloc_check(total);
    memset(base, 0, total);
    MemHeader* h = (MemHeader*)base;
    h->magic = MEM_MAGIC;
    h->owner = d->index;
    h->bytes = bytes;
    return base + MEM_HEADER;
}

static void cpu_free(Device* d, void* p) {
    if (p == NULL) return;
    unsigned char* base = (unsigned char*)p - MEM_HEADER;
    MemHeader* h = (MemHeader*)base;
    if (h->magic != MEM_MAGIC || h->owner != d->index)
        fatal("device cpu:%d: device_free of a pointer this device did not allocate", d->index);
    h->magic = 0;  // a second free of the same block now fails the check above (or ASan)
    pthread_check(pthread_mutex_lock(&d->mem_mu));
    d->mem_in_use -= h->bytes;
    pthread_check(pthread_mutex_unlock(&d->mem_mu));
    free(base);
}

// There is no page-locking on the CPU: "pinned" host memory is aligned host memory. Like
// cudaHostAlloc it is NOT zeroed, so code reading it before writing is caught by valgrind.
static void* cpu_host_alloc(size_t bytes) { return aligned_alloc_check(bytes); }

static void cpu_host_free(void* p) { free(p); }

// There is nothing to pin on the CPU.
static void cpu_host_register(void* p, size_t bytes) {
    (void)p;
    (void)bytes;
}

static void cpu_host_unregister(void* p) { (void)p; }

// ----------------------------------------------------------------------------
// work

static void cpu_submit(Device* d, StreamKind s, DevWorkFn fn, void* arg) {
    if (fn == NULL) fatal("device cpu:%d: NULL work function submitted", d->index);
    WorkItem* it = item_new(ITEM_CALL);
    it->fn = fn;
    it->arg = arg;
    stream_push(device_stream(d, s), it);
}

static void stream_push_copy(Device* d, StreamKind s, void* dst, const void* src, size_t bytes) {
    WorkItem* it = item_new(ITEM_COPY);
    it->dst = dst;
    it->src = src;
    it->bytes = bytes;
    stream_push(device_stream(d, s), it);
}

static void cpu_copy_h2d(Device* d, StreamKind s, void* dst, const void* src, size_t bytes) {
    stream_push_copy(d, s, dst, src, bytes);
}

static void cpu_copy_d2h(Device* d, StreamKind s, void* dst, const void* src, size_t bytes) {
    stream_push_copy(d, s, dst, src, bytes);
}

static void cpu_memset_zero(Device* d, StreamKind s, void* dst, size_t bytes) {
    WorkItem* it = item_new(ITEM_MEMSET);
    it->dst = dst;
    it->bytes = bytes;
    stream_push(device_stream(d, s), it);
}

static void cpu_event_record(DevEvent* e, Device* d, StreamKind s) {
    WorkItem* it = item_new(ITEM_RECORD);
    pthread_check(pthread_mutex_lock(&e->mu));
    // Bumped now, at call time: a wait called after this returns targets this capture.
    it->seq = ++e->recorded;
    e->refs++;  // held by the marker until it has run
    pthread_check(pthread_mutex_unlock(&e->mu));
    it->event = e;
    stream_push(device_stream(d, s), it);
}

static void cpu_stream_wait(Device* d, StreamKind s, DevEvent* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    uint64_t target = e->recorded;  // snapshot: later records do not extend this wait
    if (target > 0) e->refs++;
    pthread_check(pthread_mutex_unlock(&e->mu));
    if (target == 0) return;  // never recorded: a no-op, as in CUDA
    WorkItem* it = item_new(ITEM_WAIT);
    it->event = e;
    it->seq = target;
    stream_push(device_stream(d, s), it);
}

// All streams idle: record a private event on each and wait for all of them.
static void cpu_synchronize(Device* d) {
    DevEvent* ev[STREAM_COUNT];
    for (int s = 0; s < STREAM_COUNT; s++) {
        ev[s] = cpu_event_create(d);
        cpu_event_record(ev[s], d, (StreamKind)s);
    }
    for (int s = 0; s < STREAM_COUNT; s++) {
        cpu_event_synchronize(ev[s]);
        cpu_event_destroy(ev[s]);
    }
}

static double cpu_event_elapsed(DevEvent* a, DevEvent* b) {
    cpu_event_synchronize(a);
    cpu_event_synchronize(b);
    pthread_check(pthread_mutex_lock(&a->mu));
    double ta = a->t_completed;
    pthread_check(pthread_mutex_unlock(&a->mu));
    pthread_check(pthread_mutex_lock(&b->mu));
    double tb = b->t_completed;
    pthread_check(pthread_mutex_unlock(&b->mu));
    return tb - ta;
}

static void cpu_label(Device* d, StreamKind s, const char* name) {
    Stream* st = device_stream(d, s);
    pthread_check(pthread_mutex_lock(&st->mu));
    st->pending_label = name;
    pthread_check(pthread_mutex_unlock(&st->mu));
}

static void cpu_set_trace(Device* d, struct Trace* tr, int pid) {
    d->trace = tr;
    d->trace_pid = pid;
}

static void cpu_stats(Device* d, DeviceStats* out) {
    memset(out, 0, sizeof *out);
    for (int s = 0; s < STREAM_COUNT; s++) {
        Stream* st = &d->streams[s];
        pthread_check(pthread_mutex_lock(&st->mu));
        out->bytes[s] = st->bytes;
        out->busy_s[s] = st->busy_s;
        pthread_check(pthread_mutex_unlock(&st->mu));
    }
    pthread_check(pthread_mutex_lock(&d->mem_mu));
    out->mem_in_use = d->mem_in_use;
    out->mem_peak = d->mem_peak;
    pthread_check(pthread_mutex_unlock(&d->mem_mu));
}

// ----------------------------------------------------------------------------
// the table

const DeviceImpl device_cpu_impl = {
    .name = "cpu",
    .open = cpu_open,
    .close = cpu_close,
    .ops = cpu_ops,
    .ops_ctx = cpu_ops_ctx,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .host_register = cpu_host_register,
    .host_unregister = cpu_host_unregister,
    .submit = cpu_submit,
    .host_fn = cpu_submit,  // a stream item is a host function here
    .copy_h2d = cpu_copy_h2d,
    .copy_d2h = cpu_copy_d2h,
    .memset_zero = cpu_memset_zero,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .stream_wait = cpu_stream_wait,
    .event_synchronize = cpu_event_synchronize,
    .event_query = cpu_event_query,
    .event_elapsed = cpu_event_elapsed,
    .synchronize = cpu_synchronize,
    .stats = cpu_stats,
    .label = cpu_label,
    .set_trace = cpu_set_trace,
};
