/*
 * log.h — the per-step console line and the --log JSON-lines file (one object per step and one
 * per evaluation), and the throughput meter behind the line's tok/s, MFU and bubble columns.
 * Numbers are written with enough digits to round-trip.
 *
 * The JSON-lines records:
 *   {"step":N,"loss":X,"lr":X,"norm":X,"ms":X,"tok_s":X,"tokens":N[,"mfu":X][,"bubble":X]
 *    [,"dev_mib":X],"host_mib":X}       one per step (tokens: trained through this step, B x T x
 *                                       step); lr and norm are null for a step that applied
 *                                       no optimizer update (the delayed engine's first
 *                                       iteration), and any non-finite number is null
 *   {"step":N,"val_loss":X}             one per evaluation
 *   {"resume":N}                        a resumed run appending to its log: the records that
 *                                       follow replace every earlier record of a step > N (a run
 *                                       killed after its last checkpoint logged steps that the
 *                                       resumed run logs again)
 */
#ifndef LLMC_LOG_H
#define LLMC_LOG_H

#include <stdio.h>

typedef struct StepLog {
    FILE* f;  // NULL when no --log file
    const char* path;
} StepLog;

typedef struct StepStats {
    int step, steps;
    double loss;
    double norm;
    double lr;
    int no_update;  // no optimizer step was reported with this step (the delayed update's first
                    // iteration): the line shows "norm -" and "lr -", the JSON null
    double ms;
    double tok_s;
    double tokens;  // tokens trained through this step (B x T x step)
    double mfu;     // < 0 when not measured (CPU)
    double bubble;  // fraction of device compute time idle (< 0: not pipelined)
    double host_mib, dev_mib;  // memory in use (< 0: not reported)
    // MoE models (moe = 1): the objective's parts, loss = ce + router_aux_loss_coef · aux (the
    // coefficient 0 without output_router_logits), and the expert load spread: the most tokens
    // any expert got over the mean per expert (summed over the MoE blocks and micro-batches;
    // 1 = perfectly balanced, E / K = every token to the same K experts)
    int moe;
    double ce, aux, load_spread;
} StepStats;

// Resident host memory of this process in MiB (from /proc/self/status; -1 if unavailable).
double log_host_rss_mib(void);

// Open the log file; "" means no file. resume_step < 0: a new run, the file is truncated;
// otherwise a run resumed after step resume_step appends to it, first a {"resume":N} record
// (after a newline when a killed run left its last line unfinished). -1 + err on failure.
int log_open(StepLog* lg, const char* path, long long resume_step, char* err);
void log_close(StepLog* lg);
void log_step(StepLog* lg, const StepStats* s);
void log_eval(StepLog* lg, int step, double val_loss);

// ----------------------------------------------------------------------------
// throughput: tok/s, MFU and bubble over the last steps

// Dense bf16 tensor-core peak of one H100/H200 SXM GPU: 989.4 TFLOP/s in NVIDIA's H100 and H200
// datasheets (1,979 is the 2:4-sparse figure). MFU is model FLOPs per second (6N plus the
// attention term, config_flops_per_token) over this peak rounded to 989 TFLOP/s per GPU, the
// "MFU_989" convention every measurement of this project is quoted in.
#define LOG_PEAK_FLOPS_PER_GPU 989e12

#define LOG_METER_WINDOW_MAX 64

// Rates over a window of the last W steps: when the whole model is one stage each of two GPUs
// takes every other iteration, so step times alternate long and short; over W = the number of
// devices they are the steady rate. The step's own ms stays the step's.
typedef struct StepMeter {
    int window;              // W: 1..LOG_METER_WINDOW_MAX steps
    int n;                   // steps recorded so far
    double tokens_per_step;  // B x T
    double flops_per_token;  // model FLOPs per trained token
    double peak_flops;       // the devices' summed peak FLOP/s (0: no MFU column)
    double dt[LOG_METER_WINDOW_MAX];    // seconds of the last W steps (a ring)
    double idle[LOG_METER_WINDOW_MAX];  // their idle device time (bubble x seconds)
} StepMeter;

// window is clamped to 1..LOG_METER_WINDOW_MAX.
void log_meter_init(StepMeter* mt, int window, double tokens_per_step, double flops_per_token,
                    double peak_flops);
// Record a step of dt seconds whose bubble is st->bubble (< 0: not pipelined) and fill st->ms,
// st->tok_s, st->bubble (now over the window) and st->mfu (with a peak).
void log_meter_record(StepMeter* mt, StepStats* st, double dt);

#endif  // LLMC_LOG_H
