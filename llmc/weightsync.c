/*
 * weightsync.c — the weight manifest and the rollout devices' broadcast (weightsync.h).
 *
 * Buffers it touches: the rollout devices' weight slabs (through the communicator, on their
 * compute streams) and its own staging for the manifest. Events: none; comm_sync waits.
 */
#include "weightsync.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define MANIFEST_MAGIC 0x57534d31u  // "WSM1"

// ----------------------------------------------------------------------------
// the manifest

void weight_manifest_build(WeightManifest* wm, const TensorTable* tt, int act_bytes) {
    wm->e = calloc_check((size_t)(tt->n > 0 ? tt->n : 1), sizeof(WeightEntry));
    wm->n = 0;
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to >= 0 || d->param_offset < 0 || d->numel == 0) continue;  // no storage
        WeightEntry* e = &wm->e[wm->n++];
        snprintf(e->name, sizeof e->name, "%s", d->name);
        e->layer = d->owner_layer;
        e->ndim = d->ndim;
        e->dtype = act_bytes;
        for (int k = 0; k < 4; k++) e->shape[k] = k < d->ndim ? d->shape[k] : 0;
        e->offset = d->param_offset;
        e->numel = d->numel;
    }
}

void weight_manifest_free(WeightManifest* wm) {
    free(wm->e);
    memset(wm, 0, sizeof *wm);
}

size_t weight_manifest_bytes(const WeightManifest* wm) {
    return 2 * sizeof(uint32_t) + (size_t)wm->n * sizeof(WeightEntry);
}

void weight_manifest_pack(const WeightManifest* wm, void* out) {
    const uint32_t head[2] = {MANIFEST_MAGIC, (uint32_t)wm->n};
    memcpy(out, head, sizeof head);
    memcpy((char*)out + sizeof head, wm->e, (size_t)wm->n * sizeof(WeightEntry));
}

int weight_manifest_unpack(WeightManifest* wm, const void* in, size_t bytes, char* err) {
    memset(wm, 0, sizeof *wm);
    uint32_t head[2];
    if (bytes < sizeof head) return errorf(err, "weight manifest: %zu bytes, no header", bytes);
    memcpy(head, in, sizeof head);
    const size_t want = sizeof head + (size_t)head[1] * sizeof(WeightEntry);
    if (head[0] != MANIFEST_MAGIC || want > bytes)
        return errorf(err, "weight manifest: not a manifest (magic %08x, %u tensors in %zu bytes)",
                      head[0], head[1], bytes);
    wm->n = (int)head[1];
    wm->e = calloc_check((size_t)(wm->n > 0 ? wm->n : 1), sizeof(WeightEntry));
    memcpy(wm->e, (const char*)in + sizeof head, (size_t)wm->n * sizeof(WeightEntry));
    for (int i = 0; i < wm->n; i++) wm->e[i].name[sizeof wm->e[i].name - 1] = '\0';
    return 0;
}

static int find_name(const WeightManifest* wm, const char* name) {
    for (int i = 0; i < wm->n; i++)
        if (strcmp(wm->e[i].name, name) == 0) return i;
    return -1;
}

static void shape_text(const WeightEntry* e, char* out, size_t cap) {
    size_t o = (size_t)snprintf(out, cap, "(");
    for (int k = 0; k < e->ndim && o < cap; k++)
        o += (size_t)snprintf(out + o, cap - o, "%s%lld", k ? ", " : "", (long long)e->shape[k]);
    if (o < cap) snprintf(out + o, cap - o, ") %s", e->dtype == 2 ? "bf16" : "fp32");
}

int weight_manifest_check(const WeightManifest* mine, const WeightManifest* sent, char* err) {
    for (int i = 0; i < mine->n; i++) {
        const WeightEntry* m = &mine->e[i];
        const int j = find_name(sent, m->name);
        if (j < 0)
            return errorf(err, "weight manifest: the sender has no tensor \"%s\" (%d tensors "
                          "sent, %d needed)", m->name, sent->n, mine->n);
        const WeightEntry* s = &sent->e[j];
        int same = s->ndim == m->ndim && s->dtype == m->dtype && s->numel == m->numel;
        for (int k = 0; k < m->ndim && same; k++) same = s->shape[k] == m->shape[k];
        if (!same) {
            char a[96], b[96];
            shape_text(s, a, sizeof a);
            shape_text(m, b, sizeof b);
            return errorf(err, "weight manifest: tensor \"%s\" is sent as %s, the rollout side "
                          "holds %s", m->name, a, b);
        }
    }
    for (int j = 0; j < sent->n; j++)
        if (find_name(mine, sent->e[j].name) < 0)
            return errorf(err, "weight manifest: the sender's tensor \"%s\" has no place on the "
                          "rollout side", sent->e[j].name);
    return 0;
}

void weight_manifest_place(const WeightManifest* mine, const WeightManifest* sent, int* place) {
    for (int j = 0; j < sent->n; j++) place[j] = find_name(mine, sent->e[j].name);
}

// ----------------------------------------------------------------------------
// the communicators

typedef struct InitArgs {
    const CommImpl* impl;
    CommInit in;
    Comm* out;
    char err[ERR_LEN];
} InitArgs;

static void* init_rank(void* arg) {
    InitArgs* a = arg;
    a->out = a->impl->init(&a->in, a->err);
    return NULL;
}

int weight_bcast_open(WeightBcast* wb, const DeviceImpl* impl, Device** dev, const int* gpu,
                      int K, double timeout_s, char* err) {
    memset(wb, 0, sizeof *wb);
    wb->K = K;
    wb->impl = impl;
    wb->dev = dev;
    if (K < 2) return 0;  // nobody to broadcast to
    const CommImpl* ci = &comm_emul_impl;
    CommToken token;
    memset(&token, 0, sizeof token);
#ifdef HAVE_CUDA
    if (impl == &device_cuda_impl) {
        ci = &comm_nccl_impl;
        if (ci->new_token(&token, err) != 0) return -1;
    }
#endif
    (void)gpu;
    if (ci == &comm_emul_impl) wb->world = comm_emul_world_create(K);
    // init is collective (as ncclCommInitRank): every rank joins from a thread of its own
    InitArgs* a = calloc_check((size_t)K, sizeof(InitArgs));
    pthread_t* th = calloc_check((size_t)K, sizeof(pthread_t));
    for (int k = 0; k < K; k++) {
        a[k] = (InitArgs){.impl = ci,
                          .in = {.rank = k, .world = K, .timeout_s = timeout_s, .token = token,
                                 .gpu = gpu ? gpu[k] : k, .local = wb->world}};
        pthread_check(pthread_create(&th[k], NULL, init_rank, &a[k]));
    }
    for (int k = 0; k < K; k++) pthread_check(pthread_join(th[k], NULL));
    wb->comm = calloc_check((size_t)K, sizeof(Comm*));
    int rc = 0;
    for (int k = 0; k < K; k++) {
        wb->comm[k] = a[k].out;
        if (!a[k].out && rc == 0) rc = errorf(err, "rollout devices' communicator: %s", a[k].err);
    }
    free(a);
    free(th);
    if (rc != 0) weight_bcast_close(wb);
    return rc;
}

// ----------------------------------------------------------------------------
// the manifest exchange and the broadcast

static CommStream stream_of(const WeightBcast* wb, int k) {
    return (CommStream){.impl = wb->impl, .dev = wb->dev[k], .stream = STREAM_COMPUTE};
}

// Wait for rank k's ops; -1 + err (when err is not NULL) with the communicator's message.
static int sync_rank(WeightBcast* wb, int k, char* err) {
    const CommStream st = stream_of(wb, k);
    if (comm_sync(wb->comm[k], &st) == 0) return 0;
    char msg[ERR_LEN], sink[ERR_LEN];
    return errorf(err ? err : sink, "rollout devices' broadcast: %s",
                  comm_error(wb->comm[k], msg, sizeof msg) ? msg : "failed");
}

// Rank 0's `bytes` host bytes to every rank's host buffer out[k] through device staging (bytes
// even: sent as bf16 elements, which a broadcast moves unchanged).
static int bcast_host_bytes(WeightBcast* wb, const void* src, void** out, size_t bytes,
                            char* err) {
    const DeviceImpl* im = wb->impl;
    void** d = calloc_check((size_t)wb->K, sizeof(void*));
    void* stage = im->host_alloc(bytes);
    memcpy(stage, src, bytes);
    for (int k = 0; k < wb->K; k++) d[k] = im->alloc(wb->dev[k], bytes);
    im->copy_h2d(wb->dev[0], STREAM_COMPUTE, d[0], stage, bytes);
    int rc = 0;
    for (int k = 0; k < wb->K && rc == 0; k++) {
        const CommStream st = stream_of(wb, k);
        if (comm_broadcast(wb->comm[k], k == 0 ? d[0] : NULL, d[k], bytes / 2, COMM_BF16, 0,
                           &st) != 0)
            rc = sync_rank(wb, k, err);
    }
    for (int k = 0; k < wb->K; k++) {
        const int r = sync_rank(wb, k, rc ? NULL : err);
        if (rc == 0) rc = r;
    }
    for (int k = 0; k < wb->K && rc == 0; k++) {
        im->copy_d2h(wb->dev[k], STREAM_COMPUTE, stage, d[k], bytes);
        im->synchronize(wb->dev[k]);
        memcpy(out[k], stage, bytes);
    }
    for (int k = 0; k < wb->K; k++) im->free(wb->dev[k], d[k]);
    im->host_free(stage);
    free(d);
    return rc;
}

int weight_bcast_manifest(WeightBcast* wb, const WeightManifest* sender, const WeightManifest* mine,
                          char* err) {
    wb->mine = mine;
    if (wb->K < 2) return 0;
    const int K = wb->K;
    // the size first (receivers allocate for it), then the records
    uint64_t size = (weight_manifest_bytes(sender) + 1) & ~(uint64_t)1;
    uint64_t* sizes = calloc_check((size_t)K, sizeof(uint64_t));
    void** out = calloc_check((size_t)K, sizeof(void*));
    for (int k = 0; k < K; k++) out[k] = &sizes[k];
    int rc = bcast_host_bytes(wb, &size, out, sizeof size, err);
    char* packed = calloc_check((size_t)size, 1);
    weight_manifest_pack(sender, packed);
    for (int k = 0; k < K; k++) {
        if (rc == 0 && sizes[k] != size)
            rc = errorf(err, "weight manifest: rank %d received a size of %llu bytes, not %llu", k,
                        (unsigned long long)sizes[k], (unsigned long long)size);
        out[k] = calloc_check((size_t)size, 1);
    }
    if (rc == 0) rc = bcast_host_bytes(wb, packed, out, (size_t)size, err);
    // each receiver checks what it got against its own layout and plans the placement
    wb->place = calloc_check((size_t)K, sizeof(int*));
    for (int k = 0; k < K && rc == 0; k++) {
        WeightManifest got;
        if (weight_manifest_unpack(&got, out[k], (size_t)size, err) != 0) {
            rc = -1;
            break;
        }
        char why[ERR_LEN];
        if (weight_manifest_check(&mine[k], &got, why) != 0) {
            rc = errorf(err, "rollout device %d: %.400s", k, why);
        } else {
            wb->place[k] = calloc_check((size_t)(got.n > 0 ? got.n : 1), sizeof(int));
            weight_manifest_place(&mine[k], &got, wb->place[k]);
        }
        if (k == 0 && rc == 0) wb->sent = got;
        else weight_manifest_free(&got);
    }
    for (int k = 0; k < K; k++) free(out[k]);
    free(out);
    free(sizes);
    free(packed);
    wb->ready = rc == 0;
    return rc;
}

int64_t weight_bcast_run(WeightBcast* wb, void* const* const* slabs, char* err) {
    if (wb->K < 2) return 0;
    if (!wb->ready) {
        errorf(err, "internal: weight broadcast before the manifest exchange");
        return -1;
    }
    const WeightManifest* s = &wb->sent;
    CommOp* ops = calloc_check((size_t)(s->n > 0 ? s->n : 1), sizeof(CommOp));
    int64_t bytes = 0;
    int rc = 0;
    for (int k = 0; k < wb->K && rc == 0; k++) {
        const CommStream st = stream_of(wb, k);
        // one op per tensor in the sender's order, one group per sender layer
        int n = 0;
        for (int j = 0; j < s->n && rc == 0; j++) {
            const WeightEntry* e = &s->e[j];
            const WeightEntry* m = &wb->mine[k].e[wb->place[k][j]];
            const size_t ab = (size_t)e->dtype;
            // the root sends in place from the sender's layout (it received the upload in it);
            // a receiver's copy lands where its own manifest puts that name
            char* src = (char*)slabs[0][e->layer] + (size_t)e->offset * ab;
            ops[n++] = (CommOp){.kind = COMM_BROADCAST,
                                .dtype = ab == 2 ? COMM_BF16 : COMM_F32,
                                .send = k == 0 ? src : NULL,
                                .recv = k == 0 ? src
                                               : (char*)slabs[k][m->layer] + (size_t)m->offset * ab,
                                .count = (size_t)e->numel, .root = 0};
            if (k == 1) bytes += e->numel * (int64_t)ab;
            if (j + 1 == s->n || s->e[j + 1].layer != e->layer) {
                if (comm_run(wb->comm[k], ops, n, &st) != 0) rc = sync_rank(wb, k, err);
                n = 0;
            }
        }
    }
    for (int k = 0; k < wb->K; k++) {
        const int r = sync_rank(wb, k, rc ? NULL : err);
        if (rc == 0) rc = r;
    }
    free(ops);
    return rc == 0 ? bytes : -1;
}

void weight_bcast_close(WeightBcast* wb) {
    for (int k = 0; wb->comm && k < wb->K; k++)
        if (wb->comm[k]) {
            const CommStream st = stream_of(wb, k);
            (void)comm_sync(wb->comm[k], &st);
        }
    for (int k = 0; wb->comm && k < wb->K; k++)
        if (wb->comm[k]) comm_destroy(wb->comm[k]);
    if (wb->world) comm_emul_world_destroy(wb->world);
    for (int k = 0; wb->place && k < wb->K; k++) free(wb->place[k]);
    free(wb->place);
    free(wb->comm);
    weight_manifest_free(&wb->sent);
    memset(wb, 0, sizeof *wb);
}
