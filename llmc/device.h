/*
 * device.h — what the RoundPipe engine knows about a device: streams, events, asynchronous copies,
 * device memory, pinned host memory, and "submit work to a stream". Two implementations:
 * device_cpu.c emulates N devices with threads (one thread per stream, a FIFO each; events are
 * completion counters), so the real scheduler, transfer engine and consistency protocol run in CI
 * and under ThreadSanitizer; device_cuda.c maps the same calls onto CUDA streams and events.
 *
 * Semantics follow CUDA:
 *  - Work submitted to one stream runs in submission order; different streams run concurrently.
 *  - device_event_record(ev, stream) captures all work submitted to that stream so far. A later
 *    record of the same event replaces the capture.
 *  - device_stream_wait(stream, ev) makes work submitted to `stream` AFTER this call wait until the
 *    capture of ev's most recent record (at the time of the wait call) has completed. Events are
 *    not tied to a device: any device's stream may record or wait on any event of the set (the
 *    CUDA implementation makes a CUDA event per record, on the recording GPU, and a wait uses
 *    the one current when the wait was made). Waiting on an event never recorded is a no-op (as in CUDA):
 *    the engine therefore guarantees "record before wait" itself (docs/ROUNDPIPE.md §3.2).
 *  - device_event_synchronize blocks the calling host thread the same way.
 *  - device_submit(stream, fn, arg): on the CPU emulation fn(arg) runs later, on the stream's
 *    thread, in order; on CUDA fn(arg) runs later on the GPU's issue thread (every call of this
 *    interface is a command issued in order there) and is expected to ENQUEUE kernels on the
 *    stream (the op context passed to the model is bound to that stream). Either way everything
 *    fn enqueues/does is ordered after earlier work on the stream. `arg` must stay valid until
 *    the work has run (use an event to know when).
 *
 * Stream roles (docs/ROUNDPIPE.md §4.1, one of each per device): compute, activation upload and
 * download (the critical path), parameter upload, gradient download.
 */
#ifndef LLMC_DEVICE_H
#define LLMC_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"

struct Trace;

typedef enum {
    STREAM_COMPUTE = 0,
    STREAM_ACT_UP,
    STREAM_ACT_DOWN,
    STREAM_PARAM_UP,
    STREAM_GRAD_DOWN,
    STREAM_COUNT
} StreamKind;

extern const char* const stream_names[STREAM_COUNT];

typedef struct Device Device;       // one (emulated or real) device
typedef struct DevEvent DevEvent;   // an event, usable across devices of one DeviceSet
struct DeviceOptions;                // defined below; DeviceImpl.open takes one

typedef void (*DevWorkFn)(void* arg);

typedef struct DeviceStats {
    uint64_t bytes[STREAM_COUNT];    // bytes copied per stream
    double busy_s[STREAM_COUNT];     // time streams spent running work (CPU emulation: measured
                                     // on the stream threads; CUDA: from events, when traced)
    size_t mem_in_use, mem_peak;     // device memory from device_alloc
} DeviceStats;

// A set of N devices of one kind.
typedef struct DeviceSet {
    const struct DeviceImpl* impl;
    int n;
    Device** dev;
} DeviceSet;

typedef struct DeviceImpl {
    const char* name;  // "cpu", "cuda"
    // lifecycle
    Device* (*open)(int index, const struct DeviceOptions* opt);
    void (*close)(Device* d);
    // compute: the op table and a context bound to this device's compute stream
    const Ops* (*ops)(Device* d);
    void* (*ops_ctx)(Device* d);
    // memory
    void* (*alloc)(Device* d, size_t bytes);  // device memory (fatal on exhaustion, with a hint)
    void (*free)(Device* d, void* p);
    void* (*host_alloc)(size_t bytes);        // pinned (page-locked) host memory
    void (*host_free)(void* p);
    // Pin existing host memory (the Store's slabs) for fast asynchronous copies; no-op on the CPU.
    void (*host_register)(void* p, size_t bytes);
    void (*host_unregister)(void* p);
    // work: submit(fn) runs fn in stream order as the device's way to enqueue device work
    // (CUDA: on the GPU's issue thread, fn launches kernels on the compute stream; the CPU
    // emulation: on the stream's thread, fn is the work). host_fn(fn) is a host callback in
    // stream order: later work on the stream waits for it; it may block (e.g. on a condition
    // variable) but must not call this interface. It never holds up other streams.
    void (*submit)(Device* d, StreamKind s, DevWorkFn fn, void* arg);
    void (*host_fn)(Device* d, StreamKind s, DevWorkFn fn, void* arg);
    void (*copy_h2d)(Device* d, StreamKind s, void* dst, const void* src, size_t bytes);
    void (*copy_d2h)(Device* d, StreamKind s, void* dst, const void* src, size_t bytes);
    void (*memset_zero)(Device* d, StreamKind s, void* dst, size_t bytes);
    // events
    DevEvent* (*event_create)(Device* d);
    void (*event_destroy)(DevEvent* e);
    void (*event_record)(DevEvent* e, Device* d, StreamKind s);
    void (*stream_wait)(Device* d, StreamKind s, DevEvent* e);
    void (*event_synchronize)(DevEvent* e);
    int (*event_query)(DevEvent* e);  // 1 = capture complete (or never recorded)
    // Seconds between the completions of the latest records of two completed events (as
    // cudaEventElapsedTime); both must have been recorded and have completed.
    double (*event_elapsed)(DevEvent* start, DevEvent* end);
    void (*synchronize)(Device* d);   // all streams idle
    void (*stats)(Device* d, DeviceStats* out);
    // tracing: label(d, s, name) names the next call, copy or memset queued on stream s (name
    // must stay valid until that work has run); once a trace is attached with set_trace, labelled
    // work is recorded as a complete event of process `pid`, thread = the stream.
    void (*label)(Device* d, StreamKind s, const char* name);
    void (*set_trace)(Device* d, struct Trace* tr, int pid);
} DeviceImpl;

typedef struct DeviceOptions {
    int threads;            // CPU emulation: threads of each device's op context
    uint32_t delay_seed;    // CPU emulation: seed of the injected delays
    int max_delay_us;       // CPU emulation: each stream sleeps a random 0..max before each item
                            // (0 = no fault injection)
    unsigned delay_streams; // CPU emulation: bit s set = stream s gets the delays (0 = all), so
                            // a test can make one kind of traffic lag far behind the others
    size_t mem_limit;       // device memory limit in bytes (0 = the backend's default)
    int profile_ops;        // CUDA: time every op; the report is printed when the device closes
} DeviceOptions;

extern const DeviceImpl device_cpu_impl;
#ifdef HAVE_CUDA
extern const DeviceImpl device_cuda_impl;
// The cudaStream_t of a CUDA device's stream s (and its GPU index in *gpu, if non-NULL), for
// libraries that enqueue on it themselves (NCCL, comm_nccl.c) from work submitted to d.
void* device_cuda_stream(Device* d, StreamKind s, int* gpu);
#endif

// Open n devices of an implementation (fatal with a clear message when they cannot be opened).
void device_set_open(DeviceSet* set, const DeviceImpl* impl, int n, const DeviceOptions* opt);
void device_set_close(DeviceSet* set);

#endif  // LLMC_DEVICE_H
