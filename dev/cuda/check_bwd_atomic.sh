#!/usr/bin/env bash
# dev/cuda/check_bwd_atomic.sh — first GPU run of the atomic-dQ wgmma backward (lab backward
# variants 8, 9 and 10, dev/cuda/attention_bwd_atomic.cuh), sized for ONE device call (< 600 s):
#   1. build (sm_90a) and the ptxas facts: no C75xx line, no spill in attn_bwa_kernel
#   2. each new variant alone on the tiny cases under `timeout` (124 = a hang: that variant is
#      left out of the later steps, so one hang cannot cost the whole call)
#   3. the full lab for production's wgmma backward (6) and the variants that terminated: every
#      validation case twice (repeats within tolerance for 8-10), the big case (B=3 T=131072
#      H=32), the benchmark at T=2048/4096/16384 plus T=65536 B=1 (--long), the passes
#   4. compute-sanitizer memcheck, racecheck, synccheck on one case that wraps the rings
#      (T=1000: 8 kv tiles, 16 query tiles, dQ blocks added to by up to 8 CTAs), with what time
#      is left
# Logs: $OUT (device machine) or .devbuild/. Exit status: that of step 3's lab (0 passed, 3 a
# check failed, 1 a CUDA error, 124 timeout).
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG=${OUT:-.devbuild}
mkdir -p "$LOG"
T0=$SECONDS
BIN=.devbuild/attention

dev/cuda/run_attention.sh --build-only | tail -1
echo "C75 lines in the ptxas log (want 0): $(grep -c C75 .devbuild/attention_ptxas.txt)"
echo "attn_bwa_kernel instantiations without spills (want 6 of 6): $(
    grep -A2 "entry function '_Z15attn_bwa_kernel" .devbuild/attention_ptxas.txt |
        grep -c " 0 bytes spill stores") of $(grep -c "entry function '_Z15attn_bwa_kernel" \
        .devbuild/attention_ptxas.txt)"

A="--no-big --no-bench --fwd -2 --log /dev/null"
OK=""
for v in 8 9 10; do
    timeout 60 "$BIN" --tiny $A --bwd "$v" >"$LOG/bwa_tiny_$v.txt" 2>&1
    rc=$?
    echo "tiny, backward variant $v: status $rc (0 passed, 3 check failed, 1 CUDA error, 124 hang)"
    grep -E "FAIL|^  wgmma bwd atomic|CUDA error" "$LOG/bwa_tiny_$v.txt" | head -6
    if [ "$rc" = 0 ] || [ "$rc" = 3 ]; then OK="$OK,$v"; fi
done
OK=${OK#,}
if [ -z "$OK" ]; then
    echo "no atomic-dQ variant terminated normally: see $LOG/bwa_tiny_*.txt"
    exit 1
fi

echo "variants for the full lab: 6,$OK ($((SECONDS - T0)) s so far)"
timeout $((450 - (SECONDS - T0))) dev/cuda/run_attention.sh --fwd -2 --bwd "6,$OK" --long
rc=$?
echo "full lab status $rc ($((SECONDS - T0)) s so far)"

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
