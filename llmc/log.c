/*
 * log.c — console step lines, JSON-lines records and the throughput meter.
 */
#include "log.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

int log_open(StepLog* lg, const char* path, long long resume_step, char* err) {
    lg->f = NULL;
    lg->path = path;
    if (!path || !*path) return 0;
    const int append = resume_step >= 0;
    lg->f = fopen(path, append ? "a+" : "w");
    if (!lg->f) return errorf(err, "--log %s: cannot open for writing: %s", path, strerror(errno));
    if (!append) return 0;
    // a run killed while writing a record leaves a line without its newline: end it, so the
    // marker starts a line of its own
    int last = EOF;
    if (fseek(lg->f, 0, SEEK_END) == 0 && ftell(lg->f) > 0 && fseek(lg->f, -1, SEEK_END) == 0)
        last = fgetc(lg->f);
    if (fseek(lg->f, 0, SEEK_END) != 0)
        return errorf(err, "--log %s: cannot seek: %s", path, strerror(errno));
    if (last != EOF && last != '\n') fputc('\n', lg->f);
    fprintf(lg->f, "{\"resume\":%lld}\n", resume_step);
    if (fflush(lg->f) != 0)
        return errorf(err, "--log %s: write failed: %s", path, strerror(errno));
    return 0;
}

void log_close(StepLog* lg) {
    if (lg->f) fclose_check(lg->f, lg->path);
    lg->f = NULL;
}

// JSON has no NaN/Infinity: write null so every line stays valid JSON.
static void json_num(FILE* f, const char* key, double v, int last) {
    if (isfinite(v)) fprintf(f, "\"%s\":%.9g%s", key, v, last ? "" : ",");
    else fprintf(f, "\"%s\":null%s", key, last ? "" : ",");
}

void log_step(StepLog* lg, const StepStats* s) {
    if (s->no_update)
        printf("step %5d/%d | loss %.6f | norm %8s | lr %9s | %8.1f ms | %9.0f tok/s", s->step,
               s->steps, s->loss, "-", "-", s->ms, s->tok_s);
    else
        printf("step %5d/%d | loss %.6f | norm %8.4f | lr %.3e | %8.1f ms | %9.0f tok/s",
               s->step, s->steps, s->loss, s->norm, s->lr, s->ms, s->tok_s);
    if (s->mfu >= 0) printf(" | MFU %5.1f%%", 100.0 * s->mfu);
    if (s->bubble >= 0) printf(" | bubble %4.1f%%", 100.0 * s->bubble);
    if (s->moe) printf(" | experts max/mean %.2f", s->load_spread);
    if (s->host_mib >= 0) printf(" | host %.0f MiB", s->host_mib);
    if (s->dev_mib >= 0) printf(" | dev %.0f MiB", s->dev_mib);
    printf("\n");
    fflush(stdout);
    if (!lg->f) return;
    fprintf(lg->f, "{\"step\":%d,", s->step);
    json_num(lg->f, "loss", s->loss, 0);
    if (s->moe) {
        json_num(lg->f, "ce", s->ce, 0);
        json_num(lg->f, "aux", s->aux, 0);
        json_num(lg->f, "load_spread", s->load_spread, 0);
    }
    json_num(lg->f, "lr", s->no_update ? NAN : s->lr, 0);
    json_num(lg->f, "norm", s->no_update ? NAN : s->norm, 0);
    json_num(lg->f, "ms", s->ms, 0);
    json_num(lg->f, "tok_s", s->tok_s, 0);
    fprintf(lg->f, "\"tokens\":%.0f,", s->tokens);
    if (s->mfu >= 0) json_num(lg->f, "mfu", s->mfu, 0);
    if (s->bubble >= 0) json_num(lg->f, "bubble", s->bubble, 0);
    if (s->dev_mib >= 0) json_num(lg->f, "dev_mib", s->dev_mib, 0);
    json_num(lg->f, "host_mib", s->host_mib, 1);
    fprintf(lg->f, "}\n");
    fflush(lg->f);
}

double log_host_rss_mib(void) {
    FILE* f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    double kib = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0) {
            kib = atof(line + 6);
            break;
        }
    fclose(f);
    return kib < 0 ? -1 : kib / 1024.0;
}

void log_eval(StepLog* lg, int step, double val_loss) {
    printf("step %5d | val loss %.6f\n", step, val_loss);
    fflush(stdout);
    if (!lg->f) return;
    fprintf(lg->f, "{\"step\":%d,", step);
    json_num(lg->f, "val_loss", val_loss, 1);
    fprintf(lg->f, "}\n");
    fflush(lg->f);
}

// ----------------------------------------------------------------------------
// throughput

void log_meter_init(StepMeter* mt, int window, double tokens_per_step, double flops_per_token,
                    double peak_flops) {
    memset(mt, 0, sizeof *mt);
    mt->window = imax(1, imin(window, LOG_METER_WINDOW_MAX));
    mt->tokens_per_step = tokens_per_step;
    mt->flops_per_token = flops_per_token;
    mt->peak_flops = peak_flops;
}

void log_meter_record(StepMeter* mt, StepStats* st, double dt) {
    st->ms = dt * 1e3;
    st->tokens = mt->tokens_per_step * st->step;
    mt->dt[mt->n % mt->window] = dt;
    mt->idle[mt->n % mt->window] = st->bubble >= 0 ? st->bubble * dt : 0.0;
    mt->n++;
    double sum_dt = 0.0, sum_idle = 0.0;
    const int in_window = imin(mt->n, mt->window);
    for (int w = 0; w < in_window; w++) {
        sum_dt += mt->dt[w];
        sum_idle += mt->idle[w];
    }
    st->tok_s = mt->tokens_per_step * in_window / sum_dt;
    if (st->bubble >= 0) st->bubble = sum_idle / sum_dt;
    if (mt->peak_flops > 0) st->mfu = mt->flops_per_token * st->tok_s / mt->peak_flops;
}
