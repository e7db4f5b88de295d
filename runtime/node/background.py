"""Commands a node runs in the background (sb.start, then sb.wait): each in
a thread of its own running Node.exec, its result (or typed error) kept
until its sandbox goes. At most MAX_PER_SANDBOX are kept per sandbox: the
oldest finished one makes room; with all of them running, QuotaExceeded.
They live in the node process: an agent restarted loses them (the commands
themselves are stopped with their exec channel, as an exec's are).
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..api import Sink
from ..backends.base import Signaller
from ..errors import (
    BackendUnavailable,
    InvalidSpec,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    Unsupported,
)
from ..spec import BackgroundExec, ExecRequest, ExecResult

if TYPE_CHECKING:
    from .core import Node

log = logging.getLogger(__name__)

MAX_PER_SANDBOX = 256


@dataclass
class _Run:
    info: BackgroundExec
    done: threading.Event = field(default_factory=threading.Event)
    result: ExecResult | None = None
    error: SandboxError | None = None
    signaller: Signaller | None = None
    started: threading.Event = field(default_factory=threading.Event)


class Background:
    """The node's background commands (Node.background)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, _Run]] = {}  # sandbox id -> exec id -> run

    def start(self, sandbox_id: str, req: ExecRequest, on_stdout: Sink | None = None,
              on_stderr: Sink | None = None,
              on_done: Callable[[ExecResult | None, SandboxError | None], None] | None = None
              ) -> BackgroundExec:
        """Start `req`; the sinks get its output as it comes (in the
        command's thread), `on_done` its result or error once it ends."""
        info, _ = self.node._get(sandbox_id)
        self.node._require(info, "exec")
        if info.state == "paused":
            raise SandboxStateError(f"{sandbox_id} is paused: resume() it first")
        run = _Run(BackgroundExec(id=f"ex-{secrets.token_hex(8)}", sandbox_id=sandbox_id,
                                  cmd=req.cmd, started=time.time()))
        with self._lock:
            runs = self._runs.setdefault(sandbox_id, {})
            if len(runs) >= MAX_PER_SANDBOX:
                finished = [k for k, r in runs.items() if r.done.is_set()]
                if not finished:
                    raise QuotaExceeded(f"{sandbox_id} runs {MAX_PER_SANDBOX} background "
                                        "commands already: wait() for some first")
                del runs[finished[0]]  # (dicts keep their order: the oldest)
            runs[run.info.id] = run

        def started(signaller: Signaller) -> None:
            run.signaller = signaller
            run.started.set()

        def body() -> None:
            try:
                run.result = self.node.run_command(sandbox_id, req, on_stdout, on_stderr,
                                                   on_started=started)
            except SandboxError as e:
                run.error = e
            except Exception as e:  # noqa: BLE001 - the waiter gets it, typed
                run.error = BackendUnavailable(f"{run.info.id}: {type(e).__name__}: {e}")
            finally:
                run.done.set()
                run.started.set()
                if on_done is not None:
                    try:
                        on_done(run.result, run.error)
                    except Exception:
                        log.exception("%s: on_done failed", run.info.id)

        threading.Thread(target=body, name=f"exec-{run.info.id}", daemon=True).start()
        return run.info

    def wait(self, sandbox_id: str, exec_id: str, timeout: float | None = None) -> ExecResult:
        with self._lock:
            run = self._runs.get(sandbox_id, {}).get(exec_id)
        if run is None:
            self.node._get(sandbox_id)  # (a missing sandbox says so)
            raise SandboxNotFound(f"no background command {exec_id!r} in {sandbox_id}")
        if not run.done.wait(timeout):
            raise SandboxStateError(f"{exec_id} still runs after {timeout:g} s")
        if run.error is not None:
            raise run.error
        assert run.result is not None
        return run.result

    def signal(self, sandbox_id: str, exec_id: str, sig: int) -> None:
        """`sig` to a running command (Node.signal)."""
        try:
            signal.Signals(sig)
        except ValueError:
            raise InvalidSpec(f"signal {sig} is not a signal number") from None
        self.node._require(self.node._get(sandbox_id)[0], "signal")
        with self._lock:
            run = self._runs.get(sandbox_id, {}).get(exec_id)
        if run is None:
            raise SandboxNotFound(f"no background command {exec_id!r} in {sandbox_id}")
        run.started.wait(30)
        if run.done.is_set():
            raise SandboxStateError(f"{exec_id} has ended already")
        if run.signaller is None:
            info, _ = self.node._get(sandbox_id)
            raise Unsupported(f"the {info.spec.backend} backend cannot signal a command")
        run.signaller(sig)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox went: its commands' results go too."""
        with self._lock:
            self._runs.pop(sandbox_id, None)
