"""One pre-forked fncall worker: `python -m runtime.backends.fncall_worker`.

Set up once, as root, before the first call: the worker's own cgroup (memory,
pids, freezer, cpu; opened before the chroot hides /sys), a private mount
namespace and an empty network namespace (no interface is up: no network),
chroot into the image's read-only root, one size-limited tmpfs on /tmp. Then,
per call (msgpack frames on stdin, answers on stdout; never pickle: the node
and the worker trust each other, the output does not):

    limits of the calling sandbox written to the worker's cgroup
    vfork + exec of `sandbox-init call` (a copy in a root-owned /tmp/.lazyfs),
    which joins the cgroup → new PID namespace → rlimits → the sandbox's uid
    → Landlock (read-only image, writable /tmp, no TCP; its refusals logged
    to the kernel's audit, runtime/isolation/landlock_audit.py) → no_new_privs →
    seccomp (with --notify-fd: a notifying filter whose listener
    sandbox-init sends, with the sandbox's id, over that socket to the node,
    runtime/isolation/denials.py) → the command (PID 1 of its namespace); in C, so no Python runs in the
    child and the fork is a vfork
    after it: every process left in the cgroup (a setsid'd child escapes any
    process group, never the cgroup) is killed; /tmp is emptied; a worker that
    cannot get back to an empty cgroup and an empty /tmp exits (the pool
    replaces it) rather than serve the next call dirty.

Frames: request {cmd, cwd, env, stdin, timeout, max_output, memory, pids,
cpu, uid, sandbox}; answers {"o": bytes} / {"e": bytes} while it runs, then
{"x": exit_code, "d": duration, "t": truncated, "to": timed_out, "oom": bool,
"pf": forks refused at the pids limit}.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from typing import Any

import msgpack

from runtime.backends import procio
from runtime.isolation import seccomp

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x40000000, 0x20000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 0x4000, 1 << 18, 2, 4
MNT_DETACH = 2
NOBODY = 65534
CONTROLLERS = ("memory", "pids", "freezer", "cpu")
CPU_PERIOD = 100_000
_libc = ctypes.CDLL(None, use_errno=True)


class Retire(Exception):
    """The worker cannot return to a clean state; it must exit."""


def _sys(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _sys(_libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                     data.encode() if data else None), f"mount {target}")


class Cgroup:
    """The worker's cgroup v1 directories, through descriptors opened before
    the chroot."""

    def __init__(self, root: str, name: str) -> None:
        def op(controller: str, file: str, flags: int) -> int:
            return os.open(f"{root}/{controller}/{name}/{file}", flags | os.O_CLOEXEC)

        self.join_fds = [op(c, "cgroup.procs", os.O_WRONLY) for c in CONTROLLERS]
        # cgroup v1 caches a pid list per open file: open the list anew for
        # every read, relative to the directory (the chroot hides its path)
        self.pids_dir = os.open(f"{root}/pids/{name}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.freezer = op("freezer", "freezer.state", os.O_RDWR)
        self.mem_limit = op("memory", "memory.limit_in_bytes", os.O_WRONLY)
        self.oom = op("memory", "memory.oom_control", os.O_RDONLY)
        self.pids_max = op("pids", "pids.max", os.O_WRONLY)
        self.quota = op("cpu", "cpu.cfs_quota_us", os.O_WRONLY)
        # the host's /proc, to tell zombies (dead, waiting for a slow reaper,
        # still listed in cgroup v1) from the living after the chroot
        self.proc_dir = os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    @staticmethod
    def _read(fd: int) -> str:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 1 << 20).decode()

    def members(self) -> list[int]:
        """Living processes of the cgroup."""
        out = []
        fd = os.open("cgroup.procs", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.pids_dir)
        try:
            listed = os.read(fd, 1 << 20).split()
        finally:
            os.close(fd)
        for pid in listed:
            try:
                fd = os.open(f"{pid.decode()}/stat", os.O_RDONLY | os.O_CLOEXEC,
                             dir_fd=self.proc_dir)
            except FileNotFoundError:
                continue
            try:
                state = os.read(fd, 4096).rsplit(b")", 1)[1].split()[0]
            finally:
                os.close(fd)
            if state not in (b"Z", b"X"):
                out.append(int(pid))
        return out

    def fork_refusals(self) -> int:
        fd = os.open("pids.events", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.pids_dir)
        try:
            text = os.read(fd, 4096).decode()
        finally:
            os.close(fd)
        for line in text.splitlines():
            if line.startswith("max "):
                return int(line.split()[1])
        return 0

    def oom_kills(self) -> int:
        for line in self._read(self.oom).splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def limit(self, memory: int, pids: int, cpu: float) -> None:
        os.write(self.mem_limit, str(memory).encode())
        os.write(self.pids_max, str(pids).encode())
        os.write(self.quota, str(max(1000, int(cpu * CPU_PERIOD))).encode())

    def join(self) -> None:  # in the forked child, still root
        for fd in self.join_fds:
            os.write(fd, b"0")

    def kill_all(self, wait: float = 5.0) -> bool:
        """Kill every member (frozen first, so nothing forks meanwhile);
        True once the cgroup is empty."""
        deadline = time.monotonic() + wait
        while self.members():
            os.write(self.freezer, b"FROZEN")
            for pid in self.members():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.write(self.freezer, b"THAWED")
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


INIT_DIR = "/tmp/.lazyfs"  # root-owned in the sticky /tmp: calls cannot touch it
INIT = f"{INIT_DIR}/sandbox-init"
SHALLOW = 32  # deeper leftovers: a new tmpfs instead of removing them one by one


def setup(root: str, scratch_mb: int, init_binary: bytes) -> None:
    # Without /proc (hidden by the chroot) a child closes descriptors one by
    # one up to this limit before exec: a high limit cost ~5 ms per call.
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    _sys(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare")
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    os.chroot(root)
    os.chdir("/")
    # one scratch tmpfs for the worker's life, emptied after every call
    # (a mount + unmount per call cost ~3 ms)
    fresh_scratch(scratch_mb, init_binary)


def fresh_scratch(scratch_mb: int, init_binary: bytes) -> None:
    """A new, empty /tmp holding only the launcher."""
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=1777")
    os.mkdir(INIT_DIR, 0o755)
    fd = os.open(INIT, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o555)
    os.write(fd, init_binary)
    os.close(fd)


def wipe_scratch(scratch_mb: int, init_binary: bytes) -> None:
    """Empty /tmp once the call's processes are all gone.

    A call may leave any tree (thousands of levels deep, names that make
    paths longer than PATH_MAX, directories without permissions): removing
    it entry by entry can fail in ways no list of exceptions covers. Shallow
    leftovers, the common case, are removed in place (~0.1 ms); anything
    else swaps the whole tmpfs for a new one (~3 ms): the detached old one
    is freed by the kernel, as no process of the call is left to hold it."""
    try:
        with os.scandir("/tmp") as entries:
            for e in entries:
                if e.path == INIT_DIR:
                    continue
                if e.is_dir(follow_symlinks=False):
                    _rmdir_shallow(e.path)
                else:
                    os.unlink(e.path)
        return
    except (OSError, _TooDeep):
        pass
    _sys(_libc.umount2(b"/tmp", MNT_DETACH), "umount /tmp")
    fresh_scratch(scratch_mb, init_binary)


class _TooDeep(Exception):
    pass


def _rmdir_shallow(path: str, depth: int = 0) -> None:
    """Remove a tree at most SHALLOW levels deep, never following links."""
    if depth > SHALLOW:
        raise _TooDeep(path)
    with os.scandir(path) as entries:
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                _rmdir_shallow(e.path, depth + 1)
            else:
                os.unlink(e.path)
    os.rmdir(path)


class Call:
    def __init__(self, req: dict[str, Any], cgroup: Cgroup, seccomp_fd: int,
                 notify_fd: int | None) -> None:
        self.req = req
        self.cgroup = cgroup
        self.seccomp_fd = seccomp_fd
        self.notify_fd = notify_fd

    def _stop(self) -> None:
        self.cgroup.kill_all()

    def run(self, out: Any) -> None:
        self.cgroup.limit(self.req["memory"], self.req["pids"], self.req["cpu"])
        ooms, forks = self.cgroup.oom_kills(), self.cgroup.fork_refusals()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
               **self.req["env"]}
        joins = [a for fd in self.cgroup.join_fds for a in ("-j", str(fd))]
        notify = ([] if self.notify_fd is None or not self.req.get("sandbox") else
                  ["-N", str(self.notify_fd), "-k", str(self.req["sandbox"])])
        argv = [INIT, "call", *joins, "-s", str(self.seccomp_fd), *notify,
                "-t", str(int(self.req["timeout"]) + 1), "-u", str(self.req.get("uid", NOBODY)),
                "-r", "/", "-w", "/tmp", "-c", self.req.get("cwd") or "/tmp", "--",
                *self.req["cmd"]]
        proc = subprocess.Popen(argv, env=env, cwd="/", stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(*self.cgroup.join_fds, self.seccomp_fd,
                                          *([self.notify_fd] if self.notify_fd is not None
                                            and notify else [])))
        res = procio.run(proc, stdin=self.req["stdin"], timeout=self.req["timeout"],
                         max_output=self.req["max_output"], stop=self._stop,
                         on_stdout=lambda b: out({"o": b}), on_stderr=lambda b: out({"e": b}))
        code = res.returncode if res.returncode >= 0 else 128 - res.returncode  # as shells show
        out({"x": code, "d": res.duration, "t": res.truncated,
             "to": res.timed_out, "oom": self.cgroup.oom_kills() > ooms,
             "pf": self.cgroup.fork_refusals() - forks})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--cgroup", required=True, help="cgroup name under each controller")
    ap.add_argument("--cgroup-root", default="/sys/fs/cgroup")
    ap.add_argument("--scratch-mb", type=int, default=64)
    ap.add_argument("--notify-fd", type=int, default=None,
                    help="a socket to the node's seccomp listener (denials become events)")
    args = ap.parse_args()
    with open(args.init, "rb") as f:  # copied into the worker's /tmp after the chroot
        init_binary = f.read()
    cgroup = Cgroup(args.cgroup_root, args.cgroup)
    seccomp_fd = os.memfd_create("lazyfs-seccomp", os.MFD_CLOEXEC)
    # libseccomp, before the chroot hides it
    os.write(seccomp_fd, seccomp.Compiled(notify=args.notify_fd is not None).code)
    setup(args.root, args.scratch_mb, init_binary)
    rx, tx = sys.stdin.buffer, sys.stdout.buffer
    packer = msgpack.Packer()

    def out(msg: dict[str, Any]) -> None:
        tx.write(packer.pack(msg))
        tx.flush()

    out({"ready": os.getpid()})
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64 << 20)
    while True:
        data = os.read(rx.fileno(), 1 << 16)
        if not data:
            return
        unpacker.feed(data)
        for req in unpacker:
            try:
                Call(req, cgroup, seccomp_fd, args.notify_fd).run(out)
            except Exception as e:  # noqa: BLE001 - one bad call must not end the worker
                out({"x": 127, "d": 0.0, "t": False, "to": False, "oom": False, "err": str(e)})
            try:  # never hand a dirty cgroup or /tmp to the next call
                if not cgroup.kill_all():
                    raise Retire("processes of the last call would not die")
                wipe_scratch(args.scratch_mb, init_binary)
            except Exception as e:  # noqa: BLE001 - whatever it is, this worker is done
                sys.stderr.write(f"fncall worker: cannot get back to a clean state ({e!r}); "
                                 "exiting\n")
                sys.exit(3)
            out({"clean": True})  # the node hands this worker out again only after this


if __name__ == "__main__":
    main()
