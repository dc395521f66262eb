#!/usr/bin/env python3
"""
check_hf_load.py -- does HF transformers load what `--export-hf` writes, to the same model?

For each source model (a quantized LLaMA GGUF with llama3 RoPE and an untied head, and a Qwen3
GGUF with QK-norm and a tied head) this script:
  1. trains it for 3 steps with ./train_roundpipe and exports it with --export-hf, forced into
     shards (--export-shard-size 20000: model-0000i-of-0000n.safetensors + index), F32 and BF16;
  2. runs ./train_roundpipe --model <export> --dump-state on one batch: our loss and the gradient
     of every parameter on that batch;
  3. loads the export with AutoModelForCausalLM.from_pretrained (CPU, fp32, eager attention),
     computes the logits of the same batch, the mean cross-entropy over all B*T positions and its
     gradients, and compares them with ours. The loss and the gradients are functions of every
     logit, so agreement checks the logits (and the config: RoPE scaling, tying, head_dim, eps).

Tolerances: F32 export: loss 1e-5 relative, every gradient 1e-4 relative L2 (the parity suite's
bounds). BF16 export: it must load as bfloat16 and its fp32-upcast weights must equal the F32
export's weights rounded to bf16 exactly.

Run here (CPU; torch 2.15.0, transformers 5.24.0) from the repository root after `make`
(TRAINER=path overrides ./train_roundpipe):
    python3 dev/export/check_hf_load.py
Recorded result (2 cores, about 5 s):
    llama (from llama_q8_0.gguf): 4 shards + index; loss ours 5.42643261 HF 5.42643261
        (rel 0.0e+00); 21 gradients, worst rel L2 1.5e-06; bf16 export loads as torch.bfloat16,
        weights == bf16(F32 export) exactly
    qwen3 (from qwen3_f32.gguf): 6 shards + index; loss ours 5.33272886 HF 5.33272886
        (rel 0.0e+00); 24 gradients, worst rel L2 1.4e-06; bf16 export loads as torch.bfloat16,
        weights == bf16(F32 export) exactly
    all checks passed
"""

import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, T = 2, 16
SOURCES = [("llama", "dev/gguf/fixtures/llama_q8_0.gguf"), ("qwen3", "dev/gguf/fixtures/qwen3_f32.gguf")]


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
    return r.stdout


def check(name, src, tmp, shard, tokens):
    common = ["--train", shard, "--val", "", "--batch", str(B), "--seq", str(T),
              "--sample-tokens", "0", "--threads", "2"]
    out32 = os.path.join(tmp, f"{name}_f32")
    out16 = os.path.join(tmp, f"{name}_bf16")
    trainer("--model", src, *common, "--steps", "3", "--lr", "1e-2", "--export-hf", out32,
            "--export-shard-size", "20000")
    trainer("--model", src, *common, "--steps", "3", "--lr", "1e-2", "--export-hf", out16,
            "--export-dtype", "bf16")
    n_shards = len([f for f in os.listdir(out32) if f.startswith("model-")])
    assert os.path.exists(os.path.join(out32, "model.safetensors.index.json")) and n_shards > 1
    dump_path = os.path.join(tmp, f"{name}_dump.safetensors")
    trainer("--model", out32, *common, "--dump-state", dump_path)
    dump = load_file(dump_path)

    model = AutoModelForCausalLM.from_pretrained(out32, dtype=torch.float32,
                                                 attn_implementation="eager")
    # the first unshuffled batch: window b = tokens[b*(T+1) : (b+1)*(T+1)]
    win = torch.tensor(np.asarray(tokens[: B * (T + 1)], dtype=np.int64).reshape(B, T + 1))
    logits = model(input_ids=win[:, :T]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1))
    loss.backward()
    ours = float(dump["loss"][0])
    rel = abs(ours - loss.item()) / abs(loss.item())
    assert rel <= 1e-5, f"{name}: loss ours {ours} HF {loss.item()}"
    worst, n = 0.0, 0
    for pname, p in model.named_parameters():
        g = dump[f"grad.{pname}"]
        ref = p.grad.detach().numpy()
        err = np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-30)
        assert err <= 1e-4, f"{name}: grad {pname} rel L2 {err}"
        worst, n = max(worst, err), n + 1
    assert n == len([k for k in dump if k.startswith("grad.")])

    m16 = AutoModelForCausalLM.from_pretrained(out16, dtype="auto")
    dt = next(m16.parameters()).dtype
    assert dt == torch.bfloat16, dt
    sd32 = model.state_dict()
    for k, v in m16.state_dict().items():
        want = sd32[k].detach().to(torch.bfloat16).float()
        assert torch.equal(v.float(), want), f"{name}: bf16 {k}"
    print(f"{name} (from {os.path.basename(src)}): {n_shards} shards + index; loss ours {ours:.8f} "
          f"HF {loss.item():.8f} (rel {rel:.1e}); {n} gradients, worst rel L2 {worst:.1e}; bf16 "
          f"export loads as {dt}, weights == bf16(F32 export) exactly")


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = [(i * 7 + i // 5) % 64 for i in range(600)]
        shard = os.path.join(tmp, "shard.bin")
        write_shard(shard, tokens)
        for name, src in SOURCES:
            check(name, src, tmp, shard, tokens)
    print("all checks passed")


if __name__ == "__main__":
    main()
