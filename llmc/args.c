/*
 * args.c — getopt_long parsing and validation of the trainer's flags. A bad flag or value is one
 * line on stderr (what is wrong, and the limit it broke) and a hint to --help; exit status 2.
 */
#include "args.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "dist.h"
#include "dp.h"
#include "json.h"
#include "lora.h"
#include "quant.h"

void args_defaults(TrainArgs* a) {
    memset(a, 0, sizeof *a);
    a->model = "tiny";
    a->train = "data/tiny_train.bin";
    a->val = "data/tiny_val.bin";
    a->batch = 16;
    a->seq = 64;
    a->micro_batches = 1;
    a->steps = 500;
    a->lr = 3e-3f;
    a->schedule = LR_COSINE;
    a->warmup = 20;
    a->min_lr_frac = 0.1f;
    a->decay_frac = 0.2f;
    a->weight_decay = 0.1f;
    a->decay_embeddings = 0;
    a->beta1 = 0.9f;
    a->beta2 = 0.95f;
    a->eps = 1e-8f;
    a->grad_clip = 1.0f;
    a->shuffle = 1;
    a->seed = 1337;
    a->eval_every = 100;
    a->eval_batches = 8;
    a->out = "";
    a->log = "";
    a->device = DEVICE_CPU;
    a->n_devices = 0;
    a->threads = 0;
    a->dump_state = "";
    a->sample_tokens = 64;
    a->prompt = "";
    a->temperature = 0.8f;
    a->init_std = 0.02f;
    rl_args_defaults(&a->rl);
    a->round_micro_batches = 0;
    a->recompute_layer = 0;
    a->sync = -1;  // unset: resolved after the flags (the delayed update, or 1 for on-policy GRPO)
    a->split_rounds = -1;  // auto: the trainer decides once the plan is known
    a->plan_only = 0;
    a->device_mem = 0;
    a->delay_us = 0;
    a->trace = "";
    a->profile_steps = 3;
    a->mlp_chunk = -1;  // auto
    a->host_single = 0;
    a->save_every = 0;
    a->keep = 0;
    a->resume = 0;
    a->allow_overcommit = 0;
    a->export_hf = "";
    a->export_gguf = "";
    a->export_dtype = EXPORT_F32;
    a->export_shard_bytes = 5e9;  // transformers' max_shard_size "5GB"
    a->dist_init = "";
    a->dist_rank = -1;
    a->dist_world = 0;
    a->dist_timeout = (float)DIST_DEFAULT_TIMEOUT_S;
    a->net_gbps = 100.0f;
    a->step_ms = 0.0f;
    a->lora_r = 0;
    a->lora_alpha = 8.0f;  // PEFT's LoraConfig default
    a->lora_targets = LORA_ALL_LINEAR;
    a->lora_targets_arg = "all-linear";
    a->lora_dropout = 0.0f;
    a->rslora = 0;
    a->lora_init = "";
    a->export_lora = "";
    a->merge_lora = 0;
    a->lora_flag = NULL;
    a->base_dtype = BASE_DTYPE_BF16;
    a->base_dtype_arg = NULL;
    a->mmap_base = 0;
}

void args_usage(FILE* f) {
    TrainArgs d;
    args_defaults(&d);
    fprintf(f,
        "usage: ./train_roundpipe [flags]\n"
        "With no flags: train the built-in tiny model on the shipped arithmetic corpus.\n"
        "\n"
        "model and data\n"
        "  -e, --model M          preset name, HF directory, config.json, .safetensors or .gguf\n"
        "                         (default %s)\n"
        "                         presets:",
        d.model);
    for (const char* const* p = config_preset_names(); *p; p++) fprintf(f, " %s", *p);
    fprintf(f,
        "\n"
        "  -i, --train GLOB       training token shards (default %s)\n"
        "  -j, --val GLOB         validation token shards, \"\" for none (default %s)\n"
        "  -b, --batch B          sequences per optimizer step (default %d)\n"
        "  -t, --seq T            tokens per sequence (default %d)\n"
        "  -m, --micro-batches M  split each batch into M micro-batches (sizes differ by at most\n"
        "                         one sequence; M <= B) (default %d)\n"
        "      --shuffle 0|1      shuffle training windows each epoch (default %d)\n"
        "      --seed S           seed for init, shuffling and sampling (default %u)\n"
        "      --init-std X       std of the random init of matrices (default %g)\n"
        "      --layers N         keep only the model's first N decoder blocks (a shallower\n"
        "                         copy of a big model for benchmarks on small hosts)\n"
        "\n"
        "optimisation\n"
        "  -x, --steps N          optimizer steps (default %d)\n"
        "  -l, --lr X             peak learning rate (default %g)\n"
        "      --schedule S       constant | cosine | linear | wsd (default %s)\n"
        "  -u, --warmup N         linear warmup steps (default %d)\n"
        "  -q, --min-lr-frac X    final lr as a fraction of the peak (default %g)\n"
        "      --decay-frac X     wsd: fraction of post-warmup steps spent decaying (default %g)\n"
        "  -c, --weight-decay X   AdamW decoupled weight decay on matrices (default %g)\n"
        "      --decay-embeddings 0|1  also decay the token embedding (default %d)\n"
        "      --beta1 X          AdamW beta1 (default %g)\n"
        "      --beta2 X          AdamW beta2 (default %g)\n"
        "      --eps X            AdamW epsilon (default %g)\n"
        "      --grad-clip X      global gradient-norm clip, 0 = off (default %g)\n"
        "\n"
        "evaluation, output\n"
        "  -v, --eval-every N     validation loss every N steps and at the start and the end;\n"
        "                         0 = only at the start and the end (default %d)\n"
        "      --eval-batches N   batches per validation pass (default %d)\n"
        "  -o, --out DIR          write the trained model (model.safetensors + config.json) here;\n"
        "                         with --save-every also the checkpoints DIR/step_<N>/; one run\n"
        "                         per DIR (a second one is refused with the first one's pid)\n"
        "      --save-every N     training-state checkpoint (weights, AdamW state, data and RNG\n"
        "                         position, config, flags) every N steps and at the last step into\n"
        "                         --out DIR/step_<N>/, atomically (DONE marks it complete); 0 = none\n"
        "                         (default 0)\n"
        "      --keep K           keep only the newest K checkpoints, 0 = all (default 0)\n"
        "      --resume           continue bit-exactly from the newest complete checkpoint in --out\n"
        "                         whose files match the CRC-32C checksums in its DONE (a damaged\n"
        "                         one is named and the one before it tried; none: step 0)\n"
        "      --export-hf DIR    at the end, write DIR in HF layout (safetensors, sharded with an\n"
        "                         index past --export-shard-size, config.json, tokenizer files)\n"
        "      --export-gguf FILE at the end, write a GGUF file (llama.cpp layout, with the\n"
        "                         model's tokenizer)\n"
        "      --export-dtype D   f32 | bf16 | f16: weight dtype of the exports (default f32)\n"
        "      --export-shard-size BYTES  --export-hf shard size, e.g. 2G (default 5000000000)\n"
        "      --log FILE         JSON-lines log: one object per step and per evaluation; a\n"
        "                         resumed run appends {\"resume\": N} and then its steps from N+1\n"
        "      --dump-state FILE  forward+backward on the first (unshuffled) batch, write the loss\n"
        "                         and grad.<HF name> tensors as safetensors, exit\n"
        "      --sample-tokens N  tokens generated at the end, 0 = none (default %d)\n"
        "      --prompt TEXT      generation prompt, after the document token (EOT); encoded by\n"
        "                         the model's tokenizer (tokenizer.json beside the model, or the\n"
        "                         GGUF's), or as bytes for byte-level vocabularies (default \"\")\n"
        "      --temperature X    sampling temperature, 0 = greedy (default %g)\n"
        "\n"
        "execution\n"
        "      --device D         cpu (plain training), cpu:N (RoundPipe engine over N emulated\n"
        "                         devices), cuda, cuda:N (default cpu)\n"
        "      --threads N        CPU threads, 0 = all (with GPUs the optimizer gets all but one\n"
        "                         CPU per GPU and one, pinned apart) (default %d)\n"
        "      --mlp-chunk ROWS   long sequences: run the MLP in chunks of ROWS tokens and keep\n"
        "                         none of its activations, nor the block's norm output, q/k/v\n"
        "                         projection and residual (recomputed in the backward); 0 = off;\n"
        "                         auto = 16384 with the engine when micro-batches hold more\n"
        "                         than 65536 tokens, no plan fits without, or the chunked plan\n"
        "                         is cheaper (default auto)\n"
        "      --allow-overcommit start even when the run's host memory estimate exceeds what\n"
        "                         the machine has available (MemAvailable, the cgroup limit):\n"
        "                         a warning instead of the refusal (exit 2)\n"
        "\n"
        "LoRA (adapters on a frozen base; --device cpu, cpu:N, cuda and cuda:N)\n"
        "      --lora-r R         adapter rank; 0 = off, full fine-tuning (default 0)\n"
        "      --lora-alpha A     scale alpha / r (default %g)\n"
        "      --lora-targets L   all-linear (every linear but the LM head) or a comma list of\n"
        "                         q, k, v, o, gate, up, down, router, experts (default\n"
        "                         all-linear; on Qwen3-MoE: attention, router, experts)\n"
        "      --lora-dropout P   dropout on the adapters' input while training, seeded from\n"
        "                         --seed (default 0)\n"
        "      --rslora           scale alpha / sqrt(r) (rank-stabilised LoRA)\n"
        "      --lora-gate-up-rank N  the experts' fused gate/up adapter rank, alpha scaled\n"
        "                         with it (default: 2r on Qwen3-MoE as PEFT's all-linear, r on\n"
        "                         GPT-OSS; r on Qwen3-MoE is PEFT's target_parameters form)\n"
        "      --lora-init DIR    start from a PEFT adapter directory (adapter_config.json,\n"
        "                         adapter_model.safetensors); its r, lora_alpha, target_modules\n"
        "                         and use_rslora must match the flags\n"
        "      --export-lora DIR  at the end, write the adapters as a PEFT adapter directory\n"
        "      --merge-lora       the --export-hf / --export-gguf weights are W + scale*B*A\n"
        "      --base-dtype D     the frozen base's linears and experts on the host and in\n"
        "                         uploads: bf16, q8_0, q4_k, mxfp4 (ggml's block formats,\n"
        "                         quantised on load and dequantised on the device per stage)\n"
        "                         or keep (a GGUF's own Q8_0/Q4_K/MXFP4 tensors) (default bf16)\n"
        "      --mmap-base        read the frozen base from the memory-mapped checkpoint on each\n"
        "                         upload (through pinned staging buffers) instead of holding it\n"
        "                         in host memory: bases larger than the host train (the engine\n"
        "                         only; safetensors F32/F16/BF16, GGUF F32/F16/BF16 or keep)\n"
        "\n"
        "RoundPipe engine (--device cpu:N)\n"
        "      --round M_R        micro-batches per round, M %% M_R == 0, 0 = all (default 0)\n"
        "      --row-chunks K     compute each micro-batch in K row chunks, one after the other\n"
        "                         (activations for a chunk only: more layers fit the fused\n"
        "                         stage); auto = the fewest (<= 8) within 3%% of the cheapest\n"
        "                         plan (default auto)\n"
        "      --recompute G      stage | layer: what the backward recomputes from (default stage)\n"
        "      --sync 0|1         1: synchronous optimizer; 0: one-step-delayed update (default 0;\n"
        "                         1 for on-policy --rl grpo, whose next rollout needs this update)\n"
        "      --device-mem BYTES device memory for parameter stages, e.g. 512M or 80G\n"
        "                         (default: unlimited for emulated devices)\n"
        "      --plan             print the partition, predicted bubble and memory, then exit\n"
        "      --delay-us N       emulated devices: random 0..N us delay before every stream item\n"
        "                         (fault injection for ordering bugs; default 0)\n"
        "      --host-checkpoints single|double  host activation checkpoints: one set (half the\n"
        "                         host memory; the next iteration's producers wait for this\n"
        "                         one's readers) or one per iteration parity (default double)\n"
        "      --profile-steps N  re-plan once from stage times measured over the first N steps\n"
        "                         (the first is dropped as a cold start), then freeze the plan;\n"
        "                         0 keeps the FLOP-based plan (default %d)\n"
        "      --trace FILE       write a Chrome/Perfetto trace (every stage job, transfer and\n"
        "                         optimizer step per device and stream; ui.perfetto.dev)\n"
        "      --profile-ops      GPUs: print each GPU's device time per op and shape (CUDA\n"
        "                         events around every op; slows the run, not the ops)\n"
        "      --split-rounds     several devices, whole model in one stage: each iteration's\n"
        "                         micro-batches are split into one round per device, run at once,\n"
        "                         their gradients added in round order (the optimizer step then\n"
        "                         overlaps the next iteration; same sums, another order; one more\n"
        "                         fp32 gradient set in host memory per extra device). Default on\n"
        "                         2+ GPUs when the plan is one stage, the micro-batches divide\n"
        "                         evenly, no --round is given and host memory has room\n"
        "      --no-split-rounds  never split rounds (the paper's schedule)\n"
        "\n"
        "data parallel (W processes over NCCL, each with a GPU for it; each trains plain or runs\n"
        "the RoundPipe engine on its own devices: --batch and --micro-batches are global, rank r\n"
        "takes sequences r, r+W, ...; ZeRO-1 optimizer; rank 0 logs and saves)\n"
        "      --dist-init URL    tcp://HOST:PORT where rank 0 hands out the communicator's id\n"
        "                         (default: MASTER_ADDR and MASTER_PORT from the environment)\n"
        "      --rank R           this process's rank (default: RANK, else SLURM_PROCID, else 0)\n"
        "      --world W          number of processes (default: WORLD_SIZE, else SLURM_NTASKS,\n"
        "                         else 1)\n"
        "      --dist-timeout S   seconds any rendezvous or collective waits for a missing\n"
        "                         rank before failing with its name (default %g)\n"
        "      --dp-reduce-dtype D  fp32 (default) or bf16: the gradients' dtype on the wire\n"
        "                         (the engine; bf16 halves the traffic, summed in fp32)\n"
        "      --net-gbps G       with --plan --world W: each node's network bandwidth in Gbit/s\n"
        "                         for the gradient and weight traffic (default %g)\n"
        "      --step-ms MS       with --plan --world W: the measured single-node step time to\n"
        "                         project from (default: the model FLOPs at %g%% MFU per GPU)\n"
        "  -h, --help             this text\n"
        "\n"
        "tokenizing text (a mode of its own: no model, no training)\n"
        "      --tokenize IN...   write llm.c token shards from text (.txt: one document each) and\n"
        "                         JSONL files (.jsonl: one document per line), multi-threaded,\n"
        "                         the document token before each document\n"
        "      --tokenizer FILE   with --tokenize: tokenizer.json, a model directory holding one,\n"
        "                         or a .gguf (byte-level BPE: GPT-2, LLaMA-3, Qwen2/Qwen3)\n"
        "      --out-shards PREFIX  with --tokenize: write PREFIX_val_000000.bin, ... and\n"
        "                         PREFIX_train_000001.bin, ...\n"
        "      --val-frac X       with --tokenize: share of tokens (whole documents) for validation\n"
        "                         (default 0.01); more: --tokenize --help\n"
        "\n"
        "Outputs (--out, --export-hf, --export-gguf, --log, --trace, --dump-state) are checked\n"
        "before anything is loaded: folders are created as needed (the output folders and the\n"
        "folders of output files, with their parents), each must be writable, and no two outputs\n"
        "(nor an output and an input) may write the same file. SIGINT/SIGTERM (Ctrl-C): the step\n"
        "in progress finishes, a checkpoint (with --out) and the exports are written, exit\n"
        "130/143; a second signal exits at once. A bad flag or value exits with status 2.\n",
        d.train, d.val, d.batch, d.seq, d.micro_batches, d.shuffle, d.seed, (double)d.init_std,
        d.steps, (double)d.lr, lr_schedule_name(d.schedule), d.warmup, (double)d.min_lr_frac,
        (double)d.decay_frac, (double)d.weight_decay, d.decay_embeddings, (double)d.beta1,
        (double)d.beta2, (double)d.eps, (double)d.grad_clip, d.eval_every, d.eval_batches,
        d.sample_tokens, (double)d.temperature, d.threads, (double)d.lora_alpha,
        d.profile_steps, (double)d.dist_timeout, (double)d.net_gbps, 100.0 * DP_PLAN_MFU);
    rl_args_usage(f);
}

// ----------------------------------------------------------------------------
// value parsing

// The one line of a bad flag or value, with the hint where the flags are explained.
static int bad(const char* flag, const char* value, const char* what) {
    if (value && *value)
        fprintf(stderr, "train_roundpipe: error: %s '%s': %s (see --help)\n", flag, value, what);
    else
        fprintf(stderr, "train_roundpipe: error: %s: %s (see --help)\n", flag, what);
    return 2;
}

// An integer literal too long for int64 ("99999999999999999999"): parse_int64 refuses it like
// any other bad string, but the user deserves to hear it is too large, not that it is no integer.
static int int_overflows(const char* v, int* negative) {
    const char* p = v;
    *negative = *p == '-';
    if (*p == '-' || *p == '+') p++;
    if (!*p) return 0;
    for (; *p; p++)
        if (!isdigit((unsigned char)*p)) return 0;
    return 1;
}

static int int_in(const char* flag, const char* v, int lo, int hi, int* out) {
    int64_t x;
    char what[96];
    if (parse_int64(v, &x) != 0) {
        int negative;
        if (!int_overflows(v, &negative)) return bad(flag, v, "expected an integer");
        x = negative ? INT64_MIN : INT64_MAX;
    }
    if (x > hi) {
        snprintf(what, sizeof what, "too large (at most %d)", hi);
        return bad(flag, v, what);
    }
    if (x < lo) {
        snprintf(what, sizeof what, "too small (at least %d)", lo);
        return bad(flag, v, what);
    }
    *out = (int)x;
    return 0;
}

// A decimal number that overflows a double ("1e400") is too large (or too small when negative);
// NaN, infinities and words are no numbers. 0: not an overflow.
static int double_overflows(const char* v, int* negative) {
    char* end = NULL;
    errno = 0;
    const double x = strtod(v, &end);
    if (end == v || *end != '\0' || errno != ERANGE || !isinf(x)) return 0;
    // strtod also reads "inf" and "infinity": those are spelled, not overflowed
    for (const char* p = v; *p; p++)
        if (isalpha((unsigned char)*p) && *p != 'e' && *p != 'E') return 0;
    *negative = x < 0;
    return 1;
}

static int float_in(const char* flag, const char* v, double lo, double hi, int lo_open,
                    float* out) {
    double x;
    char what[96];
    if (parse_double(v, &x) != 0) {
        int negative;
        if (!double_overflows(v, &negative)) return bad(flag, v, "expected a finite number");
        x = negative ? -INFINITY : INFINITY;
    }
    if (x > hi) {
        snprintf(what, sizeof what, "too large (at most %g)", hi);
        return bad(flag, v, what);
    }
    if (x < lo || (lo_open && x == lo)) {
        snprintf(what, sizeof what, "too small (%s %g)", lo_open ? "more than" : "at least", lo);
        return bad(flag, v, what);
    }
    *out = (float)x;
    return 0;
}

static int parse_device(TrainArgs* a, const char* v) {
    const char* colon = strchr(v, ':');
    size_t kind_len = colon ? (size_t)(colon - v) : strlen(v);
    if (kind_len == 3 && strncmp(v, "cpu", 3) == 0) a->device = DEVICE_CPU;
    else if (kind_len == 4 && strncmp(v, "cuda", 4) == 0) a->device = DEVICE_CUDA;
    else return bad("--device", v, "expected cpu, cuda, cpu:N or cuda:N");
    a->n_devices = 0;
    if (colon) {
        int64_t n;
        int negative;
        if (parse_int64(colon + 1, &n) != 0) {
            if (!int_overflows(colon + 1, &negative))
                return bad("--device", v, "N must be an integer between 1 and 64");
            n = negative ? -1 : 65;
        }
        if (n > 64) return bad("--device", v, "N too large (at most 64 devices)");
        if (n < 1) return bad("--device", v, "N too small (at least 1 device)");
        a->n_devices = (int)n;
    }
    return 0;
}

enum {
    OPT_SHUFFLE = 1000, OPT_SEED, OPT_SCHEDULE, OPT_BETA1, OPT_BETA2, OPT_EPS, OPT_CLIP, OPT_LOG,
    OPT_DEVICE, OPT_THREADS, OPT_DUMP, OPT_EVAL_BATCHES, OPT_SAMPLE, OPT_PROMPT, OPT_DECAY_FRAC,
    OPT_DECAY_EMB, OPT_INIT_STD, OPT_TEMPERATURE, OPT_ROUND, OPT_ROW_CHUNKS, OPT_RECOMPUTE, OPT_SYNC, OPT_PLAN,
    OPT_DEVICE_MEM, OPT_DELAY, OPT_TRACE, OPT_PROFILE_OPS, OPT_SPLIT_ROUNDS, OPT_NO_SPLIT_ROUNDS, OPT_PROFILE_STEPS, OPT_MLP_CHUNK, OPT_HOST_CKPT, OPT_SAVE_EVERY, OPT_KEEP, OPT_RESUME, OPT_EXPORT_HF,
    OPT_EXPORT_GGUF, OPT_EXPORT_DTYPE, OPT_EXPORT_SHARD, OPT_LAYERS,
    OPT_ALLOW_OVERCOMMIT, OPT_DIST_INIT, OPT_RANK, OPT_WORLD, OPT_DIST_TIMEOUT, OPT_DP_REDUCE, OPT_NET_GBPS, OPT_STEP_MS,
    OPT_LORA_R, OPT_LORA_ALPHA, OPT_LORA_TARGETS, OPT_LORA_DROPOUT,
    OPT_RSLORA, OPT_LORA_INIT, OPT_EXPORT_LORA, OPT_MERGE_LORA, OPT_BASE_DTYPE, OPT_MMAP_BASE,
    OPT_LORA_GATE_UP_RANK
};

// "512M", "80G", "1e9": bytes with an optional K/M/G/T suffix (powers of 1024). -1: not a
// size; -2: a size too large to be one (more than 2^60 bytes, or overflowing).
static int parse_bytes(const char* v, double* out) {
    char buf[64];
    size_t n = strlen(v);
    if (n == 0 || n >= sizeof buf) return -1;
    str_copy(buf, sizeof buf, v);
    double mult = 1.0;
    char last = buf[n - 1];
    if (last == 'K' || last == 'k') mult = 1024.0;
    if (last == 'M' || last == 'm') mult = 1024.0 * 1024.0;
    if (last == 'G' || last == 'g') mult = 1024.0 * 1024.0 * 1024.0;
    if (last == 'T' || last == 't') mult = 1024.0 * 1024.0 * 1024.0 * 1024.0;
    if (mult > 1.0) buf[n - 1] = '\0';
    double x;
    int negative = 0;
    if (parse_double(buf, &x) != 0) return double_overflows(buf, &negative) && !negative ? -2 : -1;
    if (x <= 0) return -1;
    if (x * mult > 0x1p60) return -2;  // an exbibyte: no device or shard is that large
    *out = x * mult;
    return 0;
}

int args_parse_bytes(const char* v, double* out) { return parse_bytes(v, out); }

// Edit distance of two short strings (flag names), capped at 63 characters each.
static int edit_distance(const char* x, const char* y) {
    int nx = (int)strlen(x), ny = (int)strlen(y);
    if (nx > 63) nx = 63;
    if (ny > 63) ny = 63;
    int d[64][64];
    for (int i = 0; i <= nx; i++) d[i][0] = i;
    for (int j = 0; j <= ny; j++) d[0][j] = j;
    for (int i = 1; i <= nx; i++)
        for (int j = 1; j <= ny; j++) {
            const int sub = d[i - 1][j - 1] + (x[i - 1] != y[j - 1]);
            d[i][j] = imin(sub, imin(d[i - 1][j] + 1, d[i][j - 1] + 1));
        }
    return d[nx][ny];
}

// The known long flag closest to an unknown one ("--batchs" -> "batch"), or NULL when none is
// within a third of its length.
static const char* closest_flag(const struct option* opts, const char* flag) {
    const char* name = flag;
    while (*name == '-') name++;
    char given[64];
    str_copy(given, sizeof given, name);
    given[strcspn(given, "=")] = '\0';  // --flag=value
    if (!given[0]) return NULL;
    const char* best = NULL;
    int best_d = (int)strlen(given) / 3 + 1;
    for (const struct option* o = opts; o->name; o++) {
        const int dist = edit_distance(given, o->name);
        if (dist < best_d) {
            best_d = dist;
            best = o->name;
        }
    }
    return best;
}

// The LoRA flags together: every other --lora-* flag needs --lora-r.
static int check_lora(const TrainArgs* a) {
    if (a->lora_r == 0) {
        if (a->lora_flag)
            return bad(a->lora_flag, "", "needs --lora-r R (LoRA is off without a rank)");
        if (a->base_dtype_arg && a->base_dtype != BASE_DTYPE_BF16)
            return bad("--base-dtype", a->base_dtype_arg, "holds a frozen base in a block format: "
                       "LoRA runs only (give --lora-r R; full fine-tuning trains every weight)");
        if (a->mmap_base)
            return bad("--mmap-base", "", "maps a frozen base: LoRA runs only (give --lora-r R; "
                       "full fine-tuning updates every weight)");
        return 0;
    }
    if (a->merge_lora && !*a->export_hf && !*a->export_gguf)
        return bad("--merge-lora", "", "merges the adapters into the --export-hf / --export-gguf "
                   "weights: give one of them");
    if (a->mmap_base && a->n_devices == 0 && a->device != DEVICE_CUDA)
        return bad("--mmap-base", "", "the base is read on upload: it needs the RoundPipe engine "
                   "(--device cpu:N or cuda); the plain trainer reads it from host memory");
    if (a->mmap_base && !a->plan_only &&
        (a->val[0] || a->sample_tokens > 0 || a->dump_state[0] || a->export_hf[0] ||
         a->export_gguf[0] || a->merge_lora))
        return bad("--mmap-base", "", "--val, --sample-tokens, --dump-state and the HF / GGUF "
                   "exports read the base from host memory, which a mapped base is not in (give "
                   "--val '' --sample-tokens 0, no exports)");
    if (*a->lora_init && !dir_exists(a->lora_init))
        return bad("--lora-init", a->lora_init, "no such directory (a PEFT adapter directory)");
    return 0;
}

int args_parse(TrainArgs* a, int argc, char** argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'e'},        {"train", required_argument, 0, 'i'},
        {"val", required_argument, 0, 'j'},          {"batch", required_argument, 0, 'b'},
        {"seq", required_argument, 0, 't'},          {"micro-batches", required_argument, 0, 'm'},
        {"steps", required_argument, 0, 'x'},        {"lr", required_argument, 0, 'l'},
        {"schedule", required_argument, 0, OPT_SCHEDULE},
        {"warmup", required_argument, 0, 'u'},       {"min-lr-frac", required_argument, 0, 'q'},
        {"decay-frac", required_argument, 0, OPT_DECAY_FRAC},
        {"weight-decay", required_argument, 0, 'c'},
        {"decay-embeddings", required_argument, 0, OPT_DECAY_EMB},
        {"beta1", required_argument, 0, OPT_BETA1}, {"beta2", required_argument, 0, OPT_BETA2},
        {"eps", required_argument, 0, OPT_EPS},      {"grad-clip", required_argument, 0, OPT_CLIP},
        {"shuffle", required_argument, 0, OPT_SHUFFLE},
        {"seed", required_argument, 0, OPT_SEED},    {"init-std", required_argument, 0, OPT_INIT_STD},
        {"eval-every", required_argument, 0, 'v'},
        {"eval-batches", required_argument, 0, OPT_EVAL_BATCHES},
        {"out", required_argument, 0, 'o'},          {"log", required_argument, 0, OPT_LOG},
        {"device", required_argument, 0, OPT_DEVICE},
        {"threads", required_argument, 0, OPT_THREADS},
        {"dump-state", required_argument, 0, OPT_DUMP},
        {"sample-tokens", required_argument, 0, OPT_SAMPLE},
        {"prompt", required_argument, 0, OPT_PROMPT},
        {"temperature", required_argument, 0, OPT_TEMPERATURE},
        {"round", required_argument, 0, OPT_ROUND},
        {"row-chunks", required_argument, 0, OPT_ROW_CHUNKS},
        {"recompute", required_argument, 0, OPT_RECOMPUTE},
        {"sync", required_argument, 0, OPT_SYNC},
        {"plan", no_argument, 0, OPT_PLAN},
        {"device-mem", required_argument, 0, OPT_DEVICE_MEM},
        {"delay-us", required_argument, 0, OPT_DELAY},
        {"trace", required_argument, 0, OPT_TRACE},
        {"profile-ops", no_argument, 0, OPT_PROFILE_OPS},
        {"split-rounds", no_argument, 0, OPT_SPLIT_ROUNDS},
        {"no-split-rounds", no_argument, 0, OPT_NO_SPLIT_ROUNDS},
        {"profile-steps", required_argument, 0, OPT_PROFILE_STEPS},
        {"mlp-chunk", required_argument, 0, OPT_MLP_CHUNK},
        {"layers", required_argument, 0, OPT_LAYERS},
        {"host-checkpoints", required_argument, 0, OPT_HOST_CKPT},
        {"save-every", required_argument, 0, OPT_SAVE_EVERY},
        {"keep", required_argument, 0, OPT_KEEP},
        {"resume", no_argument, 0, OPT_RESUME},
        {"export-hf", required_argument, 0, OPT_EXPORT_HF},
        {"export-gguf", required_argument, 0, OPT_EXPORT_GGUF},
        {"export-dtype", required_argument, 0, OPT_EXPORT_DTYPE},
        {"export-shard-size", required_argument, 0, OPT_EXPORT_SHARD},
        {"allow-overcommit", no_argument, 0, OPT_ALLOW_OVERCOMMIT},
        {"dist-init", required_argument, 0, OPT_DIST_INIT},
        {"rank", required_argument, 0, OPT_RANK},
        {"world", required_argument, 0, OPT_WORLD},
        {"dist-timeout", required_argument, 0, OPT_DIST_TIMEOUT},
        {"dp-reduce-dtype", required_argument, 0, OPT_DP_REDUCE},
        {"net-gbps", required_argument, 0, OPT_NET_GBPS},
        {"step-ms", required_argument, 0, OPT_STEP_MS},
        {"lora-r", required_argument, 0, OPT_LORA_R},
        {"lora-alpha", required_argument, 0, OPT_LORA_ALPHA},
        {"lora-targets", required_argument, 0, OPT_LORA_TARGETS},
        {"lora-dropout", required_argument, 0, OPT_LORA_DROPOUT},
        {"rslora", no_argument, 0, OPT_RSLORA},
        {"lora-gate-up-rank", required_argument, 0, OPT_LORA_GATE_UP_RANK},
        {"lora-init", required_argument, 0, OPT_LORA_INIT},
        {"export-lora", required_argument, 0, OPT_EXPORT_LORA},
        {"merge-lora", no_argument, 0, OPT_MERGE_LORA},
        {"base-dtype", required_argument, 0, OPT_BASE_DTYPE},
        {"mmap-base", no_argument, 0, OPT_MMAP_BASE},
        {"help", no_argument, 0, 'h'},
        RL_ARGS_OPTIONS,
        {0, 0, 0, 0}};
    optind = 1;
    opterr = 0;
    for (;;) {
        int idx = 0;
        int c = getopt_long(argc, argv, ":e:i:j:b:t:m:x:l:u:q:c:v:o:h", opts, &idx);
        if (c == -1) break;
        const char* v = optarg;
        int rc = 0;
        switch (c) {
            case 'e': a->model = v; break;
            case 'i': a->train = v; break;
            case 'j': a->val = v; break;
            case 'b': rc = int_in("--batch", v, 1, 1 << 20, &a->batch); break;
            case 't': rc = int_in("--seq", v, 1, 1 << 24, &a->seq); break;
            case 'm': rc = int_in("--micro-batches", v, 1, 1 << 20, &a->micro_batches); break;
            case OPT_LAYERS: rc = int_in("--layers", v, 1, CONFIG_MAX_LAYERS, &a->layers); break;
            case 'x': rc = int_in("--steps", v, 0, 1 << 30, &a->steps); break;
            case 'l': rc = float_in("--lr", v, 0.0, 10.0, 1, &a->lr); break;
            case OPT_SCHEDULE:
                if (lr_schedule_parse(v, &a->schedule) != 0)
                    rc = bad("--schedule", v, "expected constant, cosine, linear or wsd");
                break;
            case 'u': rc = int_in("--warmup", v, 0, 1 << 30, &a->warmup); break;
            case 'q': rc = float_in("--min-lr-frac", v, 0.0, 1.0, 0, &a->min_lr_frac); break;
            case OPT_DECAY_FRAC: rc = float_in("--decay-frac", v, 0.0, 1.0, 0, &a->decay_frac); break;
            case 'c': rc = float_in("--weight-decay", v, 0.0, 10.0, 0, &a->weight_decay); break;
            case OPT_DECAY_EMB: rc = int_in("--decay-embeddings", v, 0, 1, &a->decay_embeddings); break;
            case OPT_BETA1: rc = float_in("--beta1", v, 0.0, 0.999999, 0, &a->beta1); break;
            case OPT_BETA2: rc = float_in("--beta2", v, 0.0, 0.9999999, 0, &a->beta2); break;
            case OPT_EPS: rc = float_in("--eps", v, 0.0, 1.0, 1, &a->eps); break;
            case OPT_CLIP: rc = float_in("--grad-clip", v, 0.0, 1e9, 0, &a->grad_clip); break;
            case OPT_SHUFFLE: rc = int_in("--shuffle", v, 0, 1, &a->shuffle); break;
            case OPT_SEED: {
                int64_t s;
                int negative = 0;
                if (parse_int64(v, &s) != 0) {
                    if (!int_overflows(v, &negative)) {
                        rc = bad("--seed", v, "expected an integer in [0, 4294967295]");
                        break;
                    }
                    s = negative ? -1 : INT64_MAX;
                }
                if (s < 0) rc = bad("--seed", v, "too small (at least 0)");
                else if (s > 0xffffffffll) rc = bad("--seed", v, "too large (at most 4294967295)");
                else a->seed = (uint32_t)s;
                break;
            }
            case OPT_INIT_STD: rc = float_in("--init-std", v, 0.0, 10.0, 1, &a->init_std); break;
            case 'v': rc = int_in("--eval-every", v, 0, 1 << 30, &a->eval_every); break;
            case OPT_EVAL_BATCHES: rc = int_in("--eval-batches", v, 1, 1 << 20, &a->eval_batches); break;
            case 'o': a->out = v; break;
            case OPT_LOG: a->log = v; break;
            case OPT_DEVICE: rc = parse_device(a, v); break;
            case OPT_THREADS: rc = int_in("--threads", v, 0, 4096, &a->threads); break;
            case OPT_DUMP: a->dump_state = v; break;
            case OPT_SAMPLE: rc = int_in("--sample-tokens", v, 0, 1 << 20, &a->sample_tokens); break;
            case OPT_PROMPT: a->prompt = v; break;
            case OPT_ROUND: rc = int_in("--round", v, 0, 1 << 20, &a->round_micro_batches); break;
            case OPT_ROW_CHUNKS:
                if (strcmp(v, "auto") == 0) a->row_chunks = 0;
                else rc = int_in("--row-chunks", v, 1, 1 << 20, &a->row_chunks);
                break;
            case OPT_RECOMPUTE:
                if (strcmp(v, "stage") == 0) a->recompute_layer = 0;
                else if (strcmp(v, "layer") == 0) a->recompute_layer = 1;
                else rc = bad("--recompute", v, "expected stage or layer");
                break;
            case OPT_SYNC: rc = int_in("--sync", v, 0, 1, &a->sync); break;
            case OPT_PLAN: a->plan_only = 1; break;
            case OPT_DEVICE_MEM: {
                const int pb = parse_bytes(v, &a->device_mem);
                if (pb == -2) rc = bad("--device-mem", v, "too large (at most 2^60 bytes)");
                else if (pb != 0)
                    rc = bad("--device-mem", v, "expected a positive size such as 512M or 80G");
                break;
            }
            case OPT_DELAY: rc = int_in("--delay-us", v, 0, 1000000, &a->delay_us); break;
            case OPT_TRACE: a->trace = v; break;
            case OPT_PROFILE_OPS: a->profile_ops = 1; break;
            case OPT_SPLIT_ROUNDS: a->split_rounds = 1; break;
            case OPT_NO_SPLIT_ROUNDS: a->split_rounds = 0; break;
            case OPT_HOST_CKPT:
                if (strcmp(v, "single") == 0) a->host_single = 1;
                else if (strcmp(v, "double") == 0) a->host_single = 0;
                else rc = bad("--host-checkpoints", v, "expected single or double");
                break;
            case OPT_MLP_CHUNK:
                if (strcmp(v, "auto") == 0) a->mlp_chunk = -1;
                else rc = int_in("--mlp-chunk", v, 0, 1 << 30, &a->mlp_chunk);
                break;
            case OPT_PROFILE_STEPS: rc = int_in("--profile-steps", v, 0, 1000, &a->profile_steps); break;
            case OPT_SAVE_EVERY: rc = int_in("--save-every", v, 0, 1 << 30, &a->save_every); break;
            case OPT_KEEP: rc = int_in("--keep", v, 0, 1 << 30, &a->keep); break;
            case OPT_RESUME: a->resume = 1; break;
            case OPT_ALLOW_OVERCOMMIT: a->allow_overcommit = 1; break;
            case OPT_DIST_INIT: {
                char host[256], err[ERR_LEN];
                int port = 0;
                if (dist_parse_url(v, host, sizeof host, &port, err) != 0) {
                    fprintf(stderr, "train_roundpipe: error: %s (see --help)\n", err);
                    rc = 2;
                }
                a->dist_init = v;
                break;
            }
            case OPT_RANK: rc = int_in("--rank", v, 0, DIST_MAX_WORLD - 1, &a->dist_rank); break;
            case OPT_WORLD: rc = int_in("--world", v, 1, DIST_MAX_WORLD, &a->dist_world); break;
            case OPT_DIST_TIMEOUT:
                rc = float_in("--dist-timeout", v, 0.0, 86400.0, 1, &a->dist_timeout);
                break;
            case OPT_DP_REDUCE:
                if (strcmp(v, "fp32") == 0) a->dp_reduce_bf16 = 0;
                else if (strcmp(v, "bf16") == 0) a->dp_reduce_bf16 = 1;
                else rc = bad("--dp-reduce-dtype", v, "expected fp32 or bf16");
                break;
            case OPT_NET_GBPS: rc = float_in("--net-gbps", v, 0.0, 1e6, 1, &a->net_gbps); break;
            case OPT_STEP_MS: rc = float_in("--step-ms", v, 0.0, 1e9, 1, &a->step_ms); break;
            case OPT_LORA_R: rc = int_in("--lora-r", v, 0, 65536, &a->lora_r); break;
            case OPT_LORA_ALPHA:
                rc = float_in("--lora-alpha", v, 0.0, 1e6, 1, &a->lora_alpha);
                if (!a->lora_flag) a->lora_flag = "--lora-alpha";
                break;
            case OPT_LORA_TARGETS: {
                char why[ERR_LEN];
                if (lora_parse_targets(v, &a->lora_targets, why) != 0) rc = bad("--lora-targets", v, why);
                a->lora_targets_arg = v;
                if (!a->lora_flag) a->lora_flag = "--lora-targets";
                break;
            }
            case OPT_LORA_DROPOUT:
                rc = float_in("--lora-dropout", v, 0.0, 0.999, 0, &a->lora_dropout);
                if (!a->lora_flag) a->lora_flag = "--lora-dropout";
                break;
            case OPT_RSLORA:
                a->rslora = 1;
                if (!a->lora_flag) a->lora_flag = "--rslora";
                break;
            case OPT_LORA_GATE_UP_RANK:
                rc = int_in("--lora-gate-up-rank", v, 1, 65536, &a->lora_gate_up_r);
                if (!a->lora_flag) a->lora_flag = "--lora-gate-up-rank";
                break;
            case OPT_LORA_INIT:
                a->lora_init = v;
                if (!a->lora_flag) a->lora_flag = "--lora-init";
                break;
            case OPT_EXPORT_LORA:
                a->export_lora = v;
                if (!a->lora_flag) a->lora_flag = "--export-lora";
                break;
            case OPT_MERGE_LORA:
                a->merge_lora = 1;
                if (!a->lora_flag) a->lora_flag = "--merge-lora";
                break;
            case OPT_BASE_DTYPE: {
                char why[ERR_LEN];
                BaseDtype bd;
                if (quant_parse_base_dtype(v, &bd, why) != 0)
                    rc = bad("--base-dtype", v, "unknown (use bf16, q8_0, q4_k, mxfp4 or keep)");
                a->base_dtype = bd;
                a->base_dtype_arg = v;
                break;
            }
            case OPT_MMAP_BASE: a->mmap_base = 1; break;
            case OPT_EXPORT_HF: a->export_hf = v; break;
            case OPT_EXPORT_GGUF: a->export_gguf = v; break;
            case OPT_EXPORT_DTYPE:
                if (strcmp(v, "f32") == 0) a->export_dtype = EXPORT_F32;
                else if (strcmp(v, "bf16") == 0) a->export_dtype = EXPORT_BF16;
                else if (strcmp(v, "f16") == 0) a->export_dtype = EXPORT_F16;
                else rc = bad("--export-dtype", v, "expected f32, bf16 or f16");
                break;
            case OPT_EXPORT_SHARD: {
                const int pb = parse_bytes(v, &a->export_shard_bytes);
                if (pb == -2) rc = bad("--export-shard-size", v, "too large (at most 2^60 bytes)");
                else if (pb != 0 || a->export_shard_bytes < 1)
                    rc = bad("--export-shard-size", v, "expected a positive size, e.g. 2G");
                break;
            }
            case OPT_TEMPERATURE: rc = float_in("--temperature", v, 0.0, 100.0, 0, &a->temperature); break;
            case 'h': args_usage(stdout); return 1;
            case ':': return bad(argv[optind - 1], "", "needs a value");
            default: {
                if (rl_args_owns(c)) {  // the reinforcement-learning flags (rl_args.c)
                    rc = rl_args_set(&a->rl, c, v);
                    break;
                }
                const char* flag = argv[optind - 1];
                char what[160] = "unknown flag";
                const char* near = closest_flag(opts, flag);
                if (near) snprintf(what, sizeof what, "unknown flag; did you mean --%s?", near);
                fprintf(stderr, "train_roundpipe: error: %s: %s (see --help)\n", flag, what);
                return 2;
            }
        }
        if (rc) return rc;
    }
    if (optind < argc)
        return bad(argv[optind], "", "unexpected argument (every value follows its flag)");
    // cross-flag checks
    // --sync: the delayed update applies step t's gradient during step t + 1, so iteration t + 1
    // computes with the weights before it. On-policy GRPO generates step t + 1's answers with
    // step t's update applied: the delayed update would take its gradient at older weights than
    // the answers' (ratios off 1 at every step; measured: it stops learning). --off-policy 1 is
    // the delayed update's natural schedule: its trainer computes with the weights its answers
    // were generated with.
    const int rl_engine = a->rl.on && (a->n_devices > 0 || a->device == DEVICE_CUDA);
    if (a->sync < 0) a->sync = a->rl.on && !a->rl.off_policy ? 1 : 0;
    else if (a->sync == 0 && rl_engine && !a->rl.off_policy)
        return bad("--sync", "0", "on-policy --rl grpo needs the synchronous update (its next "
                   "rollout uses this step's update, which the delayed one applies a step late): "
                   "leave --sync out, or use --off-policy 1");
    if (a->micro_batches > a->batch) {
        char v[64];
        snprintf(v, sizeof v, "%d", a->micro_batches);
        char what[128];
        snprintf(what, sizeof what, "more micro-batches than the %d sequences of --batch", a->batch);
        return bad("--micro-batches", v, what);
    }
    if (a->round_micro_batches > 0 && a->micro_batches % a->round_micro_batches != 0) {
        char v[32];
        snprintf(v, sizeof v, "%d", a->round_micro_batches);
        return bad("--round", v, "must divide --micro-batches");
    }
    if (a->trace[0] && a->n_devices == 0 && a->device != DEVICE_CUDA)
        return bad("--trace", a->trace,
                   "traces the RoundPipe engine: use it with --device cpu:N, cuda or cuda:N");
    if (a->split_rounds == 1 && a->n_devices == 0 && a->device != DEVICE_CUDA)
        return bad("--split-rounds", "", "splits rounds over several devices: use it with --device "
                   "cpu:N or cuda[:N]");
    if (a->split_rounds == 1 && a->round_micro_batches > 0) {
        char v[32];
        snprintf(v, sizeof v, "%d", a->round_micro_batches);
        return bad("--round", v, "cannot be combined with --split-rounds (rounds of M/N)");
    }
    if (a->profile_ops && a->device != DEVICE_CUDA)
        return bad("--profile-ops", "", "times CUDA ops: use it with --device cuda or cuda:N");
    if (!*a->model) return bad("--model", a->model, "must not be empty");
    if (a->save_every > 0 && !*a->out) {
        char v[32];
        snprintf(v, sizeof v, "%d", a->save_every);
        return bad("--save-every", v, "needs --out DIR for the checkpoints");
    }
    if (a->resume && !*a->out) return bad("--resume", "", "needs --out DIR holding the checkpoints");
    if (!*a->train) return bad("--train", a->train, "must not be empty");
    // data parallel: the flags and the launcher's environment must describe one valid rank
    // --plan projects a world size (--world W, llmc/dp.h) without being one of its ranks: no rank,
    // rendezvous address or environment needed
    if (a->plan_only) return check_lora(a);
    DistFlags df = {.init = a->dist_init, .rank = a->dist_rank, .world = a->dist_world,
                    .timeout_s = a->dist_timeout};
    DistConfig dc;
    char err[ERR_LEN];
    if (dist_config_resolve(&dc, &df, dist_getenv, NULL, err) != 0) {
        fprintf(stderr, "train_roundpipe: error: %s (see --help)\n", err);
        return 2;
    }
    // --rl-rollout-ranks R: one trainer rank and R rollout ranks (llmc/grpo.h), not data parallel
    const int rl_ranks = a->rl.on && a->rl.rollout_ranks > 0;
    if (rl_ranks && rl_args_check_world(&a->rl, dc.world, dc.source,
                                             a->device == DEVICE_CUDA) != 0)
        return 2;
    // data parallel over NCCL: plain training (llmc/dp.h) or the engine (docs/DISTRIBUTED.md §6)
    if (dc.world > 1) {
        const char* why = NULL;
        if (a->dump_state[0])
            why = "does not write --dump-state (run it in a single process)";
        else if (a->rl.on && !rl_ranks)
            why = "does not run --rl yet (GRPO trains in a single process for now; "
                  "--rl-rollout-ranks R gives the last R ranks to generation)";
        if (why) {
            fprintf(stderr, "train_roundpipe: error: data parallel %s (world size %d from %s)\n",
                    why, dc.world, dc.source);
            return 2;
        }
        if (!rl_ranks && dp_check_batch(a->batch, a->micro_batches, dc.world, err) != 0) {
            fprintf(stderr, "train_roundpipe: error: data parallel: %s\n", err);
            return 2;
        }
#ifndef HAVE_CUDA
        fprintf(stderr, "train_roundpipe: error: data parallel between processes runs over NCCL: "
                "this binary was built without CUDA (rebuild with nvcc; world size %d from %s)\n",
                dc.world, dc.source);
        return 2;
#endif
    }
    if (check_lora(a) != 0) return 2;
    // (--rl on --device cuda or cpu:N: through the RoundPipe engine, micro-batches of --batch rows)
    const int engine = a->device == DEVICE_CUDA || a->n_devices > 0;
    return rl_args_check(&a->rl, engine ? a->batch : 0, a->temperature, a->seq, a->lora_r > 0);
}

// ----------------------------------------------------------------------------
// args.json

const char* export_dtype_name(ExportDtype d) {
    return d == EXPORT_BF16 ? "bf16" : d == EXPORT_F16 ? "f16" : "f32";
}

char* args_to_json(const TrainArgs* a) {
    char* buf = NULL;
    size_t len = 0;
    FILE* m = open_memstream(&buf, &len);
    if (!m) fatal("open_memstream failed");
    fputs("{\n  \"model\": ", m);
    json_write_string(m, a->model);
    fputs(",\n  \"train\": ", m);
    json_write_string(m, a->train);
    fputs(",\n  \"val\": ", m);
    json_write_string(m, a->val);
    fprintf(m, ",\n  \"batch\": %d,\n  \"seq\": %d,\n  \"micro-batches\": %d,\n  \"steps\": %d",
            a->batch, a->seq, a->micro_batches, a->steps);
    fprintf(m, ",\n  \"lr\": %.9g,\n  \"schedule\": \"%s\",\n  \"warmup\": %d", (double)a->lr,
            lr_schedule_name(a->schedule), a->warmup);
    fprintf(m, ",\n  \"min-lr-frac\": %.9g,\n  \"decay-frac\": %.9g,\n  \"weight-decay\": %.9g",
            (double)a->min_lr_frac, (double)a->decay_frac, (double)a->weight_decay);
    fprintf(m, ",\n  \"decay-embeddings\": %d,\n  \"beta1\": %.9g,\n  \"beta2\": %.9g",
            a->decay_embeddings, (double)a->beta1, (double)a->beta2);
    fprintf(m, ",\n  \"eps\": %.9g,\n  \"grad-clip\": %.9g,\n  \"shuffle\": %d,\n  \"seed\": %u",
            (double)a->eps, (double)a->grad_clip, a->shuffle, a->seed);
    fprintf(m, ",\n  \"init-std\": %.9g,\n  \"eval-every\": %d,\n  \"eval-batches\": %d",
            (double)a->init_std, a->eval_every, a->eval_batches);
    fputs(",\n  \"out\": ", m);
    json_write_string(m, a->out);
    fprintf(m, ",\n  \"save-every\": %d,\n  \"keep\": %d,\n  \"device\": \"%s\",\n"
               "  \"devices\": %d,\n  \"threads\": %d",
            a->save_every, a->keep, a->device == DEVICE_CUDA ? "cuda" : "cpu", a->n_devices,
            a->threads);
    fprintf(m, ",\n  \"round\": %d,\n  \"recompute\": \"%s\",\n  \"sync\": %d",
            a->round_micro_batches, a->recompute_layer ? "layer" : "stage", a->sync);
    if (a->lora_r > 0) {  // (absent without LoRA: the flags of full fine-tuning runs as before)
        char targets[128];
        lora_targets_string(a->lora_targets, targets, sizeof targets);
        fprintf(m, ",\n  \"lora-r\": %d,\n  \"lora-alpha\": %.9g,\n  \"lora-targets\": \"%s\""
                   ",\n  \"lora-dropout\": %.9g,\n  \"rslora\": %d",
                a->lora_r, (double)a->lora_alpha, targets, (double)a->lora_dropout, a->rslora);
        if (a->base_dtype != BASE_DTYPE_BF16)
            fprintf(m, ",\n  \"base-dtype\": \"%s\"", quant_base_dtype_name(a->base_dtype));
        if (a->mmap_base) fputs(",\n  \"mmap-base\": 1", m);
        if (a->lora_gate_up_r > 0) fprintf(m, ",\n  \"lora-gate-up-rank\": %d", a->lora_gate_up_r);
    }
    rl_args_json(m, &a->rl);  // (absent without --rl)
    fputs("\n}\n", m);
    if (ferror(m) || fclose(m) != 0) fatal("building args.json failed");
    return buf;
}
