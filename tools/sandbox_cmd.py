"""Sandbox commands: `lazyfs agent` (the node agent) and `lazyfs sandbox …`
(create, run, exec, ls, pause, resume, restore, kill, snapshot, fork, verify)
through the SDK.

Which node: --node / LAZYFS_NODE, else the SDK's rule (runtime.client.transport.local):
the agent of the state directory when one answers, else the runtime embedded
in this command. `sandbox create` and `sandbox run --keep` leave a sandbox
that must outlive the command, so without an agent they start one in the
background (logging to STATE/agent.log; `lazyfs agent --stop` stops it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import click

from runtime import BackendUnavailable, InvalidSpec, Sandbox
from runtime.client.connect import resolve
from runtime.client.transport import Transport, close_embedded, local
from runtime.config import RuntimeConfig
from runtime.spec import BACKENDS, SANDBOX_ID_PATTERN, NetworkPolicy, Qos, parse_rule

from .config import Settings
from .errors import QuietError
from .options import parse_labels as _labels


def _config(settings: Settings, state: Path | None, node_root: Path | None) -> RuntimeConfig:
    kw: dict[str, Any] = {"store": settings.store_path, "cluster": settings.cluster}
    if state is not None:
        kw["state_dir"] = state
    if node_root is not None:
        kw["node_root"] = node_root
    return RuntimeConfig(**kw)


NODE_HELP = ("Node agent: unix:///PATH or http://HOST:PORT [env LAZYFS_NODE]. Default: the "
             "agent of the state directory (STATE/agent.sock) if one answers, else the node "
             "runs in this command; `sandbox create` and `run --keep` start an agent instead. "
             "A TCP agent's token: env LAZYFS_NODE_TOKEN.")


def _node_option(f: Any) -> Any:
    return click.option("--node", "node", metavar="URL", envvar="LAZYFS_NODE", default=None,
                        help=NODE_HELP)(f)


def _target(settings: Settings, node: str | None, *, detached: bool = False) -> Transport:
    """--node, else the state directory's node by the SDK's rule; `detached`:
    what is created must outlive this command (an agent is started)."""
    if node:
        return resolve(node)
    click.get_current_context().call_on_close(close_embedded)  # fncall pools go with us
    return local(_config(settings, None, None), detached=detached)


@click.command()
@click.option("--socket", "socket", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Unix socket [default STATE/agent.sock].")
@click.option("--listen", multiple=True, metavar="HOST:PORT",
              help="Also listen on TCP (needs --token-file); port 0: a free one, "
                   "printed when it serves.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Bearer token for TCP clients (created with a random token if missing).")
@click.option("--state", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Runtime state directory [default /var/lib/lazyfs-runtime as root].")
@click.option("--node-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The node's lazyfs daemon root [default /run/lazyfs as root].")
@click.option("--stop", is_flag=True,
              help="Stop the agent serving the socket instead (e.g. the one `lazyfs sandbox "
                   "create` started); container sandboxes stay, VMs end with it.")
@click.option("--fleet", metavar="etcd://HOST:PORT", envvar="LAZYFS_FLEET", default=None,
              help="Join this fleet: register the node in etcd under a lease "
                   "(docs/fleet.md) [env LAZYFS_FLEET]; needs --listen and --node-id.")
@click.option("--node-id", default=None, help="This node's id in the fleet ([a-z0-9-]).")
@click.option("--advertise", metavar="URL", default=None,
              help="The URL clients reach this agent at [default http://<first --listen>].")
@click.option("--node-label", "node_labels", multiple=True, metavar="KEY=VALUE",
              help="An operator label of this node (zone, hardware), for placement.")
@click.option("--max-sandboxes", type=int, default=None,
              help=f"Sandboxes this node admits at most [{RuntimeConfig.max_sandboxes}].")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=None,
              help="API calls answered at once; more are refused as Overloaded, which "
                   f"the SDK retries [{RuntimeConfig.max_in_flight}].")
@click.option("--memory-mb", type=int, default=None,
              help="Memory for sandboxes: admit sandboxes while the memory they ask for "
                   "fits in it times the QoS class's overcommit [no memory admission].")
@click.option("--overcommit", "overcommit", multiple=True, metavar="QOS=FACTOR",
              help="Memory overcommit of a QoS class [latency=1, best_effort=4].")
@click.option("--insecure", is_flag=True,
              help="Serve --listen over plain HTTP with a bearer token (one-machine setups: the "
                   "token travels in the clear); a fleet's agents serve HTTPS (--tls-dir).")
@click.option("--tls-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Serve --listen over HTTPS with this node identity (cert.pem, key.pem, "
                   "ca.pem, crl.pem: `lazyfs fleet ca issue node NODE_ID`); every caller must "
                   "present a client certificate of the fleet's CA (no token needed).")
@click.option("--docker-socket", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also serve the Docker Engine API on this Unix socket (mode 0600: root "
                   "only), for docker-py and the docker CLI (DOCKER_HOST=unix://PATH).")
@click.option("--docker-listen", multiple=True, metavar="HOST:PORT",
              help="Also serve the Docker Engine API on TCP, only with TLS client "
                   "certificates (--docker-tlscacert/--docker-tlscert/--docker-tlskey, as "
                   "dockerd's --tlsverify; clients: docker --tlsverify, DOCKER_CERT_PATH).")
@click.option("--docker-tlscacert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="CA certificate (PEM) that issues the Docker clients' certificates.")
@click.option("--docker-tlscert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The Docker endpoint's TLS certificate (PEM).")
@click.option("--docker-tlskey", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The Docker endpoint's TLS key (PEM).")
@click.option("--docker-certs-dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Registries' CA certificates for docker pull, as HOST/ca.crt "
                                 "[/etc/docker/certs.d].")
@click.pass_obj
def agent(settings: Settings, socket: Path | None, listen: tuple[str, ...],
          token_file: Path | None, state: Path | None, node_root: Path | None,
          stop: bool, fleet: str | None, node_id: str | None, advertise: str | None,
          node_labels: tuple[str, ...], max_sandboxes: int | None, max_in_flight: int | None,
          memory_mb: int | None, overcommit: tuple[str, ...], docker_socket: Path | None,
          docker_listen: tuple[str, ...], docker_tlscacert: str | None,
          docker_tlscert: str | None, docker_tlskey: str | None,
          docker_certs_dir: Path | None, insecure: bool, tls_dir: Path | None) -> None:
    """Run the node agent: the HTTP API that creates and drives this node's
    sandboxes (OpenAPI schema at /openapi.json). Sandboxes outlive the agent;
    a restarted agent finds them again. SDK and CLI calls that name no node
    use the agent of their state directory when one answers."""
    from runtime.agent import launch

    config = _config(settings, state, node_root)
    extra: dict[str, Any] = {}
    if max_sandboxes is not None:
        extra["max_sandboxes"] = max_sandboxes
    if max_in_flight is not None:
        extra["max_in_flight"] = max_in_flight
    if memory_mb is not None:
        extra["memory_mb"] = memory_mb
    for qos, factor in _labels(overcommit, "--overcommit").items():
        if qos not in ("latency", "best_effort"):
            raise QuietError(f"--overcommit {qos}: the QoS classes are latency and best_effort",
                             exit_code=2)
        try:
            extra[f"overcommit_{qos}"] = float(factor)
        except ValueError:
            raise QuietError(f"--overcommit {qos}={factor}: not a number", exit_code=2) from None
    if fleet is not None and not stop:
        if not node_id or not listen:
            raise QuietError("--fleet needs --node-id and --listen (clients reach the node "
                             "over TCP)", exit_code=2)
        extra["node_id"] = node_id
    if extra:
        config = dataclasses.replace(config, **extra)
    sock = socket or launch.agent_socket(config.state_dir)
    if stop:
        pid = launch.stop(sock)
        click.echo(f"stopped the agent on {sock} (pid {pid})" if pid is not None
                   else f"no agent answers on {sock}", err=True)
        return
    from runtime.agent.server import TcpListeners, bind_tcp, run_agent
    from runtime.docker.server import DockerOptions

    token = None
    listeners = TcpListeners()
    tls = None
    if tls_dir is not None:
        from runtime.fleet.ca import Identity
        try:
            tls = Identity(tls_dir).check(client=False)
        except InvalidSpec as e:
            raise QuietError(str(e), exit_code=2) from None
    if listen and not stop:
        if tls is None and not insecure:
            raise QuietError("--listen without --tls-dir would serve plain HTTP: give --tls-dir "
                             "(`lazyfs fleet ca issue node ID`), or --insecure with --token-file "
                             "on one machine", exit_code=2)
        if token_file is None and tls is None:
            raise QuietError("--listen needs --tls-dir (client certificates) or --token-file "
                             "(TCP clients must authenticate)")
        try:  # bound now: a port 0 is known before the node registers it
            listeners = bind_tcp(listen)
        except InvalidSpec as e:
            raise QuietError(str(e), exit_code=2) from None
        except BackendUnavailable as e:
            raise QuietError(str(e)) from None
        listen = tuple(listeners.addresses)
        if token_file is not None:
            if not token_file.exists():
                token_file.write_text(secrets.token_urlsafe(32) + "\n")
                token_file.chmod(0o600)
            token = token_file.read_text().strip()
    membership = None
    if fleet is not None:
        from runtime.fleet.etcd import endpoints
        from runtime.fleet.member import Registration, usable_backends

        endpoints(fleet)  # a bad URL fails here, in one line
        assert node_id is not None
        membership = (fleet, Registration(
            node_id=node_id, address=advertise or f"{'https' if tls else 'http'}://{listen[0]}",
            backends=usable_backends(), labels=_labels(node_labels, "--node-label")))
    root_logger = logging.getLogger()
    root_logger.setLevel(min(root_logger.level, logging.WARNING))  # a server's warnings show
    try:
        docker = None
        docker_tls = (docker_tlscacert, docker_tlscert, docker_tlskey)
        if docker_listen and None in docker_tls:
            raise QuietError("--docker-listen needs --docker-tlscacert, --docker-tlscert and "
                             "--docker-tlskey: the Docker API is never served on plain TCP",
                             exit_code=2)
        for address in docker_listen:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise QuietError(f"--docker-listen {address!r}: expected HOST:PORT", exit_code=2)
        if docker_socket is not None or docker_listen:
            docker = DockerOptions(docker_socket.absolute() if docker_socket else None,
                                   docker_certs_dir or Path("/etc/docker/certs.d"),
                                   tuple(docker_listen),
                                   docker_tls if docker_listen else None)  # type: ignore[arg-type]
        run_agent(config, socket=sock, listen=listeners.binds(), token=token, fleet=membership,
                  docker=docker, tls=tls,
                  on_ready=lambda: click.echo(f"lazyfs agent serving unix://{sock}"
                                              + "".join(f" {'https' if tls else 'http'}://{a}"
                                                        for a in listen)
                                              + (f" in the fleet {fleet} as {node_id}"
                                                 if fleet else "")
                                              + (f"; the Docker API on {docker.where()}"
                                                 if docker else ""), err=True))
    finally:
        listeners.close()


@click.group()
def sandbox() -> None:
    """Create sandboxes and run commands in them."""


def _create_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--backend", type=click.Choice(BACKENDS), default="container",
                     show_default=True),
        click.option("--cpu", type=float, default=None, help="CPUs [1]."),
        click.option("--memory-mb", type=int, default=None, help="Memory limit [1024]."),
        click.option("--disk-mb", type=int, default=None,
                     help="Writable layer size (a tmpfs, counted in memory) [the node's "
                          "default, 1024]."),
        click.option("--open-files", type=int, default=None,
                     help="Open files per process (RLIMIT_NOFILE) [1024]."),
        click.option("--timeout", "lifetime", type=float, default=None,
                     help="Sandbox lifetime in seconds [3600]."),
        click.option("--allow", multiple=True, metavar="ADDR[:PORT][/PROTO]",
                     help="Allow network to this destination (default: no network); the "
                          "node's own side of the sandbox's network is in `sandbox ls --json` "
                          "as host_address."),
        click.option("--qos", type=click.Choice([q.value for q in Qos]), default=None,
                     help="latency [default], or best_effort: every process of the sandbox "
                          "under SCHED_IDLE."),
        click.option("--label", "labels", multiple=True, metavar="KEY=VALUE"),
        click.option("--env", "env", multiple=True, metavar="NAME=VALUE"),
        click.option("--hidden", multiple=True, metavar="PATH",
                     help="A path of the image the sandbox does not see (a task's hidden "
                          "tests); `sandbox verify` shows it."),
        click.option("--progress/--no-progress", default=None,
                     help="Print each long step of the create on stderr (a first VM of an "
                          "image: its pmem metadata or disk built, the boot) [default: when "
                          "stderr is a terminal]."),
    ]):
        f = opt(f)
    return f


def _create(settings: Settings, node: str | None, detached: bool, image: str, backend: str,
            cpu: float | None, memory_mb: int | None, disk_mb: int | None,
            open_files: int | None, lifetime: float | None, allow: tuple[str, ...], qos: str | None,
            labels: tuple[str, ...], env: tuple[str, ...], hidden: tuple[str, ...],
            progress: bool | None) -> Sandbox:
    # a bad rule raises InvalidSpec naming it: one line, like every error
    network = NetworkPolicy.allow_only(*[parse_rule(a) for a in allow]) if allow else None
    return Sandbox.create(image, backend=backend, cpu=cpu, memory_mb=memory_mb,  # type: ignore[arg-type]
                          disk_mb=disk_mb, open_files=open_files, timeout=lifetime,
                          network=network, qos=qos,
                          labels=_labels(labels), env=_labels(env, "--env"),
                          hidden=hidden or None, node=_target(settings, node, detached=detached),
                          on_progress=_progress_line if (
                              sys.stderr.isatty() if progress is None else progress) else None)


def _progress_line(step: str) -> None:
    click.echo(f"lazyfs: {step}", err=True)


def _stream(sb: Sandbox, cmd: tuple[str, ...], timeout: float) -> int:
    def out(b: bytes) -> None:
        sys.stdout.buffer.write(b)
        sys.stdout.buffer.flush()

    def err(b: bytes) -> None:
        sys.stderr.buffer.write(b)
        sys.stderr.buffer.flush()

    r = sb.exec(list(cmd), timeout=timeout, on_stdout=out, on_stderr=err)
    return r.exit_code


@sandbox.command(context_settings={"ignore_unknown_options": True})
@_node_option
@_create_options
@click.option("--keep", is_flag=True, help="Keep the sandbox (print its id) instead of killing it.")
@click.option("--exec-timeout", type=float, default=600.0, show_default=True)
@click.argument("image")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def run(settings: Settings, /, node: str | None, image: str, cmd: tuple[str, ...], keep: bool,
        exec_timeout: float, **create: Any) -> None:
    """Create a sandbox from IMAGE, run CMD in it (output streamed), kill it.
    Exits with CMD's exit code.   lazyfs sandbox run demo:busybox -- ls /
    Without an agent the sandbox lives in this command (with --keep an agent
    is started, as for `sandbox create`)."""
    sb = _create(settings, node, keep, image, **create)
    try:
        code = _stream(sb, cmd, exec_timeout)
    finally:
        if keep:
            click.echo(sb.id, err=True)
        else:
            sb.kill()
    sys.exit(code)


@sandbox.command()
@_node_option
@_create_options
@click.argument("image")
@click.pass_obj
def create(settings: Settings, /, node: str | None, image: str, **create: Any) -> None:
    """Create a sandbox and print its id. It outlives this command: without
    an agent for the state directory one is started in the background
    (log STATE/agent.log; stop it with `lazyfs agent --stop`)."""
    click.echo(_create(settings, node, True, image, **create).id)


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@_node_option
@click.option("--timeout", type=float, default=600.0, show_default=True)
@click.argument("sandbox_id")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def exec_(settings: Settings, node: str | None, sandbox_id: str, cmd: tuple[str, ...],
          timeout: float) -> None:
    """Run CMD in sandbox SANDBOX_ID; exits with its exit code."""
    sys.exit(_stream(Sandbox.connect(sandbox_id, node=_target(settings, node)), cmd, timeout))


@sandbox.command()
@_node_option
@click.option("--tag", default=None, help="Tag of the snapshot image [snapshots/ID:N].")
@click.option("--json", "as_json", is_flag=True)
@click.argument("sandbox_id")
@click.pass_obj
def snapshot(settings: Settings, node: str | None, tag: str | None, as_json: bool,
             sandbox_id: str) -> None:
    """Capture SANDBOX_ID's files as an image (its image + its writable layer
    packed into a new layer); prints the image's digest and tag. Start a
    sandbox from it with `lazyfs sandbox create DIGEST`."""
    snap = Sandbox.connect(sandbox_id, node=_target(settings, node)).snapshot(tag)
    if as_json:
        click.echo(snap.model_dump_json(indent=1))
        return
    click.echo(f"{snap.image}  {snap.tag}  ({snap.entries} entries, {snap.bytes / 1e6:.1f} MB, "
               f"{snap.bytes_new / 1e6:.1f} MB new, frozen {snap.frozen_s * 1e3:.0f} ms)")


@sandbox.command()
@_node_option
@click.option("--tag", default=None, help="Tag of the checkpoint [checkpoints/ID:N].")
@click.option("--json", "as_json", is_flag=True)
@click.argument("sandbox_id")
@click.pass_obj
def checkpoint(settings: Settings, node: str | None, tag: str | None, as_json: bool,
               sandbox_id: str) -> None:
    """Checkpoint SANDBOX_ID's processes (CRIU) and files; prints the
    checkpoint's id and tag. The sandbox runs on; `lazyfs sandbox restore ID`
    starts a sandbox from the checkpoint."""
    ckpt = Sandbox.connect(sandbox_id, node=_target(settings, node)).checkpoint(tag)
    if as_json:
        click.echo(ckpt.model_dump_json(indent=1))
        return
    click.echo(f"{ckpt.id}  {ckpt.tag}  (memory {ckpt.memory_bytes / 1e6:.1f} MB, "
               f"{ckpt.memory_bytes_new / 1e6:.1f} MB new; files {ckpt.files.bytes / 1e6:.1f} "
               f"MB; frozen {ckpt.frozen_s * 1e3:.0f} ms)")


@sandbox.command()
@_node_option
@click.argument("sandbox_id")
@click.argument("n", type=click.IntRange(1, 1024))
@click.pass_obj
def fork(settings: Settings, node: str | None, sandbox_id: str, n: int) -> None:
    """Start N sandboxes from SANDBOX_ID's current files (one snapshot), each
    with its own writable layer and identity; prints their ids."""
    for child in Sandbox.connect(sandbox_id, node=_target(settings, node)).fork(n):
        click.echo(child.id)


@sandbox.command(context_settings={"ignore_unknown_options": True})
@_node_option
@click.option("--timeout", type=float, default=600.0, show_default=True)
@click.option("--keep", multiple=True, metavar="PATH",
              help="Take only this path of the sandbox's files (repeatable; default: all).")
@click.argument("sandbox_id")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def verify(settings: Settings, node: str | None, timeout: float, keep: tuple[str, ...],
           sandbox_id: str, cmd: tuple[str, ...]) -> None:
    """Run CMD in a fresh sandbox made from SANDBOX_ID's current files, with
    its hidden paths shown, no network and none of its processes; prints the
    output and exits with CMD's exit code."""
    sb = Sandbox.connect(sandbox_id, node=_target(settings, node))
    r = sb.verify(list(cmd) if len(cmd) > 1 else cmd[0], timeout=timeout,
                  keep=list(keep) if keep else None)
    sys.stdout.buffer.write(r.stdout)
    sys.stderr.buffer.write(r.stderr)
    sys.exit(r.exit_code)


@sandbox.command()
@_node_option
@click.option("--json", "as_json", is_flag=True)
@click.argument("sandbox_id")
@click.pass_obj
def events(settings: Settings, node: str | None, as_json: bool, sandbox_id: str) -> None:
    """What SANDBOX_ID was refused so far (denied system calls, refused
    connections, OOM kills, refused forks): one line each, with its count."""
    evs = Sandbox.connect(sandbox_id, node=_target(settings, node)).events()
    if as_json:
        click.echo(json.dumps([e.model_dump(mode="json") for e in evs], indent=1))
        return
    for e in evs:
        click.echo(f"{e.kind:13}  {e.detail}  x{e.count}")


@sandbox.command("ls")
@_node_option
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def ls(settings: Settings, node: str | None, labels: tuple[str, ...], as_json: bool) -> None:
    """List sandboxes (optionally by label)."""
    boxes = Sandbox.list(_labels(labels), node=_target(settings, node))
    if as_json:
        click.echo(json.dumps([b.info.model_dump(mode="json") for b in boxes], indent=1))
        return
    for b in boxes:
        s = b.info.spec
        click.echo(f"{b.id}  {b.info.state:8}  {s.backend:9}  {s.image}  "
                   + " ".join(f"{k}={v}" for k, v in s.labels.items()))


@sandbox.command()
@_node_option
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Kill every sandbox with this label.")
@click.argument("ids", nargs=-1)
@click.pass_obj
def kill(settings: Settings, node: str | None, labels: tuple[str, ...],
         ids: tuple[str, ...]) -> None:
    """Kill sandboxes by id or by label; killing a preempted sandbox's id
    discards it (its record and snapshot tag)."""
    target, want = _by_id_or_label(settings, node, labels, ids, "kill")
    if want:
        for i in Sandbox.kill_many(want, node=target):
            click.echo(f"killed {i}")
    for i in ids:
        target.kill(i)  # (no connect first: a preempted sandbox is discarded)
        click.echo(f"killed {i}")


def _by_id_or_label(settings: Settings, node: str | None, labels: tuple[str, ...],
                    ids: tuple[str, ...], verb: str) -> tuple[Transport, dict[str, str]]:
    if not ids and not labels:
        raise QuietError(f"name the sandboxes to {verb}: SANDBOX_ID… or --label KEY=VALUE",
                         exit_code=2)
    return _target(settings, node), _labels(labels)


@sandbox.command()
@_node_option
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Pause every running sandbox with this label.")
@click.option("--snapshot", is_flag=True,
              help="Preempt instead: snapshot each sandbox into the image store, keep a "
                   "record of it there and stop it (memory and disk freed); `sandbox "
                   "restore` brings it back, with the same id, here or on another node.")
@click.argument("ids", nargs=-1)
@click.pass_obj
def pause(settings: Settings, node: str | None, labels: tuple[str, ...], snapshot: bool,
          ids: tuple[str, ...]) -> None:
    """Freeze sandboxes (by id or by label) and reclaim their page cache;
    prints memory before/after for each one named by id. With --snapshot,
    preempt them."""
    target, want = _by_id_or_label(settings, node, labels, ids, "pause")
    if snapshot:
        mb = 1 << 20
        for i in Sandbox.pause_many(want, snapshot=True, node=target) if want else []:
            click.echo(f"preempted {i}")
        for i in ids:
            r = Sandbox.connect(i, node=target).preempt()
            click.echo(f"preempted {i}: snapshot {r.image}, {r.memory_bytes / mb:.1f} MB of "
                       f"memory and {r.disk_bytes / mb:.1f} MB of disk freed")
        return
    if want:
        for i in Sandbox.pause_many(want, node=target):
            click.echo(f"paused {i}")
    mb = 1 << 20
    for i in ids:
        f = Sandbox.connect(i, node=target).pause()
        click.echo(f"paused {i}: rss {f['before']['rss'] / mb:.1f} MB, cache "
                   f"{f['before']['cache'] / mb:.1f} → {f['after']['cache'] / mb:.1f} MB")


@sandbox.command()
@_node_option
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Resume every paused sandbox with this label.")
@click.argument("ids", nargs=-1)
@click.pass_obj
def resume(settings: Settings, node: str | None, labels: tuple[str, ...],
           ids: tuple[str, ...]) -> None:
    """Thaw paused sandboxes (by id or by label); prints each one resumed."""
    target, want = _by_id_or_label(settings, node, labels, ids, "resume")
    if want:
        for i in Sandbox.resume_many(want, node=target):
            click.echo(f"resumed {i}")
    for i in ids:
        Sandbox.connect(i, node=target).resume()
        click.echo(f"resumed {i}")


@sandbox.command()
@_node_option
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Restore every preempted sandbox with this label.")
@click.argument("ids", nargs=-1)
@click.pass_obj
def restore(settings: Settings, node: str | None, labels: tuple[str, ...],
            ids: tuple[str, ...]) -> None:
    """Start preempted sandboxes (`sandbox pause --snapshot`) again on this
    node, by id or by label: same ids, labels and files; prints each one.
    An argument that is a checkpoint's id or tag (`sandbox checkpoint`)
    starts a new sandbox from it, its processes going on where they were;
    prints the new sandbox's id."""
    target, want = _by_id_or_label(settings, node, labels, ids, "restore")
    if want:
        for i in Sandbox.restore_many(want, node=target):
            click.echo(f"restored {i}")
    for i in ids:
        if re.fullmatch(SANDBOX_ID_PATTERN, i):
            Sandbox.restore(i, node=target)
            click.echo(f"restored {i}")
        else:
            click.echo(Sandbox.restore(i, node=target).id)


@sandbox.command("preempted")
@_node_option
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def preempted(settings: Settings, node: str | None, labels: tuple[str, ...],
              as_json: bool) -> None:
    """List preempted sandboxes (optionally by label): id, where it ran,
    its snapshot image, labels."""
    records = Sandbox.preempted(_labels(labels), node=_target(settings, node))
    if as_json:
        click.echo(json.dumps([r.model_dump(mode="json") for r in records], indent=1))
        return
    for r in records:
        click.echo(f"{r.id}  {r.node}  {r.image}  "
                   + " ".join(f"{k}={v}" for k, v in r.spec.labels.items()))
