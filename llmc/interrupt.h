/*
 * interrupt.h — SIGINT and SIGTERM during training: the first asks the run to stop cleanly
 * (finish the step, save a checkpoint and the exports, say where they are, exit 130 / 143); a
 * second one exits at once.
 *
 * The handler only records the signal; the training loop polls interrupt_signal() between steps
 * and decides there. Engine worker threads never see the signals: interrupt_block() is called
 * before they are created (they inherit the blocked mask), interrupt_install() then unblocks
 * them in the calling (main) thread only, so no system call of a worker is cut short by EINTR.
 *
 * A test hook: TRAIN_ROUNDPIPE_TEST_SIGNAL="INT@K" (or "TERM@K", optionally "...*2" for two
 * signals) makes interrupt_test_hook(K) raise the signal itself right after step K, as if it
 * had arrived during that step: the tests stop runs at an exact step without racing a timer.
 */
#ifndef LLMC_INTERRUPT_H
#define LLMC_INTERRUPT_H

// Block SIGINT and SIGTERM in the calling thread (threads it creates afterwards inherit that).
void interrupt_block(void);
// Handle SIGINT and SIGTERM from now on and unblock them in the calling thread; a signal that
// arrived while they were blocked is delivered now.
void interrupt_install(void);
// The first signal received (SIGINT, SIGTERM), or 0.
int interrupt_signal(void);
// "SIGINT", "SIGTERM" (or "signal N").
const char* interrupt_name(int sig);
// The exit status of a run stopped by sig: 128 + sig (130 for SIGINT, 143 for SIGTERM).
int interrupt_exit_status(int sig);
// The test hook above, called after each step.
void interrupt_test_hook(int step);

#endif  // LLMC_INTERRUPT_H
