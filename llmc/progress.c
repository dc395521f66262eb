/*
 * progress.c — the terminal progress line (see progress.h).
 */
#include "progress.h"

#include <string.h>
#include <unistd.h>

#include "common.h"

#define PROGRESS_FIRST_S 0.5   // nothing is drawn for work shorter than this
#define PROGRESS_EVERY_S 0.2   // redraws at most this often

void progress_begin_on(Progress* p, FILE* f, int tty, const char* what, double total_bytes) {
    memset(p, 0, sizeof *p);
    p->out = tty ? f : NULL;
    str_copy(p->what, sizeof p->what, what);
    p->total = total_bytes > 0 ? total_bytes : 0;
    p->t_start = time_now_s();
    p->t_drawn = -1;
}

void progress_begin(Progress* p, const char* what, double total_bytes) {
    progress_begin_on(p, stdout, isatty(STDOUT_FILENO), what, total_bytes);
}

void progress_format(char* buf, size_t cap, const char* what, double done, double total,
                     double seconds) {
    char d[32], t[32], r[32];
    format_bytes(done, d, sizeof d);
    const double rate = seconds > 0 ? done / seconds : 0;
    format_bytes(rate, r, sizeof r);
    if (total > 0) {
        format_bytes(total, t, sizeof t);
        const int pct = (int)(100.0 * (done < total ? done : total) / total);
        if (rate > 0 && done < total)
            snprintf(buf, cap, "%s: %s / %s (%d%%), %s/s, %.0f s left", what, d, t, pct, r,
                     (total - done) / rate);
        else
            snprintf(buf, cap, "%s: %s / %s (%d%%), %s/s", what, d, t, pct, r);
    } else {
        snprintf(buf, cap, "%s: %s, %s/s", what, d, r);
    }
}

static void draw(Progress* p, double now) {
    char line[256];
    progress_format(line, sizeof line, p->what, p->done, p->total, now - p->t_start);
    // \r: back to the line's start; ESC[K: clear what a longer earlier line left behind
    fprintf(p->out, "\r%s\033[K", line);
    fflush(p->out);
    p->t_drawn = now;
}

void progress_update_at(Progress* p, double done_bytes, double now) {
    p->done = done_bytes;
    if (!p->out) return;
    const int due = p->t_drawn < 0 ? now - p->t_start >= PROGRESS_FIRST_S
                                   : now - p->t_drawn >= PROGRESS_EVERY_S;
    if (due) draw(p, now);
}

void progress_add(Progress* p, double bytes) {
    progress_update_at(p, p->done + bytes, time_now_s());
}

void progress_end(Progress* p) {
    if (!p->out || p->t_drawn < 0) return;
    draw(p, time_now_s());
    fputc('\n', p->out);
    fflush(p->out);
    p->out = NULL;
}
