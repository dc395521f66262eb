/*
 * dev/cuda/dequant.cu — lab of the ggml block dequantisers (kernels/dequant.cu): a frozen LoRA
 * base held in Q8_0, Q4_K or MXFP4 (llmc/quant.h) is expanded to bf16 on the device per stage.
 *
 *   make dev-cuda && dev/cuda/build/dequant [--validate-only] [--variant K] [--seed S]
 *
 * Variants (both in kernels/dequant.cu, included below; the launcher picks 2, and 1 for an
 * output that is not 16-byte aligned):
 *   1  naive: one thread per element, its block's header decoded per element
 *   2  one thread per 32-element (sub-)block: header once, 16-byte quant loads (Q4_K), four
 *      16-byte bf16 stores
 * Validation, every variant x format: fresh random BLOCKS (random bytes with finite scales: every
 * scale/min bit pattern of Q4_K's packed six-bit fields, every E8M0 exponent in range) and blocks
 * that llmc/quant.c's quantiser made from random rows, against bf16 of the CPU dequantiser
 * (ggml_dequantize, the loader's; itself checked against gguf-py): exact, as every product of
 * the formats is exact in fp32. Variant 1 also writes at an odd bf16 offset; outputs are
 * pre-filled with NaN.
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

static std::vector<uint8_t> quantised_blocks(Rng* r, int type, size_t n) {
    std::vector<float> w(n);
    for (size_t i = 0; i < n; i++) w[i] = 0.02f * rng_normal(r) * (1.0f + (float)(i % 5));
    std::vector<uint8_t> b(ggml_type_bytes(type, (int64_t)n));
    quant_quantize(type, w.data(), b.data(), (int64_t)n);
    return b;
}

// ----------------------------------------------------------------------------
// validation

static void validate(Lab* lab, int v, Rng* r) {
    const size_t n = 256 * 777;
    for (int k = 0; k < 3; k++) {
        const int type = TYPES[k];
        for (int source = 0; source < 2; source++) {
            std::vector<uint8_t> b = source ? quantised_blocks(r, type, n)
                                            : random_blocks(r, type, n);
            std::vector<float> ref(n);
            ggml_dequantize(type, b.data(), ref.data(), (int64_t)n);
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
    printf("benchmark: one Qwen3-1.7B block's linears, %zu elements\n", n);
    lab_bench_header_bw();
    bf16* out = dev_alloc<bf16>(n);
    for (int k = 0; k < 3; k++) {
        const int type = TYPES[k];
        Rng rb;
        rng_seed(&rb, 5);
        std::vector<uint8_t> b = random_blocks(&rb, type, n);
        uint8_t* db = dev_upload(b);
        const double bytes = (double)b.size() + 2.0 * n;
        char counted[64];
        snprintf(counted, sizeof counted, "%.2f B/elt in, 2 out", (double)b.size() / n);
        for (int v = 1; v <= DEQUANT_VARIANTS; v++) {
            if (!lab_wants(&lab->args, v)) continue;
            const double ms = lab_time_ms(lab, [&] {
                cuda_dequantize(lab->cx->stream, lab->cx->n_sms, v, out, db, type, n);
            });
            lab_report_bw(quant_type_name(type), v, "50.3M", counted, bytes, ms);
        }
        cuda_check(cudaFree(db));
    }
    cuda_check(cudaFree(out));
}

int main(int argc, char** argv) {
    return lab_main(argc, argv, "dequant",
                    "  1  naive: one thread per element\n"
                    "  2  one thread per 32-element (sub-)block, 16-byte stores (production)\n",
                    DEQUANT_VARIANTS, DEQUANT_VARIANTS, validate, bench);
}
