#!/usr/bin/env python3
"""
check_gguf_read.py -- does the official reader (gguf-py's GGUFReader, from llama.cpp) read what
`--export-gguf` writes, with the layout llama.cpp expects?

For each source (the HF fixtures dev/gguf/fixtures/{llama,qwen3}, and the GGUF fixture
llama_f32.gguf, which carries a tokenizer) and each --export-dtype (f32, f16, bf16), the script
exports with ./train_roundpipe --steps 0 and checks with GGUFReader:
  - general.architecture, block_count, embedding_length, head counts, key_length,
    layer_norm_rms_epsilon, rope.freq_base, general.file_type (0 / 1 / 32);
  - every tensor: the GGUF name (docs/FORMATS.md §4.4), ne = the HF shape reversed, 2-D weights
    in the export
    dtype and 1-D norms F32 (as llama.cpp's converter), data equal to the HF weights (rounded to
    the dtype) with LLaMA q/k rows permuted as LlamaModel.permute does; no output.weight for a
    tied model; rope_freqs.weight for llama3 equal to the converter's factors;
  - tokenizer: the source GGUF's tokenizer.* fields unchanged; without one, tokenizer.ggml.model
    is "no_vocab" (what llama.cpp loads as a model without a vocabulary);
  - offsets packed in tensor order with 32-byte alignment (ggml's own reader requires that).

Run here (gguf 0.19.0, numpy 2.4.6) from the repository root after `make` (TRAINER=path
overrides ./train_roundpipe):
    python3 dev/export/check_gguf_read.py
Recorded result (about 2 s):
    llama (HF) f32: 21 tensors checked + rope_freqs
    llama (HF) f16: 21 tensors checked + rope_freqs
    llama (HF) bf16: 21 tensors checked + rope_freqs
    qwen3 (HF) f32: 24 tensors checked
    qwen3 (HF) f16: 24 tensors checked
    qwen3 (HF) bf16: 24 tensors checked
    llama_f32.gguf f32: 21 tensors checked + rope_freqs, 8 tokenizer fields identical
    llama_f32.gguf f16: 21 tensors checked + rope_freqs, 8 tokenizer fields identical
    llama_f32.gguf bf16: 21 tensors checked + rope_freqs, 8 tokenizer fields identical
    all checks passed
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "dev", "gguf"))
from make_fixtures import gguf_name, llama_permute  # noqa: E402  (the converter's rules)

DTYPES = {"f32": (QT.F32, 0), "f16": (QT.F16, 1), "bf16": (QT.BF16, 32)}


def trainer(*args):
    cmd = [os.environ.get("TRAINER", "./train_roundpipe"), *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")


def field(r, key):
    f = r.fields[key]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]][0]


def rounded(a, dtype):
    if dtype == "f16":
        return a.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16  # round to nearest even
        return u.astype(np.uint32).view(np.float32)
    return a


def llama3_factors(cfg):
    rp = cfg["rope_parameters"]
    base, dim = rp["rope_theta"], cfg["head_dim"]
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, lf, hf = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < old / hf:
            out.append(1.0)
        elif wl > old / lf:
            out.append(factor)
        else:
            s = (old / wl - lf) / (hf - lf)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def check(label, src_spec, hf_dir, dtype, tmp, src_gguf=None):
    out = os.path.join(tmp, f"{label.replace(' ', '_')}_{dtype}.gguf")
    trainer("--model", src_spec, "--steps", "0", "--sample-tokens", "0", "--val", "",
            "--train", "data/tiny_val.bin", "--export-gguf", out, "--export-dtype", dtype)
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    r = gguf.GGUFReader(out)
    arch = cfg["model_type"]
    qtype, file_type = DTYPES[dtype]
    assert field(r, "general.architecture") == arch
    assert field(r, "general.file_type") == file_type
    assert field(r, f"{arch}.block_count") == cfg["num_hidden_layers"]
    assert field(r, f"{arch}.embedding_length") == cfg["hidden_size"]
    assert field(r, f"{arch}.feed_forward_length") == cfg["intermediate_size"]
    assert field(r, f"{arch}.attention.head_count") == cfg["num_attention_heads"]
    assert field(r, f"{arch}.attention.head_count_kv") == cfg["num_key_value_heads"]
    assert field(r, f"{arch}.attention.key_length") == cfg["head_dim"]
    assert np.float32(field(r, f"{arch}.attention.layer_norm_rms_epsilon")) == np.float32(cfg["rms_norm_eps"])
    assert field(r, f"{arch}.rope.freq_base") == np.float32(cfg["rope_parameters"]["rope_theta"])

    tensors = {t.name: t for t in r.tensors}
    n = 0
    for hf, w in weights.items():
        if cfg["tie_word_embeddings"] and hf == "lm_head.weight":
            continue
        t = tensors.pop(gguf_name(hf))
        assert list(t.shape) == list(reversed(w.shape)), (hf, t.shape, w.shape)
        want_type = QT.F32 if w.ndim == 1 else qtype
        assert t.tensor_type == want_type, (hf, t.tensor_type)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            w = llama_permute(w, cfg["num_attention_heads"])
        if arch == "llama" and hf.endswith("k_proj.weight"):
            w = llama_permute(w, cfg["num_key_value_heads"])
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape).astype(np.float32)
        want = w if w.ndim == 1 else rounded(w, dtype)
        assert np.array_equal(got, want), f"{label} {dtype}: {hf}"
        n += 1
    extra = ""
    if arch == "llama":
        rf = tensors.pop("rope_freqs.weight")
        assert np.allclose(rf.data, llama3_factors(cfg), rtol=1e-6), rf.data
        extra = " + rope_freqs"
    assert not tensors, f"unexpected tensors {list(tensors)}"
    assert "output.weight" not in [t.name for t in r.tensors] or not cfg["tie_word_embeddings"]
    # packed offsets, 32-byte aligned, in tensor order
    expect = 0
    for t in r.tensors:
        assert t.data_offset - r.tensors[0].data_offset == expect and t.data_offset % 32 == 0
        expect += (t.n_bytes + 31) // 32 * 32
    if src_gguf:
        s = gguf.GGUFReader(src_gguf)
        keys = [k for k in s.fields if k.startswith("tokenizer.")]
        for k in keys:
            a, b = s.fields[k], r.fields[k]
            assert a.types == b.types and all(np.array_equal(a.parts[i], b.parts[i]) for i in a.data), k
        extra += f", {len(keys)} tokenizer fields identical"
    else:
        assert field(r, "tokenizer.ggml.model") == "no_vocab"
    print(f"{label} {dtype}: {n} tensors checked{extra}")


def main():
    fx = os.path.join(ROOT, "dev", "gguf", "fixtures")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("llama", "qwen3"):
            for dt in DTYPES:
                check(f"{name} (HF)", f"dev/gguf/fixtures/{name}", os.path.join(fx, name), dt, tmp)
        for dt in DTYPES:
            check("llama_f32.gguf", "dev/gguf/fixtures/llama_f32.gguf", os.path.join(fx, "llama"),
                  dt, tmp, src_gguf=os.path.join(fx, "llama_f32.gguf"))
    print("all checks passed")


if __name__ == "__main__":
    main()
