#!/bin/bash
# bench.sh — encode speed of the C tokenizer on English text (target: >= 20 MB/s per core).
#
#   dev/tokenizer/bench.sh [TOKENIZER...]      (real tokenizer.json / .gguf files, optional)
#
# 1. English text: the docstrings of Python's standard library (about 1.2 MB of real prose), and
#    16 MB more made from them by a word-bigram chain (deterministic), in $OUT (default
#    /tmp/tokenizer_bench).
# 2. Tokenizers: the arguments; else, when the Python `tokenizers` package is there, LLaMA-3-
#    and Qwen2-style tokenizers with 32k-token vocabularies trained on that text (their merge
#    tables are of a realistic size, unlike the small test fixtures); else the test fixtures.
# 3. bench_tokenizer (bench.c, gcc -O3) on each: one core cold and warm, then all cores; the
#    ids of the prose are checked against HF tokenizers when the package is there, and HF's own
#    single-thread speed on the same text is printed for reference.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tokenizer_bench}
mkdir -p "$OUT"

python3 - "$OUT" <<'EOF'
import ast, os, random, sys, sysconfig
out = sys.argv[1]
if not os.path.exists(os.path.join(out, "prose.txt")):
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for dp, dn, fn in os.walk(root):
        dn.sort()
        if "test" in dp or "site-packages" in dp or "idlelib" in dp:
            continue
        for f in sorted(fn):
            if not f.endswith(".py"):
                continue
            try:
                tree = ast.parse(open(os.path.join(dp, f), encoding="utf-8").read())
            except Exception:
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    d = ast.get_docstring(node)
                    if d and len(d) > 200:
                        docs.append(d)
    prose = "\n\n".join(docs)
    open(os.path.join(out, "prose.txt"), "w").write(prose)
    # a word-bigram chain over the prose: 16 MB of English-like text with its word frequencies
    words = prose.split()
    follow = {}
    for a, b in zip(words, words[1:]):
        follow.setdefault(a, []).append(b)
    rng = random.Random(7)
    w, n, parts = "The", 0, []
    while n < 16_000_000:
        parts.append(w)
        n += len(w) + 1
        parts.append("\n\n" if rng.random() < 0.01 else "\n" if rng.random() < 0.08 else " ")
        nxt = follow.get(w)
        w = rng.choice(nxt) if nxt else rng.choice(words)
    open(os.path.join(out, "english16.txt"), "w").write("".join(parts))
print("corpus: %s/prose.txt, %s/english16.txt" % (out, out))
EOF

toks=("$@")
if [ ${#toks[@]} -eq 0 ]; then
    if python3 -c "import tokenizers" 2>/dev/null; then
        python3 - "$OUT" <<'EOF'
import os, sys
from tokenizers import Tokenizer, Regex, decoders, models, normalizers, pre_tokenizers, trainers
out = sys.argv[1]
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3 = QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
for name, regex, nfc, ignore in (("llama3_32k", LLAMA3, False, True), ("qwen3_32k", QWEN2, True, False)):
    path = os.path.join(out, name + ".json")
    if os.path.exists(path):
        continue
    tok = Tokenizer(models.BPE(ignore_merges=ignore))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([os.path.join(out, "english16.txt")], trainer)
    tok.save(path)
    print("trained", path)
EOF
        toks=("$OUT/llama3_32k.json" "$OUT/qwen3_32k.json")
    else
        toks=(dev/tokenizer/fixtures/llama3.json dev/tokenizer/fixtures/qwen3.json)
    fi
fi

gcc -std=c11 -D_GNU_SOURCE -O3 -march=native -Wall -Wextra -Werror -pthread -o "$OUT/bench_tokenizer" \
    dev/tokenizer/bench.c llmc/tokenizer*.c llmc/unicode.c llmc/unicode_tables.c \
    llmc/tokenize_shards.c llmc/threads.c llmc/json.c llmc/common.c llmc/gguf*.c llmc/config.c \
    llmc/tensor.c llmc/dataloader.c llmc/rng.c -lm

for tok in "${toks[@]}"; do
    for text in "$OUT/prose.txt" "$OUT/english16.txt"; do
        echo "----"
        "$OUT/bench_tokenizer" "$tok" "$text" --dump "$OUT/ids.bin"
        if [ "$text" = "$OUT/prose.txt" ] && python3 -c "import tokenizers" 2>/dev/null; then
            RAYON_NUM_THREADS=1 python3 - "$tok" "$text" "$OUT/ids.bin" <<'EOF'
import array, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
text = open(sys.argv[2], encoding="utf-8").read()
ids = tok.encode(text, add_special_tokens=False).ids
mine = array.array("i")
mine.frombytes(open(sys.argv[3], "rb").read())
lines = text.splitlines(keepends=True)
t0 = time.process_time()
tok.encode_batch(lines, add_special_tokens=False)
dt = time.process_time() - t0
print("HF tokenizers: ids %s; encode_batch of the lines, 1 thread: %.1f MB/s per CPU second" % (
    "identical" if list(mine) == ids else "DIFFER", len(text.encode()) / dt / 1e6))
EOF
        fi
    done
done
