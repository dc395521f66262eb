/*
 * json.h — a strict, bounded JSON (RFC 8259) parser for config.json, safetensors headers and
 * index files, plus a tiny string escaper for writers.
 *
 * The parser builds a tree in one arena owned by JsonDoc. It never crashes on hostile input:
 * nesting depth, string sizes and counts are bounded; errors name the byte offset.
 * Duplicate keys inside one object are rejected (safetensors forbids them; configs never use them).
 */
#ifndef LLMC_JSON_H
#define LLMC_JSON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef enum { JSON_NULL = 0, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } JsonType;

typedef struct JsonValue JsonValue;
struct JsonValue {
    JsonType type;
    int boolean;       // JSON_BOOL
    double number;     // JSON_NUMBER (always set)
    int is_integer;    // JSON_NUMBER written without fraction/exponent and fits in int64
    int64_t integer;   // exact value when is_integer
    const char* str;   // JSON_STRING: decoded UTF-8, NUL-terminated (may contain NUL: use str_len)
    size_t str_len;
    size_t n;                 // JSON_ARRAY / JSON_OBJECT: number of items
    JsonValue* items;         // the items (array elements or object values), in document order
    const char* const* keys;  // JSON_OBJECT: keys[i] names items[i]
    const size_t* key_lens;   // JSON_OBJECT: byte length of keys[i]
};

typedef struct JsonDoc {
    JsonValue root;
    void* arena;  // private: all memory of the tree
} JsonDoc;

#define JSON_MAX_DEPTH 64

// Parse text[0..len). Returns 0, or -1 with err like "at byte 123: expected ':' after key".
// The caller prefixes the file name. Trailing whitespace is allowed, anything else is an error.
int json_parse(const char* text, size_t len, JsonDoc* doc, char* err);
void json_free(JsonDoc* doc);

// Lookups. Return NULL when obj is not an object or the key is missing.
const JsonValue* json_get(const JsonValue* obj, const char* key);
// Typed getters: 1 = found and converted, 0 = key missing (or JSON null), -1 = wrong type/range.
int json_get_int(const JsonValue* obj, const char* key, int64_t* out);
int json_get_double(const JsonValue* obj, const char* key, double* out);  // accepts integers
int json_get_bool(const JsonValue* obj, const char* key, int* out);
int json_get_string(const JsonValue* obj, const char* key, const char** out);

// Write s as a JSON string literal (with quotes and escapes) to f.
void json_write_string(FILE* f, const char* s);
// Same into a buffer: returns the number of bytes written excluding NUL (truncates safely).
size_t json_escape(char* dst, size_t cap, const char* s);

#endif  // LLMC_JSON_H
