/*
 * trainer.h — one training step interface over the two ways this project trains: plain training
 * on the CPU (plain.h: every layer in order, then AdamW) and the RoundPipe engine over N devices
 * (engine.h: emulated CPU devices or GPUs, layer-by-layer delayed optimizer). A run builds one
 * Trainer and calls trainer_step once per optimizer step; the step line's statistics, evaluation,
 * checkpoints (with the delayed update's pending weights) and the end of the run go through it
 * the same way for both.
 *
 * What it owns: the backend (ops context, the plain path, the device set, the engine), the CPU
 * split between the engine's feeding threads and its optimizer, the plain path's AdamW tensors
 * and pool, the token buffer of one batch, and the step clock and throughput meter.
 *
 * Step timing: with the engine the next iteration is submitted before this one is collected (two
 * in flight), except where the run must stop and look (the caller's stop_after: checkpoints,
 * evaluations, the end). A step's time is the time between two collections, the iteration
 * period; after a stop it counts from the next trainer_step call, so checkpoints and evaluations
 * are not step time.
 */
#ifndef LLMC_TRAINER_H
#define LLMC_TRAINER_H

#include <stdint.h>

#include "adamw.h"
#include "args.h"
#include "checkpoint.h"
#include "comm.h"
#include "dataloader.h"
#include "device.h"
#include "dp.h"
#include "engine.h"
#include "log.h"
#include "model.h"
#include "ops.h"
#include "plain.h"
#include "store.h"
#include "threads.h"

#define TRAINER_MAX_CPUS 4096

// The engine's options for a run of n_devices devices from its flags, computed once the devices
// are open (the default device budget is the memory GPU 0 has free then).
typedef EngineOptions (*TrainerEngineOptionsFn)(const TrainArgs* a, int use_cuda, int n_devices,
                                                int64_t start_step);

typedef struct Trainer {
    const TrainArgs* a;
    const Model* m;
    Store* s;
    TrainState* ts;     // the run's state: step, loader position, pending weights of checkpoints
    int use_cuda;       // GPUs (the engine's devices and the plain path's backend)
    const Ops* ops;     // the plain path's backend
    void* ctx;
    Plain* plain;       // plain training; with the engine only for evaluation, sampling and
                        // --dump-state (NULL when nothing uses it)
    int plain_stale;    // the engine has updated the store since the plain path's weights were set
    ThreadPool* pool;   // plain training's AdamW threads (NULL with the engine)
    AdamWTensor* opt;   // (n_opt) plain training's optimizer view of the store
    int n_opt;
    LrSchedule sched;
    AdamWHyper hyper;
    DeviceSet devs;
    Engine* eng;        // NULL for plain training
    int cpus[TRAINER_MAX_CPUS];  // the engine's optimizer CPUs (the engine keeps a pointer)
    int32_t* tokens;    // (B, T+1) the batch being submitted or evaluated
    Comm* comm;         // data parallel (dp.h): this rank's communicator (NULL: one process)
    DpLayout* dp;       // the plain path's ZeRO-1 shard (NULL: one process, or the engine's)
    int32_t* dp_rows;   // (B/W, T+1) this rank's rows of the batch
    int drained;        // nothing in flight: the next step's clock starts when it is called
    int64_t n_collected;  // steps collected so far by this trainer
    double t_last;      // when the last step was collected
    StepMeter meter;
} Trainer;

// Build the backend for a run: n_devices 0 trains plain on the CPU; otherwise the RoundPipe
// engine over n_devices devices of a->device, with the options engine_options gives. The model
// and store (loaded) and ts (checkpoint_init_weights) outlive the trainer; the pending weights of
// a resumed delayed update go into the engine, after which ts's copy is freed. Prints the plan
// and the device line. -1 with err when the engine cannot be built.
int trainer_create(Trainer* t, const TrainArgs* a, const Model* m, Store* s, TrainState* ts,
                   int n_devices, TrainerEngineOptionsFn engine_options, char* err);
// The same as one rank of a data-parallel run over comm (NULL: one process): the engine
// reduces over the ranks (EngineOptions.comm: each rank runs M / W micro-batches of its B / W
// rows of every batch), plain training attaches comm as trainer_attach_comm does. Collective
// (every rank's weights are compared). The caller keeps comm and destroys it after trainer_free.
int trainer_create_ranked(Trainer* t, const TrainArgs* a, const Model* m, Store* s,
                          TrainState* ts, int n_devices, TrainerEngineOptionsFn engine_options,
                          Comm* comm, char* err);
void trainer_free(Trainer* t);
// Whether trainer_create builds the plain path (plain training; with the engine only for
// evaluation, sampling, --dump-state or --rl: the generator's backend and the KL reference): for
// the run's memory estimate.
int trainer_needs_plain(const TrainArgs* a, int use_engine);
// LoRA through the engine on GPUs: the engine holds the frozen base in bf16, and nothing reads
// the Store's fp32 copy any more (no plain path, no HF / GGUF export), so the trainer gives it
// back (store_release_frozen): the host holds the base once, in bf16, and the adapters' fp32
// state. (--out then holds the config and the adapters, as the checkpoints do.)
int trainer_releases_frozen(const TrainArgs* a, const Model* m, int use_engine);
// LoRA through the engine with a block-format base (--base-dtype; GPUs or emulated devices) or
// on GPUs, nothing reading the fp32 base (no plain path, no HF / GGUF export; --mmap-base maps it
// instead): the base is streamed (store_create_streamed, bf16 on GPUs), never held in fp32: the
// random init and the loader quantise its block-format tensors and, on GPUs, convert the others
// to bf16 as they make them. (--out then holds the config and the adapters.)
int trainer_streams_base(const TrainArgs* a, const Model* m, int use_engine);

// Data parallel on the plain path (llmc/dp.h): from now on every step trains this rank's rows of
// the global batch and steps its ZeRO-1 shard over c (which the caller keeps and destroys after
// trainer_free); checkpoints gather AdamW's state first and only rank 0 writes them. Collective
// (it checks that every rank starts from rank 0's weights). -1 with err for the engine, LoRA,
// mixture-of-experts models, a batch that does not split over the ranks, or other weights.
int trainer_attach_comm(Trainer* t, Comm* c, char* err);

// Optimizer step `step` of the run on the next batches of `train`: its loss, gradient norm and
// lr (with the delayed update those of the step applying the previous iteration's gradient),
// time, tok/s, MFU (GPUs), bubble and memory. stop_after: nothing may stay in flight after this
// step (a checkpoint, an evaluation or the end follows). Fatal on a data error or a non-finite
// loss (whose message tells a learning-rate problem from weights that were bad to begin with).
StepStats trainer_step(Trainer* t, DataLoader* train, int step, int stop_after);
// A step whose objective is the caller's (GRPO): fn accumulates its gradients on t->plain (the
// store's gradients zeroed before) and returns its value (st.loss); then the optimizer step and
// the statistics as trainer_step. Plain training only.
typedef double (*TrainerGradFn)(void* arg, Plain* p);
StepStats trainer_step_with(Trainer* t, int step, TrainerGradFn fn, void* arg);
// A step whose objective goes through the engine's loss head (engine_submit_loss: GRPO's policy
// objective) on tokens (B, T+1) of the engine's B rows: submitted, collected and synchronised
// (nothing stays in flight; the Store holds every update applied so far), its statistics as
// trainer_step's; *logp the iteration's log-probs (EngineStepResult.logp, valid until the next
// step). The engine only.
StepStats trainer_step_engine_loss(Trainer* t, int step, const int32_t* tokens,
                                   const EngineLoss* loss, const float** logp);
// The mean loss over up to --eval-batches batches of val, from its start, with the weights of
// every step applied so far.
double trainer_evaluate(Trainer* t, DataLoader* val);
// --dump-state: the gradients of the next batch of train on the plain path into the store
// (tied heads folded, no step); returns its mean loss.
double trainer_batch_gradients(Trainer* t, DataLoader* train);
// Iterations submitted and not yet collected (the engine keeps up to two; plain training none).
// A run that must stop (a signal) runs steps with stop_after set until this is 0.
int trainer_in_flight(const Trainer* t);
// A training-state checkpoint after `step` into --out (keeping --keep), with the loader position
// of train and, with the delayed update, the weights the next iteration computes with. -1 + err.
int trainer_save_checkpoint(Trainer* t, const DataLoader* train, int step, const char* args_json,
                            char* err);
// The end of training: every queued step applied to the store, the plain path's weights current
// (evaluation, sampling, exports), the engine's trace written. -1 + err.
int trainer_finish(Trainer* t, char* err);

#endif  // LLMC_TRAINER_H
