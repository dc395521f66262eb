/*
 * args.h — command-line flags of ./train_roundpipe: one struct with every option and its default,
 * getopt_long parsing with validation, and the --help text (which documents every flag).
 */
#ifndef LLMC_ARGS_H
#define LLMC_ARGS_H

#include <stdint.h>
#include <stdio.h>

#include "adamw.h"
#include "rl_args.h"

typedef enum { DEVICE_CPU = 0, DEVICE_CUDA } DeviceKind;
typedef enum { EXPORT_F32 = 0, EXPORT_BF16, EXPORT_F16 } ExportDtype;

typedef struct TrainArgs {
    const char* model;       // preset | HF dir | config.json | .safetensors
    const char* train;       // shard glob
    const char* val;         // shard glob ("" = no validation)
    int batch;               // B: sequences per optimizer step
    int seq;                 // T: tokens per sequence
    int layers;              // --layers N: keep only the first N decoder blocks (0 = all)
    int micro_batches;       // M: the batch is split into M micro-batches of B/M sequences
    int steps;
    float lr;
    LrScheduleType schedule;
    int warmup;
    float min_lr_frac;
    float decay_frac;        // wsd: fraction of the post-warmup steps spent decaying
    float weight_decay;
    int decay_embeddings;
    float beta1, beta2, eps;
    float grad_clip;         // 0 = off
    int shuffle;
    uint32_t seed;
    int eval_every;          // 0 = only at the end
    int eval_batches;
    const char* out;         // directory for the final model and step_<N> checkpoints ("" = none)
    int save_every;          // training-state checkpoint every N steps and at the end (0 = never)
    int keep;                // keep the newest K checkpoints (0 = all)
    int resume;              // continue from the newest complete checkpoint in --out
    const char* export_hf;   // HF directory written at the end ("" = none)
    const char* export_gguf; // GGUF file written at the end ("" = none)
    ExportDtype export_dtype;
    double export_shard_bytes;  // --export-hf: shard size in bytes
    const char* log;         // JSON-lines log file ("" = none)
    DeviceKind device;
    int n_devices;           // cpu:N / cuda:N (0 = plain, no engine)
    int threads;             // 0 = all CPUs
    // RoundPipe engine (--device cpu:N / cuda:N)
    int round_micro_batches; // M_R: micro-batches per round (0 = all M in one round)
    int row_chunks;          // engine: compute micro-batches in this many row chunks (0 = auto)
    int recompute_layer;     // 1: layer-grain recompute, 0: stage grain
    int sync;                // 1: synchronous optimizer, 0: one-step-delayed (default)
    int plan_only;           // --plan: print the partition and exit
    double device_mem;       // device memory for parameter stages in bytes (0 = backend default)
    int delay_us;            // emulated devices: random delay injected before each stream item
    const char* trace;       // Chrome trace JSON of the engine's work ("" = none)
    int profile_ops;         // --profile-ops: each GPU's device time per op and shape at the end
    int split_rounds;        // --split-rounds 1, --no-split-rounds 0, default -1 (auto): rounds of
                             // an iteration run at once on the devices
    int profile_steps;       // re-plan once from stage times measured over this many steps
    int mlp_chunk;           // long sequences: MLP in row chunks of this size (0 = off, -1 = auto:
                             // 16384 with the engine for micro-batches over 65536 tokens or when
                             // no plan fits without)
    int host_single;         // engine: one set of host activation checkpoints (half the memory)
    const char* dump_state;  // safetensors path ("" = train normally)
    int sample_tokens;       // tokens generated at the end (0 = none)
    const char* prompt;      // generation prompt (byte-level vocabularies)
    float temperature;       // sampling temperature (0 = greedy)
    float init_std;
    int allow_overcommit;    // start even when the host memory estimate exceeds what is available
    // data parallel (dist.h): flags win over the torchrun / Slurm environment, field by field
    const char* dist_init;   // --dist-init tcp://HOST:PORT of rank 0 ("" = from the environment)
    int dist_rank;           // --rank R (-1 = from the environment)
    int dist_world;          // --world W (0 = from the environment, else 1)
    float dist_timeout;      // --dist-timeout S: every rendezvous and collective wait (seconds)
    int dp_reduce_bf16;      // --dp-reduce-dtype bf16: gradients on the wire in bf16 (else fp32)
    float net_gbps;          // --net-gbps G: --plan's network bandwidth per node (Gbit/s)
    float step_ms;           // --step-ms MS: --plan's single-node step time (0: from the FLOPs)
    // LoRA on a frozen base (lora.h)
    int lora_r;              // rank, 0 = off
    float lora_alpha;
    unsigned lora_targets;   // LORA_BIT set (tensor.h), router/experts bits (lora.h)
    const char* lora_targets_arg;  // --lora-targets as given
    float lora_dropout;
    int rslora;              // scale alpha / sqrt(r)
    int lora_gate_up_r;      // the experts' gate_up adapter rank (0: the family's, tensor.h)
    const char* lora_init;   // PEFT adapter directory to start from ("" = PEFT's init)
    const char* export_lora; // PEFT adapter directory written at the end ("" = none)
    int merge_lora;          // the HF / GGUF exports carry W + scale·B·A
    const char* lora_flag;   // the first --lora-* flag other than --lora-r given (validation)
    int base_dtype;          // --base-dtype: BaseDtype (quant.h), the frozen base's host format
    const char* base_dtype_arg;
    int mmap_base;           // --mmap-base: the base read from the mapped checkpoint
    RlArgs rl;               // reinforcement learning (--rl grpo; rl_args.h)
} TrainArgs;

// Defaults: the built-in tiny model on the shipped corpus.
void args_defaults(TrainArgs* a);
// Parse argv. On a bad flag or value: prints one error line (what is wrong, the limit it broke, a
// hint to --help) to stderr and returns 2 (the exit status). --help prints the usage to stdout
// and returns 1 (exit 0). Otherwise 0.
int args_parse(TrainArgs* a, int argc, char** argv);
void args_usage(FILE* f);
// "512M", "80G", "1e9": a positive size in bytes with an optional K/M/G/T suffix (powers of
// 1024), as --device-mem takes it. 0, or -1 when v is not one.
int args_parse_bytes(const char* v, double* out);
// The flags as a JSON object, keys = long flag names (args.json of checkpoints). malloc'd.
char* args_to_json(const TrainArgs* a);
const char* export_dtype_name(ExportDtype d);  // "f32", "bf16", "f16"

#endif  // LLMC_ARGS_H
