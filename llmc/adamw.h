/*
 * adamw.h — the CPU optimizer: AdamW with fp32 master weights, m and v, bias correction,
 * decoupled weight decay (per tensor flag), global-norm gradient clipping; LR schedules; and the
 * sequence of one optimizer step (norm -> clip -> lr -> AdamW, adamw_update), which every
 * trainer shares.
 *
 * Math per element (torch.optim.AdamW):
 *     p *= 1 - lr*wd                         (only for tensors with decay)
 *     m  = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g*g
 *     p -= lr/(1-b1^t) * m / (sqrt(v/(1-b2^t)) + eps)
 * where g = grad * grad_scale (grad_scale folds the clipping factor in).
 *
 * Evaluated in fp32, in this order (per step, in double then rounded to fp32:
 * step_size = lr/(1-b1^t), inv_sqrt_bc2 = 1/sqrt(1-b2^t), decay = 1-lr*wd or exactly 1):
 *     g = grad*grad_scale;  m = b1*m + (1-b1)*g;  v = b2*v + ((1-b2)*g)*g
 *     p = p*decay - step_size * (m / (sqrtf(v)*inv_sqrt_bc2 + eps))
 * with true sqrt and division (no rsqrt, no fast-math), so NaN/Inf gradients propagate into
 * p, m and v.
 * When out_bf16 is set, out_bf16[i] == f32_to_bf16(param[i]) after the update (same pass).
 *
 * Work is split into fixed chunks of ADAMW_CHUNK elements, so results do not depend on the number
 * of threads; the inner loop uses AVX-512 or AVX2 when the CPU has them (chosen at run time),
 * scalar code otherwise. All three do the same IEEE operations in the same order (no FMA
 * contraction), so they give bit-identical results. The environment variable
 * ROUNDPIPE_SIMD=scalar|avx2|avx512 forces a lower path (for tests and benchmarks); asking for a
 * path the CPU lacks gets the best one it has, and any other value is a fatal error.
 * The global norm is a deterministic two-level sum (per chunk in double, then the chunk sums in
 * order); each gradient is squared exactly in double, so it is the same on every path too.
 */
#ifndef LLMC_ADAMW_H
#define LLMC_ADAMW_H

#include <stddef.h>
#include <stdint.h>

#include "threads.h"

#define ADAMW_CHUNK 16384

typedef struct AdamWHyper {
    float lr;
    float beta1, beta2, eps;
    float weight_decay;
} AdamWHyper;

// One parameter tensor seen by the optimizer (all arrays of n floats, 64-byte aligned preferred).
typedef struct AdamWTensor {
    float* param;   // fp32 master weights
    const float* grad;
    float* m;
    float* v;
    size_t n;
    int decay;        // apply weight decay
    uint16_t* out_bf16;  // optional: also write bf16(param) here after the update (GPU master)
} AdamWTensor;

// Sum of squares of all gradients (deterministic for a fixed tensor list).
double adamw_grad_norm_sq(ThreadPool* pool, const AdamWTensor* t, int n_tensors);
// The same in parts: the sum of squares of each ADAMW_CHUNK-element chunk (chunks never span
// tensors), in chunk order, into sums[adamw_chunk_count(t, n_tensors)]. adamw_grad_norm_sq is
// these summed in order, so parts computed a group of tensors at a time (as their gradients
// arrive) and summed in order give the same bits.
int64_t adamw_chunk_count(const AdamWTensor* t, int n_tensors);
void adamw_grad_norm_sq_parts(ThreadPool* pool, const AdamWTensor* t, int n_tensors, double* sums);
// One step for all tensors. step is 1-based (bias correction uses it; step < 1 is a fatal error).
void adamw_step(ThreadPool* pool, const AdamWTensor* t, int n_tensors, const AdamWHyper* h,
                int64_t step, float grad_scale);
// Clipping factor: min(1, clip / (norm + 1e-6)); clip <= 0 disables clipping (returns 1).
// As in torch's clip_grad_norm_, a NaN norm gives NaN (the step then poisons every weight) and an
// infinite norm gives 0.
float adamw_clip_scale(double norm, float clip);
// Which inner loop the CPU got: "avx512", "avx2" or "scalar".
const char* adamw_simd_name(void);

// ----------------------------------------------------------------------------
// learning-rate schedules

typedef enum { LR_CONSTANT = 0, LR_COSINE, LR_LINEAR, LR_WSD } LrScheduleType;

typedef struct LrSchedule {
    LrScheduleType type;
    float max_lr;
    int warmup;        // linear warmup from max_lr/warmup at step 1 to max_lr at step warmup
    int total_steps;
    float min_lr_frac; // final lr = max_lr * min_lr_frac (cosine, linear, wsd)
    float decay_frac;  // wsd: the last decay_frac of the steps decay linearly to min_lr
} LrSchedule;

// Parse "constant" | "cosine" | "linear" | "wsd"; -1 if unknown.
int lr_schedule_parse(const char* s, LrScheduleType* out);
const char* lr_schedule_name(LrScheduleType t);
// LR at 1-based step s, with W = max(warmup, 0), T = total_steps, D = T - W,
// min_lr = max_lr*min_lr_frac:
//  - s < 1 counts as 1; when T >= 1, s > T counts as T (the final value holds after the end);
//  - warmup, s <= W:  max_lr * s / W           (max_lr/W at step 1, max_lr at step W);
//  - after warmup, with x = (s - W) / D in (0, 1] (x = 1 at s = T):
//      constant  max_lr (min_lr_frac ignored)
//      cosine    min_lr + (max_lr - min_lr) * (1 + cos(pi*x)) / 2
//      linear    max_lr - (max_lr - min_lr) * x
//      wsd       K = round(clamp(decay_frac, 0, 1) * D) decay steps: max_lr while s <= T - K,
//                then max_lr - (max_lr - min_lr) * (s - (T - K)) / K  (K = 0: max_lr throughout)
//  - D <= 0 (no steps after warmup, or T unset): max_lr after warmup.
// Computed in double, returned as float.
float lr_schedule_at(const LrSchedule* s, int64_t step);

// ----------------------------------------------------------------------------
// one optimizer step: global norm -> clip factor -> scheduled lr -> AdamW

// The sequence every trainer runs, written once: plain training and tests call adamw_update;
// a caller that gathers the norm in parts while gradients arrive and steps tensor group by
// tensor group (the engine's layer-by-layer optimizer) calls adamw_norm_sq_total,
// adamw_update_begin once, then adamw_update_apply per group.
typedef struct AdamWUpdate {
    int64_t step;      // the run's 1-based step number (bias correction, LR schedule)
    double norm;       // global gradient norm: sqrt of the sum of squares of every gradient
    float clip_scale;  // adamw_clip_scale(norm, grad_clip), folded into the gradients
    AdamWHyper hyper;  // the run's hyper-parameters with lr = the schedule's lr at step
} AdamWUpdate;

// The sum of per-chunk sums of squares (adamw_grad_norm_sq_parts) in chunk order: the same bits
// as adamw_grad_norm_sq over the same tensors.
double adamw_norm_sq_total(const double* sums, int64_t n_chunks);
// The factors of step `step` from the sum of squares of all its gradients. sched NULL: the
// constant h->lr.
AdamWUpdate adamw_update_begin(const AdamWHyper* h, const LrSchedule* sched,
                               float grad_clip, int64_t step, double norm_sq);
// AdamW with those factors over t[0..n_tensors). Every element's update depends only on its own
// values, so applying one update group by group over a partition of the tensors gives the same
// bits as one call over all of them.
void adamw_update_apply(ThreadPool* pool, const AdamWUpdate* u, const AdamWTensor* t,
                        int n_tensors);
// The whole step over one tensor list: adamw_grad_norm_sq, adamw_update_begin,
// adamw_update_apply. Returns the factors (the norm and lr a step line reports).
AdamWUpdate adamw_update(ThreadPool* pool, const AdamWTensor* t, int n_tensors,
                         const AdamWHyper* h, const LrSchedule* sched, float grad_clip,
                         int64_t step);

#endif  // LLMC_ADAMW_H
