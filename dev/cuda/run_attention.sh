#!/usr/bin/env bash
# dev/cuda/run_attention.sh — build and run the attention kernel lab (dev/cuda/attention.cu).
#
#   dev/cuda/run_attention.sh [lab flags]   build .devbuild/attention if missing (or ATTN_REBUILD=1,
#                                           or it does not load here), then validate and benchmark
#   dev/cuda/run_attention.sh --build-only  build only (no GPU needed); ptxas report in
#                                           .devbuild/attention_ptxas.txt (device code for sm_90a:
#                                           H100/H200 only)
#   ATTN_SDPA=1 dev/cuda/run_attention.sh   also time PyTorch SDPA (flash, cuDNN) at the benchmark
#                                           shapes (needs python3 with torch)
#
# Lab flags: --quick --tiny --no-big --no-bench --long --shape B,T,H,KVH,HD --fwd I[,J..]
# --bwd I[,J..] (dev/cuda/attention.cu's header; the lab's usage lists the variants); --sink
# [--no-bench]: the sink / sliding-window (GPT-OSS) validation and benchmark only. Logs go to
# $ATTN_LOGDIR (default .devbuild): attention_lab.log, attention_lab.out. When the lab dies of a
# CUDA error, the script re-runs small cases variant by variant, and under compute-sanitizer, to
# name the culprit. Exit status: the lab's (0 passed, 3 a check failed, 1 a CUDA error).
set -uo pipefail
cd "$(dirname "$0")/../.."

case "${1:-}" in -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
BIN=.devbuild/attention
LOGDIR=${ATTN_LOGDIR:-.devbuild}
mkdir -p .devbuild "$LOGDIR"

build() {
    echo "building $BIN with $NVCC"
    # sm_90a (architecture-specific Hopper target): the wgmma variants need it; the mma.sync
    # kernels are the same code either way. The binary then runs on compute capability 9.0 only.
    "$NVCC" -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -DATTN_WGMMA_BUILD=1 -lineinfo \
        --expt-relaxed-constexpr -Xptxas -v \
        -Xcompiler -Wall,-Wextra,-Werror,-static-libstdc++,-static-libgcc \
        -o "$BIN" dev/cuda/attention.cu 2> .devbuild/attention_ptxas.txt ||
        { cat .devbuild/attention_ptxas.txt; exit 1; }
    echo "kernels with register spills: $(grep "spill stores" .devbuild/attention_ptxas.txt |
        grep -vc " 0 bytes spill stores")"
}

if [ "${1:-}" = "--build-only" ]; then build; exit 0; fi
if [ "${ATTN_REBUILD:-0}" = 1 ] || ! "$BIN" --probe >/dev/null 2>&1; then build; fi

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader || true
"$BIN" --log "$LOGDIR/attention_lab.log" "$@" 2>&1 | tee "$LOGDIR/attention_lab.out"
rc=${PIPESTATUS[0]}

if [ "$rc" != 0 ] && [ "$rc" != 3 ]; then
    echo "lab exited with status $rc: re-running small cases one variant at a time"
    read -r nf nb < <("$BIN" --count)
    for ((v = 0; v < nf; v++)); do
        timeout 30 "$BIN" --tiny --no-big --no-bench --fwd "$v" --bwd -2 --log /dev/null 2>&1 | tail -3
        echo "  forward variant $v: status ${PIPESTATUS[0]}"
    done
    for ((v = 0; v < nb; v++)); do
        timeout 30 "$BIN" --tiny --no-big --no-bench --fwd 0 --bwd "$v" --log /dev/null 2>&1 | tail -3
        echo "  backward variant $v: status ${PIPESTATUS[0]}"
    done
    if command -v compute-sanitizer >/dev/null; then
        timeout 90 compute-sanitizer --tool memcheck --print-limit 5 "$BIN" --tiny --no-big \
            --no-bench --log /dev/null 2>&1 | tail -40
    fi
fi

if [ "${ATTN_SDPA:-0}" = 1 ]; then
    PYTHONUNBUFFERED=1 timeout 120 python3 - <<'PY' 2>&1 | tee "$LOGDIR/attention_sdpa.out"
# PyTorch SDPA (flash and cuDNN backends), same shapes and FLOP counts as the lab's benchmark.
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
H, KVH, HD = 16, 8, 128
def median_ms(fn, reps=10):
    for _ in range(2): fn()
    ts = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); z.record(); z.synchronize(); ts.append(a.elapsed_time(z))
    return sorted(ts)[len(ts) // 2]
for T, B in [(2048, 16), (4096, 4), (16384, 2)]:
    q = torch.randn(B, H, T, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KVH, T, HD, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, KVH, T, HD, device="cuda", dtype=torch.bfloat16)
    k = k.repeat_interleave(H // KVH, dim=1).requires_grad_()
    v = v.repeat_interleave(H // KVH, dim=1).requires_grad_()
    flops = 2.0 * B * H * T * T * HD
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                do = torch.randn_like(o)
                f = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                b = median_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            print(f"sdpa {name:5} T={T:<5} B={B:<2} forward {f:7.3f} ms {flops/f*1e-9:6.1f} TFLOP/s   "
                  f"backward {b:7.3f} ms {2.5*flops/b*1e-9:6.1f} TFLOP/s")
        except Exception as e:
            print(f"sdpa {name:5} T={T}: {type(e).__name__}: {str(e)[:100]}")
PY
fi
exit "$rc"
