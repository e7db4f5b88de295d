"""Finding, starting and stopping the node agent of a state directory.

Owns where a state directory's agent listens (STATE/agent.sock, pid in
STATE/agent.pid, log in STATE/agent.log when started here), whether it
answers, starting one in the background (detached: it outlives the process
that started it) and stopping it. Not owned here: who talks to the agent and
who runs the node embedded (runtime.client.transport.local, the one rule for the SDK
and the CLI) and serving itself (server.py).

Light to import (no trio, FUSE or LMDB): the SDK imports it on its way to a
node.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lazyfs.options import Options

from ..errors import BackendUnavailable

if TYPE_CHECKING:
    from ..config import RuntimeConfig

log = logging.getLogger(__name__)

SOCKET = "agent.sock"
LOG = "agent.log"
START_TIMEOUT = 60.0  # imports, Node recovery of every sandbox on the state, bind
STOP_TIMEOUT = 30.0
# the directory holding the runtime package: a started agent runs the same
# code as its caller (a checkout or an installed package alike)
_CODE = Path(__file__).resolve().parents[2]


def agent_socket(state_dir: Path) -> Path:
    """Where the agent of `state_dir` listens unless told otherwise."""
    return state_dir / SOCKET


def pid_file(sock: Path) -> Path:
    """The agent serving `sock` keeps its pid here while it runs."""
    return sock.with_suffix(".pid")


def answers(sock: Path) -> bool:
    """True when something accepts connections on the Unix socket `sock`
    (a socket file left by a killed agent refuses them)."""
    try:
        if not sock.is_socket():
            return False
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5.0)
            return s.connect_ex(str(sock)) == 0
    except OSError:
        return False


def dump_config(config: RuntimeConfig) -> str:
    """`config` as JSON for an agent's command line (load_config reads it)."""
    return json.dumps({f.name: str(v) if isinstance(v, Path) else
                       dataclasses.asdict(v) if isinstance(v, Options) else v
                       for f in dataclasses.fields(config)
                       for v in [getattr(config, f.name)]})


def load_config(text: str) -> RuntimeConfig:  # (the daemon's options: a mapping, checked)
    from ..config import RuntimeConfig
    data: dict[str, Any] = json.loads(text)
    for f in dataclasses.fields(RuntimeConfig):
        # field types are strings here (postponed annotations)
        if "Path" in str(f.type) and isinstance(data.get(f.name), str):
            data[f.name] = Path(data[f.name])
    return RuntimeConfig(**data)


@contextmanager
def _starting(state_dir: Path) -> Iterator[None]:
    """One starter at a time per state directory: two CLI commands at once
    must not start two agents (the second would fail on the node's lock)."""
    fd = os.open(state_dir / "agent.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def start(config: RuntimeConfig, timeout: float = START_TIMEOUT) -> Path:
    """Start the agent of `config.state_dir` in the background unless one
    answers already; return its socket once it answers. The agent runs in
    its own session (no signal of ours reaches it) with its output appended
    to STATE/agent.log, and stays until stopped (`lazyfs agent --stop`)."""
    state = config.state_dir
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = agent_socket(state)
    with _starting(state):
        if answers(sock):
            return sock
        log_path = state / LOG
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(_CODE), *filter(None, [os.environ.get("PYTHONPATH")])])
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "runtime.agent", "--config", dump_config(config)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, cwd="/",
                start_new_session=True)
        log.info("started the node agent for %s (pid %d, log %s)", state, proc.pid, log_path)
        deadline = time.monotonic() + timeout
        while not answers(sock):
            code = proc.poll()
            if code is not None:
                raise BackendUnavailable(
                    f"the node agent for {state} exited ({code}) before it answered: "
                    f"{_last_line(log_path)} (log: {log_path})")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise BackendUnavailable(
                    f"the node agent for {state} did not answer within {timeout:.0f} s "
                    f"(log: {log_path})")
            time.sleep(0.05)
        return sock


def stop(sock: Path, timeout: float = STOP_TIMEOUT) -> int | None:
    """Stop the agent serving `sock` (SIGTERM; it closes its node; container
    sandboxes stay, VMs end with it) and wait until its process is gone. Returns its pid, or None when
    no agent answered there."""
    pf = pid_file(sock)
    if not answers(sock):
        pf.unlink(missing_ok=True)  # left by a killed agent
        return None
    try:
        pid = int(pf.read_text().split()[0])
    except (OSError, ValueError, IndexError) as e:
        raise BackendUnavailable(f"an agent answers on {sock} but its pid file {pf} "
                                 f"cannot be read: {e}") from None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            raise BackendUnavailable(f"the node agent (pid {pid}) did not stop within "
                                     f"{timeout:.0f} s")
        time.sleep(0.05)
    return pid


def _alive(pid: int) -> bool:
    try:  # our own child (started by start() in this process) must be reaped
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"
