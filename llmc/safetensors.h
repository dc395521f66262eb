/*
 * safetensors.h — reading (memory-mapped, single file or sharded via model.safetensors.index.json)
 * and writing safetensors files.
 *
 * Reading validates everything the reference reader does: header length <= 100 MB, a JSON object
 * header, known dtypes, byte sizes = numel * dtype size, tensors tiling the data buffer exactly
 * (no gaps, no overlaps, no trailing bytes), no duplicate names. Errors name the file and tensor.
 * Tensor data pointers point into the mmap and are only 1-byte aligned in general: convert with
 * st_tensor_to_f32 (which handles unaligned sources) rather than casting.
 */
#ifndef LLMC_SAFETENSORS_H
#define LLMC_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    ST_BOOL = 0, ST_U8, ST_I8, ST_I16, ST_U16, ST_F16, ST_BF16, ST_I32, ST_U32, ST_F32,
    ST_F64, ST_I64, ST_U64, ST_F8_E5M2, ST_F8_E4M3, ST_DTYPE_COUNT
} StDtype;

#define ST_MAX_DIMS 8

typedef struct StTensor {
    const char* name;
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t numel;
    uint64_t nbytes;
    const uint8_t* data;  // into the mmap (or NULL when nbytes == 0)
    const char* file;     // path of the file holding it
} StTensor;

typedef struct StFile {
    char* path;
    uint8_t* map;  // whole file, read-only mmap
    size_t size;
    int n_tensors;
    StTensor* tensors;  // sorted by name
    int n_meta;
    char** meta_keys;  // __metadata__ (string -> string)
    char** meta_vals;
} StFile;

// A checkpoint: one file, or every shard listed by a model.safetensors.index.json.
typedef struct StCheckpoint {
    int n_files;
    StFile* files;
    int n_tensors;
    const StTensor** tensors;  // all tensors of all files, sorted by name (no duplicates)
} StCheckpoint;

const char* st_dtype_name(StDtype dt);
int st_dtype_size(StDtype dt);  // bytes per element

int st_open(StFile* f, const char* path, char* err);
void st_close(StFile* f);
const StTensor* st_find(const StFile* f, const char* name);
const char* st_meta(const StFile* f, const char* key);  // NULL if absent

// path: a directory (model.safetensors.index.json or model.safetensors inside), an index .json,
// or a .safetensors file. Checks that every shard in the index exists, that each tensor of the
// weight_map is in the shard it names, and that no name appears twice across shards.
int st_checkpoint_open(StCheckpoint* ck, const char* path, char* err);
void st_checkpoint_close(StCheckpoint* ck);
const StTensor* st_checkpoint_find(const StCheckpoint* ck, const char* name);

// Convert a F32/F16/BF16 tensor to fp32 (n must equal numel). Rejects other dtypes and
// non-finite values (naming the tensor and the element index).
int st_tensor_to_f32(const StTensor* t, float* out, int64_t n, char* err);

// ----------------------------------------------------------------------------
// writing

typedef struct StWriterTensor {
    char* name;
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void* data;  // not copied: must stay valid until st_writer_write returns
    uint64_t nbytes;
} StWriterTensor;

typedef struct StWriter {
    int n, cap;
    StWriterTensor* t;
    int n_meta;
    char** meta_keys;
    char** meta_vals;
    uint64_t file_bytes;    // after a successful st_writer_write: the file's size
    uint32_t file_crc32c;   // and its CRC-32C (computed while writing, for checkpoint DONE files)
    // Optional: called before each tensor's bytes are written, in file order, with the tensor's
    // index in the order added, for a caller that fills the data only then (a data-parallel
    // checkpoint gathers one layer at a time); non-zero stops the write (err set).
    int (*before)(void* ctx, int index, char* err);
    void* before_ctx;
} StWriter;

void st_writer_init(StWriter* w);
void st_writer_add(StWriter* w, const char* name, StDtype dtype, int ndim, const int64_t* shape,
                   const void* data);
void st_writer_meta(StWriter* w, const char* key, const char* value);
// Write the file atomically (path.tmp, fsync, rename). Header padded with spaces to a multiple
// of 8; tensors in name order. Returns -1 with err on failure or duplicate names.
int st_writer_write(StWriter* w, const char* path, char* err);
// The same calls of w->before, in the same order, writing nothing (the ranks that take part in
// a gather but do not write). 0, or the first non-zero return.
int st_writer_visit(StWriter* w, char* err);
void st_writer_free(StWriter* w);

#endif  // LLMC_SAFETENSORS_H
