"""The base of every server the tests start as a child process (the registry,
the private dockerd, SeaweedFS, the lazyfs node daemon): start it with its
output in a log file, wait with one timeout until something observable says
it serves, stop it (SIGTERM, wait, SIGKILL), and put the log's tail into
every error.

A subclass says what "ready" means (`ready()`: one look, no waiting) and which
error it raises (`error`); it builds the command line and calls `spawn()`
then `wait_ready()`, and `stop_process()` when it stops. What a server leaves
behind besides its process (mounts, cgroups, sockets) is the subclass's to
clean up. A server the packages run for users too keeps its command line and
readiness look in the package, and the test class uses them: SeaweedFS's are
chunkstore/seaweed.py's (`lazyfs seaweed` runs it; a package cannot import
the tests), tests/helpers/seaweed.py runs them as a ServerProcess."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from .support import parent_death_signal, terminate

LOG_TAIL_LINES = 40
POLL = 0.05  # seconds between two looks at the server


class ServerProcess:
    """One child process serving something to the tests.

    `name` names it in errors; `log_path` gets its stderr (and stdout, unless
    spawn() is given a file of its own for that); `startup_timeout` bounds
    wait_ready(), `stop_grace` the wait between SIGTERM and SIGKILL."""

    name = "server"
    error: type[Exception] = RuntimeError

    def __init__(self, log_path: Path, *, startup_timeout: float, stop_grace: float) -> None:
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.proc: subprocess.Popen[bytes] | None = None
        self.last = "no answer"  # what the last look at the server saw, for errors

    # -- state ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Spawn the server and wait until it is ready (the subclass's)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the server and remove what it left (at least the process)."""
        self.stop_process()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def spawn(self, cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None,
              stdout: Path | None = None, new_session: bool = False,
              header: bool = False) -> None:
        """Start `cmd` with stdin closed, stderr (and stdout unless `stdout`
        names a file for it) appended to the log, and a parent-death signal so
        a killed test run leaves no server behind. `header` writes the command
        line into the log first (for logs that several starts share)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The child gets its own copies of the descriptors; ours close at once.
        with open(self.log_path, "ab") as log, \
                open(stdout if stdout is not None else self.log_path, "ab") as out:
            if header:
                log.write(f"--- {' '.join(cmd)}\n".encode())
                log.flush()
            self.proc = subprocess.Popen(
                list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=log, cwd=cwd,
                env=dict(env) if env is not None else None, start_new_session=new_session,
                preexec_fn=parent_death_signal())  # noqa: PLW1509 - one prctl() call

    def launch(self, cmd: Sequence[str], *, cwd: Path) -> None:
        """spawn() then wait_ready(); a server that does not get ready is
        stopped before the error propagates."""
        self.spawn(cmd, cwd=cwd)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def ready(self) -> bool:
        """One look: does the server serve yet? (May set `self.last` to what
        it saw, for the error if it never does.)"""
        raise NotImplementedError

    def wait_ready(self) -> None:
        """Wait until ready() or the process exits or startup_timeout passes;
        the latter two raise `error` with the log's tail (the process is left
        to the caller's stop)."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise self.error(f"{self.name} exited with {self.proc.returncode} before it "
                                 f"was ready; log tail:\n{self.log_tail()}")
            if self.ready():
                return
            if time.monotonic() > deadline:
                raise self.error(f"{self.name} not ready after {self.startup_timeout:g} s "
                                 f"(last: {self.last}); log tail:\n{self.log_tail()}")
            time.sleep(POLL)

    def stop_process(self) -> None:
        """SIGTERM, then SIGKILL after stop_grace seconds; reaped. Idempotent."""
        terminate(self.proc, self.stop_grace)
