#!/usr/bin/env bash
# scripts/check_grpo_two_gpus.sh — GRPO's two-GPU schedules against the colocated run, on a
# machine with two GPUs (docs/DISTRIBUTED.md §9): the same short GRPO run (the default tiny
# byte-level model, the arithmetic task, 8 prompts x 8 answers) six ways:
#   colocated          ./train_roundpipe --device cuda:1 (generate, then train, on GPU 0)
#   split              --device cuda:2 --rollout-gpus 1 (GPU 0 trains, GPU 1 generates)
#   rollout ranks      scripts/launch_local.sh 2 ... --rl-rollout-ranks 1 (rank 0 trains on GPU 0,
#                      rank 1 generates on GPU 1; the batches, answers and weights over NCCL)
# each on-policy and one step off (--off-policy 1). The split and rank runs must log the
# colocated run's losses, rewards, ratios and answer lengths step for step (on-policy against
# the colocated on-policy run, one step off against the colocated one-step-off run: the same
# math). Prints the rank run's weight broadcast lines (MB, ms, GB/s).
#
#   scripts/check_grpo_two_gpus.sh [EXTRA FLAGS...]
#   Environment: STEPS (6), OUTDIR (out/grpo_two_gpus), MASTER_PORT (29533; given only to the
#   launched runs).
# Exit status 0 when every run agrees with its colocated twin, 1 otherwise.
set -uo pipefail
STEPS=${STEPS:-6}
OUTDIR=${OUTDIR:-out/grpo_two_gpus}
PORT=${MASTER_PORT:-29533}
mkdir -p "$OUTDIR"
n_gpus=$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)
[ "$n_gpus" -ge 2 ] || { echo "check_grpo_two_gpus.sh: needs two GPUs ($n_gpus visible)" >&2; exit 1; }
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
F=(--rl grpo --rl-task arith --reward arith --rl-prompts 8 --rl-group 8 --batch 64 --seq 12
   --rl-max-tokens 4 --rl-eval 30 --temperature 1 --lr 5e-5 --warmup 3 --schedule constant
   --steps "$STEPS" --sample-tokens 0 "$@")
clean_env=(env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK
           -u LOCAL_WORLD_SIZE -u SLURM_PROCID -u SLURM_NTASKS -u SLURM_LOCALID)

# run NAME FLAGS...: one process; fails the script when it does
run() {
    local name=$1
    shift
    "${clean_env[@]}" ./train_roundpipe "${F[@]}" "$@" --log "$OUTDIR/$name.jsonl" \
        > "$OUTDIR/$name.out" 2>&1 || { echo "$name failed: $OUTDIR/$name.out"; exit 1; }
}

# same A B: the step records' loss, reward, ratio, answer length and version equal
same() {
    python3 - "$OUTDIR/$1.jsonl" "$OUTDIR/$2.jsonl" <<'PY'
import json, sys
keys = ("loss", "reward", "ratio", "answer_len", "version", "staleness")
def steps(p):
    return [tuple([s["step"]] + [s.get(k) for k in keys])
            for s in map(json.loads, open(p)) if "step" in s and "loss" in s]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
for x, y in zip(a, b):
    print(f"  step {x[0]}: {x[1:]!r} | {y[1:]!r}")
sys.exit(0 if a == b and len(a) > 0 else 1)
PY
}

status=0
for off in 0 1; do
    run "colocated_off$off" --device cuda:1 --off-policy "$off"
    run "split_off$off" --device cuda:2 --rollout-gpus 1 --off-policy "$off"
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=$PORT \
        scripts/launch_local.sh 2 "${F[@]}" --device cuda:1 --rl-rollout-ranks 1 \
        --off-policy "$off" --log "$OUTDIR/ranks_off$off.jsonl" > "$OUTDIR/ranks_off$off.out" 2>&1 ||
        { echo "ranks_off$off failed: $OUTDIR/ranks_off$off.out"; exit 1; }
    grep -q "rollout rank 1 of 2" "$OUTDIR/ranks_off$off.out" ||
        { echo "off-policy $off: rank 1 did not serve rollouts"; status=1; }
    grep "broadcast to 1 rollout rank" "$OUTDIR/ranks_off$off.out" | tail -2
    for twin in split ranks; do
        echo "off-policy $off: $twin vs colocated"
        if same "colocated_off$off" "${twin}_off$off"; then
            echo "off-policy $off, $twin: identical"
        else
            echo "off-policy $off, $twin: DIFFERENT"
            status=1
        fi
    done
done
exit $status
