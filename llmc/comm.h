/*
 * comm.h — collectives between the ranks of a data-parallel run: all-reduce, reduce-scatter,
 * all-gather, broadcast and barrier over fp32 or bf16 buffers, with timeouts, abort and sticky
 * asynchronous errors. Two implementations behind one function table (CommImpl, as device.h's
 * DeviceImpl): comm_nccl.c (NCCL on CUDA streams, one communicator per GPU and rank) and
 * comm_emul.c (W ranks as threads of one process, for CPU runs, CI and fault injection).
 *
 * Where an op runs. Every op takes a CommStream:
 *  - a stream of a Device (device.h): the op is ENQUEUED there, ordered after the work submitted
 *    to that stream before it and before the work submitted after it, so the engine overlaps it
 *    with compute on the other streams (a layer's gradient reduce-scatter on STREAM_GRAD_DOWN,
 *    after an event of its last backward, while the backward of the layers below goes on). The
 *    buffers are device memory of that Device. The call returns at once; a failure shows later in
 *    comm_sync / comm_poll (sticky). NCCL needs a CUDA device (the communicator's GPU); the
 *    emulation a CPU-emulated one.
 *  - NULL: host buffers, the op runs now on the calling thread and returns 0 or -1 (the ZeRO-1
 *    optimizer on the host: its fp32 shard, the all-gather of the updated weights). NCCL stages
 *    host buffers through device memory of its GPU.
 * One communicator's ops form ONE sequence: every rank issues the same ops (kind, count, dtype,
 * root) in the same order, from one stream (or the host path while that stream is idle), as
 * NCCL requires. The emulation checks the match and fails naming both ops when it breaks.
 *
 * Counts follow NCCL. all_reduce, broadcast: `count` elements in send and recv. reduce_scatter:
 * send holds world * count elements, rank r receives the sum of block r (elements
 * [r*count, (r+1)*count)). all_gather: each rank sends `count`, recv holds world * count, block r
 * from rank r. Sizes that do not divide by W are padded by the caller: comm_shard_* below give
 * the layout (blocks of ceil(n / W), the last ones shorter or empty, the tail of the padded
 * buffer zero), so a reduce-scatter of zeros in the padding stays zero and an all-gather brings
 * back exactly n meaningful elements. In place: all_reduce and broadcast with send == recv;
 * reduce_scatter with recv == send + rank * count; all_gather with send == recv + rank * count.
 *
 * Sum order (the emulation's; a single-process reference reproduces it with comm_reference_sum):
 * for every element, acc = x_0, then acc = acc + x_r for r = 1 .. W-1 in rank order, in fp32
 * (bf16 inputs are widened to fp32 exactly, summed in fp32 in the same order, and rounded to bf16
 * once at the end, round-to-nearest-even). So results are bit-identical run to run and whatever
 * the thread timing. NCCL's ring sums a block in rotated rank order and, for bf16, rounds to bf16
 * after every addition: for W <= 2 that is the same result bit for bit (one addition, and
 * a + b == b + a); for W > 2 it differs in the last bits but is still deterministic run to run on
 * a fixed topology and NCCL version (NCCL_ALGO/NCCL_PROTO pinned). fp32 is the default for
 * gradients; bf16 halves the traffic at the cost of W-1 roundings on NCCL.
 *
 * Failures. Every op completes, fails, or gives up after the communicator's timeout
 * (--dist-timeout): the emulation names the rank(s) that did not arrive or died; NCCL reports
 * its asynchronous error (ncclCommGetAsyncError) or the timeout and aborts the communicator
 * (ncclCommAbort), which also frees the ranks still waiting in its kernels. The first failure is
 * sticky: every later op fails at once with that message. Nothing here exits the process: the
 * caller prints the message (one line) and exits non-zero.
 */
#ifndef LLMC_COMM_H
#define LLMC_COMM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "device.h"

// ----------------------------------------------------------------------------
// ops

typedef enum { COMM_F32 = 0, COMM_BF16 } CommDtype;

typedef enum {
    COMM_ALL_REDUCE = 0,
    COMM_REDUCE_SCATTER,
    COMM_ALL_GATHER,
    COMM_BROADCAST,
    COMM_BARRIER,  // host only (comm_barrier); listed so mismatches can name it
    COMM_OP_KINDS
} CommOpKind;

extern const char* const comm_op_names[COMM_OP_KINDS];  // "all_reduce", ...

// One collective. count as described above (per rank for reduce_scatter and all_gather).
typedef struct CommOp {
    CommOpKind kind;
    CommDtype dtype;
    const void* send;
    void* recv;
    size_t count;
    int root;  // broadcast: the rank whose send buffer everyone receives
} CommOp;

// Where ops run: a stream of a device (enqueued), or NULL for host buffers (now, blocking).
typedef struct CommStream {
    const DeviceImpl* impl;
    Device* dev;
    StreamKind stream;
} CommStream;

// ----------------------------------------------------------------------------
// the communicator and its implementations

// What rank 0 creates once and hands to every rank (the ncclUniqueId for NCCL; unused by the
// thread emulation, whose ranks share a CommEmulWorld instead). dist.c ships it over TCP.
#define COMM_TOKEN_BYTES 128
typedef struct CommToken {
    uint8_t bytes[COMM_TOKEN_BYTES];
} CommToken;

typedef struct CommInit {
    int rank, world;
    double timeout_s;  // every op, and init, give up after this (> 0)
    CommToken token;   // NCCL: the unique id rank 0 made with new_token
    int gpu;           // NCCL: this rank's CUDA device (LOCAL_RANK)
    void* local;       // emulation: the CommEmulWorld shared by the ranks' threads
} CommInit;

typedef struct Comm Comm;

typedef struct CommImpl {
    const char* name;  // "emul", "nccl"
    // rank 0, before the rendezvous: the token every rank needs for init
    int (*new_token)(CommToken* out, char* err);
    // collective: this rank joins; NULL with err when it fails (timeout names missing ranks)
    Comm* (*init)(const CommInit* in, char* err);
    // release (after comm_sync of the streams it used); a failed communicator is aborted first,
    // so no peer keeps waiting for this rank
    void (*destroy)(Comm* c);
    // ops[0..n) as one group (one NCCL group call: per-layer reduce-scatter of several tensors)
    int (*run)(Comm* c, const CommOp* ops, int n, const CommStream* st);
    // host barrier (blocking, timeout)
    int (*barrier)(Comm* c);
    // refresh the asynchronous error state (NCCL: ncclCommGetAsyncError); 0 ok, -1 failed
    int (*poll)(Comm* c);
    // abort: ops in flight return (with an error), every later op fails; why is the message
    void (*abort)(Comm* c, const char* why);
} CommImpl;

// State shared by the implementations (each embeds it first in its own struct).
struct Comm {
    const CommImpl* impl;
    int rank, world;
    double timeout_s;
    _Atomic uint64_t n_ops;  // ops run by this rank (each op of a group counts), for messages
    pthread_mutex_t mu;    // guards failed / err (set from stream threads, read by the host)
    int failed;
    char err[ERR_LEN];     // the first failure
};

extern const CommImpl comm_emul_impl;
#ifdef HAVE_CUDA
extern const CommImpl comm_nccl_impl;
#endif

// ----------------------------------------------------------------------------
// calls (comm.c): checks, then the implementation

// Set up the common part (implementations call it from init).
void comm_base_init(Comm* c, const CommImpl* impl, int rank, int world, double timeout_s);
void comm_base_destroy(Comm* c);
// Record the first failure (later ones are dropped): "rank R: <msg>". Returns -1.
__attribute__((format(printf, 2, 3))) int comm_fail(Comm* c, const char* fmt, ...);
// The sticky error message, or NULL while none happened (copies into buf).
const char* comm_error(Comm* c, char* buf, size_t cap);

int comm_run(Comm* c, const CommOp* ops, int n, const CommStream* st);
int comm_all_reduce(Comm* c, const void* send, void* recv, size_t count, CommDtype dt,
                    const CommStream* st);
int comm_reduce_scatter(Comm* c, const void* send, void* recv, size_t count, CommDtype dt,
                        const CommStream* st);
int comm_all_gather(Comm* c, const void* send, void* recv, size_t count, CommDtype dt,
                    const CommStream* st);
int comm_broadcast(Comm* c, const void* send, void* recv, size_t count, CommDtype dt, int root,
                   const CommStream* st);
int comm_barrier(Comm* c);
// Wait until the ops enqueued on st so far have completed, polling the asynchronous error, at
// most the timeout (plus 10% and half a second, so an implementation's own timeout of an op,
// with its more precise message, comes first); on timeout (or an error) the communicator is
// aborted. 0, or -1 with the
// message in comm_error.
int comm_sync(Comm* c, const CommStream* st);
int comm_poll(Comm* c);
void comm_abort(Comm* c, const char* why);
void comm_destroy(Comm* c);

// ----------------------------------------------------------------------------
// layout and reference (comm.c)

size_t comm_dtype_size(CommDtype dt);
// Shard of n elements over world ranks: blocks of ceil(n / world); rank r owns
// [*off, *off + *len) (len 0 for trailing ranks when n is small).
size_t comm_shard_block(size_t n, int world);  // ceil(n / world)
void comm_shard_range(size_t n, int world, int rank, size_t* off, size_t* len);
// The documented sum: out[i] = sum over r of in[r][i] in rank order (see the top); in are world
// arrays of n elements of dtype dt, out n elements of dt (may alias in[0]).
void comm_reference_sum(const void* const* in, int world, size_t n, CommDtype dt, void* out);

// ----------------------------------------------------------------------------
// the emulation's world and fault injection (comm_emul.c)

typedef struct CommEmulWorld CommEmulWorld;
CommEmulWorld* comm_emul_world_create(int world);
// After every rank's Comm is destroyed.
void comm_emul_world_destroy(CommEmulWorld* w);

typedef enum {
    COMM_FAULT_NONE = 0,
    COMM_FAULT_HANG,  // at its at_op-th op the rank stops responding: the op blocks until the
                      // others give up (their timeout) and the world is aborted
    COMM_FAULT_DIE    // at its at_op-th op the rank dies: the others fail at once, naming it
} CommFault;
// Arm a fault on this rank (at_op counts the rank's ops from 0, barriers included).
void comm_emul_inject(Comm* c, CommFault fault, uint64_t at_op);

#endif  // LLMC_COMM_H
