#!/usr/bin/env bash
# scripts/bench_paper.sh — the shapes of the paper's throughput tables on the machine at hand.
#
# Random weights (presets) and random tokens, batch 128 x 2048 tokens, 10 micro-batches, 3
# warm-up and 4 timed iterations (rounded up to a multiple of the GPU count: two iterations are in
# flight, so on two GPUs the step times alternate between a long and a short one); tokens/s =
# tokens of the timed iterations / their wall time (the sum of their step times in the trainer's
# JSON-lines log: a step's time is the time between two completed iterations; a step nothing
# follows ends when the devices are done). Prints one table and appends it, with the machine and
# the date, to docs/PERF.md.
#
#   scripts/bench_paper.sh                         Qwen3-1.7B and LLaMA-3.1-8B on 1 and 2 GPUs
#   MODELS=qwen3-1.7b GPUS=1 scripts/bench_paper.sh
#   MODELS="qwen3-30b-a3b gpt-oss-20b" LAYERS=4 GPUS=1 scripts/bench_paper.sh
#                                                  the MoE shapes cut to 4 decoder blocks (the
#                                                  depth at which the official RoundPipe fits a
#                                                  128 GiB host; docs/PERF.md)
#   SWEEP=1 scripts/bench_paper.sh                 + the Qwen3-1.7B sequence sweep 512 .. 64K
#   MAXSEQ=1 scripts/bench_paper.sh                + the longest trainable sequence per model
#                                                  (one sequence per micro-batch, found with
#                                                  --plan, confirmed by one step) and the
#                                                  throughput at 262,144 tokens
#   EXTRA="--recompute layer" scripts/bench_paper.sh   extra trainer flags for every run
#   EXTRA="--no-split-rounds" GPUS=2 scripts/bench_paper.sh   the paper's schedule on two GPUs
#                                                  (split rounds are the default; see the README)
#
# Variables: MODELS, GPUS, LAYERS (empty: full depth; N: --layers N), BATCH (128), SEQ (2048), MICRO (10), WARMUP (3), TIMED (4), SWEEP (0),
# MAXSEQ (0), HOST_GIB (120: host memory a MAXSEQ plan may use), MAXSEQ_STEP (1; 0 reports
# the longest plan without running its step: at 786K tokens one step takes ~12-20 minutes),
# EXTRA, OUTDIR (out/bench), COMMIT (named in the output; default git's), NO_PERF_MD=1 to leave
# docs/PERF.md alone, SKIP_BUILD=1 to use the binary as it is. The plan is the size-based one (--profile-steps 0), so no re-planning lands in
# the timed iterations.
set -euo pipefail
cd "$(dirname "$0")/.."

MODELS=${MODELS:-"qwen3-1.7b llama3.1-8b"}
GPUS=${GPUS:-"1 2"}
BATCH=${BATCH:-128}
SEQ=${SEQ:-2048}
MICRO=${MICRO:-10}
WARMUP=${WARMUP:-3}
TIMED=${TIMED:-4}
SWEEP=${SWEEP:-0}
MAXSEQ=${MAXSEQ:-0}
EXTRA=${EXTRA:-}
LAYERS=${LAYERS:-}
if [ -n "$LAYERS" ]; then
    [[ "$LAYERS" =~ ^[1-9][0-9]*$ ]] || { echo "bench_paper.sh: LAYERS takes a positive number" >&2; exit 2; }
    EXTRA="--layers $LAYERS $EXTRA"
fi
OUTDIR=${OUTDIR:-out/bench}
mkdir -p "$OUTDIR"

[ "${SKIP_BUILD:-0}" = 1 ] || make -j"$(nproc)" train_roundpipe >/dev/null
visible=$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)
[ "$visible" -gt 0 ] || { echo "bench_paper.sh: no GPU visible" >&2; exit 1; }

vocab_of() { case "$1" in qwen3*) echo 151936;; llama*) echo 128256;; gpt-oss*) echo 201088;; *) echo 256;; esac; }

# tokens/s of the timed steps of a --log file: sum(batch*seq) / sum(ms)
tok_s() {
    python3 - "$1" "$2" "$3" "$4" <<'PY'
import json, sys
path, warm, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
steps = [json.loads(l) for l in open(path) if '"loss"' in l]
timed = steps[warm:]
if not timed:
    print("n/a n/a n/a"); sys.exit()
ms = sum(s["ms"] for s in timed)
# per-step MFU and bubble are shares of each step's time: weight them by it
mfu = sum(s.get("mfu", 0) * s["ms"] for s in timed) / ms
bub = sum(s.get("bubble", 0) * s["ms"] for s in timed) / ms
print(f"{batch*seq*len(timed)/(ms/1e3):.0f} {100*mfu:.1f} {100*bub:.1f}")
PY
}

# run MODEL GPUS BATCH SEQ MICRO -> prints "tok/s mfu% bubble%"
run() {
    local model=$1 gpus=$2 batch=$3 seq=$4 micro=$5
    local vocab; vocab=$(vocab_of "$model")
    local shard="$OUTDIR/random_${vocab}_${batch}x${seq}.bin"
    local timed=$(( (TIMED + gpus - 1) / gpus * gpus ))
    local steps=$((WARMUP + timed))
    [ -f "$shard" ] || python3 scripts/make_random_shard.py "$shard" --vocab "$vocab" \
        --tokens $(((steps + 1) * batch * (seq + 1)))
    local tag="${model}${LAYERS:+_l$LAYERS}_g${gpus}_${batch}x${seq}"
    if ./train_roundpipe --model "$model" --device "cuda:$gpus" --train "$shard" --val '' \
        --batch "$batch" --seq "$seq" --micro-batches "$micro" --steps "$steps" --warmup 1 \
        --sample-tokens 0 --lr 1e-5 --profile-steps 0 --log "$OUTDIR/$tag.jsonl" $EXTRA \
        > "$OUTDIR/$tag.out" 2>&1; then
        tok_s "$OUTDIR/$tag.jsonl" "$WARMUP" "$batch" "$seq"
    else
        echo "failed (see $OUTDIR/$tag.out) - -"
    fi
}

table="| model | GPUs | batch x seq | micro-batches | tokens/s | MFU | bubble |\n|---|---|---|---|---|---|---|\n"
for model in $MODELS; do
    for g in $GPUS; do
        [ "$g" -le "$visible" ] || { echo "skip $model on $g GPUs: only $visible visible"; continue; }
        read -r tps mfu bub <<<"$(run "$model" "$g" "$BATCH" "$SEQ" "$MICRO")"
        echo "$model  $g GPU(s)  ${BATCH}x${SEQ}: $tps tokens/s, MFU $mfu%, bubble $bub%"
        table+="| $model${LAYERS:+ ($LAYERS layers)} | $g | ${BATCH} x ${SEQ} | $MICRO | $tps | $mfu% | $bub% |\n"
    done
done
if [ "$SWEEP" = 1 ]; then
    for seq in 512 1024 2048 4096 8192 16384 32768 65536; do
        # the paper's batches (Fig. 14; docs/PERFORMANCE.md §6.1)
        case $seq in 512) batch=512;; 1024) batch=256;; 2048) batch=128;; 4096) batch=60;;
                     8192) batch=30;; *) batch=10;; esac
        read -r tps mfu bub <<<"$(run qwen3-1.7b 1 "$batch" "$seq" 10)"
        echo "qwen3-1.7b sweep ${batch}x${seq}: $tps tokens/s"
        table+="| qwen3-1.7b (sweep) | 1 | $batch x $seq | 10 | $tps | $mfu% | $bub% |\n"
    done
fi
if [ "$MAXSEQ" = 1 ]; then
    # The longest sequence (one per micro-batch, 1 GPU) whose plan fits this GPU (90% of its free
    # memory) and this host: bisection on --plan, which allocates nothing, for stage- and
    # layer-grain recompute with the MLP chunked; then one real step at that length to confirm,
    # and the throughput at 262,144 tokens (the paper's long-sequence point).
    # HOST_GIB: the host memory a plan may use (default 120, for the 128 GiB of the 1-GPU
    # machine; its MemTotal starts far lower and grows on demand, so it cannot be read).
    LONG="--mlp-chunk 16384 --host-checkpoints single"
    HOST_GIB=${HOST_GIB:-120}
    fits() {  # fits MODEL SEQ GRAIN: the plan fits the GPU and HOST_GIB
        local out need
        out=$(./train_roundpipe --model "$1" --device cuda:1 --batch 1 --seq "$2" \
            --micro-batches 1 --recompute "$3" $LONG $EXTRA --val '' --plan 2>&1) || return 1
        need=$(sed -n 's/^host memory for this plan: \([0-9.]*\) GiB.*/\1/p' <<<"$out")
        [ -n "$need" ] && python3 -c "import sys; sys.exit(0 if $need <= $HOST_GIB else 1)"
    }
    for model in $MODELS; do
        best=0 best_grain=stage
        for grain in stage layer; do
            lo=0 hi=0 seq=32768
            while [ "$hi" = 0 ] && [ "$seq" -le 8388608 ]; do
                if fits "$model" "$seq" "$grain"; then lo=$seq; seq=$((seq * 2)); else hi=$seq; fi
            done
            while [ "$hi" -gt 0 ] && [ $((hi - lo)) -gt 16384 ]; do
                mid=$(( (lo + hi) / 2 / 16384 * 16384 ))
                if fits "$model" "$mid" "$grain"; then lo=$mid; else hi=$mid; fi
            done
            echo "$model: --recompute $grain plans up to $lo tokens"
            [ "$lo" -le "$best" ] || { best=$lo; best_grain=$grain; }
        done
        if [ "${MAXSEQ_STEP:-1}" = 1 ]; then
            read -r tps _ _ <<<"$(WARMUP=0 TIMED=1 EXTRA="$EXTRA $LONG --recompute $best_grain" run "$model" 1 1 "$best" 1)"
            echo "$model: longest planned sequence $best tokens ($best_grain recompute): one step ran at $tps tokens/s"
        else
            tps="step not run"
            echo "$model: longest planned sequence $best tokens ($best_grain recompute); its step not run (MAXSEQ_STEP=0)"
        fi
        table+="| $model (longest sequence, $best_grain recompute, \`$LONG\`) | 1 | 1 x $best | 1 | $tps | - | - |\n"
        if [ "$best" -ge 262144 ]; then
            read -r tps mfu _ <<<"$(WARMUP=1 TIMED=1 EXTRA="$EXTRA $LONG --recompute $best_grain" run "$model" 1 1 262144 1)"
            echo "$model at 262144 tokens: $tps tokens/s"
            table+="| $model (long sequence, $best_grain recompute) | 1 | 1 x 262144 | 1 | $tps | $mfu% | - |\n"
        fi
    done
fi
machine="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$visible, $(nproc) CPU cores"
# the commit measured: COMMIT=..., else git's (a copy without .git says "unknown commit")
commit="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown commit")}"
if [ "$commit" != "unknown commit" ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit + uncommitted changes"
fi
printf "\nmachine: %s, %s, %s\n%b" "$machine" "$(date -u +%Y-%m-%d)" "$commit" "$table"
if [ "${NO_PERF_MD:-0}" != 1 ]; then
    {
        printf "\n### bench_paper.sh, %s, %s, %s\n\n" "$(date -u +%Y-%m-%d)" "$machine" "$commit"
        printf "Command: \`MODELS=\"%s\" GPUS=\"%s\" EXTRA=\"%s\" scripts/bench_paper.sh\`\n\n" "$MODELS" "$GPUS" "$EXTRA"
        printf "%b" "$table"
    } >> docs/PERF.md
fi
