/*
 * dev/cuda/loss.cu — cross-entropy lab (kernels/loss.cu): the fused softmax cross-entropy
 * forward and backward over a chunk of bf16 logits (n, V), in place, as the chunked LM head of
 * the model runs it (llmc/model.c: per chunk of rows, logits = matmul, then this op turns them
 * into dlogits, then the two backward matmuls).
 *
 *   make dev-cuda && dev/cuda/build/loss [--validate-only] [--variant K] [--seed S]
 *
 * Variants:
 *   1  naive: one block per row, three passes over the row (max, sum of exp, gradient) with
 *      libm-accurate expf.
 *   2  production (kernels/loss.cu, included below): one block per row, two passes: an online
 *      (max, sum) per thread merged in a fixed order, then the gradient; fast __expf.
 * Validation: (n, V) = (67, 151936) (the Qwen3 vocabulary: 16-byte vectors) and (45, 1001)
 * (scalar path), with ignored targets (-1) among them; loss and gradient ((softmax - onehot) ·
 * grad_scale, in place) against a CPU reference in double (loss TOL_EXP, gradient TOL_BF16), and
 * the loss-only call (compute_grad 0: the logits stay untouched). Production only: a target >= V
 * is treated as ignored and sets the context's device error word.
 * Benchmark: V = 151936, chunks of n = 4096 rows (the model's LM-head chunk on the GPU) and 220
 * (64 MiB of logits); then the whole chunked LM head over N = 16384 rows, C = 2048 (matmuls of
 * kernels/matmul.cu) in TFLOP/s of its three matmuls, as the share of the loss in it.
 */
#include "../../kernels/loss.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// CPU reference

// losses (n) = logsumexp(z) - z[y]; dlogits (n, V) = (softmax(z) - onehot(y)) · grad_scale
// (before its bf16 rounding). A target outside [0, V) is ignored: loss 0, gradient 0.
static void crossentropy_cpu(float* losses, float* dlogits, const float* logits,
                             const int32_t* targets, int n, int V, float grad_scale) {
    for (int row = 0; row < n; row++) {
        const float* z = logits + (size_t)row * V;
        float* d = dlogits + (size_t)row * V;
        const int y = targets[row];
        if (y < 0 || y >= V) {
            losses[row] = 0.0f;
            for (int c = 0; c < V; c++) d[c] = 0.0f;
            continue;
        }
        double m = -INFINITY, s = 0.0;
        for (int c = 0; c < V; c++) m = std::max(m, (double)z[c]);
        for (int c = 0; c < V; c++) s += exp(z[c] - m);
        losses[row] = (float)(m + log(s) - z[y]);
        for (int c = 0; c < V; c++) d[c] = (float)((exp(z[c] - m) / s - (c == y)) * grad_scale);
    }
}

// ----------------------------------------------------------------------------
// variant 1: naive

__device__ __forceinline__ float block_max1(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float m = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, red[w]);
    return m;
}

__global__ void crossentropy_kernel1(bf16* logits, float* losses, const int32_t* targets, int V,
                                     float grad_scale, int compute_grad) {
    __shared__ float red[32];
    const int row = blockIdx.x, y = targets[row];
    bf16* z = logits + (size_t)row * V;
    if (y < 0 || y >= V) {
        if (threadIdx.x == 0) losses[row] = 0.0f;
        if (compute_grad)
            for (int c = threadIdx.x; c < V; c += blockDim.x) z[c] = __float2bfloat16_rn(0.0f);
        return;
    }
    float m = -INFINITY;
    for (int c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, __bfloat162float(z[c]));
    m = block_max1(m, red);
    float s = 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) s += expf(__bfloat162float(z[c]) - m);
    s = block_sum(s, red);
    const float zy = __bfloat162float(z[y]);
    __syncthreads();  // z[y] read by every thread before any overwrites it
    if (threadIdx.x == 0) losses[row] = m + logf(s) - zy;
    if (!compute_grad) return;
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const float p = expf(__bfloat162float(z[c]) - m) / s;
        z[c] = __float2bfloat16_rn((c == y ? p - 1.0f : p) * grad_scale);
    }
}

// ----------------------------------------------------------------------------
// variant dispatch

static void crossentropy(int v, CudaCtx* cx, bf16* logits, float* losses, const int32_t* targets,
                         int n, int V, float grad_scale, int compute_grad) {
    if (v == 2)
        return cuda_crossentropy_forward_backward(cx, logits, losses, targets, n, V, grad_scale,
                                                  compute_grad);
    crossentropy_kernel1<<<n, 512, 0, cx->stream>>>(logits, losses, targets, V, grad_scale,
                                                    compute_grad);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// validation

static std::vector<int32_t> rand_targets(Rng* r, int n, int V) {
    std::vector<int32_t> t(n);
    for (auto& y : t) y = rng_uniform(r) < 0.1f ? -1 : (int32_t)rng_below(r, V);
    return t;
}

static void validate(Lab* lab, int v, Rng* r, int n, int V) {
    const size_t nV = (size_t)n * V;
    const float grad_scale = 1.0f / 3000.0f;  // 1 / (tokens of the batch), as the model passes
    std::vector<float> z = rand_bf16(r, nV, 8.0f), dz(nV), losses(n);
    std::vector<int32_t> targets = rand_targets(r, n, V);
    crossentropy_cpu(losses.data(), dz.data(), z.data(), targets.data(), n, V, grad_scale);
    int32_t* d_t = dev_upload(targets);
    bf16* d_z = dev_upload_bf16(z);
    float* d_losses = dev_alloc<float>(n);
    char what[128];
    for (int compute_grad = 0; compute_grad <= 1; compute_grad++) {
        dev_poison(d_losses, (size_t)n * 4);
        crossentropy(v, lab->cx, d_z, d_losses, d_t, n, V, grad_scale, compute_grad);
        snprintf(what, sizeof what, "v%d n=%d V=%d%s: losses", v, n, V,
                 compute_grad ? "" : " loss only");
        lab_check(lab, what, dev_download(d_losses, n).data(), losses.data(), n, TOL_EXP);
        snprintf(what, sizeof what, "v%d n=%d V=%d%s: %s", v, n, V,
                 compute_grad ? "" : " loss only", compute_grad ? "dlogits" : "logits untouched");
        lab_check(lab, what, dev_download_bf16(d_z, nV).data(), compute_grad ? dz.data() : z.data(),
                  nV, compute_grad ? TOL_BF16 : TOL_EXACT);
    }
    if (v == 2)
        lab_check_true(lab, "no device error flagged for valid targets",
                       lab_take_device_error(lab) == 0);
    cuda_check(cudaFree(d_t));
    cuda_check(cudaFree(d_z));
    cuda_check(cudaFree(d_losses));
}

// Production only: a target >= V is flagged and treated as ignored.
static void validate_bad_target(Lab* lab, Rng* r) {
    const int n = 5, V = 1000;
    std::vector<float> z = rand_bf16(r, (size_t)n * V, 8.0f), dz((size_t)n * V), losses(n);
    std::vector<int32_t> targets = {3, V, 7, -1, V - 1};
    crossentropy_cpu(losses.data(), dz.data(), z.data(), targets.data(), n, V, 1.0f);
    int32_t* d_t = dev_upload(targets);
    bf16* d_z = dev_upload_bf16(z);
    float* d_losses = dev_alloc<float>(n);
    lab_take_device_error(lab);
    crossentropy(2, lab->cx, d_z, d_losses, d_t, n, V, 1.0f, 1);
    const int e = lab_take_device_error(lab);
    lab_check(lab, "v2 target V: losses (ignored)", dev_download(d_losses, n).data(), losses.data(),
              n, TOL_EXP);
    lab_check(lab, "v2 target V: dlogits (zero row)", dev_download_bf16(d_z, (size_t)n * V).data(),
              dz.data(), (size_t)n * V, TOL_BF16);
    lab_check_true(lab, "target V flagged in the device error word", (e & CUDA_ERR_TARGET) != 0);
    cuda_check(cudaFree(d_t));
    cuda_check(cudaFree(d_z));
    cuda_check(cudaFree(d_losses));
}

// ----------------------------------------------------------------------------
// benchmark

static void bench(Lab* lab) {
    const int V = 151936, C = 2048, N = 16384, CHUNK = 4096;
    CudaCtx* cx = lab->cx;
    bf16* logits = dev_random<bf16>((size_t)CHUNK * V, 8.0f, 1);
    float* losses = dev_alloc<float>(N);
    std::vector<int32_t> targets(N);
    Rng r;
    rng_seed(&r, 2);
    for (auto& y : targets) y = (int32_t)rng_below(&r, V);
    int32_t* d_t = dev_upload(targets);
    printf("\nbenchmark\n");
    lab_bench_header_bw();
    lab_report_copy(lab, (size_t)CHUNK * V * 2);
    const int chunks[2] = {CHUNK, 220};
    for (int v = 1; v <= 2; v++) {
        if (!lab_wants(&lab->args, v)) continue;
        for (int k = 0; k < 2; k++) {
            const int n = chunks[k];
            const double nV = (double)n * V;
            char shape[64];
            snprintf(shape, sizeof shape, "n=%d V=%d", n, V);
            double ms = lab_time_ms(
                lab, [&] { crossentropy(v, cx, logits, losses, d_t, n, V, 1.0f / N, 0); });
            lab_report_bw("cross-entropy fwd", v, shape, "2nV in", 2 * nV, ms);
            ms = lab_time_ms(lab,
                             [&] { crossentropy(v, cx, logits, losses, d_t, n, V, 1.0f / N, 1); });
            lab_report_bw("cross-entropy fwd+bwd", v, shape, "2nV in, 2nV out", 4 * nV, ms);
        }
    }

    // The LM head as llmc/model.c runs it: per chunk, logits = xf · Wᵀ, cross-entropy in place,
    // dxf = dlogits · W, dW += dlogitsᵀ · xf.
    bf16* xf = dev_random<bf16>((size_t)N * C, 1.0f, 3);
    bf16* w = dev_random<bf16>((size_t)V * C, 0.05f, 4);
    bf16* dxf = dev_alloc<bf16>((size_t)N * C);
    float* dw = dev_alloc<float>((size_t)V * C);
    dev_zero(dw, (size_t)V * C * 4);
    printf("\n");
    lab_bench_header_flops();
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d C=%d V=%d, chunks of %d", N, C, V, CHUNK);
    for (int v = 1; v <= 2; v++) {
        if (!lab_wants(&lab->args, v)) continue;
        double ms_loss = lab_time_ms(
            lab,
            [&] {
                for (int r0 = 0; r0 < N; r0 += CHUNK)
                    crossentropy(v, cx, logits, losses + r0, d_t + r0, CHUNK, V, 1.0f / N, 1);
            },
            5);
        double ms = lab_time_ms(
            lab,
            [&] {
                for (int r0 = 0; r0 < N; r0 += CHUNK) {
                    const bf16* x = xf + (size_t)r0 * C;
                    cuda_matmul_forward(cx, logits, x, w, NULL, CHUNK, C, V);
                    crossentropy(v, cx, logits, losses + r0, d_t + r0, CHUNK, V, 1.0f / N, 1);
                    cuda_matmul_backward(cx, dxf + (size_t)r0 * C, dw, NULL, logits, x, w, CHUNK, C,
                                         V);
                }
            },
            5);
        char op[96];
        snprintf(op, sizeof op, "LM head + loss (loss %.0f%% of the time)", 100.0 * ms_loss / ms);
        lab_report_flops(op, v, shape, 6.0 * N * C * V, ms);
    }
    void* bufs[] = {logits, losses, d_t, xf, w, dxf, dw};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: a block per row, three passes (max, sum, gradient), expf\n"
    "  2  production (kernels/loss.cu): a block per row, online max/sum then gradient, __expf\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    validate(lab, v, r, 67, 151936);
    validate(lab, v, r, 45, 1001);
    if (v == 2) validate_bad_target(lab, r);
}

// bench as lab_main's callback (the benchmark draws nothing from the lab's Rng).
static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    return lab_main(argc, argv, "loss", VARIANTS, 2, 2, validate_variant, bench_lab);
}
