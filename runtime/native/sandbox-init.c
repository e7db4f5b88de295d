/* sandbox-init: the only program of ours inside a container sandbox.
 *
 *   sandbox-init init [-i] [-l FD]    PID 1 of the sandbox: reaps orphans, sleeps
 *                                     (a few KiB of memory). No signal from
 *                                     inside ends it (the sandbox cannot stop
 *                                     itself behind the node's back); the node
 *                                     ends it with SIGKILL from outside.
 *                                     With -l, FD is a listening unix socket
 *                                     bound on the host (outside the sandbox's
 *                                     mount namespace): init starts the node's
 *                                     commands requested over it (the exec
 *                                     channel, below).
 *   sandbox-init exec [-i] [-c DIR] -- ARGV...
 *                                     runs one command in its own session and
 *                                     waits for it; when the agent that reads the
 *                                     command's stdout goes away (the pipe's read
 *                                     end closes), kills the command's session so
 *                                     nothing outlives a dead agent.
 *
 *   sandbox-init pdeathsig [-i] [-j FD]... [-n FD] -- ARGV...
 *                                     (on the host) runs ARGV so that it gets
 *                                     SIGKILL when the calling thread's process
 *                                     dies: the node's `runc exec` goes with the
 *                                     node agent, and the command then sees its
 *                                     output reader gone. -j: join the cgroups
 *                                     whose cgroup.procs are open at FD first
 *                                     (a VM's QEMU: charged from its first page).
 *                                     -n: enter the network namespace open at FD
 *                                     (a VM's QEMU: its tap and rules are there).
 *
 *   sandbox-init call [-j FD]... [-s FD] [-N FD -k KEY] [-t SECS] [-u ID] [-r PATH]...
 *                     [-w PATH]... [-c DIR] -- ARGV...
 *                                     (fncall) restrict itself, then as exec:
 *                                     join the cgroups whose cgroup.procs are
 *                                     open at FD, new PID namespace for the
 *                                     command, RLIMIT_CPU, uid/gid ID, Landlock (read -r,
 *                                     write -w, no TCP, scoped signals and
 *                                     abstract sockets), no_new_privs, the
 *                                     seccomp BPF program at FD.
 *                                     -N: the program notifies: the filter's
 *                                     listener descriptor is sent, with KEY
 *                                     (the sandbox's id), over the socket at
 *                                     FD to the node (runtime/isolation/denials.py) and
 *                                     closed here, before the command starts:
 *                                     no process of the call ever holds it.
 *                                     Done here, in C, so the worker can start
 *                                     calls with vfork (no Python in the child).
 *
 * -i puts the process under SCHED_IDLE (qos="best_effort"); children inherit it.
 * Exit status of exec: the command's status; 127 with a message on stderr when
 * the command cannot be started (not found, not executable); a command killed
 * by signal N is re-raised so the caller sees the same signal.
 *
 * Built statically by runtime/native.py (gcc -static), so images need no libc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>

struct ll_ruleset_attr { uint64_t fs, net, scoped; };
struct ll_path_beneath { uint64_t allowed; int32_t parent_fd; } __attribute__((packed));

static void idle_class(void) {
    struct sched_param p = {0};
    if (sched_setscheduler(0, SCHED_IDLE, &p) != 0)
        perror("sandbox-init: SCHED_IDLE");
}

static __attribute__((noreturn)) void serve(int lfd);

static __attribute__((noreturn)) void run_init(int lfd) {
    prctl(PR_SET_DUMPABLE, 0);  /* /proc/1 stays closed to the sandbox */
    if (lfd >= 0) serve(lfd);
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);
    for (;;) {
        siginfo_t si;
        int sig = sigwaitinfo(&all, &si);
        if (sig == SIGCHLD) {
            while (waitpid(-1, NULL, WNOHANG) > 0) {}
        }
    }
}

static int run_exec(int argc, char **argv, const char *cwd) {
    if (argc < 1) {
        fprintf(stderr, "sandbox-init: exec needs a command\n");
        return 127;
    }
    int report[2];
    if (pipe2(report, O_CLOEXEC) != 0) { perror("sandbox-init: pipe"); return 127; }
    sigset_t mask, old;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, &old);
    setsid();
    pid_t child = fork();
    if (child < 0) { perror("sandbox-init: fork"); return 127; }
    if (child == 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        close(report[0]);
        if (cwd && chdir(cwd) != 0) {
            int e = errno;
            fprintf(stderr, "sandbox-init: cannot enter working directory %s: %s\n", cwd, strerror(e));
            (void)!write(report[1], &e, sizeof e);
            _exit(127);
        }
        execvp(argv[0], argv);
        int e = errno;
        fprintf(stderr, "sandbox-init: cannot run %s: %s\n", argv[0],
                e == ENOENT ? "command not found" : strerror(e));
        (void)!write(report[1], &e, sizeof e);
        _exit(127);
    }
    close(report[1]);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC);
    struct pollfd fds[2] = {{.fd = sfd, .events = POLLIN}, {.fd = 1, .events = 0}};
    for (;;) {
        int n = poll(fds, 2, -1);
        if (n < 0 && errno == EINTR) continue;
        if (fds[1].revents & (POLLERR | POLLHUP)) {
            /* the reader of our stdout is gone: the agent died */
            kill(-getpid(), SIGKILL);
            _exit(137);
        }
        if (fds[0].revents & POLLIN) {
            struct signalfd_siginfo si;
            (void)!read(sfd, &si, sizeof si);
            int status;
            pid_t w = waitpid(child, &status, WNOHANG);
            if (w == child) {
                int e = 0;
                if (read(report[0], &e, sizeof e) == (ssize_t)sizeof e) return 127;
                if (WIFEXITED(status)) return WEXITSTATUS(status);
                int sig = WTERMSIG(status);
                signal(sig, SIG_DFL);
                sigprocmask(SIG_UNBLOCK, &mask, NULL);
                prctl(PR_SET_DUMPABLE, 0);
                kill(getpid(), sig);
                return 128 + sig;
            }
        }
    }
}


/* ---- the exec channel (containers) --------------------------------------
 *
 * The node connects to the socket init listens on (bound to a host path no
 * sandbox process can name; init is non-dumpable, so /proc/1/fd is closed to
 * the sandbox's root, which has no CAP_SYS_PTRACE) and sends one request per
 * connection: a header, a payload (cwd, argv, env as NUL-terminated strings)
 * and, as SCM_RIGHTS, the command's stdin, stdout and stderr. Init forks the
 * command and answers on that connection only: STARTED(id, pid), then
 * EXITED(id, wait status, errno of a failed exec) or FORK_FAILED(id, errno).
 * A reply cannot be misattributed (one request per connection, the id echoed)
 * nor forged (no sandbox process holds the connection).
 *
 * Every command gets a Landlock domain of its own before it execs. Landlock
 * lets a process ptrace (and open /proc/PID/fd, /proc/PID/mem, pidfd_getfd,
 * process_vm_writev) and signal only processes in its own domain or one
 * nested below it: a process left behind by one command cannot touch another
 * command's descriptors, memory or exit, whatever the sandbox's uid.
 *
 * When the node's end of a connection closes before the command ends (the
 * node died), init kills the command's session: nothing outlives its caller.
 *
 * A request with CTL_FLAG_LISTENER carries one descriptor instead: a new
 * listening socket that replaces init's (before a checkpoint the node moves
 * the channel to an abstract name in the sandbox's own network namespace,
 * which CRIU saves with the sandbox). Every connection is checked first:
 * only a peer outside the sandbox's PID namespace (pid 0 in SO_PEERCRED) is
 * served, since any sandbox process can connect to an abstract name.
 */
#define CTL_MAGIC 0x3158454cU           /* "LEX1" little-endian */
#define CTL_MAX_PAYLOAD (4u << 20)
#define CTL_MAX_CMDS 4096
enum { REPLY_STARTED = 'S', REPLY_EXITED = 'X', REPLY_FORK_FAILED = 'F', REPLY_BAD = 'B' };

struct ctl_request { uint32_t magic, length; uint64_t id; uint32_t flags, nargs; };
struct ctl_reply { uint32_t kind; int32_t value; uint64_t id; int32_t pid, err; };

struct cmd { pid_t pid; int conn; int report; uint64_t id; };
static struct cmd cmds[CTL_MAX_CMDS];
static int ncmds;
static int listen_fd = -1;   /* the exec channel's listening socket */
#define CTL_FLAG_LISTENER 2u  /* the request's one descriptor replaces listen_fd */
#define CTL_FLAG_RW 4u        /* one descriptor: it becomes CTL_RW_FD; none: /dev/null there */
#define CTL_RW_FD 3           /* the sandbox's rw/ the node gave init (never a command's) */

static void reply(int conn, uint32_t kind, uint64_t id, int32_t value, int32_t pid, int32_t err) {
    struct ctl_reply r = {kind, value, id, pid, err};
    if (conn >= 0) (void)!send(conn, &r, sizeof r, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static int read_full(int fd, char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

/* Landlock (ABI 7+) logs a domain's denials to the kernel's audit only
 * until its creator execs, unless asked: every domain here is made right
 * before an exec, so ask (LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON). The node
 * reads the records and makes each an event of the sandbox
 * (runtime/isolation/landlock_audit.py). */
static unsigned long restrict_flags(long abi) {
    return abi >= 7 ? 1UL << 1 : 0UL;
}

/* A fresh Landlock domain for one command: it restricts nothing on files
 * (the only access handled, creating block devices, needs CAP_MKNOD, which
 * sandboxes lack) but scopes ptrace-class access and, from ABI 6, signals to
 * the command's own process tree. */
static int own_domain(void) {
    long abi = syscall(444, NULL, 0, 1UL);
    if (abi <= 0) return -1;
    struct ll_ruleset_attr attr = {1ULL << 11, 0, 0};   /* LANDLOCK_ACCESS_FS_MAKE_BLOCK */
    size_t size = 8;
    if (abi >= 6) { attr.scoped = 2; size = 24; }     /* LANDLOCK_SCOPE_SIGNAL */
    int fd = (int)syscall(444, &attr, size, 0UL);
    if (fd < 0) return -1;
    int r = (int)syscall(446, fd, restrict_flags(abi));
    close(fd);
    return r;
}

/* CTL_RW_FD made /dev/null: the number stays taken (a connection accepted
 * later must not land there), and CRIU can save what it holds */
static int null_rw(void) {
    int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (nul < 0) return -1;
    int r = nul == CTL_RW_FD ? 0 : (dup3(nul, CTL_RW_FD, O_CLOEXEC) < 0 ? -1 : 0);
    if (nul != CTL_RW_FD) close(nul);
    return r;
}

static void start_command(int conn) {
    struct ctl_request rq;
    int fds[3] = {-1, -1, -1};
    char cbuf[CMSG_SPACE(sizeof fds)];
    struct iovec iov = {&rq, sizeof rq};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = sizeof cbuf};
    struct timeval tv = {5, 0};   /* the node writes a request at once */
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ssize_t n = recvmsg(conn, &mh, MSG_WAITALL | MSG_CMSG_CLOEXEC);
    int nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int j = 0; j < k; j++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + j * sizeof(int), sizeof fd);
                if (nfds < 3) fds[nfds++] = fd; else close(fd);
            }
        }
    }
    char *payload = NULL;
    uint64_t id = n == (ssize_t)sizeof rq ? rq.id : 0;
    if (n == (ssize_t)sizeof rq && rq.magic == CTL_MAGIC && (rq.flags & CTL_FLAG_RW)) {
        /* the node takes rw/ back for a checkpoint (CRIU cannot save a
         * descriptor of a mount outside the sandbox) and gives one again */
        if (nfds > 1 || rq.length != 0 || rq.nargs != 0 || listen_fd == CTL_RW_FD ||
            (nfds == 1 && fds[0] != CTL_RW_FD && dup3(fds[0], CTL_RW_FD, O_CLOEXEC) < 0) ||
            (nfds == 0 && null_rw() != 0)) {
            reply(conn, REPLY_BAD, id, 0, 0, EINVAL);
            goto fail;
        }
        if (nfds == 1 && fds[0] == CTL_RW_FD) nfds = 0;   /* it arrived in place: keep it */
        reply(conn, REPLY_STARTED, id, 0, 0, 0);
        goto fail;   /* not a failure: closes the descriptors and the connection */
    }
    if (n == (ssize_t)sizeof rq && rq.magic == CTL_MAGIC && (rq.flags & CTL_FLAG_LISTENER)) {
        /* the node moves the channel to another listening socket (before a
         * checkpoint: one in the sandbox's own network namespace, which CRIU
         * can save with the sandbox, under an abstract name) */
        int acc = 0, dom = 0;
        socklen_t sl = sizeof acc, dl = sizeof dom;
        if (nfds != 1 || rq.length != 0 || rq.nargs != 0 ||
            getsockopt(fds[0], SOL_SOCKET, SO_ACCEPTCONN, &acc, &sl) != 0 || !acc ||
            getsockopt(fds[0], SOL_SOCKET, SO_DOMAIN, &dom, &dl) != 0 || dom != AF_UNIX ||
            dup3(fds[0], listen_fd, O_CLOEXEC) < 0) {
            reply(conn, REPLY_BAD, id, 0, 0, EINVAL);
            goto fail;
        }
        fcntl(listen_fd, F_SETFL, O_NONBLOCK);
        reply(conn, REPLY_STARTED, id, 0, 0, 0);
        goto fail;   /* not a failure: closes the descriptors and the connection */
    }
    if (n != (ssize_t)sizeof rq || rq.magic != CTL_MAGIC || rq.length > CTL_MAX_PAYLOAD ||
        rq.nargs < 1 || nfds != 3 || ncmds >= CTL_MAX_CMDS ||
        !(payload = malloc(rq.length + 1)) || read_full(conn, payload, rq.length) != 0) {
        reply(conn, REPLY_BAD, id, 0, 0, EINVAL);
        goto fail;
    }
    payload[rq.length] = 0;
    /* cwd, nargs arguments, then environment entries up to the end */
    size_t nstr = 0;
    for (uint32_t k = 0; k < rq.length; k++) nstr += payload[k] == 0;
    if (rq.length == 0 || payload[rq.length - 1] != 0 || nstr < 1 + (size_t)rq.nargs) {
        reply(conn, REPLY_BAD, id, 0, 0, EINVAL);
        goto fail;
    }
    char **strs = calloc(nstr + 2, sizeof *strs);
    if (!strs) { reply(conn, REPLY_BAD, id, 0, 0, ENOMEM); goto fail; }
    char *q = payload;
    for (size_t k = 0; k < nstr; k++) { strs[k + (k > rq.nargs)] = q; q += strlen(q) + 1; }
    /* strs: [cwd, argv..., NULL, env..., NULL] */
    char *cwd = strs[0];
    char **argv = strs + 1, **envp = strs + 2 + rq.nargs;
    argv[rq.nargs] = NULL;
    int report[2];
    if (pipe2(report, O_CLOEXEC) != 0) {
        reply(conn, REPLY_FORK_FAILED, id, 0, 0, errno);
        free(strs);
        goto fail;
    }
    pid_t child = fork();
    if (child < 0) {
        reply(conn, REPLY_FORK_FAILED, id, 0, 0, errno);
        close(report[0]); close(report[1]);
        free(strs);
        goto fail;
    }
    if (child == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        setsid();
        int e = 0;
        if (own_domain() != 0) e = errno ? errno : EPERM;
        if (!e && (dup2(fds[0], 0) < 0 || dup2(fds[1], 1) < 0 || dup2(fds[2], 2) < 0)) e = errno;
        if (e) { (void)!write(report[1], &e, sizeof e); _exit(127); }
        if ((rq.flags & 1) != 0) idle_class();
        if (chdir(cwd) != 0) {
            e = errno;
            dprintf(2, "sandbox-init: cannot enter working directory %s: %s\n", cwd, strerror(e));
            (void)!write(report[1], &e, sizeof e);
            _exit(127);
        }
        /* nothing of init's (nor what runc left it) reaches the command */
        syscall(SYS_close_range, 3U, ~0U, 4U /* CLOSE_RANGE_CLOEXEC */);
        environ = envp;
        execvp(argv[0], argv);
        e = errno;
        dprintf(2, "sandbox-init: cannot run %s: %s\n", argv[0],
                e == ENOENT ? "command not found" : strerror(e));
        (void)!write(report[1], &e, sizeof e);
        _exit(127);
    }
    free(strs);
    free(payload);
    for (int k = 0; k < 3; k++) close(fds[k]);
    close(report[1]);
    fcntl(report[0], F_SETFL, O_NONBLOCK);
    cmds[ncmds++] = (struct cmd){child, conn, report[0], id};
    reply(conn, REPLY_STARTED, id, 0, child, 0);
    return;
fail:
    free(payload);
    for (int k = 0; k < nfds; k++) close(fds[k]);
    close(conn);
}

static void reap(void) {
    int status;
    pid_t w;
    while ((w = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int k = 0; k < ncmds; k++) {
            if (cmds[k].pid != w) continue;
            int e = 0;
            if (read(cmds[k].report, &e, sizeof e) != (ssize_t)sizeof e) e = 0;
            reply(cmds[k].conn, REPLY_EXITED, cmds[k].id, status, w, e);
            if (cmds[k].conn >= 0) close(cmds[k].conn);
            close(cmds[k].report);
            cmds[k] = cmds[--ncmds];
            break;
        }
    }
}

static __attribute__((noreturn)) void serve(int lfd) {
    /* the listening socket away from fd 0..2, which become /dev/null: no
     * process of the sandbox inherits a host file (runc's log) from init */
    int l = listen_fd = fcntl(lfd, F_DUPFD_CLOEXEC, 3);
    if (l < 0) _exit(1);
    if (lfd != l) close(lfd);
    int devnull = open("/dev/null", O_RDWR);
    for (int k = 0; k < 3; k++) if (devnull >= 0 && devnull != k) dup2(devnull, k);
    if (devnull > 2) close(devnull);
    fcntl(l, F_SETFL, O_NONBLOCK);
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    static struct pollfd pfds[CTL_MAX_CMDS + 2];
    for (;;) {
        pfds[0] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
        pfds[1] = (struct pollfd){.fd = sfd, .events = POLLIN};
        for (int k = 0; k < ncmds; k++)
            pfds[2 + k] = (struct pollfd){.fd = cmds[k].conn, .events = POLLIN};
        int n = poll(pfds, (nfds_t)(2 + ncmds), -1);
        if (n < 0) continue;
        if (pfds[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {}
            reap();
            continue;    /* cmds moved: poll again before looking at connections */
        }
        for (int k = 0; k < ncmds; k++) {
            if (cmds[k].conn < 0 || !(pfds[2 + k].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            char b[64];
            ssize_t r = recv(cmds[k].conn, b, sizeof b, MSG_DONTWAIT);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                /* the node went away while its command runs */
                kill(-cmds[k].pid, SIGKILL);
                close(cmds[k].conn);
                cmds[k].conn = -1;
            }
        }
        if (pfds[0].revents & POLLIN) {
            int c;
            while ((c = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC)) >= 0) {
                /* only a peer outside the sandbox's PID namespace (the node):
                 * its pid is 0 here. A sandbox process connecting to an
                 * abstract listener shows its own pid (even once it exited) */
                struct ucred uc;
                socklen_t ul = sizeof uc;
                if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &uc, &ul) != 0 || uc.pid != 0) {
                    close(c);
                    continue;
                }
                start_command(c);
            }
        }
    }
}

/* ---- fncall restrictions ---------------------------------------------- */

#define LL_READ ((1ULL << 0) | (1ULL << 2) | (1ULL << 3)) /* execute, read file, read dir */

static int die(const char *what) {
    fprintf(stderr, "sandbox-init: %s: %s\n", what, strerror(errno));
    _exit(127);
}

static void landlock(char **ro, int nro, char **rw, int nrw) {
    long abi = syscall(444, NULL, 0, 1UL);
    if (abi <= 0) die("landlock unavailable");
    static const int fs_bits[] = {0, 13, 14, 15, 15, 16};
    int bits = abi < 6 ? fs_bits[abi] : 16;
    struct ll_ruleset_attr attr = {(1ULL << bits) - 1, 0, 0};
    size_t size = 8;
    if (abi >= 4) { attr.net = 3; size = 16; }          /* bind + connect TCP */
    if (abi >= 6) { attr.scoped = 3; size = 24; }       /* abstract unix, signal */
    int fd = (int)syscall(444, &attr, size, 0UL);
    if (fd < 0) die("landlock ruleset");
    for (int k = 0; k < nro + nrw; k++) {
        const char *p = k < nro ? ro[k] : rw[k - nro];
        int pfd = open(p, O_PATH | O_CLOEXEC);
        if (pfd < 0) die(p);
        struct ll_path_beneath rule = {k < nro ? LL_READ : attr.fs, pfd};
        if (syscall(445, fd, 1, &rule, 0UL) != 0) die("landlock rule");
        close(pfd);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die("no_new_privs");
    if (syscall(446, fd, restrict_flags(abi)) != 0) die("landlock restrict");
    close(fd);
}

/* The listener of a notifying filter goes to the node, never further: if
 * the send fails (the node's end is gone), it is closed all the same and the
 * kernel answers every denied call ENOSYS: refused, not recorded. */
static void hand_listener(int sock, int listener, const char *key) {
    char cbuf[CMSG_SPACE(sizeof listener)];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {(void *)key, strlen(key)};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof listener);
    memcpy(CMSG_DATA(c), &listener, sizeof listener);
    if (sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        perror("sandbox-init: denials will not be recorded");
    close(listener);
    close(sock);
}

static void seccomp_from(int fd, int notify_sock, const char *key) {
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0 || st.st_size % sizeof(struct sock_filter))
        die("seccomp program");
    struct sock_filter *code = malloc(st.st_size);
    if (!code || pread(fd, code, st.st_size, 0) != st.st_size) die("seccomp program");
    struct sock_fprog prog = {(unsigned short)(st.st_size / sizeof(struct sock_filter)), code};
    if (notify_sock >= 0) {
        int listener = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                                    SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
        if (listener < 0) die("seccomp");
        hand_listener(notify_sock, listener, key ? key : "");
    } else if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0) die("seccomp");
    free(code);
    close(fd);
}

#define MAX_OPT 16

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: sandbox-init init [-i] [-l FD] | exec [-i] [-c DIR] -- ARGV... | "
                        "pdeathsig [-i] [-j FD]... [-n FD] -- ARGV...\n");
        return 2;
    }
    int i = 2;
    const char *cwd = NULL;
    int idle = 0, listen_fd = -1, netns_fd = -1, njoin = 0, nro = 0, nrw = 0, seccomp_fd = -1, uid = -1;
    int notify_fd = -1;
    const char *key = NULL;
    long cpu = -1;
    int join[MAX_OPT];
    char *ro[MAX_OPT], *rw[MAX_OPT];
    for (; i < argc; i++) {
        int more = i + 1 < argc;
        if (strcmp(argv[i], "-i") == 0) idle = 1;
        else if (strcmp(argv[i], "-c") == 0 && more) cwd = argv[++i];
        else if (strcmp(argv[i], "-l") == 0 && more) listen_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "-j") == 0 && more && njoin < MAX_OPT) join[njoin++] = atoi(argv[++i]);
        else if (strcmp(argv[i], "-n") == 0 && more) netns_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "-s") == 0 && more) seccomp_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "-N") == 0 && more) notify_fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "-k") == 0 && more) key = argv[++i];
        else if (strcmp(argv[i], "-t") == 0 && more) cpu = atol(argv[++i]);
        else if (strcmp(argv[i], "-u") == 0 && more) uid = atoi(argv[++i]);
        else if (strcmp(argv[i], "-r") == 0 && more && nro < MAX_OPT) ro[nro++] = argv[++i];
        else if (strcmp(argv[i], "-w") == 0 && more && nrw < MAX_OPT) rw[nrw++] = argv[++i];
        else if (strcmp(argv[i], "--") == 0) { i++; break; }
        else break;
    }
    if (idle) idle_class();
    if (strcmp(argv[1], "call") == 0) {
        for (int k = 0; k < njoin; k++)
            if (write(join[k], "0", 1) != 1) die("joining the call's cgroup");
        if (unshare(CLONE_NEWPID) != 0) die("new PID namespace");
        struct rlimit zero = {0, 0};
        setrlimit(RLIMIT_CORE, &zero);
        if (cpu > 0) {
            struct rlimit c = {(rlim_t)cpu, (rlim_t)cpu};
            setrlimit(RLIMIT_CPU, &c);
        }
        /* the uid first: the Landlock domain's creator, named in its audit
         * records, is then the sandbox's uid (the node maps records to
         * sandboxes by it); the process turns non-dumpable with the change */
        if (uid >= 0) {
            if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0) die("uid");
        }
        landlock(ro, nro, rw, nrw);
        if (seccomp_fd >= 0) seccomp_from(seccomp_fd, notify_fd, key);
        else if (notify_fd >= 0) close(notify_fd);
        for (int k = 0; k < njoin; k++) close(join[k]);
        return run_exec(argc - i, argv + i, cwd);
    }
    if (strcmp(argv[1], "init") == 0) run_init(listen_fd);
    if (strcmp(argv[1], "exec") == 0) return run_exec(argc - i, argv + i, cwd);
    if (strcmp(argv[1], "pdeathsig") == 0 && i < argc) {
        for (int k = 0; k < njoin; k++)
            if (write(join[k], "0", 1) != 1) die("joining the sandbox's cgroup");
        if (netns_fd >= 0) {
            if (setns(netns_fd, CLONE_NEWNET) != 0) die("entering the sandbox's network namespace");
            close(netns_fd);
        }
        pid_t parent = getppid();
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) return 137;  /* the parent died before prctl */
        execvp(argv[i], argv + i);
        fprintf(stderr, "sandbox-init: cannot run %s: %s\n", argv[i], strerror(errno));
        return 127;
    }
    fprintf(stderr, "sandbox-init: unknown mode %s\n", argv[1]);
    return 2;
}
