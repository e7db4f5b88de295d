/* lazyfs-agent: PID 1 of a sandbox VM, the host's only way in.
 *
 *   lazyfs-agent [--chroot] [--cgroup DIR] [--upper DIR] [--test-fault noreap] PORT ROOT
 *
 * PORT is the virtio-serial port named lazyfs.agent (/dev/vportNpM); ROOT
 * is the sandbox's composed root (overlayfs of the EROFS layers + a
 * writable upper), which commands run chrooted into and file paths resolve
 * under (openat2 RESOLVE_IN_ROOT: "..", absolute links and links pointing
 * out stay inside). The agent itself lives in the initramfs, outside ROOT,
 * so the image needs nothing of ours (no Python, no libc: static build).
 *
 * --cgroup DIR: every command runs in cgroup v2 directory DIR (the init
 * script gives it the sandbox's pids.max and a memory.max below the guest's
 * RAM, so a fork or memory bomb is held there and the agent, outside it,
 * keeps answering); an OOM kill in DIR during a command sets EXIT's flag 4.
 *
 * --upper DIR: the overlayfs upper of ROOT (a microVM's tmpfs, outside ROOT),
 * which UPPER streams to the host for verify (see do_upper).
 *
 * --chroot: the agent chroots itself into ROOT after opening PORT, for a
 * full VM whose image's own init becomes PID 1 (switch_root moves ROOT to
 * "/"; an agent left in the initramfs root would lose /proc with it). It
 * says READY only once PID 1's root is ROOT too (switch_root has chrooted
 * and execs the image's init), at most INIT_WAIT_MS after it started: the
 * host's first command never sees switch_root as PID 1.
 *
 * Frames, both ways: u32 payload length, u8 type, the request's id (u24),
 * payload (little-endian; at most MAX_FRAME bytes, checked on both ends).
 * Every frame the agent sends carries the id of the request it answers (0
 * for READY), so a reply can never be taken for another request's. One
 * request at a time; the host serializes its calls.
 *
 *   host -> guest                         guest -> host
 *   EXEC   timeout_ms u32, max_output u64,  STDOUT/STDERR chunks, then EXIT
 *          flags u32 (1: stdin follows as   (code i32 as a shell shows it,
 *          DATA frames, empty = EOF), argc,  flags u32: 1 timed out, 2 output
 *          envc u32, then strings (u32 len   cap hit, 4 killed by the OOM killer,
 *          + bytes): cwd, argv.., env..      8 not reaped: its status is unknown,
 *                                            code -1)
 *   DATA   stdin or file bytes
 *   KILL   kill the running command's tree
 *   READ   limit u64, path               DATA chunks, then OK | ERROR
 *   WRITE  mode u32, path; DATA.., empty  OK | ERROR
 *   LIST   path                          ENTRY.. then OK | ERROR (E2BIG past
 *                                         MAX_ENTRIES entries: the host stays in step)
 *   REMOVE recursive u32, path           OK | ERROR
 *   STAT   path                          OK | ERROR
 *   PING                                 OK
 *   COUNTS                               OK (oom_kill u64, forks refused u64: the
 *                                         commands' cgroup's memory.events and
 *                                         pids.events counters) | ERROR (no --cgroup)
 *   UPPER  max_bytes u64, max_entries u32 ENTRY.. (each file's bytes after it as
 *                                         DATA), then OK | ERROR; every other
 *                                         process stopped meanwhile (do_upper;
 *                                         runtime/guest/upper.py has the entry)
 *   SHUTDOWN                             OK, then power off
 *   (on every new host connection)       READY version, NUL, dropped u32: the id
 *                                         of a request the agent gave up when the
 *                                         host's end closed (it sent no last frame
 *                                         for it: an EXEC's command was killed, no
 *                                         EXIT), else 0
 *
 * The host's end "closes" (POLLHUP on the port) also for a moment when a VM
 * is restored from a snapshot (QEMU tells the guest the saved connection
 * state, then the new one): a request under way gives up only when the
 * port stays closed for HUP_GRACE_MS.
 *
 * No process of the sandbox can reach the port: the agent holds it open (a
 * virtio-serial port opens once) and is non-dumpable, and every command runs
 * without the capabilities that would pass that (CAP_SYS_PTRACE for
 * pidfd_getfd and /proc/PID/fd, CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_BPF,
 * CAP_PERFMON, CAP_SYS_ADMIN are dropped from its bounding set, so nothing
 * it starts regains them) and in a Landlock domain of its own, so a process
 * left by one command cannot ptrace, take descriptors from, or (Landlock ABI
 * 6+) signal a later one. CAP_SYS_CHROOT is dropped too, after the agent
 * chrooted the command: with it, chroot("sub") without a chdir and then
 * chdir("..") leaves the root, to the initramfs' upper (/rw/upper) and the
 * commands' cgroup (/cgroup), where a command could move itself out of its
 * limits. (A chrooted process cannot make a user namespace either, which
 * would give it CAP_SYS_CHROOT back.)
 *
 * A command runs in its own session; on timeout, output cap or KILL its
 * tree is killed: every process of its session and every process holding
 * its stdout/stderr pipes (a double-forked daemon). When the host goes away
 * mid-command the command's tree is killed too.
 *
 * A command's exit status is reported only once the agent has reaped it.
 * A leader that exited but stays a zombie the agent cannot reap is one some
 * process of the command ptrace-attached (a zombie tracee is visible to its
 * tracer only): that tracer is killed, which hands the zombie back. If the
 * leader still cannot be reaped (e.g. stuck in the kernel), EXIT carries
 * flag 8 and code -1, never a made-up 0.
 *
 * --test-fault noreap (tests only, a fault injection): the agent discards
 * the leader's status when it reaps it, standing in for a command it cannot
 * reap, which cannot be produced on demand.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#define VERSION "lazyfs-agent 3"
#define MAX_FRAME (1u << 20)
#define CHUNK 65536
#define SEND_TIMEOUT_MS 30000
#define RECV_TIMEOUT_MS 30000
#define HUP_GRACE_MS 3000  /* a request under way outlives a host end closed this long */
#define MAX_ENTRIES 100000  /* a listing, as the host's cap (runtime/guest/protocol.py) */

enum {
    T_EXEC = 1, T_DATA = 2, T_KILL = 3, T_READ = 4, T_WRITE = 5, T_LIST = 6, T_REMOVE = 7,
    T_STAT = 8, T_PING = 9, T_SHUTDOWN = 10, T_UPPER = 11, T_COUNTS = 12,
    T_READY = 32, T_STDOUT = 33, T_STDERR = 34, T_EXIT = 35, T_FDATA = 36, T_ENTRY = 37,
    T_OK = 38, T_ERROR = 39,
};

static int port = -1;
static int rootfd = -1;
static uint32_t req_id;   /* the id of the request being answered (24 bits) */
static int cg_procs = -1; /* the commands' cgroup.procs (--cgroup), or -1 */
static int cg_events = -1; /* its memory.events */
static int cg_pids_events = -1; /* its pids.events */
static int connected = 0;
static uint32_t dropped_id; /* a request given up for a closed host end, for READY */
static int sigfd = -1;
static unsigned char *rbuf;  /* the frame being read */
static int fault_noreap = 0; /* --test-fault noreap (see the header) */
#define REAP_WAIT_MS 2000  /* a leader gone or a zombie we cannot reap: how long to wait */

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* --chroot: /proc/1 of the initramfs, opened before the chroot, until PID 1
 * has the agent's root (init_took_over) */
static int pid1_dir = -1;
static long long started_ms;
#define INIT_WAIT_MS 30000

static int init_took_over(void) {
    if (pid1_dir < 0) return 1;
    struct stat init_root, mine;
    long long waited = now_ms() - started_ms;
    int same = fstatat(pid1_dir, "root/", &init_root, 0) == 0 && stat("/", &mine) == 0
               && init_root.st_dev == mine.st_dev && init_root.st_ino == mine.st_ino;
    if (!same && waited < INIT_WAIT_MS) return 0;
    if (!same) fprintf(stderr, "lazyfs-agent: PID 1 did not move into the root in %d ms\n",
                       INIT_WAIT_MS);
    close(pid1_dir);
    pid1_dir = -1;
    return 1;
}

static void nap(int ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- frames ------------------------------------------------------------ */

static long long hup_since;  /* since when the port has said POLLHUP, or 0 */

/* Write all of buf; 0 on success, -1 when the host is gone or stuck. */
static int write_all(const void *buf, size_t n) {
    const unsigned char *p = buf;
    long long deadline = now_ms() + SEND_TIMEOUT_MS;
    while (n > 0) {
        ssize_t w = write(port, p, n);
        if (w > 0) { p += w; n -= (size_t)w; continue; }
        if (w < 0 && errno != EAGAIN && errno != EINTR) return -1;
        struct pollfd pfd = {.fd = port, .events = POLLOUT};
        long long left = deadline - now_ms();
        if (left <= 0) return -1;
        int r = poll(&pfd, 1, (int)left);
        if (r > 0 && (pfd.revents & POLLHUP)) {  /* closed: for good, or a restore's moment */
            if (hup_since == 0) hup_since = now_ms();
            if (now_ms() - hup_since > HUP_GRACE_MS) { connected = 0; return -1; }
            nap(10);
        } else {
            hup_since = 0;
        }
    }
    hup_since = 0;
    return 0;
}

static int send_frame(int type, const void *payload, uint32_t len) {
    unsigned char hdr[8] = {0};
    uint32_t id = type == T_READY ? 0 : req_id;
    memcpy(hdr, &len, 4);
    hdr[4] = (unsigned char)type;
    hdr[5] = (unsigned char)id;
    hdr[6] = (unsigned char)(id >> 8);
    hdr[7] = (unsigned char)(id >> 16);
    if (write_all(hdr, 8) != 0 || (len && write_all(payload, len) != 0)) {
        if (type != T_READY) dropped_id = req_id;
        return -1;
    }
    return 0;
}

static int send_ok(void) { return send_frame(T_OK, NULL, 0); }

static int send_error(int err, const char *what) {
    char msg[1024];
    int32_t e = err;
    int n = snprintf(msg + 4, sizeof msg - 4, "%s: %s", what, strerror(err));
    if (n < 0) n = 0;
    if (n > (int)sizeof msg - 5) n = (int)sizeof msg - 5;
    memcpy(msg, &e, 4);
    return send_frame(T_ERROR, msg, (uint32_t)n + 4);
}

/* Read exactly n bytes; 0 ok, -1 host gone or timeout. */
static int read_all(void *buf, size_t n, int timeout_ms) {
    unsigned char *p = buf;
    long long deadline = now_ms() + timeout_ms;
    while (n > 0) {
        ssize_t r = read(port, p, n);
        if (r > 0) { p += r; n -= (size_t)r; hup_since = 0; continue; }
        if (r < 0 && errno != EAGAIN && errno != EINTR) return -1;
        long long left = deadline - now_ms();
        if (left <= 0) return -1;
        if (r == 0) {  /* the host's end closed: for good, or a restore's moment */
            if (hup_since == 0) hup_since = now_ms();
            if (now_ms() - hup_since > HUP_GRACE_MS) { connected = 0; return -1; }
            nap(10);
            continue;
        }
        struct pollfd pfd = {.fd = port, .events = POLLIN};
        poll(&pfd, 1, (int)left);
    }
    hup_since = 0;
    return 0;
}

/* Read one frame into rbuf; returns its type, -1 on a lost connection. The
 * frame's request id lands in *id. */
static int recv_frame_id(uint32_t *len, uint32_t *id) {
    unsigned char hdr[8];
    if (read_all(hdr, 8, RECV_TIMEOUT_MS) != 0) return -1;
    memcpy(len, hdr, 4);
    *id = hdr[5] | (uint32_t)hdr[6] << 8 | (uint32_t)hdr[7] << 16;
    if (*len > MAX_FRAME) { connected = 0; return -1; }  /* out of sync: drop it */
    if (*len && read_all(rbuf, *len, RECV_TIMEOUT_MS) != 0) return -1;
    return hdr[4];
}

static int recv_frame(uint32_t *len) {
    uint32_t id;
    return recv_frame_id(len, &id);
}

/* What a command gives up before it execs (see the header). */
static const int dropped_caps[] = {CAP_SYS_PTRACE, CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_ADMIN,
                                   CAP_SYS_CHROOT, 38 /* CAP_PERFMON */, 39 /* CAP_BPF */};

static int confine_command(void) {
    for (size_t k = 0; k < sizeof dropped_caps / sizeof *dropped_caps; k++)
        if (prctl(PR_CAPBSET_DROP, dropped_caps[k], 0, 0, 0) != 0 && errno != EINVAL) return -1;
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d) != 0) return -1;
    for (size_t k = 0; k < sizeof dropped_caps / sizeof *dropped_caps; k++) {
        int c = dropped_caps[k];
        uint32_t bit = 1u << (c % 32);
        d[c / 32].effective &= ~bit;
        d[c / 32].permitted &= ~bit;
        d[c / 32].inheritable &= ~bit;
    }
    if (syscall(SYS_capset, &h, d) != 0) return -1;
    /* a Landlock domain of its own: handles only block-device creation (a
     * no-op here), scopes ptrace-class access and, from ABI 6, signals */
    struct { uint64_t fs, net, scoped; } attr = {1ULL << 11, 0, 0};
    long abi = syscall(444, NULL, 0, 1UL);
    if (abi <= 0) return 0;  /* no Landlock in this guest kernel: the caps still hold */
    size_t size = 8;
    if (abi >= 6) { attr.scoped = 2; size = 24; }
    int fd = (int)syscall(444, &attr, size, 0UL);
    if (fd < 0) return -1;
    int r = prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 ? (int)syscall(446, fd, 0UL) : -1;
    close(fd);
    return r;
}

/* A cursor over a request's payload. */
struct cur { const unsigned char *p; uint32_t left; int bad; };

static uint32_t get_u32(struct cur *c) {
    uint32_t v = 0;
    if (c->left < 4) { c->bad = 1; return 0; }
    memcpy(&v, c->p, 4); c->p += 4; c->left -= 4;
    return v;
}

static uint64_t get_u64(struct cur *c) {
    uint64_t v = 0;
    if (c->left < 8) { c->bad = 1; return 0; }
    memcpy(&v, c->p, 8); c->p += 8; c->left -= 8;
    return v;
}

/* A NUL-terminated copy of the next string (malloc'd). */
static char *get_str(struct cur *c) {
    uint32_t n = get_u32(c);
    if (c->bad || n > c->left) { c->bad = 1; return NULL; }
    char *s = malloc(n + 1);
    if (!s) { c->bad = 1; return NULL; }
    memcpy(s, c->p, n); s[n] = 0;
    if (strlen(s) != n) { free(s); c->bad = 1; return NULL; }  /* embedded NUL */
    c->p += n; c->left -= n;
    return s;
}

/* ---- paths inside the root ---------------------------------------------- */

static int open_in_root(const char *path, int flags, mode_t mode) {
    struct open_how how = {.flags = (uint64_t)(flags | O_CLOEXEC), .mode = mode,
                           .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS};
    return (int)syscall(SYS_openat2, rootfd, path, &how, sizeof how);
}

/* Split path into a parent fd (O_PATH dir, opened in the root) and its last
 * component. create: make the missing directories on the way. */
static int open_parent(char *path, char **name, int create) {
    char *slash = strrchr(path, '/');
    if (!slash || slash[1] == 0 || strcmp(slash + 1, ".") == 0 || strcmp(slash + 1, "..") == 0) {
        errno = EINVAL;
        return -1;
    }
    *name = slash + 1;
    *slash = 0;
    const char *dir = path[0] ? path : "/";
    if (create) {
        for (char *p = path + 1; ; p++) {
            if (*p == '/' || *p == 0) {
                char save = *p;
                *p = 0;
                char *last = strrchr(path, '/');
                if (last && last[1]) {
                    *last = 0;
                    int pfd = open_in_root(path[0] ? path : "/", O_PATH | O_DIRECTORY, 0);
                    *last = '/';
                    if (pfd >= 0) {
                        if (mkdirat(pfd, last + 1, 0755) != 0 && errno != EEXIST) {
                            int e = errno; close(pfd); *p = save; errno = e; return -1;
                        }
                        close(pfd);
                    }
                }
                *p = save;
                if (save == 0) break;
            }
        }
    }
    return open_in_root(dir, O_PATH | O_DIRECTORY, 0);
}

/* ---- file requests ------------------------------------------------------ */

static void do_read(struct cur *c) {
    uint64_t limit = get_u64(c);
    char *path = get_str(c);
    if (c->bad) { free(path); send_error(EINVAL, "bad READ request"); return; }
    int fd = open_in_root(path, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0);
    struct stat st;
    if (fd < 0) { send_error(errno, path); free(path); return; }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        send_error(fstat(fd, &st) != 0 ? errno : EISDIR, path);
        close(fd); free(path); return;
    }
    if ((uint64_t)st.st_size > limit) {
        send_error(EFBIG, path); close(fd); free(path); return;
    }
    static unsigned char buf[CHUNK];
    uint64_t total = 0;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { send_error(errno, path); break; }
        if (n == 0) { send_ok(); break; }
        total += (uint64_t)n;
        if (total > limit) { send_error(EFBIG, path); break; }
        if (send_frame(T_FDATA, buf, (uint32_t)n) != 0) break;
    }
    close(fd);
    free(path);
}

static void do_write(struct cur *c) {
    uint32_t mode = get_u32(c);
    char *path = get_str(c);
    int err = c->bad ? EINVAL : 0;
    char *name = NULL;
    char tmp[64];
    int dfd = -1, fd = -1;
    if (!err) {
        dfd = open_parent(path, &name, 1);
        if (dfd < 0) err = errno;
    }
    if (!err) {
        snprintf(tmp, sizeof tmp, ".lazyfs-agent-%lld.tmp", now_ms());
        fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                    mode & 07777);
        if (fd < 0) err = errno;
    }
    /* consume the data frames whatever happened, to stay in step */
    for (;;) {
        uint32_t len;
        int t = recv_frame(&len);
        if (t < 0) { err = err ? err : EPIPE; break; }
        if (t != T_DATA) { err = err ? err : EPROTO; break; }
        if (len == 0) break;
        if (!err) {
            unsigned char *p = rbuf;
            while (len > 0) {
                ssize_t w = write(fd, p, len);
                if (w < 0 && errno == EINTR) continue;
                if (w < 0) { err = errno; break; }
                p += w; len -= (uint32_t)w;
            }
        }
    }
    if (!err && fchmod(fd, mode & 07777) != 0) err = errno;
    if (fd >= 0 && close(fd) != 0 && !err) err = errno;
    if (!err && renameat(dfd, tmp, dfd, name) != 0) err = errno;
    if (err && fd >= 0) unlinkat(dfd, tmp, 0);
    if (dfd >= 0) close(dfd);
    if (err) send_error(err, path ? path : "write"); else send_ok();
    free(path);
}

static void do_list(struct cur *c) {
    char *path = get_str(c);
    if (c->bad) { send_error(EINVAL, "bad LIST request"); return; }
    int fd = open_in_root(path, O_RDONLY | O_DIRECTORY, 0);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) { send_error(errno, path); if (fd >= 0) close(fd); free(path); return; }
    struct dirent *e;
    unsigned char buf[8 + 4 + 8 + 8 + 4 + 256];
    long sent = 0;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (sent == MAX_ENTRIES) {
            closedir(d);
            char what[64];
            snprintf(what, sizeof what, "more than %d entries", MAX_ENTRIES);
            send_error(E2BIG, what);
            free(path);
            return;
        }
        sent++;
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        uint32_t mode = st.st_mode;
        uint64_t size = (uint64_t)st.st_size;
        int64_t mtime = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
        uint32_t n = (uint32_t)strlen(e->d_name);
        memcpy(buf, &mode, 4);
        memcpy(buf + 4, &size, 8);
        memcpy(buf + 12, &mtime, 8);
        memcpy(buf + 20, &n, 4);
        memcpy(buf + 24, e->d_name, n);
        if (send_frame(T_ENTRY, buf, 24 + n) != 0) break;
    }
    closedir(d);
    send_ok();
    free(path);
}

static int remove_tree(int dfd, const char *name) {
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return -1;
    if (!S_ISDIR(st.st_mode)) return unlinkat(dfd, name, 0);
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    DIR *d = fdopendir(fd);
    if (!d) { close(fd); return -1; }
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (remove_tree(dirfd(d), e->d_name) != 0) rc = -1;
    }
    closedir(d);
    return rc == 0 ? unlinkat(dfd, name, AT_REMOVEDIR) : -1;
}

static void do_remove(struct cur *c) {
    uint32_t recursive = get_u32(c);
    char *path = get_str(c);
    char *name = NULL;
    if (c->bad) { send_error(EINVAL, "bad REMOVE request"); return; }
    int dfd = open_parent(path, &name, 0);
    if (dfd < 0) { send_error(errno, path); free(path); return; }
    /* O_PATH parent: reopen it as a directory we can unlink in */
    int d = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    close(dfd);
    struct stat st;
    int rc = -1;
    if (d >= 0 && fstatat(d, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (!S_ISDIR(st.st_mode)) rc = unlinkat(d, name, 0);
        else if (recursive) rc = remove_tree(d, name);
        else rc = unlinkat(d, name, AT_REMOVEDIR);
    }
    if (rc != 0) send_error(errno, path); else send_ok();
    if (d >= 0) close(d);
    free(path);
}

static void do_stat(struct cur *c) {
    char *path = get_str(c);
    if (c->bad) { send_error(EINVAL, "bad STAT request"); return; }
    int fd = open_in_root(path, O_PATH, 0);
    if (fd < 0) send_error(errno, path); else { close(fd); send_ok(); }
    free(path);
}

/* ---- exec ------------------------------------------------------------- */

static ino_t pipe_ino(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? st.st_ino : 0;
}

static int holds_pipe(const char *pid, ino_t a, ino_t b) {
    char dir[300], link[600], target[64];
    snprintf(dir, sizeof dir, "/proc/%s/fd", pid);
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while (!found && (e = readdir(d)) != NULL) {
        snprintf(link, sizeof link, "%s/%s", dir, e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0) continue;
        target[n] = 0;
        unsigned long ino;
        if (sscanf(target, "pipe:[%lu]", &ino) == 1 && (ino == a || ino == b)) found = 1;
    }
    closedir(d);
    return found;
}

/* Kill the command's tree: its session, and whoever holds its output pipes.
 * Repeated until a pass finds nothing (what forked meanwhile is caught). */
static void kill_tree(pid_t leader, ino_t out_ino, ino_t err_ino) {
    for (int pass = 0; pass < 50; pass++) {
        int killed = 0;
        DIR *d = opendir("/proc");
        if (!d) return;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            char *end;
            long pid = strtol(e->d_name, &end, 10);
            /* never itself: next to an image's own init the agent is not PID 1,
             * and it holds the read ends of the command's pipes */
            if (*end || pid <= 1 || pid == getpid()) continue;
            char statp[64], line[512];
            snprintf(statp, sizeof statp, "/proc/%ld/stat", pid);
            int fd = open(statp, O_RDONLY | O_CLOEXEC);
            if (fd < 0) continue;
            ssize_t n = read(fd, line, sizeof line - 1);
            close(fd);
            if (n <= 0) continue;
            line[n] = 0;
            char *rp = strrchr(line, ')');
            char state;
            int ppid, pgrp, session;
            if (!rp || sscanf(rp + 2, "%c %d %d %d", &state, &ppid, &pgrp, &session) != 4)
                continue;
            if (state == 'Z') continue;
            if (session == leader || pid == leader || holds_pipe(e->d_name, out_ino, err_ino)) {
                kill((pid_t)pid, SIGKILL);
                killed++;
            }
        }
        closedir(d);
        if (!killed) return;
        nap(5);
    }
}

/* A counter of a cgroup events file ("KEY N" lines; 0 if absent). */
static long cg_count(int fd, const char *key) {
    if (fd < 0) return 0;
    char buf[512];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return 0;
    buf[n] = 0;
    size_t k = strlen(key);
    for (char *p = buf; (p = strstr(p, key)) != NULL; p += k)
        if ((p == buf || p[-1] == '\n') && p[k] == ' ') return atol(p + k + 1);
    return 0;
}

/* The commands' cgroup's oom_kill count (0 without --cgroup). */
static long oom_kills(void) { return cg_count(cg_events, "oom_kill"); }

/* COUNTS: what the guest kernel refused the commands so far (two kernel
 * counters of the commands' cgroup, read from descriptors opened before
 * any command ran). */
static void do_counts(void) {
    if (cg_procs < 0) { send_error(ENOENT, "no commands' cgroup"); return; }
    uint64_t v[2] = {(uint64_t)oom_kills(), (uint64_t)cg_count(cg_pids_events, "max")};
    send_frame(T_OK, v, sizeof v);
}

/* Reap every child that exited; returns 1 if `child` was among them. */
static int reap(pid_t child, int *status) {
    int found = 0, st;
    pid_t w;
    while ((w = waitpid(-1, &st, WNOHANG)) > 0) {
        if (w == child && !fault_noreap) { *status = st; found = 1; }
    }
    return found;
}

/* A process's state letter (R, S, D, Z, ...), 0 if it is gone. */
static char proc_state(pid_t pid) {
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, line, sizeof line - 1);
    close(fd);
    if (n <= 0) return 0;
    line[n] = 0;
    char *rp = strrchr(line, ')');
    return rp && rp[1] == ' ' ? rp[2] : 0;
}

/* Kill the process ptrace-attached to pid, if any: a zombie tracee goes
 * back to its parent (us) only once its tracer is gone. 1 if one was killed. */
static int kill_tracer(pid_t pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strstr(buf, "\nTracerPid:");
    long tracer = p ? atol(p + 11) : 0;
    if (tracer <= 1 || tracer == getpid()) return 0;
    kill((pid_t)tracer, SIGKILL);
    return 1;
}

static void drain_signals(void) {
    struct signalfd_siginfo si;
    while (read(sigfd, &si, sizeof si) == (ssize_t)sizeof si) {}
}

static void do_exec(struct cur *c) {
    uint32_t timeout_ms = get_u32(c);
    uint64_t max_output = get_u64(c);
    uint32_t flags = get_u32(c);
    uint32_t argc = get_u32(c), envc = get_u32(c);
    if (c->bad || argc == 0 || argc > 65536 || envc > 65536) {
        send_error(EINVAL, "bad EXEC request");
        return;
    }
    char *cwd = get_str(c);
    char **argv = calloc(argc + 1, sizeof *argv);
    char **envp = calloc(envc + 1, sizeof *envp);
    for (uint32_t i = 0; argv && i < argc; i++) argv[i] = get_str(c);
    for (uint32_t i = 0; envp && i < envc; i++) envp[i] = get_str(c);
    int want_stdin = flags & 1;
    if (c->bad || !argv || !envp) {
        send_error(EINVAL, "bad EXEC request");
        goto out;
    }
    int in[2], out[2], errp[2];
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC) || pipe2(errp, O_CLOEXEC)) {
        send_error(errno, "pipe");
        goto out;
    }
    long long start = now_ms();
    long ooms = oom_kills();
    pid_t child = fork();
    if (child < 0) {
        send_error(errno, "fork");
        close(in[0]); close(in[1]); close(out[0]); close(out[1]);
        close(errp[0]); close(errp[1]);
        goto out;
    }
    if (child == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);  /* ignored in the agent; an ignored disposition survives exec */
        setsid();
        setpriority(PRIO_PROCESS, 0, 0);
        dup2(in[0], 0); dup2(out[1], 1); dup2(errp[1], 2);
        if (cg_procs >= 0 && write(cg_procs, "0", 1) != 1) {
            int e = errno;
            dprintf(2, "lazyfs-agent: cannot start the command: %s\n",
                    e == EAGAIN ? "the sandbox is at its process limit" : strerror(e));
            _exit(126);
        }
        /* the chroot first: confine_command drops CAP_SYS_CHROOT, so the
         * command cannot chroot again (chroot("sub") without a chdir, then
         * "..": out to the initramfs root, its upper and cgroups) */
        if (fchdir(rootfd) != 0 || chroot(".") != 0) {
            dprintf(2, "lazyfs-agent: cannot enter the sandbox root: %s\n", strerror(errno));
            _exit(127);
        }
        if (confine_command() != 0) {
            dprintf(2, "lazyfs-agent: cannot confine the command: %s\n", strerror(errno));
            _exit(127);
        }
        if (chdir(cwd[0] ? cwd : "/") != 0) {
            dprintf(2, "lazyfs-agent: cannot enter working directory %s: %s\n", cwd,
                    strerror(errno));
            _exit(127);
        }
        extern char **environ;
        environ = envp;
        execvp(argv[0], argv);
        int e = errno;
        dprintf(2, "lazyfs-agent: cannot run %s: %s\n", argv[0],
                e == ENOENT ? "command not found" : strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    close(in[0]); close(out[1]); close(errp[1]);
    ino_t out_ino = pipe_ino(out[0]), err_ino = pipe_ino(errp[0]);
    int fds_open[2] = {out[0], errp[0]};
    fcntl(in[1], F_SETFL, O_NONBLOCK);
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(errp[0], F_SETFL, O_NONBLOCK);
    if (!want_stdin) { close(in[1]); in[1] = -1; }
    int stdin_done = !want_stdin;       /* the host sent its last stdin frame */
    uint32_t pend_off = 0, pend_len = 0;  /* stdin bytes of rbuf not yet written */
    uint64_t sent[2] = {0, 0};
    long long deadline = start + timeout_ms;
    int status = 0, exited = 0, killed = 0, timed_out = 0, truncated = 0, lost = 0;
    int unreaped = 0;
    long long killed_at = 0, unreapable_since = 0;
    long long hup_retry = 0;  /* the port said POLLHUP: not polled again before this */
    static unsigned char buf[CHUNK];
    for (;;) {
        if (exited && fds_open[0] < 0 && fds_open[1] < 0) break;
        if (killed && now_ms() - killed_at > 5000) break;  /* the tree would not die */
        if (!exited && fds_open[0] < 0 && fds_open[1] < 0) {
            /* output closed: a leader that exited but is not ours to reap
             * (a zombie a tracer holds, or gone) must not wait for the timeout */
            char st = proc_state(child);
            if (st == 'Z' || st == 'X' || st == 0) {
                if (!unreapable_since) { unreapable_since = now_ms(); kill_tracer(child); }
                else if (now_ms() - unreapable_since > REAP_WAIT_MS) break;
            }
        }
        struct pollfd p[5];
        int np = 0, ip_port = -1, ip_in = -1, ip_out = -1, ip_err = -1;
        p[np++] = (struct pollfd){.fd = sigfd, .events = POLLIN};
        if (!lost && !(want_stdin && pend_len) && now_ms() >= hup_retry) {
            ip_port = np;
            p[np++] = (struct pollfd){.fd = port, .events = POLLIN};
        }
        if (in[1] >= 0 && pend_len) { ip_in = np; p[np++] = (struct pollfd){.fd = in[1], .events = POLLOUT}; }
        if (fds_open[0] >= 0) { ip_out = np; p[np++] = (struct pollfd){.fd = fds_open[0], .events = POLLIN}; }
        if (fds_open[1] >= 0) { ip_err = np; p[np++] = (struct pollfd){.fd = fds_open[1], .events = POLLIN}; }
        long long left = killed ? 200 : deadline - now_ms();
        if (left < 0) left = 0;
        int r = poll(p, (nfds_t)np, left > 1000 ? 1000 : (int)left);
        if (r < 0 && errno != EINTR) break;
        if (!killed && now_ms() >= deadline) {
            timed_out = killed = 1; killed_at = now_ms();
            kill_tree(child, out_ino, err_ino);
        }
        if (p[0].revents & POLLIN) {
            drain_signals();
            if (!exited && reap(child, &status)) exited = 1;
        } else if (!exited && reap(child, &status)) {
            exited = 1;
        }
        if (ip_port >= 0 && p[ip_port].revents) {
            if ((p[ip_port].revents & POLLHUP) && !(p[ip_port].revents & POLLIN)) {
                /* gone for good only past HUP_GRACE_MS (a restore closes it a moment) */
                if (hup_since == 0) hup_since = now_ms();
                if (now_ms() - hup_since > HUP_GRACE_MS) connected = 0;
                else hup_retry = now_ms() + 50;
            } else {
                hup_since = 0;
                uint32_t len;
                int t = recv_frame(&len);
                if (t == T_DATA && want_stdin && !stdin_done) {
                    if (len == 0) {
                        stdin_done = 1;
                        if (in[1] >= 0) { close(in[1]); in[1] = -1; }
                    } else { pend_off = 0; pend_len = len; }
                } else if (t == T_KILL && !killed) {
                    killed = 1; killed_at = now_ms();
                    kill_tree(child, out_ino, err_ino);
                }
            }
            if (!connected) {  /* the host went away: nothing may outlive it */
                lost = 1;
                if (!killed) { killed = 1; killed_at = now_ms(); kill_tree(child, out_ino, err_ino); }
            }
        }
        if (ip_in >= 0 && p[ip_in].revents) {
            ssize_t w = write(in[1], rbuf + pend_off, pend_len);
            if (w > 0) { pend_off += (uint32_t)w; pend_len -= (uint32_t)w; }
            else if (w < 0 && errno != EAGAIN && errno != EINTR) {
                /* the command closed its stdin: drop the rest */
                pend_len = 0; close(in[1]); in[1] = -1;
            }
        } else if (in[1] < 0 && pend_len) {
            pend_len = 0;
        }
        int ips[2] = {ip_out, ip_err};
        for (int k = 0; k < 2; k++) {
            if (ips[k] < 0 || !p[ips[k]].revents) continue;
            ssize_t n = read(fds_open[k], buf, sizeof buf);
            if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (n <= 0) { close(fds_open[k]); fds_open[k] = -1; continue; }
            uint64_t room = max_output - sent[k];
            uint32_t take = (uint64_t)n > room ? (uint32_t)room : (uint32_t)n;
            if (take && !lost && send_frame(k ? T_STDERR : T_STDOUT, buf, take) != 0) lost = 1;
            sent[k] += take;
            if ((uint64_t)n > room && !killed) {
                truncated = killed = 1; killed_at = now_ms();
                kill_tree(child, out_ino, err_ino);
            }
            if (lost && !killed) {
                killed = 1; killed_at = now_ms();
                kill_tree(child, out_ino, err_ino);
            }
        }
    }
    for (int k = 0; k < 2; k++) if (fds_open[k] >= 0) close(fds_open[k]);
    if (in[1] >= 0) close(in[1]);
    if (!exited) {  /* it would not die (or be handed back) in time */
        kill(child, SIGKILL);
        kill_tracer(child);
        for (int i = 0; i < 100 && !exited; i++) {
            if (reap(child, &status)) exited = 1; else nap(10);
        }
        if (!exited) unreaped = 1;  /* its status is unknown: say so, never 0 */
    }
    /* a host that sent stdin frames we never read: eat them up to the EOF frame */
    while (!lost && want_stdin && !stdin_done && connected) {
        uint32_t len;
        int t = recv_frame(&len);
        if (t < 0 || (t == T_DATA && len == 0)) break;
    }
    int32_t code = unreaped ? -1 : WIFEXITED(status) ? WEXITSTATUS(status)
                 : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 255;
    uint32_t fl = (timed_out ? 1u : 0u) | (truncated ? 2u : 0u) |
                  (code == 128 + SIGKILL && oom_kills() > ooms ? 4u : 0u) |
                  (unreaped ? 8u : 0u);
    unsigned char ex[8];
    memcpy(ex, &code, 4);
    memcpy(ex + 4, &fl, 4);
    if (!lost) send_frame(T_EXIT, ex, 8);
    else dropped_id = req_id;  /* READY tells the host this command got no EXIT */
out:
    free(cwd);
    if (argv) { for (uint32_t i = 0; i < argc; i++) free(argv[i]); free(argv); }
    if (envp) { for (uint32_t i = 0; i < envc; i++) free(envp[i]); free(envp); }
}

/* ---- the upper (verify) ------------------------------------------------- */

/* UPPER streams the writable upper (--upper DIR, the overlayfs upperdir,
 * outside ROOT) with every other process of the guest stopped, so the host
 * packs one consistent state. Only as PID 1 (a microVM): kill(-1) from PID 1
 * reaches every process of the guest, whatever cgroup or root it moved to.
 *
 * Stop: SIGSTOP to all; wait until each user process is stopped (T, t) or
 * dead (Z, X), STOP_WAIT_MS; one that is not (e.g. a vfork parent waiting
 * on a stopped child) is SIGKILLed and waited for KILL_WAIT_MS more, else
 * the request fails (EBUSY). After the stream (or a failure): SIGCONT to all.
 * Kernel threads (PF_KTHREAD) take no signals and are skipped. */
#define STOP_WAIT_MS 3000
#define KILL_WAIT_MS 2000
#define PF_KTHREAD 0x00200000
#define UPPER_PATH_MAX 4096

enum { U_FILE = 1, U_DIR = 2, U_SYMLINK = 3, U_WHITEOUT = 4, U_FIFO = 5, U_LINK = 6 };
static int upperfd = -1;  /* --upper DIR (O_PATH) */

/* Processes that are neither stopped nor dead (1 once any is found); with
 * kill_them, SIGKILL each of them. */
static int unstopped(int kill_them) {
    DIR *d = opendir("/proc");
    if (!d) return 1;
    struct dirent *e;
    int found = 0;
    while ((e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 1 || pid == getpid()) continue;
        char statp[64], line[1024];
        snprintf(statp, sizeof statp, "/proc/%ld/stat", pid);
        int fd = open(statp, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = read(fd, line, sizeof line - 1);
        close(fd);
        if (n <= 0) continue;
        line[n] = 0;
        char *rp = strrchr(line, ')');
        char state;
        int ppid, pgrp, session, tty, tpgid;
        unsigned long flags;
        if (!rp || sscanf(rp + 2, "%c %d %d %d %d %d %lu", &state, &ppid, &pgrp, &session,
                          &tty, &tpgid, &flags) != 7) continue;
        if (flags & PF_KTHREAD) continue;
        if (state == 'T' || state == 't' || state == 'Z' || state == 'X') continue;
        found = 1;
        if (kill_them) kill((pid_t)pid, SIGKILL);
    }
    closedir(d);
    return found;
}

static int stop_all(void) {
    kill(-1, SIGSTOP);
    long long t0 = now_ms();
    while (unstopped(0)) {
        int st;
        reap(-1, &st);
        if (now_ms() - t0 > STOP_WAIT_MS) {
            unstopped(1);
            long long t1 = now_ms();
            for (;;) {
                reap(-1, &st);
                if (!unstopped(0)) return 0;
                if (now_ms() - t1 > KILL_WAIT_MS) return -1;
                nap(10);
            }
        }
        nap(5);
    }
    return 0;
}

struct ustate {
    char path[UPPER_PATH_MAX + 1];
    uint64_t bytes_left;
    uint32_t entries_left;
    int err;                   /* errno of the failure (its message in what) */
    char what[512];
    struct { dev_t dev; ino_t ino; char *path; } *links;  /* files with nlink > 1 */
    size_t nlinks, cap;
};

static void ufail(struct ustate *u, int err, const char *why) {
    if (u->err) return;
    u->err = err;
    snprintf(u->what, sizeof u->what, "%.300s%s%.100s", u->path[0] ? u->path : "/",
             why[0] ? ": " : "", why);
}

static int has_xattr(int fd, const char *name, const char *want) {
    char v[8];
    ssize_t n = fgetxattr(fd, name, v, sizeof v);
    if (n < 0) return 0;
    return want == NULL || ((size_t)n == strlen(want) && memcmp(v, want, (size_t)n) == 0);
}

/* One ENTRY frame: kind, mode, uid, gid (u32), mtime_ns (i64), size (u64),
 * flags (u32: 1 opaque), path (u32 len + bytes), target (u32 len + bytes). */
static int send_entry(struct ustate *u, uint32_t kind, const struct stat *st, uint64_t size,
                      uint32_t flags, const char *target) {
    static unsigned char buf[48 + 2 * (UPPER_PATH_MAX + 4)];
    uint32_t mode = st->st_mode & 07777, uid = st->st_uid, gid = st->st_gid;
    int64_t mtime = (int64_t)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
    uint32_t plen = (uint32_t)strlen(u->path), tlen = target ? (uint32_t)strlen(target) : 0;
    size_t o = 0;
    memcpy(buf + o, &kind, 4); o += 4;
    memcpy(buf + o, &mode, 4); o += 4;
    memcpy(buf + o, &uid, 4); o += 4;
    memcpy(buf + o, &gid, 4); o += 4;
    memcpy(buf + o, &mtime, 8); o += 8;
    memcpy(buf + o, &size, 8); o += 8;
    memcpy(buf + o, &flags, 4); o += 4;
    memcpy(buf + o, &plen, 4); o += 4;
    memcpy(buf + o, u->path, plen); o += plen;
    memcpy(buf + o, &tlen, 4); o += 4;
    if (tlen) { memcpy(buf + o, target, tlen); o += tlen; }
    if (send_frame(T_ENTRY, buf, (uint32_t)o) != 0) { u->err = EPIPE; return -1; }
    return 0;
}

static int send_file(struct ustate *u, int dfd, const char *name, const struct stat *st) {
    if ((uint64_t)st->st_size > u->bytes_left) {
        ufail(u, EFBIG, "the upper's files add up past its size (a sparse file?)");
        return -1;
    }
    if (st->st_nlink > 1) {
        for (size_t i = 0; i < u->nlinks; i++)
            if (u->links[i].dev == st->st_dev && u->links[i].ino == st->st_ino)
                return send_entry(u, U_LINK, st, 0, 0, u->links[i].path);
    }
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) { ufail(u, errno, "open"); return -1; }
    if (has_xattr(fd, "trusted.overlay.metacopy", NULL)) {
        close(fd);
        ufail(u, EOPNOTSUPP, "an overlayfs metacopy upper");
        return -1;
    }
    uint64_t size = (uint64_t)st->st_size;
    u->bytes_left -= size;
    if (send_entry(u, U_FILE, st, size, 0, NULL) != 0) { close(fd); return -1; }
    static unsigned char buf[CHUNK];
    uint64_t sent = 0;
    while (sent < size) {
        size_t want = size - sent < sizeof buf ? (size_t)(size - sent) : sizeof buf;
        ssize_t n = read(fd, buf, want);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) { close(fd); ufail(u, n < 0 ? errno : EIO, "read (shorter than its size)"); return -1; }
        if (send_frame(T_FDATA, buf, (uint32_t)n) != 0) { close(fd); u->err = EPIPE; return -1; }
        sent += (uint64_t)n;
    }
    close(fd);
    if (st->st_nlink > 1) {
        if (u->nlinks == u->cap) {
            size_t cap = u->cap ? 2 * u->cap : 64;
            void *p = realloc(u->links, cap * sizeof *u->links);
            if (!p) { ufail(u, ENOMEM, "hard links"); return -1; }
            u->links = p;
            u->cap = cap;
        }
        char *copy = strdup(u->path);
        if (!copy) { ufail(u, ENOMEM, "hard links"); return -1; }
        u->links[u->nlinks].dev = st->st_dev;
        u->links[u->nlinks].ino = st->st_ino;
        u->links[u->nlinks++].path = copy;
    }
    return 0;
}

/* Send the entries below the directory dfd, whose path is u->path. */
static int send_dir(struct ustate *u, int dfd) {
    DIR *d = fdopendir(dfd);
    if (!d) { close(dfd); ufail(u, errno, "opendir"); return -1; }
    size_t base = strlen(u->path);
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        size_t n = strlen(e->d_name);
        if (base + (base ? 1 : 0) + n > UPPER_PATH_MAX) {
            ufail(u, ENAMETOOLONG, "a path below it is too long");
            rc = -1;
            break;
        }
        if (base) u->path[base] = '/';
        memcpy(u->path + base + (base ? 1 : 0), e->d_name, n + 1);
        if (u->entries_left == 0) {
            u->path[base] = 0;
            ufail(u, E2BIG, "the upper has more entries than the host takes");
            rc = -1;
            break;
        }
        u->entries_left--;
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            ufail(u, errno, "stat");
            rc = -1;
        } else if (S_ISDIR(st.st_mode)) {
            int fd = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0) { ufail(u, errno, "open"); rc = -1; }
            else if (has_xattr(fd, "trusted.overlay.redirect", NULL)) {
                close(fd);
                ufail(u, EOPNOTSUPP, "an overlayfs redirect_dir upper");
                rc = -1;
            } else {
                uint32_t fl = has_xattr(fd, "trusted.overlay.opaque", "y") ? 1 : 0;
                rc = send_entry(u, U_DIR, &st, 0, fl, NULL);
                if (rc == 0) rc = send_dir(u, fd); else close(fd);
            }
        } else if (S_ISREG(st.st_mode)) {
            rc = send_file(u, dirfd(d), e->d_name, &st);
        } else if (S_ISLNK(st.st_mode)) {
            char target[UPPER_PATH_MAX + 1];
            ssize_t t = readlinkat(dirfd(d), e->d_name, target, UPPER_PATH_MAX);
            if (t < 0) { ufail(u, errno, "readlink"); rc = -1; }
            else { target[t] = 0; rc = send_entry(u, U_SYMLINK, &st, 0, 0, target); }
        } else if (S_ISCHR(st.st_mode) && st.st_rdev == 0) {
            rc = send_entry(u, U_WHITEOUT, &st, 0, 0, NULL);
        } else if (S_ISFIFO(st.st_mode)) {
            rc = send_entry(u, U_FIFO, &st, 0, 0, NULL);
        } else {
            u->entries_left++;  /* device nodes and sockets stay in the guest */
        }
        u->path[base] = 0;
    }
    closedir(d);
    return rc;
}

static void do_upper(struct cur *c) {
    uint64_t max_bytes = get_u64(c);
    uint32_t max_entries = get_u32(c);
    if (c->bad) { send_error(EINVAL, "bad UPPER request"); return; }
    if (upperfd < 0 || getpid() != 1) {
        send_error(EOPNOTSUPP, "the upper (an agent started with --upper, as PID 1)");
        return;
    }
    if (stop_all() != 0) {
        kill(-1, SIGCONT);
        send_error(EBUSY, "stopping the guest's processes (one would neither stop nor die)");
        return;
    }
    struct ustate *u = calloc(1, sizeof *u);
    if (!u) { kill(-1, SIGCONT); send_error(ENOMEM, "upper"); return; }
    u->bytes_left = max_bytes;
    u->entries_left = max_entries;
    int fd = openat(upperfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) ufail(u, errno, "open");
    else send_dir(u, fd);
    kill(-1, SIGCONT);
    if (u->err == EPIPE) {}  /* the host is gone: nothing to say */
    else if (u->err) {
        char msg[600];
        snprintf(msg, sizeof msg, "upper %s", u->what);
        errno = u->err;
        send_error(u->err, msg);
    } else send_ok();
    for (size_t i = 0; i < u->nlinks; i++) free(u->links[i].path);
    free(u->links);
    free(u);
}

/* ---- main loop ---------------------------------------------------------- */

int main(int argc, char **argv) {
    int self_chroot = 0;
    const char *cgroup = NULL, *upper = NULL;
    while (argc > 3) {
        if (strcmp(argv[1], "--chroot") == 0) { self_chroot = 1; argv++; argc--; }
        else if (strcmp(argv[1], "--cgroup") == 0 && argc > 4) { cgroup = argv[2]; argv += 2; argc -= 2; }
        else if (strcmp(argv[1], "--upper") == 0 && argc > 4) { upper = argv[2]; argv += 2; argc -= 2; }
        else if (strcmp(argv[1], "--test-fault") == 0 && argc > 4) {
            fault_noreap = strcmp(argv[2], "noreap") == 0;
            argv += 2; argc -= 2;
        }
        else break;
    }
    if (argc != 3) {
        fprintf(stderr, "usage: lazyfs-agent [--chroot] [--cgroup DIR] [--upper DIR] [--test-fault noreap] "
                "PORT ROOT\n");
        return 2;
    }
    if (cgroup) {
        char path[4096];
        snprintf(path, sizeof path, "%s/cgroup.procs", cgroup);
        cg_procs = open(path, O_WRONLY | O_CLOEXEC);
        snprintf(path, sizeof path, "%s/memory.events", cgroup);
        cg_events = open(path, O_RDONLY | O_CLOEXEC);
        snprintf(path, sizeof path, "%s/pids.events", cgroup);
        cg_pids_events = open(path, O_RDONLY | O_CLOEXEC);
        if (cg_procs < 0) fprintf(stderr, "lazyfs-agent: %s: %s (commands run unlimited)\n",
                                  cgroup, strerror(errno));
    }
    prctl(PR_SET_DUMPABLE, 0);  /* /proc/PID/fd and pidfd_getfd need CAP_SYS_PTRACE now */
    /* the agent before any command on the CPU: a fork bomb's thousand
     * runnable processes must not starve the one that kills them and
     * answers the host (the initramfs also gives their cgroup the cpu
     * controller, so they weigh as one group); commands get nice 0 back */
    setpriority(PRIO_PROCESS, 0, -20);
    rbuf = malloc(MAX_FRAME);
    port = open(argv[1], O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (port < 0) { fprintf(stderr, "lazyfs-agent: %s: %s\n", argv[1], strerror(errno)); return 1; }
    rootfd = open(argv[2], O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0 || !rbuf) { fprintf(stderr, "lazyfs-agent: %s: %s\n", argv[2], strerror(errno)); return 1; }
    if (upper) {
        upperfd = open(upper, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (upperfd < 0) fprintf(stderr, "lazyfs-agent: %s: %s (no UPPER)\n", upper, strerror(errno));
    }
    if (self_chroot) {
        pid1_dir = open("/proc/1", O_PATH | O_DIRECTORY | O_CLOEXEC);
        started_ms = now_ms();
    }
    if (self_chroot && (fchdir(rootfd) != 0 || chroot(".") != 0 || chdir("/") != 0)) {
        fprintf(stderr, "lazyfs-agent: chroot %s: %s\n", argv[2], strerror(errno));
        return 1;
    }
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    sigfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    signal(SIGPIPE, SIG_IGN);
    fprintf(stderr, "lazyfs-agent: serving %s over %s\n", argv[2], argv[1]);
    for (;;) {
        struct pollfd p[2] = {{.fd = port, .events = POLLIN}, {.fd = sigfd, .events = POLLIN}};
        int r = poll(p, 2, connected ? -1 : 100);
        if (r < 0 && errno != EINTR) { nap(100); continue; }
        if (p[1].revents & POLLIN) { int st; drain_signals(); reap(-1, &st); }
        if (p[0].revents & POLLHUP) {  /* no host on the other end */
            connected = 0;
            nap(50);
            continue;
        }
        if (!connected) {
            if (!init_took_over()) { nap(20); continue; }
            connected = 1;
            unsigned char ready[sizeof VERSION + 4];  /* version, NUL, dropped id */
            memcpy(ready, VERSION, sizeof VERSION);
            memcpy(ready + sizeof VERSION, &dropped_id, 4);
            if (send_frame(T_READY, ready, sizeof ready) != 0) continue;
            dropped_id = 0;
        }
        if (!(p[0].revents & POLLIN)) continue;
        uint32_t len, id;
        int t = recv_frame_id(&len, &id);
        if (t < 0) continue;
        if (t != T_DATA && t != T_KILL) { req_id = id; dropped_id = 0; }  /* leftovers keep no id */
        struct cur c = {rbuf, len, 0};
        switch (t) {
        case T_EXEC: do_exec(&c); break;
        case T_READ: do_read(&c); break;
        case T_WRITE: do_write(&c); break;
        case T_LIST: do_list(&c); break;
        case T_REMOVE: do_remove(&c); break;
        case T_STAT: do_stat(&c); break;
        case T_PING: send_ok(); break;
        case T_COUNTS: do_counts(); break;
        case T_UPPER: do_upper(&c); break;
        case T_SHUTDOWN:
            send_ok();
            sync();
            nap(100);
            reboot(RB_POWER_OFF);
            break;
        case T_DATA: case T_KILL: break;  /* leftovers of a finished request */
        default: send_error(EPROTO, "unknown request"); break;
        }
    }
}
