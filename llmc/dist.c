/*
 * dist.c — who this process is in a data-parallel run (flags, torchrun and Slurm environments)
 * and the TCP rendezvous that hands rank 0's communicator token to every rank (dist.h; the wire
 * format is in docs/DISTRIBUTED.md). Sockets are non-blocking and every wait is a poll() with
 * the time left to the deadline, so no step can hang past the timeout.
 */
#include "dist.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define DIST_MAGIC 0x56445052u  // "RPDV" little-endian
#define DIST_VERSION 1u
#define DIST_HELLO_BYTES 16
#define DIST_REPLY_HEADER 16
#define DIST_MSG_MAX 400

// ----------------------------------------------------------------------------
// configuration

const char* dist_getenv(void* ctx, const char* name) {
    (void)ctx;
    return getenv(name);
}

// The variable's value, NULL when unset or empty.
static const char* env_get(DistEnvFn env, void* ctx, const char* name) {
    const char* v = env ? env(ctx, name) : NULL;
    return v && *v ? v : NULL;
}

// An integer variable in [lo, hi]. 1 when set (value in *out), 0 when unset, -1 with err.
static int env_int(DistEnvFn env, void* ctx, const char* name, int lo, int hi, int* out,
                   char* err) {
    const char* v = env_get(env, ctx, name);
    if (!v) return 0;
    int64_t x;
    char shown[64];
    if (parse_int64(v, &x) != 0 || x < lo || x > hi)
        return errorf(err, "environment %s='%s': expected an integer in [%d, %d]", name,
                      str_printable(v, strlen(v), shown, sizeof shown), lo, hi);
    *out = (int)x;
    return 1;
}

int dist_parse_url(const char* url, char* host, size_t cap, int* port, char* err) {
    char shown[128];
    str_printable(url, strlen(url), shown, sizeof shown);
    if (strncmp(url, "tcp://", 6) != 0)
        return errorf(err, "--dist-init '%s': expected tcp://HOST:PORT", shown);
    const char* h = url + 6;
    const char* colon;
    size_t hlen;
    if (*h == '[') {  // [IPv6]:PORT
        const char* close = strchr(h, ']');
        if (!close || close[1] != ':')
            return errorf(err, "--dist-init '%s': expected tcp://[IPv6]:PORT", shown);
        h++;
        hlen = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(h, ':');
        if (!colon) return errorf(err, "--dist-init '%s': no :PORT (tcp://HOST:PORT)", shown);
        hlen = (size_t)(colon - h);
        if (memchr(h, ':', hlen))
            return errorf(err, "--dist-init '%s': IPv6 addresses go in brackets, "
                          "tcp://[::1]:PORT", shown);
    }
    if (hlen == 0) return errorf(err, "--dist-init '%s': empty host", shown);
    if (hlen >= cap) return errorf(err, "--dist-init '%s': host name too long", shown);
    int64_t p;
    if (parse_int64(colon + 1, &p) != 0 || p < 1 || p > 65535)
        return errorf(err, "--dist-init '%s': port must be an integer in [1, 65535]", shown);
    memcpy(host, h, hlen);
    host[hlen] = '\0';
    *port = (int)p;
    return 0;
}

int dist_config_resolve(DistConfig* out, const DistFlags* f, DistEnvFn env, void* ctx,
                        char* err) {
    memset(out, 0, sizeof *out);
    out->rank = -1;
    out->world = 1;
    out->timeout_s = f && f->timeout_s > 0 ? f->timeout_s : DIST_DEFAULT_TIMEOUT_S;
    str_copy(out->source, sizeof out->source, "default");
    // torchrun: RANK and WORLD_SIZE come together
    int t_rank = -1, t_world = 0, s_rank = -1, s_world = 0;
    int has_t_rank = env_int(env, ctx, "RANK", 0, DIST_MAX_WORLD - 1, &t_rank, err);
    int has_t_world = env_int(env, ctx, "WORLD_SIZE", 1, DIST_MAX_WORLD, &t_world, err);
    if (has_t_rank < 0 || has_t_world < 0) return -1;
    if (has_t_rank != has_t_world)
        return errorf(err, "environment: %s is set but %s is not (torchrun sets both)",
                      has_t_rank ? "RANK" : "WORLD_SIZE", has_t_rank ? "WORLD_SIZE" : "RANK");
    // Slurm: only inside a job step (srun sets SLURM_PROCID)
    int has_s_rank = env_int(env, ctx, "SLURM_PROCID", 0, DIST_MAX_WORLD - 1, &s_rank, err);
    if (has_s_rank < 0) return -1;
    int has_s_world = 0;
    if (has_s_rank) {
        has_s_world = env_int(env, ctx, "SLURM_NTASKS", 1, DIST_MAX_WORLD, &s_world, err);
        if (has_s_world < 0) return -1;
        if (!has_s_world)
            return errorf(err, "environment: SLURM_PROCID is set but SLURM_NTASKS is not");
    }
    // world size and rank, field by field
    if (f && f->world > 0) {
        out->world = f->world;
        str_copy(out->source, sizeof out->source, "--world");
    } else if (has_t_world) {
        out->world = t_world;
        str_copy(out->source, sizeof out->source, "torchrun environment (WORLD_SIZE)");
    } else if (has_s_world) {
        out->world = s_world;
        str_copy(out->source, sizeof out->source, "Slurm environment (SLURM_NTASKS)");
    }
    if (out->world > DIST_MAX_WORLD)
        return errorf(err, "--world %d: at most %d ranks", out->world, DIST_MAX_WORLD);
    const char* rank_from = "--rank";
    if (f && f->rank >= 0) out->rank = f->rank;
    else if (has_t_rank) out->rank = t_rank, rank_from = "RANK";
    else if (has_s_rank) out->rank = s_rank, rank_from = "SLURM_PROCID";
    else if (out->world == 1) out->rank = 0;
    else
        return errorf(err, "world size %d (%s) needs this process's rank: --rank R, RANK or "
                      "SLURM_PROCID", out->world, out->source);
    if (out->rank >= out->world)
        return errorf(err, "rank %d (%s) is not below the world size %d (%s)", out->rank,
                      rank_from, out->world, out->source);
    // local rank: this process's GPU on its node
    int lr = 0;
    int has_lr = env_int(env, ctx, "LOCAL_RANK", 0, DIST_MAX_WORLD - 1, &lr, err);
    if (has_lr < 0) return -1;
    if (!has_lr) {
        has_lr = env_int(env, ctx, "SLURM_LOCALID", 0, DIST_MAX_WORLD - 1, &lr, err);
        if (has_lr < 0) return -1;
    }
    out->local_rank = has_lr ? lr : 0;
    // rank 0's address
    const char* init = f && f->init ? f->init : "";
    if (*init) {
        if (dist_parse_url(init, out->host, sizeof out->host, &out->port, err) != 0) return -1;
    } else {
        const char* addr = env_get(env, ctx, "MASTER_ADDR");
        int port = 0;
        int has_port = env_int(env, ctx, "MASTER_PORT", 1, 65535, &port, err);
        if (has_port < 0) return -1;
        if ((addr != NULL) != (has_port != 0))
            return errorf(err, "environment: %s is set but %s is not (rank 0's address needs "
                          "both)", addr ? "MASTER_ADDR" : "MASTER_PORT",
                          addr ? "MASTER_PORT" : "MASTER_ADDR");
        if (addr) {
            if (strlen(addr) >= sizeof out->host)
                return errorf(err, "environment MASTER_ADDR: host name too long");
            str_copy(out->host, sizeof out->host, addr);
            out->port = port;
        }
    }
    if (out->world > 1 && !out->host[0])
        return errorf(err, "world size %d (%s) needs rank 0's address: --dist-init "
                      "tcp://HOST:PORT, or MASTER_ADDR and MASTER_PORT", out->world, out->source);
    return 0;
}

// ----------------------------------------------------------------------------
// sockets: non-blocking, every wait bounded by a deadline

static double remaining_s(double deadline) { return deadline - time_now_s(); }

static int poll_ms(double deadline) {
    const double r = remaining_s(deadline);
    return r <= 0 ? 0 : r > 1e6 ? 1000000000 : (int)(r * 1000.0) + 1;
}

static void put_u32(uint8_t* p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static int set_nonblocking(int fd) {
    const int fl = fcntl(fd, F_GETFL, 0);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

// Wait for fd to be ready for `events`: 1 ready, 0 deadline passed, -1 error.
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        const int rc = poll(&p, 1, poll_ms(deadline));
        if (rc > 0) return 1;
        if (rc == 0) return remaining_s(deadline) <= 0 ? 0 : 1;
        if (errno != EINTR) return -1;
    }
}

// Read exactly n bytes. 0 ok; -1 closed early or error (errno; 0 = closed), -2 deadline.
static int read_full(int fd, void* buf, size_t n, double deadline) {
    size_t got = 0;
    while (got < n) {
        const int w = wait_fd(fd, POLLIN, deadline);
        if (w == 0) return -2;
        if (w < 0) return -1;
        const ssize_t r = recv(fd, (char*)buf + got, n - got, 0);
        if (r == 0) {
            errno = 0;
            return -1;
        }
        if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
            return -1;
        }
        got += (size_t)r;
    }
    return 0;
}

static int write_full(int fd, const void* buf, size_t n, double deadline) {
    size_t put = 0;
    while (put < n) {
        const int w = wait_fd(fd, POLLOUT, deadline);
        if (w == 0) return -2;
        if (w < 0) return -1;
        // MSG_NOSIGNAL: a peer that went away is an error here, not a SIGPIPE
        const ssize_t r = send(fd, (const char*)buf + put, n - put, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
            return -1;
        }
        put += (size_t)r;
    }
    return 0;
}

static int resolve(const char* host, int port, int passive, struct addrinfo** out, char* err) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    const int rc = getaddrinfo(host, port_s, &hints, out);
    if (rc != 0) return errorf(err, "cannot resolve '%s': %s", host, gai_strerror(rc));
    return 0;
}

// ----------------------------------------------------------------------------
// rank 0

struct DistServer {
    int fd;
    int port;
    char host[256];
};

DistServer* dist_server_listen(const char* host, int port, char* err) {
    struct addrinfo* ai = NULL;
    if (resolve(host, port, 1, &ai, err) != 0) return NULL;
    int fd = -1, last_errno = 0;
    for (struct addrinfo* a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        const int one = 1;
        // a restarted run may reuse the port while the last one's sockets sit in TIME_WAIT
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
            bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0 ||
            set_nonblocking(fd) != 0) {
            last_errno = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0) {
        errorf(err, "rank 0 cannot listen on %s:%d: %s%s", host, port, strerror(last_errno),
               last_errno == EADDRINUSE ? " (another run uses the port: pick another one)"
               : last_errno == EADDRNOTAVAIL ? " (the address is not one of this machine's: "
                                               "rank 0 must run on the rendezvous host)" : "");
        return NULL;
    }
    DistServer* s = calloc_check(1, sizeof *s);
    s->fd = fd;
    str_copy(s->host, sizeof s->host, host);
    struct sockaddr_storage sa;
    socklen_t len = sizeof sa;
    if (getsockname(fd, (struct sockaddr*)&sa, &len) != 0) {
        errorf(err, "getsockname failed: %s", strerror(errno));
        close(fd);
        free(s);
        return NULL;
    }
    s->port = sa.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6*)&sa)->sin6_port)
                                       : ntohs(((struct sockaddr_in*)&sa)->sin_port);
    return s;
}

int dist_server_port(const DistServer* s) { return s->port; }

void dist_server_close(DistServer* s) {
    if (!s) return;
    close(s->fd);
    free(s);
}

// The reply header: magic, version, status (0 token follows, 1 message follows), payload bytes.
static void reply_send(int fd, uint32_t status, const void* payload, size_t n, double deadline) {
    if (status != 0 && n > DIST_MSG_MAX) n = DIST_MSG_MAX;  // messages are cut to what ranks take
    uint8_t h[DIST_REPLY_HEADER];
    put_u32(h, DIST_MAGIC);
    put_u32(h + 4, DIST_VERSION);
    put_u32(h + 8, status);
    put_u32(h + 12, (uint32_t)n);
    // best effort: a rank that went away misses the message, nothing else to do
    if (write_full(fd, h, sizeof h, deadline) == 0) write_full(fd, payload, n, deadline);
}

// Tell every connected rank why the rendezvous failed, close them, return -1 with err = msg.
static int hand_out_fail(int* fds, int world, const char* msg, char* err) {
    const double deadline = time_now_s() + 2.0;
    const size_t n = strlen(msg);
    for (int r = 1; r < world; r++) {
        if (fds[r] < 0) continue;
        reply_send(fds[r], 1, msg, n, deadline);
        close(fds[r]);
        fds[r] = -1;
    }
    free(fds);
    str_copy(err, ERR_LEN, msg);
    return -1;
}

int dist_server_hand_out(DistServer* s, int world, const CommToken* token, double timeout_s,
                         char* err) {
    const double deadline = time_now_s() + timeout_s;
    int* fds = malloc_check((size_t)(world > 0 ? world : 1) * sizeof(int));
    for (int r = 0; r < world; r++) fds[r] = -1;
    char msg[1024];  // room for the names of the missing ranks and the host (cut to ERR_LEN)
    int connected = 0;
    while (connected < world - 1) {
        const int w = wait_fd(s->fd, POLLIN, deadline);
        if (w == 0) {
            // name the ranks that never showed up
            char miss[256] = "";
            size_t len = 0;
            int n_miss = 0;
            for (int r = 1; r < world && len + 16 < sizeof miss; r++)
                if (fds[r] < 0)
                    len += (size_t)snprintf(miss + len, sizeof miss - len, "%s%d",
                                            n_miss++ ? ", " : "", r);
            snprintf(msg, sizeof msg, "rendezvous: rank%s %s did not connect to rank 0 at %s:%d "
                     "within %.1f s (--dist-timeout)", n_miss > 1 ? "s" : "", miss, s->host,
                     s->port, timeout_s);
            return hand_out_fail(fds, world, msg, err);
        }
        if (w < 0) {
            snprintf(msg, sizeof msg, "rendezvous: poll failed: %s", strerror(errno));
            return hand_out_fail(fds, world, msg, err);
        }
        const int fd = accept(s->fd, NULL, NULL);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ||
                errno == ECONNABORTED)
                continue;
            snprintf(msg, sizeof msg, "rendezvous: accept failed: %s", strerror(errno));
            return hand_out_fail(fds, world, msg, err);
        }
        if (set_nonblocking(fd) != 0) {
            close(fd);
            continue;
        }
        uint8_t h[DIST_HELLO_BYTES];
        // a connected rank sends its hello at once; a few seconds bound a stray connection
        const double now = time_now_s();
        const double hello_deadline = deadline < now + 5.0 ? deadline : now + 5.0;
        if (read_full(fd, h, sizeof h, hello_deadline) != 0 || load_le32(h) != DIST_MAGIC) {
            close(fd);  // not one of ours (a port scanner, a rank of another run): ignore it
            continue;
        }
        const uint32_t ver = load_le32(h + 4), rank = load_le32(h + 8), w_of = load_le32(h + 12);
        if (ver != DIST_VERSION) {
            snprintf(msg, sizeof msg, "rendezvous: rank %u speaks protocol version %u, rank 0 "
                     "version %u (mixed builds?)", rank, ver, DIST_VERSION);
            reply_send(fd, 1, msg, strlen(msg), time_now_s() + 2.0);  // it hears why, too
            close(fd);
            return hand_out_fail(fds, world, msg, err);
        }
        if ((int)w_of != world || rank < 1 || (int)rank >= world || fds[rank] >= 0) {
            if ((int)w_of != world)
                snprintf(msg, sizeof msg, "rendezvous: rank %u was started with world size %u, "
                         "rank 0 with %d", rank, w_of, world);
            else if (rank == 0 || (int)rank >= world)
                snprintf(msg, sizeof msg, "rendezvous: a process claims rank %u, not in [1, %d)",
                         rank, world);
            else
                snprintf(msg, sizeof msg, "rendezvous: rank %u connected twice (two processes "
                         "with the same rank)", rank);
            reply_send(fd, 1, msg, strlen(msg), time_now_s() + 2.0);
            close(fd);
            return hand_out_fail(fds, world, msg, err);
        }
        fds[rank] = fd;
        connected++;
    }
    for (int r = 1; r < world; r++) {
        reply_send(fds[r], 0, token->bytes, sizeof token->bytes, deadline);
        close(fds[r]);
        fds[r] = -1;
    }
    free(fds);
    return 0;
}

// ----------------------------------------------------------------------------
// ranks > 0

// One connection attempt within the deadline: the fd, or -1 (errno set).
static int connect_once(const struct addrinfo* a, double deadline) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) return -1;
    if (set_nonblocking(fd) != 0) {
        const int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) {
            const int e = errno;
            close(fd);
            errno = e;
            return -1;
        }
        const int w = wait_fd(fd, POLLOUT, deadline);
        int so = 0;
        socklen_t len = sizeof so;
        if (w <= 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len) != 0 || so != 0) {
            close(fd);
            errno = w == 0 ? ETIMEDOUT : so ? so : errno;
            return -1;
        }
    }
    return fd;
}

static void sleep_s(double s) {
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

int dist_client_fetch(const char* host, int port, int rank, int world, double timeout_s,
                      CommToken* out, char* err) {
    const double t0 = time_now_s();
    const double deadline = t0 + timeout_s;
    struct addrinfo* ai = NULL;
    if (resolve(host, port, 0, &ai, err) != 0) return -1;
    int fd = -1, last_errno = 0;
    // rank 0 may not listen yet: retry until the deadline
    while (fd < 0 && remaining_s(deadline) > 0) {
        for (struct addrinfo* a = ai; a && fd < 0; a = a->ai_next) {
            fd = connect_once(a, deadline);
            if (fd < 0) last_errno = errno;
        }
        if (fd < 0) sleep_s(remaining_s(deadline) < 0.1 ? 0.01 : 0.1);
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return errorf(err, "rendezvous: rank %d could not connect to rank 0 at %s:%d within "
                      "%.1f s (%s; is rank 0 running there?)", rank, host, port, timeout_s,
                      strerror(last_errno ? last_errno : ETIMEDOUT));
    uint8_t h[DIST_HELLO_BYTES];
    put_u32(h, DIST_MAGIC);
    put_u32(h + 4, DIST_VERSION);
    put_u32(h + 8, (uint32_t)rank);
    put_u32(h + 12, (uint32_t)world);
    // rank 0 answers when every rank is there, or at its own deadline, which is at most one
    // timeout after this connection (it was listening already): wait that long plus a margin
    const double reply_deadline = time_now_s() + timeout_s + 5.0;
    int rc = write_full(fd, h, sizeof h, reply_deadline);
    uint8_t r[DIST_REPLY_HEADER];
    if (rc == 0) rc = read_full(fd, r, sizeof r, reply_deadline);
    if (rc != 0) {
        const int e = errno;
        close(fd);
        if (rc == -2)
            return errorf(err, "rendezvous: rank 0 at %s:%d sent no token to rank %d within "
                          "%.1f s", host, port, rank, timeout_s + 5.0);
        return errorf(err, "rendezvous: rank 0 at %s:%d closed the connection of rank %d "
                      "without an answer (%s)", host, port, rank, e ? strerror(e) : "it failed");
    }
    const uint32_t status = load_le32(r + 8), n = load_le32(r + 12);
    if (load_le32(r) != DIST_MAGIC || load_le32(r + 4) != DIST_VERSION ||
        (status == 0 && n != COMM_TOKEN_BYTES) || (status != 0 && n > DIST_MSG_MAX)) {
        close(fd);
        return errorf(err, "rendezvous: %s:%d is not rank 0 of this run (bad reply)", host, port);
    }
    if (status == 0) {
        rc = read_full(fd, out->bytes, COMM_TOKEN_BYTES, reply_deadline);
        close(fd);
        if (rc != 0)
            return errorf(err, "rendezvous: rank 0 at %s:%d broke off while sending the token",
                          host, port);
        return 0;
    }
    char msg[DIST_MSG_MAX + 1], shown[DIST_MSG_MAX + 1];
    rc = read_full(fd, msg, n, reply_deadline);
    close(fd);
    msg[rc == 0 ? n : 0] = '\0';
    return errorf(err, "rendezvous failed on rank 0: %s",
                  rc == 0 ? str_printable(msg, n, shown, sizeof shown) : "(no reason received)");
}

// ----------------------------------------------------------------------------
// both

int dist_rendezvous(const DistConfig* cfg, const CommImpl* impl, CommToken* token, char* err) {
    if (cfg->world == 1) return impl->new_token(token, err);
    if (cfg->rank != 0)
        return dist_client_fetch(cfg->host, cfg->port, cfg->rank, cfg->world, cfg->timeout_s,
                                 token, err);
    DistServer* s = dist_server_listen(cfg->host, cfg->port, err);
    if (!s) return -1;
    int rc = impl->new_token(token, err);
    if (rc == 0) rc = dist_server_hand_out(s, cfg->world, token, cfg->timeout_s, err);
    dist_server_close(s);
    return rc;
}
