/*
 * tokenizer.h — byte-level BPE as GPT-2, LLaMA-3 and Qwen2/Qwen3 use it, loaded from a Hugging
 * Face tokenizer.json or from GGUF tokenizer.ggml.* metadata, and id-exact with HF tokenizers.
 *
 * Encoding runs the HF pipeline:
 *   1. added tokens (<|im_start|>, <|endoftext|>, <|begin_of_text|>, ...) are cut out of the text
 *      as atoms, leftmost-longest, before anything else sees the text;
 *   2. each stretch between them is normalised (NFC for Qwen; nothing for LLaMA-3 and GPT-2);
 *   3. pre-tokenised by one of three hand-written scanners that implement the split regexes
 *      exactly (GPT-2's, LLaMA-3's = tiktoken cl100k's, Qwen2's; Unicode classes from generated
 *      tables, see unicode.h); no regex engine;
 *   4. every piece becomes bytes (the byte-level alphabet is a bijection, so BPE works on bytes and
 *      token ids directly) and is merged by merge rank, lowest first and leftmost on ties, with a
 *      heap over a linked list of symbols; LLaMA-3's ignore_merges takes a piece that is a whole
 *      vocabulary entry as is. Pieces are cached per encoder.
 * Invalid UTF-8 is encoded byte by byte (each invalid byte is a pre-tokenizer "other" character),
 * so decode(encode(x)) == x for any bytes x.
 *
 * Decoding maps every id to its bytes (the byte-level alphabet reversed; added tokens as their
 * text) and concatenates them: no replacement characters, the caller sees the exact bytes.
 *
 * A Tokenizer is immutable after loading and may be shared by threads; each thread encodes with
 * its own TokEncoder (the piece cache and scratch buffers).
 */
#ifndef LLMC_TOKENIZER_H
#define LLMC_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef enum {
    TOK_SPLIT_GPT2 = 0,  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    TOK_SPLIT_LLAMA3,    // (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|...
    TOK_SPLIT_QWEN2,     // the same with \p{N} (one digit per piece)
} TokSplit;

// What an id is (Tokenizer.kind).
enum {
    TOK_KIND_NONE = 0,  // an unused id (a hole in the vocabulary): encodes never, decodes to nothing
    TOK_KIND_NORMAL,    // a model (BPE) token
    TOK_KIND_ADDED,     // an added token matched as an atom (special=false in HF, USER_DEFINED in GGUF)
    TOK_KIND_SPECIAL,   // an added special token (special=true in HF, CONTROL in GGUF)
};

typedef struct TokAdded {
    int32_t id;
    int special;         // TOK_ENCODE_NO_SPECIAL leaves it to the text
    int lstrip, rstrip;  // the match swallows the whitespace on its left / right
    uint64_t off;        // its text (what is matched): added_text[off, off + len)
    uint32_t len;
} TokAdded;

typedef struct TokMergeSlot {  // private: the merge table, keyed by (left id, right id)
    uint64_t key;
    int32_t rank, id;
} TokMergeSlot;

typedef struct TokVocabSlot {  // private: model tokens by their bytes
    uint32_t tag;  // high hash bits
    int32_t id;    // -1: empty
} TokVocabSlot;

typedef struct Tokenizer {
    int32_t n_vocab;     // ids are [0, n_vocab): one past the largest id of vocabulary and added tokens
    TokSplit split;
    int nfc;             // NFC normaliser (Qwen)
    int add_prefix_space;  // ByteLevel add_prefix_space: a space before text that has none
    int ignore_merges;   // LLaMA-3: a piece that is a vocabulary entry is one token
    int fuse_unk;
    int32_t bos_id, eos_id, pad_id, unk_id;  // -1 when the tokenizer has none
    // What TOK_ENCODE_ADD_SPECIAL adds around the ids (HF TemplateProcessing's single sequence,
    // GGUF add_bos_token / add_eos_token).
    int n_prefix, n_suffix;
    int32_t prefix[4], suffix[4];
    // per id
    uint8_t* kind;         // (n_vocab) TOK_KIND_*
    uint8_t* bytelevel;    // (n_vocab) 1: the token's text is in the byte-level alphabet
    uint64_t* piece_off;   // (n_vocab + 1) the bytes of id i are pieces[piece_off[i], piece_off[i+1])
    uint8_t* pieces;
    // added tokens, matched leftmost-longest: sorted by (first byte, length descending)
    int n_added;
    TokAdded* added;
    uint8_t* added_text;
    int32_t added_first[257];  // added tokens starting with byte b: added[added_first[b], [b+1])
    // BPE
    int32_t byte_id[256];  // the token of each single byte (-1: none)
    int32_t n_merges;      // merges kept (those over byte-level tokens), in rank order
    int32_t (*merges)[2];  // (n_merges) left and right id
    TokMergeSlot* merge_table;
    uint64_t merge_mask;
    TokVocabSlot* vocab_table;  // model tokens by bytes (open addressing)
    uint64_t vocab_mask;
} Tokenizer;

// ----------------------------------------------------------------------------
// loading

// A tokenizer.json, a directory holding one, or a GGUF file (told apart by its magic). Next to a
// tokenizer.json, tokenizer_config.json (when present) names the bos / eos / pad tokens, which
// tokenizer.json itself does not. Errors are one line naming the file.
int tokenizer_load(Tokenizer* t, const char* path, char* err);
// HF tokenizer.json text (name is for messages).
int tokenizer_load_json(Tokenizer* t, const char* text, size_t len, const char* name, char* err);
// Apply a tokenizer_config.json: bos_token / eos_token / pad_token / unk_token, when they name
// tokens of t (strings or {"content": ...} objects).
int tokenizer_apply_config(Tokenizer* t, const char* text, size_t len, const char* name, char* err);
// GGUF metadata: tokenizer.ggml.model "gpt2" with tokenizer.ggml.pre "default"/"gpt-2",
// "llama-bpe"/"llama3" or "qwen2"; tokens, merges, token_type, bos/eos/padding/unknown ids,
// add_bos_token / add_eos_token. "qwen2" gets the NFC normaliser of Qwen's tokenizer.json.
int tokenizer_load_gguf(Tokenizer* t, const GgufFile* f, char* err);
// The same from the tokenizer records a checkpoint keeps (gguf_tokenizer_extract).
int tokenizer_load_gguf_records(Tokenizer* t, const GgufTokenizer* rec, const char* name,
                                char* err);
void tokenizer_free(Tokenizer* t);

// The id of the token whose text is exactly s[0..n) (an added token's content first, then a
// model token's bytes), or -1.
int32_t tokenizer_find(const Tokenizer* t, const char* s, size_t n);
// The token that starts every document: the BOS token, else the EOS token, else <|endoftext|>;
// -1 when there is none. The shard tool puts it before each document, so the sample starts with
// it too.
int32_t tokenizer_document_token(const Tokenizer* t);

// ----------------------------------------------------------------------------
// encoding

typedef struct TokIds {
    int32_t* ids;
    size_t n, cap;
} TokIds;

// The per-thread state of encoding: a cache of pieces already merged and scratch buffers.
typedef struct TokEncoder {
    const Tokenizer* tok;
    // piece cache: open addressing over slots, keys and ids in two pools; cleared when full
    struct TokCacheSlot* slots;
    uint64_t slot_mask;
    size_t n_used;
    uint8_t* keys;
    size_t keys_n, keys_cap;
    int32_t* cids;
    size_t cids_n, cids_cap;
    // scratch
    uint8_t* norm;  // the normalised text of a stretch
    size_t norm_n, norm_cap;
    struct TokSymbol* sym;
    struct TokHeapItem* heap;
    size_t sym_cap, heap_cap;
    int64_t hits, misses;  // cache statistics
} TokEncoder;

enum {
    TOK_ENCODE_ADD_SPECIAL = 1,  // add the prefix / suffix tokens (HF add_special_tokens=True)
    TOK_ENCODE_NO_SPECIAL = 2,   // special added tokens are plain text (HF split_special_tokens)
};

void tokenizer_encoder_init(TokEncoder* e, const Tokenizer* t);
void tokenizer_encoder_free(TokEncoder* e);
// Append the ids of text[0..len) (any bytes) to out. Never fails.
void tokenizer_encode(TokEncoder* e, const void* text, size_t len, int flags, TokIds* out);
// The same without keeping an encoder (a prompt, a chat template): a temporary one.
void tokenizer_encode_once(const Tokenizer* t, const void* text, size_t len, int flags, TokIds* out);
void tokenizer_ids_push(TokIds* v, int32_t id);
void tokenizer_ids_free(TokIds* v);

// ----------------------------------------------------------------------------
// decoding

// The bytes of one id (NULL for an id out of range; a hole has length 0).
const uint8_t* tokenizer_piece(const Tokenizer* t, int32_t id, size_t* len);

enum { TOK_DECODE_SKIP_SPECIAL = 1 };

// Append the bytes of ids to *out (malloc'd, *cap bytes, *len used; NUL-terminated for
// convenience, the NUL not counted). -1 with err for an id outside [0, n_vocab).
int tokenizer_decode(const Tokenizer* t, const int32_t* ids, size_t n, int flags, uint8_t** out,
                     size_t* len, size_t* cap, char* err);

// ----------------------------------------------------------------------------
// writing (exports)

// The tokenizer as GGUF tokenizer.ggml.* records (model "gpt2", pre, tokens, token_type, merges,
// special ids, add_bos/add_eos), ready for gguf_writer_add_records. n_vocab: the model's
// vocabulary size; ids from t->n_vocab up to it are written as unused [PAD<id>] tokens, as
// llama.cpp's converter does (llama.cpp's vocabulary must match the embedding's rows).
void tokenizer_gguf_records(const Tokenizer* t, int32_t n_vocab, GgufTokenizer* out);
// The tokenizer as an HF tokenizer.json (written atomically).
int tokenizer_write_json(const Tokenizer* t, const char* path, char* err);
// An HF model directory's tokenizer files: dir/tokenizer.json and dir/tokenizer_config.json
// (bos / eos / pad / unk tokens, PreTrainedTokenizerFast), what AutoTokenizer reads.
int tokenizer_write_hf(const Tokenizer* t, const char* dir, char* err);

#endif  // LLMC_TOKENIZER_H
