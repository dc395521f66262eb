#!/usr/bin/env python3
"""tokenize.py -- turn your own text into llm.c token shards for train_roundpipe.

Reads plain-text files (each file is one document) and/or .jsonl files (one JSON object per line,
each line one document, text in the field named by --text-field, default "text"), tokenizes them
with a Hugging Face tokenizer, puts the tokenizer's BOS token (or EOS when it has no BOS) before
every document, and writes shards of --shard-size tokens:

    <prefix>_val_000000.bin      the first --val-tokens tokens (the validation split)
    <prefix>_train_000001.bin    then --shard-size tokens per train shard
    <prefix>_train_000002.bin    ...

Format (see data/README.md): a 256 x int32 little-endian header (magic, version, token count,
zeros) followed by the tokens; uint16 tokens (magic 20240520, version 1) when the vocabulary has
fewer than 65536 entries, else uint32 tokens (magic 20240801, version 7). As in llm.c, documents
are concatenated and may straddle a shard boundary. Each shard is written to <name>.tmp and
renamed, so a reader never sees half a shard.

Usage:
    python3 data/tokenize.py --tokenizer Qwen/Qwen3-0.6B --prefix out/mytext books/*.txt
    python3 data/tokenize.py --tokenizer ./my_model_dir --prefix out/web \\
        --val-tokens 1000000 --shard-size 100000000 corpus.jsonl
    # then train on "out/web_train_*.bin" and evaluate on "out/web_val_*.bin"

--tokenizer is anything transformers.AutoTokenizer.from_pretrained() accepts: a local directory
with tokenizer files, or a hub name (downloaded by transformers if not cached).

Requires Python 3 with the standard library and the `transformers` package.

Without Python: the trainer has the same tool built in, with its own C tokenizer (byte-level BPE
from a tokenizer.json or a .gguf: GPT-2, LLaMA-3, Qwen2/Qwen3), multi-threaded, id-exact with HF:

    ./train_roundpipe --tokenize books/*.txt corpus.jsonl --tokenizer ./my_model_dir \
        --out-shards out/mytext --val-frac 0.01

It writes the same shard format and names; its validation split takes whole documents (a share
of the tokens) instead of the first --val-tokens tokens. `./train_roundpipe --tokenize --help`
lists its options.
"""

import os
import sys

# This file is named like the standard-library module `tokenize`, which transformers imports
# (through inspect). Running it as a script puts this directory first on sys.path, where our
# file would shadow the real module; drop the directory before anything imports it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import array  # noqa: E402
import json  # noqa: E402
import struct  # noqa: E402

HEADER_INTS = 256
MAGIC_U16, VERSION_U16 = 20240520, 1
MAGIC_U32, VERSION_U32 = 20240801, 7
MAX_SHARD_TOKENS = 2**31 - 1  # the header's token count is an int32

# ----------------------------------------------------------------------------
# reading documents


def iter_documents(paths, text_field):
    """Yield (source, text) for every document: a whole text file, or one line of a .jsonl."""
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, "r", encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SystemExit("%s:%d: invalid JSON: %s" % (path, lineno, e))
                    if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                        raise SystemExit("%s:%d: no string field '%s'" % (path, lineno, text_field))
                    yield "%s:%d" % (path, lineno), obj[text_field]
        else:
            with open(path, "r", encoding="utf-8") as f:
                yield path, f.read()


def iter_batches(items, size):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------
# writing shards


class ShardWriter:
    """Cuts a token stream into the val shard (index 0) and train shards (index 1, 2, ...)."""

    def __init__(self, prefix, token_bytes, val_tokens, shard_size):
        self.prefix = prefix
        self.token_bytes = token_bytes
        wide = "I" if array.array("I").itemsize == 4 else "L"
        self.typecode = "H" if token_bytes == 2 else wide
        self.limit_max = 2**16 if token_bytes == 2 else 2**32
        self.val_tokens = val_tokens
        self.shard_size = shard_size
        self.index = 0 if val_tokens > 0 else 1
        self.buf = array.array(self.typecode)
        self.written = []  # (path, ntok)

    def capacity(self):
        return self.val_tokens if self.index == 0 else self.shard_size

    def add(self, tokens):
        pos = 0
        while pos < len(tokens):
            room = self.capacity() - len(self.buf)
            take = tokens[pos:pos + room]
            bad = [t for t in take if not 0 <= t < self.limit_max]
            if bad:
                raise SystemExit("token id %d does not fit in %d bytes"
                                 % (bad[0], self.token_bytes))
            self.buf.extend(take)
            pos += len(take)
            if len(self.buf) == self.capacity():
                self.flush()

    def flush(self):
        if len(self.buf) == 0:
            return
        split = "val" if self.index == 0 else "train"
        path = "%s_%s_%06d.bin" % (self.prefix, split, self.index)
        header = [0] * HEADER_INTS
        if self.token_bytes == 2:
            header[0], header[1] = MAGIC_U16, VERSION_U16
        else:
            header[0], header[1] = MAGIC_U32, VERSION_U32
        header[2] = len(self.buf)
        body = self.buf
        if sys.byteorder != "little":
            body = array.array(self.typecode, body)
            body.byteswap()
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<%di" % HEADER_INTS, *header))
            f.write(body.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.written.append((path, len(self.buf)))
        print("wrote %s: %d tokens" % (path, len(self.buf)))
        self.buf = array.array(self.typecode)
        self.index += 1


# ----------------------------------------------------------------------------


def load_tokenizer(name):
    """AutoTokenizer.from_pretrained(name), with one line instead of a traceback when transformers
    (or the tokenizer) is missing."""
    try:
        # imported late: --help and the argument checks work without it
        from transformers import AutoTokenizer
    except ImportError as e:
        raise SystemExit("tokenize.py: needs the `transformers` package (%s): "
                         "pip install transformers" % e)
    try:
        return AutoTokenizer.from_pretrained(name)
    except ImportError as e:
        # a tokenizer class that needs more (sentencepiece, tiktoken, protobuf, ...)
        raise SystemExit("tokenize.py: the tokenizer %s needs another package: %s" % (name, e))
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit("tokenize.py: cannot load a tokenizer from %s: %s" % (name, first))


def main():
    ap = argparse.ArgumentParser(
        description="Tokenize text files / .jsonl with a Hugging Face tokenizer into llm.c token "
        "shards (<prefix>_val_000000.bin, <prefix>_train_000001.bin, ...).",
        epilog="Without Python or transformers: ./train_roundpipe --tokenize IN... --tokenizer FILE "
        "--out-shards PREFIX [--val-frac X] does the same in C (see --tokenize --help).")
    ap.add_argument("inputs", nargs="+", help="text files (one document each) or .jsonl files")
    ap.add_argument("--tokenizer", required=True,
                    help="AutoTokenizer.from_pretrained() argument: local dir or hub name")
    ap.add_argument("--prefix", required=True, help="output path prefix, e.g. out/mydata")
    ap.add_argument("--shard-size", type=int, default=100_000_000,
                    help="tokens per train shard (default 1e8)")
    ap.add_argument("--val-tokens", type=int, default=1_000_000,
                    help="tokens in the val shard, taken first (default 1e6; 0 = no val shard)")
    ap.add_argument("--text-field", default="text",
                    help="text field of .jsonl lines (default text)")
    ap.add_argument("--batch-docs", type=int, default=256,
                    help="documents per tokenizer call (default 256)")
    args = ap.parse_args()
    if not 1 <= args.shard_size <= MAX_SHARD_TOKENS:
        ap.error("--shard-size must be in [1, 2^31)")
    if not 0 <= args.val_tokens <= MAX_SHARD_TOKENS:
        ap.error("--val-tokens must be in [0, 2^31)")
    if args.batch_docs < 1:
        ap.error("--batch-docs must be positive")
    for path in args.inputs:
        if not os.path.isfile(path):
            ap.error("%s: not a file" % path)

    tok = load_tokenizer(args.tokenizer)
    tok.model_max_length = 2**62  # documents are any length here; silence the length warning
    doc_start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if doc_start is None:
        raise SystemExit("%s: tokenizer has neither a BOS nor an EOS token to start documents"
                         % args.tokenizer)
    vocab = max(len(tok), tok.vocab_size)
    token_bytes = 2 if vocab < 2**16 else 4
    print("tokenizer %s: vocab %d, documents start with token %d, %s tokens"
          % (args.tokenizer, vocab, doc_start, "uint16" if token_bytes == 2 else "uint32"))

    out_dir = os.path.dirname(args.prefix)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    writer = ShardWriter(args.prefix, token_bytes, args.val_tokens, args.shard_size)
    n_docs = 0
    for batch in iter_batches(iter_documents(args.inputs, args.text_field), args.batch_docs):
        ids = tok([text for _, text in batch], add_special_tokens=False)["input_ids"]
        for doc in ids:
            writer.add([doc_start] + list(doc))
        n_docs += len(batch)
    writer.flush()
    total = sum(n for _, n in writer.written)
    print("%d documents, %d tokens in %d shards" % (n_docs, total, len(writer.written)))
    if not any("_train_" in p for p, _ in writer.written):
        print("warning: everything went to the val shard (fewer than --val-tokens=%d tokens); "
              "lower --val-tokens to get a train shard" % args.val_tokens, file=sys.stderr)


if __name__ == "__main__":
    main()
