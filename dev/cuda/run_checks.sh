#!/usr/bin/env bash
# dev/cuda/run_checks.sh — one call on a GPU machine: the `gpu` test suite (the CUDA backend
# against the CPU one, the model, the HF fixtures), the matmul and memory-bound labs, and a
# compute-sanitizer memcheck of the suites with hand-written indexing (SKIP_MATMUL=1 and
# MEMCHECK_TESTS="..." narrow the call). Logs go to $OUT (or
# ./out/gpu_checks). Binaries come prebuilt in $BIN (default .devbuild-ops: test_roundpipe,
# matmul, memory_bound, built by `make test_roundpipe dev-cuda` or an equivalent), so the call
# spends no device time compiling.
set -u
cd "$(dirname "$0")/../.."
BIN=${BIN:-.devbuild-ops}
OUT=${OUT:-out/gpu_checks}
mkdir -p "$OUT"
nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
for b in test_roundpipe matmul memory_bound; do
    if ldd "$BIN/$b" | grep -q "not found"; then echo "MISSING LIBS for $b:"; ldd "$BIN/$b"; fi
done
# The parity test finds dev/parity/fixtures next to the test binary.
cp "$BIN/test_roundpipe" ./test_roundpipe_gpu
echo "== gpu suite"
timeout 240 ./test_roundpipe_gpu --partial gpu 2>&1 | tee "$OUT/test_gpu.log"
if [ "${SKIP_MATMUL:-0}" != 1 ]; then
    echo "== matmul lab"
    timeout 120 "$BIN/matmul" 2>&1 | tee "$OUT/matmul.log"
fi
echo "== memory-bound lab"
timeout 60 "$BIN/memory_bound" 2>&1 | tee "$OUT/memory_bound.log"
echo "== memcheck"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
for t in ${MEMCHECK_TESTS:-gpu_embedding gpu_rmsnorm gpu_qknorm_rope gpu_crossentropy gpu_swiglu_add}; do
    timeout 40 "${CS:-compute-sanitizer}" --tool memcheck --print-limit 5 ./test_roundpipe_gpu --partial "$t" \
        2>&1 | tail -6 | tee -a "$OUT/memcheck.log"
done
rm -f ./test_roundpipe_gpu
echo "== summary"
grep -E "passed|FAIL|CHECK" "$OUT/test_gpu.log" | tail -20
grep -E "ERROR SUMMARY" "$OUT/memcheck.log"
