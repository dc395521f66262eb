/*
 * unicode.c — lookups in the generated Unicode tables (unicode_tables.c) and NFC normalisation
 * (Unicode Standard Annex #15: full canonical decomposition, canonical ordering, canonical
 * composition; Hangul syllables arithmetically).
 *
 * NFC works span by span: text passing the quick check is copied as is, and only a span around
 * code points that fail it (from the starter before them to the next code point that passes) is
 * decomposed and recomposed. The spans are independent: a code point that passes the check is a
 * starter that composes with nothing before it and never reorders, so nothing crosses it.
 */
#include "unicode.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// table lookups

static int range_lookup(const UnicodeRange* r, int n, uint32_t cp) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) >> 1;
        if (cp < r[mid].lo) hi = mid - 1;
        else if (cp > r[mid].hi) lo = mid + 1;
        else return r[mid].value;
    }
    return 0;
}

UnicodeClass unicode_class(uint32_t cp) {
    if (cp >= UNICODE_RAW_BYTE) return UNICODE_OTHER;
    return (UnicodeClass)range_lookup(unicode_class_ranges, unicode_class_ranges_n, cp);
}

int unicode_ccc(uint32_t cp) {
    if (cp < 0x300 || cp >= UNICODE_RAW_BYTE) return 0;
    return range_lookup(unicode_ccc_ranges, unicode_ccc_ranges_n, cp);
}

int unicode_nfc_safe(uint32_t cp) {
    if (cp < 0x300 || cp >= UNICODE_RAW_BYTE) return 1;  // below U+0300 every code point passes
    return !range_lookup(unicode_nfc_unsafe, unicode_nfc_unsafe_n, cp);
}

int utf8_encode(uint32_t cp, uint8_t* out) {
    if (cp >= UNICODE_RAW_BYTE) {
        out[0] = (uint8_t)(cp - UNICODE_RAW_BYTE);
        return 1;
    }
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

// ----------------------------------------------------------------------------
// decomposition and composition of one code point / pair

#define HANGUL_S 0xAC00u
#define HANGUL_L 0x1100u
#define HANGUL_V 0x1161u
#define HANGUL_T 0x11A7u
#define HANGUL_LN 19u
#define HANGUL_VN 21u
#define HANGUL_TN 28u
#define HANGUL_SN (HANGUL_LN * HANGUL_VN * HANGUL_TN)

// The full canonical decomposition of cp into out (room for 4); returns its length.
static int decompose(uint32_t cp, uint32_t* out) {
    if (cp >= HANGUL_S && cp < HANGUL_S + HANGUL_SN) {
        uint32_t s = cp - HANGUL_S, t = s % HANGUL_TN;
        out[0] = HANGUL_L + s / (HANGUL_VN * HANGUL_TN);
        out[1] = HANGUL_V + (s % (HANGUL_VN * HANGUL_TN)) / HANGUL_TN;
        if (t == 0) return 2;
        out[2] = HANGUL_T + t;
        return 3;
    }
    if (cp >= 0xC0 && cp < UNICODE_RAW_BYTE) {
        int lo = 0, hi = unicode_decomp_n - 1;
        while (lo <= hi) {
            int mid = (lo + hi) >> 1;
            if (cp < unicode_decomp[mid].cp) hi = mid - 1;
            else if (cp > unicode_decomp[mid].cp) lo = mid + 1;
            else {
                const UnicodeDecomp* d = &unicode_decomp[mid];
                for (int k = 0; k < d->len; k++) out[k] = unicode_decomp_pool[d->offset + k];
                return d->len;
            }
        }
    }
    out[0] = cp;
    return 1;
}

// The primary composite of (a, b), or 0 when they do not compose.
static uint32_t compose(uint32_t a, uint32_t b) {
    if (a >= HANGUL_L && a < HANGUL_L + HANGUL_LN && b >= HANGUL_V && b < HANGUL_V + HANGUL_VN)
        return HANGUL_S + ((a - HANGUL_L) * HANGUL_VN + (b - HANGUL_V)) * HANGUL_TN;
    if (a >= HANGUL_S && a < HANGUL_S + HANGUL_SN && (a - HANGUL_S) % HANGUL_TN == 0 &&
        b > HANGUL_T && b < HANGUL_T + HANGUL_TN)
        return a + (b - HANGUL_T);
    int lo = 0, hi = unicode_comp_n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) >> 1;
        const UnicodeComp* c = &unicode_comp[mid];
        if (a < c->first || (a == c->first && b < c->second)) hi = mid - 1;
        else if (a > c->first || b > c->second) lo = mid + 1;
        else return c->composite;
    }
    return 0;
}

// ----------------------------------------------------------------------------
// NFC

static void out_reserve(uint8_t** out, size_t* len, size_t* cap, size_t more) {
    if (*len + more <= *cap) return;
    size_t want = *cap ? *cap : 256;
    while (want < *len + more) want *= 2;
    *out = realloc_check(*out, want);
    *cap = want;
}

// Normalise one span s[0..n) (starting at a starter or at the text's start) and append it.
static void nfc_span(const uint8_t* s, size_t n, uint8_t** out, size_t* len, size_t* cap) {
    // every code point decomposes to at most 4; a span's code points are at most its bytes
    uint32_t local[256];
    int local_ccc[256];
    size_t room = 4 * n;
    uint32_t* cps = room <= 256 ? local : malloc_check(room * sizeof(uint32_t));
    int* ccc = room <= 256 ? local_ccc : malloc_check(room * sizeof(int));
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += (size_t)utf8_decode(s + i, n - i, &cp);
        m += (size_t)decompose(cp, cps + m);
    }
    for (size_t i = 0; i < m; i++) ccc[i] = unicode_ccc(cps[i]);
    // canonical ordering: a stable insertion sort of each run of non-starters by class
    for (size_t i = 1; i < m; i++) {
        uint32_t cp = cps[i];
        int cc = ccc[i];
        if (cc == 0) continue;  // starters never move, and nothing passes them
        size_t j = i;
        while (j > 0 && ccc[j - 1] > cc) {
            cps[j] = cps[j - 1];
            ccc[j] = ccc[j - 1];
            j--;
        }
        cps[j] = cp;
        ccc[j] = cc;
    }
    // canonical composition in place: k is the output length
    size_t k = 0;
    long starter = -1;
    int last_ccc = 0;
    for (size_t i = 0; i < m; i++) {
        uint32_t cp = cps[i];
        int cc = ccc[i];
        if (starter >= 0) {
            // not blocked: adjacent to the starter, or every code point between has a lower,
            // non-zero class (the run is ordered, so the last one tells)
            int adjacent = (long)k - 1 == starter;
            if (adjacent || (last_ccc != 0 && last_ccc < cc)) {
                uint32_t c = compose(cps[starter], cp);
                if (c) {
                    cps[starter] = c;
                    continue;
                }
            }
        }
        if (cc == 0) starter = (long)k;
        last_ccc = cc;
        cps[k++] = cp;
    }
    out_reserve(out, len, cap, 4 * k);
    for (size_t i = 0; i < k; i++) *len += (size_t)utf8_encode(cps[i], *out + *len);
    if (cps != local) {
        free(cps);
        free(ccc);
    }
}

int unicode_nfc_quick(const uint8_t* s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {  // ASCII, eight bytes at a time
            uint64_t w;
            memcpy(&w, s + i, 8);
            if ((w & 0x8080808080808080ull) == 0) {
                i += 8;
                continue;
            }
        }
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        i += (size_t)utf8_decode(s + i, n - i, &cp);
        if (!unicode_nfc_safe(cp)) return 0;
    }
    return 1;
}

void unicode_nfc(const uint8_t* s, size_t n, uint8_t** out, size_t* len, size_t* cap) {
    size_t copied = 0, prev = 0, i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            prev = i++;
            continue;
        }
        uint32_t cp;
        int l = utf8_decode(s + i, n - i, &cp);
        if (unicode_nfc_safe(cp)) {
            prev = i;
            i += (size_t)l;
            continue;
        }
        // the span: from the starter before (when not already written) to the next safe point
        size_t start = i > copied ? prev : i;
        size_t j = i + (size_t)l;
        while (j < n) {
            uint32_t c2;
            int l2 = utf8_decode(s + j, n - j, &c2);
            if (unicode_nfc_safe(c2)) break;
            j += (size_t)l2;
        }
        if (start > copied) {
            out_reserve(out, len, cap, start - copied);
            memcpy(*out + *len, s + copied, start - copied);
            *len += start - copied;
        }
        nfc_span(s + start, j - start, out, len, cap);
        copied = i = j;
    }
    if (n > copied) {
        out_reserve(out, len, cap, n - copied);
        memcpy(*out + *len, s + copied, n - copied);
        *len += n - copied;
    }
}
