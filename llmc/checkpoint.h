/*
 * checkpoint.h — where a model comes from and where it goes:
 *  - resolving --model (preset, HF directory, config.json, .safetensors, .gguf) into a config and
 *    an open weight source, and loading the weights into the store;
 *  - the final model in HF layout (--out), the --dump-state file;
 *  - training-state checkpoints (--save-every, --keep, --resume): DIR/step_<N>/ with the weights,
 *    the optimizer state, the data-loader and RNG state, the config and the flags, written
 *    atomically and marked complete by a DONE file written last;
 *  - the model's tokenizer (tokenizer.json beside an HF source or its config.json, or a GGUF
 *    source's tokenizer.ggml.* records), for the prompt, the sample and the exports;
 *  - exports: --export-hf (safetensors, sharded with an index past the shard size, config.json,
 *    the source's tokenizer files, or tokenizer.json written from a GGUF source's tokenizer) and
 *    --export-gguf (F32/F16/BF16 with the architecture metadata and the source GGUF's tokenizer
 *    records, or records written from an HF source's tokenizer).
 */
#ifndef LLMC_CHECKPOINT_H
#define LLMC_CHECKPOINT_H

#include <stdint.h>

#include "args.h"  // ExportDtype (the --export-dtype values)
#include "config.h"
#include "dataloader.h"
#include "gguf.h"
#include "model.h"
#include "rng.h"
#include "safetensors.h"
#include "store.h"
#include "tokenizer.h"

typedef enum {
    SOURCE_CONFIG = 0,   // a preset or a config.json: no weights (random init)
    SOURCE_SAFETENSORS,  // an HF directory or a .safetensors file
    SOURCE_GGUF          // a .gguf file
} SourceKind;

typedef struct ModelSource {
    ModelConfig cfg;
    SourceKind kind;
    int has_weights;          // ck or gguf is open and holds the weights
    StCheckpoint ck;          // SOURCE_SAFETENSORS
    GgufFile gguf;            // SOURCE_GGUF
    GgufTokenizer tokenizer;  // tokenizer.* records of a GGUF source (empty otherwise)
    Tokenizer* tok;           // the model's tokenizer, once checkpoint_load_tokenizer found one
    char config_path[1024];   // "" for presets and GGUF files
    char hf_dir[1024];        // the directory of an HF source or of a config.json (tokenizer
                              // files), or ""
} ModelSource;

// spec: a preset name, an HF directory (config.json + safetensors), a config.json (random init),
// a .safetensors file (config.json from the same directory) or a .gguf file (config from its
// metadata). -1 + one-line error.
int checkpoint_resolve_model(ModelSource* src, const char* spec, char* err);
// Load the source's weights into the store (checks names and shapes; *n_unused counts tensors of
// the file the model does not use).
int checkpoint_load_weights(const ModelSource* src, Store* s, int* n_unused, char* err);
// The source's tokenizer into src->tok: hf_dir/tokenizer.json (with tokenizer_config.json), or
// a GGUF source's tokenizer.ggml.* records; call it before the weights are released. None, or
// one this tokenizer cannot read (other than byte-level BPE), leaves src->tok NULL: the latter
// with a warning (the prompt is then not encoded; the exports still copy the files or records
// as they are). Prints "tokenizer: N tokens from FILE" when it loads one. -1 with err when its
// vocabulary is larger than the model's.
int checkpoint_load_tokenizer(ModelSource* src, char* err);
// Unmap the weight files; the config, tokenizer and hf_dir stay for the exports.
void checkpoint_release_weights(ModelSource* src);
// Release everything.
void checkpoint_close_source(ModelSource* src);

// Write dir/model.safetensors (F32, HF names; tied head omitted) and dir/config.json.
int checkpoint_save_hf(const char* dir, const Model* m, const Store* s, char* err);
// Write the --dump-state file: "loss" F32 [1] and "grad.<HF name>" F32 for every owned tensor
// (store gradients must already be folded: tied heads summed into the embedding); with LoRA
// "grad.<PEFT key>" of the adapters only.
int checkpoint_dump_state(const char* path, const Model* m, const Store* s, float loss, char* err);

// ----------------------------------------------------------------------------
// training state

// Everything besides the store (weights, m, v, step) that a run needs to continue bit-exactly.
typedef struct TrainState {
    int64_t step;                                  // optimizer steps completed
    uint8_t train_loader[DATALOADER_STATE_BYTES];  // the training loader's position
    Rng rng;      // the run's random stream (seeded from --seed; for stochastic training parts)
    int resumed;  // loaded from a checkpoint (not saved)
    // The RoundPipe engine's delayed update: the weights the next iteration computes with are one
    // step behind the master weights. A checkpoint keeps them (pending_weights.safetensors, in
    // the engine's compute dtype) so a resumed run continues bit-exactly. pending_bytes: bytes per
    // element (2 bf16, 4 fp32), 0 = none; pending[l]: layer l's slab (owned after loading).
    // pending_norm/pending_lr: the gradient norm and lr of the last update (already in the master
    // weights), which the straight run would have reported with the next step.
    int pending_bytes;
    void** pending;
    int pending_owned;
    double pending_norm, pending_lr;
    // Reinforcement learning's state beyond the weights (rl_state.bin, opaque here: llmc/grpo.c
    // writes and reads it): the rollout generated ahead for the next step, which a resumed
    // one-step-off-policy run trains on as the straight run would. Saved when rl_state_bytes > 0;
    // loaded into an owned buffer (rl_state_owned) when the checkpoint has one.
    const void* rl_state;
    size_t rl_state_bytes;
    int rl_state_owned;
} TrainState;

void train_state_init(TrainState* ts, uint32_t seed);
void train_state_free(TrainState* ts);  // the loaded pending weights
void train_state_free_rl(TrainState* ts);  // the loaded RL state (rl_state)

// Where the start of a run takes its weights from (the run's --model, --out, --resume, --seed
// and --init-std).
typedef struct InitOptions {
    const char* model;    // the model spec, named in the "loaded weights from" line
    const char* out_dir;  // the directory of the step_<N> checkpoints (--resume looks there)
    int resume;           // continue from the newest complete checkpoint in out_dir, if any
    uint32_t seed;        // seeds the run's random stream (ts->rng) and the random init
    float init_std;       // random init: matrices and embeddings ~ N(0, init_std)
    const char* lora_init;  // LoRA: a PEFT adapter directory to start from (NULL / "": PEFT's
                            // init, seeded by seed)
    int keep_source;        // leave the source's weight files open (--mmap-base reads them on
                            // every upload; --base-dtype keep takes a GGUF's blocks after loading)
} InitOptions;

// The start of a run: with o->resume and a complete checkpoint in o->out_dir, the weights and
// state come from it; otherwise the source's weights are loaded, or the store is randomly
// initialised. ts is initialised either way; the source's weight files are released afterwards.
// With LoRA (m->tt.lora.r > 0) the base always comes from the source (or the random init) and
// the adapters from the checkpoint, o->lora_init or their init (lora_init_random).
int checkpoint_init_weights(const InitOptions* o, ModelSource* src, const Model* m, Store* s,
                            TrainState* ts, const char* args_json, char* err);

// Write dir/step_<ts->step>/:
//   model.safetensors, config.json   the fp32 master weights in HF layout (--model can load it);
//                                    with LoRA no model.safetensors (the base is frozen) but
//                                    adapter_config.json + adapter_model.safetensors (PEFT)
//   train_state.safetensors          m.<HF name>, v.<HF name> (F32) of the trainable tensors
//                                    (LoRA: m.<PEFT key> of the adapters), step (I64), dataloader (U8),
//                                    rng.mt (U32 [624]), rng.index, rng.has_spare (I32), rng.spare
//   args.json                        the flags of the run (args_json)
//   pending_weights.safetensors      only with ts->pending_bytes: layer.<l> = the weights the
//                                    next iteration of the delayed update computes with
//   DONE                             written last: only a directory holding it is complete.
//                                    "step <N>", then one line per file above: its name, its
//                                    size in bytes and its CRC-32C (8 hex digits), e.g.
//                                    "model.safetensors 3291864 e3069283"
// The files go to dir/step_<N>.tmp (each fsync'd), which is renamed to step_<N> before DONE is
// written. Then only the newest `keep` complete checkpoints stay (keep 0: all).
int checkpoint_save_state(const char* dir, int keep, const Model* m, const Store* s,
                          const TrainState* ts, const char* args_json, char* err);
// Data parallel (ZeRO-1: each rank holds the fp32 weights, m and v of its shard only): the
// checkpoint written from layers gathered one at a time, so the writing rank holds one layer
// more than its shard, never the whole state. layer(ctx, field, l, err) makes layer l's fp32
// weights (field 0), AdamW m (1) or v (2) complete in the writer's Store (and may give the
// previous layer's back); it is called before their tensors are written, in the files' order,
// on every rank (the ranks with writer 0 write nothing and only take part: the gathers are
// collectives). 0, or -1 with err.
typedef struct CkptGather {
    int (*layer)(void* ctx, int field, int l, char* err);
    void* ctx;
    int writer;
} CkptGather;
// checkpoint_save_state with g (NULL: checkpoint_save_state itself); the files are the same.
int checkpoint_save_state_gathered(const char* dir, int keep, const Model* m, const Store* s,
                                   const TrainState* ts, const char* args_json,
                                   const CkptGather* g, char* err);
// The newest complete checkpoint (step_<N> holding DONE) in dir: 1 and its path and step,
// 0 if there is none (or dir does not exist), -1 on an error.
int checkpoint_find_latest(const char* dir, char* path, size_t cap, int64_t* step, char* err);
// Check the files step_dir/DONE lists against their sizes and CRC-32C: 1 when all match (*n_files
// of them, may be NULL), 0 when DONE records no checksums (an older checkpoint: nothing to
// check), -1 with err naming the first file that is missing, truncated or corrupt (or a damaged
// DONE). --resume (checkpoint_init_weights) takes the newest complete checkpoint that passes,
// saying which file made it pass over a newer one; with none left the run starts from step 0.
int checkpoint_verify(const char* step_dir, int* n_files, char* err);
// Load a checkpoint written by checkpoint_save_state: the model config must match m's, the
// weights, m, v and step go to the store, the rest to ts. Prints a warning for every training
// flag that differs from args.json (args_json: this run's flags).
int checkpoint_load_state(const char* step_dir, const Model* m, Store* s, TrainState* ts,
                          const char* args_json, char* err);

// ----------------------------------------------------------------------------
// exports

#define EXPORT_DEFAULT_SHARD_BYTES 5000000000ull  // transformers' max_shard_size "5GB"

// The host memory the exports take while they are written, on top of the store (the larger of
// the two, as they run one after the other): with hf, the converted copies of one shard (bf16 /
// f16; none for f32); with gguf, the permuted q/k weights of a LLaMA.
double checkpoint_export_bytes(const Model* m, int hf, ExportDtype dtype, uint64_t shard_bytes,
                              int gguf);
// dir/: model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json
// when the tensors exceed shard_bytes; config.json; the tokenizer files of an HF source, or
// tokenizer.json + tokenizer_config.json written from a GGUF source's tokenizer.
int checkpoint_export_hf(const char* dir, const Model* m, const Store* s, ExportDtype dtype,
                         uint64_t shard_bytes, const ModelSource* src, char* err);
// One GGUF file (2-D weights in dtype, norms F32), LLaMA q/k rows permuted and rope_freqs.weight
// written as llama.cpp expects, MoE experts in its layout (gguf_tensor_parts), the source GGUF's
// tokenizer records, else records written from the source's tokenizer (padded to the model's
// vocabulary), else tokenizer.ggml.model "no_vocab" (llama.cpp loads that as a model without a
// vocabulary).
int checkpoint_export_gguf(const char* path, const Model* m, const Store* s, ExportDtype dtype,
                           const ModelSource* src, char* err);

#endif  // LLMC_CHECKPOINT_H
