/*
 * outputs.c — the run's outputs checked as a set before training (path resolution, kinds,
 * writability probes, collisions between outputs and with inputs) and the --out folder lock.
 */
#include "outputs.h"

#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"

// ----------------------------------------------------------------------------
// the trainer's outputs

// The names the writers create directly in an output folder (checkpoint.c): --out holds the final
// model, the checkpoints step_<N>/ (built as step_<N>.tmp/) and the lock; --export-hf the
// weights (one file, or shards and their index), config.json and the copied tokenizer files.
static const char* const out_writes[] = {"model.safetensors", "config.json", ".lock", "step_*",
                                         "adapter_config.json", "adapter_model.safetensors",
                                         NULL};
// --export-lora: a PEFT adapter directory
static const char* const export_lora_writes[] = {"adapter_config.json",
                                                 "adapter_model.safetensors", NULL};
static const char* const export_hf_writes[] = {
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
    "chat_template.jinja", NULL};

void outputs_add_run(Outputs* o, const TrainArgs* a) {
    outputs_add(o, "--out", a->out, OUTPUT_DIR, out_writes);
    outputs_add(o, "--export-hf", a->export_hf, OUTPUT_DIR, export_hf_writes);
    outputs_add(o, "--export-gguf", a->export_gguf, OUTPUT_FILE, NULL);
    outputs_add(o, "--export-lora", a->export_lora, OUTPUT_DIR, export_lora_writes);
    outputs_add(o, "--trace", a->trace, OUTPUT_FILE, NULL);
    outputs_add(o, "--dump-state", a->dump_state, OUTPUT_FILE, NULL);
    outputs_add(o, "--log", a->log, OUTPUT_STREAM, NULL);
    outputs_add_input(o, "--train", a->train, 1);
    outputs_add_input(o, "--val", a->val, 1);
    outputs_add_input(o, "--model", a->model, 0);
    outputs_add_input(o, "--lora-init", a->lora_init, 0);
}

void outputs_init(Outputs* o) {
    memset(o, 0, sizeof *o);
    o->lock_fd = -1;
}

void outputs_add(Outputs* o, const char* flag, const char* path, OutputKind kind,
                 const char* const* writes) {
    if (!path || !*path) return;
    if (o->n >= OUTPUTS_MAX) fatal("outputs_add: more than %d outputs", OUTPUTS_MAX);
    OutputEntry* e = &o->e[o->n++];
    memset(e, 0, sizeof *e);
    e->flag = flag;
    e->path = path;
    e->kind = kind;
    e->writes = writes;
}

void outputs_add_input(Outputs* o, const char* flag, const char* pattern, int is_glob) {
    if (!pattern || !*pattern) return;
    if (o->n_inputs >= OUTPUTS_INPUTS_MAX) fatal("outputs_add_input: more than %d inputs",
                                                 OUTPUTS_INPUTS_MAX);
    o->in[o->n_inputs++] = (OutputInput){flag, pattern, is_glob};
}

// ----------------------------------------------------------------------------
// resolving a path that may not exist yet

// e->path as an absolute path with the symlinks of its existing part resolved and the rest
// normalised ("." and empty components dropped, ".." popped), so that two spellings of one
// file compare equal. *probe_dir: the folder a write would happen in (or, when that is still
// to be created, the nearest existing folder above it).
static int resolve(OutputEntry* e, char* probe_dir, size_t cap, char* err) {
    char abs[2 * OUTPUTS_PATH_MAX];
    size_t n = strlen(e->path);
    if (n >= OUTPUTS_PATH_MAX) return errorf(err, "%s: path too long", e->flag);
    int trailing_slash = n > 1 && e->path[n - 1] == '/';
    if (e->path[0] == '/') {
        str_copy(abs, sizeof abs, e->path);
    } else {
        char cwd[OUTPUTS_PATH_MAX];
        if (!getcwd(cwd, sizeof cwd))
            return errorf(err, "%s %s: cannot read the current folder: %s", e->flag, e->path,
                          strerror(errno));
        snprintf(abs, sizeof abs, "%s/%s", cwd, e->path);
    }
    size_t len = strlen(abs);
    while (len > 1 && abs[len - 1] == '/') abs[--len] = '\0';
    if (trailing_slash && e->kind != OUTPUT_DIR)
        return errorf(err, "%s %s: names a folder (ends in '/'); give a file name", e->flag,
                      e->path);
    // the longest prefix that exists
    size_t plen = len;
    struct stat st;
    for (;;) {
        const char c = abs[plen];
        abs[plen] = '\0';
        const int ok = stat(abs, &st) == 0;
        const int why = errno;
        abs[plen] = c;
        if (ok) break;
        if (why == ENOTDIR)
            return errorf(err, "%s %s: a folder on the way is a file", e->flag, e->path);
        if (why != ENOENT)
            return errorf(err, "%s %s: %s", e->flag, e->path, strerror(why));
        size_t k = plen;
        while (k > 0 && abs[k - 1] != '/') k--;  // the start of the last component
        plen = k > 1 ? k - 1 : 1;                // the prefix without it ("/" at the top)
    }
    const char* rest = abs + plen;
    while (*rest == '/') rest++;
    e->exists = *rest == '\0';
    if (!e->exists && !S_ISDIR(st.st_mode)) {
        abs[plen] = '\0';
        return errorf(err, "%s %s: %s is a file, not a folder", e->flag, e->path, abs);
    }
    char prefix[OUTPUTS_PATH_MAX];
    if (plen >= sizeof prefix) return errorf(err, "%s: path too long", e->flag);
    memcpy(prefix, abs, plen);
    prefix[plen] = '\0';
    char real[PATH_MAX];
    if (!realpath(prefix, real))
        return errorf(err, "%s %s: %s: %s", e->flag, e->path, prefix, strerror(errno));
    // canon = real + the rest, normalised
    char canon[2 * OUTPUTS_PATH_MAX];
    str_copy(canon, sizeof canon, strcmp(real, "/") == 0 ? "" : real);
    const size_t base = strlen(canon);
    for (const char* p = rest; *p;) {
        const char* q = strchr(p, '/');
        const size_t cl = q ? (size_t)(q - p) : strlen(p);
        if (cl == 2 && strncmp(p, "..", 2) == 0) {
            char* slash = strrchr(canon, '/');
            if (slash && (size_t)(slash - canon) >= base) *slash = '\0';
        } else if (cl > 0 && !(cl == 1 && p[0] == '.')) {
            const size_t used = strlen(canon);
            if (used + 1 + cl >= sizeof canon) return errorf(err, "%s: path too long", e->flag);
            canon[used] = '/';
            memcpy(canon + used + 1, p, cl);
            canon[used + 1 + cl] = '\0';
        }
        p += cl;
        while (*p == '/') p++;
    }
    if (!canon[0]) str_copy(canon, sizeof canon, "/");
    if (strlen(canon) >= sizeof e->canon) return errorf(err, "%s: path too long", e->flag);
    str_copy(e->canon, sizeof e->canon, canon);
    // kinds
    if (e->exists && e->kind == OUTPUT_DIR && !S_ISDIR(st.st_mode))
        return errorf(err, "%s %s: exists and is not a folder", e->flag, e->path);
    if (e->exists && e->kind != OUTPUT_DIR && S_ISDIR(st.st_mode))
        return errorf(err, "%s %s: is a folder; give a file name", e->flag, e->path);
    if (e->exists && e->kind == OUTPUT_FILE && !S_ISREG(st.st_mode))
        return errorf(err, "%s %s: not a regular file (this output is written to a temporary "
                      "file renamed over it, which would replace it); give a file name",
                      e->flag, e->path);
    e->special = e->exists && e->kind == OUTPUT_STREAM && !S_ISREG(st.st_mode);
    if (!e->exists) {
        str_copy(probe_dir, cap, real);
    } else if (e->kind == OUTPUT_DIR) {
        str_copy(probe_dir, cap, e->canon);
    } else {
        str_copy(probe_dir, cap, e->canon);
        char* slash = strrchr(probe_dir, '/');
        if (slash == probe_dir) slash[1] = '\0';
        else if (slash) *slash = '\0';
    }
    return 0;
}

// ----------------------------------------------------------------------------
// writability

// A file created and removed in dir: the one test that answers "can this run write here" for
// permissions, read-only mounts, ACLs and full inode tables alike.
static int probe_write(const OutputEntry* e, const char* dir, char* err) {
    char tmpl[OUTPUTS_PATH_MAX + 64];
    snprintf(tmpl, sizeof tmpl, "%s/.train_roundpipe-probe-XXXXXX", dir);
    const int fd = mkstemp(tmpl);
    if (fd < 0)
        return errorf(err, "%s %s: cannot write in the folder %s: %s", e->flag, e->path, dir,
                      strerror(errno));
    close(fd);
    unlink(tmpl);
    return 0;
}

// ----------------------------------------------------------------------------
// collisions

// name without one trailing ".tmp" (the atomic writers' temporary of name) into buf.
static const char* strip_tmp(const char* name, char* buf, size_t cap) {
    str_copy(buf, cap, name);
    size_t n = strlen(buf);
    if (n > 4 && strcmp(buf + n - 4, ".tmp") == 0) buf[n - 4] = '\0';
    return buf;
}

// Does writing output x touch path p (canonical)? Then *what names the file x writes there.
static int writes_path(const OutputEntry* x, const char* p, char* what, size_t cap) {
    if (x->special) return 0;
    char a[OUTPUTS_PATH_MAX], b[OUTPUTS_PATH_MAX];
    if (x->kind != OUTPUT_DIR) {
        // x itself and its temporary x.tmp
        if (strcmp(strip_tmp(x->canon, a, sizeof a), strip_tmp(p, b, sizeof b)) != 0) return 0;
        str_copy(what, cap, x->path);
        return 1;
    }
    if (strcmp(x->canon, p) == 0) {
        str_copy(what, cap, x->path);
        return 1;
    }
    const size_t n = strlen(x->canon);
    const int inside = strncmp(p, x->canon, n) == 0 && (p[n] == '/' || n == 1);
    if (!inside) return 0;
    const char* rel = p + (n == 1 ? 1 : n + 1);
    char first[OUTPUTS_PATH_MAX];
    str_copy(first, sizeof first, rel);
    char* slash = strchr(first, '/');
    if (slash) *slash = '\0';
    strip_tmp(first, b, sizeof b);
    for (const char* const* w = x->writes; w && *w; w++)
        if (fnmatch(*w, b, FNM_PERIOD) == 0 || fnmatch(*w, first, FNM_PERIOD) == 0) {
            snprintf(what, cap, "%s/%s", x->path, first);
            return 1;
        }
    return 0;
}

static int check_pair(const OutputEntry* x, const OutputEntry* y, char* err) {
    if (x->special || y->special) return 0;
    char what[2 * OUTPUTS_PATH_MAX + 8];
    if (strcmp(x->canon, y->canon) == 0)
        return errorf(err, "%s %s and %s %s are the same path: each would overwrite the other",
                      x->flag, x->path, y->flag, y->path);
    if (writes_path(x, y->canon, what, sizeof what))
        return errorf(err, "%s %s would be overwritten by %s, which writes %s", y->flag, y->path,
                      x->flag, what);
    if (writes_path(y, x->canon, what, sizeof what))
        return errorf(err, "%s %s would be overwritten by %s, which writes %s", x->flag, x->path,
                      y->flag, what);
    return 0;
}

// Every existing file of input `in` against every output.
static int check_input(const Outputs* o, const OutputInput* in, char* err) {
    glob_t g;
    memset(&g, 0, sizeof g);
    const char* single[1] = {in->pattern};
    const char* const* files = single;
    size_t n_files = 1;
    if (in->is_glob) {
        if (glob(in->pattern, 0, NULL, &g) != 0) {
            globfree(&g);
            return 0;  // no files: the loader says so
        }
        files = (const char* const*)g.gl_pathv;
        n_files = g.gl_pathc;
    }
    int rc = 0;
    char real[PATH_MAX], what[2 * OUTPUTS_PATH_MAX + 8];
    for (size_t i = 0; i < n_files && rc == 0; i++) {
        struct stat st;
        if (stat(files[i], &st) != 0 || !S_ISREG(st.st_mode) || !realpath(files[i], real))
            continue;
        for (int k = 0; k < o->n && rc == 0; k++)
            if (writes_path(&o->e[k], real, what, sizeof what))
                rc = errorf(err, "%s %s would overwrite the %s input %s", o->e[k].flag,
                            o->e[k].path, in->flag, files[i]);
    }
    if (in->is_glob) globfree(&g);
    return rc;
}

int outputs_check(Outputs* o, char* err) {
    char dir[OUTPUTS_PATH_MAX];
    for (int i = 0; i < o->n; i++) {
        OutputEntry* e = &o->e[i];
        if (resolve(e, dir, sizeof dir, err) != 0) return -1;
        if (e->exists && e->kind != OUTPUT_DIR && access(e->canon, W_OK) != 0)
            return errorf(err, "%s %s: exists and is not writable: %s", e->flag, e->path,
                          strerror(errno));
        if (!e->special && probe_write(e, dir, err) != 0) return -1;
    }
    for (int i = 0; i < o->n; i++)
        for (int j = i + 1; j < o->n; j++)
            if (check_pair(&o->e[i], &o->e[j], err) != 0) return -1;
    for (int i = 0; i < o->n_inputs; i++)
        if (check_input(o, &o->in[i], err) != 0) return -1;
    return 0;
}

int outputs_create(const Outputs* o, char* err) {
    char dir[OUTPUTS_PATH_MAX];
    for (int i = 0; i < o->n; i++) {
        const OutputEntry* e = &o->e[i];
        if (e->exists) continue;
        str_copy(dir, sizeof dir, e->canon);
        if (e->kind != OUTPUT_DIR) {
            char* slash = strrchr(dir, '/');
            if (!slash || slash == dir) continue;  // a file in "/"
            *slash = '\0';
        }
        if (mkdir_p(dir, err) != 0) return -1;
    }
    return 0;
}

// ----------------------------------------------------------------------------
// the --out lock

int outputs_lock(Outputs* o, const char* dir, char* err) {
    char path[OUTPUTS_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/.lock", dir);
    const int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return errorf(err, "--out %s: cannot create the lock file %s: %s", dir, path,
                      strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int why = errno;
        if (why != EWOULDBLOCK) {
            close(fd);
            return errorf(err, "--out %s: cannot lock %s: %s", dir, path, strerror(why));
        }
        // the holder writes its pid right after taking the lock: give it a moment
        char pid[32] = "";
        for (int tries = 0; tries < 10 && !pid[0]; tries++) {
            const ssize_t got = pread(fd, pid, sizeof pid - 1, 0);
            pid[got > 0 ? got : 0] = '\0';
            pid[strcspn(pid, "\n")] = '\0';
            if (!pid[0]) usleep(20000);
        }
        close(fd);
        return errorf(err, "--out %s: another run (pid %s) is using this folder (it holds %s); "
                      "wait for it to finish or choose another --out", dir,
                      pid[0] ? pid : "unknown", path);
    }
    char pid[32];
    const int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
        const int why = errno;
        close(fd);
        return errorf(err, "--out %s: cannot write the lock file %s: %s", dir, path,
                      strerror(why));
    }
    o->lock_fd = fd;
    return 0;
}

void outputs_release(Outputs* o) {
    if (o->lock_fd >= 0) close(o->lock_fd);  // closing the last descriptor releases the flock
    o->lock_fd = -1;
}
