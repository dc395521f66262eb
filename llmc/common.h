/*
 * common.h — checked wrappers, error reporting, timing and small helpers used by every module.
 *
 * Two kinds of failure exist in this code base:
 *  - Bad external input (a file, a flag, a config field). Parsers never exit: they return -1 and
 *    write one human-readable line into a caller-provided `char err[ERR_LEN]` that names the file
 *    and the field. The caller (usually main) prints it with `fatal()` and exits non-zero.
 *  - Failures of the machine (out of memory, an I/O error, a pthread call failing). These go
 *    through the `*_check` wrappers below, which print file:line of the call site and exit(1).
 * No assert() on user input anywhere.
 */
#ifndef LLMC_COMMON_H
#define LLMC_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define ERR_LEN 512

// ----------------------------------------------------------------------------
// fatal errors

// Print "train_roundpipe: error: <msg>" and exit(1).
__attribute__((noreturn, format(printf, 1, 2))) void fatal(const char* fmt, ...);
// Same, with the source location of the failing call (for machine failures, not user input).
__attribute__((noreturn, format(printf, 3, 4))) void fatal_at(const char* file, int line,
                                                              const char* fmt, ...);
// Write a formatted message into err (ERR_LEN bytes) and return -1. For parsers:
//   if (bad) return errorf(err, "%s: tensor '%s': shape mismatch", path, name);
__attribute__((format(printf, 2, 3))) int errorf(char* err, const char* fmt, ...);

// ----------------------------------------------------------------------------
// checked wrappers: on failure print file:line and exit(1)

void* malloc_check_at(size_t size, const char* file, int line);
void* calloc_check_at(size_t n, size_t size, const char* file, int line);
void* realloc_check_at(void* p, size_t size, const char* file, int line);
// 64-byte aligned allocation (SIMD, cache lines); free with free().
void* aligned_alloc_check_at(size_t size, const char* file, int line);
// The same for large arrays streamed by many threads (the optimizer's state): from 2 MiB up,
// 2 MiB aligned and advised to use transparent huge pages (fewer TLB misses); free with free().
void* huge_alloc_check_at(size_t size, const char* file, int line);
FILE* fopen_check_at(const char* path, const char* mode, const char* file, int line);
void fread_check_at(void* p, size_t size, size_t n, FILE* f, const char* path, const char* file,
                    int line);
void fwrite_check_at(const void* p, size_t size, size_t n, FILE* f, const char* path,
                     const char* file, int line);
void fclose_check_at(FILE* f, const char* path, const char* file, int line);
// A NUL-terminated malloc'd copy of the n bytes at s.
char* strndup_check_at(const char* s, size_t n, const char* file, int line);

#define malloc_check(size) malloc_check_at((size), __FILE__, __LINE__)
#define calloc_check(n, size) calloc_check_at((n), (size), __FILE__, __LINE__)
#define realloc_check(p, size) realloc_check_at((p), (size), __FILE__, __LINE__)
#define aligned_alloc_check(size) aligned_alloc_check_at((size), __FILE__, __LINE__)
#define huge_alloc_check(size) huge_alloc_check_at((size), __FILE__, __LINE__)
#define fopen_check(path, mode) fopen_check_at((path), (mode), __FILE__, __LINE__)
#define fread_check(p, size, n, f, path) fread_check_at((p), (size), (n), (f), (path), __FILE__, __LINE__)
#define fwrite_check(p, size, n, f, path) fwrite_check_at((p), (size), (n), (f), (path), __FILE__, __LINE__)
#define fclose_check(f, path) fclose_check_at((f), (path), __FILE__, __LINE__)
#define strndup_check(s, n) strndup_check_at((s), (n), __FILE__, __LINE__)
// For pthread_* and similar calls that return an error number.
#define pthread_check(call)                                                                      \
    do {                                                                                         \
        int rc__ = (call);                                                                       \
        if (rc__ != 0) fatal_at(__FILE__, __LINE__, "%s failed (errno %d)", #call, rc__);        \
    } while (0)

// ----------------------------------------------------------------------------
// whole files

// Read a whole (small) file into a NUL-terminated malloc'd buffer. Returns NULL and fills err when
// the file cannot be opened/read or is larger than max_bytes.
char* file_read_all(const char* path, size_t max_bytes, size_t* out_len, char* err);
// "1.50 GiB", "12.00 MiB", "3.00 KiB" or "17 B" into buf.
void format_bytes(double bytes, char* buf, size_t cap);
int file_exists(const char* path);
int dir_exists(const char* path);
// mkdir -p. Returns -1 with err on failure.
int mkdir_p(const char* path, char* err);
// fsync a directory, so that the names created or renamed in it survive a crash.
int fsync_dir(const char* dir, char* err);

// ----------------------------------------------------------------------------
// atomic writes: every file this program writes goes through these (all but the --log
// JSON-lines file, which is appended to step by step)
//
// The bytes go to path.tmp (same directory, hence same file system), which is fsync'd, closed and
// renamed over path; then the directory is fsync'd so the rename is durable too. Until the
// commit, path keeps its old contents (or stays absent); a failure removes path.tmp. Every stdio
// call is checked: a write error, including one that only shows at fflush/fclose, fails the
// commit. Errors are one line naming the file.

typedef struct AtomicFile {
    FILE* f;     // the temporary; callers may fprintf to it (errors surface at the commit)
    char* path;  // the final name
    char* tmp;   // path.tmp
    int failed;  // a write failed (the message is already in err)
} AtomicFile;

// Create path.tmp. -1 with err if it cannot be created.
int atomic_file_open(AtomicFile* af, const char* path, char* err);
// Append n bytes. -1 with err on a write error (later writes and the commit then fail too).
int atomic_file_write(AtomicFile* af, const void* data, size_t n, char* err);
// Flush, fsync, close, rename to path, fsync the directory. Releases af either way; on failure
// path.tmp is removed and path untouched.
int atomic_file_commit(AtomicFile* af, char* err);
// Close and remove path.tmp (a writer that gives up after atomic_file_open).
void atomic_file_abort(AtomicFile* af);
// The whole of a buffer: open, write, commit.
int file_write_atomic(const char* path, const void* data, size_t len, char* err);

// ----------------------------------------------------------------------------
// time, numbers, strings

double time_now_s(void);  // monotonic seconds

// Parse a whole string as a number. Return 0 on success, -1 if the string is empty, has trailing
// characters, overflows, or (for the float) is not finite.
int parse_int64(const char* s, int64_t* out);
int parse_double(const char* s, double* out);

// Copy a string into a fixed buffer, always NUL-terminated, truncating if needed.
void str_copy(char* dst, size_t cap, const char* src);
// Untrusted bytes (names and values read from files) made safe for a one-line message: the n
// bytes at s (NULs included) with every byte outside printable ASCII (controls, DEL, bytes
// >= 0x80) replaced by '?', truncated with "..." to fit cap. Returns buf.
const char* str_printable(const char* s, size_t n, char* buf, size_t cap);
int str_ends_with(const char* s, const char* suffix);

// Multiplications and sums of sizes that must not overflow (return -1 on overflow).
int size_mul(size_t a, size_t b, size_t* out);
int size_add(size_t a, size_t b, size_t* out);

// bf16/fp16 <-> fp32 conversions on the host (round to nearest even for bf16).
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Little-endian loads from byte buffers (file formats; no alignment assumed).
static inline uint16_t load_le16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t load_le32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t load_le64(const uint8_t* p) {
    return (uint64_t)load_le32(p) | ((uint64_t)load_le32(p + 4) << 32);
}

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
static inline int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

#endif  // LLMC_COMMON_H
