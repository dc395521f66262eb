/*
 * mxfp4.c — dequantisation of HF MXFP4 expert tensors (see mxfp4.h).
 */
#include "mxfp4.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

// E2M1: sign, 2 exponent bits, 1 mantissa bit (transformers' FP4_VALUES).
static const float fp4_values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float mxfp4_value(unsigned code) { return fp4_values[code & 15]; }

void mxfp4_dequant_transposed(const uint8_t* blocks, const uint8_t* scales, int64_t E,
                              int64_t rows, int64_t G, float* out) {
    const int64_t cols = 32 * G;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t rg = (e * rows + r) * G + g;
                const int exp = (int)scales[rg] - 127;  // torch.ldexp(lut[code], scale - 127)
                const uint8_t* b = blocks + rg * 16;
                for (int k = 0; k < 16; k++) {
                    const int64_t c = 32 * g + 2 * k;
                    out[(e * cols + c) * rows + r] = ldexpf(fp4_values[b[k] & 15], exp);
                    out[(e * cols + c + 1) * rows + r] = ldexpf(fp4_values[b[k] >> 4], exp);
                }
            }
}

int mxfp4_load(const StCheckpoint* ck, const char* name, int64_t E, int64_t cols, int64_t rows,
               float* out, char* err) {
    char bname[256], sname[256];
    snprintf(bname, sizeof bname, "%s_blocks", name);
    snprintf(sname, sizeof sname, "%s_scales", name);
    const StTensor* b = st_checkpoint_find(ck, bname);
    const StTensor* s = st_checkpoint_find(ck, sname);
    if (!b && !s) return 0;
    if (!b || !s) return errorf(err, "%s: MXFP4 tensor '%s' has no '%s'", (b ? b : s)->file,
                                b ? bname : sname, b ? sname : bname);
    const int64_t G = cols / 32;
    int ok = cols % 32 == 0 && b->dtype == ST_U8 && s->dtype == ST_U8 && b->ndim == 4 &&
             s->ndim == 3 && b->shape[0] == E && b->shape[1] == rows && b->shape[2] == G &&
             b->shape[3] == 16 && s->shape[0] == E && s->shape[1] == rows && s->shape[2] == G;
    if (!ok)
        return errorf(err, "%s: MXFP4 '%s' / '%s' must be U8 [%lld, %lld, %lld, 16] / [%lld, "
                           "%lld, %lld] for the parameter [%lld, %lld, %lld]",
                      b->file, bname, sname, (long long)E, (long long)rows, (long long)G,
                      (long long)E, (long long)rows, (long long)G, (long long)E, (long long)cols,
                      (long long)rows);
    mxfp4_dequant_transposed(b->data, s->data, E, rows, G, out);
    const int64_t n = E * cols * rows;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(out[i]))
            return errorf(err, "%s: MXFP4 '%s' dequantises to a non-finite value at element %lld "
                               "(a scale byte of 255?)", b->file, name, (long long)i);
    return 1;
}

int mxfp4_is_part_of(const char* name, const char* base) {
    const size_t n = strlen(base);
    return strncmp(name, base, n) == 0 &&
           (strcmp(name + n, "_blocks") == 0 || strcmp(name + n, "_scales") == 0);
}
