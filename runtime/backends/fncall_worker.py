"""One pre-forked fncall worker: `python -m runtime.backends.fncall_worker`.

Set up once, as root, before the first call: a private mount namespace and an
empty network namespace (no interface is up: no network), chroot into the
image's read-only root. Then, per call (msgpack frames on stdin, answers on
stdout; never pickle: the node and the worker trust each other, the output
does not):

    /tmp: the worker's size-limited tmpfs, empty at the start of every call
    fork → new PID namespace → rlimits → Landlock (read-only image, writable
    /tmp, no TCP) → no_new_privs → seccomp → uid/gid nobody → sandbox-init
    exec → the command (PID 1 of its namespace: when it ends, everything it
    started dies with it)

Frames: request {cmd, cwd, env, stdin, timeout, max_output}; answers
{"o": bytes} / {"e": bytes} while it runs, then {"x": exit_code, "d":
duration, "t": truncated, "to": timed_out}.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
from typing import Any

import msgpack

from runtime import landlock, procio, seccomp

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x40000000, 0x20000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 0x4000, 1 << 18, 2, 4
NOBODY = 65534
_libc = ctypes.CDLL(None, use_errno=True)


def _sys(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _sys(_libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                     data.encode() if data else None), f"mount {target}")


def setup(root: str, scratch_mb: int) -> None:
    _sys(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare")
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    os.chroot(root)
    os.chdir("/")
    # one scratch tmpfs for the worker's life, emptied after every call
    # (a mount + unmount per call cost ~3 ms)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=1777")


def wipe_scratch() -> None:
    """Empty /tmp. The call's processes are gone (its PID namespace ended
    with it), so nothing writes there any more; rmtree works on descriptors
    and does not follow the links a call may have planted."""
    with os.scandir("/tmp") as entries:
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)


class Call:
    def __init__(self, req: dict[str, Any], init_fd: int, scratch_mb: int, syscalls: Any
                 ) -> None:
        self.req = req
        self.syscalls = syscalls
        self.init_fd = init_fd
        self.scratch_mb = scratch_mb
        self.argv: list[str] = []
        self.env: dict[str, str] = {}

    def child_setup(self) -> None:
        # In the forked child, after Popen set up its pipes: restrict, then
        # execute sandbox-init from its descriptor (it is not in the image).
        # A failure is written to the call's stderr (Popen's own message
        # would not say which step failed).
        try:
            self._restrict_and_exec()
        except BaseException as e:  # noqa: BLE001 - reported, then the child exits
            os.write(2, f"fncall: cannot start the call: {e}\n".encode())
            os._exit(127)

    def _restrict_and_exec(self) -> None:
        _sys(_libc.unshare(CLONE_NEWPID), "unshare pid")
        mb = self.scratch_mb
        resource.setrlimit(resource.RLIMIT_NPROC, (256, 256))
        resource.setrlimit(resource.RLIMIT_FSIZE, (mb << 20, mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        cpu = int(self.req["timeout"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        landlock.restrict(["/"], ["/tmp"], executable_fds=[self.init_fd])
        self.syscalls.load()
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        os.execve(self.init_fd, self.argv, self.env)

    def run(self, out: Any) -> None:
        self.env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp",
                    "TMPDIR": "/tmp", **self.req["env"]}
        self.argv = ["sandbox-init", "exec", "-c", self.req.get("cwd") or "/tmp", "--",
                     *self.req["cmd"]]
        proc = subprocess.Popen(
            ["/"], cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=self.child_setup)  # noqa: PLW1509 - the worker has one thread

        def stop() -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        res = procio.run(proc, stdin=self.req["stdin"], timeout=self.req["timeout"],
                         max_output=self.req["max_output"], stop=stop,
                         on_stdout=lambda b: out({"o": b}), on_stderr=lambda b: out({"e": b}))
        out({"x": res.returncode, "d": res.duration, "t": res.truncated,
             "to": res.timed_out})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--scratch-mb", type=int, default=64)
    args = ap.parse_args()
    init_fd = os.open(args.init, os.O_RDONLY)  # exec'd by fd: not in the image's tree
    syscalls = seccomp.Compiled()  # uses libseccomp before the chroot hides it
    setup(args.root, args.scratch_mb)
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
                Call(req, init_fd, args.scratch_mb, syscalls).run(out)
            except Exception as e:  # noqa: BLE001 - one bad call must not end the worker
                out({"x": 127, "d": 0.0, "t": False, "to": False, "err": str(e)})
            try:
                wipe_scratch()
            except OSError as e:  # never hand a dirty /tmp to the next call
                sys.stderr.write(f"fncall worker: cannot empty /tmp ({e}); exiting\n")
                sys.exit(3)


if __name__ == "__main__":
    main()
