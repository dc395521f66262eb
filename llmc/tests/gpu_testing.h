/*
 * gpu_testing.h — the fixture the GPU test suites share (test_gpu.c, test_gpu_moe.c,
 * test_gpu_moe_matmul.c, test_gpu_sink.c): one CUDA op context and one CPU op context side by
 * side with the random generator that draws their common inputs, and the helpers that move test
 * tensors between host floats and device buffers and compare the results.
 *
 * The inputs are bf16 values rounded on the host (rand_bf16), so both backends see the same
 * numbers; device activations are bf16 (upload_f32 / download_f32 convert), device gradients and
 * indices are raw fp32 / int32 copies. Every host buffer returned is malloc'd (free it), every
 * device buffer comes from the CUDA op table (gfree it).
 *
 * Everything here exists only in a CUDA build (HAVE_CUDA): a CPU-only build compiles
 * gpu_testing.c to nothing and the suites' tests report "skipped" there.
 */
#ifndef LLMC_TESTS_GPU_TESTING_H
#define LLMC_TESTS_GPU_TESTING_H

#ifdef HAVE_CUDA

#include <stddef.h>
#include <stdint.h>

#include "../ops.h"
#include "../rng.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// fixture: one CUDA context and one CPU context per test

typedef struct Gpu {
    const Ops* g;  // ops_cuda
    void* gctx;
    const Ops* c;  // ops_cpu
    void* cctx;    // t->n_threads threads
    Rng rng;       // the test's inputs, seeded by gpu_open
} Gpu;

// 1 with both contexts made on GPU 0; 0 when there is no GPU: the test is then reported as
// skipped (never as passed) and must return without gpu_close.
int gpu_open(TestCtx* t, Gpu* G, uint32_t seed);
void gpu_close(Gpu* G);

// ----------------------------------------------------------------------------
// host inputs

// x rounded to the nearest-even bf16 value (what upload_f32 stores).
float bf16_value(float x);
// n random bf16 values (as floats) ~ scale * N(0, 1), drawn from G->rng (at least one element
// is allocated). fp32 values of the same draws: testing.h's rand_floats(&G->rng, n, scale).
float* rand_bf16(Gpu* G, size_t n, float scale);

// ----------------------------------------------------------------------------
// device buffers

// A device bf16 buffer holding host[0..n) (rounded to bf16).
void* dev_bf16(Gpu* G, const float* host, size_t n);
// The same from element `pad` of an allocation of n + pad elements (pad 1: the tensor starts
// 2 bytes past the allocation's 16-byte boundary, for the kernels' misaligned paths). Returns
// the tensor; *base receives the allocation to gfree (base may be NULL only when pad is 0).
void* dev_bf16_pad(Gpu* G, const float* host, size_t n, int pad, void** base);
// A device buffer holding a raw copy of `bytes` host bytes (fp32, int32).
void* dev_raw(Gpu* G, const void* host, size_t bytes);
// A device bf16 buffer of n NaNs (an output the op must overwrite).
void* dev_nan_bf16(Gpu* G, size_t n);
// n bf16 device values as floats (exact) / n fp32 device values / `bytes` raw device bytes.
float* host_bf16(Gpu* G, const void* dev, size_t n);
float* host_f32(Gpu* G, const void* dev, size_t n);
void* host_raw(Gpu* G, const void* dev, size_t bytes);
void gfree(Gpu* G, void* dev);

// ----------------------------------------------------------------------------
// comparisons

// got vs want: one CHECK that the relative L2 error is <= tol and every element of got finite.
// Returns the error.
double check_rel(TestCtx* t, const char* what, const float* got, const float* want, size_t n,
                 double tol);
// 1 when two device buffers hold the same `bytes` bytes (bit-identical reruns).
int same_device_bytes(Gpu* G, const void* a, const void* b, size_t bytes);

// ----------------------------------------------------------------------------
// shared op cases

// matmul forward and backward, CUDA against CPU on the same bf16 inputs (x ~ N(0, 1), w ~ w_scale
// N(0, 1), bias ~ N(0, 1) when with_bias; the tensor w from element w_offset of its allocation):
// out and dinp (NaN pre-filled) within 1e-2, dw and dbias (accumulated onto random fp32) within
// 1e-4 and 1e-5. what: the messages' prefix. Draws from G->rng: x, w, bias, dout, dw, dbias.
void gpu_check_matmul(TestCtx* t, Gpu* G, const char* what, int N, int IC, int OC, int with_bias,
                      float w_scale, int w_offset);

#endif  // HAVE_CUDA

#endif  // LLMC_TESTS_GPU_TESTING_H
