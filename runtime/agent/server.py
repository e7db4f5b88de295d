"""Serving the node agent: hypercorn on trio, a Unix socket by default (mode
0600: only its owner may call), TCP listeners only with a bearer token, and a
reaper task that kills sandboxes past their timeouts. `run_agent` is the whole
agent process (node, pid file, serve, close), for `lazyfs agent` and for
`python -m runtime.agent` (what launch.start runs in the background).

    run_agent(RuntimeConfig(...))                      # STATE/agent.sock
    serve(node, socket=Path("/var/lib/lazyfs-runtime/agent.sock"))
    serve(node, listen=["127.0.0.1:7070"], token="…")
    listeners = bind_tcp(["127.0.0.1:0"])          # a port the kernel picks, bound now
    serve(node, listen=listeners.binds(), token="…")  # listeners.addresses: where
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket as socketlib
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from ..config import RuntimeConfig
from ..docker.http import close_all
from ..docker.server import DockerOptions, serve_docker
from ..docker.server import bind as bind_docker
from ..errors import BackendUnavailable, InvalidSpec
from ..fleet.ca import CrlWatch, Identity, server_context
from ..fleet.etcd import Etcd
from ..fleet.member import Member, Registration
from ..node import Node
from .app import Admission, make_app
from .launch import agent_socket, pid_file
from .metrics import AgentMetrics

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 4096  # (the kernel's net.core.somaxconn caps it)
KEEP_ALIVE_S = 75.0


@dataclass
class TcpListeners:
    """TCP sockets bound before the agent serves: a port given as 0 is one
    the kernel picked, known (and advertised in a fleet) before serving."""

    sockets: list[socketlib.socket] = field(default_factory=list)

    @property
    def addresses(self) -> list[str]:
        """HOST:PORT of each, as bound."""
        out = []
        for s in self.sockets:
            host, port = s.getsockname()[:2]
            out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        return out

    def binds(self) -> list[str]:
        """What serve(listen=) takes: hypercorn's fd:// binds of fresh
        duplicates, which hypercorn owns (these stay open until close())."""
        return [f"fd://{os.dup(s.fileno())}" for s in self.sockets]

    def close(self) -> None:
        for s in self.sockets:
            s.close()
        self.sockets = []


def bind_tcp(listen: Sequence[str]) -> TcpListeners:
    """Bind and listen on each HOST:PORT now (PORT 0: any free one).
    InvalidSpec naming an address that is malformed, BackendUnavailable one
    that cannot be bound (in use, not this host's); nothing stays bound."""
    out = TcpListeners()
    try:
        for address in listen:
            host, sep, port = address.rpartition(":")
            host = host.strip("[]")
            if not sep or not host or not port.isdigit():
                raise InvalidSpec(f"--listen {address!r}: expected HOST:PORT")
            family = socketlib.AF_INET6 if ":" in host else socketlib.AF_INET
            s = socketlib.socket(family, socketlib.SOCK_STREAM)
            out.sockets.append(s)
            s.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_REUSEADDR, 1)
            try:
                s.bind((host, int(port)))
            except (OSError, OverflowError) as e:
                raise BackendUnavailable(f"--listen {address}: cannot bind it: "
                                 f"{getattr(e, 'strerror', None) or e}") from None
            s.listen(LISTEN_BACKLOG)
    except BaseException:
        out.close()
        raise
    return out


async def _reaper(node: Node) -> None:
    while True:
        await trio.sleep(node.config.reap_interval)
        try:
            await trio.to_thread.run_sync(node.reaper.reap)
        except Exception:
            log.exception("reaping sandboxes failed")


class _TlsConfig(Config):  # type: ignore[misc]
    """hypercorn's config serving TLS with our context (runtime.fleet.ca:
    client certificates required, the revocation list read again as it
    changes) instead of one it would make from file names."""

    context: ssl.SSLContext

    @property
    def ssl_enabled(self) -> bool:
        return True

    def create_ssl_context(self) -> ssl.SSLContext:
        return self.context


async def _watch_crl(crl: CrlWatch) -> None:
    while True:
        await trio.sleep(1.0)
        if crl.poll():
            log.info("loaded the revocation list %s again (%d connection(s) of revoked "
                     "certificates ended so far)", crl.ident.crl, crl.ended)


def serve(node: Node, *, socket: Path | None = None, listen: list[str] | None = None,
          token: str | None = None, on_ready: Callable[[], None] | None = None,
          docker: DockerOptions | None = None, tls: Identity | None = None) -> None:
    """Serve until SIGINT/SIGTERM. Sandboxes outlive the agent; a restarted
    agent on the same state directory finds them (Node.recover). `tls`: TCP
    listeners serve HTTPS to callers with a client certificate of the
    fleet's CA (then a token is not needed)."""
    if listen and token is None and tls is None:
        raise ValueError("a TCP listener needs a token (--token-file) or TLS (--tls-dir)")
    context = server_context(tls) if tls is not None else None
    crl = CrlWatch(tls, context) if tls is not None and context is not None else None

    def config(binds: list[str], secure: bool = False) -> Config:
        c: Config = Config()
        if secure:
            c = _TlsConfig()
            assert context is not None
            c.context = context
        c.bind = binds
        c.accesslog = None
        c.errorlog = logging.getLogger("hypercorn.error")
        c.graceful_timeout = 2.0
        c.backlog = LISTEN_BACKLOG  # a client's burst of connections waits, not refused
        # idle connections outlive the clients' own expiry (httpx: 5 s), so a
        # client never sends a call on one the agent is closing
        c.keep_alive_timeout = KEEP_ALIVE_S
        return c

    # The Unix socket is guarded by its permissions; TCP by the token: two
    # servers over one node.
    servers = []
    metrics = AgentMetrics(node)
    admission = Admission(metrics, node.config.max_in_flight)
    if socket is not None:
        socket.parent.mkdir(parents=True, exist_ok=True)
        socket.unlink(missing_ok=True)
        servers.append((admission.wrap(make_app(node, metrics=metrics)),
                        config([f"unix:{socket}"])))
    if listen:
        servers.append((admission.wrap(make_app(node, token, metrics)),
                        config(list(listen), secure=tls is not None)))

    docker_sockets = bind_docker(docker) if docker is not None else []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reaper, node)
            shutdown = trio.Event()

            async def signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
                    async for _ in sigs:
                        shutdown.set()
                        return

            nursery.start_soon(signals)
            if crl is not None:
                nursery.start_soon(_watch_crl, crl)
            if docker is not None:  # (root-only: its socket is made 0600)
                nursery.start_soon(serve_docker, node, docker, docker_sockets)

            async def ready_when_bound() -> None:
                while socket is not None and not socket.exists():
                    await trio.sleep(0.01)
                if socket is not None:
                    os.chmod(socket, 0o600)
                if on_ready:
                    on_ready()

            nursery.start_soon(ready_when_bound)
            async with trio.open_nursery() as inner:
                for app, cfg in servers:
                    inner.start_soon(functools.partial(hypercorn_serve, app, cfg,
                                                       shutdown_trigger=shutdown.wait))
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        close_all(docker_sockets)


def run_agent(config: RuntimeConfig, *, socket: Path | None = None,
              listen: list[str] | None = None, token: str | None = None,
              on_ready: Callable[[], None] | None = None,
              fleet: tuple[str, Registration] | None = None,
              docker: DockerOptions | None = None, tls: Identity | None = None) -> None:
    """The agent of `config.state_dir` until SIGINT/SIGTERM: its node (which
    refuses when another node process owns the state), a pid file next to
    the socket (launch.stop reads it), serve, then close the node. `fleet`:
    (etcd URL, registration): the node joins the fleet (runtime.fleet.member)
    once it serves and leaves it before it closes."""
    sock = socket or agent_socket(config.state_dir)
    node = Node(config)
    pid = pid_file(sock)
    member: Member | None = None
    if fleet is not None:
        member = Member(node, Etcd(fleet[0], identity=tls.dir if tls else None), fleet[1])

    def ready() -> None:
        if member is not None:
            member.start()
        if on_ready:
            on_ready()

    try:
        sock.parent.mkdir(parents=True, exist_ok=True)
        pid.write_text(f"{os.getpid()}\n")
        serve(node, socket=sock, listen=listen, token=token, on_ready=ready, docker=docker,
              tls=tls)
    finally:
        try:
            if member is not None:
                member.stop()
                member.etcd.close()
        finally:
            try:
                node.close()
            finally:
                pid.unlink(missing_ok=True)
