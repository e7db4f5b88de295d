/* hog: a hostile program that takes as much of a kernel table as the kernel
 * lets it (tests/test_sandbox_limits.py copies a static build into a sandbox).
 *
 *   hog files|inotify|watches|denied|signal PROCS
 *   hog calls
 *
 * forks PROCS children; each takes open files (open /dev/null), inotify
 * instances (inotify_init1) or inotify watches (one instance, a watch on each
 * of a growing set of new files under /tmp/hog-w) until the kernel refuses,
 * and reports "N ERRNO" on one line; denied: each calls mount(2) (denied by
 * the sandbox's seccomp policy) in a loop for DENIED_S seconds and reports how
 * many calls came back. Once all have reported, the parent prints
 * "total N" and the children keep what they took until the sandbox goes.
 * calls: one each of mount, unshare, bpf, keyctl (all denied by the seccomp
 * policy), a line "NAME ERRNO" per call, "fds N" (descriptors open beyond
 * stdin, stdout and stderr), then "alive". */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/mount.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define DENIED_S 3

static long take(const char *what, int child, int *err) {
    long n = 0;
    if (!strcmp(what, "files")) {
        while (open("/dev/null", O_RDONLY) >= 0) n++;
    } else if (!strcmp(what, "inotify")) {
        while (inotify_init1(IN_CLOEXEC) >= 0) n++;
    } else if (!strcmp(what, "watches")) {
        int fd = inotify_init1(IN_CLOEXEC);
        if (fd < 0) { *err = errno; return 0; }
        char dir[64], path[96];
        snprintf(dir, sizeof dir, "/tmp/hog-w%d", child);
        mkdir(dir, 0700);
        for (;;) {
            snprintf(path, sizeof path, "%s/%ld", dir, n);
            int f = open(path, O_CREAT | O_WRONLY, 0600);
            if (f < 0) break;
            close(f);
            if (inotify_add_watch(fd, path, IN_MODIFY) < 0) break;
            n++;
        }
    } else if (!strcmp(what, "denied")) {
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do {
            if (mount("x", "/mnt", "tmpfs", 0, NULL) == 0) { *err = 0; return n; }
            n++;
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while (t.tv_sec - t0.tv_sec < DENIED_S);
    } else if (!strcmp(what, "signal")) {
        /* kill(1, 0): PID 1 (the sandbox's init) is outside the command's
         * Landlock domain, so each is a refused signal and an audit record */
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do {
            if (kill(1, 0) == 0) { *err = 0; return n; }
            n++;
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while (t.tv_sec - t0.tv_sec < DENIED_S);
    } else {
        *err = EINVAL;
        return -1;
    }
    *err = errno;
    return n;
}

static int calls(void) {
    long r;
    r = mount("x", "/mnt", "tmpfs", 0, NULL);
    printf("mount %d\n", r ? errno : 0);
    r = unshare(CLONE_NEWNS);
    printf("unshare %d\n", r ? errno : 0);
    char attr[128] = {0};
    unsigned int *a = (unsigned int *)attr;
    a[0] = 2; a[1] = 4; a[2] = 4; a[3] = 1;   /* BPF_MAP_TYPE_ARRAY, key 4, value 4, 1 entry */
    r = syscall(SYS_bpf, 0 /* BPF_MAP_CREATE */, attr, sizeof attr);
    printf("bpf %d\n", r < 0 ? errno : 0);
    r = syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3 /* session */, 0);
    printf("keyctl %d\n", r < 0 ? errno : 0);
    int open_fds = 0;   /* beyond stdio: the seccomp listener must not be among them */
    for (int fd = 3; fd < 1024; fd++) open_fds += fcntl(fd, F_GETFD) >= 0;
    printf("fds %d\n", open_fds);
    printf("alive\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "calls")) return calls();
    if (argc != 3) { fprintf(stderr, "usage: hog files|inotify|watches|denied|signal PROCS\n"); return 2; }
    int procs = atoi(argv[2]);
    int report[2];
    if (pipe(report) != 0) return 1;
    for (int k = 0; k < procs; k++) {
        pid_t pid = fork();
        if (pid < 0) break;
        if (pid == 0) {
            close(report[0]);
            int err = 0;
            long n = take(argv[1], k, &err);
            char line[64];
            int len = snprintf(line, sizeof line, "%ld %d\n", n, err);
            (void)!write(report[1], line, len);
            close(report[1]);
            for (;;) pause();
        }
    }
    close(report[1]);
    FILE *in = fdopen(report[0], "r");
    long total = 0, n;
    int err;
    while (in && fscanf(in, "%ld %d", &n, &err) == 2) {
        printf("%ld %d\n", n, err);
        total += n;
    }
    printf("total %ld\n", total);
    fflush(stdout);
    return 0;
}
