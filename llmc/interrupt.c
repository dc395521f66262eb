/*
 * interrupt.c — the SIGINT/SIGTERM handler and the flag it sets.
 */
#include "interrupt.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

// The one piece of global mutable state in this code base, and why it cannot be avoided: a
// signal handler receives no context pointer, so the only thing it can reach is an object of
// static storage, and the only such object it may write is a volatile sig_atomic_t (C11
// 7.14.1.1). Nothing else is shared: the training loop reads it through interrupt_signal().
static volatile sig_atomic_t interrupt_received = 0;

static void write_stderr(const char* s) {
    // write(2) is async-signal-safe, stdio is not; a failed write has nowhere to be reported
    ssize_t rc = write(STDERR_FILENO, s, strlen(s));
    (void)rc;
}

static void on_signal(int sig) {
    if (interrupt_received) {
        write_stderr("\ntrain_roundpipe: second signal: exiting now (nothing more is saved)\n");
        _exit(128 + sig);
    }
    interrupt_received = sig;
    write_stderr(sig == SIGTERM
                     ? "\ntrain_roundpipe: SIGTERM: finishing this step, then saving "
                       "(a second signal exits at once)\n"
                     : "\ntrain_roundpipe: SIGINT: finishing this step, then saving "
                       "(Ctrl-C again exits at once)\n");
}

static void signal_set(sigset_t* set) {
    sigemptyset(set);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGTERM);
}

void interrupt_block(void) {
    sigset_t set;
    signal_set(&set);
    pthread_check(pthread_sigmask(SIG_BLOCK, &set, NULL));
}

void interrupt_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    // restart interrupted system calls: the step in progress must finish as if nothing happened
    sa.sa_flags = SA_RESTART;
    if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0)
        fatal("sigaction failed");
    sigset_t set;
    signal_set(&set);
    pthread_check(pthread_sigmask(SIG_UNBLOCK, &set, NULL));
}

int interrupt_signal(void) { return (int)interrupt_received; }

const char* interrupt_name(int sig) {
    if (sig == SIGINT) return "SIGINT";
    if (sig == SIGTERM) return "SIGTERM";
    return "a signal";
}

int interrupt_exit_status(int sig) { return 128 + sig; }

void interrupt_test_hook(int step) {
    const char* spec = getenv("TRAIN_ROUNDPIPE_TEST_SIGNAL");
    if (!spec || !*spec) return;
    char name[8];
    int at = 0, times = 1;
    if (sscanf(spec, "%7[A-Z]@%d*%d", name, &at, &times) < 2 || at != step) return;
    const int sig = strcmp(name, "TERM") == 0 ? SIGTERM : SIGINT;
    for (int i = 0; i < times; i++) raise(sig);
}
