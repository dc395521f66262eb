/*
 * kernels.h — the C face of the CUDA backend (the .cu files of kernels/): the op table of
 * llmc/ops.h with bf16 storage and fp32 accumulation, its context, and a few device queries for
 * the trainer.
 *
 * A context is bound to one device and one stream: every op of ops_cuda enqueues its kernels on
 * that stream, in call order, and returns without waiting, except the ops that hand data to the
 * host (download, download_f32, synchronize) and the uploads, which return once the host buffer
 * may be reused. Device-side errors that a kernel can only flag (a token id or target outside the
 * vocabulary) are reported, fatally, by the next synchronize or download.
 *
 * Only C types here: host C11 code includes this header; the .cu files implement it.
 */
#ifndef KERNELS_KERNELS_H
#define KERNELS_KERNELS_H

#include <stddef.h>
#include <stdio.h>

#include "../llmc/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

// The CUDA op table: name "cuda", act_bytes 2 (bf16). ctx comes from ops_cuda_create.
extern const Ops ops_cuda;

// A context on `device` that enqueues on `stream` (a cudaStream_t); NULL creates (and owns) a
// non-blocking stream. Fatal with a clear message when the device cannot be used.
void* ops_cuda_create(int device, void* stream);
void ops_cuda_destroy(void* ctx);
// The context's stream (a cudaStream_t) and device index.
void* ops_cuda_stream(void* ctx);
int ops_cuda_device(void* ctx);

// Op profile (--profile-ops): from now on time every compute op of the context with CUDA events,
// per op and shape; the report prints the device time per key, sorted, with TFLOP/s and GB/s
// where the op's work is counted. Enabling makes the issuing thread wait for the GPU every 1024
// ops: the run gets slower, the per-op times do not.
void ops_cuda_profile_enable(void* ctx);
void ops_cuda_profile_report(void* ctx, FILE* f);
// Ops::profile_phase: the ops issued from now on count toward phase `name` (NULL: none); the
// report adds each phase's device span, its ops' time and the gaps between them.
void ops_cuda_profile_phase(void* ctx, const char* name);

// Number of CUDA devices; 0 when there is no GPU or no driver (never fatal).
int cuda_device_count(void);
// The GPU_ARCH the kernels were compiled for ("sm_90a", ...).
const char* cuda_build_arch(void);
// Compute capability as 10 * major + minor (90 for H100/H200); -1 when it cannot be queried.
int cuda_device_capability(int device);
// "NVIDIA H200" and the like; "unknown" when the device cannot be queried.
const char* cuda_device_name(int device);
// Free and total device memory in bytes. Returns 0, or -1 when the device cannot be queried.
int cuda_device_memory(int device, size_t* free_bytes, size_t* total_bytes);

#ifdef __cplusplus
}
#endif

#endif  // KERNELS_KERNELS_H
