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

// The bytes one broadcast of the weights moves to a receiver.
static int64_t weight_manifest_payload(const WeightManifest* s) {
    int64_t bytes = 0;
    for (int j = 0; j < s->n; j++) bytes += s->e[j].numel * (int64_t)s->e[j].dtype;
    return bytes;
}

// One rank's ops of a weight broadcast, enqueued on st: one op per tensor in the sender's order,
// one group per sender layer (the same sequence on every rank). The root sends in place from
// its slabs, laid out as the sender's manifest (it received the upload in it); a receiver's copy
// lands where its own manifest puts that name (mine, place); a rank with neither (scratch set)
// receives into scratch. ops holds s->n. 0, or -1 when the communicator refused an op.
static int enqueue_tensors(Comm* c, const CommStream* st, const WeightManifest* s, int root,
                           int is_root, const WeightManifest* mine, const int* place,
                           void* const* slabs, void* scratch, CommOp* ops) {
    int n = 0;
    for (int j = 0; j < s->n; j++) {
        const WeightEntry* e = &s->e[j];
        const size_t ab = (size_t)e->dtype;
        char* dst;
        if (is_root) {
            dst = (char*)slabs[e->layer] + (size_t)e->offset * ab;
        } else if (scratch) {
            dst = scratch;
        } else {
            const WeightEntry* m = &mine->e[place[j]];
            dst = (char*)slabs[m->layer] + (size_t)m->offset * ab;
        }
        ops[n++] = (CommOp){.kind = COMM_BROADCAST, .dtype = ab == 2 ? COMM_BF16 : COMM_F32,
                            .send = is_root ? dst : NULL, .recv = dst,
                            .count = (size_t)e->numel, .root = root};
        if (j + 1 == s->n || s->e[j + 1].layer != e->layer) {
            if (comm_run(c, ops, n, st) != 0) return -1;
            n = 0;
        }
    }
    return 0;
}

int64_t weight_bcast_run(WeightBcast* wb, void* const* const* slabs, char* err) {
    if (wb->K < 2) return 0;
    if (!wb->ready) {
        errorf(err, "internal: weight broadcast before the manifest exchange");
        return -1;
    }
    const WeightManifest* s = &wb->sent;
    CommOp* ops = calloc_check((size_t)(s->n > 0 ? s->n : 1), sizeof(CommOp));
    int rc = 0;
    for (int k = 0; k < wb->K && rc == 0; k++) {
        const CommStream st = stream_of(wb, k);
        if (enqueue_tensors(wb->comm[k], &st, s, 0, k == 0, &wb->mine[k], wb->place[k], slabs[k],
                            NULL, ops) != 0)
            rc = sync_rank(wb, k, err);
    }
    const int64_t bytes = weight_manifest_payload(s);
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

// ----------------------------------------------------------------------------
// one rank of the broadcast across processes

#define VERDICT_BYTES 384  // each rank's refusal (empty: accepted), all-gathered

// Wait for this rank's ops: 0, or -1 + err with the communicator's message.
static int rank_sync(WeightRank* wr, char* err) {
    if (comm_sync(wr->comm, &wr->st) == 0) return 0;
    char msg[ERR_LEN];
    return errorf(err, "weight broadcast: %s",
                  comm_error(wr->comm, msg, sizeof msg) ? msg : "failed");
}

// `bytes` (even) host bytes: the root's buf to every rank's buf, through device staging.
static int rank_bcast_bytes(WeightRank* wr, void* buf, size_t bytes, char* err) {
    const DeviceImpl* im = wr->st.impl;
    Device* dev = wr->st.dev;
    void* stage = im->host_alloc(bytes);
    void* d = im->alloc(dev, bytes);
    if (wr->comm->rank == wr->root) {
        memcpy(stage, buf, bytes);
        im->copy_h2d(dev, wr->st.stream, d, stage, bytes);
    }
    int rc = comm_broadcast(wr->comm, wr->comm->rank == wr->root ? d : NULL, d, bytes / 2,
                            COMM_BF16, wr->root, &wr->st);
    const int r = rank_sync(wr, err);
    if (rc == 0) rc = r;
    else if (r == 0) rc = errorf(err, "weight broadcast: the manifest's broadcast was refused");
    if (rc == 0) {
        im->copy_d2h(dev, wr->st.stream, stage, d, bytes);
        im->synchronize(dev);
        memcpy(buf, stage, bytes);
    }
    im->free(dev, d);
    im->host_free(stage);
    return rc;
}

// Every rank's verdict (mine: "" accepted, else the refusal) to every rank; the first refusal
// in rank order becomes err on all of them. 0 when every rank accepted.
static int rank_verdicts(WeightRank* wr, const char* mine, char* err) {
    const DeviceImpl* im = wr->st.impl;
    Device* dev = wr->st.dev;
    const int W = wr->comm->world;
    const size_t all = (size_t)W * VERDICT_BYTES;
    char* stage = im->host_alloc(all);
    memset(stage, 0, all);
    snprintf(stage, VERDICT_BYTES, "%s", mine);
    char* d = im->alloc(dev, all);
    char* send = d + (size_t)wr->comm->rank * VERDICT_BYTES;
    im->copy_h2d(dev, wr->st.stream, send, stage, VERDICT_BYTES);
    int rc = comm_all_gather(wr->comm, send, d, VERDICT_BYTES / 2, COMM_BF16, &wr->st);
    const int r = rank_sync(wr, err);
    if (rc == 0) rc = r;
    else if (r == 0) rc = errorf(err, "weight broadcast: the verdicts' all-gather was refused");
    if (rc == 0) {
        im->copy_d2h(dev, wr->st.stream, stage, d, all);
        im->synchronize(dev);
        for (int q = 0; q < W && rc == 0; q++) {
            char* v = stage + (size_t)q * VERDICT_BYTES;
            v[VERDICT_BYTES - 1] = '\0';
            if (v[0]) rc = errorf(err, "weight manifest, rank %d: %s", q, v);
        }
    }
    im->free(dev, d);
    im->host_free(stage);
    return rc;
}

int weight_rank_manifest(WeightRank* wr, Comm* c, const CommStream* st, int root, WeightRole role,
                         const WeightManifest* mine, char* err) {
    memset(wr, 0, sizeof *wr);
    wr->comm = c;
    wr->st = *st;
    wr->root = root;
    wr->role = role;
    wr->mine = mine;
    const int is_root = c->rank == root;
    if (is_root != (role == WEIGHT_SEND) || (role != WEIGHT_PASS && !mine))
        return errorf(err, "internal: weight broadcast rank %d: role %d with root %d", c->rank,
                      (int)role, root);
    // the size first (receivers allocate for it), then the records
    uint64_t size[2] = {is_root ? (weight_manifest_bytes(mine) + 1) & ~(uint64_t)1 : 0, 0};
    if (rank_bcast_bytes(wr, size, sizeof size, err) != 0) return -1;
    char* packed = calloc_check((size_t)size[0] + 2, 1);
    if (is_root) weight_manifest_pack(mine, packed);
    if (rank_bcast_bytes(wr, packed, (size_t)size[0], err) != 0) {
        free(packed);
        return -1;
    }
    // this rank's verdict: a receiver checks the manifest against its own layout
    char why[ERR_LEN] = "", verdict[VERDICT_BYTES] = "";
    if (weight_manifest_unpack(&wr->sent, packed, (size_t)size[0], why) == 0 &&
        role == WEIGHT_RECV && weight_manifest_check(mine, &wr->sent, why) == 0) {
        wr->place = calloc_check((size_t)(wr->sent.n > 0 ? wr->sent.n : 1), sizeof(int));
        weight_manifest_place(mine, &wr->sent, wr->place);
    }  // the sender and the ranks passing through keep the manifest for the op sequence
    if (why[0]) snprintf(verdict, sizeof verdict, "%s", why);
    free(packed);
    if (rank_verdicts(wr, verdict, err) != 0) {
        weight_rank_close(wr);
        return -1;
    }
    if (role == WEIGHT_PASS) {
        size_t most = 2;
        for (int j = 0; j < wr->sent.n; j++) {
            const size_t b = (size_t)wr->sent.e[j].numel * (size_t)wr->sent.e[j].dtype;
            if (b > most) most = b;
        }
        wr->scratch = st->impl->alloc(st->dev, most);
    }
    wr->ready = 1;
    return 0;
}

int64_t weight_rank_run(WeightRank* wr, void* const* slabs, char* err) {
    if (!wr->ready) {
        errorf(err, "internal: weight broadcast before the manifest exchange");
        return -1;
    }
    CommOp* ops = calloc_check((size_t)(wr->sent.n > 0 ? wr->sent.n : 1), sizeof(CommOp));
    const int rc = enqueue_tensors(wr->comm, &wr->st, &wr->sent, wr->root,
                                   wr->role == WEIGHT_SEND, wr->mine, wr->place, slabs,
                                   wr->scratch, ops);
    free(ops);
    const int r = rank_sync(wr, err);
    if (rc != 0 && r == 0) errorf(err, "weight broadcast: an op was refused");
    return rc == 0 && r == 0 ? weight_manifest_payload(&wr->sent) : -1;
}

void weight_rank_close(WeightRank* wr) {
    if (wr->scratch) {
        (void)comm_sync(wr->comm, &wr->st);
        wr->st.impl->free(wr->st.dev, wr->scratch);
    }
    free(wr->place);
    weight_manifest_free(&wr->sent);
    memset(wr, 0, sizeof *wr);
}
