/* sandbox-init: the only program of ours inside a container sandbox.
 *
 *   sandbox-init init [-i]            PID 1 of the sandbox: reaps orphans, sleeps
 *                                     (a few KiB of memory). No signal from
 *                                     inside ends it (the sandbox cannot stop
 *                                     itself behind the node's back); the node
 *                                     ends it with SIGKILL from outside.
 *   sandbox-init exec [-i] [-c DIR] -- ARGV...
 *                                     runs one command in its own session and
 *                                     waits for it; when the agent that reads the
 *                                     command's stdout goes away (the pipe's read
 *                                     end closes), kills the command's session so
 *                                     nothing outlives a dead agent.
 *
 *   sandbox-init pdeathsig -- ARGV... (on the host) runs ARGV so that it gets
 *                                     SIGKILL when the calling thread's process
 *                                     dies: the node's `runc exec` goes with the
 *                                     node agent, and the command then sees its
 *                                     output reader gone.
 *
 *   sandbox-init call [-j FD]... [-s FD] [-t SECS] [-u ID] [-r PATH]... [-w PATH]...
 *                     [-c DIR] -- ARGV...
 *                                     (fncall) restrict itself, then as exec:
 *                                     join the cgroups whose cgroup.procs are
 *                                     open at FD, new PID namespace for the
 *                                     command, RLIMIT_CPU, Landlock (read -r,
 *                                     write -w, no TCP, scoped signals and
 *                                     abstract sockets), no_new_privs, the
 *                                     seccomp BPF program at FD, uid/gid ID.
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
#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>

static void idle_class(void) {
    struct sched_param p = {0};
    if (sched_setscheduler(0, SCHED_IDLE, &p) != 0)
        perror("sandbox-init: SCHED_IDLE");
}

static __attribute__((noreturn)) void run_init(void) {
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

/* ---- fncall restrictions ---------------------------------------------- */

struct ll_ruleset_attr { uint64_t fs, net, scoped; };
struct ll_path_beneath { uint64_t allowed; int32_t parent_fd; } __attribute__((packed));
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
    if (syscall(446, fd, 0UL) != 0) die("landlock restrict");
    close(fd);
}

static void seccomp_from(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0 || st.st_size % sizeof(struct sock_filter))
        die("seccomp program");
    struct sock_filter *code = malloc(st.st_size);
    if (!code || pread(fd, code, st.st_size, 0) != st.st_size) die("seccomp program");
    struct sock_fprog prog = {(unsigned short)(st.st_size / sizeof(struct sock_filter)), code};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0) die("seccomp");
    free(code);
    close(fd);
}

#define MAX_OPT 16

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: sandbox-init init [-i] | exec [-i] [-c DIR] -- ARGV... | "
                        "pdeathsig -- ARGV...\n");
        return 2;
    }
    int i = 2;
    const char *cwd = NULL;
    int idle = 0, njoin = 0, nro = 0, nrw = 0, seccomp_fd = -1, uid = -1;
    long cpu = -1;
    int join[MAX_OPT];
    char *ro[MAX_OPT], *rw[MAX_OPT];
    for (; i < argc; i++) {
        int more = i + 1 < argc;
        if (strcmp(argv[i], "-i") == 0) idle = 1;
        else if (strcmp(argv[i], "-c") == 0 && more) cwd = argv[++i];
        else if (strcmp(argv[i], "-j") == 0 && more && njoin < MAX_OPT) join[njoin++] = atoi(argv[++i]);
        else if (strcmp(argv[i], "-s") == 0 && more) seccomp_fd = atoi(argv[++i]);
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
        landlock(ro, nro, rw, nrw);
        if (seccomp_fd >= 0) seccomp_from(seccomp_fd);
        if (uid >= 0) {
            if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0) die("uid");
        }
        for (int k = 0; k < njoin; k++) close(join[k]);
        return run_exec(argc - i, argv + i, cwd);
    }
    if (strcmp(argv[1], "init") == 0) run_init();
    if (strcmp(argv[1], "exec") == 0) return run_exec(argc - i, argv + i, cwd);
    if (strcmp(argv[1], "pdeathsig") == 0 && i < argc) {
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
