#!/bin/bash
# dev/long_seq_bg.sh — a long-sequence step (Qwen3-1.7B, one sequence per micro-batch) that
# outlives the device call which starts it, for steps longer than one call (786K: ~13 minutes):
#   dev/long_seq_bg.sh start SEQ GPU [STEPS]   copy the binary to /tmp, make a random shard, start
#                                              the run detached (setsid) on GPU, log in /tmp
#   dev/long_seq_bg.sh status SEQ              seconds since the start, the log's step lines or
#                                              its tail, whether it still runs
# The machine keeps /tmp only while it stays warm (30 s idle release): make the next device call
# before the previous one ends. Do not `wait` without a PID in the same call: a bare `wait` waits
# for this run too.
set -u
cd "$(dirname "$0")/.."  # the repository root
cmd=${1:-}; seq=${2:-}
[[ "$seq" =~ ^[0-9]+$ ]] || { echo "usage: $0 start SEQ GPU [STEPS] | status SEQ" >&2; exit 2; }
log=/tmp/long$seq.out
case "$cmd" in
start)
    gpu=${3:-}; steps=${4:-1}
    [[ "$gpu" =~ ^[0-9]+$ && "$steps" =~ ^[0-9]+$ ]] || { echo "start: GPU and STEPS are numbers" >&2; exit 2; }
    cp train_roundpipe "/tmp/tr$seq" || exit 1
    python3 scripts/make_random_shard.py "/tmp/long$seq.bin" --vocab 151936 \
        --tokens $(( (steps + 1) * (seq + 1) )) > /dev/null || exit 1
    date +%s > "/tmp/long$seq.t0"
    CUDA_VISIBLE_DEVICES=$gpu setsid nohup "/tmp/tr$seq" --model qwen3-1.7b --device cuda:1 \
        --train "/tmp/long$seq.bin" --val '' --batch 1 --seq "$seq" --micro-batches 1 \
        --recompute stage --mlp-chunk 16384 --host-checkpoints single --steps "$steps" \
        --sample-tokens 0 --lr 1e-5 --profile-steps 0 > "$log" 2>&1 < /dev/null &
    echo "started $seq tokens on GPU $gpu (pid $!), log $log"
    ;;
status)
    [ -f "/tmp/long$seq.t0" ] || { echo "no run of $seq tokens started on this machine" >&2; exit 1; }
    echo "$(( $(date +%s) - $(cat "/tmp/long$seq.t0") )) s since the start"
    grep -E "^step|error|S_f|device memory per" "$log" || tail -c 600 "$log"
    if pgrep -f "/tmp/tr$seq " > /dev/null; then echo "running"; else echo "finished"; fi
    ;;
*) echo "usage: $0 start SEQ GPU [STEPS] | status SEQ" >&2; exit 2 ;;
esac
