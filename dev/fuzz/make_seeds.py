#!/usr/bin/env python3
"""
make_seeds.py -- the committed seed corpora of the fuzz targets (dev/fuzz/corpus/<target>/), kept
small (a few KB each) so that `make test`'s fuzz smoke run over every seed plus mutations stays
fast. Seeds are valid inputs that reach deep into each parser:

  json/         config.json variants (legacy and transformers-5 RoPE), a safetensors header, an
                index file, every JSON value kind
  safetensors/  F32/F16/BF16/U8 tensors, an empty file, a scalar, a zero-sized tensor
  gguf/         tiny llama and qwen3 models (Q8_0/Q4_0/F16/F32 tensors, tokenizer, rope_freqs),
                and a metadata-only file with every value type and nested arrays
  shard/        llm.c token shards, uint16 and uint32

Written by the official `gguf` package (llama.cpp gguf-py) and `safetensors`. Deterministic.
Usage:  python3 dev/fuzz/make_seeds.py
"""

import json
import os
import struct

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from safetensors.numpy import save as st_save

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def json_seeds():
    put("json", "llama_config.json", json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": None}).encode())
    put("json", "qwen3_v5.json", json.dumps({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048,
        "rope_parameters": {"full_attention": {"rope_theta": 1000000, "rope_type": "default"}},
        "layer_types": ["full_attention"] * 3, "use_sliding_window": False,
        "sliding_window": None}).encode())
    put("json", "st_header.json",
        b'{"__metadata__":{"format":"pt"},"a.weight":{"dtype":"BF16","shape":[2,3],'
        b'"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[],"data_offsets":[12,16]}}')
    put("json", "index.json", json.dumps({
        "metadata": {"total_size": 16},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                       "b": "model-00002-of-00002.safetensors"}}).encode())
    put("json", "values.json",
        '[null,true,false,-0.5e-3,9007199254740993,"\\u00e9\\ud83d\\ude00\\n\\"",[[[]]],{"":{}},'
        '"\u00e9\u20ac",1E+2]'.encode("utf-8"))


def safetensors_seeds():
    rng = np.random.default_rng(7)
    put("safetensors", "mixed.safetensors", st_save({
        "w": rng.standard_normal((4, 8)).astype(np.float32),
        "h": rng.standard_normal((3,)).astype(np.float16),
        "u": np.arange(5, dtype=np.uint8)}, metadata={"format": "pt"}))
    bf = rng.standard_normal((2, 4)).astype(np.float32).view(np.uint32) >> 16
    hdr = b'{"bf":{"dtype":"BF16","shape":[2,4],"data_offsets":[0,16]},' \
          b'"s":{"dtype":"F32","shape":[],"data_offsets":[16,20]},' \
          b'"z":{"dtype":"F32","shape":[0,3],"data_offsets":[20,20]}}'
    hdr += b" " * ((8 - len(hdr) % 8) % 8)
    body = bf.astype(np.uint16).tobytes() + np.float32(1.5).tobytes()
    put("safetensors", "bf16_scalar_empty.safetensors", struct.pack("<Q", len(hdr)) + hdr + body)
    put("safetensors", "empty.safetensors", bytes.fromhex("08000000000000007b7d202020202020"))


def gguf_bytes(build):
    path = os.path.join(OUT, "tmp.gguf")
    w = gguf.GGUFWriter(path, build.__name__.split("_")[0])
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "rb") as f:
        data = f.read()
    os.remove(path)
    return data


def tiny_model(w, arch, qtype):
    # V 8, C 32, L 1, H 1, KVH 1, HD 32, F 32: every 2-D weight is whole 32-element blocks
    rng = np.random.default_rng(11)
    V, C, F = 8, 32, 32
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(C)
    w.add_feed_forward_length(F)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_types([1] * V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def mat(name, rows, cols):
        a = (0.1 * rng.standard_normal((rows, cols))).astype(np.float32)
        if qtype == QT.F32:
            w.add_tensor(name, a)
        elif qtype == QT.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    mat("token_embd.weight", V, C)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(C, dtype=np.float32))
    for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
        mat(f"blk.0.{n}.weight", C, C)
    if arch == "qwen3":
        w.add_tensor("blk.0.attn_q_norm.weight", np.ones(C, dtype=np.float32))
        w.add_tensor("blk.0.attn_k_norm.weight", np.ones(C, dtype=np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(C, dtype=np.float32))
    mat("blk.0.ffn_gate.weight", F, C)
    mat("blk.0.ffn_up.weight", F, C)
    mat("blk.0.ffn_down.weight", C, F)
    w.add_tensor("output_norm.weight", np.ones(C, dtype=np.float32))
    if arch == "llama":
        mat("output.weight", V, C)
        w.add_tensor("rope_freqs.weight", np.array([1.0] * 8 + [2.5] + [8.0] * 7, np.float32))


def llama_q4_0(w):
    tiny_model(w, "llama", QT.Q4_0)


def llama_f16(w):
    tiny_model(w, "llama", QT.F16)


def qwen3_q8_0(w):
    tiny_model(w, "qwen3", QT.Q8_0)


def meta_all_types(w):
    w.add_custom_alignment(64)
    w.add_uint8("m.u8", 7)
    w.add_int8("m.i8", -7)
    w.add_uint16("m.u16", 700)
    w.add_int16("m.i16", -700)
    w.add_uint32("m.u32", 70000)
    w.add_int32("m.i32", -70000)
    w.add_float32("m.f32", 0.5)
    w.add_bool("m.bool", False)
    w.add_string("m.str", "s")
    w.add_uint64("m.u64", 1 << 40)
    w.add_int64("m.i64", -(1 << 40))
    w.add_float64("m.f64", 2.5)
    w.add_array("m.arr", [1, 2, 3])
    w.add_array("m.nested", [[1, 2], [3]])
    w.add_array("m.strs", ["a", "bc"])
    rng = np.random.default_rng(5)
    for qt in (QT.Q4_K, QT.Q6_K, QT.MXFP4, QT.Q5_0, QT.Q5_1, QT.Q4_1, QT.BF16):
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        n = 256 if bs == 256 else 32
        raw = rng.integers(0, 256, size=(1, n // bs * ts), dtype=np.uint8)
        w.add_tensor(f"{qt.name.lower()}.w", raw, raw_shape=raw.shape, raw_dtype=qt)


def shard_seeds():
    def shard(magic, version, tokens, dtype):
        hdr = np.zeros(256, dtype=np.int32)
        hdr[0], hdr[1], hdr[2] = magic, version, len(tokens)
        return hdr.tobytes() + np.asarray(tokens, dtype=dtype).tobytes()
    put("shard", "u16.bin", shard(20240520, 1, [i % 50 for i in range(64)], np.uint16))
    put("shard", "u32.bin", shard(20240801, 7, [(i * 7919) % 100000 for i in range(40)], np.uint32))


def main():
    json_seeds()
    safetensors_seeds()
    for build in (llama_q4_0, llama_f16, qwen3_q8_0, meta_all_types):
        put("gguf", build.__name__ + ".gguf", gguf_bytes(build))
    shard_seeds()
    total = 0
    for root, _, files in os.walk(OUT):
        for fn in files:
            total += os.path.getsize(os.path.join(root, fn))
    print(f"seeds in {OUT}: {total} bytes")


if __name__ == "__main__":
    main()
