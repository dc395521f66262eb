/*
 * memory.c — a run's host memory before anything big is allocated: the estimate (the sum of the
 * estimators next to the allocating code), the limit (MemAvailable, the memory cgroup) and the
 * decision to start, warn or refuse. memory.h says why these two figures and not MemTotal.
 */
#include "memory.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "common.h"
#include "dp.h"
#include "loader.h"
#include "plain.h"
#include "quant.h"
#include "threads.h"
#include "trace.h"
#include "trainer.h"

// The program itself: its code and libraries, heap bookkeeping, thread stacks, small tables.
// Measured: a tiny run peaks at 150-210 MiB of resident memory of which the model is a few MiB.
#define PROGRAM_BYTES (256.0 * 1048576.0)
// Per GPU: the CUDA context, cuBLAS(Lt) handles and the driver's host-side buffers.
#define CUDA_CONTEXT_BYTES (512.0 * 1048576.0)

// ----------------------------------------------------------------------------
// the limit

// The first number of the file at path (0 with *unlimited for "max"); -1 when unreadable.
static int read_number(const char* path, double* out, int* unlimited) {
    FILE* f = fopen(path, "r");
    if (!f) return -1;
    char buf[64] = "";
    const int ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);  // read-only
    if (!ok) return -1;
    *unlimited = strncmp(buf, "max", 3) == 0;
    if (*unlimited) {
        *out = 0;
        return 0;
    }
    char* end;
    const double v = strtod(buf, &end);
    if (end == buf || v < 0) return -1;
    // cgroup v1 spells "no limit" as the largest page-aligned 63-bit value
    *unlimited = v >= 4.0e18;
    *out = v;
    return 0;
}

// The value of `key` in a "key value" file (memory.stat, /proc/meminfo); -1 when absent.
static double read_keyed(const char* path, const char* key) {
    FILE* f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    double v = -1;
    const size_t n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && (line[n] == ' ' || line[n] == ':' || line[n] == '\t')) {
            v = strtod(line + n + 1 + strspn(line + n + 1, " \t"), NULL);
            break;
        }
    fclose(f);  // read-only
    return v;
}

typedef struct CgroupFiles {
    const char* limit;     // memory.max / memory.limit_in_bytes
    const char* usage;     // memory.current / memory.usage_in_bytes
    const char* inactive;  // the reclaimable page cache in memory.stat
    const char* name;      // "v2" / "v1"
} CgroupFiles;

// Walk from dir up to mount (both under root): the least any level with a limit still allows
// (limit - usage + its inactive page cache, which the kernel reclaims before it kills). 1 when a
// level has a limit (*avail, the level's directory in where), 0 when none does.
static int cgroup_walk(const char* mount, const char* dir, const CgroupFiles* cf, double* avail,
                       char* where, size_t cap) {
    char d[4608], path[4700];
    str_copy(d, sizeof d, dir);
    int found = 0;
    for (;;) {
        double limit = 0, usage = 0;
        int unlimited = 1, u2 = 0;
        snprintf(path, sizeof path, "%s/%s", d, cf->limit);
        if (read_number(path, &limit, &unlimited) == 0 && !unlimited) {
            snprintf(path, sizeof path, "%s/%s", d, cf->usage);
            if (read_number(path, &usage, &u2) == 0) {
                snprintf(path, sizeof path, "%s/memory.stat", d);
                const double inactive = read_keyed(path, cf->inactive);
                double a = limit - usage + (inactive > 0 ? inactive : 0);
                if (a < 0) a = 0;
                if (!found || a < *avail) {
                    *avail = a;
                    str_copy(where, cap, d);
                }
                found = 1;
            }
        }
        if (strcmp(d, mount) == 0 || strlen(d) <= strlen(mount)) break;
        char* slash = strrchr(d, '/');
        if (!slash) break;
        *slash = '\0';
    }
    return found;
}

// The process's memory cgroups (/proc/self/cgroup: "0::/path" for v2, "N:...memory...:/path" for
// v1) under the usual mounts. A path that does not exist there (a cgroup namespace shows the
// host's path) is looked up at the mount's root, which is then the container's own cgroup.
static int cgroup_available(const char* root, double* avail, char* source, size_t cap) {
    char path[4700], line[2048];
    snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
    FILE* f = fopen(path, "r");
    if (!f) return 0;
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char* c1 = strchr(line, ':');
        char* c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c1 = *c2 = '\0';
        const char* controllers = c1 + 1;
        const char* cg = c2 + 1;
        static const CgroupFiles v2 = {"memory.max", "memory.current", "inactive_file", "v2"};
        static const CgroupFiles v1 = {"memory.limit_in_bytes", "memory.usage_in_bytes",
                                       "total_inactive_file", "v1"};
        const CgroupFiles* cf = NULL;
        const char* mounts[2] = {NULL, NULL};
        if (strcmp(line, "0") == 0 && controllers[0] == '\0') {
            cf = &v2;
            mounts[0] = "/sys/fs/cgroup";
            mounts[1] = "/sys/fs/cgroup/unified";
        } else {
            // a v1 hierarchy whose controllers include memory
            char list[256];
            str_copy(list, sizeof list, controllers);
            char* save = NULL;
            for (char* tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
                if (strcmp(tok, "memory") == 0) cf = &v1;
            mounts[0] = "/sys/fs/cgroup/memory";
        }
        for (int i = 0; cf && i < 2 && mounts[i]; i++) {
            char mount[2048], dir[4608], where[4608];
            snprintf(mount, sizeof mount, "%s%s", root, mounts[i]);
            snprintf(path, sizeof path, "%s/%s", mount, cf->limit);
            if (cf == &v2) snprintf(path, sizeof path, "%s/cgroup.controllers", mount);
            if (!file_exists(path)) continue;  // not this kind of mount
            snprintf(dir, sizeof dir, "%s%s", mount, strcmp(cg, "/") == 0 ? "" : cg);
            if (!dir_exists(dir)) str_copy(dir, sizeof dir, mount);
            double a = 0;
            if (cgroup_walk(mount, dir, cf, &a, where, sizeof where) && (!found || a < *avail)) {
                *avail = a;
                snprintf(source, cap, "cgroup %s %s of %s", cf->name, cf->limit,
                         where + strlen(root));
                found = 1;
            }
        }
    }
    fclose(f);  // read-only
    return found;
}

// A device of the virtio driver `name` is bound (root/sys/bus/virtio/drivers/<name>/virtio<k>);
// with `feature` >= 0, one whose feature bit `feature` is set.
static int virtio_bound(const char* root, const char* name, int feature) {
    char path[4700];
    snprintf(path, sizeof path, "%s/sys/bus/virtio/drivers/%s", root, name);
    DIR* d = opendir(path);
    if (!d) return 0;
    int found = 0;
    struct dirent* e;
    while (!found && (e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "virtio", 6) != 0) continue;
        if (feature < 0) {
            found = 1;
            continue;
        }
        // "features": one '0' / '1' per bit, bit 0 first
        char fpath[5000], bits[130] = "";
        snprintf(fpath, sizeof fpath, "%s/%s/features", path, e->d_name);
        FILE* f = fopen(fpath, "r");
        if (f) {
            if (!fgets(bits, sizeof bits, f)) bits[0] = '\0';
            fclose(f);  // read-only
        }
        found = (int)strlen(bits) > feature && bits[feature] == '1';
    }
    closedir(d);
    return found;
}

int memory_host_limit(const char* root, HostLimit* out, char* err) {
    memset(out, 0, sizeof *out);
    const char* env = getenv(MEMORY_LIMIT_ENV);
    if (env && env[0]) {
        if (args_parse_bytes(env, &out->bytes) != 0)
            return errorf(err, "%s='%s': expected a size in bytes (e.g. 8G)", MEMORY_LIMIT_ENV,
                          env);
        snprintf(out->source, sizeof out->source, "%s", MEMORY_LIMIT_ENV);
        out->ceiling = 1;
        return 0;
    }
    char path[4700];
    snprintf(path, sizeof path, "%s/proc/meminfo", root);
    const double kib = read_keyed(path, "MemAvailable");
    if (kib >= 0) {
        out->bytes = kib * 1024.0;
        snprintf(out->source, sizeof out->source, "MemAvailable in /proc/meminfo");
        // memory plugged in on demand (virtio-mem): MemAvailable is today's figure, not a ceiling
        out->ceiling = !virtio_bound(root, "virtio_mem", -1);
        // a balloon holding pages: one that deflates under memory pressure (virtio feature 2,
        // DEFLATE_ON_OOM) gives them back on demand, so they are available too; any other
        // gives them back when the host decides, so MemAvailable is no ceiling either
        snprintf(path, sizeof path, "%s/proc/vmstat", root);
        const double balloon = read_keyed(path, "nr_balloon_pages");
        if (balloon > 0 && virtio_bound(root, "virtio_balloon", 2)) {
            out->bytes += balloon * 4096.0;
            snprintf(out->source, sizeof out->source,
                     "MemAvailable in /proc/meminfo + the balloon's pages");
        } else if (balloon > 0) {
            out->ceiling = 0;
        }
    }
    double cg = 0;
    char source[sizeof out->source];
    if (cgroup_available(root, &cg, source, sizeof source) && (kib < 0 || cg < out->bytes)) {
        out->bytes = cg;
        str_copy(out->source, sizeof out->source, source);
        out->ceiling = 1;
    }
    return 0;
}

// ----------------------------------------------------------------------------
// the estimate

// Data parallel over W = a->dist_world ranks through the engine (ZeRO-1, docs/DISTRIBUTED.md
// §6): what rank 0 (the largest shard, and the rank that writes) holds beyond or instead of the
// whole Store that memory_estimate counts, h the engine's host buffers. AdamW's m and v are the
// shard's only from the start (store_create_shard; a resumed checkpoint's are read into the
// shard only). The fp32 weights (with eo->shard_weights) are whole until the engine has made its
// masters from them and the shard's only from then on (shard_release_early), before the gradient
// sets beyond the Store's are allocated: at start-up they count whole only beyond those sets;
// they are whole again on rank 0 while --out or the exports write (trainer_finish gathers them).
// A checkpoint gathers one layer's weights, m or v at a time onto rank 0 (streamed); the
// collectives' buffer is the largest layer. Negative: less than the whole Store. (The fp32
// weights are sharded when no plain path reads them, as trainer.c sets shard_weights, and only
// in layers without a frozen head: store_release_state keeps LoRA's adapters whole on every
// rank. LoRA's checkpoint gathers the adapters' whole state onto rank 0 at once, not layer by
// layer: trainer.c, trainer_save.)
static double dp_engine_rank_bytes(const TrainArgs* a, const Model* m, const EngineOptions* eo,
                                   const EngineHostMemory* h) {
    const TensorTable* tt = &m->tt;
    const int W = a->dist_world;
    int64_t* lo = malloc_check((size_t)tt->n_layers * sizeof(int64_t));
    int64_t* hi = malloc_check((size_t)tt->n_layers * sizeof(int64_t));
    dp_engine_state_ranges(tt, W, 0, lo, hi);
    // others: the other ranks' elements of m and v; others_w: of the fp32 weights that can be
    // sharded (a layer whose weights are all trainable)
    double others = 0.0, others_w = 0.0, layer_max = 0.0;
    for (int l = 0; l < tt->n_layers; l++) {
        const double o = (double)(tt->state_numel[l] - (hi[l] - lo[l]));
        others += o;
        if (tt->param_numel[l] == tt->state_numel[l]) others_w += o;
        if ((double)tt->state_numel[l] > layer_max) layer_max = (double)tt->state_numel[l];
    }
    free(lo);
    free(hi);
    // m and v: the shard's only, except where the Store was made without a shard (--mmap-base,
    // a streamed base: train_roundpipe.c), which holds them whole until the engine has made its
    // masters, like the fp32 weights
    const int mv_whole = a->mmap_base || trainer_streams_base(a, m, 1);
    const int shard_weights = !trainer_needs_plain(a, 1);  // (the trainer's EngineOptions')
    double bytes = -8.0 * others;
    double startup = mv_whole ? 8.0 * others : 0.0, final = 0.0;
    if (shard_weights) {
        bytes -= 4.0 * others_w;
        startup += 4.0 * others_w;
        // (trainer_finish gathers the weights onto rank 0 for any of these)
        if (a->out[0] || a->export_hf[0] || a->export_gguf[0] || a->export_lora[0])
            final = 4.0 * others_w;
    }
    const double later = h->grads + (eo->split_rounds ? h->split_extra : 0.0);
    bytes += fmax(fmax(0.0, startup - later), final);
    if (a->save_every > 0 || a->out[0])  // a checkpoint: one layer, or LoRA's whole state
        bytes += tt->lora.r > 0 ? 8.0 * others + (shard_weights ? 4.0 * others_w : 0.0)
                                : 4.0 * layer_max;
    return bytes + 4.0 * layer_max;  // (the collectives' buffer)
}

double memory_stream_staging(const TrainArgs* a, const Model* m, int* from_file) {
    // (a preset, a config.json or the default model: the seeded random init; else a checkpoint)
    ModelConfig c;
    char err[ERR_LEN];
    const size_t n = strlen(a->model);
    const int random_init = !a->model[0] || config_from_preset(&c, a->model, err) == 0 ||
                            (n >= 5 && strcmp(a->model + n - 5, ".json") == 0);
    if (from_file) *from_file = !random_init;
    const int bf16 = a->device == DEVICE_CUDA;
    if (random_init || !str_ends_with(a->model, ".gguf"))
        return quant_stream_staging_bytes(&m->tt, threads_online_cpus(), !random_init, bf16);
    // a GGUF: its large tensors read in slices (loader.c)
    double largest = 0.0;
    for (int i = 0; i < m->tt.n; i++) {
        const TensorDesc* d = &m->tt.t[i];
        if (d->qtype || (bf16 && !d->trainable && d->tied_to < 0))
            largest = fmax(largest, loader_gguf_staging_bytes(d, &m->cfg, LOADER_SLICE_BYTES));
    }
    return threads_online_cpus() * largest;
}

RunMemory memory_estimate(const TrainArgs* a, const Model* m, int n_devices,
                          const EngineOptions* eo) {
    RunMemory r;
    memset(&r, 0, sizeof r);
    const int engine = n_devices > 0, gpus = a->device == DEVICE_CUDA;
    const int threads = a->threads > 0 ? a->threads : threads_online_cpus();
    const int Bm = (a->batch + a->micro_batches - 1) / a->micro_batches;  // the largest
    const int T = a->seq;
    r.state = store_bytes(&m->tt);
    // --base-dtype: the Store's blocks of the quantised base beside its fp32 values (quant.h)
    for (int l = 0; l < m->tt.n_layers; l++) r.state += (double)quant_layer_block_bytes(&m->tt, l);
    // the plain path (plain training; with the engine evaluation, sampling, --dump-state): its
    // buffers are host memory on the CPU backend, the store's slabs its own (aliased)
    if (trainer_needs_plain(a, engine) && !gpus)
        r.activations += (double)plain_bytes(m, 4, 1, Bm, T, plain_needs_recompute(m, 4, Bm, T)) +
                         (double)model_cpu_op_temp_bytes(m, Bm, T, threads);
    if (engine) {
        const int ab = gpus ? 2 : 4;  // the devices' compute dtype
        const EngineHostMemory h = engine_host_memory(m, ab, n_devices, eo);
        r.state += h.masters + h.grads + (eo->split_rounds ? h.split_extra : 0.0);
        // LoRA on GPUs: the engine's bf16 base takes the place of the Store's fp32 one, page by
        // page as it converts them (the peak is the fp32 base the loader fills)
        if (trainer_releases_frozen(a, m, engine)) r.state -= h.base;
        // --mmap-base: no copy of the base in host memory at all (the Store's fp32 head is never
        // touched, the engine's copy holds nothing of it; the page cache holds what the
        // uploads read, reclaimable)
        if (a->mmap_base) {
            r.state -= store_frozen_bytes(&m->tt);
            for (int l = 0; l < m->tt.n_layers; l++)
                r.state -= (double)quant_layer_block_bytes(&m->tt, l);
            if (!trainer_releases_frozen(a, m, engine)) r.state -= h.base;
        }
        // a streamed base (trainer_streams_base): the block-format tensors never in fp32, on
        // GPUs none of the base (the others in bf16, Store.base16, which the engine uploads from
        // or packs a layer at a time), the init's or the loader's staging instead
        if (trainer_streams_base(a, m, engine)) {
            r.state -= quant_fp32_bytes(&m->tt);
            if (gpus)
                r.state -= store_frozen_bytes(&m->tt) - quant_fp32_bytes(&m->tt) -
                           store_base16_bytes(&m->tt);
            r.activations += memory_stream_staging(a, m, NULL);
        }
        // resuming the delayed update: its pending weights stay until the engine has copied them
        if (a->resume && !a->sync) {
            for (int l = 0; l < m->tt.n_layers; l++)  // (the trainable tensors': LoRA's adapters)
                r.state += (double)m->tt.state_numel[l] * ab;
        }
        r.activations += h.staging;
        if (a->dist_world > 1) r.state += dp_engine_rank_bytes(a, m, eo, &h);
        EnginePlanMemory pm;
        char err[ERR_LEN];
        if (engine_plan_memory(m, ab, n_devices, eo, &pm, err) == 0) {
            r.checkpoints = (double)pm.host_checkpoints;
            r.activations += r.checkpoints;
            // emulated devices allocate on the host, and their ops compute one row chunk at a
            // time with their own threads (trainer.c: create_engine)
            const int per_dev =
                a->threads > 0 ? a->threads : imax(1, threads_online_cpus() / n_devices);
            if (!gpus)
                r.activations +=
                    n_devices * ((double)pm.device.total +
                                 (double)model_cpu_op_temp_bytes(m, pm.Bc, T, per_dev));
        } else {
            r.plan_failed = 1;
            r.checkpoints = h.checkpoints_max;
            r.activations += r.checkpoints;
        }
    }
    // the plain path's data parallel (dp.c): the whole Store on every rank, and the packed
    // gradients and the gathered weights, each the model's size (padded to W blocks)
    if (!engine && a->dist_world > 1) r.state += 8.0 * (double)m->tt.trainable_params;
    r.activations += 2.0 * a->batch * (T + 1.0) * sizeof(int32_t);  // the batch, twice
    if (engine && a->trace[0]) r.activations += (double)trace_max_bytes(ENGINE_TRACE_EVENTS);
    r.exports = checkpoint_export_bytes(m, a->export_hf[0] != '\0', a->export_dtype,
                                        (uint64_t)a->export_shard_bytes, a->export_gguf[0] != '\0');
    r.program = PROGRAM_BYTES + (gpus && engine ? n_devices * CUDA_CONTEXT_BYTES : 0.0);
    r.total = r.state + r.activations + r.exports + r.program;
    return r;
}

// ----------------------------------------------------------------------------
// the decision

// A changed setting and what the run needs with it.
typedef struct Option {
    char flags[96];
    double total;
} Option;

// The estimate with other flags: micro-batches M (0 = as given), the MLP chunked (chunk > 0),
// one set of host checkpoints, the synchronous optimizer, no split rounds. Changes and restores
// m->mlp_chunk. -1 when the engine cannot plan it.
static double estimate_with(const TrainArgs* a, Model* m, int n_devices, const EngineOptions* eo,
                            int M, int chunk, int single, int sync, int no_split) {
    TrainArgs b = *a;
    EngineOptions e;
    memset(&e, 0, sizeof e);
    if (eo) e = *eo;
    if (M > 0) b.micro_batches = e.M = M;
    if (single) b.host_single = e.host_single = 1;
    if (sync) b.sync = e.sync = 1;
    if (no_split) e.split_rounds = 0;
    const int saved = m->mlp_chunk;
    if (chunk > 0) m->mlp_chunk = chunk;
    const RunMemory r = memory_estimate(&b, m, n_devices, n_devices > 0 ? &e : NULL);
    m->mlp_chunk = saved;
    return r.plan_failed ? -1 : r.total;
}

// What would make the run fit in `limit`, appended to buf: each setting that fits alone, else
// all of them together, else why nothing does.
static void suggest(const TrainArgs* a, Model* m, int n_devices, const EngineOptions* eo,
                    const RunMemory* r, double limit, char* buf, size_t cap) {
    const int engine = n_devices > 0;
    Option opt[8];
    int n = 0;
    // more micro-batches: the smallest count (doubling up to the batch) that fits
    const int M0 = a->micro_batches;
    for (int M = 2 * M0; M0 < a->batch; M *= 2) {
        if (M > a->batch) M = a->batch;
        const int valid = !engine || a->round_micro_batches == 0 || M % a->round_micro_batches == 0;
        const double need = valid ? estimate_with(a, m, n_devices, eo, M, 0, 0, 0, 0) : -1;
        if (need > 0 && need <= limit) {
            snprintf(opt[n].flags, sizeof opt[n].flags, "--micro-batches %d", M);
            opt[n++].total = need;
            break;
        }
        if (M == a->batch) break;
    }
    const int chunk = 16384;
    if (m->mlp_chunk == 0 && (int64_t)((a->batch + M0 - 1) / M0) * a->seq > chunk) {
        snprintf(opt[n].flags, sizeof opt[n].flags, "--mlp-chunk %d", chunk);
        opt[n++].total = estimate_with(a, m, n_devices, eo, 0, chunk, 0, 0, 0);
    }
    if (engine && !a->host_single) {
        snprintf(opt[n].flags, sizeof opt[n].flags, "--host-checkpoints single");
        opt[n++].total = estimate_with(a, m, n_devices, eo, 0, 0, 1, 0, 0);
    }
    if (engine && !a->sync) {
        snprintf(opt[n].flags, sizeof opt[n].flags, "--sync 1");
        opt[n++].total = estimate_with(a, m, n_devices, eo, 0, 0, 0, 1, 0);
    }
    if (engine && eo->split_rounds) {
        snprintf(opt[n].flags, sizeof opt[n].flags, "--no-split-rounds");
        opt[n++].total = estimate_with(a, m, n_devices, eo, 0, 0, 0, 0, 1);
    }
    size_t len = strlen(buf);
#ifdef HAVE_CUDA
    // plain training keeps every activation on the host; with the engine the GPUs hold them
    if (!engine && r->state + r->program < limit)
        len += (size_t)snprintf(buf + len, cap - len, "; with GPUs, --device cuda holds the "
                                "activations there");
#endif
    int fits = 0;
    for (int i = 0; i < n; i++) {
        if (opt[i].total <= 0 || opt[i].total > limit) continue;
        char g[32];
        format_bytes(opt[i].total, g, sizeof g);
        len += (size_t)snprintf(buf + len, cap - len, "%s%s (about %s)", fits ? " or " : "; ",
                                opt[i].flags, g);
        fits++;
        if (len >= cap) return;
    }
    if (fits) {
        snprintf(buf + len, cap - len, " would fit");
        return;
    }
    // together: every setting tried, with micro-batches as many as there are sequences
    const double all = estimate_with(a, m, n_devices, eo, a->batch,
                                     m->mlp_chunk == 0 ? chunk : 0, engine, engine,
                                     engine && eo->split_rounds);
    char g[32];
    if (r->state + r->program > limit) {
        format_bytes(r->state, g, sizeof g);
        snprintf(buf + len, cap - len, "; the weights, optimizer state and gradients alone take %s "
                 "(16 B per parameter%s): no flag makes this model fit here", g,
                 engine ? " and the engine's weight copies" : "");
    } else if (all > 0 && all <= limit) {
        format_bytes(all, g, sizeof g);
        snprintf(buf + len, cap - len, "; --micro-batches %d%s%s%s%s together would fit (about %s)",
                 a->batch, m->mlp_chunk == 0 ? " --mlp-chunk 16384" : "",
                 engine && !a->host_single ? " --host-checkpoints single" : "",
                 engine && !a->sync ? " --sync 1" : "",
                 engine && eo->split_rounds ? " --no-split-rounds" : "", g);
    } else {
        snprintf(buf + len, cap - len, "; shorter sequences (--seq) or a smaller --batch would");
    }
}

int memory_check_run(const TrainArgs* a, Model* m, int n_devices, const EngineOptions* eo,
                     const HostLimit* lim, char* err) {
    const RunMemory r = memory_estimate(a, m, n_devices, eo);
    char total[32], state[32], acts[32], avail[32], prog[32];
    format_bytes(r.total, total, sizeof total);
    format_bytes(r.state, state, sizeof state);
    format_bytes(r.activations + r.exports, acts, sizeof acts);
    format_bytes(lim->bytes, avail, sizeof avail);
    format_bytes(r.program, prog, sizeof prog);
    printf("host memory: about %s = %s of weights, optimizer state and gradients + %s of "
           "activations, scratch and buffers + %s for the program", total, state, acts, prog);
    if (n_devices > 0 && a->dist_world > 1)
        printf(" on rank 0 of %d (ZeRO-1: AdamW's state and the fp32 weights for its shard)",
               a->dist_world);
    if (lim->bytes > 0) printf(" (available: %s, %s)", avail, lim->source);
    printf("\n");
    // (no plan fits the devices: engine_create says so, which matters more)
    if (lim->bytes <= 0 || r.total <= lim->bytes || r.plan_failed) return 0;
    if (a->allow_overcommit || !lim->ceiling) {
        printf("warning: this run needs about %s of host memory but %s is available (%s); %s\n",
               total, avail, lim->source,
               a->allow_overcommit ? "--allow-overcommit: starting anyway"
                                   : "this virtual machine adds memory on demand (virtio-mem or "
                                     "a balloon), so that is not its ceiling: starting anyway");
        return 0;
    }
    char help[ERR_LEN] = "";
    suggest(a, m, n_devices, eo, &r, lim->bytes, help + strlen(help), sizeof help - strlen(help));
    errorf(err, "not enough host memory: this run needs about %s (%s of weights, optimizer "
           "state and gradients, %s of activations and buffers) but %s is available (%s)%s; "
           "--allow-overcommit starts it anyway", total, state, acts, avail, lim->source, help);
    return -1;
}
