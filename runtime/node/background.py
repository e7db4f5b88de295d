"""Commands a node runs in the background (sb.start, then sb.wait): each in
a thread of its own running Node.exec, its result (or typed error) kept
until its sandbox goes. At most MAX_PER_SANDBOX are kept per sandbox: the
oldest finished one makes room; with all of them running, QuotaExceeded.
They live in the node process: an agent restarted loses them (the commands
themselves are stopped with their exec channel, as an exec's are).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import (
    BackendUnavailable,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
)
from ..spec import BackgroundExec, ExecRequest, ExecResult

if TYPE_CHECKING:
    from .core import Node

MAX_PER_SANDBOX = 256


@dataclass
class _Run:
    info: BackgroundExec
    done: threading.Event = field(default_factory=threading.Event)
    result: ExecResult | None = None
    error: SandboxError | None = None


class Background:
    """The node's background commands (Node.background)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, _Run]] = {}  # sandbox id -> exec id -> run

    def start(self, sandbox_id: str, req: ExecRequest) -> BackgroundExec:
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

        def body() -> None:
            try:
                run.result = self.node.exec(sandbox_id, req)
            except SandboxError as e:
                run.error = e
            except Exception as e:  # noqa: BLE001 - the waiter gets it, typed
                run.error = BackendUnavailable(f"{run.info.id}: {type(e).__name__}: {e}")
            finally:
                run.done.set()

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

    def forget(self, sandbox_id: str) -> None:
        """The sandbox went: its commands' results go too."""
        with self._lock:
            self._runs.pop(sandbox_id, None)
