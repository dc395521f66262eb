#!/usr/bin/env bash
# dev/check_gpu.sh — the GPU checks of a built checkout, run on a machine with a CUDA GPU after a
# kernel or engine change: the `gpu` test suite, the kernel labs and a short throughput benchmark
# (about 3-4 minutes on an H200), with extra parts on request; a log per part and one verdict
# each. Build first (`make && make dev-cuda`): nothing here compiles, except the labs when one of
# their binaries is missing.
#
#   dev/check_gpu.sh [options]
#
# Parts run by default (each can be skipped):
#   tests   ./test_roundpipe --no-skip gpu: the CUDA backend against the CPU one, op by op and for whole
#           models (HF parity, the engine)                                       --no-tests
#   labs    dev/cuda/run_labs.sh: every kernel lab's validation and benchmark    --no-labs
#           (--labs-validate-only: the validations only)
#   bench   scripts/bench_paper.sh for Qwen3-1.7B on one GPU, batch 128 x 2048, 2 warm-up and
#           2 timed steps, docs/PERF.md untouched (MODELS, GPUS, BATCH, SEQ, MICRO, WARMUP,
#           TIMED, EXTRA from the environment override these)                   --no-bench
# Parts run on request:
#   --memcheck        compute-sanitizer memcheck of the gpu suite's kernel tests (the tests in
#                     MEMCHECK_TESTS, default: embedding, rmsnorm, qk-norm+rope, cross-entropy,
#                     swiglu/add)
#   --attention ARGS  the attention lab: dev/cuda/run_attention.sh ARGS (one word list, e.g.
#                     "--tiny --no-big"; "" for its defaults)
#   --long-seq SEQ    Qwen3-1.7B on one GPU, one sequence of SEQ tokens per step (random weights
#                     and tokens, stage recompute, chunked MLP, one host checkpoint), 2 steps with
#                     --profile-ops (LONG_STEPS changes the count)
# Other options:
#   --out DIR         logs (default out/check_gpu)
#   --time-limit S    seconds per part (default 600)
#   -h, --help        this text
#
# CUDA_VISIBLE_DEVICES picks the GPUs as usual. Exit status: 0 every part that ran passed, 1 a
# part failed, 2 bad usage or no binaries. Runs longer than one sitting (a 786K-token step takes
# ~15 minutes) go through scripts/run_detached.sh.
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "check_gpu.sh: $*" >&2; exit 2; }

tests=1 labs=1 bench=1 labs_validate_only=0 memcheck=0 attention="" attention_on=0 long_seq=""
out=out/check_gpu limit=600
while [ $# -gt 0 ]; do
    case "$1" in
    --no-tests) tests=0 ;;
    --no-labs) labs=0 ;;
    --no-bench) bench=0 ;;
    --labs-validate-only) labs_validate_only=1 ;;
    --memcheck) memcheck=1 ;;
    --attention) [ $# -ge 2 ] || die "--attention takes the lab's arguments (\"\" for none)"
        attention=$2; attention_on=1; shift ;;
    --long-seq) [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--long-seq takes a number of tokens"
        long_seq=$2; shift ;;
    --out) [ -n "${2:-}" ] || die "--out takes a folder"
        out=$2; shift ;;
    --time-limit) [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--time-limit takes seconds"
        limit=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check_gpu.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
[ -x ./test_roundpipe ] && [ -x ./train_roundpipe ] ||
    die "./train_roundpipe and ./test_roundpipe are missing: build them first (make)"
command -v nvidia-smi > /dev/null && nvidia-smi -L 2>/dev/null | head -8
mkdir -p "$out"

T0=$(date +%s)
verdicts=""
failed=0
# part NAME LOG COMMAND...: run COMMAND (a program; a shell function through `bash -c` after
# `export -f`) under the time limit with its output in LOG; prints the log's last lines and
# records the verdict.
part() {
    local name=$1 log=$2 rc t=$(date +%s)
    shift 2
    echo "=== $name ($(( t - T0 )) s into the run)"
    timeout "$limit" "$@" > "$log" 2>&1
    rc=$?
    tail -n "${TAIL_LINES:-8}" "$log" | cut -c1-200
    local v="passed"
    [ "$rc" = 0 ] || { v="FAILED (exit status $rc$([ "$rc" = 124 ] && echo ": over $limit s"))"; failed=1; }
    verdicts+="$(printf '%-10s %s, %d s, log %s' "$name" "$v" $(( $(date +%s) - t )) "$log")"$'\n'
}

if [ "$tests" = 1 ]; then
    part tests "$out/test_gpu.log" ./test_roundpipe --no-skip gpu
    verdicts+="           $(tail -n 1 "$out/test_gpu.log" | cut -c1-100)"$'\n'  # the skipped count
fi
if [ "$labs" = 1 ]; then
    lab_args=(--out "$out/labs")
    [ "$labs_validate_only" = 1 ] && lab_args+=(--validate-only)
    TAIL_LINES=30 part labs "$out/labs.log" dev/cuda/run_labs.sh "${lab_args[@]}"
fi
if [ "$memcheck" = 1 ]; then
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
    if [ -z "$cs" ]; then
        verdicts+="memcheck   FAILED (compute-sanitizer not found)"$'\n'
        failed=1
    else
        memcheck_all() {
            local t rc=0
            for t in ${MEMCHECK_TESTS:-gpu_embedding gpu_rmsnorm gpu_qknorm_rope gpu_crossentropy gpu_swiglu_add}; do
                echo "--- $t"
                "$cs" --tool memcheck --error-exitcode 9 --print-limit 5 ./test_roundpipe "$t" || rc=1
            done
            return $rc
        }
        export -f memcheck_all
        export cs
        part memcheck "$out/memcheck.log" bash -c memcheck_all
        grep -E "^--- |ERROR SUMMARY" "$out/memcheck.log"
    fi
fi
if [ "$attention_on" = 1 ]; then
    # shellcheck disable=SC2086  # the lab's arguments are one word list
    TAIL_LINES=20 part attention "$out/attention.log" dev/cuda/run_attention.sh $attention
fi
if [ "$bench" = 1 ]; then
    part bench "$out/bench.log" env SKIP_BUILD=1 NO_PERF_MD=1 OUTDIR="$out/bench" \
        MODELS="${MODELS:-qwen3-1.7b}" GPUS="${GPUS:-1}" WARMUP="${WARMUP:-2}" \
        TIMED="${TIMED:-2}" scripts/bench_paper.sh
fi
if [ -n "$long_seq" ]; then
    steps=${LONG_STEPS:-2}
    shard="$out/long_$long_seq.bin"
    long_run() {
        python3 scripts/make_random_shard.py "$shard" --vocab 151936 \
            --tokens $(( (steps + 1) * (long_seq + 1) )) > /dev/null || return 1
        ./train_roundpipe --model qwen3-1.7b --device cuda:1 --train "$shard" --val '' --batch 1 \
            --seq "$long_seq" --micro-batches 1 --recompute stage --mlp-chunk 16384 \
            --host-checkpoints single --steps "$steps" --profile-ops --sample-tokens 0 \
            --lr 1e-5 --profile-steps 0
    }
    export -f long_run
    export steps shard long_seq
    part "long-seq" "$out/long_seq.log" bash -c long_run
    grep -E "^step|device memory" "$out/long_seq.log" | cut -c1-170 | head -6
    rm -f "$shard"
fi

echo
echo "=== summary ($(( $(date +%s) - T0 )) s)"
printf "%s" "${verdicts:-nothing ran}"
[ -z "$verdicts" ] && echo
exit "$failed"
