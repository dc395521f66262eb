#!/usr/bin/env bash
# dev/cuda/check_attention_refactor.sh — for a change to the attention kernels that must keep
# their results and their speed (a refactor): two builds of the attention lab
# (dev/cuda/attention.cu), compared bit for bit and timed side by side on one Hopper GPU.
#
#   dev/cuda/check_attention_refactor.sh BASE_LAB NEW_LAB [LOGDIR]          (GPU, ~5 minutes)
#     1. validation of both labs against the CPU reference: every forward variant and the
#        deterministic backward variants 0-7 (NEW_LAB also on the B=3 T=131072 case)
#     2. both labs' outputs on fixed cases (--check-dump: out, lse, dq, dk, dv of every such
#        variant), compared bit for bit per tensor (NEW_LAB --check-compare)
#     3. forward and backward TFLOP/s of the C interface (variant 0) and of the mma.sync
#        production shapes (forward 4, backward 2), base and new alternating, twice each
#     Exit status 0 when both validations pass and every tensor is bit-identical (the timings
#     are for reading: the same instructions should run at the same speed, within noise). Logs
#     in LOGDIR (default .devbuild/refactor_check); the dumps (~0.8 GB each) go to a temporary
#     folder, removed at the end unless KEEP_DUMPS=1. QUICK=1 validates the --quick cases only.
#   dev/cuda/check_attention_refactor.sh --build REV OUT                       (no GPU needed)
#     build the lab of git revision REV (`.` = this work tree) into OUT, for sm_90a as
#     dev/cuda/run_attention.sh does; a lab older than the --check-* modes gets this tree's
#     refactor-check block spliced in (the block between its "[refactor check: begin]" and
#     "[refactor check: end]" markers, before main, and the one line in main that calls it).
#
# Typical use: dev/cuda/check_attention_refactor.sh --build BASE_COMMIT .devbuild/attention_base
#              dev/cuda/check_attention_refactor.sh --build . .devbuild/attention_new
#              then on the GPU machine, with both binaries there:
#              dev/cuda/check_attention_refactor.sh .devbuild/attention_base .devbuild/attention_new
set -uo pipefail
cd "$(dirname "$0")/../.."

usage() {
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
}

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}

# ---------------------------------------------------------------------------------------------
# --build REV OUT

build_lab() {
    local rev=$1 out=$2 src tmp=""
    if [ "$rev" = . ]; then
        src=.
    else
        tmp=$(mktemp -d)
        git archive "$rev" kernels dev/cuda | tar -x -C "$tmp" || { rm -rf "$tmp"; exit 1; }
        src=$tmp
        if ! grep -q '\[refactor check: begin\]' "$tmp/dev/cuda/attention.cu"; then
            echo "splicing this tree's refactor-check block into the lab of $rev"
            sed -n '/\[refactor check: begin\]/,/\[refactor check: end\]/p' dev/cuda/attention.cu \
                > "$tmp/check_block.txt"
            awk -v blk="$tmp/check_block.txt" '
                /^int main\(int argc, char\*\* argv\) \{$/ {
                    while ((getline line < blk) > 0) print line
                    print
                    print "    if (argc > 1 && !strncmp(argv[1], \"--check-\", 8)) return check_main(argc, argv);"
                    found = 1
                    next
                }
                { print }
                END { if (!found) exit 1 }' "$tmp/dev/cuda/attention.cu" > "$tmp/lab.cu" ||
                { echo "no main() to splice into in $rev"; rm -rf "$tmp"; exit 1; }
            mv "$tmp/lab.cu" "$tmp/dev/cuda/attention.cu"
        fi
    fi
    mkdir -p "$(dirname "$out")"
    echo "building $out from $rev with $NVCC"
    "$NVCC" -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -DATTN_WGMMA_BUILD=1 -lineinfo \
        --expt-relaxed-constexpr -Xptxas -v \
        -Xcompiler -Wall,-Wextra,-Werror,-static-libstdc++,-static-libgcc \
        -o "$out" "$src/dev/cuda/attention.cu" 2> "$out.ptxas.txt" ||
        { cat "$out.ptxas.txt"; [ -n "$tmp" ] && rm -rf "$tmp"; exit 1; }
    [ -n "$tmp" ] && rm -rf "$tmp"
    echo "built $out (ptxas report: $out.ptxas.txt; kernels with spills: $(
        grep "spill stores" "$out.ptxas.txt" | grep -vc " 0 bytes spill stores"))"
}

if [ "${1:-}" = --build ]; then
    [ $# = 3 ] || usage
    build_lab "$2" "$3"
    exit 0
fi
case "${1:-}" in -h | --help | "") usage ;; esac
[ $# = 2 ] || [ $# = 3 ] || usage

# ---------------------------------------------------------------------------------------------
# BASE_LAB NEW_LAB [LOGDIR]

BASE=$1 NEW=$2 LOG=${3:-.devbuild/refactor_check}
for b in "$BASE" "$NEW"; do
    if ! "$b" --probe >/dev/null 2>&1; then
        echo "$b does not run here (not a lab binary, or no GPU / driver)"
        exit 1
    fi
    if ! grep -q -- --check-compare <<< "$("$b" --check-dump 2>&1)"; then
        echo "$b has no --check-* modes: build it with $0 --build REV OUT"
        exit 1
    fi
done
if ! "$NEW" --check-time 1,1,1,1,16 - - > /dev/null 2>&1; then
    echo "no usable GPU here: $("$NEW" --check-time 1,1,1,1,16 - - 2>&1 | tail -1)"
    exit 1
fi
mkdir -p "$LOG"
DUMPS=$(mktemp -d)
T0=$SECONDS
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>/dev/null

echo "=== 1. validation (every forward variant, backward 0-7)"
VARGS="--no-bench --bwd 0,1,2,3,4,5,6,7"
[ "${QUICK:-0}" = 1 ] && VARGS="$VARGS --quick"
for which in base new; do
    bin=$BASE extra="--no-big"
    [ $which = new ] && bin=$NEW extra=""
    timeout 300 "$bin" $VARGS $extra --log "$LOG/validate_$which.log" > "$LOG/validate_$which.out" 2>&1
    rc=$?
    echo "$which: status $rc ($((SECONDS - T0)) s)"
    grep -E "^validation|worst|^big|sampled|whole|FAIL|PASSED|CUDA error" \
        "$LOG/validate_$which.out" | head -40
    [ $rc = 0 ] || status=1
done

echo "=== 2. outputs bit for bit ($((SECONDS - T0)) s)"
for which in base new; do
    bin=$BASE
    [ $which = new ] && bin=$NEW
    timeout 240 "$bin" --check-dump "$DUMPS/$which.bin" > "$LOG/dump_$which.out" 2>&1
    rc=$?
    echo "$which dump: status $rc, $(grep -c "^check-dump" "$LOG/dump_$which.out") cases" \
        "($((SECONDS - T0)) s)"
    [ $rc = 0 ] || { status=1; tail -5 "$LOG/dump_$which.out"; }
done
timeout 120 "$NEW" --check-compare "$DUMPS/base.bin" "$DUMPS/new.bin" > "$LOG/compare.out" 2>&1
rc=$?
head -40 "$LOG/compare.out"
[ "$(wc -l < "$LOG/compare.out")" -gt 41 ] && echo "  ... (all in $LOG/compare.out)" && tail -1 "$LOG/compare.out"
[ $rc = 0 ] || status=1
if [ "${KEEP_DUMPS:-0}" = 1 ]; then echo "dumps kept in $DUMPS"; else rm -rf "$DUMPS"; fi

echo "=== 3. speed: median TFLOP/s, base and new alternating, twice each ($((SECONDS - T0)) s)"
# shape (B,T,H,KVH,HD), forward variants, backward variants
SHAPES=(
    "1,4096,16,8,128 0,4 0,2"
    "1,16384,16,8,128 0,4 0,2"
    "1,65536,16,8,128 0 0"
    "1,16384,16,8,64 0,4 0,2"
    "4,4096,16,8,32 0 0"
)
: > "$LOG/time.out"
for line in "${SHAPES[@]}"; do
    read -r shape fwd bwd <<< "$line"
    for round in 1 2; do
        for which in base new; do
            bin=$BASE
            [ $which = new ] && bin=$NEW
            timeout 120 "$bin" --check-time "$shape" "$fwd" "$bwd" 10 2>&1 |
                sed "s/^/$shape $which $round /" >> "$LOG/time.out"
        done
    done
done
printf "%-18s %-4s %-28s %17s %17s %7s\n" shape pass variant "base TFLOP/s" "new TFLOP/s" "new/base"
awk '$4 == "check-time" {
        key = $1 " " $5 " " $6; v = $8
        name = $9; for (i = 10; i <= NF; i++) name = name " " $i
        names[key] = name
        if (!(key in seen)) { order[n++] = key; seen[key] = 1 }
        if ($2 == "base") base[key] = base[key] (base[key] == "" ? "" : "/") v
        else new[key] = new[key] (new[key] == "" ? "" : "/") v
        if ($2 == "base") { bs[key] += v; bn[key]++ } else { ns[key] += v; nn[key]++ }
     }
     END {
        for (i = 0; i < n; i++) {
            k = order[i]; split(k, p, " ")
            r = (bn[k] && nn[k] && bs[k] > 0) ? sprintf("%.3f", (ns[k] / nn[k]) / (bs[k] / bn[k])) : "-"
            printf "%-18s %-4s %-28s %17s %17s %7s\n", p[1], p[2], names[k], base[k], new[k], r
        }
     }' "$LOG/time.out"
grep -v "check-time" "$LOG/time.out" | head -5

echo "=== done in $((SECONDS - T0)) s: $([ $status = 0 ] && echo PASSED || echo FAILED)" \
    "(validation of both labs, outputs bit-identical; logs in $LOG)"
exit $status
