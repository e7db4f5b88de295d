/* sandbox-spawn: start a container sandbox's init, in place of `runc run`.
 *
 *   sandbox-spawn SPEC PIDFILE
 *
 * SPEC is a file the node renders from the sandbox's OCI config
 * (runtime/isolation/oci.py, native_spec): the same namespaces, id
 * mappings, mounts, masked and read-only paths, groups, rlimits,
 * capabilities and seccomp program, so both starters build one sandbox.
 * It is a sequence of NUL-terminated strings: a directive, then its fixed
 * number of arguments (the table `directives` below).
 *
 * The parent (on the host, root) clones the child into new user, pid,
 * mount, ipc, uts and network namespaces, writes its id maps, puts it in
 * its groups, then lets it go on. The child makes the root (mounts,
 * pivot_root, masks), drops to the sandbox's capabilities, loads the
 * seccomp program (a notifying one's listener goes to the node's socket
 * with the sandbox's id, as runc hands it) and execs init with descriptors
 * 0-3 as given (the exec channel, stdout, stderr, rw/). The parent writes
 * init's host pid to PIDFILE and exits 0 once init runs; any failure is one
 * line on stderr, exit 1, and the child killed (nothing of it runs on).
 *
 * Every mount point the image could shape (its /proc, /dev, /sys and what
 * lies under them before our own file systems cover them) is walked one
 * component at a time without following symbolic links: a mount never
 * lands outside the root.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <grp.h>
#include <time.h>
#include <unistd.h>

#define MAX_ITEMS 256
#define MAX_SPEC (1 << 20)
/* below the node's own 30 s for the whole start (RUNC_TIMEOUT), so that the
 * child is killed here, not left behind by a spawner that killed us */
#define TIMEOUT_MS 20000

struct mnt { const char *src, *dst, *type, *data; unsigned long flags; };
struct pair { const char *a, *b; };
struct rl { int res; rlim_t soft, hard; };

static struct {
    const char *root, *uidmap, *gidmap, *hostname, *cwd, *bpf, *listener, *id;
    int nsflags, newcgroup, nonewprivs, have_caps;
    uint64_t caps;
    struct mnt mounts[MAX_ITEMS]; int nmounts;
    struct pair links[MAX_ITEMS]; int nlinks;
    struct pair sysctls[MAX_ITEMS]; int nsysctls;
    const char *ro[MAX_ITEMS]; int nro;
    const char *masks[MAX_ITEMS]; int nmasks;
    const char *cgroups[MAX_ITEMS]; int ncgroups;
    struct rl rlimits[16]; int nrlimits;
    char *args[MAX_ITEMS + 1]; int nargs;
    char *env[MAX_ITEMS + 1]; int nenv;
} S;

static int errfd = -1;  /* the child's report to the parent (close-on-exec) */

/* One line: the parent's stderr, or (in the child) the report pipe. */
static __attribute__((noreturn, format(printf, 1, 2))) void fail(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof buf) n = sizeof buf - 1;
    for (int k = 0; k < n; k++)   /* one line, whatever a path holds */
        if ((unsigned char)buf[k] < 0x20 || buf[k] == 0x7f) buf[k] = '?';
    if (errfd >= 0) {
        (void)!write(errfd, buf, (size_t)n);
        _exit(1);
    }
    fprintf(stderr, "sandbox-spawn: %.*s\n", n, buf);
    exit(1);
}

/* ---- the spec ------------------------------------------------------------ */

static char *spec_buf;
static size_t spec_len, spec_pos;

/* A spec string for a message: at most 40 bytes, anything unprintable '?'. */
static const char *shown(const char *s) {
    static char bufs[2][41];   /* two per message */
    static int turn;
    char *buf = bufs[turn ^= 1];
    size_t k = 0;
    for (; s[k] && k < 40; k++) buf[k] = (s[k] >= 0x20 && s[k] < 0x7f) ? s[k] : '?';
    buf[k] = 0;
    return buf;
}

static const char *next(const char *what) {
    if (spec_pos >= spec_len) fail("spec: %s is missing its arguments", shown(what));
    const char *s = spec_buf + spec_pos;
    size_t n = strnlen(s, spec_len - spec_pos);
    if (spec_pos + n >= spec_len) fail("spec: an unterminated string after %s", shown(what));
    spec_pos += n + 1;
    return s;
}

static unsigned long long number(const char *s, const char *what) {
    char *end;
    errno = 0;
    if (s[0] == '-' || s[0] == ' ') fail("spec: %s: not a number: %s", shown(what), shown(s));
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end) fail("spec: %s: not a number: %s", shown(what), shown(s));
    return v;
}

static void need(int n, int max, const char *what) {
    if (n >= max) fail("spec: too many %s", what);
}

static void parse(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("cannot open the spec %s: %s", path, strerror(errno));
    spec_buf = malloc(MAX_SPEC);
    if (!spec_buf) fail("out of memory");
    ssize_t n, got = 0;
    while ((n = read(fd, spec_buf + got, MAX_SPEC - got)) > 0) got += n;
    if (n < 0 || got >= MAX_SPEC) fail("cannot read the spec %s", path);
    close(fd);
    spec_len = (size_t)got;
    while (spec_pos < spec_len) {
        const char *d = next("a directive");
        if (!strcmp(d, "root")) S.root = next(d);
        else if (!strcmp(d, "uidmap")) S.uidmap = next(d);
        else if (!strcmp(d, "gidmap")) S.gidmap = next(d);
        else if (!strcmp(d, "hostname")) S.hostname = next(d);
        else if (!strcmp(d, "cwd")) S.cwd = next(d);
        else if (!strcmp(d, "nonewprivs")) S.nonewprivs = 1;
        else if (!strcmp(d, "caps")) { S.caps = number(next(d), d); S.have_caps = 1; }
        else if (!strcmp(d, "ns")) {
            const char *t = next(d);
            if (!strcmp(t, "user")) S.nsflags |= CLONE_NEWUSER;
            else if (!strcmp(t, "pid")) S.nsflags |= CLONE_NEWPID;
            else if (!strcmp(t, "ipc")) S.nsflags |= CLONE_NEWIPC;
            else if (!strcmp(t, "uts")) S.nsflags |= CLONE_NEWUTS;
            else if (!strcmp(t, "mount")) S.nsflags |= CLONE_NEWNS;
            else if (!strcmp(t, "network")) S.nsflags |= CLONE_NEWNET;
            else if (!strcmp(t, "cgroup")) S.newcgroup = 1;
            else fail("spec: unknown namespace %s", shown(t));
        } else if (!strcmp(d, "mount")) {
            need(S.nmounts, MAX_ITEMS, "mounts");
            struct mnt *m = &S.mounts[S.nmounts++];
            m->src = next(d); m->dst = next(d); m->type = next(d);
            m->flags = (unsigned long)number(next(d), "mount flags");
            m->data = next(d);
        } else if (!strcmp(d, "symlink")) {
            need(S.nlinks, MAX_ITEMS, "symlinks");
            S.links[S.nlinks].a = next(d); S.links[S.nlinks++].b = next(d);
        } else if (!strcmp(d, "sysctl")) {
            need(S.nsysctls, MAX_ITEMS, "sysctls");
            S.sysctls[S.nsysctls].a = next(d); S.sysctls[S.nsysctls++].b = next(d);
        } else if (!strcmp(d, "ro")) { need(S.nro, MAX_ITEMS, "read-only paths"); S.ro[S.nro++] = next(d); }
        else if (!strcmp(d, "mask")) { need(S.nmasks, MAX_ITEMS, "masks"); S.masks[S.nmasks++] = next(d); }
        else if (!strcmp(d, "cgroup")) { need(S.ncgroups, MAX_ITEMS, "groups"); S.cgroups[S.ncgroups++] = next(d); }
        else if (!strcmp(d, "rlimit")) {
            need(S.nrlimits, 16, "rlimits");
            struct rl *r = &S.rlimits[S.nrlimits++];
            r->res = (int)number(next(d), d);
            r->soft = (rlim_t)number(next(d), d);
            r->hard = (rlim_t)number(next(d), d);
        } else if (!strcmp(d, "seccomp")) { S.bpf = next(d); S.listener = next(d); S.id = next(d); }
        else if (!strcmp(d, "arg")) { need(S.nargs, MAX_ITEMS, "arguments"); S.args[S.nargs++] = (char *)next(d); }
        else if (!strcmp(d, "env")) { need(S.nenv, MAX_ITEMS, "environment entries"); S.env[S.nenv++] = (char *)next(d); }
        else fail("spec: unknown directive %s", shown(d));
    }
    /* what every sandbox has: a spec without it is refused, never a weaker
     * sandbox */
    if (!S.root || S.root[0] != '/') fail("spec: no absolute root");
    if (S.nargs < 1 || S.args[0][0] != '/') fail("spec: no absolute program to run");
    int all_ns = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET;
    if ((S.nsflags & all_ns) != all_ns || !S.newcgroup)
        fail("spec: a sandbox needs its own mount, pid, ipc, uts, network and cgroup namespaces");
    if (!S.have_caps) fail("spec: no capability set");
    if (!S.nonewprivs) fail("spec: no no_new_privs");
    if (!S.bpf) fail("spec: no seccomp program");
    if (S.ncgroups < 1) fail("spec: no groups to join");
}

/* ---- the root ------------------------------------------------------------ */

/* Open (O_PATH) the path `rel` under the directory `dirfd`, one component at
 * a time, never following a symbolic link; missing components are made
 * (directories, and the last one a directory or, with `file`, an empty
 * file). Returns the descriptor. */
static int walk(int dirfd, const char *rel, int file) {
    char buf[4096];
    if (strlen(rel) >= sizeof buf) fail("path too long: %.60s", rel);
    strcpy(buf, rel);
    int cur = dup(dirfd);
    if (cur < 0) fail("dup: %s", strerror(errno));
    char *save = NULL;
    char *part = strtok_r(buf, "/", &save);
    while (part) {
        char *following = strtok_r(NULL, "/", &save);
        if (!strcmp(part, "..") || !strcmp(part, ".")) fail("path %.60s: %s", rel, "no . or .. allowed");
        int last = following == NULL;
        int fd = openat(cur, part, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT) {
            if (last && file) {
                int c = openat(cur, part, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0644);
                if (c < 0 && errno != EEXIST) fail("creating %s: %s", rel, strerror(errno));
                if (c >= 0) close(c);
            } else if (mkdirat(cur, part, 0755) != 0 && errno != EEXIST) {
                fail("creating %s: %s", rel, strerror(errno));
            }
            fd = openat(cur, part, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        }
        if (fd < 0) fail("%s: %s", rel, strerror(errno));
        struct stat st;
        if (fstat(fd, &st) != 0) fail("%s: %s", rel, strerror(errno));
        if (S_ISLNK(st.st_mode))
            fail("mount point %s: the image has a symbolic link there (%s)", rel, part);
        if (!last && !S_ISDIR(st.st_mode)) fail("mount point %s: %s is not a directory", rel, part);
        close(cur);
        cur = fd;
        part = following;
    }
    return cur;
}

static void fdpath(char *out, size_t n, int fd) {
    snprintf(out, n, "/proc/self/fd/%d", fd);
}

/* The flags a remount must keep: those the kernel locked on a mount made
 * outside the user namespace (nosuid, nodev, noexec, ro, atime). */
static unsigned long kept_flags(const char *path) {
    struct statvfs sv;
    if (statvfs(path, &sv) != 0) fail("statvfs %s: %s", path, strerror(errno));
    unsigned long f = 0;
    if (sv.f_flag & ST_RDONLY) f |= MS_RDONLY;
    if (sv.f_flag & ST_NOSUID) f |= MS_NOSUID;
    if (sv.f_flag & ST_NODEV) f |= MS_NODEV;
    if (sv.f_flag & ST_NOEXEC) f |= MS_NOEXEC;
    if (sv.f_flag & ST_NOATIME) f |= MS_NOATIME;
    if (sv.f_flag & ST_NODIRATIME) f |= MS_NODIRATIME;
    if (sv.f_flag & ST_RELATIME) f |= MS_RELATIME;
    return f;
}

#define REMOUNT_FLAGS (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | \
                       MS_NODIRATIME | MS_RELATIME | MS_STRICTATIME)

static void do_mount(int rootfd, const struct mnt *m) {
    char target[64];
    if (!strcmp(m->type, "bind")) {
        struct stat st;
        if (stat(m->src, &st) != 0) fail("bind source %s: %s", m->src, strerror(errno));
        int t = walk(rootfd, m->dst, !S_ISDIR(st.st_mode));
        fdpath(target, sizeof target, t);
        if (mount(m->src, target, NULL, MS_BIND | (m->flags & MS_REC), NULL) != 0)
            fail("binding %s on %s: %s", m->src, m->dst, strerror(errno));
        close(t);
        unsigned long want = m->flags & REMOUNT_FLAGS;
        if (want) {
            /* the new mount, reached again (nothing in the sandbox runs yet) */
            t = walk(rootfd, m->dst, 0);
            fdpath(target, sizeof target, t);
            unsigned long f = MS_BIND | MS_REMOUNT | want | kept_flags(target);
            if (mount(NULL, target, NULL, f, NULL) != 0)
                fail("remounting %s: %s", m->dst, strerror(errno));
            close(t);
        }
        return;
    }
    int t = walk(rootfd, m->dst, 0);
    fdpath(target, sizeof target, t);
    if (mount(m->src, target, m->type, m->flags, m->data[0] ? m->data : NULL) != 0)
        fail("mounting %s on %s: %s", m->type, m->dst, strerror(errno));
    close(t);
}

static void readonly(const char *path) {
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) != 0) {
        if (errno == ENOENT) return;
        fail("read-only %s: %s", path, strerror(errno));
    }
    unsigned long f = MS_BIND | MS_REMOUNT | MS_RDONLY | kept_flags(path);
    if (mount(NULL, path, NULL, f, NULL) != 0) fail("read-only %s: %s", path, strerror(errno));
}

static void mask(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return;
        fail("mask %s: %s", path, strerror(errno));
    }
    int r = S_ISDIR(st.st_mode)
        ? mount("tmpfs", path, "tmpfs", MS_RDONLY, NULL)
        : mount("/dev/null", path, NULL, MS_BIND, NULL);
    if (r != 0 && errno != ENOENT) fail("mask %s: %s", path, strerror(errno));
}

static void write_file(const char *path, const char *value) {
    int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) fail("%s: %s", path, strerror(errno));
    size_t n = strlen(value);
    if (write(fd, value, n) != (ssize_t)n) fail("writing %s: %s", path, strerror(errno));
    close(fd);
}

/* ---- privileges ---------------------------------------------------------- */

static void drop_caps(void) {
    int last = 40;
    int fd = open("/proc/sys/kernel/cap_last_cap", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        char b[16] = {0};
        if (read(fd, b, sizeof b - 1) > 0) last = atoi(b);
        close(fd);
    }
    for (int c = 0; c <= last && c < 64; c++)
        if (!(S.caps & (1ULL << c)) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) != 0 && errno != EINVAL)
            fail("dropping capability %d: %s", c, strerror(errno));
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
        fail("clearing ambient capabilities: %s", strerror(errno));
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    memset(d, 0, sizeof d);
    d[0].effective = d[0].permitted = (uint32_t)S.caps;
    d[1].effective = d[1].permitted = (uint32_t)(S.caps >> 32);
    if (syscall(SYS_capset, &h, d) != 0) fail("capset: %s", strerror(errno));
}

static int connect_listener(void) {
    if (!S.listener || !S.listener[0]) return -1;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(S.listener) >= sizeof a.sun_path) fail("listener path too long");
    strcpy(a.sun_path, S.listener);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0)
        fail("the node's seccomp listener %s: %s", S.listener, strerror(errno));
    return s;
}

/* The program at S.bpf; with a listener socket, a notifying filter whose
 * listener descriptor goes to the node with the container state runc sends
 * (the node reads state.id), then is closed here. */
static struct sock_fprog prog;

/* Read before the child changes ids (the file is root's only). */
static void read_seccomp(void) {
    int fd = open(S.bpf, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0 ||
        st.st_size % (off_t)sizeof(struct sock_filter) || st.st_size > (off_t)(4096 * sizeof(struct sock_filter)))
        fail("seccomp program %s: unreadable or malformed", S.bpf);
    struct sock_filter *code = malloc((size_t)st.st_size);
    if (!code || pread(fd, code, (size_t)st.st_size, 0) != st.st_size) fail("seccomp program %s", S.bpf);
    close(fd);
    prog.len = (unsigned short)(st.st_size / (off_t)sizeof(struct sock_filter));
    prog.filter = code;
}

static void load_seccomp(int sock) {
    if (sock < 0) {
        if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0)
            fail("seccomp: %s", strerror(errno));
        return;
    }
    int listener = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                                SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
    if (listener < 0) fail("seccomp: %s", strerror(errno));
    char msg[512];
    int n = snprintf(msg, sizeof msg, "{\"ociVersion\":\"1.0.2\",\"fds\":[\"seccompFd\"],"
                     "\"pid\":1,\"metadata\":\"\",\"state\":{\"ociVersion\":\"1.0.2\","
                     "\"id\":\"%s\",\"status\":\"creating\",\"pid\":1,\"bundle\":\"\"}}", S.id);
    if (n < 0 || (size_t)n >= sizeof msg) fail("sandbox id too long");
    char cbuf[CMSG_SPACE(sizeof listener)];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {msg, (size_t)n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof listener);
    memcpy(CMSG_DATA(c), &listener, sizeof listener);
    if (sendmsg(sock, &mh, MSG_NOSIGNAL) < 0) fail("handing the seccomp listener: %s", strerror(errno));
    close(listener);
    close(sock);
}

/* The network namespace's loopback up, as runc's default "loopback"
 * network does (the sandbox has no CAP_NET_ADMIN to do it itself). */
static void loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) fail("loopback: %s", strerror(errno));
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) != 0) fail("loopback: %s", strerror(errno));
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) != 0) fail("loopback up: %s", strerror(errno));
    close(s);
}

/* ---- the child ----------------------------------------------------------- */

static __attribute__((noreturn)) void child(int go, int sock) {
    char c;
    if (read(go, &c, 1) != 1) _exit(1);  /* the parent failed or died */
    close(go);
    /* a session of its own, as runc's init: nothing of the host's session
     * reaches in (and CRIU dumps no session leader outside the sandbox) */
    if (setsid() < 0) fail("setsid: %s", strerror(errno));
    /* the sandbox's root, no supplementary groups (with or without a user
     * namespace: none of the node's ids or groups reach in) */
    if (setresgid(0, 0, 0) != 0 || setgroups(0, NULL) != 0 || setresuid(0, 0, 0) != 0)
        fail("becoming the sandbox's root: %s", strerror(errno));
    /* a session keyring of its own (the node's is not the sandbox's) */
    if (syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, NULL) < 0 && errno != ENOSYS)
        fail("session keyring: %s", strerror(errno));
    loopback_up();
    if (S.newcgroup && unshare(CLONE_NEWCGROUP) != 0) fail("cgroup namespace: %s", strerror(errno));
    if (S.hostname && sethostname(S.hostname, strlen(S.hostname)) != 0)
        fail("hostname: %s", strerror(errno));
    if (mount(NULL, "/", NULL, MS_SLAVE | MS_REC, NULL) != 0)
        fail("making / a slave: %s", strerror(errno));
    /* a mount of this namespace's own (the copied root is locked: pivot_root
     * refuses it) */
    if (mount(S.root, S.root, NULL, MS_BIND | MS_REC, NULL) != 0)
        fail("binding the root %s: %s", S.root, strerror(errno));
    int rootfd = open(S.root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) fail("root %s: %s", S.root, strerror(errno));
    for (int k = 0; k < S.nmounts; k++) do_mount(rootfd, &S.mounts[k]);
    for (int k = 0; k < S.nlinks; k++) {
        /* links go in directories the sandbox's own mounts made (/dev) */
        const char *slash = strrchr(S.links[k].b, '/');
        int dir = slash ? walk(rootfd, strndupa(S.links[k].b, (size_t)(slash - S.links[k].b)), 0)
                        : dup(rootfd);
        const char *name = slash ? slash + 1 : S.links[k].b;
        if (symlinkat(S.links[k].a, dir, name) != 0 && errno != EEXIST)
            fail("symlink %s: %s", S.links[k].b, strerror(errno));
        close(dir);
    }
    if (fchdir(rootfd) != 0) fail("entering the root: %s", strerror(errno));
    close(rootfd);
    if (syscall(SYS_pivot_root, ".", ".") != 0) fail("pivot_root: %s", strerror(errno));
    if (mount(NULL, ".", NULL, MS_SLAVE | MS_REC, NULL) != 0)
        fail("old root: %s", strerror(errno));
    if (umount2(".", MNT_DETACH) != 0) fail("detaching the old root: %s", strerror(errno));
    if (chdir("/") != 0) fail("chdir /: %s", strerror(errno));
    for (int k = 0; k < S.nsysctls; k++) write_file(S.sysctls[k].a, S.sysctls[k].b);
    for (int k = 0; k < S.nro; k++) readonly(S.ro[k]);
    for (int k = 0; k < S.nmasks; k++) mask(S.masks[k]);
    if (S.cwd && chdir(S.cwd) != 0) fail("working directory %s: %s", S.cwd, strerror(errno));
    if (S.nonewprivs && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        fail("no_new_privs: %s", strerror(errno));
    if (S.have_caps) drop_caps();
    if (S.bpf) load_seccomp(sock);
    /* nothing but 0-3 (what init is given) reaches init, with default signal
     * dispositions, an empty mask and umask 022 (runc's), whatever the node had */
    if (syscall(SYS_close_range, 4U, ~0U, 4U /* CLOSE_RANGE_CLOEXEC */) != 0)
        fail("close_range: %s", strerror(errno));
    for (int sig = 1; sig <= 64; sig++) {  /* (the raw call: libc refuses 32 and 33) */
        struct { void *handler; unsigned long flags; void *restorer; uint64_t mask; } dfl = {0};
        if (sig != SIGKILL && sig != SIGSTOP)
            syscall(SYS_rt_sigaction, sig, &dfl, NULL, sizeof dfl.mask);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    umask(022);
    S.args[S.nargs] = NULL;
    S.env[S.nenv] = NULL;
    execve(S.args[0], S.args, S.env);
    fail("cannot run %s: %s", S.args[0], strerror(errno));
}

/* ---- the parent ---------------------------------------------------------- */

static void write_map(pid_t pid, const char *name, const char *map) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", pid, name);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail("%s: %s", path, strerror(errno));
    size_t n = strlen(map);
    if (write(fd, map, n) != (ssize_t)n) fail("writing %s (%s): %s", path, map, strerror(errno));
    close(fd);
}

static pid_t kid;
static void kill_kid(void) {
    if (kid > 0) {
        kill(kid, SIGKILL);
        waitpid(kid, NULL, 0);
        kid = 0;
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: sandbox-spawn SPEC PIDFILE\n");
        return 2;
    }
    parse(argv[1]);
    /* the node's socket is root's only: connected before the child changes ids */
    int sock = S.bpf ? connect_listener() : -1;
    if (S.bpf) read_seccomp();
    int go[2], report[2];
    if (pipe2(go, O_CLOEXEC) != 0 || pipe2(report, O_CLOEXEC) != 0) fail("pipe: %s", strerror(errno));
    /* fork-like clone: new user namespace first in the same call, so the
     * others belong to it */
    pid_t pid = (pid_t)syscall(SYS_clone, (unsigned long)(S.nsflags | SIGCHLD), NULL, NULL, NULL, 0UL);
    if (pid < 0) fail("clone: %s", strerror(errno));
    if (pid == 0) {
        close(go[1]);
        close(report[0]);
        errfd = report[1];
        child(go[0], sock);
    }
    kid = pid;
    atexit(kill_kid);
    close(go[0]);
    close(report[1]);
    if (sock >= 0) close(sock);
    if (S.nsflags & CLONE_NEWUSER) {
        if (!S.uidmap || !S.gidmap) fail("spec: a user namespace needs uidmap and gidmap");
        write_map(pid, "uid_map", S.uidmap);
        write_map(pid, "gid_map", S.gidmap);
    }
    char pidtext[24];
    int pn = snprintf(pidtext, sizeof pidtext, "%d", pid);
    for (int k = 0; k < S.ncgroups; k++) {
        int fd = open(S.cgroups[k], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, pidtext, (size_t)pn) != pn)
            fail("joining %s: %s", S.cgroups[k], strerror(errno));
        close(fd);
    }
    /* rlimits from here (host root: a hard limit may be raised) */
    for (int k = 0; k < S.nrlimits; k++) {
        struct rlimit r = {S.rlimits[k].soft, S.rlimits[k].hard};
        if (prlimit(pid, S.rlimits[k].res, &r, NULL) != 0)
            fail("rlimit %d: %s", S.rlimits[k].res, strerror(errno));
    }
    if (write(go[1], "g", 1) != 1) fail("starting the child: %s", strerror(errno));
    close(go[1]);
    /* the report pipe closes at init's exec (close-on-exec): EOF with no
     * message is success */
    char msg[1024];
    size_t got = 0;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left = TIMEOUT_MS - ((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000);
        if (left <= 0) fail("the sandbox's init did not start in %d s", TIMEOUT_MS / 1000);
        struct pollfd p = {report[0], POLLIN, 0};
        int r = poll(&p, 1, (int)left);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) continue;
        ssize_t n = read(report[0], msg + got, sizeof msg - 1 - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
        if (got >= sizeof msg - 1) break;
    }
    if (got) {
        msg[got] = 0;
        fail("%s", msg);
    }
    /* EOF also comes from a child that died (its files close before it is a
     * zombie): it must be running another program than this one */
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
        kid = 0;
        fail("the sandbox's init exited at once (status %d)", status);
    }
    char exe[64];
    snprintf(exe, sizeof exe, "/proc/%d/exe", pid);
    struct stat mine, theirs;
    if (stat(exe, &theirs) != 0) fail("the sandbox's init died before it ran");
    if (stat("/proc/self/exe", &mine) == 0 && mine.st_dev == theirs.st_dev &&
        mine.st_ino == theirs.st_ino)
        fail("the sandbox's init did not start");
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", argv[2]) >= (int)sizeof tmp) fail("pid file path too long");
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, pidtext, (size_t)pn) != pn || close(fd) != 0 || rename(tmp, argv[2]) != 0)
        fail("writing %s: %s", argv[2], strerror(errno));
    kid = 0;  /* init runs on: detached from us */
    return 0;
}
