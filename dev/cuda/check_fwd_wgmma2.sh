#!/usr/bin/env bash
# dev/cuda/check_fwd_wgmma2.sh — first GPU run of the wgmma2 forward variants (lab forward
# variants 9-12, dev/cuda/attention_fwd_wgmma2.cuh), sized for ONE device call (< 600 s):
#   1. build (sm_90a) and the ptxas facts: no C75xx line, no spill in attn_fw2_kernel
#   2. each new variant alone on the tiny cases under `timeout` (124 = a hang: that variant is
#      left out of the later steps, so one hang cannot cost the whole call)
#   3. the full lab for production (7) and the variants that terminated: every validation case
#      twice (bit-identical repeats) and bit-for-bit against variant 7; the big case (B=3
#      T=131072 H=32, whole tensors compared bit for bit with the C interface's output); the
#      benchmark at T=2048/4096/16384 plus T=65536 B=1 (--long)
#   4. compute-sanitizer memcheck, synccheck, racecheck on one case that wraps the 3-stage rings
#      (T=1000: 8 kv tiles), with what time is left
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
echo "attn_fw2_kernel instantiations without spills (want 8 of 8): $(
    grep -A2 "entry function '_Z15attn_fw2" .devbuild/attention_ptxas.txt |
        grep -c " 0 bytes spill stores") of $(grep -c "entry function '_Z15attn_fw2" \
        .devbuild/attention_ptxas.txt)"

A="--no-big --no-bench --bwd -2 --log /dev/null"
OK=""
for v in 9 10 11 12; do
    timeout 60 "$BIN" --tiny $A --fwd "$v" >"$LOG/fw2_tiny_$v.txt" 2>&1
    rc=$?
    echo "tiny, forward variant $v: status $rc (0 passed, 3 check failed, 1 CUDA error, 124 hang)"
    grep -E "FAIL|^  wgmma2|CUDA error" "$LOG/fw2_tiny_$v.txt" | head -6
    if [ "$rc" = 0 ] || [ "$rc" = 3 ]; then OK="$OK,$v"; fi
done
OK=${OK#,}
if [ -z "$OK" ]; then
    echo "no wgmma2 variant terminated normally: see $LOG/fw2_tiny_*.txt"
    exit 1
fi
echo "variants for the full lab: 7,$OK ($((SECONDS - T0)) s so far)"

timeout $((480 - (SECONDS - T0))) dev/cuda/run_attention.sh --fwd "7,$OK" --bwd -2 --long
rc=$?
echo "full lab status $rc ($((SECONDS - T0)) s so far)"

S="--shape 1,1000,2,1,128 $A --fwd $OK"
for t in memcheck synccheck racecheck; do
    left=$((585 - (SECONDS - T0)))
    if [ "$left" -lt 20 ]; then echo "$t: skipped (no time left)"; continue; fi
    timeout "$left" compute-sanitizer --tool "$t" --print-limit 5 "$BIN" $S \
        >"$LOG/fw2_$t.txt" 2>&1
    echo "$t: status $? ($((SECONDS - T0)) s so far)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid|Barrier|error" "$LOG/fw2_$t.txt" |
        head -6
done
exit "$rc"
