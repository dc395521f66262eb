/*
 * gguf.h — GGUF v3 checkpoints (docs/FORMATS.md §4), one header over four files:
 *   gguf_read.c   a bounded, validating reader (memory-mapped, or over a caller's buffer for
 *                 fuzzing): header, metadata, tensor infos, lookups, the tokenizer records;
 *   gguf_quant.c  the ggml type table and dequantisation of the types we accept to fp32;
 *   gguf_arch.c   GGUF metadata <-> ModelConfig, descriptor/HF names -> GGUF names, ne order,
 *                 LLaMA Q/K rows, llama3 rope_freqs;
 *   gguf_write.c  the writer (F32/F16/BF16 tensors) for exports.
 *
 * Reader invariants after a successful gguf_open:
 *  - every count and length was bounded by the bytes left in the file before anything was
 *    allocated, so allocations are a small multiple of the file size;
 *  - keys and tensor names are unique, non-empty and free of control bytes (copies are
 *    NUL-terminated), so they print in one-line messages;
 *  - every tensor has a known ggml type with a known block size, 1..4 dims, ne[0] a multiple of
 *    the block size, and an aligned, in-bounds, non-overlapping byte range: data points into the
 *    file and t->nbytes bytes are readable;
 *  - values point into the file (strings are NOT NUL-terminated: use their length).
 * Every error is one line that starts with the file path and names the key, tensor or offset.
 */
#ifndef LLMC_GGUF_H
#define LLMC_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "tensor.h"

#define GGUF_MAGIC             0x46554747u  // "GGUF" little-endian
#define GGUF_VERSION           3
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS          4
#define GGUF_MAX_NAME          64  // ggml's GGML_MAX_NAME: names are shorter than this
#define GGUF_MAX_KEY           65535
#define GGUF_MAX_ARRAY_DEPTH   8  // nested arrays deeper than this are refused

typedef enum {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT
} GgufValueType;

// ggml tensor types that have a name here (the codes are ggml's; gaps are removed types).
typedef enum {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q5_1 = 7,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_Q2_K = 10,
    GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q6_K = 14,
    GGML_TYPE_BF16 = 30,
    GGML_TYPE_MXFP4 = 39,
    GGML_TYPE_COUNT = 43
} GgmlType;

typedef struct GgufString {
    const char* s;  // into the file; not NUL-terminated
    uint64_t n;
} GgufString;

typedef struct GgufValue GgufValue;
struct GgufValue {
    GgufValueType type;
    uint64_t u;      // UINT8..UINT64 and BOOL (0/1)
    int64_t i;       // INT8..INT64
    double f;        // FLOAT32 / FLOAT64
    GgufString str;  // STRING
    // ARRAY
    GgufValueType elem_type;
    uint64_t n;            // number of elements
    const uint8_t* elems;  // scalar element types: the packed little-endian elements
    GgufString* strs;      // STRING elements (n, allocated)
    GgufValue* arrays;     // ARRAY elements (n nested arrays, allocated)
};

typedef struct GgufKV {
    const char* key;  // NUL-terminated copy
    GgufValue value;
    uint64_t raw_begin, raw_end;  // the whole record (key, type, value) in the file
} GgufKV;

typedef struct GgufTensor {
    const char* name;  // NUL-terminated copy
    int n_dims;
    int64_t ne[GGUF_MAX_DIMS];  // ggml order: ne[0] is the contiguous (innermost) dimension
    GgmlType type;
    uint64_t offset;  // relative to the data section
    uint64_t nbytes;
    int64_t numel;
    const uint8_t* data;  // into the file (only 1-byte aligned is assumed)
} GgufTensor;

typedef struct GgufFile {
    char* path;          // path, or the name given to gguf_open_memory
    const uint8_t* map;  // the whole file
    size_t size;
    int mapped;  // map is an mmap this struct owns
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;  // file offset of the data section
    int nonsequential;     // offsets are valid but not the writer's packed order (warn)
    int64_t n_kv;
    GgufKV* kv;  // file order
    int64_t n_tensors;
    GgufTensor* tensors;   // file order
    GgufTensor** by_name;  // sorted by name (lookups)
} GgufFile;

// ----------------------------------------------------------------------------
// reading (gguf_read.c)

int gguf_open(GgufFile* f, const char* path, char* err);
// Parse a buffer the caller keeps alive until gguf_close (fuzzing, tests). name is for messages.
int gguf_open_memory(GgufFile* f, const uint8_t* data, size_t size, const char* name, char* err);
void gguf_close(GgufFile* f);

const GgufKV* gguf_find_kv(const GgufFile* f, const char* key);
const GgufTensor* gguf_find_tensor(const GgufFile* f, const char* name);
// Typed getters: 1 = found and converted, 0 = absent, -1 = wrong type or out of range.
// Integers of any width are widened; gguf_get_float also accepts integers.
int gguf_get_int(const GgufFile* f, const char* key, int64_t* out);
int gguf_get_float(const GgufFile* f, const char* key, double* out);
int gguf_get_string(const GgufFile* f, const char* key, GgufString* out);
// Element i of an integer array (any integer width); -1 if not an integer array or i >= n.
int gguf_array_int(const GgufValue* v, uint64_t i, int64_t* out);

// A scalar integer value widened to int64 (-1 if not an integer or above INT64_MAX).
int gguf_value_int(const GgufValue* v, int64_t* out);
const char* gguf_value_type_name(GgufValueType t);  // "UINT32", ... or "?"

// ----------------------------------------------------------------------------
// ggml types and dequantisation (gguf_quant.c)

const char* ggml_type_name(int type);  // "Q4_K", ... or NULL if unknown
int ggml_type_can_dequantize(int type);
// Elements per block of a type, and the bytes of one block in *block_bytes; 0 (and *block_bytes
// untouched) when the type is unknown or its block size is unknown to this build.
int ggml_type_block(int type, int* block_bytes);
// Bytes of n elements of a type (n a multiple of the block size); 0 when unknown.
uint64_t ggml_type_bytes(int type, int64_t n);
// The types ggml_dequantize accepts, for messages: "F32, F16, BF16, Q8_0, ...".
const char* ggml_supported_types(void);

// n elements (a multiple of the type's block size) of `type` at src -> fp32. -1 if the type
// cannot be dequantised. No finiteness check here.
int ggml_dequantize(int type, const uint8_t* src, float* dst, int64_t n);
// Whole tensor to fp32 in ggml order (n must equal numel). Refuses unsupported types by name and
// non-finite values by element index.
int gguf_tensor_to_f32(const GgufFile* f, const GgufTensor* t, float* out, int64_t n, char* err);
// Elements [from, from + n) of t into out, the same checks and messages (an element's index is
// the tensor's); from and n whole blocks of t's type (-1 with err otherwise).
int gguf_tensor_range_to_f32(const GgufFile* f, const GgufTensor* t, int64_t from, int64_t n,
                             float* out, char* err);

// ----------------------------------------------------------------------------
// architectures (gguf_arch.c)

// general.architecture of a family: "llama", "qwen3", "qwen3moe", "gpt-oss".
const char* gguf_arch_name(ModelFamily family);
// Configuration from the metadata (and, where the metadata is silent, from tensor shapes:
// vocabulary from token_embd, tied head from the absence of output.weight, llama3 RoPE scaling
// from rope_freqs.weight, which is checked against our frequencies). Ends with config_validate.
int gguf_config(const GgufFile* f, ModelConfig* cfg, char* err);
// The GGUF name of a descriptor in a file of `family` (gguf_name, with per-architecture
// spellings: gpt-oss calls the post-attention norm post_attention_norm).
void gguf_tensor_name(ModelFamily family, const TensorDesc* d, char* out, size_t cap);
// GGUF name of an HF tensor name of any supported family, including the MoE tensors of
// qwen3moe and gpt-oss (router, stacked experts, sinks, biases). -1 if the name has no mapping.
int gguf_name_from_hf(ModelFamily family, const char* hf_name, char* out, size_t cap);
// Read descriptor d's tensor into out (HF row-major layout, fp32): the GGUF ne must be d's shape
// reversed (its parts' shapes for the MoE experts, below); LLaMA q/k rows are un-permuted
// (docs/FORMATS.md §4.4); non-finite values are refused.
int gguf_read_hf_tensor(const GgufFile* f, const ModelConfig* cfg, const TensorDesc* d, float* out,
                        char* err);

// The GGUF tensors that hold one descriptor, in llama.cpp's names and layouts. Most descriptors
// are one tensor of their own shape. The MoE experts differ: llama.cpp keeps gate and up apart
// (ffn_gate_exps then ffn_up_exps, each [E, Fe, C]; GPT-OSS's biases [E, Fe] likewise) and
// stores every expert matrix as [E, out, in], where GPT-OSS's HF tensors are x·W ([E, C, 2Fe]
// with gate/up interleaved in the columns, down [E, Fe, C]).
typedef struct GgufPart {
    char name[GGUF_MAX_NAME + 32];
    int ndim;
    int64_t shape[3];  // row-major (the file's ne reversed)
    int64_t numel;
} GgufPart;

// d's parts (1 or 2) into parts; returns how many.
int gguf_tensor_parts(const ModelConfig* cfg, const TensorDesc* d, GgufPart parts[2]);
// Part p's tensor of f, its ne checked against the part's shape reversed; NULL with err (missing,
// or another shape).
const GgufTensor* gguf_part_tensor(const GgufFile* f, const GgufPart* p, const TensorDesc* d,
                                   char* err);
// 1 if d's values must be rearranged between its table layout and its parts' (the MoE cases
// above); 0 if the single part's data is the table's.
int gguf_parts_rearranged(const ModelConfig* cfg, const TensorDesc* d);
// Between d's table layout (table) and its parts' row-major data back to back (packed, d->numel
// floats in all): to_table 1 fills table from packed, 0 fills packed from table.
void gguf_parts_convert(const ModelConfig* cfg, const TensorDesc* d, float* table, float* packed,
                        int to_table);

// llama.cpp's LLaMA Q/K row permutation on a (n_head*hd, cols) row-major matrix: forward
// (HF -> GGUF: GGUF row 2i+j = HF row j*hd/2+i within each head) or inverse (GGUF -> HF).
void gguf_permute_rows(const float* src, float* dst, int n_head, int64_t rows, int64_t cols,
                       int inverse);
// llama.cpp's rope_freqs.weight for a llama3-scaled config: HD/2 divisors of the base
// frequencies (1, factor or a blend), as the HF->GGUF converter computes them.
void gguf_llama3_rope_factors(const ModelConfig* cfg, float* factors);

// ----------------------------------------------------------------------------
// tokenizer metadata: every tokenizer.* record of a file, kept verbatim for exports (gguf_read.c)

typedef struct GgufTokenizer {
    uint8_t* records;  // n_kv serialized KV records, back to back
    size_t len;
    int64_t n_kv;
} GgufTokenizer;

void gguf_tokenizer_extract(const GgufFile* f, GgufTokenizer* tok);
void gguf_tokenizer_free(GgufTokenizer* tok);

// ----------------------------------------------------------------------------
// writing (F32 / F16 / BF16 tensors from fp32 sources; gguf_write.c)

typedef struct GgufWriterTensor {
    char* name;
    int n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    GgmlType type;
    const float* data;  // fp32 source, ggml order (= row-major HF layout)
    float* owned;       // freed by the writer (when the source was made for it)
} GgufWriterTensor;

typedef struct GgufWriter {
    uint8_t* kv;  // serialized KV records
    size_t kv_len, kv_cap;
    int64_t n_kv;
    int n, cap;
    GgufWriterTensor* t;
} GgufWriter;

void gguf_writer_init(GgufWriter* w);
void gguf_writer_add_u32(GgufWriter* w, const char* key, uint32_t v);
void gguf_writer_add_f32(GgufWriter* w, const char* key, float v);
void gguf_writer_add_bool(GgufWriter* w, const char* key, int v);
void gguf_writer_add_string(GgufWriter* w, const char* key, const char* v);
// Append serialized records (e.g. a GgufTokenizer) verbatim.
void gguf_writer_add_records(GgufWriter* w, const uint8_t* records, size_t len, int64_t n_kv);
// shape is row-major (HF); the file gets ne = shape reversed. type: F32, F16 or BF16.
// If `owned`, the writer frees data when it is freed.
void gguf_writer_add_tensor(GgufWriter* w, const char* name, GgmlType type, int ndim,
                            const int64_t* shape, const float* data, int owned);
// The architecture metadata of a config ({arch}.block_count, ...; general.architecture first;
// gguf_arch.c).
void gguf_writer_add_config(GgufWriter* w, const ModelConfig* cfg);
// Write atomically (atomic_file_*: path.tmp, fsync, rename); refuses values that overflow F16
// and duplicate names. Returns -1 with err on failure.
int gguf_writer_write(GgufWriter* w, const char* path, char* err);
void gguf_writer_free(GgufWriter* w);

#endif  // LLMC_GGUF_H
