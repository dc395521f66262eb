/*
 * transfer.c — the transfer engine (docs/ROUNDPIPE.md §4): every host<->device copy of the engine,
 * on a device's four copy streams (STREAM_PARAM_UP, STREAM_ACT_UP / STREAM_ACT_DOWN,
 * STREAM_GRAD_DOWN).
 *   - parameters: a stage's weights from the master copy of its iteration into a parameter slot,
 *     in LPT bins of <= 256 MiB pieces behind the running stage's activation-upload marks, or
 *     layer by layer behind the optimizer's per-layer fences (gated uploads); the gradient slot
 *     zeroed or loaded with the host's partial sum of earlier rounds;
 *   - activations: tokens, targets, boundary checkpoints and boundary gradients up, before a
 *     micro-batch's compute; boundaries, gradients and losses down, after it;
 *   - gradients: a backward stage's slot down to the host gradient set of its iteration (or of its
 *     split round), deferred into the next stage's activation windows or layer by layer behind
 *     the last micro-batch's backward;
 *   - MoE models: each micro-batch's aux statistics rows and summed counts (docs/ROUNDPIPE.md
 *     §4.5), down from forward stages, up to and down from the fused stage, up to backward stages.
 *
 * Buffers it touches: device slots and activation buffers (as copy source or target), host
 * master[ip] and base (the trainable tail and the frozen head of each layer's slab: LoRA's base
 * is one copy for both parities), hids, htgt and the policy objective's inputs in hpol (read),
 * hx / hdx / hmoe (both), hloss, hpol's log-probs, hgrad / hsplit (written).
 * Events it records: lev[k][l], up_done[p], marks[r], down_done[p], x_ev / dx_ev / loss_ev,
 * x_free / dx_free, grads_ready, grad_ev / split_ev, gslot_free[k]; its copies wait on
 * pslot_free, gslot_free, comp_done, down_done, the running stage's marks, grads_ready, gev, and
 * on the host buffers' producers and readers (x_ev, dx_ev, x_free, dx_free, grad_ev). Protocol
 * flags only through protocol.c.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

// ----------------------------------------------------------------------------
// pieces and LPT bins (docs/ROUNDPIPE.md §4.3)

static int piece_cmp_desc(const void* a, const void* b) {
    size_t x = ((const Piece*)a)->bytes, y = ((const Piece*)b)->bytes;
    return x < y ? 1 : (x > y ? -1 : 0);
}

#define PIECE_MAX_BYTES (256u << 20)

// Append a copy of `bytes` from src to dst as pieces of at most 256 MiB (big tensors such as the
// LM head are split so no single copy hogs a window).
static void pieces_add(Piece** pieces, int* n, int* cap, void* dst, const void* src, size_t bytes) {
    for (size_t off = 0; off < bytes; off += PIECE_MAX_BYTES) {
        if (*n == *cap) *pieces = realloc_check(*pieces, (size_t)(*cap *= 2) * sizeof(Piece));
        size_t len = bytes - off < PIECE_MAX_BYTES ? bytes - off : PIECE_MAX_BYTES;
        (*pieces)[(*n)++] = (Piece){(char*)dst + off, (const char*)src + off, len, 0, 0};
    }
}

// Longest processing time first: pieces sorted by size, each to the least-loaded of n_bins bins.
static void lpt_assign(Piece* pieces, int n, int n_bins, int* bin_of) {
    qsort(pieces, (size_t)n, sizeof(Piece), piece_cmp_desc);
    size_t* load = calloc_check((size_t)n_bins, sizeof(size_t));
    for (int i = 0; i < n; i++) {
        int best = 0;
        for (int b = 1; b < n_bins; b++)
            if (load[b] < load[best]) best = b;
        bin_of[i] = best;
        load[best] += pieces[i].bytes;
    }
    free(load);
}


// The most copies one layer's upload makes (a quantised head: one per tensor, quant.h).
#define LAYER_COPIES_MAX 64

// A quantised base's head of layer l (e->quant): its frozen tensors in [from, to) one copy
// each, the quantised ones' blocks to the layer's staging area qdst, the others to dst, from
// base[l] where they lie back to back as uploaded (protocol.c's pack_layer_head).
static int head_copies(const Engine* e, int l, int64_t from, int64_t to, char* dst, char* qdst,
                       Piece* seg) {
    const TensorTable* tt = &e->m->tt;
    const char* src = e->base[l];
    size_t qoff = 0;
    int n = 0;
    for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->owner_layer != l || d->tied_to >= 0 || d->trainable) continue;
        const size_t bytes = quant_tensor_bytes(d, e->ab);
        // (--mmap-base: from the mapped checkpoint, through the staging buffers)
        const void* mapped = e->s->map_src ? e->s->map_src[i] : NULL;
        if (d->param_offset >= from && d->param_offset + d->numel <= to) {
            if (n == LAYER_COPIES_MAX) fatal("internal: layer %d uploads in too many pieces", l);
            seg[n] = d->qtype ? (Piece){qdst + qoff, src, bytes, 0, 0}
                              : (Piece){dst + (size_t)(d->param_offset - from) * e->ab, src, bytes,
                                        0, 0};
            if (mapped) {
                seg[n].src = mapped;
                seg[n].staged = 1;
                seg[n].src_type = e->s->map_type[i];
            }
            n++;
        } else if (d->param_offset < to && d->param_offset + d->numel > from) {
            fatal("internal: a quantised layer's upload splits tensor %s", d->name);
        }
        if (d->qtype) qoff += bytes;
        if (!mapped) src += bytes;
    }
    return n;
}


// ----------------------------------------------------------------------------
// --mmap-base: pageable sources through pinned staging buffers

// Host work on the parameter stream: a chunk of a mapped tensor into a staging buffer, in the
// upload format (blocks as they are; F32 / F16 / BF16 elements to the compute dtype). It runs
// after the stream's earlier work, so after the copy that last read this staging buffer.
static void stage_fill_fn(void* arg) {
    const MbJob* j = arg;
    const Piece* p = &j->piece;
    const int64_t n = j->from;  // elements (bytes for blocks)
    if (p->src_type != GGML_TYPE_F32 && p->src_type != GGML_TYPE_F16 &&
        p->src_type != GGML_TYPE_BF16) {
        memcpy(p->dst, p->src, (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const uint8_t* s = (const uint8_t*)p->src;
        const float x = p->src_type == GGML_TYPE_F32    ? ((const float*)p->src)[i]
                        : p->src_type == GGML_TYPE_BF16 ? bf16_to_f32(load_le16(s + 2 * i))
                                                        : f16_to_f32(load_le16(s + 2 * i));
        if (j->e->ab == 4) ((float*)p->dst)[i] = x;
        else ((uint16_t*)p->dst)[i] = f32_to_bf16(x);
    }
}

// One piece on stream s: a direct copy, or a staged one in chunks of at most STAGE_BYTES.
static void upload_piece(Engine* e, int ip, DevState* ds, StreamKind s, const Piece* p,
                         const char* name) {
    const DeviceImpl* im = e->impl;
    if (!p->staged) {
        jobs_label(e, ip, ds, s, "%s", name);
        im->copy_h2d(ds->d, s, p->dst, p->src, p->bytes);
        return;
    }
    int bb = 0;
    const int blocks = p->src_type != GGML_TYPE_F32 && p->src_type != GGML_TYPE_F16 &&
                       p->src_type != GGML_TYPE_BF16;
    if (blocks) ggml_type_block(p->src_type, &bb);
    const size_t unit = blocks ? (size_t)bb : e->ab;  // upload bytes per chunk unit
    const size_t src_unit = blocks ? (size_t)bb : (p->src_type == GGML_TYPE_F32 ? 4u : 2u);
    const size_t per = STAGE_BYTES / unit;  // units per chunk
    const size_t units = p->bytes / unit;
    for (size_t u = 0; u < units; u += per) {
        const size_t k = units - u < per ? units - u : per;
        void* buf = ds->stage[ds->stage_next];
        ds->stage_next = ds->stage[1] && ds->stage[1] != ds->stage[0] ? 1 - ds->stage_next : 0;
        MbJob* j = jobs_new(e, ip);
        *j = (MbJob){.e = e, .ds = ds, .from = (int)(blocks ? k * unit : k)};
        j->piece = (Piece){buf, (const char*)p->src + u * src_unit, k * unit, 1, p->src_type};
        jobs_label(e, ip, ds, s, "stage %s", name);
        im->host_fn(ds->d, s, stage_fill_fn, j);
        jobs_label(e, ip, ds, s, "%s", name);
        im->copy_h2d(ds->d, s, (char*)p->dst + u * unit, buf, k * unit);
    }
}

// Elements [from, to) of layer l's slab from iteration parity ip's weights to dst: the frozen
// head from the one base copy, the trainable tail from the parity's master. Returns the copies
// in seg (0 to 2; a quantised head: one per tensor, its blocks to qdst).
static int layer_range_copies(const Engine* e, int ip, int l, int64_t from, int64_t to, char* dst,
                              char* qdst, Piece* seg) {
    const int64_t off = e->train_off[l];
    int n = 0;
    if (from < off && from < to && e->quant)
        n = head_copies(e, l, from, imin64(to, off), dst, qdst, seg);
    else if (from < off && from < to)
        seg[n++] = (Piece){dst, (const char*)e->base[l] + (size_t)from * e->ab,
                           (size_t)(imin64(to, off) - from) * e->ab, 0, 0};
    if (to > off) {
        const int64_t b = from > off ? from : off;
        seg[n++] = (Piece){dst + (size_t)(b - from) * e->ab,
                           (const char*)e->master[ip][l] + (size_t)(b - off) * e->ab,
                           (size_t)(to - b) * e->ab, 0, 0};
    }
    return n;
}

// Where layer l's blocks go in staging slot k (a quantised base): after the stage's shallower
// layers' blocks.
static char* slot_layer_blocks(const Engine* e, const DevState* ds, const Stage* st, int k, int l) {
    if (!e->quant) return NULL;
    size_t off = 0;
    for (int j = st->b; j < l; j++) off += quant_layer_block_bytes(&e->m->tt, j);
    return (char*)ds->qslot[k] + off;
}

// Where layer l of a stage goes in parameter slot k, from iteration parity ip's weights (l ==
// st->e: the copy of the embedding that a stage carrying a tied head holds as its head), as
// copies in seg (layer_range_copies).
static int slot_layer_copies(const Engine* e, const DevState* ds, const Stage* st, int k, int ip,
                             int l, Piece* seg) {
    const TensorTable* tt = &e->m->tt;
    if (l < st->e)
        return layer_range_copies(e, ip, l, 0, tt->param_numel[l],
                                  (char*)ds->pslot[k] + (size_t)st->p_off[l - st->b] * e->ab,
                                  slot_layer_blocks(e, ds, st, k, l), seg);
    if (st->head_off < 0) return 0;
    const int64_t head = tt->t[tensor_table_index(tt, TK_LM_HEAD, -1)].numel;
    return layer_range_copies(e, ip, 0, 0, head,
                              (char*)ds->pslot[k] + (size_t)st->head_off * e->ab, NULL, seg);
}

// ----------------------------------------------------------------------------
// a quantised base: dequantisation on the device (quant.h)

// Compute-stream work: layer `from`'s quantised tensors from the staging slot into the parameter
// slot (MbJob.pslot: the slot, .gslot unused, .to: the staging slot index).
static void dequant_layer_fn(void* arg) {
    const MbJob* j = arg;
    const Engine* e = j->e;
    const TensorTable* tt = &e->m->tt;
    const int l = j->from;
    const char* q = slot_layer_blocks(e, j->ds, j->st, j->to, l);
    char* dst = (char*)j->pslot + (size_t)j->st->p_off[l - j->st->b] * e->ab;
    for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++) {
        const TensorDesc* d = &tt->t[i];
        if (!d->qtype || d->owner_layer != l) continue;
        j->ds->ops->dequantize(j->ds->ctx, dst + (size_t)d->param_offset * e->ab, q, d->qtype,
                               (size_t)d->numel);
        q += quant_tensor_bytes(d, 0);
    }
}

void transfer_params_dequant(Engine* e, DevState* ds, const Stage* st, int k, int64_t t, int gated) {
    if (!e->quant) return;
    const int ip = (int)(t % 2);
    for (int l = st->b; l < st->e; l++) {
        if (quant_layer_block_bytes(&e->m->tt, l) == 0) continue;
        // (the compute stream runs it before the stage's first micro-batch: behind the layer's
        // own upload when gated, the whole stage's otherwise)
        e->impl->stream_wait(ds->d, STREAM_COMPUTE, gated ? ds->lev[k][l - st->b] : ds->param_done);
        MbJob* j = jobs_new(e, ip);
        *j = (MbJob){.e = e, .ds = ds, .st = st, .pslot = ds->pslot[k], .from = l, .to = k, .t = t};
        jobs_label(e, ip, ds, STREAM_COMPUTE, "dequant %s layer %d", st->name, l);
        e->impl->submit(ds->d, STREAM_COMPUTE, dequant_layer_fn, j);
    }
}

// One copy on stream s in pieces of at most PIECE_MAX_BYTES, each labelled `name` in traces.
static void copy_pieces(Engine* e, int ip, DevState* ds, StreamKind s, void* dst, const void* src,
                        size_t bytes, int h2d, const char* name) {
    for (size_t off = 0; off < bytes; off += PIECE_MAX_BYTES) {
        const size_t len = bytes - off < PIECE_MAX_BYTES ? bytes - off : PIECE_MAX_BYTES;
        jobs_label(e, ip, ds, s, "%s", name);
        if (h2d) e->impl->copy_h2d(ds->d, s, (char*)dst + off, (const char*)src + off, len);
        else e->impl->copy_d2h(ds->d, s, (char*)dst + off, (const char*)src + off, len);
    }
}

// Upload a stage's parameters into slot `k` on the parameter stream, split into pieces of at most
// 256 MiB assigned longest-first to the bin with the least load (LPT, docs/ROUNDPIPE.md §4.3); bin
// j waits the j-th activation-upload mark of the stage currently running on this device, so the
// parameter traffic fills the gaps between activation uploads instead of delaying them.
void transfer_params_up(Engine* e, DevState* ds, const Stage* st, int k, int64_t t) {
    const int ip = (int)(t % 2);
    int cap = 16, n = 0;
    Piece* pieces = malloc_check((size_t)cap * sizeof(Piece));
    for (int l = st->b; l <= st->e; l++) {
        Piece seg[LAYER_COPIES_MAX + 1];
        const int n_seg = slot_layer_copies(e, ds, st, k, ip, l, seg);
        for (int c = 0; c < n_seg; c++) {
            if (!seg[c].staged) {
                pieces_add(&pieces, &n, &cap, seg[c].dst, seg[c].src, seg[c].bytes);
                continue;
            }
            // (staged: chunked by upload_piece)
            if (n == cap) pieces = realloc_check(pieces, (size_t)(cap *= 2) * sizeof(Piece));
            pieces[n++] = seg[c];
        }
    }
    int n_bins = ds->n_marks > 0 ? ds->n_marks : 1;
    int* bin_of = malloc_check((size_t)(n ? n : 1) * sizeof(int));
    lpt_assign(pieces, n, n_bins, bin_of);
    const DeviceImpl* im = e->impl;
    im->stream_wait(ds->d, STREAM_PARAM_UP, ds->pslot_free[k]);
    for (int b = 0; b < n_bins; b++) {
        if (ds->n_marks > 0) im->stream_wait(ds->d, STREAM_PARAM_UP, ds->marks[b]);
        char name[40];
        snprintf(name, sizeof name, "params %s [%d]", st->name, b);
        for (int i = 0; i < n; i++)
            if (bin_of[i] == b) upload_piece(e, ip, ds, STREAM_PARAM_UP, &pieces[i], name);
    }
    free(bin_of);
    free(pieces);
}

// Gated upload (the optimizer has not finished iteration t's weights of this stage yet): layer by
// layer, shallowest first as the optimizer writes them, each behind a host fence on the parameter
// stream (protocol_param_fence_fn) and followed by its event lev[k][layer], so the first
// micro-batch's forward of layer l waits for layer l alone and the device starts while the CPU
// step still updates deeper layers. All of it after the running stage's last activation upload
// (no LPT bins: the parameter traffic is behind the optimizer anyway).
void transfer_params_up_gated(Engine* e, DevState* ds, const Stage* st, int k, int64_t t) {
    const int ip = (int)(t % 2);
    const DeviceImpl* im = e->impl;
    im->stream_wait(ds->d, STREAM_PARAM_UP, ds->pslot_free[k]);
    if (ds->n_marks > 0) im->stream_wait(ds->d, STREAM_PARAM_UP, ds->marks[ds->n_marks - 1]);
    for (int l = st->b; l <= st->e; l++) {
        const int owner = l < st->e ? l : 0;  // the tied head is a copy of layer 0's embedding
        Piece seg[LAYER_COPIES_MAX + 1];
        const int n_seg = slot_layer_copies(e, ds, st, k, ip, l, seg);
        if (l == st->e && !n_seg) break;  // no tied head
        if (!protocol_layer_ready(e, owner, t)) {
            MbJob* j = jobs_new(e, ip);
            *j = (MbJob){.e = e, .ds = ds, .st = st, .from = owner, .t = t};
            im->host_fn(ds->d, STREAM_PARAM_UP, protocol_param_fence_fn, j);
        }
        char name[40];
        snprintf(name, sizeof name, "params %s layer %d", st->name, l);
        for (int c = 0; c < n_seg; c++) {
            if (seg[c].staged) upload_piece(e, ip, ds, STREAM_PARAM_UP, &seg[c], name);
            else copy_pieces(e, ip, ds, STREAM_PARAM_UP, seg[c].dst, seg[c].src, seg[c].bytes, 1, name);
        }
        im->event_record(ds->lev[k][l - st->b], ds->d, STREAM_PARAM_UP);
    }
}

// Prepare the gradient slot of a backward stage on the parameter stream: zero in the first round,
// the host's partial fp32 sum in later rounds (waiting for the previous round's download).
void transfer_grads_prepare(Engine* e, DevState* ds, const Stage* st, int k, int round, int64_t t) {
    const int ip = (int)(t % 2);
    const DeviceImpl* im = e->impl;
    const TensorTable* tt = &e->m->tt;
    im->stream_wait(ds->d, STREAM_PARAM_UP, ds->gslot_free[k]);
    if (round == 0 || e->split) {  // (split rounds each start from zero)
        jobs_label(e, ip, ds, STREAM_PARAM_UP, "zero grads %s", st->name);
        im->memset_zero(ds->d, STREAM_PARAM_UP, ds->gslot[k], (size_t)st->grad_numel * sizeof(float));
        return;
    }
    for (int l = st->b; l < st->e; l++) {
        if (tt->grad_numel[l] == 0) continue;  // (LoRA: a frozen prefix or postfix)
        im->stream_wait(ds->d, STREAM_PARAM_UP, e->grad_ev[t % e->n_hgrad][l]);
        jobs_label(e, ip, ds, STREAM_PARAM_UP, "partial grads %s", st->name);
        im->copy_h2d(ds->d, STREAM_PARAM_UP, ds->gslot[k] + st->g_off[l - st->b],
                     e->hgrad[t % e->n_hgrad][l],
                     (size_t)tt->grad_numel[l] * sizeof(float));
    }
}

// ----------------------------------------------------------------------------
// activation hand-offs (docs/ROUNDPIPE.md §4.2): host buffers between stages, per micro-batch

// Activation upload of micro-batch i (the r-th of its round: device parity r % 2) of stage st,
// on the high-priority stream: the tokens (prefix) or the stage's input boundary, the targets
// (fused stage), and for a backward stage the incoming gradient (with layer-grain recompute every
// block's checkpoint before it). It waits for the parity's previous compute and download, and
// for each host buffer's producer (x_ev, dx_ev); records up_done[p] and the LPT mark r.
void transfer_acts_up(Engine* e, DevState* ds, const Stage* st, int i, int r, int64_t t) {
    const DeviceImpl* im = e->impl;
    Device* d = ds->d;
    const int p = r % 2, ip = (int)(t % 2);
    void** xs = ds->xs[p];
    const int Bi = mb_rows(e, i);
    const size_t x_bytes = (size_t)Bi * e->T * e->C * e->ab;
    const size_t tok_bytes = (size_t)Bi * e->T * sizeof(int32_t);
    im->stream_wait(d, STREAM_ACT_UP, ds->comp_done[p]);
    im->stream_wait(d, STREAM_ACT_UP, ds->down_done[p]);
    jobs_label(e, ip, ds, STREAM_ACT_UP, "up %s mb%d", st->name, i);
    if (st->b == 0) {
        im->copy_h2d(d, STREAM_ACT_UP, ds->ids[p], e->hids[ip][i], tok_bytes);
    } else {
        im->stream_wait(d, STREAM_ACT_UP, e->x_ev[st->b][i]);
        im->copy_h2d(d, STREAM_ACT_UP, xs[0], e->hx[ip][st->b][i], x_bytes);
        if (e->x_free) im->event_record(e->x_free[st->b][i], d, STREAM_ACT_UP);
    }
    if (st->kind == SLOT_FUSED)
        im->copy_h2d(d, STREAM_ACT_UP, ds->targets[p], e->htgt[ip][i], tok_bytes);
    // the policy objective's per-token inputs (four runs: old, ref, adv, weight)
    if (st->kind == SLOT_FUSED && e->pol_on[ip])
        im->copy_h2d(d, STREAM_ACT_UP, ds->pol[p], e->hpol[ip][i],
                     4 * e->pol_stride * sizeof(float));
    // MoE: the aux statistics rows of the forward stages' blocks, which the fused stage's aux loss
    // needs (each forward stage downloaded its rows before recording its output boundary's x_ev,
    // so the x_ev wait above covers them all)
    const int n_moe = e->m->n_moe, E = e->m->cfg.E;
    const int moe_lo = n_moe > 0 ? engine_moe_row(e, st->b) : 0;
    if (st->kind == SLOT_FUSED && moe_lo > 0)
        im->copy_h2d(d, STREAM_ACT_UP, ds->moe[p], e->hmoe[ip][i],
                     (size_t)moe_lo * 2 * E * sizeof(float));
    if (st->kind == SLOT_BWD) {
        if (e->opt.grain == RECOMPUTE_LAYER) {
            for (int l = imax(st->b, 1); l < st->e; l++) {
                if (l == st->b) continue;  // already uploaded as the stage input
                im->stream_wait(d, STREAM_ACT_UP, e->x_ev[l][i]);
                im->copy_h2d(d, STREAM_ACT_UP, xs[l - st->b], e->hx[ip][l][i], x_bytes);
                if (e->x_free) im->event_record(e->x_free[l][i], d, STREAM_ACT_UP);
            }
        }
        im->stream_wait(d, STREAM_ACT_UP, e->dx_ev[st->e][i]);
        im->copy_h2d(d, STREAM_ACT_UP, ds->dres[p], e->hdx[ip][st->e][i], x_bytes);
        if (e->dx_free) im->event_record(e->dx_free[st->e][i], d, STREAM_ACT_UP);
        // MoE: the micro-batch's summed counts for the blocks' aux gradient (the fused stage
        // downloaded them before recording its dx_ev, which this stage's dx_ev wait follows)
        if (n_moe > 0 && engine_moe_row(e, st->e) > moe_lo)
            im->copy_h2d(d, STREAM_ACT_UP, ds->moe[p] + (size_t)n_moe * 2 * E,
                         e->hmoe[ip][i] + (size_t)n_moe * 2 * E, (size_t)E * sizeof(float));
    }
    im->event_record(ds->up_done[p], d, STREAM_ACT_UP);
    im->event_record(ds->marks[r], d, STREAM_ACT_UP);
}

// Activation download of micro-batch i after its compute: a forward stage's boundaries that a
// later stage reads (x_ev), the fused stage's losses (loss_ev), a backward stage's outgoing
// gradient (dx_ev). With one host set each waits for the previous iteration's last reader of its
// buffer (x_free, dx_free). Records down_done[p].
void transfer_acts_down(Engine* e, DevState* ds, const Stage* st, int i, int r, int64_t t) {
    const DeviceImpl* im = e->impl;
    Device* d = ds->d;
    const int p = r % 2, ip = (int)(t % 2);
    const int n = st->e - st->b;
    void** xs = ds->xs[p];
    const int Bi = mb_rows(e, i);
    const size_t x_bytes = (size_t)Bi * e->T * e->C * e->ab;
    im->stream_wait(d, STREAM_ACT_DOWN, ds->comp_done[p]);
    // MoE: a forward stage's blocks' aux statistics rows, before its boundaries' x_ev (which the
    // fused stage's upload waits for); the fused stage's rows and the counts (the tail of the
    // buffer), before its loss_ev (engine_collect's aux) and dx_ev (the backward stages' counts)
    const int n_moe = e->m->n_moe, E = e->m->cfg.E;
    if (n_moe > 0 && st->kind != SLOT_BWD) {
        const int lo = engine_moe_row(e, st->b);
        const size_t end = st->kind == SLOT_FWD ? (size_t)engine_moe_row(e, st->e) * 2 * E
                                                : (size_t)e->moe_floats;
        const size_t from = (size_t)lo * 2 * E;
        if (end > from) {
            jobs_label(e, ip, ds, STREAM_ACT_DOWN, "down %s mb%d moe stats", st->name, i);
            im->copy_d2h(d, STREAM_ACT_DOWN, e->hmoe[ip][i] + from, ds->moe[p] + from,
                         (end - from) * sizeof(float));
        }
    }
    if (st->kind == SLOT_FWD) {
        for (int k = 1; k <= n; k++) {
            int bnd = st->b + k;
            if (!e->need_x[bnd]) continue;
            jobs_label(e, ip, ds, STREAM_ACT_DOWN, "down %s mb%d x%d", st->name, i, bnd);
            // one host set: the previous iteration's last reader of this buffer (the latest
            // consumer enqueued, causally the last) must be done with it
            if (e->x_free) im->stream_wait(d, STREAM_ACT_DOWN, e->x_free[bnd][i]);
            im->copy_d2h(d, STREAM_ACT_DOWN, e->hx[ip][bnd][i], xs[k], x_bytes);
            im->event_record(e->x_ev[bnd][i], d, STREAM_ACT_DOWN);
        }
    } else {
        if (st->kind == SLOT_FUSED) {
            im->copy_d2h(d, STREAM_ACT_DOWN, e->hloss[ip][i], ds->losses[p],
                         (size_t)Bi * e->T * sizeof(float));
            if (e->pol_on[ip])  // the log-probs (the fifth run)
                im->copy_d2h(d, STREAM_ACT_DOWN, e->hpol[ip][i] + 4 * e->pol_stride,
                             ds->pol[p] + 4 * e->pol_stride, (size_t)Bi * e->T * sizeof(float));
            im->event_record(e->loss_ev[ip][i], d, STREAM_ACT_DOWN);
        }
        if (st->b > 0) {
            jobs_label(e, ip, ds, STREAM_ACT_DOWN, "down %s mb%d dx%d", st->name, i, st->b);
            // one host set: the previous iteration's last reader of this ring slot
            if (e->dx_free) im->stream_wait(d, STREAM_ACT_DOWN, e->dx_free[e->dx_last[st->b]][i]);
            im->copy_d2h(d, STREAM_ACT_DOWN, e->hdx[ip][st->b][i], ds->dres[p], x_bytes);
            im->event_record(e->dx_ev[st->b][i], d, STREAM_ACT_DOWN);
        }
    }
    im->event_record(ds->down_done[p], d, STREAM_ACT_DOWN);
}

// ----------------------------------------------------------------------------
// gradient downloads (docs/ROUNDPIPE.md §4.4): a backward stage's gradients are complete after its
// last micro-batch; they are downloaded in LPT chunks during the activation windows of the next
// stage on the same device (bin j after that stage's micro-batch j has been downloaded), on the
// gradient stream, so bulk gradient traffic never sits in front of an activation transfer.

void transfer_grads_defer(Engine* e, DevState* ds, const Stage* st, int gk, int64_t t, int round) {
    const TensorTable* tt = &e->m->tt;
    PendingGrads* pg = &ds->pend;
    int cap = 16, n = 0;
    Piece* pieces = malloc_check((size_t)cap * sizeof(Piece));
    for (int l = st->b; l < st->e; l++)
        pieces_add(&pieces, &n, &cap, e->hgrad[t % e->n_hgrad][l],
                   ds->gslot[gk] + st->g_off[l - st->b],
                   (size_t)tt->grad_numel[l] * sizeof(float));
    pg->active = 1;
    pg->st = st;
    pg->gk = gk;
    pg->t = t;
    pg->final_round = round == e->R - 1;
    pg->pieces = pieces;
    pg->n_pieces = n;
    pg->n_bins = e->M_R;
    pg->bin_of = malloc_check((size_t)(n ? n : 1) * sizeof(int));
    lpt_assign(pieces, n, pg->n_bins, pg->bin_of);
    pg->next_bin = 0;
    pg->fenced = 0;
    e->impl->event_record(ds->grads_ready, ds->d, STREAM_COMPUTE);
}

// A stage's gradient download is enqueued: its slot is free once it is done, and after the final
// round the optimizer's step may wait for the layers' download events.
void transfer_grads_done(Engine* e, DevState* ds, const Stage* st, int gk, int64_t t,
                         int final_round) {
    e->impl->event_record(ds->gslot_free[gk], ds->d, STREAM_GRAD_DOWN);
    if (final_round) protocol_grads_recorded(e, st, t);
}

// Enqueue the next bin of the pending download (the caller has made the gradient stream wait for
// the window it belongs to), or every remaining bin when all != 0; finish when the last is out.
void transfer_grads_issue(Engine* e, DevState* ds, int all) {
    PendingGrads* pg = &ds->pend;
    if (!pg->active) return;
    const DeviceImpl* im = e->impl;
    const int ip = (int)(pg->t % 2);
    if (!pg->fenced) {
        // rule 4: the host buffers still hold the previous iteration's gradients until the
        // optimizer has consumed them
        protocol_fence_grads(e, pg->st, pg->t);
        im->stream_wait(ds->d, STREAM_GRAD_DOWN, ds->grads_ready);
        pg->fenced = 1;
    }
    do {
        int b = pg->next_bin++;
        for (int i = 0; i < pg->n_pieces; i++)
            if (pg->bin_of[i] == b) {
                jobs_label(e, ip, ds, STREAM_GRAD_DOWN, "grads %s [%d]", pg->st->name, b);
                im->copy_d2h(ds->d, STREAM_GRAD_DOWN, pg->pieces[i].dst, pg->pieces[i].src,
                             pg->pieces[i].bytes);
            }
    } while (all && pg->next_bin < pg->n_bins);
    if (pg->next_bin < pg->n_bins) return;
    const Stage* st = pg->st;
    for (int l = st->b; l < st->e; l++)
        im->event_record(e->grad_ev[pg->t % e->n_hgrad][l], ds->d, STREAM_GRAD_DOWN);
    transfer_grads_done(e, ds, st, pg->gk, pg->t, pg->final_round);
    free(pg->pieces);
    free(pg->bin_of);
    memset(pg, 0, sizeof *pg);
}

// Per-layer downloads (a stage whose gradients would otherwise go down only at the round's end,
// after its last micro-batch): layer l's final gradients go down as soon as the last micro-batch's
// backward has passed it (gev[l - b], recorded by the caller on the compute stream), so the
// optimizer's wait for the last layer ends right after the backward.
// folded: the tied tensors' gradients were folded into their owners' on the device, so the host
// needs none of them (a tied head is the largest tensor: 1.2 GB for Qwen3-1.7B) and they stay.
void transfer_grads_layer_down(Engine* e, DevState* ds, const Stage* st, int gk, int l, int64_t t,
                               int round, int folded) {
    const TensorTable* tt = &e->m->tt;
    const DeviceImpl* im = e->impl;
    const int ip = (int)(t % 2);
    char name[40];
    snprintf(name, sizeof name, "grads %s layer %d", st->name, l);
    im->stream_wait(ds->d, STREAM_GRAD_DOWN, ds->gev[l - st->b]);
    float* dst = engine_grad_host(e, t, round, l);
    const float* src = ds->gslot[gk] + st->g_off[l - st->b];
    // the layer's gradient in runs between its tied tensors (all of it when nothing is skipped)
    int64_t from = 0;
    for (;;) {
        int64_t to = tt->grad_numel[l], next = to;
        for (int i = 0; folded && i < tt->n; i++) {
            const TensorDesc* d = &tt->t[i];
            if (d->layer == l && d->tied_to >= 0 && d->numel > 0 && d->grad_offset >= from &&
                d->grad_offset < to) {
                to = d->grad_offset;
                next = d->grad_offset + d->numel;
            }
        }
        if (to > from)
            copy_pieces(e, ip, ds, STREAM_GRAD_DOWN, dst + from, src + from,
                        (size_t)(to - from) * sizeof(float), 0, name);
        if (next >= tt->grad_numel[l]) break;
        from = next;
    }
    im->event_record(engine_grad_event(e, t, round, l), ds->d, STREAM_GRAD_DOWN);
}

// Round boundaries: the next round's gradient preparation and the optimizer read these buffers,
// so nothing may stay deferred past a round.
void transfer_grads_flush_all(Engine* e) {
    for (int g = 0; g < e->N; g++) transfer_grads_issue(e, &e->dev[g], 1);
}
