/*
 * progress.h — a one-line progress display for long byte-moving work (loading a checkpoint,
 * converting, exporting): "loading model.safetensors: 3.20 GiB / 16.00 GiB (20%), 1.10 GiB/s,
 * 12 s left", redrawn in place with '\r'.
 *
 * Only on a terminal: when stdout is a file or a pipe (a log, a test, CI) nothing is printed at
 * all, so logs hold no carriage returns. Work that ends within half a second prints nothing
 * either; after that the line is redrawn at most five times a second, and progress_end leaves
 * its final state on a line of its own.
 *
 *   Progress pg;
 *   progress_begin(&pg, "loading model.safetensors", (double)total_bytes);
 *   for (...) { read a piece; progress_add(&pg, (double)piece_bytes); }
 *   progress_end(&pg);
 */
#ifndef LLMC_PROGRESS_H
#define LLMC_PROGRESS_H

#include <stdio.h>

typedef struct Progress {
    FILE* out;       // where the line is drawn; NULL: silent (not a terminal)
    char what[96];   // what is being done ("exporting out/model.gguf")
    double total;    // bytes in all (0: unknown)
    double done;     // bytes so far
    double t_start;  // seconds (time_now_s) at progress_begin
    double t_drawn;  // when the line was last drawn (< 0: never)
} Progress;

// Progress on stdout when stdout is a terminal, else silent. total_bytes 0: unknown.
void progress_begin(Progress* p, const char* what, double total_bytes);
// The same onto f, drawn only when tty is set (what progress_begin decides from isatty).
void progress_begin_on(Progress* p, FILE* f, int tty, const char* what, double total_bytes);
// bytes more done; redraws when due.
void progress_add(Progress* p, double bytes);
// done_bytes done at time now (seconds, time_now_s's clock); redraws when due (tests pass now).
void progress_update_at(Progress* p, double done_bytes, double now);
// The final state on its own line (only if the line was ever drawn).
void progress_end(Progress* p);
// The text of the line: "what: 1.50 GiB / 16.00 GiB (9%), 1.20 GiB/s, 12 s left" (total 0:
// "what: 1.50 GiB, 1.20 GiB/s").
void progress_format(char* buf, size_t cap, const char* what, double done, double total,
                     double seconds);

#endif  // LLMC_PROGRESS_H
