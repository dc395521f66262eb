#!/usr/bin/env python3
"""
dev/cuda/attention_fwd_ws_model.py -- a random-interleaving model of the synchronisation
protocol of the wgmma forward in kernels/attention_wgmma.cuh (producer warpgroup + two consumer
warpgroups, mbarrier rings for K and V, ping-pong named barriers). The kernel ships with PP on
and WF off; the model keeps both switches (variants the lab measured). Each role is the kernel's program
order as a generator of actions; a scheduler runs one runnable action at a time, chosen at
random, and lands cp.async copies and completes wgmma groups at random moments.

Checked on every run:
  - no deadlock (every role finishes), for n_tiles 1..9, rings (2,2), (2,3), (3,3), (3,2), PP
    on/off, WF on/off (WF: copy n-1 published by the producer itself after issuing copy n and
    waiting for n-1 to land; without WF the hardware arrives when a copy and all earlier ones
    landed);
  - S_j reads a K stage holding tile j, fully landed; P_{j-1} V_{j-1} a V stage holding tile j-1;
  - no copy is issued into a stage while a wgmma that reads it is still running;
  - every arrival on a full barrier belongs to the tile of the barrier's current phase, and every
    arrival on an empty barrier to the tile being released (no phase is skipped or aliased);
  - the try_wait.parity rule: a wait with parity P passes iff the barrier's phase count has
    parity != P (the phase of parity P completed), which is what the hardware does;
  - named barriers (count 256 = two warpgroups): never more than two warpgroup arrivals in one
    generation, none pending at exit; with PP, the issue phases strictly alternate WG0, WG1;
  - mutations: dropping the pre-loop arrive deadlocks, dropping the post-loop sync leaves a
    barrier half-complete, a wrong empty-wait parity lets a copy overwrite a live stage, and
    releasing V one step early lets a copy hit a running P V product, and (WF) publishing a copy
    without waiting for it lets a wgmma read a stage that has not landed (all detected).
Run: python3 dev/cuda/attention_fwd_ws_model.py  (prints a summary, exit 0 when all pass)
"""
import random
import sys


class ModelError(Exception):
    pass


class MBar:
    def __init__(self, name, count):
        self.name, self.count, self.phase, self.arrived, self.tag = name, count, 0, 0, None

    def arrive(self, tag):
        if self.arrived and self.tag != tag:
            raise ModelError(f"{self.name}: arrival for {tag} mixed into phase of {self.tag}")
        self.tag = tag
        self.arrived += 1
        if self.arrived == self.count:
            self.phase += 1
            self.arrived, self.tag = 0, None

    def passed(self, parity):  # mbarrier.try_wait.parity
        return (self.phase & 1) != parity


class NamedBar:  # bar.sync / bar.arrive with count 256 = two warpgroup units
    def __init__(self, name):
        self.name, self.units, self.gen, self.who = name, 0, 0, []

    def arrive(self, wg):
        if wg in self.who:
            raise ModelError(f"{self.name}: warpgroup {wg} arrived twice in one generation")
        self.who.append(wg)
        self.units += 1
        if self.units == 2:
            self.units, self.who = 0, []
            self.gen += 1


def run(n_tiles, SK, SV, PP, rng, mutate=None, WF=False):
    mb_q = MBar("full_q", 1)
    full_k = [MBar(f"full_k{s}", 1) for s in range(SK)]
    empty_k = [MBar(f"empty_k{s}", 8) for s in range(SK)]
    full_v = [MBar(f"full_v{s}", 1) for s in range(SV)]
    empty_v = [MBar(f"empty_v{s}", 8) for s in range(SV)]
    nbar = {1: NamedBar("bar1"), 2: NamedBar("bar2")}
    stage = {("K", s): None for s in range(SK)}
    stage.update({("V", s): None for s in range(SV)})  # (tile, landed)
    loads = []            # issue order: dicts {mat, stage, tile, landed, arrived, bar}
    groups = {0: [], 1: []}  # per warpgroup: committed wgmma groups [{reads, done}]
    issue_log = []

    def producer():
        def load(mat, u):
            S = SK if mat == "K" else SV
            s = u % S
            empty = (empty_k if mat == "K" else empty_v)[s]
            if u >= S:
                par = ((u // S) & 1) ^ 1
                if mutate == "bad_empty_parity":
                    par ^= 1
                yield ("wait", empty, par)
            # a copy may not start while a wgmma still reads this stage
            for w in (0, 1):
                for g in groups[w]:
                    if not g["done"] and (mat, s) in g["reads"]:
                        raise ModelError(f"copy of {mat}{u} into stage {s} while a wgmma reads it")
            stage[(mat, s)] = [u, False]
            loads.append({"mat": mat, "stage": s, "tile": u, "landed": False, "arrived": WF,
                          "bar": (full_k if mat == "K" else full_v)[s]})
            yield ("step",)
            if WF:  # wait_group 1: the previous copy landed; fence; release-arrive on its barrier
                yield from publish(len(loads) - 2)

        def publish(i):
            if mutate != "wf_no_wait":
                yield ("landed", i)
            l = loads[i]
            l["bar"].arrive(("load", l["mat"], l["tile"]))
            yield ("step",)

        stage[("Q", 0)] = [0, False]
        loads.append({"mat": "Q", "stage": 0, "tile": 0, "landed": False, "arrived": WF,
                      "bar": mb_q})
        yield ("step",)
        yield from load("K", 0)
        for t in range(n_tiles):
            if t + 1 < n_tiles:
                yield from load("K", t + 1)
            yield from load("V", t)
        if WF:
            yield from publish(len(loads) - 1)

    def consumer(w):
        my, other = 1 + w, 2 - w

        def wait_group(n):
            yield ("wgwait", w, n)

        def issue(kind, j):
            if kind == "S":
                st = stage[("K", j % SK)]
                if st is None or st[0] != j or not st[1]:
                    raise ModelError(f"WG{w} S_{j}: K stage {j % SK} holds {st}")
                reads = {("K", j % SK)}
            else:
                st = stage[("V", j % SV)]
                if st is None or st[0] != j or not st[1]:
                    raise ModelError(f"WG{w} PV_{j}: V stage {j % SV} holds {st}")
                reads = {("V", j % SV)}
            if stage[("Q", 0)] is None or not stage[("Q", 0)][1]:
                raise ModelError("Q not landed")
            groups[w].append({"reads": reads, "done": False})

        def release(bars, idx, tile, pred=True):
            if pred:
                for _ in range(4):  # lane 0 of each of the warpgroup's 4 warps
                    bars[idx].arrive(("rel", tile))
            yield ("step",)

        if PP and w == 1 and mutate != "no_pre_arrive":
            nbar[1].arrive(1)
            yield ("step",)
        yield ("wait", mb_q, 0)
        yield ("wait", full_k[0], 0)
        if PP:
            yield ("barsync", my, w)
        issue("S", 0)
        issue_log.append(w)
        if PP:
            nbar[other].arrive(w)
        yield ("step",)
        yield from wait_group(0)
        yield from release(empty_k, 0, 0)
        for j in range(1, n_tiles):
            yield from wait_group(0)
            early = 1 if mutate == "early_v_release" else 2
            if j >= early:
                yield from release(empty_v, (j - early) % SV, j - early)
            yield ("wait", full_k[j % SK], (j // SK) & 1)
            yield ("wait", full_v[(j - 1) % SV], ((j - 1) // SV) & 1)
            if PP:
                yield ("barsync", my, w)
            issue("S", j)
            issue("V", j - 1)
            issue_log.append(w)
            if PP:
                nbar[other].arrive(w)
            yield ("step",)
            yield from wait_group(1)
            yield from release(empty_k, j % SK, j)
        yield from wait_group(0)
        if n_tiles >= 2:
            yield from release(empty_v, (n_tiles - 2) % SV, n_tiles - 2)
        yield ("wait", full_v[(n_tiles - 1) % SV], ((n_tiles - 1) // SV) & 1)
        if PP:
            yield ("barsync", my, w)
        issue("V", n_tiles - 1)
        issue_log.append(w)
        if PP:
            nbar[other].arrive(w)
        yield ("step",)
        yield from wait_group(0)
        if PP and w == 0 and mutate != "no_post_sync":
            yield ("barsync", 1, w)

    roles = {"P": producer(), 0: consumer(0), 1: consumer(1)}
    pending = {r: None for r in roles}  # blocked action per role
    barsync_gen = {}  # (role) -> generation of the named barrier we arrived in
    done = set()

    def runnable(r):
        a = pending[r]
        if a is None:
            return True
        if a[0] == "wait":
            return a[1].passed(a[2])
        if a[0] == "wgwait":
            w, n = a[1], a[2]
            return sum(not g["done"] for g in groups[w]) <= n
        if a[0] == "barsync":
            return nbar[a[1]].gen > barsync_gen[r]
        if a[0] == "landed":  # cp.async.wait_group: this copy (and the earlier ones) landed
            return all(l["landed"] for l in loads[:a[1] + 1])
        return True

    steps = 0
    while len(done) < 3:
        steps += 1
        if steps > 200000:
            raise ModelError("no progress (livelock?)")
        choices = [("role", r) for r in roles if r not in done and runnable(r)]
        choices += [("land", i) for i, l in enumerate(loads) if not l["landed"]]
        for w in (0, 1):
            for i, g in enumerate(groups[w]):
                if not g["done"]:
                    choices.append(("wgmma", w, i))  # in order: only the oldest
                    break
        if not choices:
            blocked = {r: pending[r] for r in roles if r not in done}
            raise ModelError(f"deadlock: {blocked}")
        c = rng.choice(choices)
        if c[0] == "land":
            l = loads[c[1]]
            l["landed"] = True
            key = (l["mat"], l["stage"])
            if stage[key] is not None and stage[key][0] == l["tile"]:
                stage[key][1] = True
            # cp.async.mbarrier.arrive.noinc: fires once this and every earlier copy landed
            for l2 in loads:
                if not l2["landed"]:
                    break
                if not l2["arrived"]:
                    l2["arrived"] = True
                    l2["bar"].arrive(("load", l2["mat"], l2["tile"]))
            continue
        if c[0] == "wgmma":
            groups[c[1]][c[2]]["done"] = True
            continue
        r = c[1]
        pending[r] = None
        try:
            a = next(roles[r])
        except StopIteration:
            done.add(r)
            continue
        if a[0] == "barsync":
            bar = nbar[a[1]]
            barsync_gen[r] = bar.gen
            bar.arrive(a[2])
            if bar.gen > barsync_gen[r]:
                continue  # completed by this arrival
        if a[0] in ("wait", "wgwait", "barsync", "landed"):
            pending[r] = a
    # exit state
    for b in nbar.values():
        if b.units:
            raise ModelError(f"{b.name} half-complete at exit ({b.who})")
    if PP:
        for k in range(0, len(issue_log) - 1, 2):
            if issue_log[k:k + 2] != [0, 1]:
                raise ModelError(f"issue order not alternating: {issue_log}")
    # full barriers: each completed once per tile of the stage
    for S, bars in ((SK, full_k), (SV, full_v)):
        for s, b in enumerate(bars):
            expect = len(range(s, n_tiles, S))
            if b.phase != expect:
                raise ModelError(f"{b.name}: {b.phase} phases, expected {expect}")
    return True


def main():
    rng = random.Random(1234)
    configs = [(2, 2), (2, 3), (3, 3), (3, 2)]
    runs = 0
    for SK, SV in configs:
        for PP in (False, True):
            for WF in (False, True):
                for n in range(1, 10):
                    for _ in range(150):
                        run(n, SK, SV, PP, rng, WF=WF)
                        runs += 1
    print(f"protocol model: {runs} random interleavings, rings {configs}, PP off/on, "
          f"WF off/on, n_tiles 1..9: all pass")
    # mutations must be caught
    ok = True
    for mutate, PP, WF in (("no_pre_arrive", True, False), ("no_post_sync", True, False),
                           ("bad_empty_parity", False, False), ("early_v_release", False, False),
                           ("wf_no_wait", True, True)):
        caught = 0
        for trial in range(400):
            try:
                run(6, 3, 3, PP, rng, mutate, WF)
            except ModelError:
                caught += 1
        print(f"  mutation {mutate:17s}: caught in {caught}/400 runs")
        ok = ok and caught > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
