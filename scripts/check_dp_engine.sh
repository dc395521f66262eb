#!/usr/bin/env bash
# scripts/check_dp_engine.sh — data parallel through the engine on one GPU (docs/DISTRIBUTED.md
# §6): the same run twice, once plain (./train_roundpipe) and once as a world of one rank
# started by scripts/launch_local.sh, which opens the NCCL communicator on GPU 0 and takes every
# collective of the engine's step through NCCL (the weights' check, the per-layer reduce-scatter,
# the norm's parts and the loss, the all-gather of the updated weights, the gather for the
# checkpoint). With one rank the step is the engine's own: the loss lines must be identical, in
# sync mode and with the delayed update.
#
#   scripts/check_dp_engine.sh [EXTRA FLAGS...]
#   e.g. MODEL=qwen3-30b-a3b LAYERS=2 scripts/check_dp_engine.sh     (mixture of experts)
#        scripts/check_dp_engine.sh --lora-r 16                        (LoRA adapters)
#   Environment: MODEL (default qwen3-1.7b), LAYERS (4), STEPS (10), OUTDIR (out/dp_engine),
#   MASTER_PORT (29531; given only to the launched run: the plain run must not see half of a
#   rendezvous, it refuses MASTER_PORT without MASTER_ADDR, and runs with the distributed
#   variables of the caller's environment removed).
# Exit status 0 when every pair of runs agrees, 1 otherwise.
set -uo pipefail
MODEL=${MODEL:-qwen3-1.7b}
LAYERS=${LAYERS:-4}
STEPS=${STEPS:-10}
OUTDIR=${OUTDIR:-out/dp_engine}
PORT=${MASTER_PORT:-29531}
mkdir -p "$OUTDIR"
shard="$OUTDIR/random_151936.bin"
[ -f "$shard" ] || python3 scripts/make_random_shard.py "$shard" --vocab 151936 \
    --tokens $(((STEPS + 2) * 8 * 513)) || exit 1
status=0
for sync in 1 0; do
    flags=(--model "$MODEL" --layers "$LAYERS" --device cuda:1 --train "$shard" --val ''
           --batch 8 --seq 512 --micro-batches 4 --steps "$STEPS" --warmup 2 --sync "$sync"
           --sample-tokens 0 --save-every 5 "$@")
    rm -rf "$OUTDIR/alone$sync" "$OUTDIR/rank$sync"
    env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE \
        -u SLURM_PROCID -u SLURM_NTASKS -u SLURM_LOCALID \
        ./train_roundpipe "${flags[@]}" --out "$OUTDIR/alone$sync" \
        --log "$OUTDIR/alone$sync.jsonl" > "$OUTDIR/alone$sync.out" 2>&1 ||
        { echo "plain run failed: $OUTDIR/alone$sync.out"; exit 1; }
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=$PORT \
        scripts/launch_local.sh 1 "${flags[@]}" --out "$OUTDIR/rank$sync" \
        --log "$OUTDIR/rank$sync.jsonl" > "$OUTDIR/rank$sync.out" 2>&1 ||
        { echo "one-rank run failed: $OUTDIR/rank$sync.out"; exit 1; }
    grep -q "data parallel: rank 0 of 1 (NCCL" "$OUTDIR/rank$sync.out" ||
        { echo "sync $sync: the launched run did not open the NCCL communicator"; status=1; }
    if python3 - "$OUTDIR/alone$sync.jsonl" "$OUTDIR/rank$sync.jsonl" <<'PY'
import json, sys
def losses(p):
    return [(s["step"], s["loss"], s.get("norm")) for s in map(json.loads, open(p)) if "loss" in s and "step" in s]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
for x, y in zip(a, b):
    print(f"step {x[0]}: alone loss {x[1]!r} norm {x[2]!r} | one NCCL rank loss {y[1]!r} norm {y[2]!r}")
sys.exit(0 if a == b and len(a) > 0 else 1)
PY
    then echo "sync $sync: identical"; else echo "sync $sync: DIFFERENT"; status=1; fi
done
exit $status
