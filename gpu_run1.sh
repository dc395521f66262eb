#!/usr/bin/env bash
# one device call: build, GPU tests, MoE labs, attention sink lab
set -u
O=${OUT:-out}; mkdir -p $O
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
( make -j16 && make -j16 dev-cuda ) > $O/build.log 2>&1; echo "build rc=$? $(( $(date +%s)-t0 ))s" | tee -a $O/summary.txt
timeout 200 ./test_roundpipe --no-skip gpu > $O/test_gpu.log 2>&1; echo "test gpu rc=$? $(( $(date +%s)-t0 ))s" | tee -a $O/summary.txt
grep -E "^(FAIL|ok|skip)|passed," $O/test_gpu.log | tee -a $O/summary.txt
timeout 120 dev/cuda/build/moe_matmul > $O/lab_moe_matmul.log 2>&1; echo "lab moe_matmul rc=$? $(( $(date +%s)-t0 ))s" | tee -a $O/summary.txt
timeout 60 dev/cuda/build/moe > $O/lab_moe.log 2>&1; echo "lab moe rc=$? $(( $(date +%s)-t0 ))s" | tee -a $O/summary.txt
ATTN_LOGDIR=$O timeout 150 dev/cuda/run_attention.sh --sink > $O/lab_attn_sink.log 2>&1; echo "lab attn sink rc=$? $(( $(date +%s)-t0 ))s" | tee -a $O/summary.txt
cd $O && tar czf logs.tgz *.log && rm -f *.log
