/*
 * lora.c — LoRA adapters: the --lora-targets list, the scale, the adapters' forward and backward
 * against the op table, their init and their merge into the base. PEFT adapter files are
 * lora_peft.c's. See lora.h for the math.
 */
#include "lora.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "rng.h"

// ----------------------------------------------------------------------------
// targets and scale

// The flag's names of the linears (the experts are one name, "experts", for both projections).
static const char* const short_names[LORA_EXP_GATE_UP] = {"q",    "k",  "v",    "o",
                                                          "gate", "up", "down", "router"};

int lora_parse_targets(const char* s, unsigned* targets, char* err) {
    *targets = 0;
    if (strcmp(s, "all-linear") == 0) {
        *targets = LORA_ALL_LINEAR;
        return 0;
    }
    char buf[256];
    if (strlen(s) >= sizeof buf) return errorf(err, "list too long");
    str_copy(buf, sizeof buf, s);
    char* save = NULL;
    for (char* tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int found = 0;
        for (int tg = 0; tg < LORA_EXP_GATE_UP && !found; tg++) {
            if (strcmp(tok, short_names[tg]) == 0 ||
                strcmp(tok, lora_target_name((LoraTarget)tg)) == 0) {
                *targets |= LORA_BIT(tg);
                found = 1;
            }
        }
        if (!found && strcmp(tok, "experts") == 0) *targets |= LORA_EXPERTS_BIT, found = 1;
        if (!found)
            return errorf(err, "unknown module '%s' (expected all-linear or a comma list of q, k, "
                               "v, o, gate, up, down, router, experts)", tok);
    }
    if (*targets == 0) return errorf(err, "no module named");
    return 0;
}

void lora_targets_string(unsigned targets, char* buf, size_t cap) {
    size_t len = 0;
    buf[0] = '\0';
    for (int tg = 0; tg < LORA_EXP_GATE_UP; tg++) {
        if (!(targets & LORA_BIT(tg))) continue;
        int w = snprintf(buf + len, cap - len, "%s%s", len ? "," : "", short_names[tg]);
        if (w < 0 || (size_t)w >= cap - len) return;
        len += (size_t)w;
    }
    if (targets & LORA_EXPERTS_BIT) snprintf(buf + len, cap - len, "%sexperts", len ? "," : "");
}

// alpha / r (rsLoRA: alpha / sqrt(r)) in double, rounded once.
static float scale_of(int r, float alpha, int rslora) {
    if (r <= 0) return 0.0f;
    return rslora ? (float)((double)alpha / sqrt((double)r)) : (float)((double)alpha / (double)r);
}

float lora_scale(const LoraSpec* l) { return scale_of(l->r, l->alpha, l->rslora); }

// A target's scale: PEFT's scaling of its module (the expert gate_up on Qwen3-MoE has rank 2r and
// alpha 2·alpha, tensor.h: the same alpha / r, but not the same alpha / sqrt(r)).
static float target_scale(const Model* m, LoraTarget tg) {
    const LoraSpec* l = &m->tt.lora;
    return scale_of(lora_target_rank(&m->cfg, l, tg), lora_target_alpha(&m->cfg, l, tg),
                    l->rslora);
}

uint64_t lora_dropout_seed(uint32_t seed, int64_t done, int mb) {
    uint64_t z = ((uint64_t)seed << 32 | (uint32_t)mb) ^ ((uint64_t)done * 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// ----------------------------------------------------------------------------
// where an adapter reads and writes: its linear's input width, and its column range [c0, c0 + w)
// of the fused output (ld wide)

typedef struct LoraSite {
    int in, ld, c0, w;
} LoraSite;

static LoraSite lora_site(const Model* m, LoraTarget tg) {
    const ModelConfig* c = &m->cfg;
    const int C = c->C, F = c->F, QD = c->H * c->HD, KVD = c->KVH * c->HD;
    switch (tg) {
    case LORA_Q: return (LoraSite){C, m->QKV, 0, QD};
    case LORA_K: return (LoraSite){C, m->QKV, QD, KVD};
    case LORA_V: return (LoraSite){C, m->QKV, QD + KVD, KVD};
    case LORA_O: return (LoraSite){QD, C, 0, C};
    case LORA_GATE: return (LoraSite){C, 2 * F, 0, F};
    case LORA_UP: return (LoraSite){C, 2 * F, F, F};
    case LORA_ROUTER: return (LoraSite){C, c->E, 0, c->E};
    default: return (LoraSite){F, C, 0, C};  // LORA_DOWN
    }
}

// The widest input and output of any linear (the scratch's row widths).
static int64_t widest(const Model* m) {
    const ModelConfig* c = &m->cfg;
    int64_t w = c->C;
    if ((int64_t)c->H * c->HD > w) w = (int64_t)c->H * c->HD;
    if (c->F > w) w = c->F;
    if (c->E > w) w = c->E;
    return w;
}

// ----------------------------------------------------------------------------
// the adapters of one fused linear: the targets in a mask that the block has, sharing input x.
// Without dropout they run as one: their A's are adjacent in the slab (tensor.c, lora_slab_pass),
// one (k·r, in) matrix A_s, so t_s = x·A_sᵀ is one (n, k·r) product (one pass over x instead of k)
// and so are dx += dt_s·A_s and dA_s += dt_sᵀ·x; each B still writes its own column range.

typedef struct LoraGroup {
    int n;                     // adapters, in target order
    LoraTarget tg[LORA_N_DENSE_TARGETS];
    int in, ld, rank;          // the shared input's width, the fused output's, t's (n · r)
    int64_t a, ga;             // the first A in the parameter slab, its gradient in gslab
} LoraGroup;

static LoraGroup lora_group(const Model* m, int block, unsigned mask) {
    const BlockLayout* bl = &m->layout[block];
    const BlockLayout* gl = &m->glayout[block];
    const int r = m->tt.lora.r;
    LoraGroup g = {0};
    for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
        if (!(mask & LORA_BIT(tg)) || bl->lora_a[tg] < 0 || lora_target_is_expert((LoraTarget)tg))
            continue;
        const LoraSite st = lora_site(m, (LoraTarget)tg);
        if (g.n == 0) {
            g.in = st.in, g.ld = st.ld, g.a = bl->lora_a[tg], g.ga = gl->lora_a[tg];
        } else if (g.n == LORA_N_DENSE_TARGETS || st.in != g.in || st.ld != g.ld ||
                   bl->lora_a[tg] != g.a + (int64_t)g.rank * g.in ||
                   gl->lora_a[tg] != g.ga + (int64_t)g.rank * g.in) {
            fatal("internal: LoRA adapters of block %d (mask %#x) do not share an input and "
                  "adjacent A's", block, mask);
        }
        g.tg[g.n++] = (LoraTarget)tg;
        g.rank += r;
    }
    return g;
}

// ----------------------------------------------------------------------------
// scratch: t and dt (rows, the widest fused linear's k·r), tmp (rows, widest), drop(x) (rows,
// widest) with dropout. The expert adapters run on the R = n·K routed rows: t, dt (R, 2r at
// most), tmp (R, max(2F, C)).

// The widest t of one fused linear's adapters (k·r: q, k, v run as one; r each with dropout).
static int64_t group_rank_max(const Model* m) {
    const LoraSpec* l = &m->tt.lora;
    if (l->dropout > 0) return l->r;
    const unsigned sites[] = {LORA_BIT(LORA_Q) | LORA_BIT(LORA_K) | LORA_BIT(LORA_V),
                              LORA_BIT(LORA_O), LORA_BIT(LORA_GATE) | LORA_BIT(LORA_UP),
                              LORA_BIT(LORA_DOWN), LORA_BIT(LORA_ROUTER)};
    int64_t most = l->r;
    for (int b = 0; b < m->cfg.L; b++)
        for (size_t i = 0; i < sizeof sites / sizeof sites[0]; i++) {
            const int64_t k = lora_group(m, b, sites[i]).rank;
            if (k > most) most = k;
        }
    return most;
}

static void scratch_elems(const Model* m, int64_t n, size_t* t_elems, size_t* tmp_elems) {
    const LoraSpec* l = &m->tt.lora;
    const ModelConfig* c = &m->cfg;
    *t_elems = (size_t)n * (size_t)group_rank_max(m);
    *tmp_elems = (size_t)n * (size_t)widest(m);
    if (!(l->targets & LORA_EXPERTS_BIT)) return;
    const size_t R = (size_t)n * (size_t)c->K;
    const size_t rank = (size_t)lora_target_rank(c, l, LORA_EXP_GATE_UP);
    const size_t w = (size_t)(2 * c->F_expert > c->C ? 2 * c->F_expert : c->C);
    if (R * rank > *t_elems) *t_elems = R * rank;
    if (R * w > *tmp_elems) *tmp_elems = R * w;
}

size_t lora_scratch_bytes(const Model* m, size_t act_bytes, int64_t n) {
    const LoraSpec* l = &m->tt.lora;
    if (l->r <= 0) return 0;
    const size_t w = (size_t)widest(m), rows = (size_t)n;
    size_t t_elems, tmp_elems;
    scratch_elems(m, n, &t_elems, &tmp_elems);
    size_t bytes = (2 * t_elems + tmp_elems) * act_bytes;  // t, dt, tmp
    if (l->dropout > 0) bytes += rows * w * act_bytes;     // drop(x)
    return bytes;
}

void lora_scratch_alloc(const Model* m, Workspace* ws, int64_t n) {
    const LoraSpec* l = &m->tt.lora;
    if (l->r <= 0) return;
    const size_t ab = (size_t)ws->ops->act_bytes, w = (size_t)widest(m), rows = (size_t)n;
    size_t t_elems, tmp_elems;
    scratch_elems(m, n, &t_elems, &tmp_elems);
    ws->lora_t = ws->ops->alloc(ws->ctx, t_elems * ab);
    ws->lora_dt = ws->ops->alloc(ws->ctx, t_elems * ab);
    ws->lora_tmp = ws->ops->alloc(ws->ctx, tmp_elems * ab);
    if (l->dropout > 0) ws->lora_xd = ws->ops->alloc(ws->ctx, rows * w * ab);
}

void lora_scratch_free(Workspace* ws) {
    void* bufs[] = {ws->lora_t, ws->lora_dt, ws->lora_tmp, ws->lora_xd};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ws->ops->free(ws->ctx, bufs[i]);
    ws->lora_t = ws->lora_dt = ws->lora_tmp = ws->lora_xd = NULL;
}

// ----------------------------------------------------------------------------
// the branch's input (dropout), the adapters' coverage of their output, the kept t

static inline void* byte_at(const Workspace* ws, const void* p, int64_t i) {
    return (char*)p + (size_t)i * (size_t)ws->ops->act_bytes;
}

// The dropout mask's seed of one adapter in this micro-batch (the dense targets' keys as before
// the router came; the router's a range of its own).
static uint64_t site_seed(const Workspace* ws, int block, LoraTarget tg) {
    const uint64_t key = tg < LORA_N_DENSE_TARGETS
                             ? (uint64_t)block * LORA_N_DENSE_TARGETS + (uint64_t)tg + 1
                             : (1ull << 40) + (uint64_t)block * LORA_ROUTER_SEED_STRIDE +
                                   (uint64_t)tg;
    uint64_t z = ws->lora_seed ^ (key * 0xd1b54a32d192ed03ull);
    z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdull;
    return z ^ (z >> 33);
}

// The adapter's input: x, or drop(x) in the scratch while training with dropout.
static const void* branch_input(const Model* m, Workspace* ws, int block, LoraTarget tg,
                                const void* x, int n, int in, int64_t row0) {
    const float p = m->tt.lora.dropout;
    if (!ws->lora_train || p <= 0) return x;
    ws->ops->dropout(ws->ctx, ws->lora_xd, x, p, site_seed(ws, block, tg), ws->lora_row0 + row0,
                     n, in);
    return ws->lora_xd;
}

int lora_covers(const Model* m, int block, unsigned mask) {
    if (m->tt.lora.r <= 0 || m->tt.lora.dropout > 0) return 0;
    const LoraGroup g = lora_group(m, block, mask);
    int width = 0;
    for (int i = 0; i < g.n; i++) width += lora_site(m, g.tg[i]).w;
    return g.n > 0 && width == g.ld;
}

// The dense targets' t a block's forward keeps for its backward (BlockActs.lora_t): each fused
// linear's (n, k·r) in target order, one after the other. None with dropout (its per-adapter
// inputs: the backward recomputes t from drop(x)).
int64_t lora_saved_t_width(const Model* m) {
    const LoraSpec* l = &m->tt.lora;
    if (l->r <= 0 || l->dropout > 0) return 0;
    int64_t most = 0;
    for (int b = 0; b < m->cfg.L; b++) {
        int64_t w = 0;
        for (int tg = 0; tg < LORA_N_DENSE_TARGETS; tg++)
            if (m->layout[b].lora_a[tg] >= 0) w += l->r;
        if (w > most) most = w;
    }
    return most;
}

int64_t lora_saved_t_offset(const Model* m, int block, unsigned mask, int n) {
    int64_t cols = 0;
    for (int tg = 0; tg < LORA_N_DENSE_TARGETS && !(mask & LORA_BIT(tg)); tg++)
        if (m->layout[block].lora_a[tg] >= 0) cols += m->tt.lora.r;
    return cols * (int64_t)n;
}

// ----------------------------------------------------------------------------
// with dropout: adapter by adapter (each drops its own elements of x), onto the base's output

static void forward_dropout(const Model* m, Workspace* ws, int block, const LoraGroup* g,
                            const void* slab, const void* x, void* y, int n, int64_t row0) {
    const int r = m->tt.lora.r;
    const Ops* ops = ws->ops;
    const BlockLayout* bl = &m->layout[block];
    for (int i = 0; i < g->n; i++) {
        const LoraTarget tg = g->tg[i];
        const LoraSite st = lora_site(m, tg);
        const void* xa = branch_input(m, ws, block, tg, x, n, st.in, row0);
        // t = drop(x)·Aᵀ (n, r); y[:, c0:c0+w] += scale · t·Bᵀ
        ops->matmul_forward(ws->ctx, ws->lora_t, xa, byte_at(ws, slab, bl->lora_a[tg]), NULL, n,
                            st.in, r);
        ops->matmul_cols_forward(ws->ctx, y, 1, ws->lora_t, r, byte_at(ws, slab, bl->lora_b[tg]),
                                 m->lora_scale, n, r, st.w, st.ld, st.c0);
    }
}

static void backward_dropout(const Model* m, Workspace* ws, int block, const LoraGroup* g,
                             const void* slab, float* gslab, const void* x, const void* dy,
                             void* dx, int n, int64_t row0) {
    const int r = m->tt.lora.r;
    const Ops* ops = ws->ops;
    const BlockLayout* bl = &m->layout[block];
    const BlockLayout* gl = &m->glayout[block];
    const float p = m->tt.lora.dropout;
    for (int i = 0; i < g->n; i++) {
        const LoraTarget tg = g->tg[i];
        const LoraSite st = lora_site(m, tg);
        const void* A = byte_at(ws, slab, bl->lora_a[tg]);
        const void* Bw = byte_at(ws, slab, bl->lora_b[tg]);
        float* dA = gslab + gl->lora_a[tg];
        float* dB = gslab + gl->lora_b[tg];
        // t = drop(x)·Aᵀ again (the same mask: the same bits as the forward's)
        const void* xa = branch_input(m, ws, block, tg, x, n, st.in, row0);
        ops->matmul_forward(ws->ctx, ws->lora_t, xa, A, NULL, n, st.in, r);
        // g = scale · dy[:, c0:c0+w] (n, w), read in place; dt = g·B (n, r); dB += gᵀ·t
        ops->matmul_cols_backward(ws->ctx, ws->lora_dt, 0, dB, dy, ws->lora_t, Bw, m->lora_scale,
                                  n, r, r, st.w, st.ld, st.c0);
        // dx += drop(dt·A): the dropout is linear, its backward the same mask; dA += dtᵀ·drop(x)
        if (ws->lora_train && p > 0) {
            ops->matmul_cols_backward(ws->ctx, ws->lora_tmp, 0, dA, ws->lora_dt, xa, A, 1.0f, n,
                                      st.in, st.in, r, r, 0);
            ops->dropout(ws->ctx, ws->lora_tmp, ws->lora_tmp, p, site_seed(ws, block, tg),
                         ws->lora_row0 + row0, n, st.in);
            ops->add(ws->ctx, dx, dx, ws->lora_tmp, (size_t)n * (size_t)st.in);
        } else {
            ops->matmul_cols_backward(ws->ctx, dx, 1, dA, ws->lora_dt, xa, A, 1.0f, n, st.in,
                                      st.in, r, r, 0);
        }
    }
}

// ----------------------------------------------------------------------------
// forward and backward

void lora_forward(const Model* m, Workspace* ws, int block, unsigned mask, const void* slab,
                  const void* x, void* y, int n, int64_t row0, int accumulate, void* t_keep) {
    if (m->tt.lora.r <= 0) return;
    const LoraGroup g = lora_group(m, block, mask);
    if (g.n == 0) return;
    if (m->tt.lora.dropout > 0) {
        if (!accumulate) fatal("internal: LoRA with dropout adds onto the base's output");
        forward_dropout(m, ws, block, &g, slab, x, y, n, row0);
        return;
    }
    const Ops* ops = ws->ops;
    const BlockLayout* bl = &m->layout[block];
    const int r = m->tt.lora.r;
    // t = x·A_sᵀ (n, k·r), kept for the backward when t_keep is given
    void* t = t_keep ? t_keep : ws->lora_t;
    ops->matmul_forward(ws->ctx, t, x, byte_at(ws, slab, g.a), NULL, n, g.in, g.rank);
    // y[:, c0:c0+w] (+)= scale · t_i·B_iᵀ, t_i adapter i's r columns of t
    for (int i = 0; i < g.n; i++) {
        const LoraSite st = lora_site(m, g.tg[i]);
        ops->matmul_cols_forward(ws->ctx, y, accumulate, byte_at(ws, t, (int64_t)i * r), g.rank,
                                 byte_at(ws, slab, bl->lora_b[g.tg[i]]), m->lora_scale, n, r,
                                 st.w, st.ld, st.c0);
    }
}

void lora_backward(const Model* m, Workspace* ws, int block, unsigned mask, const void* slab,
                   float* gslab, const void* x, const void* dy, void* dx, int n, int64_t row0,
                   int accumulate, const void* t_kept) {
    if (m->tt.lora.r <= 0) return;
    const LoraGroup g = lora_group(m, block, mask);
    if (g.n == 0) return;
    if (m->tt.lora.dropout > 0) {
        if (!accumulate) fatal("internal: LoRA with dropout adds onto the base's input gradient");
        backward_dropout(m, ws, block, &g, slab, gslab, x, dy, dx, n, row0);
        return;
    }
    const Ops* ops = ws->ops;
    const BlockLayout* bl = &m->layout[block];
    const BlockLayout* gl = &m->glayout[block];
    const int r = m->tt.lora.r;
    const void* A = byte_at(ws, slab, g.a);
    // t = x·A_sᵀ: the forward's, or again
    const void* t = t_kept;
    if (!t) {
        ops->matmul_forward(ws->ctx, ws->lora_t, x, A, NULL, n, g.in, g.rank);
        t = ws->lora_t;
    }
    // per adapter: g_i = scale · dy[:, c0:c0+w] (n, w), read in place; dt_i = g_i·B_i into its r
    // columns of dt (n, k·r); dB_i += g_iᵀ·t_i
    for (int i = 0; i < g.n; i++) {
        const LoraTarget tg = g.tg[i];
        const LoraSite st = lora_site(m, tg);
        ops->matmul_cols_backward(ws->ctx, byte_at(ws, ws->lora_dt, (int64_t)i * r), 0,
                                  gslab + gl->lora_b[tg], dy, byte_at(ws, t, (int64_t)i * r),
                                  byte_at(ws, slab, bl->lora_b[tg]), m->lora_scale, n, r, g.rank,
                                  st.w, st.ld, st.c0);
    }
    // dx (+)= dt·A_s (one product over k·r); dA_s += dtᵀ·x
    ops->matmul_cols_backward(ws->ctx, dx, accumulate, gslab + g.ga, ws->lora_dt, x, A, 1.0f, n,
                              g.in, g.in, g.rank, g.rank, 0);
}

// The expert adapters: the same products per expert, on the rows routed to it (offsets), through
// the grouped matmul (A as (E, rank, in), B as (E, out, rank): nn.Linear's layout per expert).
// No dropout (tensor_table_build_lora refuses it with expert targets, as PEFT does).

void lora_expert_forward(const Model* m, Workspace* ws, int block, LoraTarget tg,
                         const void* slab, const void* x, void* y, const int32_t* offsets, int R) {
    const BlockLayout* bl = &m->layout[block];
    if (m->tt.lora.r <= 0 || bl->lora_a[tg] < 0) return;
    const Ops* ops = ws->ops;
    const int E = m->cfg.E, r = lora_target_rank(&m->cfg, &m->tt.lora, tg);
    int64_t in64, out64;
    lora_target_dims(&m->cfg, tg, &in64, &out64);
    const int in = (int)in64, out = (int)out64;
    // t = x_e·A_eᵀ (R, r); tmp = scale · t_e·B_eᵀ (R, out); y += tmp
    ops->moe_matmul_forward(ws->ctx, ws->lora_t, x, byte_at(ws, slab, bl->lora_a[tg]), NULL,
                            offsets, R, E, in, r, 0);
    ops->moe_matmul_forward(ws->ctx, ws->lora_tmp, ws->lora_t, byte_at(ws, slab, bl->lora_b[tg]),
                            NULL, offsets, R, E, r, out, 0);
    ops->scale(ws->ctx, ws->lora_tmp, ws->lora_tmp, target_scale(m, tg), (size_t)R * out);
    ops->add(ws->ctx, y, y, ws->lora_tmp, (size_t)R * out);
}

void lora_expert_backward(const Model* m, Workspace* ws, int block, LoraTarget tg,
                          const void* slab, float* gslab, const void* x, const void* dy, void* dx,
                          const int32_t* offsets, int R) {
    const BlockLayout* bl = &m->layout[block];
    if (m->tt.lora.r <= 0 || bl->lora_a[tg] < 0) return;
    const BlockLayout* gl = &m->glayout[block];
    const Ops* ops = ws->ops;
    const int E = m->cfg.E, r = lora_target_rank(&m->cfg, &m->tt.lora, tg);
    int64_t in64, out64;
    lora_target_dims(&m->cfg, tg, &in64, &out64);
    const int in = (int)in64, out = (int)out64;
    const void* A = byte_at(ws, slab, bl->lora_a[tg]);
    const void* Bw = byte_at(ws, slab, bl->lora_b[tg]);
    // t = x_e·A_eᵀ again; g = scale · dy (R, out); dt = g_e·B_e (R, r); dB_e += g_eᵀ·t_e
    ops->moe_matmul_forward(ws->ctx, ws->lora_t, x, A, NULL, offsets, R, E, in, r, 0);
    ops->scale(ws->ctx, ws->lora_tmp, dy, target_scale(m, tg), (size_t)R * out);
    ops->moe_matmul_backward(ws->ctx, ws->lora_dt, gslab + gl->lora_b[tg], NULL, ws->lora_tmp,
                             ws->lora_t, Bw, offsets, R, E, r, out, 0);
    // tmp = dt_e·A_e (R, in); dA_e += dt_eᵀ·x_e; dx += tmp
    ops->moe_matmul_backward(ws->ctx, ws->lora_tmp, gslab + gl->lora_a[tg], NULL, ws->lora_dt, x,
                             A, offsets, R, E, in, r, 0);
    ops->add(ws->ctx, dx, dx, ws->lora_tmp, (size_t)R * (size_t)in);
}

// ----------------------------------------------------------------------------
// init and merge

static uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

void lora_init_random(const Model* m, Store* s, uint32_t seed) {
    const TensorTable* tt = &m->tt;
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->lora_target < 0) continue;
        float* p = store_param(s, i);
        if (d->kind == TK_LORA_B) {
            memset(p, 0, (size_t)d->numel * sizeof(float));
            continue;
        }
        // nn.Linear's kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound
        // gain · sqrt(3 / fan_in) = 1 / sqrt(fan_in); the experts' A is one nn.Linear
        // (in, rank·E) in PEFT's ParamWrapper: the same fan_in
        const double bound = 1.0 / sqrt((double)d->shape[d->ndim - 1]);
        Rng rng;
        rng_seed(&rng, mix32(seed ^ mix32(0x10a5u + (uint32_t)i * 0x9e3779b9u)));
        for (int64_t j = 0; j < d->numel; j++)
            p[j] = (float)((2.0 * (double)rng_uniform(&rng) - 1.0) * bound);
    }
}

static TensorKind base_kind(LoraTarget tg) {
    static const TensorKind kinds[LORA_N_TARGETS] = {
        TK_WQ,     TK_WK,     TK_WV,          TK_WO,      TK_W_GATE,
        TK_W_UP,   TK_W_DOWN, TK_ROUTER,      TK_EXP_GATE_UP, TK_EXP_DOWN};
    return kinds[tg];
}

// W_e += scale · B_e·A_e for every expert e, as PEFT's ParamWrapper.get_delta_weight (the einsum
// over the rank, then scaled): W (E, out, in) (Qwen3-MoE, nn.Linear) or (E, in, out) (GPT-OSS,
// is_transposed: the delta "e i o").
static void merge_experts(const Model* m, LoraTarget tg, const float* A, const float* B,
                          float* W) {
    const int E = m->cfg.E, r = lora_target_rank(&m->cfg, &m->tt.lora, tg);
    const int in_out = m->cfg.family == FAMILY_GPTOSS;
    const float scale = target_scale(m, tg);
    int64_t in, out;
    lora_target_dims(&m->cfg, tg, &in, &out);
    double* row = malloc_check((size_t)in * sizeof(double));
    for (int e = 0; e < E; e++) {
        const float* Ae = A + (int64_t)e * r * in;   // (r, in)
        const float* Be = B + (int64_t)e * out * r;  // (out, r)
        float* We = W + (int64_t)e * out * in;
        for (int64_t o = 0; o < out; o++) {
            for (int64_t j = 0; j < in; j++) row[j] = 0.0;
            for (int k = 0; k < r; k++) {
                const double b = (double)Be[o * r + k];
                const float* a = Ae + (int64_t)k * in;
                for (int64_t j = 0; j < in; j++) row[j] += b * (double)a[j];
            }
            for (int64_t j = 0; j < in; j++) {
                float* w = in_out ? &We[j * out + o] : &We[o * in + j];
                *w += (float)row[j] * scale;
            }
        }
    }
    free(row);
}

void lora_merge(const Model* m, Store* s) {
    const TensorTable* tt = &m->tt;
    const int r = tt->lora.r;
    if (r <= 0) return;
    for (int l = 0; l < m->cfg.L; l++) {
        for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
            const int ia = tensor_table_lora_index(tt, l, (LoraTarget)tg, 0);
            const int ib = tensor_table_lora_index(tt, l, (LoraTarget)tg, 1);
            const int iw = tensor_table_index(tt, base_kind((LoraTarget)tg), l);
            if (ia < 0 || ib < 0 || iw < 0) continue;
            if (lora_target_is_expert((LoraTarget)tg)) {
                merge_experts(m, (LoraTarget)tg, store_param(s, ia), store_param(s, ib),
                              store_param(s, iw));
                continue;
            }
            const int64_t out = tt->t[iw].shape[0], in = tt->t[iw].shape[1];
            const float* A = store_param(s, ia);  // (r, in)
            const float* B = store_param(s, ib);  // (out, r)
            float* W = store_param(s, iw);        // (out, in)
            // W += (B·A) · scale, as PEFT's merge: the product (in double, row by row), then
            // scaled, then added
            double* row = malloc_check((size_t)in * sizeof(double));
            for (int64_t o = 0; o < out; o++) {
                for (int64_t j = 0; j < in; j++) row[j] = 0.0;
                for (int k = 0; k < r; k++) {
                    const double b = (double)B[o * r + k];
                    const float* a = A + (int64_t)k * in;
                    for (int64_t j = 0; j < in; j++) row[j] += b * (double)a[j];
                }
                for (int64_t j = 0; j < in; j++) W[o * in + j] += (float)row[j] * m->lora_scale;
            }
            free(row);
        }
    }
}
