/*
 * checkpoint.h — where a model comes from and where it goes: resolving --model (preset, HF
 * directory, config.json, .safetensors), saving a trained model in HF layout (model.safetensors +
 * config.json), and the --dump-state file (loss + every parameter gradient by HF name).
 */
#ifndef LLMC_CHECKPOINT_H
#define LLMC_CHECKPOINT_H

#include "config.h"
#include "model.h"
#include "safetensors.h"
#include "store.h"

typedef struct ModelSource {
    ModelConfig cfg;
    int has_weights;     // ck is open and holds the weights
    StCheckpoint ck;
    char config_path[1024];  // "" for presets
} ModelSource;

// spec: a preset name, an HF directory (config.json + safetensors), a config.json (random init)
// or a .safetensors file (config.json from the same directory). -1 + one-line error.
int checkpoint_resolve_model(ModelSource* src, const char* spec, char* err);
void checkpoint_close_source(ModelSource* src);

// Write dir/model.safetensors (F32, HF names; tied head omitted) and dir/config.json.
int checkpoint_save_hf(const char* dir, const Model* m, const Store* s, char* err);
// Write the --dump-state file: "loss" F32 [1] and "grad.<HF name>" F32 for every owned tensor
// (store gradients must already be folded: tied heads summed into the embedding).
int checkpoint_dump_state(const char* path, const Model* m, const Store* s, float loss, char* err);

#endif  // LLMC_CHECKPOINT_H
