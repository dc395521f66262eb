#!/usr/bin/env bash
# scripts/check_loss_curve.sh — the GPU path learns like the CPU reference: a 200-step run of the
# default tiny model on the shipped corpus with --device cpu (fp32, plain) and --device cuda:1
# (bf16, the RoundPipe engine, --sync 1 so both apply the same update at the same step), same seed
# and data order. bf16 rounding makes the two runs drift apart step by step, and a loss plateau
# amplifies the drift (the runs leave it at slightly different steps), so the check is on what a
# bug would break: every one of the first 20 steps within 1%, the 20-step moving averages within
# 8% everywhere, and the mean of the last 100 steps within 1%.
#
#   make && scripts/check_loss_curve.sh        (on a GPU machine; STEPS=200 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-200}
OUT=${OUTDIR:-out/loss_curve}
mkdir -p "$OUT"
common="--steps $STEPS --eval-every 0 --sample-tokens 0 --val '' --seed 7"
eval ./train_roundpipe $common --device cpu --log "$OUT/cpu.jsonl" > "$OUT/cpu.out"
eval ./train_roundpipe $common --device cuda:1 --sync 1 --log "$OUT/gpu.jsonl" > "$OUT/gpu.out"
python3 - "$OUT/cpu.jsonl" "$OUT/gpu.jsonl" <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"loss"' in l]
b = [json.loads(l)["loss"] for l in open(sys.argv[2]) if '"loss"' in l]
assert len(a) == len(b) >= 120, (len(a), len(b))
rel = lambda x, y: abs(x - y) / x
early = max(rel(x, y) for x, y in zip(a[:20], b[:20]))
w = 20
avg = lambda v, i: sum(v[i:i + w]) / w
smooth = max(rel(avg(a, i), avg(b, i)) for i in range(len(a) - w + 1))
tail_a, tail_b = sum(a[-100:]) / 100, sum(b[-100:]) / 100
tail = rel(tail_a, tail_b)
print(f"steps {len(a)}: first loss cpu {a[0]:.4f} gpu {b[0]:.4f}; worst relative difference: "
      f"first 20 steps {early:.2e}, 20-step moving averages {smooth:.2e}; last-100 mean cpu "
      f"{tail_a:.4f} gpu {tail_b:.4f} ({tail:.2%})")
ok = early <= 1e-2 and smooth <= 0.08 and tail <= 0.01
print("loss curves agree" if ok else "LOSS CURVES DIFFER")
sys.exit(0 if ok else 1)
PY
