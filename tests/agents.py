"""A node agent as users run it (`lazyfs agent`, a separate process) on its
own state directory, Unix socket and TCP port with a token, for the tests
that talk to one."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lazynode import LazyNode
from sandboxes import busybox_store
from support import parent_death_signal, terminate

from runtime import BackendUnavailable, Sandbox

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agent:
    def __init__(self, d: Path, store: Path, node_root: Path) -> None:
        self.d, self.store, self.node_root = d, store, node_root
        self.sock = d / "agent.sock"
        self.port = _free_port()
        self.token_file = d / "token"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def unix(self) -> str:
        return f"unix://{self.sock}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def start(self) -> None:
        self.sock.unlink(missing_ok=True)
        log = open(self.d / "agent.log", "ab")  # noqa: SIM115 - the child keeps its copy
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "--store", str(self.store), "agent",
             "--socket", str(self.sock), "--state", str(self.d / "state"),
             "--node-root", str(self.node_root), "--listen", f"127.0.0.1:{self.port}",
             "--token-file", str(self.token_file)],
            stdout=log, stderr=log, cwd=REPO, preexec_fn=parent_death_signal())  # noqa: PLW1509
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.d / "agent.log").read_text()
            if self.sock.exists():
                with socket.socket(socket.AF_UNIX) as s:
                    if s.connect_ex(str(self.sock)) == 0:
                        return
            time.sleep(0.05)
        raise RuntimeError("agent not ready: " + (self.d / "agent.log").read_text())

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        terminate(self.proc, 10)


@contextmanager
def running_agent(d: Path) -> Iterator[Agent]:
    """An agent over the busybox store in `d` (its own lazyfs node daemon);
    afterwards its sandboxes are killed, whatever a killed agent left too."""
    store = busybox_store(d)
    with LazyNode(d / "lazynode", store) as lazy:
        a = Agent(d, store, lazy.paths.root)
        a.start()
        try:
            yield a
        finally:
            try:
                Sandbox.kill_many(node=a.unix)
            except BackendUnavailable:
                pass
            a.stop()
            from runtime.config import RuntimeConfig
            from runtime.node import Node
            # whatever a killed agent left, a node on the same state cleans up
            n = Node(RuntimeConfig(store=store, cluster=None, state_dir=d / "state",
                                   node_root=lazy.paths.root))
            n.kill_many(None)
            n.close()
