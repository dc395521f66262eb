/*
 * weightsync.h — moving a new version of the weights to the rollout side (GRPO's split schedule,
 * grpo.h): the weight manifest, and the broadcast from the first rollout device to the others.
 *
 * The manifest lists every tensor the rollout side needs (the tensor table's tensors with
 * storage of their own: a tied head reads its owner's): name, shape, dtype (bytes per element),
 * and where it lies (layer slab, element offset). The sender's manifest is exchanged before the
 * first broadcast; each receiver checks it against its own (the same names, shapes and dtypes:
 * a mismatch is one error naming the tensor) and places every tensor by name into its own
 * layout. The broadcast then runs one op per tensor in the sender's order (the same sequence on
 * every rank, as a communicator needs), one group per layer.
 *
 * The broadcast group: K ranks, one per rollout device, over comm.h — the emulation on CPU
 * devices (--device cpu:N), NCCL on GPUs — all in this process: the communicators are made on K
 * threads (init is collective), every op is enqueued on the devices' compute streams (after the
 * upload that brought the weights to rank 0, before the next generation on each device), so the
 * CUDA path and the emulated one are the same code.
 *
 * Across processes (WeightRank): each process holds ONE rank of a communicator (dist.c's, or one
 * made for the purpose) and calls the same steps for itself: the root (a trainer rank) sends its
 * manifest, every receiving rank (a rollout rank) checks it and plans the placement, and a verdict
 * all-gathered from every rank makes a refusal on any one of them the same one-line error on all
 * of them (the sender learns that a receiver refused instead of waiting for it at the first
 * weight). Ranks of the communicator that neither send nor receive (other trainer ranks, when it
 * is the whole run's) take part in every op and receive into scratch. The per-tensor broadcast is
 * the in-process one's (the same op sequence and placement by name).
 */
#ifndef LLMC_WEIGHTSYNC_H
#define LLMC_WEIGHTSYNC_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "device.h"
#include "tensor.h"

typedef struct WeightEntry {
    char name[64];    // the tensor table's name ("layers.3.wq")
    int layer;        // slab holding it
    int ndim;
    int dtype;        // bytes per element: 2 (bf16) or 4 (fp32)
    int64_t shape[4];
    int64_t offset;   // elements into the layer's slab
    int64_t numel;
} WeightEntry;

typedef struct WeightManifest {
    int n;
    WeightEntry* e;   // (n) in slab order
} WeightManifest;

// The manifest of the generator's layout (the tensor table's slabs in the compute dtype).
void weight_manifest_build(WeightManifest* wm, const TensorTable* tt, int act_bytes);
void weight_manifest_free(WeightManifest* wm);
// Serialised: a header and n fixed-size records (for a broadcast as bytes).
size_t weight_manifest_bytes(const WeightManifest* wm);
void weight_manifest_pack(const WeightManifest* wm, void* out);
// -1 + err when the bytes are not a manifest.
int weight_manifest_unpack(WeightManifest* wm, const void* in, size_t bytes, char* err);
// The receiver's check of the sender's manifest against its own: every tensor it needs is sent,
// with the same shape and dtype, and nothing else is. 0, or -1 + one line naming the tensor.
int weight_manifest_check(const WeightManifest* mine, const WeightManifest* sent, char* err);
// Where sender entry i lands here: place[i] = index into mine (after a passing check).
void weight_manifest_place(const WeightManifest* mine, const WeightManifest* sent, int* place);

typedef struct WeightBcast {
    int K;                  // ranks (rollout devices); K = 1 needs no communicator
    const DeviceImpl* impl;
    Device** dev;           // (K) borrowed
    Comm** comm;            // (K) rank k on dev[k]
    CommEmulWorld* world;   // the emulation's shared state (CPU devices)
    WeightManifest sent;    // the sender's manifest, as every rank received it
    int** place;            // (K) per rank: sender entry -> its own entry
    const WeightManifest* mine;  // (K) borrowed: each rank's own manifest
    int ready;              // manifests exchanged and checked
} WeightBcast;

// The communicators over dev[0..K) (NCCL on CUDA devices, gpu[k] their GPU indices; the
// emulation on CPU devices). -1 + err.
int weight_bcast_open(WeightBcast* wb, const DeviceImpl* impl, Device** dev, const int* gpu,
                      int K, double timeout_s, char* err);
// The manifest exchange: rank 0 holds `sender`'s layout (what the trainer sends), every rank
// receives it over the communicator, checks it against its own (mine[k]) and plans the
// placement. -1 + err (the first rank's failure).
int weight_bcast_manifest(WeightBcast* wb, const WeightManifest* sender, const WeightManifest* mine,
                          char* err);
// Rank 0's slabs (slabs[0][layer], device memory) to every other rank's (slabs[k][layer]), each
// tensor placed by name; waits for the broadcast. Returns the bytes each receiver got, or -1 +
// err.
int64_t weight_bcast_run(WeightBcast* wb, void* const* const* slabs, char* err);
void weight_bcast_close(WeightBcast* wb);

// ----------------------------------------------------------------------------
// one rank of the broadcast across processes

typedef enum {
    WEIGHT_SEND = 0,  // the root: its slabs are laid out as the manifest it sends
    WEIGHT_RECV,      // a rollout rank: checks the sender's manifest, places tensors by name
    WEIGHT_PASS       // in the communicator, neither: joins every op, keeps nothing
} WeightRole;

typedef struct WeightRank {
    Comm* comm;                  // borrowed
    CommStream st;               // this rank's device stream (ops and staging)
    int root;                    // the sending rank
    WeightRole role;
    const WeightManifest* mine;  // borrowed: SEND the manifest it sends, RECV its own; PASS NULL
    WeightManifest sent;         // the sender's manifest, as received
    int* place;                  // RECV: sender entry -> its own entry
    void* scratch;               // PASS: device memory for the largest tensor
    int ready;
} WeightRank;

// This rank's part of the manifest exchange over c (every rank of c calls it, with the same
// root): the root sends `mine`, each receiver checks it against its own `mine`, then every rank
// learns every rank's verdict. 0 on all ranks, or -1 on all ranks with the same err ("weight
// manifest, rank R: ..." naming the first rank that refused and the tensor).
int weight_rank_manifest(WeightRank* wr, Comm* c, const CommStream* st, int root, WeightRole role,
                         const WeightManifest* mine, char* err);
// This rank's part of one broadcast of the weights: the root's slabs (device memory of st's
// device, by layer) to every receiver's slabs, each tensor placed by name; waits for it.
// Returns the bytes a receiver gets, or -1 + err.
int64_t weight_rank_run(WeightRank* wr, void* const* slabs, char* err);
// Frees what the exchange made (not the communicator).
void weight_rank_close(WeightRank* wr);

#endif  // LLMC_WEIGHTSYNC_H
