#!/usr/bin/env bash
# dev/cuda/check_bwd_atomic.sh — first GPU run of the atomic-dQ wgmma backward (lab backward
# variants 8, 9 and 10, dev/cuda/attention_bwd_atomic.cuh): its first-run checklist in one go,
# on one Hopper GPU, in under 10 minutes.
#
#   dev/cuda/check_bwd_atomic.sh [LOGDIR]     logs in LOGDIR (default .devbuild/bwd_atomic)
#
#   1. the lab binary .devbuild/attention and its ptxas report .devbuild/attention_ptxas.txt:
#      built here (dev/cuda/run_attention.sh --build-only) when either is missing or
#      ATTN_REBUILD=1, else taken as they are (e.g. built from this tree on a machine without a
#      GPU); then the ptxas facts: no C75xx line, no spill in attn_bwa_kernel
#   2. each new variant alone on the tiny cases under `timeout` (124 = a hang: that variant is
#      left out of the later steps, so one hang cannot cost the whole run)
#   3. the full lab for production's wgmma backward (6) and the variants that terminated: every
#      validation case twice (repeats within tolerance for 8-10), the big case (B=3 T=131072
#      H=32), the benchmark at T=2048/4096/16384 plus T=65536 B=1 (--long), the passes
#   4. compute-sanitizer memcheck, racecheck, synccheck on one case that wraps the rings
#      (T=1000: 8 kv tiles, 16 query tiles, dQ blocks added to by up to 8 CTAs), with the time
#      that is left (skipped when compute-sanitizer is not on the PATH)
# Exit status: that of step 3's lab (0 passed, 3 a check failed, 1 a CUDA error, 124 timeout).
set -uo pipefail
cd "$(dirname "$0")/../.."

case "${1:-}" in -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -le 1 ] || { echo "usage: $0 [LOGDIR]  (-h for help)"; exit 2; }
LOG=${1:-.devbuild/bwd_atomic}
mkdir -p "$LOG"
T0=$SECONDS
BIN=.devbuild/attention
PTXAS=.devbuild/attention_ptxas.txt

if [ "${ATTN_REBUILD:-0}" = 1 ] || [ ! -x "$BIN" ] || [ ! -f "$PTXAS" ]; then
    dev/cuda/run_attention.sh --build-only | tail -1 || exit 1
else
    echo "using $BIN as it is (ATTN_REBUILD=1 rebuilds it)"
fi
echo "C75 lines in the ptxas log (want 0): $(grep -c C75 "$PTXAS")"
echo "attn_bwa_kernel instantiations without spills (want 6 of 6): $(
    grep -A2 "entry function '_Z15attn_bwa_kernel" "$PTXAS" |
        grep -c " 0 bytes spill stores") of $(grep -c "entry function '_Z15attn_bwa_kernel" "$PTXAS")"

A="--no-big --no-bench --fwd -2 --log /dev/null"
OK=""
for v in 8 9 10; do
    timeout 60 "$BIN" --tiny $A --bwd "$v" >"$LOG/bwa_tiny_$v.txt" 2>&1
    rc=$?
    echo "tiny, backward variant $v: status $rc (0 passed, 3 check failed, 1 CUDA error, 124 hang)"
    grep -E "FAIL|^  wgmma bwd atomic|^  wgmma bwd bulk|CUDA error" "$LOG/bwa_tiny_$v.txt" | head -6
    if [ "$rc" = 0 ] || [ "$rc" = 3 ]; then OK="$OK,$v"; fi
done
OK=${OK#,}
if [ -z "$OK" ]; then
    echo "no atomic-dQ variant terminated normally: see $LOG/bwa_tiny_*.txt"
    exit 1
fi

echo "variants for the full lab: 6,$OK ($((SECONDS - T0)) s so far)"
ATTN_LOGDIR="$LOG" timeout $((450 - (SECONDS - T0))) dev/cuda/run_attention.sh --fwd -2 \
    --bwd "6,$OK" --long
rc=$?
echo "full lab status $rc ($((SECONDS - T0)) s so far; log $LOG/attention_lab.out)"

if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer not found: step 4 skipped"
    exit "$rc"
fi
S="--shape 1,1000,2,1,128 $A --bwd $OK"
for t in memcheck racecheck synccheck; do
    left=$((585 - (SECONDS - T0)))
    if [ "$left" -lt 20 ]; then echo "$t: skipped (no time left)"; continue; fi
    timeout "$((left < 60 ? left : 60))" compute-sanitizer --tool "$t" --print-limit 5 "$BIN" $S \
        >"$LOG/bwa_$t.txt" 2>&1
    echo "$t: status $? ($((SECONDS - T0)) s so far)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid|Barrier|error" "$LOG/bwa_$t.txt" |
        head -6
done
exit "$rc"
