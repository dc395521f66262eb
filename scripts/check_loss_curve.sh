#!/usr/bin/env bash
# scripts/check_loss_curve.sh — the GPU path learns like the CPU reference: a 200-step run of the
# default tiny model on the shipped corpus with --device cpu (fp32, plain) and --device cuda:1
# (bf16, the RoundPipe engine, --sync 1 so both apply the same update at the same step), same seed
# and data order. Passes when every step's loss agrees within bf16 noise: |gpu - cpu| <= 3e-2 *
# cpu for the first 50 steps and the last-20-step means within 2%.
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
assert len(a) == len(b) > 20, (len(a), len(b))
early = max(abs(x - y) / x for x, y in zip(a[:50], b[:50]))
late_a, late_b = sum(a[-20:]) / 20, sum(b[-20:]) / 20
late = abs(late_a - late_b) / late_a
print(f"steps {len(a)}: first loss cpu {a[0]:.4f} gpu {b[0]:.4f}; worst relative difference over "
      f"the first 50 steps {early:.2e}; last-20 mean cpu {late_a:.4f} gpu {late_b:.4f} ({late:.2%})")
ok = early <= 3e-2 and late <= 0.02
print("loss curves agree" if ok else "LOSS CURVES DIFFER")
sys.exit(0 if ok else 1)
PY
