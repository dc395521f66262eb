/*
 * dev/cuda/dequant.cu — lab of the ggml block dequantisers (kernels/dequant.cu): a frozen LoRA
 * base held in Q8_0, Q4_K or MXFP4 (llmc/quant.h) is expanded to bf16 on the device per stage.
 *
 *   make dev/cuda/build/dequant && dev/cuda/build/dequant [--validate-only] [--variant K] [--seed S]
 *
 * Variants (all in kernels/dequant.cu, included below; the launcher picks 3, and 1 for an output
 * that is not 16-byte aligned):
 *   1  naive: one thread per element, its block's header decoded per element
 *   2  one thread per 32-element (sub-)block: header once, 16-byte quant loads (Q4_K), four
 *      16-byte bf16 stores (the E2M1 table in constant memory)
 *   3  a warp per tile of blocks (32 Q8_0 / MXFP4 blocks through shared memory, or 2 Q4_K blocks):
 *      16-byte loads prefetched a tile ahead, E2M1 from its bits, coalesced 16-byte stores
 * Validation, every variant x format, against bf16 of the CPU dequantiser (ggml_dequantize, the
 * loader's; itself checked against gguf-py), exact, as every product of the formats is exact in
 * fp32: fresh random BLOCKS (random bytes with finite scales: every scale/min bit pattern of
 * Q4_K's packed six-bit fields, E8M0 exponents 100..149), blocks that llmc/quant.c's quantiser
 * made from random rows, and edge blocks compared bit for bit (NaN as any NaN): every one of the
 * 256 E8M0 exponents (2^-128 .. 2^127: subnormal scales, products that overflow to inf), fp16
 * scales of any bit pattern (subnormal, inf, NaN) for Q8_0 and Q4_K. Those come at a block
 * address that is not 16-byte aligned too (odd bytes ahead, as in a staging slot after another
 * tensor's 17-byte blocks), and with a block count that leaves a partial tile. Variant 1 also
 * writes at an odd bf16 offset; outputs are pre-filled with NaN.
 * Benchmark: one Qwen3-1.7B block's linears (q 2048x2048, k and v 1024x2048, o 2048x2048, gate
 * and up 6144x2048, down 2048x6144: 50.3 M elements) in each format; GB/s = (blocks read + bf16
 * written) / time, against the 4.8 TB/s HBM roofline.
 */
#include "../../kernels/dequant.cu"
#include "lab.cuh"
extern "C" {
#include "../../llmc/gguf.h"
#include "../../llmc/quant.h"
}

static const int TYPES[3] = {8 /* Q8_0 */, 12 /* Q4_K */, 39 /* MXFP4 */};

// ----------------------------------------------------------------------------
// random blocks

static uint16_t rand_f16_scale(Rng* r) {
    // a finite, normal fp16 in [2^-14, 2^-2): the magnitudes weight scales have
    return f32_to_f16(ldexpf(1.0f + rng_uniform(r), -14 + (int)rng_below(r, 12)));
}

static std::vector<uint8_t> random_blocks(Rng* r, int type, size_t n) {
    int bb = 0;
    const int block = ggml_type_block(type, &bb);
    std::vector<uint8_t> b((n / block) * bb);
    for (auto& x : b) x = (uint8_t)rng_below(r, 256);
    for (size_t k = 0; k < n / block; k++) {
        uint8_t* p = &b[k * bb];
        if (type == TYPES[0] || type == TYPES[1]) {
            uint16_t d = rand_f16_scale(r);
            p[0] = (uint8_t)d;
            p[1] = (uint8_t)(d >> 8);
        }
        if (type == TYPES[1]) {
            uint16_t m = rand_f16_scale(r);
            p[2] = (uint8_t)m;
            p[3] = (uint8_t)(m >> 8);
        }
        if (type == TYPES[2]) p[0] = (uint8_t)(100 + rng_below(r, 50));  // 2^-28 .. 2^21
    }
    return b;
}

// Any byte in any field (fp16 scales of every kind: subnormal, inf, NaN), MXFP4's exponent of
// block k = k mod 256 (every one of the 256, the smallest giving subnormal scales, the largest
// products that overflow to inf), a few scales set to the special values outright.
static std::vector<uint8_t> edge_blocks(Rng* r, int type, size_t n) {
    int bb = 0;
    const int block = ggml_type_block(type, &bb);
    std::vector<uint8_t> b((n / block) * bb);
    for (auto& x : b) x = (uint8_t)rng_below(r, 256);
    const uint16_t special[6] = {0x7C00, 0xFC00, 0x7E01, 0x0001, 0x8000, 0x03FF};  // inf, -inf, NaN, ...
    for (size_t k = 0; k < n / block; k++) {
        uint8_t* p = &b[k * bb];
        if (type == TYPES[2]) p[0] = (uint8_t)k;
        else if (k < 6) {
            p[0] = (uint8_t)special[k];
            p[1] = (uint8_t)(special[k] >> 8);
        }
    }
    return b;
}

static std::vector<uint8_t> quantised_blocks(Rng* r, int type, size_t n) {
    std::vector<float> w(n);
    for (size_t i = 0; i < n; i++) w[i] = 0.02f * rng_normal(r) * (1.0f + (float)(i % 5));
    std::vector<uint8_t> b(ggml_type_bytes(type, (int64_t)n));
    quant_quantize(type, w.data(), b.data(), (int64_t)n);
    return b;
}

// ----------------------------------------------------------------------------
// validation

// Bit for bit: every bf16 of got equals bf16(ref), a NaN any NaN (the GPU's conversion gives the
// canonical NaN, the CPU's keeps the payload).
static void check_bits(Lab* lab, const char* what, const uint16_t* got, const float* ref, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        const uint16_t want = f32_to_bf16(ref[i]);
        const int nan_got = (got[i] & 0x7FFF) > 0x7F80, nan_want = (want & 0x7FFF) > 0x7F80;
        if (nan_got && nan_want) continue;
        if (got[i] != want) {
            if (bad < 3)
                printf("    mismatch at %zu: got bf16 0x%04x, want 0x%04x (%.7g)\n", i, got[i],
                       want, (double)ref[i]);
            bad++;
        }
    }
    lab_check_true(lab, what, bad == 0);
    if (bad) printf("    %zu of %zu elements differ\n", bad, n);
}

static void validate(Lab* lab, int v, Rng* r) {
    const size_t n = 256 * 777;
    for (int k = 0; k < 3; k++) {
        const int type = TYPES[k];
        for (int source = 0; source < 3; source++) {
            std::vector<uint8_t> b = source == 0   ? random_blocks(r, type, n)
                                     : source == 1 ? quantised_blocks(r, type, n)
                                                   : edge_blocks(r, type, n);
            std::vector<float> ref(n);
            ggml_dequantize(type, b.data(), ref.data(), (int64_t)n);
            if (source == 2) {
                // bit for bit, the blocks at addresses 1, 5, 11 and 15 bytes past a 16-byte
                // boundary (every tile then is), on odd passes with 7 blocks (Q4_K: 1) cut off
                // the end (a partial tile)
                int bb = 0;
                const int block = ggml_type_block(type, &bb);
                const size_t pads[4] = {5, 11, 1, 15};
                for (int pass = 0; pass < 4; pass++) {
                    const size_t nn = pass & 1 ? n - (size_t)block * (type == TYPES[1] ? 1 : 7) : n;
                    const size_t pad = pads[pass], bytes = nn / block * bb;
                    std::vector<uint8_t> buf(pad + bytes, 0xA5);
                    memcpy(buf.data() + pad, b.data(), bytes);
                    uint8_t* db = dev_upload(buf);
                    bf16* out = dev_alloc<bf16>(n + 8);
                    dev_poison(out, (n + 8) * 2);
                    cuda_dequantize(lab->cx->stream, lab->cx->n_sms, v, out, db + pad, type, nn);
                    std::vector<uint16_t> got = dev_download((const uint16_t*)out, n + 8);
                    char what[96];
                    snprintf(what, sizeof what, "v%d %s edge blocks (+%zu bytes, %zu blocks)", v,
                             quant_type_name(type), pad, nn / block);
                    check_bits(lab, what, got.data(), ref.data(), nn);
                    int untouched = 1;  // nothing written past the end
                    for (size_t i = nn; i < n + 8; i++) untouched &= got[i] == 0xFFFF;
                    snprintf(what, sizeof what, "v%d %s edge blocks: nothing past the end", v,
                             quant_type_name(type));
                    lab_check_true(lab, what, untouched);
                    cuda_check(cudaFree(db));
                    cuda_check(cudaFree(out));
                }
                continue;
            }
            for (auto& x : ref) x = bf16r(x);
            uint8_t* db = dev_upload(b);
            bf16* out = dev_alloc<bf16>(n + 8);
            for (int off = 0; off < (v == DEQUANT_NAIVE ? 2 : 1); off++) {
                dev_poison(out, (n + 8) * 2);
                cuda_dequantize(lab->cx->stream, lab->cx->n_sms, v, out + off, db, type, n);
                std::vector<float> got = dev_download_bf16(out + off, n);
                char what[96];
                snprintf(what, sizeof what, "v%d %s %s blocks%s", v, quant_type_name(type),
                         source ? "quantised" : "random", off ? " (odd output offset)" : "");
                lab_check(lab, what, got.data(), ref.data(), n, TOL_EXACT);
            }
            cuda_check(cudaFree(db));
            cuda_check(cudaFree(out));
        }
    }
}

// ----------------------------------------------------------------------------
// benchmark

static void bench(Lab* lab, Rng* r) {
    (void)r;
    const size_t n = 2048ull * 2048 * 2 + 1024ull * 2048 * 2 + 6144ull * 2048 * 3;  // 50.3 M
    printf("benchmark: one Qwen3-1.7B block's linears, %zu elements; \"+5 B\": the blocks 5 bytes "
           "past a 16-byte boundary (a staging slot after another tensor's 17-byte blocks)\n", n);
    lab_report_copy(lab, 2 * n);
    lab_bench_header_bw();
    bf16* out = dev_alloc<bf16>(n);
    for (int k = 0; k < 3; k++) {
        const int type = TYPES[k];
        Rng rb;
        rng_seed(&rb, 5);
        std::vector<uint8_t> b = random_blocks(&rb, type, n);
        b.insert(b.begin(), 16, 0);  // the blocks at db + 16 (aligned) or db + 5
        uint8_t* db = dev_upload(b);
        const double bytes = (double)(b.size() - 16) + 2.0 * n;
        char counted[64];
        snprintf(counted, sizeof counted, "%.2f B/elt in, 2 out", (double)(b.size() - 16) / n);
        for (int pad = 0; pad <= 5; pad += 5)
            for (int v = 1; v <= DEQUANT_VARIANTS; v++) {
                if (!lab_wants(&lab->args, v) || (pad && v == DEQUANT_NAIVE)) continue;
                const double ms = lab_time_ms(lab, [&] {
                    cuda_dequantize(lab->cx->stream, lab->cx->n_sms, v, out, db + (pad ? 5 : 16), type, n);
                });
                lab_report_bw(quant_type_name(type), v, pad ? "50.3M +5 B" : "50.3M", counted, bytes, ms);
            }
        cuda_check(cudaFree(db));
    }
    cuda_check(cudaFree(out));
}

int main(int argc, char** argv) {
    return lab_main(argc, argv, "dequant",
                    "  1  naive: one thread per element\n"
                    "  2  one thread per 32-element (sub-)block, 16-byte stores\n"
                    "  3  a warp per tile of blocks: 16-byte loads, E2M1 from its bits, coalesced\n"
                    "     16-byte stores (production)\n",
                    DEQUANT_VARIANTS, DEQUANT_VARIANTS, validate, bench);
}
