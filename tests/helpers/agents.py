"""A node agent as users run it (`lazyfs agent`, a separate process) on its
own state directory, Unix socket and TCP port with a token, for the tests
that talk to one."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from runtime import BackendUnavailable, Sandbox

from .lazynode import LazyNode
from .netns import NodeNet
from .process import ServerProcess
from .sandboxes import busybox_store
from .support import free_port

REPO = Path(__file__).resolve().parents[2]



class Agent(ServerProcess):
    name = "lazyfs agent"  # ready when its Unix socket accepts a connection

    def __init__(self, d: Path, store: Path, node_root: Path,
                 extra: Sequence[str] = (), cluster: str | None = None,
                 log_json: bool = False, net: NodeNet | None = None,
                 repo: Path = REPO) -> None:
        """`extra`: more `lazyfs agent` options (e.g. --fleet, --node-id);
        `repo`: the source tree whose `tools.cli` runs (a benchmark's
        baseline runs an earlier commit's);
        `cluster`: the cluster store it serves images from; `log_json`: its
        log as JSON lines, at INFO (`lazyfs --log-json -v`); `net`: the
        network namespace it runs in, listening on its veth's address
        (tests/helpers/netns.py), instead of the host's loopback."""
        super().__init__(d / "agent.log", startup_timeout=20, stop_grace=10)
        self.d, self.store, self.node_root = d, store, node_root
        self.sock = d / "agent.sock"
        self.port = free_port()
        self.token_file = d / "token"
        self.extra = list(extra)
        self.cluster = cluster
        self.log_json = log_json
        self.net = net
        self.repo = repo
        self.host = net.address if net is not None else "127.0.0.1"

    @property
    def unix(self) -> str:
        return f"unix://{self.sock}"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def start(self) -> None:
        self.sock.unlink(missing_ok=True)
        cluster = ["--cluster", self.cluster] if self.cluster else []
        logs = ["--log-json", "-v"] if self.log_json else []
        cmd = [sys.executable, "-m", "tools.cli", "--store", str(self.store), *cluster,
               *logs, "agent",
               "--socket", str(self.sock), "--state", str(self.d / "state"),
               "--node-root", str(self.node_root), "--listen", f"{self.host}:{self.port}",
               "--token-file", str(self.token_file),
               *(["--insecure"] if self._needs_insecure() else []), *self.extra]
        self.spawn(self.net.wrap(cmd) if self.net is not None else cmd, cwd=self.repo)
        self.wait_ready()

    def _needs_insecure(self) -> bool:
        """Plain TCP with a token: `--insecure`, since the agent has it (a
        benchmark's baseline may run an earlier tree that does not)."""
        if "--tls-dir" in self.extra:
            return False
        cli = self.repo / "tools" / "sandbox_cmd.py"
        return cli.exists() and '"--insecure"' in cli.read_text()

    def ready(self) -> bool:
        if not self.sock.exists():
            return False
        with socket.socket(socket.AF_UNIX) as s:
            return s.connect_ex(str(self.sock)) == 0

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        self.stop_process()


@contextmanager
def running_agent(d: Path, repo: Path = REPO, extra: Sequence[str] = ()) -> Iterator[Agent]:
    """An agent over the busybox store in `d` (its own lazyfs node daemon);
    afterwards its sandboxes are killed, whatever a killed agent left too.
    `repo`, `extra`: the source tree the agent runs and more options (Agent)."""
    store = busybox_store(d)
    with LazyNode(d / "lazynode", store) as lazy:
        a = Agent(d, store, lazy.paths.root, repo=repo, extra=extra)
        a.start()
        try:
            yield a
        finally:
            _teardown(a)


def fleet_agent(d: Path, etcd_url: str, node_id: str, stack: ExitStack, *, token: str,
                max_sandboxes: int, memory_mb: int | None = None,
                cluster: str | None = None, log_json: bool = False,
                net: NodeNet | None = None, extra: Sequence[str] = ()) -> Agent:
    """An agent (not started) in the fleet of `etcd_url` as `node_id`, with
    its own busybox store (or, with `cluster`, the cluster store the fleet
    shares), lazyfs daemon and state in `d`, the fleet's `token` and label
    zone=<node id>; `memory_mb`: its memory admission; `net`: its network
    namespace (it registers its veth's address). `stack` stops it and
    its daemon and kills its sandboxes, also what a killed agent left."""
    store = d / "no-local-store" if cluster else busybox_store(d)
    lazy = stack.enter_context(LazyNode(d / "lazynode", store, cluster=cluster))
    d.mkdir(parents=True, exist_ok=True)
    (d / "token").write_text(token + "\n")
    a = Agent(d, store, lazy.paths.root, extra=[
        "--fleet", etcd_url, "--node-id", node_id, "--node-label", f"zone={node_id}",
        "--max-sandboxes", str(max_sandboxes),
        *(["--memory-mb", str(memory_mb)] if memory_mb is not None else []), *extra],
        cluster=cluster, log_json=log_json, net=net)
    stack.callback(_teardown, a)
    return a


def _teardown(a: Agent) -> None:
    """Kill the agent's sandboxes, stop it, and clean up whatever a killed
    agent left (a node on the same state does)."""
    try:
        Sandbox.kill_many(node=a.unix)
    except BackendUnavailable:
        pass
    a.stop()
    from runtime.config import RuntimeConfig
    from runtime.node import Node
    n = Node(RuntimeConfig(store=a.store, cluster=a.cluster, state_dir=a.d / "state",
                           node_root=a.node_root))
    n.kill_many(None)
    n.close()
