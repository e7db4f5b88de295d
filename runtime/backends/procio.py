"""Running one command with its output captured under a cap, its stdin fed,
streamed to callbacks, and a deadline: the part of exec that is the same for
every backend that talks to the command through pipes.

The caller supplies `stop()`, which kills the command's whole process tree the
backend's way (freeze + kill for containers, a process group for fncall).
"""

from __future__ import annotations

import heapq
import itertools
import os
import select
import selectors
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

Sink = Callable[[bytes], None]
T = TypeVar("T", bound="int | HasFileno")


class HasFileno(Protocol):
    def fileno(self) -> int: ...


def ready(read: Sequence[T], write: Sequence[T] = (), timeout: float | None = None
          ) -> tuple[list[T], list[T]]:
    """select(2)'s answer without its limit: the node holds a descriptor or
    more per sandbox, and select() refuses any numbered 1024 or above
    (FD_SETSIZE), so this polls. Which of `read` are readable (or hung up)
    and which of `write` writable within `timeout` seconds (None: wait)."""
    poll = select.poll()
    fds: dict[int, tuple[T | None, T | None]] = {}
    for obj in read:
        fd = obj if isinstance(obj, int) else obj.fileno()
        fds[fd] = (obj, fds.get(fd, (None, None))[1])
    for obj in write:
        fd = obj if isinstance(obj, int) else obj.fileno()
        fds[fd] = (fds.get(fd, (None, None))[0], obj)
    for fd, (r, w) in fds.items():
        poll.register(fd, (select.POLLIN if r is not None else 0) |
                      (select.POLLOUT if w is not None else 0))
    events = poll.poll(None if timeout is None else max(0.0, timeout) * 1000)
    readable: list[T] = []
    writable: list[T] = []
    for fd, ev in events:
        r, w = fds[fd]
        if r is not None and ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
            readable.append(r)
        if w is not None and ev & (select.POLLOUT | select.POLLHUP | select.POLLERR):
            writable.append(w)
    return readable, writable


class Pipe(Protocol):
    def fileno(self) -> int: ...
    def close(self) -> None: ...


class Process(Protocol):
    """What run() drives: a subprocess.Popen with three pipes, or anything
    shaped like its pipes, wait and kill (the container's exec channel)."""

    @property
    def stdin(self) -> Pipe | None: ...
    @property
    def stdout(self) -> Pipe | None: ...
    @property
    def stderr(self) -> Pipe | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...
READ_SIZE = 65536


class _Deadlines:
    """Calls due at a time, watched by one thread for the whole process (a
    threading.Timer per exec started a thread per command: a tenth of a
    millisecond of a short exec). A call that comes due runs in a thread of
    its own: a stop that blocks holds up no other deadline."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Callable[[], None]] = {}
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def at(self, when: float, fn: Callable[[], None]) -> int:
        """Call `fn` once at time.monotonic() `when` unless cancel() comes
        first; the handle for cancel()."""
        with self._cv:
            key = next(self._seq)
            self._live[key] = fn
            heapq.heappush(self._heap, (when, key))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="exec-deadlines",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0][1] == key:  # (sooner than what the thread waits for)
                self._cv.notify()
            return key

    def cancel(self, key: int) -> None:
        with self._cv:
            self._live.pop(key, None)
            while self._heap and self._heap[0][1] not in self._live:
                heapq.heappop(self._heap)

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    while self._heap and self._heap[0][1] not in self._live:
                        heapq.heappop(self._heap)
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        fn = self._live.pop(heapq.heappop(self._heap)[1])
                        break
                    self._cv.wait(self._heap[0][0] - now if self._heap else None)
            threading.Thread(target=fn, name="exec-deadline", daemon=True).start()


DEADLINES = _Deadlines()


@dataclass
class Captured:
    returncode: int = 0
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    timed_out: bool = False
    duration: float = 0.0


def run(proc: Process, *, stdin: bytes, timeout: float, max_output: int,
        stop: Callable[[], None], on_stdout: Sink | None = None,
        on_stderr: Sink | None = None) -> Captured:
    """Drive `proc` (started with stdin/stdout/stderr pipes) to its end.
    Over max_output bytes on either stream or past the timeout, `stop()` is
    called once and what was read so far is kept."""
    out = Captured()
    start = time.monotonic()
    deadline = start + timeout
    assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout.fileno(): (out.stdout, on_stdout),
            proc.stderr.fileno(): (out.stderr, on_stderr)}
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    pending = memoryview(stdin)
    stdin_fd = proc.stdin.fileno()
    if pending:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    stopped = False
    once = threading.Lock()

    def stop_once(why: str) -> None:
        nonlocal stopped
        with once:
            if stopped:
                return
            stopped = True
            if why == "timeout":
                out.timed_out = True
            else:
                out.truncated = True
        stop()

    # The deadline also fires from a timer: a sink that blocks (a slow
    # reader of a stream) must not hold the command past its timeout.
    watchdog = DEADLINES.at(deadline, lambda: stop_once("timeout"))
    try:
        readers = (proc.stdout.fileno(), proc.stderr.fileno())
        while any(fd in sel.get_map() for fd in readers):
            left = deadline - time.monotonic()
            if left <= 0 and not stopped:
                stop_once("timeout")
            for key, _ in sel.select(timeout=max(left, 0.05) if not stopped else 1.0):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        n = os.write(fd, pending[:READ_SIZE])
                        pending = pending[n:]
                    except (BrokenPipeError, BlockingIOError) as e:
                        if isinstance(e, BrokenPipeError):
                            pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    data = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    continue
                buf, sink = bufs[fd]
                room = max_output - len(buf)
                if len(data) > room:
                    data = data[:room]
                    stop_once("output")
                buf += data
                if sink is not None and data:
                    sink(data)
            if stopped and time.monotonic() > deadline + 30:
                break  # the tree would not die; do not hang the caller
    finally:
        DEADLINES.cancel(watchdog)
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
    try:
        out.returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()) if not stopped
                                   else 10.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        out.returncode = proc.wait()
    out.duration = time.monotonic() - start
    return out
