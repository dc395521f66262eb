/*
 * memory.h — a run's host memory, decided before anything big is allocated: what the run will
 * allocate, what the machine can give it, and whether to start. A run that does not fit is
 * refused at start-up with the flags that would make it fit, rather than killed by the kernel
 * minutes or hours later.
 *
 * The estimate adds the estimators that sit next to the code that allocates (one copy of each
 * rule): store_bytes (the Store), plain_bytes and model_cpu_op_temp_bytes (the plain path's
 * workspace, residual streams and the CPU ops' own temporaries), engine_host_memory and
 * engine_plan_memory (the engine's weight copies, gradient sets, batch staging, host activation
 * checkpoints and, on emulated devices, every device's buffers), checkpoint_export_bytes (what
 * the exports hold while they write), plus the program itself.
 *
 * The limit is the smaller of MemAvailable (/proc/meminfo) and what the process's memory cgroup
 * still allows (v2: memory.max - memory.current, v1: memory.limit_in_bytes -
 * memory.usage_in_bytes, plus the cgroup's inactive page cache, which the kernel reclaims before
 * it kills; every ancestor's limit counts). MemTotal is not used: it includes memory that other
 * processes and the kernel hold, and some virtual machines grow it lazily as memory is touched,
 * so it says neither what can be allocated now nor what can be at most; a container's real
 * ceiling is its cgroup, which MemTotal does not show. Virtual machines that hold memory back are
 * recognised: a balloon that deflates under memory pressure (its pages are added to
 * MemAvailable); memory plugged in on demand (virtio-mem) or a balloon the host deflates at will
 * (MemAvailable is then no ceiling: beyond it only a cgroup limit refuses, otherwise the run
 * starts with a warning). Anywhere else that can give more, --allow-overcommit starts the run
 * anyway (with a warning). Swap is not counted: training with weights or activations in swap is
 * slower than not training.
 */
#ifndef LLMC_MEMORY_H
#define LLMC_MEMORY_H

#include "args.h"
#include "engine.h"
#include "model.h"

// The environment variable that replaces the machine's limit, in bytes (K/M/G/T suffixes):
// meant for tests, which must not depend on the machine they run on.
#define MEMORY_LIMIT_ENV "TRAIN_ROUNDPIPE_MEM_LIMIT"

typedef struct HostLimit {
    double bytes;       // what this process can still allocate; 0 = unknown (nothing is checked)
    char source[320];   // where the figure comes from, for messages
    int ceiling;        // 1: more cannot be had (a run beyond it is refused); 0: the virtual
                        // machine adds memory on demand (virtio-mem, a balloon that is not
                        // deflated on memory pressure), so beyond it only warns
} HostLimit;

// The limit of this machine (root "") or of a fake tree for tests (root/proc/meminfo,
// root/proc/self/cgroup, root/sys/fs/cgroup/...). MEMORY_LIMIT_ENV, when set, is used instead.
// -1 with err when MEMORY_LIMIT_ENV is not a size.
int memory_host_limit(const char* root, HostLimit* out, char* err);

typedef struct RunMemory {
    double state;        // fp32 weights, AdamW m and v, gradients (the Store); with the engine its
                         // compute-dtype weight copies, extra gradient sets and, resuming a
                         // delayed run, the pending weights read from the checkpoint
    double activations;  // activations, scratch, LM-head logits chunks, the ops' temporaries and
                         // the batch: the plain path's workspace, the host activation
                         // checkpoints, emulated devices' buffers
    double checkpoints;  // of activations: the engine's host activation checkpoints (the plan's
                         // boundaries, one or two iteration sets; --host-checkpoints)
    double exports;      // held while --export-hf / --export-gguf write, at the end
    double program;      // the program, its libraries and threads; the CUDA context per GPU
    double total;
    int plan_failed;     // engine: no plan fits the device budget (engine_create will say so);
                         // its activation memory is then the plan-independent upper bound
} RunMemory;

// A streamed base (trainer_streams_base): the fp32 staging its init or load holds at once (the
// loader's and the init's threads: every CPU); *from_file (may be NULL): loaded, not the init.
double memory_stream_staging(const TrainArgs* a, const Model* m, int* from_file);

// The estimate for the run `a` of model m on n_devices devices (0: plain training on the CPU) with
// the engine's options eo (resolved: m->mlp_chunk and eo->split_rounds set; unused when plain).
// a->dist_world > 1: what rank 0 of that many data-parallel ranks holds (the engine: AdamW's m
// and v, and the fp32 weights where no plain path reads them, for its ZeRO-1 shard; the gradient
// sets and compute-dtype masters whole; the start-up's and the final write's whole fp32 weights;
// docs/DISTRIBUTED.md §6); the caller sets it to the resolved world size.
RunMemory memory_estimate(const TrainArgs* a, const Model* m, int n_devices,
                          const EngineOptions* eo);

// Print the run's "host memory:" line, then decide: 0 = start (it fits, the limit is unknown, or
// a->allow_overcommit, which prints a warning when it does not fit); -1 with one line in err (the
// estimate, the limit and its source, and the flags that would make the run fit) otherwise.
// m->mlp_chunk is changed while other settings are tried and restored.
int memory_check_run(const TrainArgs* a, Model* m, int n_devices, const EngineOptions* eo,
                     const HostLimit* lim, char* err);

#endif  // LLMC_MEMORY_H
