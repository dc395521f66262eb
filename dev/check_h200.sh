#!/bin/bash
# dev/check_h200.sh — one device call on nvidia-h200-x2 (about 4-5 minutes) after kernel or engine
# changes. GPU 1, in the background: Qwen3-1.7B on 1 GPU (bench_paper.sh, no PERF.md edit).
# GPU 0: the attention lab's production forward variants (tiny under timeout, full with --long,
# compute-sanitizer memcheck/synccheck/racecheck on a case that wraps the K/V rings), then
# make test-gpu (both GPUs), then a 262,144-token step pair with --profile-ops. Logs under $OUT.
# Build here first (`make && dev/cuda/run_attention.sh --build-only`) and carry build,
# train_roundpipe, test_roundpipe and .devbuild. LAB_FWD / LAB_BWD pick the lab variants
# (default: the wgmma forward at both ring depths, the C interface's backward).
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-.devbuild}
T0=$(date +%s)
L=.devbuild/attention
FWD=${LAB_FWD:-0,7,8}
BWD=${LAB_BWD:-0}
( CUDA_VISIBLE_DEVICES=1 SKIP_BUILD=1 NO_PERF_MD=1 OUTDIR=/tmp/bench/q1 MODELS=qwen3-1.7b GPUS=1 \
    timeout 420 taskset -c 16-31 scripts/bench_paper.sh > "$OUT/bench_q1.log" 2>&1
  echo "bench rc=$? $(( $(date +%s) - T0 )) s" >> "$OUT/bench_q1.log" ) &
BP=$!
export CUDA_VISIBLE_DEVICES=0
echo "=== lab tiny"
timeout 60 taskset -c 0-15 $L --tiny --no-big --no-bench --fwd "$FWD" --bwd "$BWD" --log /dev/null 2>&1 |
    grep -v "^B=" | tail -6
echo "=== lab full --long ($(( $(date +%s) - T0 )) s)"
timeout 240 taskset -c 0-15 $L --fwd "$FWD" --bwd "$BWD" --long --log "$OUT/lab.log" 2>&1 |
    grep -v "^B=" | grep -v "^  ok" | tail -30
for t in memcheck synccheck racecheck; do
    timeout 60 compute-sanitizer --tool $t --print-limit 5 $L --shape 1,1000,2,1,128 --no-big \
        --no-bench --fwd "$FWD" --bwd "$BWD" --log /dev/null > "$OUT/san_$t.txt" 2>&1
    echo "$t rc=$? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/san_$t.txt")"
done
unset CUDA_VISIBLE_DEVICES
echo "=== test-gpu ($(( $(date +%s) - T0 )) s)"
timeout 100 taskset -c 0-15 ./test_roundpipe gpu > "$OUT/testgpu.log" 2>&1; echo "test-gpu rc=$?"
grep -E "FAIL|passed|failed|wgmma kernels" "$OUT/testgpu.log" | cut -c1-160 | tail -5
echo "=== 262K ($(( $(date +%s) - T0 )) s)"
python3 scripts/make_random_shard.py /tmp/long262.bin --vocab 151936 --tokens $((3 * 262145)) >/dev/null
CUDA_VISIBLE_DEVICES=0 timeout 260 taskset -c 0-15 ./train_roundpipe --model qwen3-1.7b \
    --device cuda:1 --train /tmp/long262.bin --val '' --batch 1 --seq 262144 --micro-batches 1 \
    --recompute stage --mlp-chunk 16384 --host-checkpoints single --steps 2 --profile-ops \
    --sample-tokens 0 --lr 1e-5 --profile-steps 0 > "$OUT/long262.out" 2>&1
echo "262K rc=$? $(( $(date +%s) - T0 )) s"
grep -E "^step|attention|matmul (f|b)wd$|S_f|device memory|error" "$OUT/long262.out" | cut -c1-170 | head -12
wait $BP; tail -6 "$OUT/bench_q1.log"
echo "all done $(( $(date +%s) - T0 )) s"
