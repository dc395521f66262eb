#!/usr/bin/env python3
"""
gen_unicode_tables.py -- writes llmc/unicode_tables.c, the Unicode data of the tokenizer, from
Python's unicodedata module (no other dependency), and prints the Unicode version it used.

Tables (all sorted, searched by binary search in llmc/unicode.c):

  unicode_class_ranges   code point ranges of the pre-tokenizer classes: letters (\\p{L}: Lu Ll
                         Lt Lm Lo), numbers (\\p{N}: Nd Nl No) and whitespace (the White_Space
                         property, what the regex engines of HF tokenizers and tiktoken call \\s);
                         everything else (punctuation, symbols, marks, controls, unassigned) is
                         "other" and has no entry
  unicode_ccc_ranges     canonical combining class, for every code point where it is not 0
  unicode_nfc_unsafe     code points that may change under NFC or make their neighbours change:
                         non-zero combining class, not NFC-stable on their own (singletons,
                         composition exclusions), or the second half of a canonical composition
                         (Hangul vowel and trailing jamo included); text without any of them is
                         already NFC, which is the quick check that skips the normaliser
  unicode_decomp         full canonical decomposition (recursive; Hangul syllables excepted, they
                         are decomposed arithmetically) into unicode_decomp_pool
  unicode_comp           canonical composition pairs (first, second) -> primary composite

White_Space is not exposed by unicodedata; it is listed below from PropList.txt (it has not changed
since Unicode 6.3) and checked against the general categories.

Usage:  python3 scripts/gen_unicode_tables.py [--out llmc/unicode_tables.c]
"""

import argparse
import os
import sys
import unicodedata as ud

MAX_CP = 0x110000

# PropList.txt, White_Space=Yes
WHITE_SPACE = [(0x0009, 0x000D), (0x0020, 0x0020), (0x0085, 0x0085), (0x00A0, 0x00A0),
               (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F),
               (0x205F, 0x205F), (0x3000, 0x3000)]

CLASS_LETTER, CLASS_NUMBER, CLASS_SPACE = 1, 2, 3


def ranges_of(values):
    """[(lo, hi, v)] for the runs of equal non-zero values of a per-code-point list."""
    out = []
    for cp, v in enumerate(values):
        if not v:
            continue
        if out and out[-1][1] == cp - 1 and out[-1][2] == v:
            out[-1][1] = cp
        else:
            out.append([cp, cp, v])
    return out


def class_values():
    vals = [0] * MAX_CP
    for cp in range(MAX_CP):
        g = ud.category(chr(cp))
        if g[0] == "L":
            vals[cp] = CLASS_LETTER
        elif g[0] == "N":
            vals[cp] = CLASS_NUMBER
    for lo, hi in WHITE_SPACE:
        for cp in range(lo, hi + 1):
            assert ud.category(chr(cp)) in ("Zs", "Cc", "Zl", "Zp"), hex(cp)
            vals[cp] = CLASS_SPACE
    return vals


def is_hangul_syllable(cp):
    return 0xAC00 <= cp <= 0xD7A3


def canonical_decomposition(cp):
    """The one-level canonical decomposition of cp as a list, or None."""
    d = ud.decomposition(chr(cp))
    if not d or d.startswith("<"):
        return None
    return [int(x, 16) for x in d.split()]


def full_decomposition(cp):
    d = canonical_decomposition(cp)
    if d is None:
        return [cp]
    out = []
    for x in d:
        out += full_decomposition(x)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(root, "llmc", "unicode_tables.c"))
    args = ap.parse_args()

    classes = ranges_of(class_values())
    ccc_vals = [ud.combining(chr(cp)) for cp in range(MAX_CP)]
    ccc = ranges_of(ccc_vals)

    decomp = []  # (cp, [full decomposition])
    comp = []    # (first, second, composite)
    seconds = set()
    for cp in range(MAX_CP):
        if is_hangul_syllable(cp):
            continue
        d = canonical_decomposition(cp)
        if d is None:
            continue
        full = full_decomposition(cp)
        # the recursive decomposition is already in canonical order (checked, not assumed)
        assert ud.normalize("NFD", chr(cp)) == "".join(map(chr, full)), hex(cp)
        decomp.append((cp, full))
        # a primary composite: a pair decomposition that NFC keeps (not excluded, not a
        # non-starter decomposition)
        if len(d) == 2 and ud.normalize("NFC", chr(cp)) == chr(cp) and ccc_vals[d[0]] == 0:
            comp.append((d[0], d[1], cp))
            seconds.add(d[1])
    comp.sort()

    unsafe = [0] * MAX_CP
    for cp in range(MAX_CP):
        if ccc_vals[cp] or cp in seconds or ud.normalize("NFC", chr(cp)) != chr(cp):
            unsafe[cp] = 1
    for cp in list(range(0x1161, 0x1176)) + list(range(0x11A8, 0x11C3)):  # Hangul V and T jamo
        unsafe[cp] = 1
    unsafe_ranges = ranges_of(unsafe)

    pool = []
    decomp_entries = []
    for cp, full in decomp:
        decomp_entries.append((cp, len(pool), len(full)))
        pool += full
    assert len(pool) < 65536 and max(len(f) for _, f in decomp) <= 4

    def emit_ranges(f, name, rows, what):
        f.write("// %s\n" % what)
        f.write("const UnicodeRange %s[] = {\n" % name)
        for i in range(0, len(rows), 4):
            f.write("   " + "".join(" {0x%X, 0x%X, %d}," % tuple(r) for r in rows[i:i + 4]) + "\n")
        f.write("};\nconst int %s_n = %d;\n\n" % (name, len(rows)))

    with open(args.out, "w") as f:
        f.write("/*\n * unicode_tables.c — GENERATED by scripts/gen_unicode_tables.py from Python's "
                "unicodedata\n * (Unicode %s). Do not edit: re-run the script. The lookups are in "
                "unicode.c.\n */\n" % ud.unidata_version)
        f.write('#include "unicode.h"\n\n')
        f.write('const char unicode_tables_version[] = "%s";\n\n' % ud.unidata_version)
        emit_ranges(f, "unicode_class_ranges", classes,
                    "pre-tokenizer classes: 1 letter (\\p{L}), 2 number (\\p{N}), 3 White_Space")
        emit_ranges(f, "unicode_ccc_ranges", ccc, "canonical combining class (non-zero only)")
        emit_ranges(f, "unicode_nfc_unsafe", unsafe_ranges,
                    "code points that fail the NFC quick check (value 1)")
        f.write("// full canonical decompositions: {code point, offset into the pool, length}\n")
        f.write("const UnicodeDecomp unicode_decomp[] = {\n")
        for i in range(0, len(decomp_entries), 4):
            f.write("   " + "".join(" {0x%X, %d, %d}," % e for e in decomp_entries[i:i + 4]) + "\n")
        f.write("};\nconst int unicode_decomp_n = %d;\n\n" % len(decomp_entries))
        f.write("const uint32_t unicode_decomp_pool[] = {\n")
        for i in range(0, len(pool), 8):
            f.write("   " + "".join(" 0x%X," % x for x in pool[i:i + 8]) + "\n")
        f.write("};\n\n")
        f.write("// canonical compositions, sorted by (first, second): {first, second, composite}\n")
        f.write("const UnicodeComp unicode_comp[] = {\n")
        for i in range(0, len(comp), 4):
            f.write("   " + "".join(" {0x%X, 0x%X, 0x%X}," % c for c in comp[i:i + 4]) + "\n")
        f.write("};\nconst int unicode_comp_n = %d;\n" % len(comp))

    print("Unicode %s: %d class ranges, %d ccc ranges, %d NFC quick-check ranges, %d decompositions "
          "(%d code points), %d compositions -> %s" % (
              ud.unidata_version, len(classes), len(ccc), len(unsafe_ranges), len(decomp_entries),
              len(pool), len(comp), os.path.relpath(args.out)), file=sys.stdout)


if __name__ == "__main__":
    main()
