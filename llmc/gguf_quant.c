/*
 * gguf_quant.c — the ggml tensor types: the table of names and block sizes, and dequantisation
 * to fp32 of the types we accept (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q6_K MXFP4).
 *
 * Block layouts follow ggml (docs/FORMATS.md §4.3) operation for operation, so results are
 * bit-identical to gguf-py's dequantize (our oracle in tests).
 */
#include "gguf.h"

#include <math.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// type tables

typedef struct GgmlTypeInfo {
    const char* name;  // NULL: removed or unknown code
    int block;         // elements per block (0: size unknown to this build)
    int bytes;         // bytes per block
    int dequant;       // this build can dequantise it
} GgmlTypeInfo;

static const GgmlTypeInfo ggml_types[GGML_TYPE_COUNT] = {
    [0] = {"F32", 1, 4, 1},         [1] = {"F16", 1, 2, 1},         [2] = {"Q4_0", 32, 18, 1},
    [3] = {"Q4_1", 32, 20, 1},      [6] = {"Q5_0", 32, 22, 1},      [7] = {"Q5_1", 32, 24, 1},
    [8] = {"Q8_0", 32, 34, 1},      [9] = {"Q8_1", 32, 36, 0},      [10] = {"Q2_K", 256, 84, 0},
    [11] = {"Q3_K", 256, 110, 0},   [12] = {"Q4_K", 256, 144, 1},   [13] = {"Q5_K", 256, 176, 0},
    [14] = {"Q6_K", 256, 210, 1},   [15] = {"Q8_K", 256, 292, 0},   [16] = {"IQ2_XXS", 256, 66, 0},
    [17] = {"IQ2_XS", 256, 74, 0},  [18] = {"IQ3_XXS", 256, 98, 0}, [19] = {"IQ1_S", 256, 50, 0},
    [20] = {"IQ4_NL", 32, 18, 0},   [21] = {"IQ3_S", 256, 110, 0},  [22] = {"IQ2_S", 256, 82, 0},
    [23] = {"IQ4_XS", 256, 136, 0}, [24] = {"I8", 1, 1, 0},         [25] = {"I16", 1, 2, 0},
    [26] = {"I32", 1, 4, 0},        [27] = {"I64", 1, 8, 0},        [28] = {"F64", 1, 8, 0},
    [29] = {"IQ1_M", 256, 56, 0},   [30] = {"BF16", 1, 2, 1},       [34] = {"TQ1_0", 256, 54, 0},
    [35] = {"TQ2_0", 256, 66, 0},   [39] = {"MXFP4", 32, 17, 1},    [40] = {"NVFP4", 64, 36, 0},
    [41] = {"Q1_0", 128, 18, 0},    [42] = {"Q2_0", 0, 0, 0},
};

const char* ggml_type_name(int type) {
    return (type >= 0 && type < GGML_TYPE_COUNT) ? ggml_types[type].name : NULL;
}

int ggml_type_can_dequantize(int type) {
    return type >= 0 && type < GGML_TYPE_COUNT && ggml_types[type].dequant;
}

uint64_t ggml_type_bytes(int type, int64_t n) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_types[type].block == 0 || n < 0) return 0;
    const GgmlTypeInfo* ti = &ggml_types[type];
    return (uint64_t)(n / ti->block) * (uint64_t)ti->bytes;
}

int ggml_type_block(int type, int* block_bytes) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_types[type].block == 0) return 0;
    if (block_bytes) *block_bytes = ggml_types[type].bytes;
    return ggml_types[type].block;
}

const char* ggml_supported_types(void) {
    return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, MXFP4";
}

// ----------------------------------------------------------------------------
// dequantisation (ggml-quants.c dequantize_row_*, same operations in the same order)

static float f16_at(const uint8_t* p) { return f16_to_f32(load_le16(p)); }

// E8M0 exponent to 2^(e-128) (ggml's GGML_E8M0_TO_FP32_HALF), built from the bits.
static float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void dq_q8_0(const uint8_t* b, float* y) {
    const float d = f16_at(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

static void dq_q4_0(const uint8_t* b, float* y) {
    const float d = f16_at(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0x0F) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void dq_q4_1(const uint8_t* b, float* y) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0x0F) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static void dq_q5_0(const uint8_t* b, float* y) {
    const float d = f16_at(b);
    const uint32_t qh = load_le32(b + 2);
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int hi0 = (int)((qh >> j) & 1u) << 4, hi1 = (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)(((qs[j] & 0x0F) | hi0) - 16) * d;
        y[j + 16] = (float)(((qs[j] >> 4) | hi1) - 16) * d;
    }
}

static void dq_q5_1(const uint8_t* b, float* y) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = load_le32(b + 4);
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; j++) {
        const int hi0 = (int)((qh >> j) & 1u) << 4, hi1 = (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)((qs[j] & 0x0F) | hi0) * d + m;
        y[j + 16] = (float)((qs[j] >> 4) | hi1) * d + m;
    }
}

// Six-bit scale and min of sub-block j of a Q4_K block (ggml's get_scale_min_k4).
static void q4k_scale_min(int j, const uint8_t* s, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void dq_q4_k(const uint8_t* b, float* y) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int c = 0; c < 4; c++) {
        int sc, m;
        q4k_scale_min(2 * c, scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        q4k_scale_min(2 * c + 1, scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++) y[64 * c + l] = d1 * (float)(q[32 * c + l] & 0x0F) - m1;
        for (int l = 0; l < 32; l++) y[64 * c + 32 + l] = d2 * (float)(q[32 * c + l] >> 4) - m2;
    }
}

static void dq_q6_k(const uint8_t* b, float* y) {
    const float d = f16_at(b + 208);
    for (int n = 0; n < 2; n++) {
        const uint8_t* ql = b + 64 * n;
        const uint8_t* qh = b + 128 + 32 * n;
        const int8_t* sc = (const int8_t*)(b + 192 + 8 * n);
        float* o = y + 128 * n;
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            o[l] = d * (float)sc[is] * (float)q1;
            o[l + 32] = d * (float)sc[is + 2] * (float)q2;
            o[l + 64] = d * (float)sc[is + 4] * (float)q3;
            o[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

static void dq_mxfp4(const uint8_t* b, float* y) {
    // E2M1 values times two; the E8M0 scale is halved to match (ggml's kvalues_mxfp4)
    static const int8_t k[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const float d = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = (float)k[b[1 + j] & 0x0F] * d;
        y[j + 16] = (float)k[b[1 + j] >> 4] * d;
    }
}

int ggml_dequantize(int type, const uint8_t* src, float* dst, int64_t n) {
    if (!ggml_type_can_dequantize(type) || n < 0 || n % ggml_types[type].block != 0) return -1;
    const int64_t nb = n / ggml_types[type].block;
    const int bs = ggml_types[type].bytes, be = ggml_types[type].block;
    switch (type) {
        case GGML_TYPE_F32:
            if (n) memcpy(dst, src, (size_t)n * 4);
            return 0;
        case GGML_TYPE_F16:
            for (int64_t i = 0; i < n; i++) dst[i] = f16_at(src + 2 * i);
            return 0;
        case GGML_TYPE_BF16:
            for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(load_le16(src + 2 * i));
            return 0;
        default: break;
    }
    void (*block_fn)(const uint8_t*, float*) = type == GGML_TYPE_Q8_0   ? dq_q8_0
                                               : type == GGML_TYPE_Q4_0 ? dq_q4_0
                                               : type == GGML_TYPE_Q4_1 ? dq_q4_1
                                               : type == GGML_TYPE_Q5_0 ? dq_q5_0
                                               : type == GGML_TYPE_Q5_1 ? dq_q5_1
                                               : type == GGML_TYPE_Q4_K ? dq_q4_k
                                               : type == GGML_TYPE_Q6_K ? dq_q6_k
                                                                        : dq_mxfp4;
    for (int64_t i = 0; i < nb; i++) block_fn(src + (size_t)i * bs, dst + (size_t)i * be);
    return 0;
}

int gguf_tensor_to_f32(const GgufFile* f, const GgufTensor* t, float* out, int64_t n, char* err) {
    if (n != t->numel)
        return errorf(err, "%s: tensor '%s': asked for %lld elements but it has %lld", f->path,
                      t->name, (long long)n, (long long)t->numel);
    if (!ggml_type_can_dequantize(t->type))
        return errorf(err,
                      "%s: tensor '%s' has type %s, which this build cannot load (supported: "
                      "%s)",
                      f->path, t->name, ggml_type_name(t->type), ggml_supported_types());
    ggml_dequantize(t->type, t->data, out, n);
    // A NaN or Inf in a checkpoint would silently poison training: refuse it, by index.
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(out[i]))
            return errorf(err, "%s: tensor '%s': element %lld is %s", f->path, t->name,
                          (long long)i, isnan(out[i]) ? "NaN" : "infinite");
    return 0;
}
