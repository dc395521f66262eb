#!/usr/bin/env python3
"""
make_fixtures.py -- GGUF fixtures for the C tests (llmc/tests/test_gguf.c), written by the
official `gguf` package (llama.cpp gguf-py), the same library llama.cpp's HF->GGUF converter uses.

Output under fixtures/ (under 500 KB in all):

  llama/, qwen3/              tiny random HF models (save_pretrained: config.json +
                              model.safetensors, fp32). llama: llama3 RoPE scaling, GQA, untied
                              head. qwen3: QK-norm, head_dim != hidden/heads, tied head.
  <model>_<type>.gguf         the same models converted the way convert_hf_to_gguf.py does it:
                              metadata keys and GGUF names of docs/FORMATS.md §4.2 and §4.4,
                              ne = shape reversed, LLaMA q/k rows permuted (docs/FORMATS.md §4.4),
                              rope_freqs.weight for llama3, a small
                              tokenizer (tokens, token types, merges, special ids, chat template).
                              Types: f32, f16, bf16 (all weights); q8_0, q4_0, mxfp4 (2-D weights
                              quantized with gguf.quants.quantize, 1-D norms stay F32, as llama.cpp
                              does).
  quant_zoo.gguf              one [2, 256] tensor per ggml type we read ("<type>.q") next to the
                              oracle's dequantisation ("<type>.expected", F32, from
                              gguf.quants.dequantize). Q4_K / Q6_K (dequantize-only in gguf-py)
                              and a second MXFP4 tensor are random blocks with finite scales. Also
                              a Q2_K tensor (must be refused by name), metadata of every value
                              type including nested arrays, and general.alignment = 64.

The C test checks: F32 GGUF == safetensors exactly (after un-permuting q/k), F16/BF16 == the
rounded safetensors values exactly, quantized models within the quantisation error, and every zoo
tensor exactly equal to the oracle.

This is a development tool (dev/); it needs torch, transformers, numpy and gguf (pip), no GPU.
Recorded run: gguf 0.19.0, transformers 5.24.0, torch 2.15.0, numpy 2.4.6.

Usage:  python3 dev/gguf/make_fixtures.py [--out DIR]
"""

import argparse
import os
import shutil

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

SIZE_BUDGET = 500 * 1024


# ----------------------------------------------------------------------------
# models


def make_llama():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=512, rope_parameters=rope, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", bos_token_id=1,
        eos_token_id=2, pad_token_id=None, dtype="float32")
    torch.manual_seed(3001)
    return "llama", cfg, LlamaForCausalLM(cfg)


def make_qwen3():
    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu",
        use_sliding_window=False, sliding_window=None, bos_token_id=1, eos_token_id=2,
        pad_token_id=None, dtype="float32")
    torch.manual_seed(3002)
    return "qwen3", cfg, Qwen3ForCausalLM(cfg)


def randomize(model):
    # Weights ~ N(0, 0.3), norms 1 + 0.1 N(0, 1): every value matters and quantisation has work.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))


# ----------------------------------------------------------------------------
# HF -> GGUF, as convert_hf_to_gguf.py (LlamaModel, Qwen3Model) does it

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    assert parts[0] == "model" and parts[1] == "layers", hf
    return f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:])]}"


def llama_permute(w, n_head):
    # LlamaModel.permute: rows [n_head, 2, hd/2] -> swap the last two -> back
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(cfg):
    # LlamaModel.generate_extra_tensors, in torch fp32 as the converter computes it
    rp = cfg.rope_parameters
    base, dim = rp["rope_theta"], cfg.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lf, hf = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    lo_w, hi_w = old / lf, old / hf
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < hi_w:
            out.append(1)
        elif wavelen > lo_w:
            out.append(factor)
        else:
            smooth = (old / wavelen - lf) / (hf - lf)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array([float(x) for x in out], dtype=np.float32)


def add_tokenizer(w, vocab):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>" if i < 3 else f"w{i}" for i in range(vocab)])
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["w 1", "w1 0", "w 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "mxfp4": 38}
QUANT = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "mxfp4": QT.MXFP4, "bf16": QT.BF16}


def write_gguf(path, arch, cfg, state, kind):
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(FILE_TYPE[kind])
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.head_dim)
    if kind in ("q8_0", "q4_0", "mxfp4"):
        w.add_quantization_version(2)
    add_tokenizer(w, cfg.vocab_size)
    for hf, t in state.items():
        a = t.detach().numpy().astype(np.float32)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            a = llama_permute(a, cfg.num_attention_heads)
        if arch == "llama" and hf.endswith("k_proj.weight"):
            a = llama_permute(a, cfg.num_key_value_heads)
        name = gguf_name(hf)
        if kind == "f32" or a.ndim == 1:
            w.add_tensor(name, a)
        elif kind == "f16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, QUANT[kind])
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QUANT[kind])
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------
# quantisation zoo


def random_k_blocks(rng, qtype, n_blocks):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    # finite, moderate f16 scales: d/dmin at bytes 0..3 (Q4_K) or 208..209 (Q6_K)
    def f16_bytes(x):
        return np.frombuffer(np.float16(x).tobytes(), dtype=np.uint8)
    for b in range(n_blocks):
        if qtype == QT.Q4_K:
            raw[b, 0:2] = f16_bytes(rng.uniform(0.01, 0.1))
            raw[b, 2:4] = f16_bytes(rng.uniform(0.0, 0.05))
        elif qtype == QT.Q6_K:
            raw[b, 208:210] = f16_bytes(rng.uniform(-0.05, 0.05))
        elif qtype == QT.MXFP4:
            raw[b, 0] = rng.integers(100, 140)  # e8m0 exponent: 2^-27 .. 2^13
    return raw


def write_zoo(path):
    rng = np.random.default_rng(4242)
    w = gguf.GGUFWriter(path, "zoo")
    w.add_custom_alignment(64)
    # one key of every value type, and nested arrays (checked by the C test)
    w.add_uint8("zoo.u8", 200)
    w.add_int8("zoo.i8", -100)
    w.add_uint16("zoo.u16", 60000)
    w.add_int16("zoo.i16", -30000)
    w.add_uint32("zoo.u32", 4000000000)
    w.add_int32("zoo.i32", -2000000000)
    w.add_float32("zoo.f32", 0.25)
    w.add_bool("zoo.bool", True)
    w.add_string("zoo.str", "héllo")
    w.add_uint64("zoo.u64", 2**63 + 5)
    w.add_int64("zoo.i64", -(2**62))
    w.add_float64("zoo.f64", -1.5e300)
    w.add_array("zoo.arr_i32", [1, -2, 3])
    w.add_array("zoo.arr_str", ["a", "", "ccc"])
    w.add_array("zoo.nested", [[1, 2], [3]])
    w.add_array("zoo.nested_str", [["a"], ["b", "cd"]])
    rows, cols = 2, 256
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    for qtype in [QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.MXFP4]:
        q = x.astype(np.float16) if qtype == QT.F16 else gguf.quants.quantize(x, qtype)
        name = qtype.name.lower()
        if qtype == QT.F16:
            w.add_tensor(f"{name}.q", q)
            exp = q.astype(np.float32)
        else:
            w.add_tensor(f"{name}.q", q, raw_shape=q.shape, raw_dtype=qtype)
            exp = gguf.quants.dequantize(q, qtype)
        w.add_tensor(f"{name}.expected", exp.astype(np.float32).reshape(rows, cols))
    for qtype, name in [(QT.Q4_K, "q4_k"), (QT.Q6_K, "q6_k"), (QT.MXFP4, "mxfp4_random")]:
        block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
        raw = random_k_blocks(rng, qtype, rows * cols // block_size).reshape(rows, -1)
        exp = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
        assert np.all(np.isfinite(exp)), name
        w.add_tensor(f"{name}.q", raw, raw_shape=raw.shape, raw_dtype=qtype)
        w.add_tensor(f"{name}.expected", exp)
    raw = rng.integers(0, 256, size=(2, 84), dtype=np.uint8)  # Q2_K: readable, not loadable
    w.add_tensor("q2_k.q", raw, raw_shape=raw.shape, raw_dtype=QT.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "fixtures"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for make in (make_llama, make_qwen3):
        arch, cfg, model = make()
        randomize(model)
        d = os.path.join(args.out, arch)
        if os.path.isdir(d):
            shutil.rmtree(d)
        model.save_pretrained(d, safe_serialization=True)
        for extra in os.listdir(d):  # keep only config.json and model.safetensors
            if extra not in ("config.json", "model.safetensors"):
                os.remove(os.path.join(d, extra))
        state = {k: v for k, v in model.state_dict().items()
                 if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        kinds = ["f32", "f16", "bf16", "q8_0", "q4_0"] if arch == "llama" else ["f32", "q8_0", "mxfp4"]
        for kind in kinds:
            write_gguf(os.path.join(args.out, f"{arch}_{kind}.gguf"), arch, cfg, state, kind)
    write_zoo(os.path.join(args.out, "quant_zoo.gguf"))

    total = 0
    for root, _, files in os.walk(args.out):
        for fn in files:
            total += os.path.getsize(os.path.join(root, fn))
    print(f"fixtures in {args.out}: {total / 1024:.1f} KB")
    assert total <= SIZE_BUDGET, f"fixtures are {total} bytes, over the {SIZE_BUDGET} budget"
    # read back with the reference reader
    for fn in sorted(os.listdir(args.out)):
        if fn.endswith(".gguf"):
            r = gguf.GGUFReader(os.path.join(args.out, fn))
            print(f"  {fn}: {len(r.tensors)} tensors, {len(r.fields)} fields")


if __name__ == "__main__":
    main()
