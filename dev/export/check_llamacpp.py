#!/usr/bin/env python3
"""
check_llamacpp.py -- does llama.cpp load what `--export-gguf` writes, to the same model?

For each source model (the LLaMA fixture with llama3 RoPE scaling and an untied head, whose q/k
rows the exporter permutes for llama.cpp, and the Qwen3 fixture with QK-norm and a tied head)
this script:
  1. exports it with ./train_roundpipe --steps 0 --export-gguf (F32);
  2. runs ./train_roundpipe --model <source> --dump-state on one batch of B x T tokens: our mean
     cross-entropy over all B*T positions;
  3. loads the GGUF with llama.cpp (the llama-cpp-python bindings, CPU, F32), evaluates the same
     token rows with logits for every position, computes the same mean cross-entropy from
     llama.cpp's logits and compares. The loss is a function of every logit, so agreement checks
     the export (names, dimension order, q/k permutation, rope_freqs, tying, eps, head_dim).

Tolerance: 1e-4 relative (llama.cpp's F32 kernels accumulate in their own order).

Needs `pip install llama-cpp-python` (builds llama.cpp from source) and numpy. Run from the
repository root after `make` (TRAINER=path overrides ./train_roundpipe):
    python3 dev/export/check_llamacpp.py
Recorded result (2026-11-30, 2-core CPU container, llama-cpp-python 0.3.36 built from source):
    llama: loss ours 4.89146996 llama.cpp 4.89146931 (rel 1.3e-07) ok
    qwen3: loss ours 6.12969351 llama.cpp 6.12972707 (rel 5.5e-06) ok
    all checks passed
"""

import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, T = 2, 16
SOURCES = [("llama", "dev/parity/fixtures/llama"), ("qwen3", "dev/parity/fixtures/qwen3")]


def write_shard(path, tokens):
    hdr = np.zeros(256, dtype=np.int32)
    hdr[0], hdr[1], hdr[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(hdr.tobytes() + np.asarray(tokens, dtype=np.uint16).tobytes())


def trainer(*args):
    cmd = [os.environ.get("TRAINER", "./train_roundpipe"), *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")


def mean_ce(logits, targets):
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return float(np.mean(lse - z[np.arange(len(targets)), targets]))


def main():
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("check_llamacpp.py: needs llama-cpp-python (pip install llama-cpp-python)")
    rng = np.random.default_rng(7)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in SOURCES:
            tokens = rng.integers(0, 128, size=B * (T + 1))
            shard = os.path.join(tmp, f"{name}.bin")
            write_shard(shard, tokens)
            gguf = os.path.join(tmp, f"{name}.gguf")
            dump = os.path.join(tmp, f"{name}_dump.safetensors")
            trainer("--model", src, "--train", shard, "--val", "", "--batch", str(B), "--seq",
                    str(T), "--steps", "0", "--sample-tokens", "0", "--export-gguf", gguf,
                    "--export-dtype", "f32")
            trainer("--model", src, "--train", shard, "--val", "", "--batch", str(B), "--seq",
                    str(T), "--dump-state", dump)
            ours = float(load_file(dump)["loss"][0])
            llm = Llama(model_path=gguf, n_ctx=T, logits_all=True, verbose=False, n_threads=2)
            losses = []
            rows = tokens.reshape(B, T + 1)
            for b in range(B):
                llm.reset()
                llm.eval([int(x) for x in rows[b, :T]])
                logits = np.array(llm.scores[:T], dtype=np.float32)
                losses.append(mean_ce(logits, rows[b, 1:]))
            theirs = float(np.mean(losses))
            rel = abs(ours - theirs) / abs(ours)
            good = rel <= 1e-4
            ok &= good
            print(f"{name}: loss ours {ours:.8f} llama.cpp {theirs:.8f} (rel {rel:.1e}) "
                  f"{'ok' if good else 'MISMATCH'}")
    print("all checks passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
