#!/usr/bin/env python3
"""
make_fixtures.py -- the tokenizer fixtures of llmc/tests/test_tokenizer.c (dev/tokenizer/fixtures/).

The hub's tokenizer files are not at hand, so three byte-level BPE tokenizers are built here with
the `tokenizers` package (pip install tokenizers), with exactly the normalizer, pre-tokenizer,
decoder and post-processor settings of the real ones, and small vocabularies trained on the
corpus below:

  qwen3.json   Qwen2/Qwen3: NFC, Split(Qwen2 regex, \\p{N} one digit at a time) + ByteLevel,
               ByteLevel decoder, ByteLevel post-processor; <|endoftext|>, <|im_start|>,
               <|im_end|> special, <think> </think> not; merges in the old "a b" spelling
  llama3.json  LLaMA-3: no normaliser, Split(LLaMA-3 = tiktoken cl100k regex, \\p{N}{1,3}) +
               ByteLevel, ignore_merges (and a few whole words added to the vocabulary without
               merges, so that it matters), TemplateProcessing "<|begin_of_text|> $A"; merges in
               the ["a", "b"] spelling
  gpt2.json    GPT-2: ByteLevel pre-tokenizer with its own regex; an lstrip/rstrip added token
               (<mask>, as RoBERTa), added tokens whose text has a space or non-ASCII characters,
               and one spelled in the byte-level alphabet

cases.json holds the test inputs (hex, so that invalid UTF-8 fits) and, per tokenizer, the ids
HF tokenizers gives (add_special_tokens=False unless the case says "add_special"; "no_special"
cases set encode_special_tokens, i.e. special tokens are plain text) and the bytes its decode()
gives. Inputs: a hand-written multilingual list (CJK, emoji and ZWJ sequences, combining marks in
and out of canonical order, Hangul jamo, whitespace runs like "\\n\\n  \\t", numbers, code,
contractions in all cases, special tokens inline and truncated) plus seeded random strings over
the same characters. Inputs with invalid UTF-8 cannot go through the tokenizers API (it takes
str); for them the ids are made from HF's parts: each invalid byte becomes a private-use
character (class "other", a starter, as the C code treats it), HF's normaliser and Split
pre-tokenizer cut the text, and HF's BPE model (tokenizer.model.tokenize) merges each piece's
real bytes.

Deterministic: the same tokenizers version writes the same files. Prints the sizes.
Usage:  python3 dev/tokenizer/make_fixtures.py
"""

import json
import os
import random
import unicodedata

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures")

QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ----------------------------------------------------------------------------
# the training corpus: English prose, code, and some of every script the tests use

ENGLISH = """\
The quick brown fox jumps over the lazy dog, and then it runs back into the forest.
It's a truth universally acknowledged that a single model in possession of good data must be in
want of a tokenizer. We'll see whether they're right; I'd say you've got to measure it first.
Training a language model starts with text: books, articles, code and conversations. The text is
split into pieces, each piece becomes a number, and the numbers become vectors that the network
learns to predict, one token after another, over billions of examples.
In 1969, 600 million people watched the landing; the mission lasted 8 days, 3 hours and 18 minutes.
Prices rose by 3.5% in 2023, to $1,234.56 per unit, while costs fell 12 percent.
She said, "Don't worry about it." He replied: "I can't help it, I'm worried!"
Mr. O'Neil's shop on 5th Avenue opens at 9:30 a.m. and closes at 11 p.m. on weekdays.
A tokenizer should be fast, exact and boring: every byte in, every byte out, nothing lost.
Whitespace matters too:   three spaces, a tab\there, and blank lines

between paragraphs.
"""

CODE = """\
def encode(self, text: str) -> list[int]:
    ids = []
    for piece in self.split(text):
        ids.extend(self.bpe(piece))  # merge by rank
    return ids

int main(int argc, char** argv) {
    for (int i = 0; i < argc; i++) {
        printf("%s\\n", argv[i]);
    }
    return 0;
}
SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;
const x = {a: 1, b: [2, 3], c: "four"}; // JSON-ish
"""

WORLD = """\
自然语言处理是人工智能的一个重要领域。我们今天学习分词器。
東京は日本の首都です。ひらがなとカタカナと漢字を使います。
한국어 텍스트도 잘 처리해야 합니다. 안녕하세요, 세계!
Привет, мир! Это тест токенизатора на русском языке.
Καλημέρα κόσμε· αυτό είναι ένα τεστ.
مرحبا بالعالم، هذا اختبار للمقسم.
नमस्ते दुनिया, यह एक परीक्षण है।
Ça va très bien, merci! Große Straße, Übung macht den Meister. Niño, año, mañana.
Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷 🎉 — done.
Math: ½ + ¼ = ¾, x² + y² = z², Ⅻ o'clock, ١٢٣٤ in Arabic digits.
"""


def training_lines():
    text = ENGLISH + CODE + WORLD
    lines = text.split("\n")
    # repeat with variations so that merges have counts
    out = []
    for k in range(8):
        for ln in lines:
            out.append(ln if k % 2 == 0 else ln.upper() if k == 3 else ln.lower())
    return out


# ----------------------------------------------------------------------------
# the tokenizers

def train(tok, vocab_size, small=False):
    if small:
        vocab_size = 270
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_lines(), trainer)
    return tok


def build_qwen3(small=False):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    train(tok, 900, small)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>")])
    return tok


def bytelevel(s):
    table = {b: c for b, c in zip(range(256), byte_chars())}
    return "".join(table[b] for b in s.encode("utf-8"))


def byte_chars():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def build_llama3(small=False):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    train(tok, 1000, small)
    # whole words in the vocabulary without a merge path: only ignore_merges finds them
    j = json.loads(tok.to_str())
    j["model"]["ignore_merges"] = True
    vocab = j["model"]["vocab"]
    for w in (" extraordinary", " tokenization", "自然语言", " Übung", "Hello", " 👍"):
        if bytelevel(w) not in vocab:
            vocab[bytelevel(w)] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(j, ensure_ascii=False))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in (
        "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return tok


def build_gpt2(small=False):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    train(tok, 800, small)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False),
                            AddedToken("<mask>", special=True, lstrip=True, rstrip=True,
                                       normalized=False)])
    tok.add_tokens([AddedToken(s, special=False, normalized=False)
                    for s in ("<|im sep|>", "<|ünï|>", "ĠSpecialWord")])
    return tok


# ----------------------------------------------------------------------------
# the inputs

HAND = [
    "Hello world", "Hello, world!", " hello", "  hello", "hello  ", "\n", " ", "", "a",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right; it's what they've said, we'll see, he'd know.",
    "I'M SURE YOU'RE RIGHT; IT'S WHAT THEY'VE SAID, WE'LL SEE, HE'D KNOW.",
    "x'Sy x'sy x'REy x'rEy x'LLama 'ſt x'ſy '' 'x' ' s", "don't", "O'Neil's", "'s", "'",
    "\n\n  \t", "  \n\n  \tx", "a\n\n\nb", "a\r\n\r\nb", "  \r\n  x", "\t\tindent", "trailing   ",
    "x\u3000\u3000y", "x\u00a0\u00a0y", "x\u2028y\u2029z", "x\x85\x85y", "x\x1c\x1dy", "x\u180e\u180ey",
    "x\u200b\u200by", "x\x0b\x0cy", "a \t b", " \u3000x", "end with newline\n", "  ",
    "1234567", "12345678901234567890", "3.14159", "1,234,567.89", "v1.2.3", "2023-12-31T23:59:59Z",
    "١٢٣٤٥", "Ⅻ ½ ² ³ ⅞", "٣٤abc12", "x1y22z333",
    "自然语言处理是人工智能的一个重要领域。", "東京は日本の首都です。", "한국어 텍스트 안녕하세요",
    "Привет, мир!", "Καλημέρα κόσμε", "مرحبا بالعالم", "नमस्ते दुनिया", "Ça va très bien, Übung, mañana",
    "😀 👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷 🎉", "🎉🎉🎉", "a😀b", " 😀", "💩💩", "\U0001F9D1\u200D\U0001F4BB",
    # combining marks: decomposed, precomposed, out of canonical order, Hangul jamo
    "e\u0301", "\u00e9", "A\u030a", "\u212b", "a\u0323\u0301", "a\u0301\u0323", "o\u0308\u0304",
    "q\u0307\u0323", "\u1100\u1161\u11a8", "\u1100\u1161", "\uac00\u11a8", "\u0958", "\u2126",
    "e\u0301\u0301\u0301", "\u0301start", "x \u0301", "\u00c5\u0328", "\u1e9b\u0323",
    "Cafe\u0301 na\u0308ive", "\u0f73\u0f75", "\u0dd9\u0dcf", "\u09c7\u09be",
    # code
    "def f(x):\n    return x ** 2  # square\n", "int main(void) { return 0; }\n",
    "if (a && b || !c) { x += 1; }", "for i in range(10):\n\tprint(i)", "a=b+c;d=e-f;",
    "<div class=\"x\">hi</div>", "path/to/file.txt", "user@example.com", "http://x.org/?q=1&r=2",
    "...", "!!!???", "--flag=value", "foo_bar_baz", "CamelCaseWord", "}\n\n  x", "x;\r\ny",
    # special tokens
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>", "a<|endoftext|>b", "<|endoftext|><|endoftext|>", "<|endoftext|",
    "<|im_start", "<|begin_of_text|>Hello<|eot_id|>", "<think>hmm</think>answer",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "x <mask> y", "x<mask>y", "  <mask>  ", "a <|im sep|> b <|ünï|> c ĠSpecialWord d",
    "<|reserved_special_token_0|>", "<<|endoftext|>>",
    "extraordinary tokenization of 自然语言 and Übung, Hello 👍",
    "ſ ß ẞ İ ı ǅ ﬀ ﬁ Å K",
]

# inputs with invalid UTF-8 (bytes): stray continuation bytes, overlongs, surrogates, truncations
INVALID = [
    b"abc\xffdef", b"\xff", b"\x80\x80", b"caf\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82x",
    b"\xed\xa0\x80 surrogate", b"\xc0\xaf overlong", b"\xf4\x90\x80\x80 too big", b"\xf0\x80\x80\x80",
    b"hello \xfe\xfe world", b"  \xff\n\n", b"123\xff456", b"e\xcc\x81\xff\xcc\x81", b"\xff\xcc\x81",
    b"It\xe2\x80s", b"\x00\x01\x02 ctrl", b"\xe6\x97\xa5\xe6\x97", b"'\xffs",
]

POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") * 3 +
    list(" " * 20) + list("\n\n\t\r") + list(".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`") +
    ["'s", "'S", "'ll", "'RE", "'ſ", "<|endoftext|>", "<|im_start|>", "<think>", "<mask>"] +
    list("àéîõüçñßÅøæœ") + ["e\u0301", "a\u0308", "\u0323", "\u0301", "\u0308\u0323", "\u0345"] +
    list("\u1100\u1161\u11a8\uac00\u1112\u1175") + list("自然语言处理日本語東京한국어") +
    list("ПриветмирΚαλημέρα") + list("مرحبا") + list("नमस्ते") + list("١٢٣½²Ⅻ") +
    list("😀👍🏽❤️🎉💩") + ["\u200d", "\ufe0f", "\u00a0", "\u3000", "\u2028", "\x85", "\x0b", "\u180e"]
)


def random_inputs(rng, n):
    out = []
    for _ in range(n):
        k = rng.randint(1, 40)
        out.append("".join(rng.choice(POOL) for _ in range(k)))
    return out


# ----------------------------------------------------------------------------
# expected ids

def pua_text(data):
    """bytes -> str, each invalid byte as U+F0000 + byte (a private-use "other" character)."""
    s = data.decode("utf-8", errors="surrogateescape")
    return "".join(chr(0xF0000 + ord(c) - 0xDC00) if 0xDC80 <= ord(c) <= 0xDCFF else c for c in s)


def pua_bytes(s):
    out = bytearray()
    for c in s:
        if 0xF0080 <= ord(c) <= 0xF00FF:
            out.append(ord(c) - 0xF0000)
        else:
            out += c.encode("utf-8")
    return bytes(out)


def split_for(name):
    if name == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Split(Regex(QWEN2_RE if name == "qwen3" else LLAMA3_RE),
                                behavior="isolated", invert=False)


def ids_from_parts(tok, name, data):
    """HF's ids for bytes with invalid UTF-8, from HF's normaliser, split and BPE model."""
    text = pua_text(data)
    assert not any(t in text for t in ("<|", "<mask>", "<think>"))
    if tok.normalizer is not None:
        text = tok.normalizer.normalize_str(text)
    chars = byte_chars()
    ids = []
    for piece, _ in split_for(name).pre_tokenize_str(text):
        if name == "gpt2":  # ByteLevel already mapped the piece: back to the characters
            piece = bytes(chars.index(c) for c in piece).decode("utf-8")
        bl = "".join(chars[b] for b in pua_bytes(piece))
        ids += [t.id for t in tok.model.tokenize(bl)]
    return ids


def fuzz_seeds():
    """Seeds of the tokenizer fuzz target (dev/fuzz/corpus/tokenizer): a small tokenizer.json of
    each style (the 256 bytes and a few merges), a NUL, and text to encode."""
    out = os.path.join(os.path.dirname(HERE), "fuzz", "corpus", "tokenizer")
    os.makedirs(out, exist_ok=True)
    text = ("Hello world, it's 1234567!\n\n  \tCafe\u0301 \u81ea\u7136 \U0001F600 "
            "<|im_start|>x<|endoftext|> <mask> 'LL").encode("utf-8") + b" \xff\xc3("
    for name, build in (("qwen3", build_qwen3), ("llama3", build_llama3), ("gpt2", build_gpt2)):
        tok = build(small=True)
        j = json.loads(tok.to_str())
        if name == "qwen3":
            j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]
        seed = json.dumps(j, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        with open(os.path.join(out, name + "_small"), "wb") as f:
            f.write(seed + b"\0" + text)
    with open(os.path.join(out, "no_text"), "wb") as f:  # no NUL: the JSON encodes itself
        f.write(json.dumps(json.loads(build_gpt2(small=True).to_str()), separators=(",", ":")).encode())


def main():
    os.makedirs(OUT, exist_ok=True)
    toks = {"qwen3": build_qwen3(), "llama3": build_llama3(), "gpt2": build_gpt2()}
    for name, tok in toks.items():
        path = os.path.join(OUT, name + ".json")
        tok.save(path, pretty=False)
        if name == "qwen3":  # the old "a b" spelling of merges (tokenizers >= 0.20 writes pairs)
            with open(path) as f:
                j = json.load(f)
            j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]
            with open(path, "w") as f:
                json.dump(j, f, ensure_ascii=False, separators=(",", ":"))
        # what was saved is what is tested: reload it
        toks[name] = Tokenizer.from_file(os.path.join(OUT, name + ".json"))

    rng = random.Random(1234)
    texts = HAND + random_inputs(rng, 150)
    cases = []
    for text in texts:
        c = {"hex": text.encode("utf-8").hex()}
        for name, tok in toks.items():
            enc = tok.encode(text, add_special_tokens=False)
            c[name] = enc.ids
            c[name + "_decoded"] = tok.decode(enc.ids, skip_special_tokens=False).encode("utf-8").hex()
        cases.append(c)
    # with the post-processor (LLaMA-3 adds <|begin_of_text|>)
    for text in ("Hello world", "", "<|begin_of_text|>x"):
        c = {"hex": text.encode("utf-8").hex(), "add_special": 1}
        for name, tok in toks.items():
            c[name] = tok.encode(text, add_special_tokens=True).ids
        cases.append(c)
    # special tokens as plain text
    for name, tok in toks.items():
        tok.encode_special_tokens = True
    for text in ("<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b <think>x</think>",
                 "<|begin_of_text|>Hello<|eot_id|>", "x <mask> y"):
        c = {"hex": text.encode("utf-8").hex(), "no_special": 1}
        for name, tok in toks.items():
            c[name] = tok.encode(text, add_special_tokens=False).ids
        cases.append(c)
    for name, tok in toks.items():
        tok.encode_special_tokens = False
    # invalid UTF-8
    for data in INVALID:
        c = {"hex": data.hex(), "invalid": 1}
        for name, tok in toks.items():
            c[name] = ids_from_parts(tok, name, data)
        cases.append(c)
    # the parts agree with the whole encoder on valid text (checks the construction above)
    for text in HAND + random_inputs(random.Random(99), 100):
        if any(t in text for t in ("<|", "<mask>", "<think>", "</think>", "ĠSpecialWord")):
            continue
        for name, tok in toks.items():
            whole = tok.encode(text, add_special_tokens=False).ids
            assert ids_from_parts(tok, name, text.encode("utf-8")) == whole, (name, text)

    with open(os.path.join(OUT, "cases.json"), "w") as f:
        f.write('{"tokenizers_version": "%s", "unicode_version": "%s", "cases": [\n' % (
            tokenizers.__version__, unicodedata.unidata_version))
        f.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
        f.write("\n]}\n")
    for fn in sorted(os.listdir(OUT)):
        print("%-14s %7d bytes" % (fn, os.path.getsize(os.path.join(OUT, fn))))
    print("%d cases, tokenizers %s" % (len(cases), tokenizers.__version__))
    fuzz_seeds()


if __name__ == "__main__":
    main()
