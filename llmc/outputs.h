/*
 * outputs.h — every file and folder a run will write, checked before the first step, and the
 * lock that keeps two runs out of one --out folder.
 *
 * A run that trains for hours and then cannot write its model has lost the hours. So before
 * anything big is loaded, the run's outputs (--out, --export-hf, --export-gguf, --trace,
 * --dump-state, --log; the table is outputs_add_run) are checked as a set:
 *  - the folder rule, the same for all of them: folders are created as needed (as mkdir -p
 *    does), both an output folder itself (--out, --export-hf) and the folders a file output
 *    goes into; nothing is created for --plan;
 *  - a file output must not be an existing folder (nor end in '/'), a folder output must not be
 *    an existing file, and no path on the way may be a file; a file written atomically (to
 *    NAME.tmp, renamed over NAME) must not be a device or pipe (the rename would replace
 *    /dev/null itself), only the log, written in place, may be;
 *  - the folder each output is written into is writable: a temporary file is created and
 *    removed there (in the nearest existing folder when it is still to be created), and an
 *    existing file output must be writable itself;
 *  - no two outputs write the same file: two equal paths, a file output inside an output folder
 *    under a name that folder's writer uses (--export-gguf DIR/model.safetensors with
 *    --export-hf DIR, --log DIR/config.json with --out DIR, anything inside --out's step_<N>/),
 *    or a name and its atomic-write temporary (NAME.tmp);
 *  - no output overwrites an input: a --train or --val shard, or the --model file.
 * Any failure is one line naming the flag and the path; the caller exits with status 2.
 *
 * The lock: --out DIR takes an exclusive flock on DIR/.lock and writes its pid there; a second
 * run on DIR is refused with the first one's pid. The kernel releases the lock when the process
 * ends, however it ends, so a lock left by a dead run is simply taken over (the file stays: a
 * lock file must never be unlinked, or two runs could hold locks on two different files).
 */
#ifndef LLMC_OUTPUTS_H
#define LLMC_OUTPUTS_H

#include "args.h"

#define OUTPUTS_MAX 16
#define OUTPUTS_INPUTS_MAX 8
#define OUTPUTS_PATH_MAX 4096

typedef enum {
    OUTPUT_FILE = 0,  // a file written whole to NAME.tmp and renamed over NAME (an atomic write):
                      // it must be a regular file or absent (renaming over /dev/null replaces it)
    OUTPUT_STREAM,    // a file opened and written in place (the log): /dev/null and pipes do
    OUTPUT_DIR        // a folder
} OutputKind;

typedef struct OutputEntry {
    const char* flag;               // "--log" (message prefix)
    const char* path;               // as given
    OutputKind kind;
    const char* const* writes;      // OUTPUT_DIR: fnmatch patterns of the names its writer
                                    // creates directly in the folder (NULL-terminated); a
                                    // directory matched is reserved with everything inside
    char canon[OUTPUTS_PATH_MAX];   // absolute, symlinks of the existing part resolved
    int exists;                     // the path exists now
    int special;                    // an existing non-regular stream (/dev/null): never collides
} OutputEntry;

typedef struct OutputInput {
    const char* flag;     // "--train"
    const char* pattern;  // a glob (is_glob) or a literal path
    int is_glob;
} OutputInput;

typedef struct Outputs {
    int n, n_inputs;
    OutputEntry e[OUTPUTS_MAX];
    OutputInput in[OUTPUTS_INPUTS_MAX];
    int lock_fd;  // --out's DIR/.lock while held, else -1
} Outputs;

void outputs_init(Outputs* o);
// Add one output; "" or NULL path: not asked for (ignored). writes: see OutputEntry.
void outputs_add(Outputs* o, const char* flag, const char* path, OutputKind kind,
                 const char* const* writes);
// An input no output may overwrite: a glob of files (is_glob) or one path.
void outputs_add_input(Outputs* o, const char* flag, const char* pattern, int is_glob);
// The trainer's outputs from its flags, and the inputs they must not overwrite (the --train and
// --val shards, the --model file). A new output flag is one more line here.
void outputs_add_run(Outputs* o, const TrainArgs* a);
// Resolve and check everything (the rules above); creates nothing but a probe file it removes
// again. -1 + one line in err.
int outputs_check(Outputs* o, char* err);
// Create the output folders and the folders of the file outputs. -1 + err.
int outputs_create(const Outputs* o, char* err);
// Lock dir (which exists) for this run: flock on dir/.lock, our pid written there. -1 + err
// (another run holds it: its pid is in the message).
int outputs_lock(Outputs* o, const char* dir, char* err);
// Release the lock (also released by the kernel when the process ends).
void outputs_release(Outputs* o);

#endif  // LLMC_OUTPUTS_H
