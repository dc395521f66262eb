#!/usr/bin/env bash
# scripts/bench_grpo.sh — the speed rows of GRPO on one GPU (colocated: generate, then train).
#
# Random weights of a preset (default Qwen3-1.7B), PROMPTS x GROUP answers (8 x 16 = 128
# sequences decoded at once) of exactly TOKENS generated tokens each (--rl-ignore-eos 1: no early
# stop), random rewards from a reward command (so no group is skipped and every answer trains),
# the policy loss in micro-batches of BATCH sequences, STEPS GRPO steps of which the first WARMUP
# are not counted. From the trainer's JSON-lines log, per timed step: decode tokens/s (the decode
# steps alone), the step's time split into rollout (prefill, decode, rewards), train (the policy
# loss through the RoundPipe engine: bf16 weights streamed up, its forward/backward in micro-batches
# of BATCH rows, fp32 gradients down, AdamW on the host; EXTRA="--sync 1" for the synchronous
# update) and sync (the new weights into the generator's buffer: the engine's bf16 masters with
# --sync 1, else the Store's fp32 weights converted on the upload), and the sync's GB/s. On a
# machine with several GPUs --device cuda uses them all: CUDA_VISIBLE_DEVICES=0 for one.
# Prints one table and appends it, with the machine and the date, to docs/PERF.md.
#
#   scripts/bench_grpo.sh
#   MODEL=qwen3-0.6b TOKENS=256 scripts/bench_grpo.sh
#   EXTRA="--profile-ops" STEPS=2 WARMUP=1 scripts/bench_grpo.sh   (per-op device times)
#
# Variables: MODEL (qwen3-1.7b), PROMPTS (8), GROUP (16), TOKENS (512), BATCH (32), STEPS (4),
# WARMUP (1), EXTRA, OUTDIR (out/bench), COMMIT (named in the output; default git's),
# NO_PERF_MD=1 to leave docs/PERF.md alone, SKIP_BUILD=1 to use the binary as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-qwen3-1.7b}
PROMPTS=${PROMPTS:-8}
GROUP=${GROUP:-16}
TOKENS=${TOKENS:-512}
BATCH=${BATCH:-32}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-1}
EXTRA=${EXTRA:-}
OUTDIR=${OUTDIR:-out/bench}
mkdir -p "$OUTDIR"
[ "$STEPS" -gt "$WARMUP" ] || { echo "bench_grpo.sh: STEPS must exceed WARMUP" >&2; exit 2; }

[ "${SKIP_BUILD:-0}" = 1 ] || make -j"$(nproc)" train_roundpipe >/dev/null
visible=$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)
[ "$visible" -gt 0 ] || { echo "bench_grpo.sh: no GPU visible" >&2; exit 1; }

# the prompts are short arithmetic problems read as byte ids (at most 16 tokens): the sequence
# holds them and the answer
SEQ=$((TOKENS + 16))
tag="grpo_${MODEL}_${PROMPTS}x${GROUP}_${TOKENS}"
log="$OUTDIR/$tag.jsonl"
rm -f "$log"
# one uniform reward per answer line, answered line by line (the trainer waits for each batch)
REWARD="python3 -u -c 'import sys, random; [print(random.random(), flush=True) for _ in sys.stdin]'"
if ! ./train_roundpipe --model "$MODEL" --device cuda --val '' --sample-tokens 0 \
    --rl grpo --rl-ignore-eos 1 --rl-prompts "$PROMPTS" --rl-group "$GROUP" \
    --rl-max-tokens "$TOKENS" --rl-eval 0 --temperature 1.0 --reward-cmd "$REWARD" \
    --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" --lr 1e-6 --warmup 1 --log "$log" $EXTRA \
    > "$OUTDIR/$tag.out" 2>&1; then
    echo "bench_grpo.sh: the run failed; the end of $OUTDIR/$tag.out:" >&2
    tail -20 "$OUTDIR/$tag.out" >&2
    exit 1
fi

read -r dec step roll train sync gbs <<<"$(python3 - "$log" "$WARMUP" <<'PY'
import json, sys
path, warm = sys.argv[1], int(sys.argv[2])
steps = [json.loads(l) for l in open(path) if '"rollout_ms"' in l]
timed = steps[warm:]
if not timed:
    print("n/a n/a n/a n/a n/a n/a"); sys.exit()
mean = lambda k: sum(s.get(k) or 0 for s in timed) / len(timed)
roll, train, sync = mean("rollout_ms"), mean("train_ms"), mean("sync_ms")
gbs = mean("sync_bytes") / (sync * 1e-3) / 1e9 if sync > 0 else 0
print(f"{mean('decode_tok_s'):.0f} {(roll + train + sync) / 1e3:.2f} {roll / 1e3:.2f} "
      f"{train / 1e3:.2f} {sync:.1f} {gbs:.0f}")
PY
)"
echo "$MODEL GRPO ${PROMPTS}x${GROUP} x $TOKENS tokens, 1 GPU colocated: decode $dec tokens/s" \
     "at batch $((PROMPTS * GROUP)); step $step s = rollout $roll s + train $train s +" \
     "sync $sync ms ($gbs GB/s)"

table="| model | answers x tokens | decode tokens/s (batch $((PROMPTS * GROUP))) | GRPO step s | rollout s | train s | sync ms | sync GB/s |\n|---|---|---|---|---|---|---|---|\n"
table+="| $MODEL | ${PROMPTS}x${GROUP} x $TOKENS | $dec | $step | $roll | $train | $sync | $gbs |\n"
machine="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) CPU cores"
commit="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown commit")}"
printf "\nmachine: %s, %s, %s\n%b" "$machine" "$(date -u +%Y-%m-%d)" "$commit" "$table"
if [ "${NO_PERF_MD:-0}" != 1 ]; then
    {
        printf "\n### bench_grpo.sh (GRPO colocated on one GPU), %s, %s, %s\n\n" \
            "$(date -u +%Y-%m-%d)" "$machine" "$commit"
        printf "%b" "$table"
    } >> docs/PERF.md
fi
