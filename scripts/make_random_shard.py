#!/usr/bin/env python3
"""Write an llm.c token shard of uniformly random token ids (benchmarks: the paper measures
throughput on random weights and random tokens).

usage: scripts/make_random_shard.py OUT.bin --vocab V --tokens N [--seed S]

uint32 tokens (magic 20240801, version 7) when V > 65535, else uint16 (20240520, 1).
Uses numpy when available (fast), the standard library otherwise.
"""
import argparse
import array
import os
import random
import struct
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if a.vocab < 1 or a.tokens < 1:
        sys.exit("make_random_shard.py: --vocab and --tokens must be positive")
    wide = a.vocab > 65535
    magic, version = (20240801, 7) if wide else (20240520, 1)
    header = struct.pack("<256i", magic, version, a.tokens, *([0] * 253))
    try:
        import numpy as np

        rng = np.random.default_rng(a.seed)
        toks = rng.integers(0, a.vocab, size=a.tokens, dtype=np.uint32 if wide else np.uint16)
        payload = toks.astype("<u4" if wide else "<u2").tobytes()
    except ImportError:
        rng = random.Random(a.seed)
        toks = array.array("I" if wide else "H", (rng.randrange(a.vocab) for _ in range(a.tokens)))
        if sys.byteorder != "little":
            toks.byteswap()
        payload = toks.tobytes()
    tmp = a.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(payload)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
