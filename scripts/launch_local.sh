#!/usr/bin/env bash
# scripts/launch_local.sh — start W ranks of a data-parallel run on this machine, the way torchrun
# would: each rank is one process of ./train_roundpipe (or $TRAIN_ROUNDPIPE_BIN) with RANK,
# WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
#
#   scripts/launch_local.sh W [ARGS...]
#       W        number of ranks (1 .. 64); LOCAL_RANK = RANK (one machine), so rank r drives GPU r
#       ARGS     the trainer's flags, the same for every rank
#   Environment: MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500), LOG_DIR (each
#   rank's output also goes to LOG_DIR/rank<R>.log; default: none).
#
# Every line a rank prints is prefixed "[rank R] ". When a rank fails, the others are stopped
# (SIGTERM, then SIGKILL 10 s later) and the script exits with that rank's status; with every
# rank done it exits 0. Ctrl-C stops all ranks. Exit status 2: bad usage.
#
# Examples (every rank needs a GPU for NCCL, GPU LOCAL_RANK; a world of one on GPUs opens NCCL
# too, the same code path, for checking it against the run without it: scripts/check_dp_engine.sh;
# note that the engine's own devices are GPUs 0..N-1 in every rank for now, so several engine
# ranks on one machine share them):
#   scripts/launch_local.sh 1 --device cuda:1 --steps 10      one rank, the engine on GPU 0
#   scripts/launch_local.sh 2 --device cpu --steps 10         two ranks training plain
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "launch_local.sh: $*" >&2; exit 2; }

[ $# -ge 1 ] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0 ;; esac
W=$1
shift
[[ "$W" =~ ^[0-9]+$ ]] && [ "$W" -ge 1 ] && [ "$W" -le 64 ] ||
    die "W '$W': expected a number of ranks between 1 and 64"
BIN=${TRAIN_ROUNDPIPE_BIN:-./train_roundpipe}
[ -x "$BIN" ] || die "$BIN not found or not executable (run make first, or set TRAIN_ROUNDPIPE_BIN)"
ADDR=${MASTER_ADDR:-127.0.0.1}
PORT=${MASTER_PORT:-29500}
[[ "$PORT" =~ ^[0-9]+$ ]] && [ "$PORT" -ge 1 ] && [ "$PORT" -le 65535 ] ||
    die "MASTER_PORT '$PORT': expected a port between 1 and 65535"
if [ -n "${LOG_DIR:-}" ]; then
    mkdir -p "$LOG_DIR" || die "cannot create LOG_DIR '$LOG_DIR'"
fi

# Every rank runs in a session (and process group) of its own, led by the trainer itself
# (setsid execs it: the pid is the trainer's), so stopping a rank reaches the trainer; its output
# goes through a prefixing filter.
command -v setsid > /dev/null || die "setsid not found (util-linux)"
pids=()
# stop_all SIGNAL: signal the process group of every rank still running (only what this script
# started)
stop_all() {
    local p
    for p in "${pids[@]}"; do kill "-$1" -- "-$p" 2>/dev/null; done
}
trap 'stop_all TERM; exit 130' INT
trap 'stop_all TERM; exit 143' TERM

for ((r = 0; r < W; r++)); do
    if [ -n "${LOG_DIR:-}" ]; then
        RANK=$r WORLD_SIZE=$W LOCAL_RANK=$r LOCAL_WORLD_SIZE=$W MASTER_ADDR=$ADDR \
            MASTER_PORT=$PORT setsid "$BIN" "$@" \
            > >(tee "$LOG_DIR/rank$r.log" | sed -u "s/^/[rank $r] /") 2>&1 &
    else
        RANK=$r WORLD_SIZE=$W LOCAL_RANK=$r LOCAL_WORLD_SIZE=$W MASTER_ADDR=$ADDR \
            MASTER_PORT=$PORT setsid "$BIN" "$@" > >(sed -u "s/^/[rank $r] /") 2>&1 &
    fi
    pids+=($!)
done

# Collect the ranks' statuses; the first to fail stops the others (a dead rank must not leave the
# rest waiting for it until their --dist-timeout), with SIGKILL for those still there 10 s later.
status=0
kill_at=
declare -A finished=()
while :; do
    alive=0
    for i in "${!pids[@]}"; do
        [ -n "${finished[$i]:-}" ] && continue
        if kill -0 "${pids[$i]}" 2>/dev/null; then
            alive=$((alive + 1))
            continue
        fi
        wait "${pids[$i]}"
        rc=$?
        finished[$i]=1
        if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
            status=$rc
            echo "launch_local.sh: rank $i exited with status $rc; stopping the others" >&2
            stop_all TERM
            kill_at=$((SECONDS + 10))
        fi
    done
    [ "$alive" -eq 0 ] && break
    if [ -n "$kill_at" ] && [ "$SECONDS" -ge "$kill_at" ]; then
        stop_all KILL
        kill_at=
    fi
    sleep 0.2
done
wait  # the output filters
exit "$status"
