/*
 * dist.h — launching a data-parallel run: who this process is (rank, world size, local rank, the
 * address of rank 0) from flags or the launcher's environment (torchrun, Slurm), and the TCP
 * rendezvous in which rank 0 hands every rank the communicator's token (the ncclUniqueId).
 *
 * Precedence, field by field: the flags (--dist-init tcp://HOST:PORT, --rank, --world), then
 * torchrun's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, then Slurm's
 * SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (only when SLURM_PROCID is set: a bare salloc
 * shell sets SLURM_NTASKS but is no rank). Nothing set: one rank (world 1, rank 0).
 *
 * The rendezvous protocol (docs/DISTRIBUTED.md): rank 0 listens on HOST:PORT; every other rank
 * connects (retrying until the timeout: rank 0 may start later) and sends a hello (magic, version,
 * its rank, the world size it was given); once all world-1 ranks are there rank 0 answers each
 * with the token; on any failure (a rank missing at the timeout, a mismatched world size, a rank
 * twice) it answers every connected rank with the failure message instead, so every process
 * ends with one line naming the rank at fault.
 */
#ifndef LLMC_DIST_H
#define LLMC_DIST_H

#include <stddef.h>

#include "comm.h"

#define DIST_DEFAULT_TIMEOUT_S 300.0
#define DIST_MAX_WORLD 65536

// The flags (args.c); unset: init "" (or NULL), rank -1, world 0, timeout_s 0 (the default).
typedef struct DistFlags {
    const char* init;   // --dist-init tcp://HOST:PORT
    int rank;           // --rank R
    int world;          // --world W
    double timeout_s;   // --dist-timeout S
} DistFlags;

typedef struct DistConfig {
    int rank, world, local_rank;
    char host[256];     // rank 0's address ("" when world == 1 and none was given)
    int port;
    double timeout_s;
    char source[96];    // where the world size came from: "--world", "torchrun environment
                        // (WORLD_SIZE)", "Slurm environment (SLURM_NTASKS)" or "default"
} DistConfig;

// The environment as a function, so tests pass their own (dist_getenv: the process's).
typedef const char* (*DistEnvFn)(void* ctx, const char* name);
const char* dist_getenv(void* ctx, const char* name);

// Resolve who this process is. 0, or -1 with one line in err naming the flag or variable.
int dist_config_resolve(DistConfig* out, const DistFlags* f, DistEnvFn env, void* env_ctx,
                        char* err);
// "tcp://HOST:PORT" (HOST a name, an IPv4 address or a bracketed IPv6 one). 0 or -1 with err.
int dist_parse_url(const char* url, char* host, size_t cap, int* port, char* err);

// ----------------------------------------------------------------------------
// the rendezvous

typedef struct DistServer DistServer;
// Rank 0: listen on host:port (port 0: any free port, see dist_server_port). NULL with err.
DistServer* dist_server_listen(const char* host, int port, char* err);
int dist_server_port(const DistServer* s);
// Rank 0: wait for ranks 1 .. world-1 (at most timeout_s) and hand each the token. 0, or -1 with
// err naming the missing or misbehaving ranks (they get the same message).
int dist_server_hand_out(DistServer* s, int world, const CommToken* token, double timeout_s,
                         char* err);
void dist_server_close(DistServer* s);
// Rank r > 0: connect to rank 0 (retrying within timeout_s), send the hello, receive the token.
int dist_client_fetch(const char* host, int port, int rank, int world, double timeout_s,
                      CommToken* out, char* err);
// Both sides for cfg: rank 0 listens, makes the token with impl->new_token and hands it out;
// the others fetch it. world 1: the token is made locally. 0 or -1 with err.
int dist_rendezvous(const DistConfig* cfg, const CommImpl* impl, CommToken* token, char* err);

#endif  // LLMC_DIST_H
