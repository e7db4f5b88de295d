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
#include <sys/prctl.h>
#include <sys/signalfd.h>
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

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: sandbox-init init [-i] | exec [-i] [-c DIR] -- ARGV... | "
                        "pdeathsig -- ARGV...\n");
        return 2;
    }
    int i = 2;
    const char *cwd = NULL;
    int idle = 0;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "-i") == 0) idle = 1;
        else if (strcmp(argv[i], "-c") == 0 && i + 1 < argc) cwd = argv[++i];
        else if (strcmp(argv[i], "--") == 0) { i++; break; }
        else break;
    }
    if (idle) idle_class();
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
