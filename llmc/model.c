/*
 * model.c — forward and backward of the prefix, decoder blocks and fused postfix, written once
 * against the op table. See model.h for the math and the buffer conventions.
 */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "lora.h"

// Byte address of element `i` of a compute-dtype buffer.
static inline void* at(const Workspace* ws, const void* p, int64_t i) {
    return (char*)p + (size_t)i * (size_t)ws->ops->act_bytes;
}

// ----------------------------------------------------------------------------
// model description

// Offset of the tensor of `kind` in block `block`'s slab, or -1.
static int64_t block_offset(const TensorTable* tt, TensorKind kind, int block) {
    int i = tensor_table_index(tt, kind, block);
    return i < 0 ? -1 : tt->t[i].param_offset;
}

// The same in its gradient slab (-1 also for a frozen tensor).
static int64_t block_grad_offset(const TensorTable* tt, TensorKind kind, int block) {
    int i = tensor_table_index(tt, kind, block);
    return i < 0 ? -1 : tt->t[i].grad_offset;
}

// Block l's offsets of every tensor, in its parameter slab (grad 0) or gradient slab (grad 1).
static void fill_layout(const TensorTable* tt, int l, int grad, BlockLayout* bl) {
    int64_t* slots[] = {&bl->attn_norm, &bl->wqkv,   &bl->q_norm,      &bl->k_norm,
                        &bl->wo,        &bl->mlp_norm, &bl->wgu,       &bl->wdown,
                        &bl->bqkv,      &bl->bo,     &bl->sinks,       &bl->router,
                        &bl->router_bias, &bl->exp_gu, &bl->exp_gu_bias, &bl->exp_down,
                        &bl->exp_down_bias};
    const TensorKind kinds[] = {TK_ATTN_NORM, TK_WQ,       TK_Q_NORM,      TK_K_NORM,
                                TK_WO,        TK_MLP_NORM, TK_W_GATE,      TK_W_DOWN,
                                TK_BQ,        TK_BO,       TK_SINKS,       TK_ROUTER,
                                TK_ROUTER_BIAS, TK_EXP_GATE_UP, TK_EXP_GATE_UP_BIAS,
                                TK_EXP_DOWN,  TK_EXP_DOWN_BIAS};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        *slots[i] = grad ? block_grad_offset(tt, kinds[i], l) : block_offset(tt, kinds[i], l);
    for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
        for (int k = 0; k < 2; k++) {
            const int i = tensor_table_lora_index(tt, l, (LoraTarget)tg, k);
            const int64_t off = i < 0 ? -1 : grad ? tt->t[i].grad_offset : tt->t[i].param_offset;
            if (k) bl->lora_b[tg] = off;
            else bl->lora_a[tg] = off;
        }
    }
}

int model_init(Model* m, const ModelConfig* cfg, int decay_embeddings, char* err) {
    return model_init_lora(m, cfg, decay_embeddings, NULL, err);
}

int model_init_lora(Model* m, const ModelConfig* cfg, int decay_embeddings, const LoraSpec* lora,
                    char* err) {
    memset(m, 0, sizeof *m);
    if (config_validate(cfg, err) != 0) return -1;
    m->cfg = *cfg;
    if (tensor_table_build_lora(&m->tt, cfg, decay_embeddings, lora, err) != 0) return -1;
    m->QKV = (cfg->H + 2 * cfg->KVH) * cfg->HD;
    if (m->tt.lora.r > 0) m->lora_scale = lora_scale(&m->tt.lora);

    // Block layouts relative to each block's slab, read off the table.
    const TensorTable* tt = &m->tt;
    const int64_t C = cfg->C;
    m->layout = calloc_check((size_t)cfg->L, sizeof(BlockLayout));
    m->glayout = calloc_check((size_t)cfg->L, sizeof(BlockLayout));
    m->moe_slot = malloc_check((size_t)cfg->L * sizeof(int));
    for (int l = 0; l < cfg->L; l++) {
        BlockLayout* bl = &m->layout[l];
        fill_layout(tt, l, 0, bl);
        fill_layout(tt, l, 1, &m->glayout[l]);
        bl->moe = config_block_is_moe(cfg, l);
        bl->window = config_block_window(cfg, l);
        m->glayout[l].moe = bl->moe;
        m->glayout[l].window = bl->window;
        m->moe_slot[l] = bl->moe ? m->n_moe++ : -1;
        // The fused matmuls rely on adjacency: check it here rather than trusting the table.
        const int64_t QD = (int64_t)cfg->H * cfg->HD, KVD = (int64_t)cfg->KVH * cfg->HD;
        int bad = block_offset(tt, TK_WK, l) != bl->wqkv + QD * C ||
                  block_offset(tt, TK_WV, l) != bl->wqkv + (QD + KVD) * C;
        if (bl->bqkv >= 0)
            bad |= block_offset(tt, TK_BK, l) != bl->bqkv + QD ||
                   block_offset(tt, TK_BV, l) != bl->bqkv + QD + KVD;
        if (!bl->moe) bad |= block_offset(tt, TK_W_UP, l) != bl->wgu + (int64_t)cfg->F * C;
        if (bad) fatal("internal: tensor table breaks the fused qkv / gate-up adjacency");
    }

    m->inv_freq = malloc_check((size_t)(cfg->HD / 2) * sizeof(float));
    m->rope_scale = config_rope_inv_freq(cfg, m->inv_freq);
    return 0;
}

void model_free(Model* m) {
    tensor_table_free(&m->tt);
    free(m->inv_freq);
    free(m->layout);
    free(m->glayout);
    free(m->moe_slot);
    memset(m, 0, sizeof *m);
}

double model_aux_weight(const Model* m) {
    return m->n_moe > 0 && m->cfg.output_router_logits ? m->cfg.router_aux_loss_coef : 0.0;
}

// ----------------------------------------------------------------------------
// workspaces

// The LM-head chunk: as many rows as fit in about 64 MiB of logits, at least one sequence's
// last row per batch entry (for generation), at most N. On GPU backends (bf16) at least 4096 rows:
// every chunk's weight-gradient GEMM reads and writes the whole fp32 dW of the head, so small
// chunks starve it (Qwen3 vocabulary on an H200: 146 TFLOP/s at 220 rows, 669 at 4096).
static int lm_chunk_rows(const Model* m, int act_bytes, int B, int T) {
    int64_t N = (int64_t)B * T;
    int64_t rows = (64ll << 20) / ((int64_t)m->cfg.V * act_bytes);
    if (act_bytes < 4 && rows < 4096) rows = 4096;
    if (rows < B) rows = B;
    if (rows > N) rows = N;
    return (int)rows;
}

// Rows per MLP chunk for a workspace of B x T tokens (0: not chunked).
// (MoE models: never; their blocks keep whole activations.)
static int mlp_chunk_rows(const Model* m, int B, int T) {
    int64_t N = (int64_t)B * T;
    if (m->n_moe > 0) return 0;
    return m->mlp_chunk > 0 && N > m->mlp_chunk ? m->mlp_chunk : 0;
}

#define ACT_SLOTS 13  // the buffers of one BlockActs set (its MoE part aside)

static void acts_sizes(const Model* m, int B, int T, size_t act_bytes, size_t* sizes) {
    const ModelConfig* c = &m->cfg;
    const size_t N = (size_t)B * T, C = c->C, F = c->F;
    // long sequences (a chunked MLP) keep only what the backward cannot cheaply recompute (the
    // attention's output and lse, rstd1): ln1, qkv_raw, qkv, rstd_qk and h are recomputed by the
    // block backward (model_block_backward_at)
    const int chunked = mlp_chunk_rows(m, B, T) > 0;
    sizes[0] = chunked ? 0 : N * C * act_bytes;                   // ln1
    sizes[1] = N * sizeof(float);                                 // rstd1
    sizes[2] = chunked ? 0 : N * m->QKV * act_bytes;              // qkv_raw
    sizes[3] = chunked ? 0 : N * m->QKV * act_bytes;              // qkv
    sizes[4] = c->qk_norm && !chunked ? N * (c->H + c->KVH) * sizeof(float) : 0;  // rstd_qk
    sizes[5] = N * c->H * c->HD * act_bytes;                      // att
    sizes[6] = (size_t)B * c->H * T * sizeof(float);              // lse
    sizes[7] = chunked ? 0 : N * C * act_bytes;                   // h
    sizes[8] = chunked ? 0 : N * C * act_bytes;                   // ln2
    sizes[9] = chunked ? 0 : N * sizeof(float);                   // rstd2
    const int dense = m->n_moe < c->L;  // some block has the dense MLP
    sizes[10] = chunked || !dense ? 0 : N * 2 * F * act_bytes;    // gu
    sizes[11] = chunked || !dense ? 0 : N * F * act_bytes;        // act
    sizes[12] = chunked ? 0 : N * (size_t)lora_saved_t_width(m) * act_bytes;  // lora_t
}

size_t workspace_act_set_bytes(const Model* m, int act_bytes, int B, int T) {
    size_t sizes[ACT_SLOTS], total = 0;
    acts_sizes(m, B, T, (size_t)act_bytes, sizes);
    for (int i = 0; i < ACT_SLOTS; i++) total += sizes[i];
    if (m->n_moe > 0) total += moe_acts_bytes(&m->cfg, (size_t)act_bytes, (int64_t)B * T);
    return total;
}

size_t workspace_bytes(const Model* m, int act_bytes, int B, int T, int n_acts) {
    const ModelConfig* c = &m->cfg;
    const size_t N = (size_t)B * T, C = c->C, F = c->F, ab = (size_t)act_bytes;
    const int chunk = mlp_chunk_rows(m, B, T);
    const size_t mlp_rows = chunk > 0 ? (size_t)chunk : N;  // rows of the MLP gradient scratch
    const size_t per_set = workspace_act_set_bytes(m, act_bytes, B, T);
    const size_t row = C > (size_t)m->QKV ? C : (size_t)m->QKV;
    const size_t dense_rows = m->n_moe < c->L ? mlp_rows : 0;  // the dense MLP's gradient scratch
    size_t scratch = 2 * N * row * ab + 3 * dense_rows * F * ab + N * sizeof(float) +
                     (size_t)lm_chunk_rows(m, act_bytes, B, T) * c->V * ab;
    if (chunk > 0)  // the MLP chunk's scratch, and the recomputed ln1 / h, qkv_raw, qkv, rstds
        scratch += (size_t)chunk * (C + 3 * F) * ab + (size_t)chunk * sizeof(float) +
                   N * (C + 2 * (size_t)m->QKV) * ab + N * sizeof(float) +
                   (c->qk_norm ? N * (size_t)(c->H + c->KVH) * sizeof(float) : 0);
    if (m->n_moe > 0)  // the experts' scratch, the per-block statistics and the summed counts
        scratch += moe_scratch_bytes(c, ab, (int64_t)N) +
                   ((size_t)m->n_moe * 2 + 1) * (size_t)c->E * sizeof(float);
    scratch += lora_scratch_bytes(m, ab, (int64_t)N);  // the adapters' products (none without)
    size_t rope = 2 * (size_t)T * (c->HD / 2) * sizeof(float);
    return per_set * (size_t)n_acts + scratch + rope;
}

// The CPU backend's largest temporary of a linear layer of n rows, IC -> OC: its forward, input
// gradient or weight gradient (cpu_matmul_backward's two products).
static size_t linear_temp_bytes(int64_t n, int64_t IC, int64_t OC) {
    size_t most = ops_cpu_gemm_temp_bytes(n, OC, IC);                  // out = inp . w^T
    size_t b = ops_cpu_gemm_temp_bytes(n, IC, OC);                     // dinp = dout . w
    if (b > most) most = b;
    b = ops_cpu_gemm_temp_bytes(OC, IC, n);                            // dw += dout^T . inp
    return b > most ? b : most;
}

size_t model_cpu_op_temp_bytes(const Model* m, int B, int T, int n_threads) {
    const ModelConfig* c = &m->cfg;
    const int64_t N = (int64_t)B * T, C = c->C, F = c->F, QD = (int64_t)c->H * c->HD;
    const int chunk = mlp_chunk_rows(m, B, T);
    const int64_t mlp_rows = chunk > 0 ? chunk : N;
    const int64_t lm_rows = lm_chunk_rows(m, ops_cpu.act_bytes, B, T);
    const size_t cand[] = {linear_temp_bytes(N, C, m->QKV),       // q/k/v projection
                           linear_temp_bytes(N, QD, C),           // attention output projection
                           linear_temp_bytes(mlp_rows, C, 2 * F), // gate and up
                           linear_temp_bytes(mlp_rows, F, C),     // down
                           linear_temp_bytes(lm_rows, C, c->V),   // the LM head's chunk
                           ops_cpu_attention_temp_bytes(B, T, c->H, c->KVH, c->HD, n_threads)};
    size_t most = 0;
    for (size_t i = 0; i < sizeof cand / sizeof cand[0]; i++)
        if (cand[i] > most) most = cand[i];
    if (m->n_moe > 0) {
        // the router, and each expert's grouped matmul on its rows (at most all N: a token goes
        // to K distinct experts); the router statistics' probabilities (N, E)
        const int64_t E = c->E, Fe = c->F_expert;
        const size_t moe[] = {linear_temp_bytes(N, C, E), linear_temp_bytes(N, C, 2 * Fe),
                              linear_temp_bytes(N, Fe, C), (size_t)N * E * sizeof(float)};
        for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++)
            if (moe[i] > most) most = moe[i];
    }
    // glibc keeps freed blocks below its largest mmap threshold (32 MiB) in the heap, where the
    // next op's temporary of another size may not fit: one more of them can stay resident
    const size_t kept = (size_t)32 << 20;
    return most + (most < kept ? most : kept);
}

Workspace* workspace_create(const Model* m, const Ops* ops, void* ctx, int B, int T, int n_acts) {
    const ModelConfig* c = &m->cfg;
    if (config_is_moe(c) && !moe_ops_supported(ops, c))
        fatal("model family %s: the %s backend has no mixture-of-experts kernels yet (train it "
              "on the CPU: --device cpu or cpu:N)", family_names[c->family], ops->name);
    Workspace* ws = calloc_check(1, sizeof(Workspace));
    ws->ops = ops;
    ws->ctx = ctx;
    ws->B = B;
    ws->T = T;
    const size_t N = (size_t)B * T, C = c->C, F = c->F, ab = (size_t)ops->act_bytes;
    const int half = c->HD / 2;

    // RoPE tables: angle = fp32(pos * inv_freq) as transformers computes it, times the yarn
    // attention scaling (1 otherwise).
    float* cosb = malloc_check((size_t)T * half * sizeof(float));
    float* sinb = malloc_check((size_t)T * half * sizeof(float));
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            float ang = (float)t * m->inv_freq[i];
            cosb[(size_t)t * half + i] = cosf(ang) * m->rope_scale;
            sinb[(size_t)t * half + i] = sinf(ang) * m->rope_scale;
        }
    }
    ws->rope_cos = ops->alloc(ctx, (size_t)T * half * sizeof(float));
    ws->rope_sin = ops->alloc(ctx, (size_t)T * half * sizeof(float));
    ops->upload(ctx, ws->rope_cos, cosb, (size_t)T * half * sizeof(float));
    ops->upload(ctx, ws->rope_sin, sinb, (size_t)T * half * sizeof(float));
    free(cosb);
    free(sinb);

    ws->n_acts = n_acts;
    ws->acts = calloc_check((size_t)n_acts, sizeof(BlockActs));
    size_t sizes[ACT_SLOTS];
    acts_sizes(m, B, T, ab, sizes);
    for (int i = 0; i < n_acts; i++) {
        BlockActs* a = &ws->acts[i];
        void** slots[ACT_SLOTS] = {&a->ln1, (void**)&a->rstd1, &a->qkv_raw, &a->qkv,
                                   (void**)&a->rstd_qk, &a->att, (void**)&a->lse, &a->h,
                                   &a->ln2, (void**)&a->rstd2, &a->gu, &a->act, &a->lora_t};
        for (int j = 0; j < ACT_SLOTS; j++) *slots[j] = sizes[j] ? ops->alloc(ctx, sizes[j]) : NULL;
        if (m->n_moe > 0) moe_acts_alloc(&a->moe, c, ops, ctx, (int64_t)N);
    }
    if (m->n_moe > 0) {
        moe_scratch_alloc(&ws->moe, c, ops, ctx, (int64_t)N);
        ws->moe_stats = ops->alloc(ctx, (size_t)m->n_moe * 2 * c->E * sizeof(float));
        ws->moe_counts = ops->alloc(ctx, (size_t)c->E * sizeof(float));
        ws->moe_counts_host = calloc_check((size_t)c->E, sizeof(float));
    }
    // Two row buffers serve every (N, <= max(C, QKV)) temporary, by lifetime: the block backward
    // passes d_att (A) -> d_qkv (B) -> d_qkv_raw (A) -> d_ln (B), the forward uses proj (A),
    // the postfix xf (A) and d_xf (B); no op reads or writes two roles of one buffer.
    const size_t row = (size_t)(C > (size_t)m->QKV ? C : (size_t)m->QKV);
    ws->row_a = ops->alloc(ctx, N * row * ab);
    ws->row_b = ops->alloc(ctx, N * row * ab);
    ws->proj = ws->row_a;
    ws->d_att = ws->row_a;
    ws->d_qkv_raw = ws->row_a;
    ws->d_ln = ws->row_b;
    ws->d_qkv = ws->row_b;
    ws->mlp_chunk = mlp_chunk_rows(m, B, T);
    const size_t mlp_rows = ws->mlp_chunk > 0 ? (size_t)ws->mlp_chunk : N;
    if (m->n_moe < c->L) {  // some block has the dense MLP (MoE blocks use ws->moe)
        ws->d_act = ops->alloc(ctx, mlp_rows * F * ab);
        ws->d_gu = ops->alloc(ctx, mlp_rows * 2 * F * ab);
    }
    if (ws->mlp_chunk > 0) {
        ws->ln2_c = ops->alloc(ctx, mlp_rows * C * ab);
        ws->rstd2_c = ops->alloc(ctx, mlp_rows * sizeof(float));
        ws->gu_c = ops->alloc(ctx, mlp_rows * 2 * F * ab);
        ws->act_c = ops->alloc(ctx, mlp_rows * F * ab);
        // not saved per block (acts_sizes): recomputed into one buffer each. ln1 and h never
        // live at once (ln1: the attention's input projection; h: the MLP), so they share.
        ws->ln1_h = ops->alloc(ctx, N * C * ab);
        ws->qkv_raw_s = ops->alloc(ctx, N * (size_t)m->QKV * ab);
        ws->rstd1_s = ops->alloc(ctx, N * sizeof(float));
        ws->qkv_s = ops->alloc(ctx, N * (size_t)m->QKV * ab);
        if (c->qk_norm) ws->rstd_qk_s = ops->alloc(ctx, N * (size_t)(c->H + c->KVH) * sizeof(float));
    }
    ws->xf = ws->row_a;
    ws->rstdf = ops->alloc(ctx, N * sizeof(float));
    ws->d_xf = ws->row_b;
    ws->lm_chunk = lm_chunk_rows(m, ops->act_bytes, B, T);
    ws->logits = ops->alloc(ctx, (size_t)ws->lm_chunk * c->V * ab);
    lora_scratch_alloc(m, ws, (int64_t)N);
    return ws;
}

void workspace_free(Workspace* ws) {
    if (!ws) return;
    const Ops* ops = ws->ops;
    void* ctx = ws->ctx;
    for (int i = 0; i < ws->n_acts; i++) {
        BlockActs* a = &ws->acts[i];
        void* ptrs[ACT_SLOTS] = {a->ln1, a->rstd1, a->qkv_raw, a->qkv, a->rstd_qk, a->att,
                                 a->lse, a->h, a->ln2, a->rstd2, a->gu, a->act, a->lora_t};
        for (int j = 0; j < ACT_SLOTS; j++)
            if (ptrs[j]) ops->free(ctx, ptrs[j]);
        moe_acts_free(&a->moe, ops, ctx);
    }
    free(ws->acts);
    moe_scratch_free(&ws->moe, ops, ctx);
    if (ws->moe_stats) ops->free(ctx, ws->moe_stats);
    if (ws->moe_counts) ops->free(ctx, ws->moe_counts);
    free(ws->moe_counts_host);
    void* bufs[] = {ws->rope_cos, ws->rope_sin, ws->row_a, ws->row_b, ws->d_act, ws->d_gu,
                    ws->rstdf, ws->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ops->free(ctx, bufs[i]);
    void* chunk_bufs[] = {ws->ln2_c,  ws->rstd2_c,    ws->gu_c,  ws->act_c,    ws->ln1_h,
                          ws->qkv_raw_s, ws->rstd1_s, ws->qkv_s, ws->rstd_qk_s};
    for (size_t i = 0; i < sizeof chunk_bufs / sizeof chunk_bufs[0]; i++)
        if (chunk_bufs[i]) ops->free(ctx, chunk_bufs[i]);
    lora_scratch_free(ws);
    free(ws);
}

// ----------------------------------------------------------------------------
// prefix

void model_prefix_forward(const Model* m, Workspace* ws, void* x_out, const int32_t* ids,
                          const void* wte, int B, int T) {
    ws->ops->embedding_forward(ws->ctx, x_out, ids, wte, B * T, m->cfg.C);
}

void model_prefix_backward(const Model* m, Workspace* ws, float* dwte, const void* dx,
                           const int32_t* ids, int B, int T) {
    if (!dwte) return;  // a frozen embedding (LoRA)
    ws->ops->embedding_backward(ws->ctx, dwte, dx, ids, B * T, m->cfg.C, m->cfg.V);
}

// ----------------------------------------------------------------------------
// decoder block

// Parameter pointer of a slab offset, NULL when the tensor is absent (-1).
static const void* opt_at(const Workspace* ws, const void* slab, int64_t off) {
    return off >= 0 ? at(ws, slab, off) : NULL;
}

static float* opt_grad(float* gslab, int64_t off) { return off >= 0 ? gslab + off : NULL; }

// ----------------------------------------------------------------------------
// a linear with its LoRA adapters (lora.h)

#define LORA_QKV (LORA_BIT(LORA_Q) | LORA_BIT(LORA_K) | LORA_BIT(LORA_V))
#define LORA_GATE_UP (LORA_BIT(LORA_GATE) | LORA_BIT(LORA_UP))

// y (n, OC) = x (n, IC) · Wᵀ (+ bias) plus the adapters in mask (none: the plain product). When
// they cover y (lora_covers) they write it first and the base product adds onto it: its GEMM is
// compute-bound, so reading y there is free, where adding them after it would read and write y
// once more. t: where the adapters keep their t for the backward, or NULL. row0: the rows' first
// within the micro-batch (the dropout's key).
static void linear_forward(const Model* m, Workspace* ws, int block, unsigned mask,
                           const void* slab, void* y, const void* x, const void* w,
                           const void* bias, int n, int IC, int OC, int64_t row0, void* t) {
    const Ops* ops = ws->ops;
    if (!bias && lora_covers(m, block, mask)) {
        lora_forward(m, ws, block, mask, slab, x, y, n, row0, 0, t);
        ops->matmul_cols_forward(ws->ctx, y, 1, x, IC, w, 1.0f, n, IC, OC, OC, 0);
        return;
    }
    ops->matmul_forward(ws->ctx, y, x, w, bias, n, IC, OC);
    lora_forward(m, ws, block, mask, slab, x, y, n, row0, 1, t);
}

// Its backward: dx (n, IC) = dy · W plus the adapters' input gradient, in linear_forward's order
// (a frozen base: no dw, dbias); dw, dbias (NULL: frozen) accumulate. t: the forward's, or NULL.
static void linear_backward(const Model* m, Workspace* ws, int block, unsigned mask,
                            const void* slab, float* gslab, void* dx, float* dw, float* dbias,
                            const void* dy, const void* x, const void* w, int n, int IC, int OC,
                            int64_t row0, const void* t) {
    const Ops* ops = ws->ops;
    if (!dw && !dbias && lora_covers(m, block, mask)) {
        lora_backward(m, ws, block, mask, slab, gslab, x, dy, dx, n, row0, 0, t);
        ops->matmul_cols_backward(ws->ctx, dx, 1, NULL, dy, x, w, 1.0f, n, IC, IC, OC, OC, 0);
        return;
    }
    ops->matmul_backward(ws->ctx, dx, dw, dbias, dy, x, w, n, IC, OC);
    lora_backward(m, ws, block, mask, slab, gslab, x, dy, dx, n, row0, 1, t);
}

// Where the adapters in mask keep their t in a block's saved set for n rows (NULL: none kept,
// the backward recomputes it).
static void* lora_t_at(const Model* m, const Workspace* ws, const BlockActs* a, int block,
                       unsigned mask, int n) {
    return a && a->lora_t ? at(ws, a->lora_t, lora_saved_t_offset(m, block, mask, n)) : NULL;
}

// Rows [r0, r0+n) of the MLP's activations into the chunk scratch: ln2_c = RMSNorm(h), gu_c =
// ln2_c · Wguᵀ, act_c = silu(gate) * up. The same ops on the same rows as the unchunked MLP.
static void mlp_chunk_forward(const Model* m, Workspace* ws, const BlockLayout* bl, int block,
                              const void* slab, const void* h, int r0, int n) {
    const Ops* ops = ws->ops;
    const ModelConfig* c = &m->cfg;
    ops->rmsnorm_forward(ws->ctx, ws->ln2_c, ws->rstd2_c, at(ws, h, (int64_t)r0 * c->C),
                         at(ws, slab, bl->mlp_norm), n, c->C, c->norm_eps);
    linear_forward(m, ws, block, LORA_GATE_UP, slab, ws->gu_c, ws->ln2_c, at(ws, slab, bl->wgu),
                   NULL, n, c->C, 2 * c->F, r0, NULL);
    ops->swiglu_forward(ws->ctx, ws->act_c, ws->gu_c, n, c->F);
}

// ln1 = RMSNorm(x) (rstd into rstd1), qkv_raw = ln1 · Wqkvᵀ (+ bqkv) (+ the adapters: their t
// into lora_t, or NULL), qkv = RoPE(qk-norm(qkv_raw)) (its rstd into rstd_qk): the forward's
// ops, also run by the backward of a chunked block, which keeps none of them (the same ops on the
// same inputs: the same bits).
static void attention_input_forward(const Model* m, Workspace* ws, const BlockLayout* bl,
                                    int block, const void* slab, const void* x_in, void* ln1,
                                    float* rstd1, void* qkv_raw, void* qkv, float* rstd_qk,
                                    void* lora_t, int B, int T) {
    const Ops* ops = ws->ops;
    const ModelConfig* c = &m->cfg;
    const int N = B * T;
    ops->rmsnorm_forward(ws->ctx, ln1, rstd1, x_in, at(ws, slab, bl->attn_norm), N, c->C,
                         c->norm_eps);
    linear_forward(m, ws, block, LORA_QKV, slab, qkv_raw, ln1, at(ws, slab, bl->wqkv),
                   opt_at(ws, slab, bl->bqkv), N, c->C, m->QKV, 0, lora_t);
    ops->qknorm_rope_forward(ws->ctx, qkv, rstd_qk, qkv_raw, opt_at(ws, slab, bl->q_norm),
                             opt_at(ws, slab, bl->k_norm), ws->rope_cos, ws->rope_sin, B, T, c->H,
                             c->KVH, c->HD, c->norm_eps);
}

// The attention proper: plain causal (flash) attention, or GPT-OSS's with sinks and the block's
// window.
static void attention_core_forward(const Model* m, Workspace* ws, const BlockLayout* bl,
                                   const void* slab, BlockActs* a, const void* qkv, int B, int T) {
    const ModelConfig* c = &m->cfg;
    if (bl->sinks >= 0 || bl->window > 0)
        ws->ops->attention_sink_forward(ws->ctx, a->att, a->lse, qkv, opt_at(ws, slab, bl->sinks),
                                        B, T, c->H, c->KVH, c->HD, bl->window);
    else
        ws->ops->attention_forward(ws->ctx, a->att, a->lse, qkv, B, T, c->H, c->KVH, c->HD);
}

// h = x + att · Woᵀ (+ bo) (through ws->proj), for a chunked block: its forward, and its
// backward's recompute of h.
static void attention_residual_forward(const Model* m, Workspace* ws, const BlockLayout* bl,
                                       int block, const void* slab, const void* att,
                                       const void* x_in, void* h, int N) {
    const Ops* ops = ws->ops;
    const ModelConfig* c = &m->cfg;
    linear_forward(m, ws, block, LORA_BIT(LORA_O), slab, ws->proj, att, at(ws, slab, bl->wo),
                   opt_at(ws, slab, bl->bo), N, c->H * c->HD, c->C, 0, NULL);
    ops->add(ws->ctx, h, x_in, ws->proj, (size_t)N * c->C);
}

// The router's LoRA adapter, called by moe.c between the router's matmul and the routing.
typedef struct RouterLora {
    const Model* m;
    Workspace* ws;
    int block;
    const void* slab;
    float* gslab;
} RouterLora;

static void router_lora_forward(void* arg, const void* x, void* logits, int N) {
    const RouterLora* r = arg;
    lora_forward(r->m, r->ws, r->block, LORA_BIT(LORA_ROUTER), r->slab, x, logits, N, 0, 1, NULL);
}

static void router_lora_backward(void* arg, const void* x, const void* dlogits, void* dx, int N) {
    const RouterLora* r = arg;
    lora_backward(r->m, r->ws, r->block, LORA_BIT(LORA_ROUTER), r->slab, r->gslab, x, dlogits,
                  dx, N, 0, 1, NULL);
}

// The experts' LoRA adapters, called by moe.c after each grouped projection (proj 0: gate/up,
// 1: down) on the dispatched rows.
static void expert_lora_forward(void* arg, int proj, const void* inp, void* out,
                                const int32_t* offsets, int R) {
    const RouterLora* r = arg;
    lora_expert_forward(r->m, r->ws, r->block, proj ? LORA_EXP_DOWN : LORA_EXP_GATE_UP, r->slab,
                        inp, out, offsets, R);
}

static void expert_lora_backward(void* arg, int proj, const void* inp, const void* dout,
                                 void* dinp, const int32_t* offsets, int R) {
    const RouterLora* r = arg;
    lora_expert_backward(r->m, r->ws, r->block, proj ? LORA_EXP_DOWN : LORA_EXP_GATE_UP, r->slab,
                         r->gslab, inp, dout, dinp, offsets, R);
}

// The block's expert weights; with router or expert adapters, their hooks on rl (filled here).
static MoeWeights moe_weights(const Workspace* ws, const BlockLayout* bl, const void* slab,
                              RouterLora* rl) {
    MoeWeights w = {opt_at(ws, slab, bl->router),   opt_at(ws, slab, bl->router_bias),
                    opt_at(ws, slab, bl->exp_gu),   opt_at(ws, slab, bl->exp_gu_bias),
                    opt_at(ws, slab, bl->exp_down), opt_at(ws, slab, bl->exp_down_bias),
                    NULL, NULL, NULL, NULL, NULL};
    if (rl->m->tt.lora.r > 0 && bl->lora_a[LORA_ROUTER] >= 0) {
        w.router_adapter = router_lora_forward;
        w.router_adapter_backward = router_lora_backward;
        w.adapter_arg = rl;
    }
    if (rl->m->tt.lora.r > 0 && bl->lora_a[LORA_EXP_GATE_UP] >= 0) {
        w.expert_adapter = expert_lora_forward;
        w.expert_adapter_backward = expert_lora_backward;
        w.adapter_arg = rl;
    }
    return w;
}

static const BlockLayout* block_layout(const Model* m, int block) {
    if (block < 0 || block >= m->cfg.L) fatal("internal: block %d of a %d-block model", block, m->cfg.L);
    return &m->layout[block];
}

// The block after its attention, on n rows whose activations are kept in a: output projection,
// residual + RMSNorm, then the MLP or the experts, and the second residual into x_out. Shared by
// the training forward and the generator's decode step (model_block_decode_at), which passes
// x_out NULL: the second residual is left pending as a->h + ws->proj, for the next block's first
// norm (or the final norm) to add in the same op.
static void block_forward_after_attention(const Model* m, Workspace* ws, BlockActs* a, int block,
                                          const void* slab, const void* x_in, void* x_out,
                                          int n) {
    const Ops* ops = ws->ops;
    void* ctx = ws->ctx;
    const ModelConfig* c = &m->cfg;
    const BlockLayout* bl = block_layout(m, block);
    const int C = c->C, F = c->F, QD = c->H * c->HD;
    linear_forward(m, ws, block, LORA_BIT(LORA_O), slab, ws->proj, a->att, at(ws, slab, bl->wo),
                   opt_at(ws, slab, bl->bo), n, QD, C, 0,
                   lora_t_at(m, ws, a, block, LORA_BIT(LORA_O), n));
    ops->residual_rmsnorm_forward(ctx, a->h, a->ln2, a->rstd2, x_in, ws->proj,
                                  at(ws, slab, bl->mlp_norm), n, C, c->norm_eps);
    if (bl->moe) {
        // x' = h + MoE(ln2); the block's aux statistics go to its slot of ws->moe_stats
        RouterLora rl = {m, ws, block, slab, NULL};
        MoeWeights w = moe_weights(ws, bl, slab, &rl);
        float* stats = ws->moe_stats + (size_t)m->moe_slot[block] * 2 * c->E;
        moe_forward(c, ops, ctx, &ws->moe, &a->moe, &w, a->ln2, ws->proj, stats, n);
        if (x_out) ops->add(ctx, x_out, a->h, ws->proj, (size_t)n * C);
        return;
    }
    // MLP: x' = h + down(silu(gate(ln2)) * up(ln2)). The decode step (x_out NULL: nothing keeps
    // gu) takes the backend's fused gate_up + SwiGLU where it has one and no adapter applies.
    const int fused = !x_out && m->tt.lora.r <= 0 && ops->matmul_swiglu_forward &&
                      ops->matmul_swiglu_forward(ctx, a->act, a->ln2, at(ws, slab, bl->wgu), n, C,
                                                 F);
    if (!fused) {
        linear_forward(m, ws, block, LORA_GATE_UP, slab, a->gu, a->ln2, at(ws, slab, bl->wgu),
                       NULL, n, C, 2 * F, 0, lora_t_at(m, ws, a, block, LORA_GATE_UP, n));
        ops->swiglu_forward(ctx, a->act, a->gu, n, F);
    }
    linear_forward(m, ws, block, LORA_BIT(LORA_DOWN), slab, ws->proj, a->act,
                   at(ws, slab, bl->wdown), NULL, n, F, C, 0,
                   lora_t_at(m, ws, a, block, LORA_BIT(LORA_DOWN), n));
    if (x_out) ops->add(ctx, x_out, a->h, ws->proj, (size_t)n * C);
}

void model_block_forward_at(const Model* m, Workspace* ws, BlockActs* a, int block,
                            const void* slab, const void* x_in, void* x_out, int B, int T) {
    const Ops* ops = ws->ops;
    void* ctx = ws->ctx;
    const ModelConfig* c = &m->cfg;
    const BlockLayout* bl = block_layout(m, block);
    const int N = B * T, C = c->C, F = c->F;

    // attention: h = x + o_proj(attn(rope(qk_norm(qkv_proj(rmsnorm(x))))))
    // (long sequences: ln1, qkv_raw, qkv, rstd_qk and h go to workspace scratch, not the saved set)
    const int lean = ws->mlp_chunk > 0;
    void* ln1 = lean ? ws->ln1_h : a->ln1;
    void* qkv_raw = lean ? ws->qkv_raw_s : a->qkv_raw;
    void* qkv = lean ? ws->qkv_s : a->qkv;
    float* rstd_qk = lean ? ws->rstd_qk_s : a->rstd_qk;
    attention_input_forward(m, ws, bl, block, slab, x_in, ln1, a->rstd1, qkv_raw, qkv, rstd_qk,
                            lora_t_at(m, ws, a, block, LORA_QKV, N), B, T);
    attention_core_forward(m, ws, bl, slab, a, qkv, B, T);
    if (lean) {
        // long sequences: h = x + attn, then the MLP chunk by chunk
        void* h = ws->ln1_h;  // ln1 is dead once qkv_raw exists
        attention_residual_forward(m, ws, bl, block, slab, a->att, x_in, h, N);
        for (int r0 = 0; r0 < N; r0 += ws->mlp_chunk) {
            const int n = imin(ws->mlp_chunk, N - r0);
            mlp_chunk_forward(m, ws, bl, block, slab, h, r0, n);
            linear_forward(m, ws, block, LORA_BIT(LORA_DOWN), slab,
                           at(ws, ws->proj, (int64_t)r0 * C), ws->act_c, at(ws, slab, bl->wdown),
                           NULL, n, F, C, r0, NULL);
        }
        ops->add(ctx, x_out, h, ws->proj, (size_t)N * C);
        return;
    }
    block_forward_after_attention(m, ws, a, block, slab, x_in, x_out, N);
}

void model_block_backward_at(const Model* m, Workspace* ws, const BlockActs* a, int block,
                             const void* slab, float* gslab, const void* x_in, void* dres, int B,
                             int T) {
    const Ops* ops = ws->ops;
    void* ctx = ws->ctx;
    const ModelConfig* c = &m->cfg;
    const BlockLayout* bl = block_layout(m, block);
    const BlockLayout* gl = &m->glayout[block];  // gradient offsets (-1: frozen)
    const int N = B * T, C = c->C, F = c->F, HD = c->HD, QD = c->H * c->HD;
    const void* q_norm = opt_at(ws, slab, bl->q_norm);
    const void* k_norm = opt_at(ws, slab, bl->k_norm);
    float* dq_norm = opt_grad(gslab, gl->q_norm);
    float* dk_norm = opt_grad(gslab, gl->k_norm);

    // MLP. dres is the gradient of x' and, through the residual, of h.
    const int lean = ws->mlp_chunk > 0;
    const void* h = lean ? ws->ln1_h : a->h;
    if (lean) {
        // recompute h, then each chunk's activations from h, then its backward
        attention_residual_forward(m, ws, bl, block, slab, a->att, x_in, ws->ln1_h, N);
        for (int r0 = 0; r0 < N; r0 += ws->mlp_chunk) {
            const int n = imin(ws->mlp_chunk, N - r0);
            void* dres_c = at(ws, dres, (int64_t)r0 * C);
            mlp_chunk_forward(m, ws, bl, block, slab, h, r0, n);
            linear_backward(m, ws, block, LORA_BIT(LORA_DOWN), slab, gslab, ws->d_act,
                            opt_grad(gslab, gl->wdown), NULL, dres_c, ws->act_c,
                            at(ws, slab, bl->wdown), n, F, C, r0, NULL);
            ops->swiglu_backward(ctx, ws->d_gu, ws->d_act, ws->gu_c, n, F);
            linear_backward(m, ws, block, LORA_GATE_UP, slab, gslab, ws->d_ln,
                            opt_grad(gslab, gl->wgu), NULL, ws->d_gu, ws->ln2_c,
                            at(ws, slab, bl->wgu), n, C, 2 * F, r0, NULL);
            ops->rmsnorm_backward(ctx, dres_c, opt_grad(gslab, gl->mlp_norm), ws->d_ln,
                                  at(ws, h, (int64_t)r0 * C), at(ws, slab, bl->mlp_norm),
                                  ws->rstd2_c, n, C);
        }
    } else {
        if (bl->moe) {
            RouterLora rl = {m, ws, block, slab, gslab};
            MoeWeights w = moe_weights(ws, bl, slab, &rl);
            MoeGrads g = {opt_grad(gslab, gl->router),   opt_grad(gslab, gl->router_bias),
                          opt_grad(gslab, gl->exp_gu),   opt_grad(gslab, gl->exp_gu_bias),
                          opt_grad(gslab, gl->exp_down), opt_grad(gslab, gl->exp_down_bias)};
            moe_backward(c, ops, ctx, &ws->moe, &a->moe, &w, &g, a->ln2, dres, ws->d_ln,
                         ws->moe_counts, ws->moe_aux_scale, N);
        } else {
            linear_backward(m, ws, block, LORA_BIT(LORA_DOWN), slab, gslab, ws->d_act,
                            opt_grad(gslab, gl->wdown), NULL, dres, a->act,
                            at(ws, slab, bl->wdown), N, F, C, 0,
                            lora_t_at(m, ws, a, block, LORA_BIT(LORA_DOWN), N));
            ops->swiglu_backward(ctx, ws->d_gu, ws->d_act, a->gu, N, F);
            linear_backward(m, ws, block, LORA_GATE_UP, slab, gslab, ws->d_ln,
                            opt_grad(gslab, gl->wgu), NULL, ws->d_gu, a->ln2,
                            at(ws, slab, bl->wgu), N, C, 2 * F, 0,
                            lora_t_at(m, ws, a, block, LORA_GATE_UP, N));
        }
        // rmsnorm_backward accumulates: dres becomes the full gradient of h
        ops->rmsnorm_backward(ctx, dres, opt_grad(gslab, gl->mlp_norm), ws->d_ln, a->h,
                              at(ws, slab, bl->mlp_norm), a->rstd2, N, C);
    }
    // attention. dres is the gradient of h and, through the residual, of x.
    // (chunked: ln1, qkv_raw, qkv and rstd_qk recomputed by the forward's ops, into scratch no
    // op below writes; rstd1 is saved)
    const void* ln1 = lean ? ws->ln1_h : a->ln1;
    const void* qkv_raw = lean ? ws->qkv_raw_s : a->qkv_raw;
    const void* qkv = lean ? ws->qkv_s : a->qkv;
    const float* rstd_qk = lean ? ws->rstd_qk_s : a->rstd_qk;
    if (lean)
        attention_input_forward(m, ws, bl, block, slab, x_in, ws->ln1_h, ws->rstd1_s, ws->qkv_raw_s,
                                ws->qkv_s, ws->rstd_qk_s, NULL, B, T);
    linear_backward(m, ws, block, LORA_BIT(LORA_O), slab, gslab, ws->d_att, opt_grad(gslab, gl->wo),
                    opt_grad(gslab, gl->bo), dres, a->att, at(ws, slab, bl->wo), N, QD, C, 0,
                    lora_t_at(m, ws, a, block, LORA_BIT(LORA_O), N));
    if (bl->sinks >= 0 || bl->window > 0)
        ops->attention_sink_backward(ctx, ws->d_qkv, opt_grad(gslab, gl->sinks), ws->d_att, qkv,
                                     a->att, a->lse, opt_at(ws, slab, bl->sinks), B, T, c->H,
                                     c->KVH, HD, bl->window);
    else
        ops->attention_backward(ctx, ws->d_qkv, ws->d_att, qkv, a->att, a->lse, B, T, c->H, c->KVH,
                                HD);
    ops->qknorm_rope_backward(ctx, ws->d_qkv_raw, dq_norm, dk_norm, ws->d_qkv, qkv_raw, q_norm,
                              k_norm, rstd_qk, ws->rope_cos, ws->rope_sin, B, T, c->H, c->KVH,
                              HD);
    linear_backward(m, ws, block, LORA_QKV, slab, gslab, ws->d_ln, opt_grad(gslab, gl->wqkv),
                    opt_grad(gslab, gl->bqkv), ws->d_qkv_raw, ln1, at(ws, slab, bl->wqkv), N, C,
                    m->QKV, 0, lora_t_at(m, ws, a, block, LORA_QKV, N));
    ops->rmsnorm_backward(ctx, dres, opt_grad(gslab, gl->attn_norm), ws->d_ln, x_in,
                          at(ws, slab, bl->attn_norm), a->rstd1, N, C);
}

// ----------------------------------------------------------------------------
// mixture of experts: the aux loss across the blocks of a micro-batch

double model_moe_aux(const Model* m, Workspace* ws, int B, int T, float grad_scale) {
    if (m->n_moe == 0) return 0.0;
    const ModelConfig* c = &m->cfg;
    const int64_t N = (int64_t)B * T;
    const size_t n_stats = (size_t)m->n_moe * 2 * c->E;
    float* stats = malloc_check(n_stats * sizeof(float));
    float* counts = ws->moe_counts_host;
    ws->ops->download(ws->ctx, stats, ws->moe_stats, n_stats * sizeof(float));
    ws->moe_aux = moe_aux_loss(c, stats, m->n_moe, N, counts, &ws->moe_load_max,
                               &ws->moe_load_mean);
    ws->ops->upload(ws->ctx, ws->moe_counts, counts, (size_t)c->E * sizeof(float));
    ws->moe_aux_scale = model_moe_aux_scale(m, B, T, grad_scale);
    free(stats);
    return ws->moe_aux;
}

float model_moe_aux_scale(const Model* m, int B, int T, float grad_scale) {
    if (m->n_moe == 0) return 0.0f;
    const int64_t N = (int64_t)B * T;
    // d(coef · aux · N · grad_scale) / d logits
    //     = coef N grad_scale E / R'^2 · p (counts - counts·p)
    const double rows = (double)m->n_moe * (double)N;
    return (float)(model_aux_weight(m) * (double)N * grad_scale * m->cfg.E / (rows * rows));
}

// ----------------------------------------------------------------------------
// postfix: final norm, LM head, cross-entropy — chunked and fused with the backward

void model_postfix_forward_backward(const Model* m, Workspace* ws, const void* norm_w,
                                    const void* head_w, float* dnorm_w, float* dhead_w,
                                    const void* x_in, void* dx, const int32_t* targets,
                                    float* losses, float grad_scale, int compute_grad, int B,
                                    int T) {
    const Ops* ops = ws->ops;
    void* ctx = ws->ctx;
    const ModelConfig* c = &m->cfg;
    const int N = B * T, C = c->C, V = c->V;
    const size_t ab = (size_t)ops->act_bytes;

    ops->rmsnorm_forward(ctx, ws->xf, ws->rstdf, x_in, norm_w, N, C, c->norm_eps);
    for (int r0 = 0; r0 < N; r0 += ws->lm_chunk) {
        int n = imin(ws->lm_chunk, N - r0);
        const void* xf = at(ws, ws->xf, (int64_t)r0 * C);
        ops->matmul_forward(ctx, ws->logits, xf, head_w, NULL, n, C, V);
        // logits become dlogits in place; then this chunk's dxf and dW_head, so the chunk's
        // logits never outlive the loop iteration.
        ops->crossentropy_forward_backward(ctx, ws->logits, losses + r0, targets + r0, n, V,
                                           grad_scale, compute_grad);
        if (compute_grad)
            ops->matmul_backward(ctx, at(ws, ws->d_xf, (int64_t)r0 * C), dhead_w, NULL,
                                 ws->logits, xf, head_w, n, C, V);
    }
    if (compute_grad) {
        ops->zero(ctx, dx, (size_t)N * C * ab);
        ops->rmsnorm_backward(ctx, dx, dnorm_w, ws->d_xf, x_in, norm_w, ws->rstdf, N, C);
    }
}

void model_postfix_logits_last(const Model* m, Workspace* ws, const void* norm_w,
                               const void* head_w, const void* x_in, void* logits, int B, int T) {
    const Ops* ops = ws->ops;
    const ModelConfig* c = &m->cfg;
    ops->rmsnorm_forward(ws->ctx, ws->xf, ws->rstdf, x_in, norm_w, B * T, c->C, c->norm_eps);
    model_postfix_head_last(m, ws, head_w, logits, B, T);
}

void model_postfix_head_last(const Model* m, Workspace* ws, const void* head_w, void* logits,
                             int B, int T) {
    const Ops* ops = ws->ops;
    const ModelConfig* c = &m->cfg;
    for (int b = 0; b < B; b++) {
        const void* row = at(ws, ws->xf, ((int64_t)b * T + T - 1) * c->C);
        ops->matmul_forward(ws->ctx, at(ws, logits, (int64_t)b * c->V), row, head_w, NULL, 1, c->C,
                            c->V);
    }
}

// ----------------------------------------------------------------------------
// generation: one decode step of a block, the prefill's keys and values

const void* model_block_qkv(const Workspace* ws, const BlockActs* a) {
    return ws->mlp_chunk > 0 ? ws->qkv_s : a->qkv;
}

void model_block_decode_at(const Model* m, Workspace* ws, int block, const void* slab, void* kc,
                           void* vc, const DecodeRows* r, void* x, int x_pending) {
    const Ops* ops = ws->ops;
    void* ctx = ws->ctx;
    const ModelConfig* c = &m->cfg;
    const BlockLayout* bl = block_layout(m, block);
    BlockActs* a = &ws->acts[0];
    const int n = r->n, C = c->C, QD = c->H * c->HD, KD = c->KVH * c->HD;
    const int half = c->HD / 2, heads = c->H + c->KVH;
    if (ws->mlp_chunk > 0 || n > ws->B * ws->T)
        fatal("internal: decode of %d rows in a workspace of %d (mlp chunk %d)", n, ws->B * ws->T,
              ws->mlp_chunk);
    // ln1, qkv_raw as in the forward; then each row's RoPE at its own position (a row is a
    // one-token sequence whose tables start at that position). A pending input is the previous
    // block's x' = h + proj, added here in the norm's op (the same bits as add then rmsnorm);
    // h and proj are read before this block overwrites them (a->h in its residual norm,
    // ws->proj in its output projection).
    if (x_pending)
        ops->residual_rmsnorm_forward(ctx, x, a->ln1, a->rstd1, a->h, ws->proj,
                                      at(ws, slab, bl->attn_norm), n, C, c->norm_eps);
    else
        ops->rmsnorm_forward(ctx, a->ln1, a->rstd1, x, at(ws, slab, bl->attn_norm), n, C,
                             c->norm_eps);
    linear_forward(m, ws, block, LORA_QKV, slab, a->qkv_raw, a->ln1, at(ws, slab, bl->wqkv),
                   opt_at(ws, slab, bl->bqkv), n, C, m->QKV, 0, NULL);
    if (ops->decode_rope_append && r->d_pos) {
        // one fused op for every row (a GPU step would otherwise launch 3 ops per row)
        ops->decode_rope_append(ctx, a->qkv, kc, vc, a->qkv_raw, opt_at(ws, slab, bl->q_norm),
                                opt_at(ws, slab, bl->k_norm), r->rope_cos, r->rope_sin, r->d_pos,
                                r->d_slot, n, r->maxT, c->H, c->KVH, c->HD, c->norm_eps);
    }
    for (int i = 0; i < n && !(ops->decode_rope_append && r->d_pos); i++) {
        const int64_t row = (int64_t)i * m->QKV;
        ops->qknorm_rope_forward(ctx, at(ws, a->qkv, row),
                                 a->rstd_qk ? a->rstd_qk + (size_t)i * heads : NULL,
                                 at(ws, a->qkv_raw, row), opt_at(ws, slab, bl->q_norm),
                                 opt_at(ws, slab, bl->k_norm),
                                 r->rope_cos + (size_t)r->pos[i] * half,
                                 r->rope_sin + (size_t)r->pos[i] * half, 1, 1, c->H, c->KVH,
                                 c->HD, c->norm_eps);
        // the new token's key and value into its slot's cache at its position
        const int64_t cache_at = ((int64_t)r->slot[i] * r->maxT + r->pos[i]) * KD;
        ops->copy(ctx, at(ws, kc, cache_at), at(ws, a->qkv, row + QD),
                  (size_t)KD * ops->act_bytes);
        ops->copy(ctx, at(ws, vc, cache_at), at(ws, a->qkv, row + QD + KD),
                  (size_t)KD * ops->act_bytes);
    }
    ops->attention_decode(ctx, a->att, a->qkv, kc, vc, r->d_slot, r->d_len,
                          opt_at(ws, slab, bl->sinks), n, r->maxT, c->H, c->KVH, c->HD,
                          bl->window);
    // the rest of the block is the forward's, on n rows, its second residual left pending
    block_forward_after_attention(m, ws, a, block, slab, x, NULL, n);
}

void model_decode_final_norm(const Model* m, Workspace* ws, const void* norm_w, void* x, int n) {
    const ModelConfig* c = &m->cfg;
    ws->ops->residual_rmsnorm_forward(ws->ctx, x, ws->xf, ws->rstdf, ws->acts[0].h, ws->proj,
                                      norm_w, n, c->C, c->norm_eps);
}

// ----------------------------------------------------------------------------
// postfix with the policy-gradient objective (GRPO): the cross-entropy's chunked loop

void model_postfix_policy(const Model* m, Workspace* ws, const void* norm_w, const void* head_w,
                          float* dnorm_w, float* dhead_w, const void* x_in, void* dx,
                          const int32_t* targets, const PolicyLoss* pl, float* logp,
                          float* losses, int compute_grad, int B, int T) {
    const Ops* ops = ws->ops;
    void* ctx = ws->ctx;
    const ModelConfig* c = &m->cfg;
    const int N = B * T, C = c->C, V = c->V;
    if (!ops->policy_forward_backward)
        fatal("the %s backend has no policy-gradient op yet (--rl trains on the CPU for now)",
              ops->name);
    ops->rmsnorm_forward(ctx, ws->xf, ws->rstdf, x_in, norm_w, N, C, c->norm_eps);
    for (int r0 = 0; r0 < N; r0 += ws->lm_chunk) {
        int n = imin(ws->lm_chunk, N - r0);
        const void* xf = at(ws, ws->xf, (int64_t)r0 * C);
        ops->matmul_forward(ctx, ws->logits, xf, head_w, NULL, n, C, V);
        ops->policy_forward_backward(ctx, ws->logits, logp + r0, losses + r0, targets + r0,
                                     pl->old_logp + r0, pl->ref_logp ? pl->ref_logp + r0 : NULL,
                                     pl->adv + r0, pl->weight + r0, n, V, pl->inv_temp,
                                     pl->clip_low, pl->clip_high, pl->kl_beta, compute_grad);
        if (compute_grad)
            ops->matmul_backward(ctx, at(ws, ws->d_xf, (int64_t)r0 * C), dhead_w, NULL,
                                 ws->logits, xf, head_w, n, C, V);
    }
    if (compute_grad) {
        ops->zero(ctx, dx, (size_t)N * C * (size_t)ops->act_bytes);
        ops->rmsnorm_backward(ctx, dx, dnorm_w, ws->d_xf, x_in, norm_w, ws->rstdf, N, C);
    }
}
