/*
 * test_gpu_dp_engine.c — data parallel through the engine on a GPU with the NCCL communicator
 * (suite `gpu_dp_engine`; docs/DISTRIBUTED.md §6): one rank on GPU 0, world size 1, so every
 * collective of the engine's step (the weights' check, the per-layer reduce-scatter of the
 * gradients, the all-gather of the norm's parts and the loss, the per-layer all-gather of the
 * updated bf16 weights, the gather of the state) takes NCCL's code path, staged through GPU 0.
 * With one rank the step is the engine's own: losses, norms and the fp32 weights bit-identical to
 * the engine without a communicator, in sync mode and with the delayed update. Two ranks on two
 * GPUs belong to the two-GPU issue. Without a GPU, or in a build without CUDA, skipped.
 */
#include <stdlib.h>
#include <string.h>

#include "../comm.h"
#include "../common.h"
#include "../device.h"
#include "../engine.h"
#include "../model.h"
#include "../rng.h"
#include "../store.h"
#include "testing.h"

#ifdef HAVE_CUDA

#include "../../kernels/kernels.h"

#define GDE_STEPS 3
#define GDE_B 8
#define GDE_T 32

typedef struct GdeRun {
    double loss[GDE_STEPS], norm[GDE_STEPS];
    float* params;  // every parameter slab after the run, concatenated
    int64_t n;
    int ok;
} GdeRun;

// The engine on GPU 0 over c's model for GDE_STEPS steps, with comm (NULL: none).
static void gde_run(TestCtx* t, const ModelConfig* cfg, int sync, Comm* comm,
                    const int32_t* tokens, GdeRun* run) {
    char err[ERR_LEN];
    memset(run, 0, sizeof *run);
    Model m;
    if (model_init(&m, cfg, 0, err) != 0) {
        CHECK(t, 0, "model: %s", err);
        return;
    }
    Store s;
    store_create(&s, &m.tt);
    store_init_random(&s, 11, 0.05f);
    DeviceOptions dopt = {.threads = 1};
    DeviceSet devs;
    device_set_open(&devs, &device_cuda_impl, 1, &dopt);
    EngineOptions eo = {.B = GDE_B, .T = GDE_T, .M = 2, .sync = sync, .opt_threads = 2,
                        .row_chunks = 1, .trace_path = "",
                        .hyper = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f},
                        .sched = {LR_COSINE, 1e-3f, 1, GDE_STEPS, 0.1f, 0.0f},
                        .grad_clip = 0.5f, .comm = comm};
    Engine* e = engine_create(&m, &s, &devs, &eo, err);
    CHECK(t, e != NULL, "engine_create (%s): %s", comm ? "NCCL" : "alone", err);
    if (e) {
        run->ok = 1;
        for (int step = 0; step < GDE_STEPS; step++) {
            const EngineStepResult r = engine_step(e, tokens + (size_t)step * GDE_B * (GDE_T + 1));
            CHECK(t, r.error == NULL, "step %d: %s", step + 1, r.error ? r.error : "");
            run->loss[step] = r.loss;
            run->norm[step] = r.norm;
        }
        engine_synchronize(e);
        CHECK(t, engine_gather_state(e, -1, 1, err) == 0, "gather: %s", err);
        for (int l = 0; l < m.tt.n_layers; l++) run->n += m.tt.param_numel[l];
        run->params = malloc_check((size_t)run->n * sizeof(float));
        int64_t o = 0;
        for (int l = 0; l < m.tt.n_layers; l++) {
            memcpy(run->params + o, s.param[l], (size_t)m.tt.param_numel[l] * sizeof(float));
            o += m.tt.param_numel[l];
        }
        engine_free(e);
    }
    device_set_close(&devs);
    store_free(&s);
    model_free(&m);
}

static void test_gpu_dp_engine_nccl(TestCtx* t) {
    if (cuda_device_count() == 0) {
        test_skip(t, "no GPU: cudaGetDeviceCount found no CUDA device");
        return;
    }
    char err[ERR_LEN];
    const ModelConfig cfg = test_engine_config(1);
    Rng rng;
    rng_seed(&rng, 5);
    int32_t* tokens = malloc_check((size_t)GDE_STEPS * GDE_B * (GDE_T + 1) * sizeof(int32_t));
    for (int i = 0; i < GDE_STEPS * GDE_B * (GDE_T + 1); i++)
        tokens[i] = (int32_t)rng_below(&rng, (uint64_t)cfg.V);
    for (int sync = 1; sync >= 0; sync--) {
        CommToken tok;
        CHECK(t, comm_nccl_impl.new_token(&tok, err) == 0, "token: %s", err);
        const CommInit in = {.rank = 0, .world = 1, .timeout_s = 60.0, .token = tok, .gpu = 0};
        Comm* c = comm_nccl_impl.init(&in, err);
        CHECK(t, c != NULL, "NCCL init: %s", err);
        if (!c) break;
        GdeRun alone, ranked;
        gde_run(t, &cfg, sync, NULL, tokens, &alone);
        gde_run(t, &cfg, sync, c, tokens, &ranked);
        comm_destroy(c);
        if (alone.ok && ranked.ok) {
            for (int s = 0; s < GDE_STEPS; s++)
                CHECK(t, ranked.loss[s] == alone.loss[s] && ranked.norm[s] == alone.norm[s],
                      "sync %d step %d: NCCL rank loss %.17g norm %.17g, the engine alone %.17g "
                      "%.17g", sync, s + 1, ranked.loss[s], ranked.norm[s], alone.loss[s],
                      alone.norm[s]);
            CHECK(t, ranked.n == alone.n &&
                         memcmp(ranked.params, alone.params, (size_t)alone.n * sizeof(float)) == 0,
                  "sync %d: the same fp32 weights", sync);
            CHECK(t, alone.loss[GDE_STEPS - 1] < alone.loss[0], "sync %d: the loss falls", sync);
        }
        free(alone.params);
        free(ranked.params);
    }
    free(tokens);
}

#else  // no CUDA in this build

static void test_gpu_dp_engine_nccl(TestCtx* t) { test_skip(t, "built without CUDA"); }

#endif

const TestCase tests_gpu_dp_engine[] = {
    {"gpu_dp_engine_nccl", test_gpu_dp_engine_nccl},
    {NULL, NULL},
};
