/*
 * quant.c — the frozen base in a block format (quant.h): --base-dtype, which tensors are held
 * quantised, ggml's reference quantisers (Q8_0, Q4_K, MXFP4), and the
 * byte counts of a layer's frozen head as held and uploaded.
 */
#include "quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common.h"
#include "store.h"
#include "threads.h"

// ----------------------------------------------------------------------------
// names

static const char* const dtype_names[] = {"bf16", "q8_0", "q4_k", "mxfp4", "keep"};

int quant_parse_base_dtype(const char* s, BaseDtype* out, char* err) {
    for (int i = 0; i < (int)(sizeof dtype_names / sizeof dtype_names[0]); i++)
        if (strcasecmp(s, dtype_names[i]) == 0) {
            *out = (BaseDtype)i;
            return 0;
        }
    return errorf(err, "--base-dtype %s: unknown (use bf16, q8_0, q4_k, mxfp4 or keep)", s);
}

const char* quant_base_dtype_name(BaseDtype d) { return dtype_names[d]; }

int quant_type_supported(int type) {
    return type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_MXFP4;
}

const char* quant_type_name(int type) {
    return type == GGML_TYPE_Q8_0 ? "q8_0" : type == GGML_TYPE_Q4_K ? "q4_k"
                                           : type == GGML_TYPE_MXFP4 ? "mxfp4" : "bf16";
}

size_t quant_tensor_bytes(const TensorDesc* d, size_t ab) {
    return d->qtype ? (size_t)ggml_type_bytes(d->qtype, d->numel) : (size_t)d->numel * ab;
}

// ----------------------------------------------------------------------------
// the table

// A frozen base matrix that --base-dtype quantises: a linear an adapter sits on, or experts.
static int quantisable(const TensorTable* tt, const TensorDesc* d) {
    if (d->trainable || d->tied_to >= 0 || d->ndim < 2) return 0;
    static const struct { TensorKind kind; LoraTarget target; } linears[] = {
        {TK_WQ, LORA_Q},         {TK_WK, LORA_K},    {TK_WV, LORA_V},
        {TK_WO, LORA_O},         {TK_W_GATE, LORA_GATE}, {TK_W_UP, LORA_UP},
        {TK_W_DOWN, LORA_DOWN},  {TK_ROUTER, LORA_ROUTER},
    };
    for (size_t k = 0; k < sizeof linears / sizeof linears[0]; k++)
        if (d->kind == linears[k].kind) return (tt->lora.targets & LORA_BIT(linears[k].target)) != 0;
    return d->kind == TK_EXP_GATE_UP || d->kind == TK_EXP_DOWN;
}

// The GGUF's type of descriptor d (its first part's: llama.cpp splits some expert tensors),
// or -1 if the file lacks it.
static int gguf_type_of(const GgufFile* f, const ModelConfig* cfg, const TensorDesc* d) {
    GgufPart parts[2];
    gguf_tensor_parts(cfg, d, parts);
    const GgufTensor* t = gguf_find_tensor(f, parts[0].name);
    return t ? (int)t->type : -1;
}

int quant_table_set(TensorTable* tt, BaseDtype dtype, const GgufFile* gguf, const ModelConfig* cfg,
                    char* err) {
    for (int i = 0; i < tt->n; i++) tt->t[i].qtype = 0;
    if (dtype == BASE_DTYPE_BF16) return 0;
    if (tt->lora.r <= 0)
        return errorf(err, "--base-dtype %s: the base is held in a block format only for LoRA "
                      "runs (give --lora-r R; full fine-tuning trains every weight)",
                      quant_base_dtype_name(dtype));
    if (dtype == BASE_DTYPE_KEEP && !gguf)
        return errorf(err, "--base-dtype keep: keeps the GGUF's own block formats, and the model "
                      "is not a GGUF file (use q8_0, q4_k or mxfp4 to quantise it on load)");
    const int fixed = dtype == BASE_DTYPE_Q8_0   ? GGML_TYPE_Q8_0
                      : dtype == BASE_DTYPE_Q4_K ? GGML_TYPE_Q4_K
                                                 : GGML_TYPE_MXFP4;
    for (int i = 0; i < tt->n; i++) {
        TensorDesc* d = &tt->t[i];
        if (!quantisable(tt, d)) continue;
        int type = fixed;
        if (dtype == BASE_DTYPE_KEEP) {
            type = gguf_type_of(gguf, cfg, d);
            if (!quant_type_supported(type)) continue;  // (F32/F16/BF16, other blocks: bf16)
        }
        const int block = ggml_type_block(type, NULL);
        const int64_t width = d->shape[d->ndim - 1];
        if (width % block != 0)
            return errorf(err, "--base-dtype %s: %s is %lld wide, not a multiple of %s's "
                          "%d-element blocks (use --base-dtype %s or bf16)",
                          quant_base_dtype_name(dtype), d->hf_name, (long long)width,
                          quant_type_name(type), block,
                          width % 32 == 0 ? "q8_0" : "bf16");
        d->qtype = type;
    }
    return 0;
}

int quant_table_count(const TensorTable* tt) {
    int n = 0;
    for (int i = 0; i < tt->n; i++) n += tt->t[i].qtype != 0;
    return n;
}

size_t quant_layer_head_bytes(const TensorTable* tt, int l, size_t ab) {
    size_t bytes = 0;
    for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->owner_layer == l && d->tied_to < 0 && !d->trainable) bytes += quant_tensor_bytes(d, ab);
    }
    return bytes;
}

size_t quant_layer_block_bytes(const TensorTable* tt, int l) {
    size_t bytes = 0;
    for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++)
        if (tt->t[i].qtype && tt->t[i].owner_layer == l) bytes += quant_tensor_bytes(&tt->t[i], 0);
    return bytes;
}

double quant_head_bytes(const TensorTable* tt, size_t ab) {
    double bytes = 0;
    for (int l = 0; l < tt->n_layers; l++) bytes += (double)quant_layer_head_bytes(tt, l, ab);
    return bytes;
}

// ----------------------------------------------------------------------------
// ggml's reference quantisers (ggml-quants.c quantize_row_*_ref)

static void put_le16(uint8_t* p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xFF);
    p[1] = (uint8_t)(v >> 8);
}

// Round to nearest, ties to even, for |f| <= 4194303 (ggml's nearest_int).
static int nearest_int(float f) {
    const float v = f + 12582912.f;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

static void q8_0_block(const float* x, uint8_t* y) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_le16(y, f32_to_f16(d));
    for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

// make_qkx2_quants(n = 32, nmax = 15, ..., rmin = -1, rdelta = 0.1, nstep = 20, use_mad = false)
static float qkx2_quants(const float* x, const float* w, uint8_t* L, float* the_min) {
    const int n = 32, nmax = 15, nstep = 20;
    const float rmin = -1.0f, rdelta = 0.1f;
    uint8_t Laux[32];
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.0f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; i++) {
        const int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        const float diff = scale * L[i] + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * (x[i] - min));
            l = l < 0 ? 0 : l > nmax ? nmax : l;
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float mad = 0;
            for (int i = 0; i < n; i++) {
                const float diff = this_scale * Laux[i] + this_min - x[i];
                mad += w[i] * (diff * diff);
            }
            if (mad < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = mad;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

// Six-bit scale and min of sub-block j (ggml's get_scale_min_k4).
static void q4k_get_scale_min(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// block_q4_K: d (f16), dmin (f16), scales[12], qs[128]
static void q4_k_block(const float* x, uint8_t* y) {
    uint8_t L[256];
    float weights[32], mins[8], scales[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = qkx2_quants(x + 32 * j, weights, L + 32 * j, &mins[j]);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    uint8_t* sc = y + 4;
    memset(sc, 0, 12);
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < 8; j++) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    const uint16_t dh = f32_to_f16(max_scale / 63.f), mh = f32_to_f16(max_min / 63.f);
    put_le16(y, dh);
    put_le16(y + 2, mh);
    for (int j = 0; j < 8; j++) {
        uint8_t s, m;
        q4k_get_scale_min(j, sc, &s, &m);
        const float d = f16_to_f32(dh) * s;
        if (!d) continue;
        const float dm = f16_to_f32(mh) * m;
        for (int ii = 0; ii < 32; ii++) {
            int l = nearest_int((x[32 * j + ii] + dm) / d);
            L[32 * j + ii] = (uint8_t)(l < 0 ? 0 : l > 15 ? 15 : l);
        }
    }
    uint8_t* q = y + 16;
    for (int j = 0; j < 256; j += 64) {
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        q += 32;
    }
}

// ggml's kvalues_mxfp4: E2M1 values times two (the E8M0 scale is halved to match)
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) from the bits (ggml's GGML_E8M0_TO_FP32_HALF)
static float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint8_t mxfp4_best_index(float x, float e) {
    int best = 0;
    float best_err = fabsf(kvalues_mxfp4[0] * e - x);
    for (int i = 1; i < 16; i++) {
        const float err = fabsf(kvalues_mxfp4[i] * e - x);
        if (err < best_err) {
            best = i;
            best_err = err;
        }
    }
    return (uint8_t)best;
}

// block_mxfp4: e (E8M0), qs[16] (element j low nibble, j + 16 high nibble)
static void mxfp4_block(const float* x, uint8_t* y) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) amax = fabsf(x[j]);
    const uint8_t e = amax > 0.0f ? (uint8_t)(floorf(log2f(amax)) - 2 + 127) : 0;
    const float d = e8m0_half(e);
    y[0] = e;
    for (int j = 0; j < 16; j++)
        y[1 + j] = (uint8_t)(mxfp4_best_index(x[j], d) | (mxfp4_best_index(x[16 + j], d) << 4));
}

void quant_quantize(int type, const float* x, uint8_t* y, int64_t n) {
    int bytes = 0;
    const int block = ggml_type_block(type, &bytes);
    if (!quant_type_supported(type) || n % block != 0)
        fatal("internal: quant_quantize(%s, %lld elements)", quant_type_name(type), (long long)n);
    void (*fn)(const float*, uint8_t*) = type == GGML_TYPE_Q8_0   ? q8_0_block
                                         : type == GGML_TYPE_Q4_K ? q4_k_block
                                                                  : mxfp4_block;
    for (int64_t b = 0; b < n / block; b++) fn(x + b * block, y + b * bytes);
}

void quant_dequantize(int type, const uint8_t* y, float* x, int64_t n) {
    if (ggml_dequantize(type, y, x, n) != 0)
        fatal("internal: quant_dequantize(%s, %lld elements)", quant_type_name(type), (long long)n);
}

// ----------------------------------------------------------------------------
// the Store's blocks

// keep: the GGUF's blocks of d as they are, when they are d's elements in d's order (the
// loader's fp32 values are exactly their dequantisation); 0 if not.
static int take_gguf_blocks(const GgufFile* gguf, const ModelConfig* cfg, const TensorDesc* d,
                            const float* w, uint8_t* out) {
    GgufPart parts[2];
    if (!gguf || gguf_tensor_parts(cfg, d, parts) != 1 || gguf_parts_rearranged(cfg, d))
        return 0;
    const GgufTensor* t = gguf_find_tensor(gguf, parts[0].name);
    if (!t || (int)t->type != d->qtype || t->numel != d->numel) return 0;
    float* check = malloc_check((size_t)d->numel * sizeof(float));
    quant_dequantize(d->qtype, t->data, check, d->numel);
    const int same = memcmp(check, w, (size_t)d->numel * sizeof(float)) == 0;
    free(check);
    if (same) memcpy(out, t->data, quant_tensor_bytes(d, 0));
    return same;
}

void quant_tensor_blocks(const TensorDesc* d, const float* w, uint8_t* blocks,
                         const GgufFile* gguf, const ModelConfig* cfg) {
    if (!take_gguf_blocks(gguf, cfg, d, w, blocks)) quant_quantize(d->qtype, w, blocks, d->numel);
}

// ----------------------------------------------------------------------------
// a streamed base (store_create_streamed)

double quant_fp32_bytes(const TensorTable* tt) {
    double bytes = 0.0;
    for (int i = 0; i < tt->n; i++)
        if (tt->t[i].qtype) bytes += 4.0 * (double)tt->t[i].numel;
    return bytes;
}

double quant_stream_staging_bytes(const TensorTable* tt, int threads, int from_file, int bf16) {
    double largest = 0.0;
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        const int streamed = d->qtype || (bf16 && !d->trainable && d->tied_to < 0);
        if (streamed && (double)d->numel > largest) largest = (double)d->numel;
    }
    // the random init: one chunk of store.c's 2^20 elements per thread; a load: one tensor's
    // fp32 values per thread (a GGUF reads a whole tensor; a safetensors part is at most that)
    if (!from_file && largest > (double)(1 << 20)) largest = (double)(1 << 20);
    return (threads > 0 ? threads : 1) * 4.0 * largest;
}
