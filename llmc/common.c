/*
 * common.c — checked wrappers, error reporting, files and atomic writes, time, number parsing,
 * printable strings, float conversions.
 */
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

// ----------------------------------------------------------------------------
// fatal errors

void fatal(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    fprintf(stderr, "train_roundpipe: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

void fatal_at(const char* file, int line, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    fprintf(stderr, "train_roundpipe: error at %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

int errorf(char* err, const char* fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, ERR_LEN, fmt, ap);
        va_end(ap);
    }
    return -1;
}

// ----------------------------------------------------------------------------
// checked wrappers

void* malloc_check_at(size_t size, const char* file, int line) {
    void* p = malloc(size ? size : 1);
    if (!p) fatal_at(file, line, "out of host memory allocating %zu bytes", size);
    return p;
}

void* calloc_check_at(size_t n, size_t size, const char* file, int line) {
    void* p = calloc(n ? n : 1, size ? size : 1);
    if (!p) fatal_at(file, line, "out of host memory allocating %zu x %zu bytes", n, size);
    return p;
}

void* realloc_check_at(void* p, size_t size, const char* file, int line) {
    void* q = realloc(p, size ? size : 1);
    if (!q) fatal_at(file, line, "out of host memory reallocating to %zu bytes", size);
    return q;
}

void* huge_alloc_check_at(size_t size, const char* file, int line) {
    const size_t huge = (size_t)2 << 20;
    if (size < huge) return aligned_alloc_check_at(size, file, line);
    void* p = NULL;
    if (posix_memalign(&p, huge, size) != 0 || !p)
        fatal_at(file, line, "out of host memory allocating %zu aligned bytes", size);
    // advice only (where transparent huge pages are off it changes nothing), for the whole 2 MiB
    // pages inside the allocation
    (void)madvise(p, size / huge * huge, MADV_HUGEPAGE);
    return p;
}

void* aligned_alloc_check_at(size_t size, const char* file, int line) {
    void* p = NULL;
    if (posix_memalign(&p, 64, size ? size : 64) != 0 || !p)
        fatal_at(file, line, "out of host memory allocating %zu aligned bytes", size);
    return p;
}

FILE* fopen_check_at(const char* path, const char* mode, const char* file, int line) {
    FILE* f = fopen(path, mode);
    if (!f) fatal_at(file, line, "cannot open '%s' (mode %s): %s", path, mode, strerror(errno));
    return f;
}

void fread_check_at(void* p, size_t size, size_t n, FILE* f, const char* path, const char* file,
                    int line) {
    size_t got = fread(p, size, n, f);
    if (got != n) {
        fatal_at(file, line, "%s: short read (%zu of %zu items): %s", path, got, n,
                 feof(f) ? "unexpected end of file" : strerror(errno));
    }
}

void fwrite_check_at(const void* p, size_t size, size_t n, FILE* f, const char* path,
                     const char* file, int line) {
    if (fwrite(p, size, n, f) != n) fatal_at(file, line, "%s: write failed: %s", path, strerror(errno));
}

void fclose_check_at(FILE* f, const char* path, const char* file, int line) {
    if (fclose(f) != 0) fatal_at(file, line, "%s: close failed: %s", path, strerror(errno));
}

char* strndup_check_at(const char* s, size_t n, const char* file, int line) {
    char* d = malloc_check_at(n + 1, file, line);
    if (n) memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

// ----------------------------------------------------------------------------
// whole files

char* file_read_all(const char* path, size_t max_bytes, size_t* out_len, char* err) {
    FILE* f = fopen(path, "rb");
    if (!f) {
        errorf(err, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    if (fseeko(f, 0, SEEK_END) != 0) {
        fclose(f);
        errorf(err, "%s: cannot seek: %s", path, strerror(errno));
        return NULL;
    }
    off_t size = ftello(f);
    if (size < 0 || (uint64_t)size > max_bytes) {
        fclose(f);
        errorf(err, "%s: file size %lld exceeds the limit of %zu bytes", path, (long long)size,
               max_bytes);
        return NULL;
    }
    rewind(f);
    char* buf = malloc_check((size_t)size + 1);
    if (size > 0 && fread(buf, 1, (size_t)size, f) != (size_t)size) {
        fclose(f);
        free(buf);
        errorf(err, "%s: short read", path);
        return NULL;
    }
    fclose(f);
    buf[size] = '\0';
    if (out_len) *out_len = (size_t)size;
    return buf;
}

int file_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

int dir_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int mkdir_p(const char* path, char* err) {
    char buf[4096];
    if (strlen(path) >= sizeof buf) return errorf(err, "%s: path too long", path);
    str_copy(buf, sizeof buf, path);
    for (char* p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return errorf(err, "%s: cannot create directory: %s", buf, strerror(errno));
            *p = '/';
        }
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return errorf(err, "%s: cannot create directory: %s", buf, strerror(errno));
    if (!dir_exists(buf)) return errorf(err, "%s: exists and is not a directory", buf);
    return 0;
}

int fsync_dir(const char* dir, char* err) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errorf(err, "%s: cannot open directory: %s", dir, strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0) return errorf(err, "%s: fsync failed: %s", dir, strerror(e));
    return 0;
}

// ----------------------------------------------------------------------------
// atomic writes

static void atomic_file_release(AtomicFile* af) {
    free(af->path);
    free(af->tmp);
    memset(af, 0, sizeof *af);
}

int atomic_file_open(AtomicFile* af, const char* path, char* err) {
    memset(af, 0, sizeof *af);
    const size_t n = strlen(path);
    af->path = strndup_check(path, n);
    af->tmp = malloc_check(n + 5);
    memcpy(af->tmp, path, n);
    memcpy(af->tmp + n, ".tmp", 5);
    af->f = fopen(af->tmp, "wb");
    if (!af->f) {
        errorf(err, "%s: cannot create: %s", af->tmp, strerror(errno));
        atomic_file_release(af);
        return -1;
    }
    return 0;
}

int atomic_file_write(AtomicFile* af, const void* data, size_t n, char* err) {
    if (af->failed) return -1;
    if (n > 0 && fwrite(data, 1, n, af->f) != n) {
        af->failed = 1;
        return errorf(err, "%s: write failed: %s", af->tmp, strerror(errno));
    }
    return 0;
}

void atomic_file_abort(AtomicFile* af) {
    if (af->f) fclose(af->f);  // the file is being thrown away: its close status does not matter
    if (af->tmp) unlink(af->tmp);
    atomic_file_release(af);
}

int atomic_file_commit(AtomicFile* af, char* err) {
    if (af->failed) {  // the message of the failed write is already in err
        atomic_file_abort(af);
        return -1;
    }
    int rc = 0;
    if (ferror(af->f) || fflush(af->f) != 0)
        rc = errorf(err, "%s: write failed: %s", af->tmp, strerror(errno));
    else if (fsync(fileno(af->f)) != 0)
        rc = errorf(err, "%s: fsync failed: %s", af->tmp, strerror(errno));
    FILE* f = af->f;
    af->f = NULL;
    if (fclose(f) != 0 && rc == 0) rc = errorf(err, "%s: close failed: %s", af->tmp, strerror(errno));
    if (rc == 0 && rename(af->tmp, af->path) != 0)
        rc = errorf(err, "%s: rename from %s failed: %s", af->path, af->tmp, strerror(errno));
    if (rc != 0) {
        atomic_file_abort(af);
        return -1;
    }
    // the rename is only durable once the directory entry is on disk
    char* slash = strrchr(af->path, '/');
    if (slash == af->path) {
        rc = fsync_dir("/", err);
    } else if (slash) {
        *slash = '\0';
        rc = fsync_dir(af->path, err);
    } else {
        rc = fsync_dir(".", err);
    }
    atomic_file_release(af);
    return rc;
}

int file_write_atomic(const char* path, const void* data, size_t len, char* err) {
    AtomicFile af;
    if (atomic_file_open(&af, path, err) != 0) return -1;
    if (atomic_file_write(&af, data, len, err) != 0) {
        atomic_file_abort(&af);
        return -1;
    }
    return atomic_file_commit(&af, err);
}

// ----------------------------------------------------------------------------
// time, numbers, strings

double time_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int parse_int64(const char* s, int64_t* out) {
    if (!s || !*s) return -1;
    errno = 0;
    char* end = NULL;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0') return -1;
    *out = (int64_t)v;
    return 0;
}

int parse_double(const char* s, double* out) {
    if (!s || !*s) return -1;
    errno = 0;
    char* end = NULL;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

void str_copy(char* dst, size_t cap, const char* src) {
    if (cap == 0) return;
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

const char* str_printable(const char* s, size_t n, char* buf, size_t cap) {
    if (cap == 0) return buf;
    // Printable ASCII only: a control byte would split the message, and a byte >= 0x80 may be a
    // C1 control (0x9b starts an escape sequence on some terminals) or half a UTF-8 character.
    size_t o = 0;
    for (size_t i = 0; i < n && o + 4 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        buf[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (o + 4 >= cap && n > 0 && cap >= 4) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

int str_ends_with(const char* s, const char* suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && memcmp(s + a - b, suffix, b) == 0;
}

int size_mul(size_t a, size_t b, size_t* out) {
    if (a != 0 && b > SIZE_MAX / a) return -1;
    *out = a * b;
    return 0;
}

int size_add(size_t a, size_t b, size_t* out) {
    if (a > SIZE_MAX - b) return -1;
    *out = a + b;
    return 0;
}

// ----------------------------------------------------------------------------
// float conversions

float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (uint16_t)((u + rounding) >> 16);
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400u) == 0);
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int32_t exp = (int32_t)((u >> 23) & 0xffu);
    uint32_t man = u & 0x7fffffu;
    if (exp == 255) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0));  // inf / nan
    int32_t e = exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);  // overflow -> inf
    if (e <= 0) {                                    // subnormal or zero
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = 1u << (shift - 1);
        uint32_t rest = man & ((1u << shift) - 1);
        uint32_t r = man >> shift;
        if (rest > half || (rest == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((uint32_t)e << 10) | (man >> 13);
    uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) r++;  // may carry into exponent: fine
    return (uint16_t)(sign | r);
}

void format_bytes(double b, char* buf, size_t cap) {
    if (b >= 1073741824.0) snprintf(buf, cap, "%.2f GiB", b / 1073741824.0);
    else if (b >= 1048576.0) snprintf(buf, cap, "%.2f MiB", b / 1048576.0);
    else if (b >= 1024.0) snprintf(buf, cap, "%.2f KiB", b / 1024.0);
    else snprintf(buf, cap, "%.0f B", b);
}
