#!/bin/bash
# dev/check_h200.sh — one device call on nvidia-h200-x2 (about 8-9 minutes) after kernel or engine
# changes. GPU 1, in the background: the attention lab's checks of backward variants LABBWD
# (default 10,11: tiny validation, compute-sanitizer memcheck/racecheck/synccheck, then the full
# lab against production variant 8). GPU 0: make test-gpu, a 262,144-token step pair with
# --profile-ops, then LLaMA-3.1-8B on 1 GPU (bench_paper.sh). Logs under $OUT.
# Build here first (`make && dev/cuda/run_attention.sh --build-only`) and carry build,
# train_roundpipe, test_roundpipe and .devbuild. The forward variants have their own script:
# dev/cuda/check_fwd_wgmma2.sh.
cd "$(dirname "$0")/.."  # the repository root
T0=$(date +%s)
L=.devbuild/attention
(
  A="--tiny --no-big --no-bench --fwd -2 --bwd ${LABBWD:-10,11} --log /dev/null"
  echo "=== tiny"; CUDA_VISIBLE_DEVICES=1 timeout 120 $L $A 2>&1 | tail -4
  for tool in memcheck racecheck synccheck; do echo "=== $tool"
    CUDA_VISIBLE_DEVICES=1 timeout 100 compute-sanitizer --tool $tool --print-limit 5 $L $A 2>&1 | tail -3; done
  echo "=== full + bench vs 8"
  CUDA_VISIBLE_DEVICES=1 timeout 240 taskset -c 16-31 $L --fwd -2 --bwd 8,${LABBWD:-10,11} --log $OUT/labbwd.log 2>&1 | grep -v "^B=" | tail -30
  echo "=== lab done $(( $(date +%s) - T0 )) s"
) > $OUT/lab.log 2>&1 &
LABPID=$!
timeout 120 taskset -c 0-15 ./test_roundpipe gpu > $OUT/testgpu.log 2>&1; echo "test-gpu rc=$? $(( $(date +%s) - T0 )) s"
grep -E "FAIL|passed|failed|wgmma kernels|chunked" $OUT/testgpu.log | cut -c1-200 | tail -12
python3 scripts/make_random_shard.py /tmp/long262.bin --vocab 151936 --tokens $((3 * 262145)) >/dev/null
CUDA_VISIBLE_DEVICES=0 timeout 300 taskset -c 0-15 ./train_roundpipe --model qwen3-1.7b --device cuda:1 --train /tmp/long262.bin --val '' --batch 1 --seq 262144 --micro-batches 1 --recompute stage --mlp-chunk 16384 --host-checkpoints single --steps 2 --profile-ops --sample-tokens 0 --lr 1e-5 --profile-steps 0 > $OUT/long262.out 2>&1
echo "262K rc=$? $(( $(date +%s) - T0 )) s"
grep -E "^step|attention|matmul (f|b)wd$|plan for|S_f|device memory|error" $OUT/long262.out | cut -c1-170 | head -14
wait $LABPID; cat $OUT/lab.log | cut -c1-200
CUDA_VISIBLE_DEVICES=0 SKIP_BUILD=1 NO_PERF_MD=1 OUTDIR=/tmp/bench/l1 WARMUP=2 TIMED=3 MODELS=llama3.1-8b GPUS=1 timeout $(( 590 - ($(date +%s) - T0) )) scripts/bench_paper.sh 2>&1 | tail -2
echo "all done $(( $(date +%s) - T0 )) s"
