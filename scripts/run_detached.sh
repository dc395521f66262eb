#!/usr/bin/env bash
# scripts/run_detached.sh — run a command detached from the shell that starts it (it survives
# the end of that shell, a logout or a remote call that returns), with its log, pid and exit
# status in a folder, and look at it later.
#
#   scripts/run_detached.sh start DIR [--] COMMAND [ARGS...]
#       Start COMMAND in a new session, in the current folder with the current environment.
#       DIR/log gets its stdout and stderr, DIR/pid the pid of its session (the process group
#       `stop` signals), DIR/cmd the command line, DIR/started the start time (seconds since the
#       epoch), DIR/rc its exit status once it ends. Refuses while DIR holds a run still going.
#   scripts/run_detached.sh status DIR [--lines N] [--grep REGEX]
#       Whether the run is still going (or how it ended) and the seconds since its start, then the
#       last N lines of its log (default 15), or the log's lines that match the extended regular
#       expression REGEX. Exit status: 0 running or ended with status 0, 1 ended otherwise.
#   scripts/run_detached.sh wait DIR [SECONDS]
#       Wait until the run ends (at most SECONDS); exit status: the run's, or 124 on the limit.
#   scripts/run_detached.sh stop DIR
#       SIGTERM to the run's process group (the command and what it started), SIGKILL 10 s later.
# Exit status 2: bad usage, or no run in DIR.
#
# Example: a long-sequence step that takes longer than the call which starts it (786,432 tokens
# of Qwen3-1.7B: about 15 minutes on an H200):
#   python3 scripts/make_random_shard.py out/long.bin --vocab 151936 --tokens 1572866
#   CUDA_VISIBLE_DEVICES=0 scripts/run_detached.sh start out/long786k -- ./train_roundpipe \
#       --model qwen3-1.7b --device cuda:1 --train out/long.bin --val '' --batch 1 \
#       --seq 786432 --micro-batches 1 --recompute stage --mlp-chunk 16384 \
#       --host-checkpoints single --steps 1 --sample-tokens 0 --lr 1e-5 --profile-steps 0
#   scripts/run_detached.sh status out/long786k --grep '^step|error|device memory'
# The command's files must stay where they are while it runs: when the checkout may be replaced
# under it, copy the binary elsewhere first and start the copy.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "run_detached.sh: $*" >&2; exit 2; }

# running DIR: true while the run of DIR is going (its session leader lives and wrote no status).
running() {
    local pid
    [ -f "$1/pid" ] && [ ! -f "$1/rc" ] || return 1
    pid=$(cat "$1/pid")
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

need_run() { [ -f "$1/started" ] || die "no run in '$1' (start one with: $0 start $1 -- COMMAND)"; }

cmd=${1:-}
[ $# -ge 1 ] && shift
case "$cmd" in
start)
    [ $# -ge 1 ] || die "start: which folder? (usage: $0 start DIR [--] COMMAND [ARGS...])"
    dir=$1
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || die "start: no command given"
    mkdir -p "$dir" || die "cannot create '$dir'"
    running "$dir" && die "a run in '$dir' is still going (pid $(cat "$dir/pid")): stop it first"
    rm -f "$dir/log" "$dir/pid" "$dir/rc" "$dir/cmd" "$dir/started"
    printf '%q ' "$@" > "$dir/cmd"
    echo >> "$dir/cmd"
    date +%s > "$dir/started"
    # The wrapper is the session leader: it records its own pid, runs the command as its child
    # and writes the exit status when the command ends.
    setsid bash -c 'd=$1; shift; echo $$ > "$d/pid"; "$@"; echo $? > "$d/rc"' run_detached \
        "$dir" "$@" > "$dir/log" 2>&1 < /dev/null &
    for _ in $(seq 50); do [ -s "$dir/pid" ] && break; sleep 0.1; done
    [ -s "$dir/pid" ] || die "the run did not start (see $dir/log)"
    echo "started in $dir (pid $(cat "$dir/pid")): $(cat "$dir/cmd")"
    echo "log: $dir/log; look at it with: $0 status $dir"
    ;;
status)
    [ $# -ge 1 ] || die "status: which folder?"
    dir=$1
    shift
    lines=15 regex=""
    while [ $# -gt 0 ]; do
        case "$1" in
        --lines) [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--lines takes a number"; lines=$2; shift ;;
        --grep) [ -n "${2:-}" ] || die "--grep takes a regular expression"; regex=$2; shift ;;
        *) die "status: unknown option '$1'" ;;
        esac
        shift
    done
    need_run "$dir"
    elapsed=$(( $(date +%s) - $(cat "$dir/started") ))
    rc=1
    if running "$dir"; then
        state="running (pid $(cat "$dir/pid"))"
        rc=0
    elif [ -f "$dir/rc" ]; then
        state="ended with exit status $(cat "$dir/rc")"
        [ "$(cat "$dir/rc")" = 0 ] && rc=0
    else
        state="ended without an exit status (killed, or the machine restarted)"
    fi
    echo "$dir: $state; started $elapsed s ago"
    echo "command: $(cat "$dir/cmd")"
    if [ -n "$regex" ]; then
        echo "--- log lines matching '$regex'"
        grep -E -- "$regex" "$dir/log"
    else
        echo "--- last $lines lines of the log"
        tail -n "$lines" "$dir/log"
    fi
    exit "$rc"
    ;;
wait)
    [ $# -ge 1 ] || die "wait: which folder?"
    dir=$1
    limit=${2:-}
    [ -z "$limit" ] || [[ "$limit" =~ ^[0-9]+$ ]] || die "wait: SECONDS is a number"
    need_run "$dir"
    t0=$(date +%s)
    while running "$dir"; do
        if [ -n "$limit" ] && [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then
            echo "$dir: still running after $limit s"
            exit 124
        fi
        sleep 2
    done
    [ -f "$dir/rc" ] || { echo "$dir: ended without an exit status"; exit 1; }
    echo "$dir: ended with exit status $(cat "$dir/rc")"
    exit "$(cat "$dir/rc")"
    ;;
stop)
    [ $# -ge 1 ] || die "stop: which folder?"
    dir=$1
    need_run "$dir"
    running "$dir" || { echo "$dir: not running"; exit 0; }
    pid=$(cat "$dir/pid")
    kill -TERM -- "-$pid" 2>/dev/null
    for _ in $(seq 10); do running "$dir" || break; sleep 1; done
    if running "$dir"; then kill -KILL -- "-$pid" 2>/dev/null; fi
    echo "$dir: stopped (process group $pid)"
    ;;
-h|--help|help) usage ;;
*) usage >&2; exit 2 ;;
esac
