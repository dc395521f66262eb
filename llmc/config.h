/*
 * config.h — model configuration: families, built-in presets, HF config.json parsing.
 *
 * One ModelConfig describes every family the trainer knows. Dimension letters follow
 * docs/ARCHITECTURE.md §1.2: V vocab, C model width, L layers, H query heads, KVH kv heads, HD head
 * dim, F ffn width, E experts, K experts per token. Fields a family does not use stay zero.
 */
#ifndef LLMC_CONFIG_H
#define LLMC_CONFIG_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    FAMILY_LLAMA = 0,  // LLaMA-3.x: RMSNorm, RoPE (optionally llama3-scaled), GQA, SwiGLU
    FAMILY_QWEN3,      // Qwen3 dense: LLaMA + per-head RMSNorm of q and k before RoPE
    FAMILY_QWEN3MOE,   // Qwen3-MoE: Qwen3 attention + routed SwiGLU experts (math: MoE issue)
    FAMILY_GPTOSS,     // GPT-OSS: sinks, sliding windows, YaRN, biased clamped experts (MoE issue)
    FAMILY_COUNT
} ModelFamily;

typedef enum { ROPE_DEFAULT = 0, ROPE_LLAMA3, ROPE_YARN } RopeType;

// How an HF checkpoint stores the experts of an MoE block (docs/FORMATS.md §8.2). The
// trainer keeps one layout in memory (tensor.h); this only names the checkpoint's tensors, so a
// model is saved, dumped and exported in the layout it was loaded from.
typedef enum {
    EXPERTS_PER_EXPERT = 0,  // Qwen3-MoE hub: mlp.experts.{e}.{gate,up,down}_proj.weight
    EXPERTS_FUSED,           // transformers 5 Qwen3-MoE: mlp.experts.gate_up_proj [E, 2F, C]
                             // (gate rows, then up rows), mlp.experts.down_proj [E, C, F]
    EXPERTS_GPTOSS           // GPT-OSS: gate_up_proj [E, C, 2F] (x·W, gate/up interleaved),
                             // down_proj [E, F, C], their _bias tensors; MXFP4 *_blocks/_scales
                             // are dequantised on load
} ExpertLayout;

#define CONFIG_MAX_LAYERS 1024

typedef struct ModelConfig {
    char name[64];  // preset name or the source path's basename
    ModelFamily family;
    int V;    // vocab size
    int C;    // hidden size
    int L;    // decoder layers
    int H;    // query heads
    int KVH;  // key/value heads (H % KVH == 0)
    int HD;   // head dim (independent of C/H for Qwen3)
    int F;    // dense MLP width (intermediate_size)
    float norm_eps;
    int tied_embeddings;  // LM head reuses the token embedding
    int qk_norm;          // Qwen3: RMSNorm over HD on q and k before RoPE
    int attention_bias;   // biases on q/k/v/o projections (GPT-OSS)
    int max_pos;          // max_position_embeddings (informational; longer sequences warn)

    // RoPE (half-split rotate_half convention for every family)
    RopeType rope_type;
    double rope_theta;
    double rope_factor;           // llama3 / yarn scaling factor
    double rope_low_freq_factor;  // llama3
    double rope_high_freq_factor; // llama3
    int rope_original_max_pos;    // llama3 / yarn original_max_position_embeddings
    double yarn_beta_fast, yarn_beta_slow;
    int yarn_truncate;

    double rope_attention_factor;  // yarn attention_factor given by the config (0: 0.1 ln f + 1)

    // MoE (Qwen3-MoE, GPT-OSS); unused by dense families
    int E;                // experts (num_experts / num_local_experts)
    int K;                // experts per token (num_experts_per_tok)
    int F_expert;         // expert MLP width (moe_intermediate_size; GPT-OSS intermediate_size)
    int norm_topk_prob;   // Qwen3-MoE: renormalise the top-k probabilities to sum to 1
    int decoder_sparse_step;             // Qwen3-MoE: block i is MoE iff (i + 1) % step == 0 ...
    uint8_t mlp_only[CONFIG_MAX_LAYERS];  // ... and mlp_only[i] == 0 (mlp_only_layers)
    double router_aux_loss_coef;         // weight of the load-balancing loss ...
    int output_router_logits;            // ... which is in the objective only when this is set
    int sliding_window;                  // GPT-OSS sliding attention window W (0 = none)
    uint8_t sliding[CONFIG_MAX_LAYERS];  // GPT-OSS layer_types: 1 = sliding_attention
    float swiglu_limit;   // GPT-OSS clamp (7.0)
    ExpertLayout expert_layout;  // how HF checkpoints of this model hold the experts

    int bos_id, eos_id;  // -1 when unknown
} ModelConfig;

extern const char* const family_names[FAMILY_COUNT];  // "llama", "qwen3", "qwen3moe", "gptoss"

// Fill from a built-in preset ("qwen3-1.7b", "llama3.1-8b", "tiny", ...). -1 + err if unknown.
int config_from_preset(ModelConfig* cfg, const char* name, char* err);
// Names of all presets, NULL-terminated (for --help and error hints).
const char* const* config_preset_names(void);
// Parse an HF config.json (both the legacy rope_theta/rope_scaling form and the transformers-5
// rope_parameters form). Every field is validated; -1 + one line naming the file and field.
int config_from_hf_json(ModelConfig* cfg, const char* path, char* err);
// Check internal consistency (positive sizes, H % KVH, even HD, supported family...).
int config_validate(const ModelConfig* cfg, char* err);
// Write an HF-style config.json text for this config into a malloc'd string.
char* config_to_hf_json(const ModelConfig* cfg);

// Mixture-of-experts structure. config_is_moe: the family routes tokens to experts.
// config_block_is_moe: decoder block `block` has a routed-expert MLP (HF Qwen3MoeDecoderLayer's
// rule; every GPT-OSS block). config_block_window: the block's attention window (0 = full
// causal attention). config_num_moe_blocks: how many blocks have experts.
int config_is_moe(const ModelConfig* cfg);
int config_block_is_moe(const ModelConfig* cfg, int block);
int config_block_window(const ModelConfig* cfg, int block);
int config_num_moe_blocks(const ModelConfig* cfg);
// Keep only the first n decoder blocks (--layers): their per-block settings (MoE or dense,
// sliding windows) stay as they were. -1 + err when n is not in [1, L].
int config_truncate_layers(ModelConfig* cfg, int n, char* err);

// RoPE inverse frequencies, HD/2 floats, after llama3/yarn scaling, computed the way
// transformers does (fp32). Returns the attention scaling factor applied to cos/sin (1 unless yarn).
float config_rope_inv_freq(const ModelConfig* cfg, float* inv_freq);

// Parameter counts. n_mm counts matmul parameters per token (FLOP convention of
// docs/PERFORMANCE.md §1.1; the LM head counts once even when tied; MoE blocks count their router
// and the K active experts, so FLOPs and MFU use active parameters).
int64_t config_num_params(const ModelConfig* cfg);
int64_t config_num_matmul_params(const ModelConfig* cfg);
// Model FLOPs per trained token at sequence length T: 6*N_mm + 6*T*H*HD per block; a
// sliding-window block (window W < T) has 12*(W - W^2/(2T))*H*HD instead (docs/PERFORMANCE.md).
double config_flops_per_token(const ModelConfig* cfg, int T);

void config_print(const ModelConfig* cfg);

#endif  // LLMC_CONFIG_H
