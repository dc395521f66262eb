#!/usr/bin/env python3
"""gen_arith.py -- deterministic synthetic arithmetic corpus in llm.c token-shard format.

Writes data/tiny_train.bin and data/tiny_val.bin: byte-level token shards (uint16 tokens,
header magic 20240520, version 1) for a 256-token vocabulary. Token = byte value (1..255) of
ASCII text; token 0 is EOT and precedes every document (the llm.c convention).

A document is a short block of arithmetic problems with their answers, one per line:

    37+45=82
    91-17=74
    8*7=56

Answers are a deterministic function of the question, so even a tiny model can learn to predict
them, while the operands stay random.

Problems: a+b with a, b in [0, 99]; a-b with 0 <= b <= a <= 99; a*b with a, b in [0, 12].
Train and val are independent draws from the same distribution (different random streams).

Pure Python (standard library only), seeded: the same command always writes the same bytes.

Usage:
    python3 data/gen_arith.py                   # writes data/tiny_train.bin, data/tiny_val.bin
    python3 data/gen_arith.py --seed 7 --out-dir /tmp/arith --train-tokens 2000000
"""

import argparse
import array
import os
import random
import struct
import sys

MAGIC_U16 = 20240520
VERSION_U16 = 1
HEADER_INTS = 256
EOT = 0

# ----------------------------------------------------------------------------
# text


def gen_problem(rng):
    """One line "a<op>b=c\\n"; the answer is exact integer arithmetic."""
    kind = rng.randrange(10)
    if kind < 4:
        a, b = rng.randrange(100), rng.randrange(100)
        return "%d+%d=%d\n" % (a, b, a + b)
    if kind < 7:
        a = rng.randrange(100)
        b = rng.randrange(a + 1)
        return "%d-%d=%d\n" % (a, b, a - b)
    a, b = rng.randrange(13), rng.randrange(13)
    return "%d*%d=%d\n" % (a, b, a * b)


def gen_document(rng):
    """EOT followed by 3 to 6 problems, as byte-level tokens."""
    text = "".join(gen_problem(rng) for _ in range(3 + rng.randrange(4)))
    return [EOT] + list(text.encode("ascii"))


def gen_tokens(rng, budget):
    """Whole documents until the next one would exceed `budget` tokens."""
    tokens = []
    while True:
        doc = gen_document(rng)
        if len(tokens) + len(doc) > budget:
            return tokens
        tokens.extend(doc)


# ----------------------------------------------------------------------------
# shard file


def write_shard_u16(path, tokens):
    """llm.c shard: 256 x int32 LE header (magic, version, ntok, zeros), then uint16 LE tokens.
    Written to path.tmp and renamed, so a reader never sees a half-written file."""
    if len(tokens) >= 2**31:
        raise ValueError("%s: %d tokens do not fit a shard header" % (path, len(tokens)))
    header = [0] * HEADER_INTS
    header[0], header[1], header[2] = MAGIC_U16, VERSION_U16, len(tokens)
    body = array.array("H", tokens)
    if sys.byteorder != "little":
        body.byteswap()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<%di" % HEADER_INTS, *header))
        f.write(body.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(
        description="Generate the byte-level arithmetic corpus tiny_train.bin / tiny_val.bin "
        "(llm.c uint16 token shards, vocab 256, EOT = 0 before every document).")
    ap.add_argument("--seed", type=int, default=1337, help="random seed (default 1337)")
    ap.add_argument("--train-tokens", type=int, default=800000,
                    help="token budget of tiny_train.bin (default 800000, about 1.6 MB)")
    ap.add_argument("--val-tokens", type=int, default=80000,
                    help="token budget of tiny_val.bin (default 80000, about 160 KB)")
    ap.add_argument("--out-dir", default=here, help="output directory (default: this script's)")
    args = ap.parse_args()
    if args.train_tokens < 1 or args.val_tokens < 1:
        ap.error("token budgets must be positive")

    os.makedirs(args.out_dir, exist_ok=True)
    # separate streams: the val split does not depend on the size of the train split
    splits = [("tiny_train.bin", args.train_tokens, args.seed * 2 + 0),
              ("tiny_val.bin", args.val_tokens, args.seed * 2 + 1)]
    for name, budget, split_seed in splits:
        tokens = gen_tokens(random.Random(split_seed), budget)
        path = os.path.join(args.out_dir, name)
        write_shard_u16(path, tokens)
        print("wrote %s: %d tokens, %d documents, %d bytes"
              % (path, len(tokens), tokens.count(EOT), os.path.getsize(path)))


if __name__ == "__main__":
    main()
