"""Deciding whether a test can run here, and small helpers shared by tests:
marks, waiting on something observable (wait_until; tests never sleep to let
something happen), processes by command line, subprocess workers.

Tests that need root (mounts) are marked `root` and skip elsewhere with the
reason; in CI they run (CI is root). The servers tests start are in
process.py (the base) and its subclasses."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, TypeVar

import pytest

IS_ROOT = os.geteuid() == 0
F = TypeVar("F", bound=Any)
T = TypeVar("T")

POLL = 0.05  # seconds between two looks at what wait_until waits for

needs_root = [pytest.mark.root,
              pytest.mark.skipif(not IS_ROOT, reason="needs root to mount filesystems")]


def root_only(fn: F) -> F:
    """Mark a test `root` and skip it, with the reason, when not root."""
    for mark in needs_root:
        fn = mark(fn)
    return fn


def pack_path(store_root: Path, pack: int) -> Path:
    return store_root / "packs" / f"{pack:016x}.pack"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def in_page_cache(path: Path) -> bool:
    """Whether every page of a file is in the page cache now: mincore(2) on
    a mapping of it (mapping reads nothing in, and on overlayfs it maps the
    lower file's own pages)."""
    size = path.stat().st_size
    if size == 0:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return all(b & 1 for b in vec)


@contextmanager
def mounted(*mount_args: str, target: Path) -> Iterator[Path]:
    """Mount for the duration of the block; lazy-unmount as a last resort."""
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *mount_args, str(target)], check=True)
    try:
        yield target
    finally:
        if subprocess.run(["umount", str(target)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], check=False)


REPO = Path(__file__).resolve().parents[2]


def start_worker(*args: str) -> subprocess.Popen[str]:
    """`python -m tests.helpers.workers ARGS` from the repository root (so the
    worker imports this checkout's packages, as the test does)."""
    import sys
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.workers", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (a server binds it a moment later)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def terminate(proc: subprocess.Popen[Any] | None, grace: float) -> None:
    """Stop a server the tests started: SIGTERM, then SIGKILL after `grace`
    seconds; reaped either way. Idempotent."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL a server the tests start when the
    thread that forked it dies, so a killed test run leaves no daemon behind
    (dockerd passes the same to its containerd). Resolved before fork: the
    child makes one syscall. Start servers from a long-lived thread (pytest's
    main thread is)."""
    import ctypes
    import signal
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)

    return preexec


def processes_with(tag: str) -> list[int]:
    """Host pids whose command line contains `tag` (a unique string a test
    put in a command, to check that it no longer runs anywhere)."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and tag.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            pass
    return out


def gone(tag: str, wait: float = 5.0) -> bool:
    """True once no process with `tag` in its command line is left (False if
    one still runs after `wait` seconds)."""
    try:
        wait_until(lambda: not processes_with(tag), wait, f"no process with {tag!r}")
    except WaitTimeout:
        return False
    return True


class WaitTimeout(AssertionError):
    """What wait_until waited for did not happen in time (an assertion: the
    test fails, naming what it waited for)."""


def wait_until(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Poll `predicate` until it returns something true and return that; after
    `timeout` seconds raise WaitTimeout naming `what` and the last value. The
    predicate is always called at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        last_look = time.monotonic() >= deadline
        value = predicate()
        if value:
            return value
        if last_look:
            raise WaitTimeout(f"{what}: not after {timeout:g} s (last: {value!r})")
        time.sleep(min(POLL, max(0.0, deadline - time.monotonic())))


def tcp_listening(pid: int, port: int) -> bool:
    """Does a TCP socket listen on `port` in the network namespace of `pid`?
    (/proc/PID/net/tcp{,6}: local address as hex, state 0A = LISTEN)."""
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


class Hello(BaseHTTPRequestHandler):
    """An HTTP server's handler answering every GET with "mirror says hi"
    (a destination sandboxes are allowed or refused)."""

    def do_GET(self) -> None:  # (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"mirror says hi")

    def log_message(self, *args: object) -> None:
        pass
