#!/usr/bin/env bash
# dev/cuda/run_labs.sh — run the kernel labs of dev/cuda on a GPU: every lab's validation and
# benchmark, a log per lab and one summary (about 2 minutes on an H200; each lab is limited to
# LAB_TIMEOUT seconds, default 150).
#
#   dev/cuda/run_labs.sh [--validate-only] [--build] [--seed S] [--out DIR] [LAB ...]
#
#   LAB              norm rope elementwise embedding loss matmul moe moe_matmul dequant
#                    decode (default: all)
#   --validate-only  the validations only (seconds)
#   --build          run `make dev-cuda` first even when every binary exists (make rebuilds what
#                    is out of date); without it the labs are built only when a binary is missing
#   --seed S         the random inputs of every lab (default: each lab takes one from the clock
#                    and prints it)
#   --out DIR        logs (DIR/<lab>.log) and the summary (DIR/summary.md); default out/labs
#   -h, --help       this text
#
# Exit status: 0 every lab passed, 1 a lab failed (a check, a CUDA error, the time limit),
# 2 bad usage or a failed build. The attention lab has its own script, dev/cuda/run_attention.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root

ALL_LABS="norm rope elementwise embedding loss matmul moe moe_matmul dequant decode"
BIN_DIR=dev/cuda/build
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

validate_only=0 build=0 seed="" out=out/labs labs=""
while [ $# -gt 0 ]; do
    case "$1" in
    --validate-only) validate_only=1 ;;
    --build) build=1 ;;
    --seed)
        [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "run_labs.sh: --seed takes a number" >&2; exit 2; }
        seed=$2; shift ;;
    --out)
        [ -n "${2:-}" ] || { echo "run_labs.sh: --out takes a folder" >&2; exit 2; }
        out=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "run_labs.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    *)
        [[ " $ALL_LABS " == *" $1 "* ]] || { echo "run_labs.sh: no lab '$1' (labs: $ALL_LABS)" >&2; exit 2; }
        labs="$labs $1" ;;
    esac
    shift
done
labs=${labs:-$ALL_LABS}

missing=0
for lab in $labs; do [ -x "$BIN_DIR/$lab" ] || missing=1; done
if [ "$build" = 1 ] || [ "$missing" = 1 ]; then
    echo "building the labs (make dev-cuda)"
    make -j"$(nproc)" dev-cuda > /dev/null || { echo "run_labs.sh: make dev-cuda failed" >&2; exit 2; }
fi

mkdir -p "$out"
args=()
[ "$validate_only" = 1 ] && args+=(--validate-only)
[ -n "$seed" ] && args+=(--seed "$seed")
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "unknown commit")
summary="$out/summary.md"
{
    echo "# kernel labs: $(date -u '+%Y-%m-%d %H:%M UTC'), ${device:-unknown GPU}, $commit"
    echo
    echo "| lab | result | seconds |"
    echo "|---|---|---|"
} > "$summary"
tables=""
failed=0
for lab in $labs; do
    echo "== $lab"
    t0=$(date +%s)
    timeout "${LAB_TIMEOUT:-150}" "$BIN_DIR/$lab" "${args[@]}" > "$out/$lab.log" 2>&1
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    grep -E "^  FAIL|^    |validation (passed|FAILED)|error" "$out/$lab.log" | head -20
    case $rc in
    0) result="passed ($(grep -o '[0-9]* checks' "$out/$lab.log" | tail -1))" ;;
    3) result="FAILED: $(grep -o '[0-9]* of [0-9]* checks' "$out/$lab.log" | tail -1) failed" ;;
    124) result="FAILED: over the time limit (${LAB_TIMEOUT:-150} s)" ;;
    *) result="FAILED: exit status $rc ($(grep -m1 error "$out/$lab.log" | cut -c1-120))" ;;
    esac
    [ "$rc" = 0 ] || failed=1
    echo "| $lab | $result | $dt |" >> "$summary"
    if grep -q '^|' "$out/$lab.log"; then
        tables+=$'\n'"## $lab"$'\n\n'"$(grep '^|' "$out/$lab.log")"$'\n'
    fi
done
printf "%s" "$tables" >> "$summary"
echo
cat "$summary"
echo
echo "logs: $out/<lab>.log; summary: $summary"
exit "$failed"
