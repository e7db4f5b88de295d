"""Docker's containers, execs and events over the node's sandboxes.

A container is a sandbox (same id: `docker ps`, `lazyfs sandbox ls`, the
SDK and the metrics name it alike) plus what Docker adds: a name, the
create request, and a main process. `create` makes the sandbox (its files
exist from then on: `docker cp` into a created container works); `start`
runs Entrypoint + Cmd as a background command of the sandbox (the SDK's
start(), so its exit status has exec's integrity: it comes from the
sandbox's init, never from the command's output); when it ends the
container is `exited` and its sandbox stays, files and all, until the
container is removed (`docker cp` out, `commit`, `start` again). stop and
kill signal the main process (Node.signal); pause and unpause are the
node's (freeze, reclaim). Everything here is the node's SandboxApi plus
its background commands' output sinks.

What Docker keeps that this does not: containers, names and logs live in
the agent process (an agent restarted shows its sandboxes through the SDK,
not as containers); a main process's output is kept up to LOG_LIMIT bytes
per stream and the process is stopped past it, as an exec's is; stdin
reaches a command whole (an attached client's stdin is read to its end
before the command starts), not as a terminal.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import re
import secrets
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    FileError,
    ImageNotFound,
    InvalidSpec,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    Unsupported,
)
from ..spec import ExecRequest, ExecResult, NetworkPolicy, Rule, SandboxSpec, build
from .http import HttpError
from .images import DockerImages
from .shapes import (
    STDERR,
    STDOUT,
    ago,
    as_list,
    check_filters,
    iso,
    labels_match,
)

if TYPE_CHECKING:
    from ..node import Node

log = logging.getLogger(__name__)

LOG_LIMIT = 64 << 20  # per stream, per run of a main process
KEPT_LOG = 2 * LOG_LIMIT  # per container, over its runs: older output is dropped
EXEC_TIMEOUT = 7 * 86400.0  # the most ExecRequest allows: Docker's commands have none
STDIN_LIMIT = 64 << 20
MAX_EVENTS = 10_000
RUNTIMES = {"": "container", "runc": "container", "lazyfs-container": "container",
            "lazyfs-microvm": "microvm", "lazyfs-vm": "vm"}
BACKEND_LABEL = "lazyfs.backend"
_NAME = re.compile(r"^/?[a-zA-Z0-9][a-zA-Z0-9_.-]+$")
_ROOT_USERS = ("", "root", "0", "0:0", "root:root", "root:0", "0:root")
# create fields refused (not silently ignored): what they would need
_REFUSED_HOST = {
    "Binds": "bind mounts of the host's files", "Mounts": "mounts",
    "VolumesFrom": "volumes", "Devices": "devices", "DeviceRequests": "devices",
    "CapAdd": "added capabilities", "Privileged": "privileged containers",
    "PortBindings": "published ports", "Links": "links", "Sysctls": "sysctls",
    "SecurityOpt": "security options", "ExtraHosts": "extra hosts",
    "Dns": "DNS servers", "DnsSearch": "DNS search domains", "GroupAdd": "extra groups",
}
_HOST_MODES: dict[str, str | None] = {"PidMode": "the host's PID namespace", "IpcMode": "the host's IPC namespace",
               "UsernsMode": "the host's user namespace", "UTSMode": "the host's UTS namespace",
               "CgroupnsMode": None}


def _now() -> float:
    return time.time()


@dataclass
class Run:
    """One run of a container's main process."""

    n: int
    exec_id: str | None = None
    done: bool = False


@dataclass
class Container:
    id: str
    name: str
    image: str  # as asked
    image_id: str
    command: list[str]
    config: dict[str, Any]
    host_config: dict[str, Any]
    backend: str
    created: float
    status: str = "created"  # created running paused exited removing dead
    exit_code: int = 0
    error: str = ""
    oom_killed: bool = False
    started_at: float = 0.0
    finished_at: float = 0.0
    runs: int = 0  # started
    finished: int = 0
    restarts: int = 0
    main: Run | None = None
    log: list[tuple[float, int, bytes]] = field(default_factory=list)
    log_start: int = 0  # index of log[0] in all the output ever kept
    log_bytes: int = 0
    stdin: bytes | None = None  # an attached client's, read whole, for the next run
    stdin_wanted: bool = False  # a client attached with stdin: the next run waits for it
    stdin_ready: threading.Event = field(default_factory=threading.Event)
    removed: bool = False
    stopping: bool = False

    @property
    def tty(self) -> bool:
        return bool(self.config.get("Tty"))

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.config.get("Labels") or {})


@dataclass
class Exec:
    id: str
    container: str
    config: dict[str, Any]
    running: bool = False
    exit_code: int | None = None
    started: bool = False
    pid: int = 0


class Engine:
    """Docker's containers and execs on one node (the agent's Node)."""

    def __init__(self, node: Node, images: DockerImages) -> None:
        self.node = node
        self.images = images
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        self.containers: dict[str, Container] = {}
        self.execs: dict[str, Exec] = {}
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
        self.event_seq = 0
        self._reserved: set[str] = set()  # names of containers being made
        self.dir = node.config.state_dir / "docker"  # a record per container
        self.recover()

    # -- records -----------------------------------------------------------------------
    def _save(self, c: Container) -> None:
        """What a restarted agent needs to show the container again (its
        sandbox outlives the agent; its main process does not)."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        doc = {"id": c.id, "name": c.name, "image": c.image, "image_id": c.image_id,
               "command": c.command, "config": c.config, "host_config": c.host_config,
               "backend": c.backend, "created": c.created, "restarts": c.restarts}
        tmp = self.dir / f".{c.id}.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.dir / f"{c.id}.json")

    def _forget(self, c: Container) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / f"{c.id}.json").unlink()

    def recover(self) -> None:
        """The containers of an earlier agent whose sandboxes are still
        here, exited (their main process ended with that agent); records of
        sandboxes gone are dropped."""
        if not self.dir.is_dir():
            return
        for f in sorted(self.dir.glob("*.json")):
            try:
                doc = json.loads(f.read_text())
                c = Container(id=str(doc["id"]), name=str(doc["name"]),
                              image=str(doc["image"]), image_id=str(doc["image_id"]),
                              command=[str(x) for x in doc["command"]],
                              config=dict(doc["config"]), host_config=dict(doc["host_config"]),
                              backend=str(doc["backend"]), created=float(doc["created"]),
                              restarts=int(doc["restarts"]))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("docker: dropping the unreadable record %s: %s", f, e)
                f.unlink(missing_ok=True)
                continue
            if f.stem != c.id:
                f.unlink(missing_ok=True)
                continue
            try:
                self.node.get(c.id)
            except SandboxError:
                f.unlink(missing_ok=True)  # its sandbox is gone
                continue
            c.status, c.exit_code, c.finished_at = "exited", 137, _now()
            c.error = "the agent restarted: the container's main process ended with it"
            self.containers[c.id] = c
        if self.containers:
            log.info("docker: %d containers of an earlier agent (exited)", len(self.containers))

    # -- lookups ---------------------------------------------------------------------
    def get(self, ref: str) -> Container:
        """By id, name, or a unique id prefix (Docker's rule)."""
        with self._lock:
            c = self.containers.get(ref)
            if c is not None:
                return c
            name = ref.lstrip("/")
            for c in self.containers.values():
                if c.name == name:
                    return c
            hits = [c for c in self.containers.values() if c.id.startswith(ref)] if ref else []
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise HttpError(400, f"multiple IDs found with provided prefix: {ref}")
        raise HttpError(404, f"No such container: {ref}")

    def exec_of(self, exec_id: str) -> Exec:
        with self._lock:
            e = self.execs.get(exec_id)
        if e is None:
            raise HttpError(404, f"No such exec instance: {exec_id}")
        return e

    def using(self, image_digest: str) -> str | None:
        with self._lock:
            for c in self.containers.values():
                if c.image_id == image_digest:
                    return c.id
        return None

    # -- events ----------------------------------------------------------------------
    def emit(self, c: Container, action: str, extra: dict[str, str] | None = None) -> None:
        t = _now()
        attrs = {**c.labels, "image": c.image, "name": c.name, **(extra or {})}
        with self.changed:
            self.event_seq += 1
            self.events.append({
                "status": action, "id": c.id, "from": c.image, "Type": "container",
                "Action": action, "Actor": {"ID": c.id, "Attributes": attrs},
                "scope": "local", "time": int(t), "timeNano": int(t * 1e9),
                "seq": self.event_seq})
            self.changed.notify_all()

    def events_after(self, seq: int, timeout: float) -> list[dict[str, Any]]:
        with self.changed:
            if self.event_seq <= seq:
                self.changed.wait(timeout)
            return [e for e in self.events if e["seq"] > seq]

    # -- create ----------------------------------------------------------------------
    def create(self, body: Any, name: str | None) -> Container:
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        if name is not None and name != "":
            if not _NAME.match(name):
                raise HttpError(400, f"Invalid container name ({name}), only "
                                     "[a-zA-Z0-9][a-zA-Z0-9_.-] are allowed")
            name = name.lstrip("/")
            with self._lock:  # (reserved while it is made: two creates, one name)
                taken = [c.id for c in self.containers.values() if c.name == name]
                if taken or name in self._reserved:
                    raise HttpError(409, f'Conflict. The container name "/{name}" is already '
                                         f'in use by container "{(taken or ["?"])[0]}". You '
                                         "have to remove (or rename) that container to be able "
                                         "to reuse that name.")
                self._reserved.add(name)
        try:
            return self._create(body, name or None)
        finally:
            if name:
                with self._lock:
                    self._reserved.discard(name)

    def _create(self, body: dict[str, Any], name: str | None) -> Container:
        image_name = body.get("Image")
        if not isinstance(image_name, str) or not image_name:
            raise HttpError(400, "Config.Image: an image is needed")
        hc = body.get("HostConfig")
        hc = {} if hc is None else hc
        if not isinstance(hc, dict):
            raise HttpError(400, "HostConfig must be a JSON object")
        self._refuse(body, hc)
        found = self.images.find(image_name)
        ic = found.image.config
        entrypoint = as_list(body.get("Entrypoint"), "Entrypoint")
        cmd = as_list(body.get("Cmd"), "Cmd")
        if entrypoint is None:
            entrypoint = as_list(ic.get("Entrypoint"), "the image's Entrypoint") or []
            if cmd is None:
                cmd = as_list(ic.get("Cmd"), "the image's Cmd")
        command = [*(entrypoint or []), *(cmd or [])]
        if not command:
            raise HttpError(400, "no command specified")
        try:
            build(ExecRequest, cmd=tuple(command))
        except InvalidSpec as e:
            raise HttpError(400, f"Cmd / Entrypoint: {e}") from None
        env: dict[str, str] = {}
        for item in [*(as_list(ic.get("Env"), "the image's Env") or []),
                     *(as_list(body.get("Env"), "Env") or [])]:
            k, sep, v = item.partition("=")
            if sep:
                env[k] = v
        user = str(body.get("User") or ic.get("User") or "")
        if user not in _ROOT_USERS:
            raise HttpError(400, f"User {user!r}: lazyfs runs a sandbox's commands as the root "
                                 "of its own user namespace; other users are not supported")
        if body.get("Hostname") and body.get("Hostname") != "":
            raise HttpError(400, "Hostname: a lazyfs sandbox's host name cannot be set")
        if body.get("StopSignal"):
            parse_signal(str(body["StopSignal"]))
        if body.get("StopTimeout") is not None and (
                isinstance(body["StopTimeout"], bool) or not isinstance(body["StopTimeout"], int)):
            raise HttpError(400, "StopTimeout: expected an integer of seconds")
        if not isinstance(body.get("Labels") or {}, dict):
            raise HttpError(400, "Labels: expected an object of strings")
        labels = {**(ic.get("Labels") or {}), **(body.get("Labels") or {})}
        if not all(isinstance(v, str) for v in labels.values()):
            raise HttpError(400, "Labels: expected an object of strings")
        backend = RUNTIMES.get(str(hc.get("Runtime") or labels.get(BACKEND_LABEL) or ""))
        if backend is None:
            if (hc.get("Runtime") or labels.get(BACKEND_LABEL)) in ("lazyfs-fncall", "fncall"):
                raise HttpError(400, "Runtime lazyfs-fncall: a function-call sandbox has no "
                                     "main process to run; use the SDK's backend='fncall'")
            raise HttpError(400, f"unknown or invalid runtime name: {hc.get('Runtime')} "
                                 f"(lazyfs serves {', '.join(r for r in RUNTIMES if r)})")
        kw: dict[str, Any] = {"image": found.digest, "backend": backend, "env": env, "labels": labels,
                                  "workdir": str(body.get("WorkingDir") or ic.get("WorkingDir")
                                              or "/"),
                                  "timeout": None, "network": _network(hc)}
        memory = _number(hc, "Memory")
        if memory:
            kw["memory_mb"] = math.ceil(memory / (1 << 20))
        cpu = _cpus(hc)
        if cpu is not None:
            kw["cpu"] = cpu
        pids = _number(hc, "PidsLimit")
        if pids > 0:
            kw["pids"] = pids
        try:
            spec = build(SandboxSpec, **kw)
        except InvalidSpec as e:
            raise HttpError(400, f"invalid container configuration: {e}") from None
        try:
            info = self.node.create(spec)
        except SandboxError as e:
            raise to_http(e) from None
        stored = {k: body.get(k) for k in (
            "Hostname", "Domainname", "User", "AttachStdin", "AttachStdout", "AttachStderr",
            "Tty", "OpenStdin", "StdinOnce", "Env", "Cmd", "Entrypoint", "WorkingDir",
            "Labels", "StopSignal", "StopTimeout", "ExposedPorts", "Volumes")}
        stored.update(Image=image_name, Env=[f"{k}={v}" for k, v in env.items()],
                      Cmd=cmd, Entrypoint=entrypoint or None, Labels=labels,
                      WorkingDir=spec.workdir, User=user)
        c = Container(id=info.id, name=name or _random_name(), image=image_name,
                      image_id=found.digest, command=command, config=stored,
                      host_config={**hc, "Runtime": _runtime_name(backend)}, backend=backend,
                      created=info.created)
        with self._lock:
            self.containers[c.id] = c
        try:
            self._save(c)
        except OSError as e:
            self.containers.pop(c.id, None)
            with contextlib.suppress(SandboxError):
                self.node.kill(c.id)
            raise HttpError(500, f"cannot record the container: {e}") from None
        self.emit(c, "create")
        return c

    def _refuse(self, body: dict[str, Any], hc: dict[str, Any]) -> None:
        for k, what in _REFUSED_HOST.items():
            v = hc.get(k)
            if v and v != {} and v != []:
                raise HttpError(400, f"HostConfig.{k}: {what} are not supported by lazyfs "
                                     "sandboxes (their files are the image's and their own: "
                                     "copy files in with `docker cp` / put_archive)")
        for k, mode in _HOST_MODES.items():
            if str(hc.get(k) or "") == "host" and mode:
                raise HttpError(400, f"HostConfig.{k}=host: {mode} is never shared with a "
                                     "sandbox")
        rp = (hc.get("RestartPolicy") or {}).get("Name") or ""
        if rp not in ("", "no"):
            raise HttpError(400, f"HostConfig.RestartPolicy {rp}: restart policies are not "
                                 "supported (restart containers with `docker restart`)")
        if body.get("Volumes"):
            raise HttpError(400, "Config.Volumes: volumes are not supported by lazyfs sandboxes")
        nm = str(hc.get("NetworkMode") or "")
        if nm not in ("", "default", "none", "bridge"):
            raise HttpError(400, f"HostConfig.NetworkMode {nm}: lazyfs serves none (the "
                                 "default: loopback only) and bridge (outbound access)")

    # -- run ---------------------------------------------------------------------------
    def start(self, ref: str) -> bool:
        """False when it was running already (304)."""
        c = self.get(ref)
        with self._lock:
            if c.status in ("running", "paused"):
                return False
            if c.removed or c.status in ("removing", "dead"):
                raise HttpError(409, f"container {c.id} is being removed")
            c.runs += 1
            run = Run(n=c.runs)
            c.main = run
            c.status = "running"
            c.started_at = _now()
            c.finished_at = 0.0
            c.exit_code = 0
            c.error = ""
            c.oom_killed = False
            c.stopping = False
            waiting_stdin = c.stdin_wanted
            self.changed.notify_all()
        if waiting_stdin:
            threading.Thread(target=self._start_after_stdin, args=(c, run), daemon=True,
                             name=f"docker-stdin-{c.id}").start()
        else:
            self._launch(c, run, b"")
        self.emit(c, "start")
        return True

    def _start_after_stdin(self, c: Container, run: Run) -> None:
        c.stdin_ready.wait()
        with self._lock:
            data, c.stdin, c.stdin_wanted = c.stdin or b"", None, False
            c.stdin_ready.clear()
        self._launch(c, run, data)

    def _launch(self, c: Container, run: Run, stdin: bytes) -> None:
        def sink(stream: int) -> Callable[[bytes], None]:
            def put(data: bytes) -> None:
                with self.changed:
                    c.log.append((_now(), STDOUT if c.tty else stream, data))
                    c.log_bytes += len(data)
                    if c.log_bytes > KEPT_LOG:  # the oldest quarter goes
                        n, dropped = 0, 0
                        while n < len(c.log) - 1 and dropped < KEPT_LOG // 4:
                            dropped += len(c.log[n][2])
                            n += 1
                        del c.log[:n]
                        c.log_bytes -= dropped
                        c.log_start += n
                    self.changed.notify_all()
            return put

        def done(result: ExecResult | None, error: SandboxError | None) -> None:
            self._ended(c, run, result, error)

        req = ExecRequest(cmd=tuple(c.command), stdin=stdin, timeout=EXEC_TIMEOUT,
                          max_output_bytes=LOG_LIMIT)
        try:
            started = self.node.background.start(c.id, req, sink(STDOUT), sink(STDERR),
                                                 on_done=done)
        except SandboxError as e:
            self._ended(c, run, None, e)
            raise to_http(e) from None
        run.exec_id = started.id

    def _ended(self, c: Container, run: Run, result: ExecResult | None,
               error: SandboxError | None) -> None:
        if result is None and error is not None:
            result = getattr(error, "result", None)
        with self.changed:
            if run.done:
                return
            run.done = True
            c.finished += 1
            c.finished_at = _now()
            c.exit_code = result.exit_code if result is not None else 137
            c.oom_killed = bool(result is not None and result.oom_killed)
            if error is not None and result is None:
                c.error = str(error)
            if c.status in ("running", "paused"):
                c.status = "exited"
            self.changed.notify_all()
            auto = bool(c.host_config.get("AutoRemove")) and not c.removed
        self.emit(c, "die", {"exitCode": str(c.exit_code)})
        if auto:
            try:
                self.remove(c.id, force=True)
            except HttpError as e:
                log.warning("auto-removing %s: %s", c.id, e.message)

    def _signal(self, c: Container, sig: int) -> None:
        run = c.main
        if run is None or run.exec_id is None:
            return
        try:
            self.node.signal(c.id, run.exec_id, sig)
        except SandboxStateError:
            pass  # it ended meanwhile
        except SandboxError as e:
            raise to_http(e) from None

    def kill(self, ref: str, sig: str | None) -> None:
        c = self.get(ref)
        num = parse_signal(sig or "SIGKILL")
        with self._lock:
            if c.status not in ("running", "paused"):
                raise HttpError(409, f"Cannot kill container: {ref}: Container {c.id} is not "
                                     "running")
        if c.status == "paused" and num == signal.SIGKILL:
            self.unpause(c.id)
        self._signal(c, num)
        self.emit(c, "kill", {"signal": str(num)})

    def stop(self, ref: str, timeout: int | None, sig: str | None = None) -> bool:
        """False when it was not running (304)."""
        c = self.get(ref)
        with self._lock:
            if c.status not in ("running", "paused"):
                return False
            c.stopping = True
            n = c.runs
        if c.status == "paused":
            self.unpause(c.id)
        num = parse_signal(sig or c.config.get("StopSignal") or "SIGTERM")
        t = timeout if timeout is not None else int(c.config.get("StopTimeout") or 10)
        self._signal(c, num)
        if not self.wait_until(c, lambda: c.finished >= n, max(t, 0)):
            self._signal(c, signal.SIGKILL)
            self.wait_until(c, lambda: c.finished >= n, 30)
        self.emit(c, "stop")
        return True

    def restart(self, ref: str, timeout: int | None) -> None:
        c = self.get(ref)
        self.stop(c.id, timeout)
        c.restarts += 1
        self._save(c)
        self.start(c.id)
        self.emit(c, "restart")

    def pause(self, ref: str) -> None:
        c = self.get(ref)
        if c.status != "running":
            raise HttpError(409, f"Container {c.id} is not running" if c.status != "paused"
                            else f"Container {c.id} is already paused")
        try:
            self.node.pause(c.id)
        except SandboxError as e:
            raise to_http(e) from None
        with self.changed:
            if c.status == "running":  # (its main process may have ended meanwhile)
                c.status = "paused"
            self.changed.notify_all()
        self.emit(c, "pause")

    def unpause(self, ref: str) -> None:
        c = self.get(ref)
        if c.status != "paused":
            raise HttpError(409, f"Container {c.id} is not paused")
        try:
            self.node.resume(c.id)
        except SandboxError as e:
            raise to_http(e) from None
        with self.changed:
            c.status = "running" if c.main is not None and not c.main.done else "exited"
            self.changed.notify_all()
        self.emit(c, "unpause")

    def rename(self, ref: str, name: str) -> None:
        c = self.get(ref)
        if not name or not _NAME.match(name):
            raise HttpError(400, f"Invalid container name ({name}), only "
                                 "[a-zA-Z0-9][a-zA-Z0-9_.-] are allowed")
        name = name.lstrip("/")
        with self._lock:
            if any(o.name == name and o is not c for o in self.containers.values()):
                raise HttpError(409, f'Conflict. The container name "/{name}" is already in use')
            old, c.name = c.name, name
            self._save(c)
        self.emit(c, "rename", {"oldName": f"/{old}"})

    def remove(self, ref: str, force: bool) -> None:
        c = self.get(ref)
        with self._lock:
            if c.removed:
                return
            if c.status in ("running", "paused") and not force:
                raise HttpError(409, f"cannot remove container \"/{c.name}\": container is "
                                     f"{c.status}: stop the container before removing or "
                                     "force remove")
            c.removed = True
            c.status = "removing"
        try:
            self.node.kill(c.id)
        except SandboxNotFound:
            pass
        except SandboxError as e:
            with self._lock:
                c.removed, c.status = False, "dead"
            raise to_http(e) from None
        with self.changed:
            if c.main is not None and not c.main.done:  # its command went with the sandbox
                c.main.done = True
                c.finished += 1
                c.exit_code, c.finished_at = 137, _now()
            self.containers.pop(c.id, None)
            self._forget(c)
            for x in [x for x in self.execs.values() if x.container == c.id]:
                self.execs.pop(x.id, None)
            c.status = "removed"
            c.stdin_ready.set()
            self.changed.notify_all()
        self.emit(c, "destroy")

    def wait_until(self, c: Container, cond: Callable[[], bool], timeout: float | None
                   ) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while not cond():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.changed.wait(1.0 if left is None else min(left, 1.0))
            return True

    def top(self, ref: str) -> tuple[list[str], list[list[str]]]:
        """The container's processes as the host sees them (its cgroup's
        members, read from /proc: nothing the sandbox prints is trusted)."""
        c = self.get(ref)
        if c.status not in ("running", "paused"):
            raise HttpError(409, f"container {c.id} is not running")
        if c.backend != "container":
            raise HttpError(501, f"top: the {c.backend} backend's processes are in its guest")
        from ..isolation import cgroups
        procs = []
        for pid in sorted(cgroups.pids(c.id)):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # it ended meanwhile
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            cmd = b" ".join(a for a in argv if a).decode(errors="replace") or \
                f"[{fields.get('Name', '?').strip()}]"
            procs.append([fields.get("Uid", "?").split()[0], str(pid),
                          fields.get("PPid", "?").strip(), cmd])
        return ["UID", "PID", "PPID", "CMD"], procs

    # -- logs ------------------------------------------------------------------------
    def log_after(self, c: Container, cursor: int, timeout: float
                  ) -> tuple[list[tuple[float, int, bytes]], int]:
        """Output kept after `cursor` (an index into all output), waiting up
        to `timeout` for some."""
        with self.changed:
            if cursor >= c.log_start + len(c.log) and timeout > 0:
                self.changed.wait(timeout)
            start = max(cursor - c.log_start, 0)
            out = c.log[start:]
            return out, c.log_start + len(c.log)

    # -- execs -----------------------------------------------------------------------
    def exec_create(self, ref: str, body: Any) -> Exec:
        c = self.get(ref)
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        self._running(c)
        cmd = as_list(body.get("Cmd"), "Cmd")
        if not cmd:
            raise HttpError(400, "No exec command specified")
        if body.get("Privileged"):
            raise HttpError(400, "Privileged: privileged execs are not supported")
        if str(body.get("User") or "") not in _ROOT_USERS:
            raise HttpError(400, f"User {body.get('User')!r}: lazyfs runs a sandbox's commands "
                                 "as the root of its own user namespace")
        e = Exec(id=secrets.token_hex(32), container=c.id,
                 config={**body, "Cmd": cmd})
        self.exec_request(e, b"")  # (a bad command or environment: 400 now, not at start)
        with self._lock:
            self.execs[e.id] = e
        self.emit(c, "exec_create", {"execID": e.id})
        return e

    def _running(self, c: Container) -> None:
        if c.status == "paused":
            raise HttpError(409, f"Container {c.id} is paused, unpause the container before "
                                 "exec")
        if c.status != "running":
            raise HttpError(409, f"container {c.id} is not running")

    def exec_request(self, e: Exec, stdin: bytes) -> ExecRequest:
        env: dict[str, str] = {}
        for item in as_list(e.config.get("Env"), "Env") or []:
            k, sep, v = item.partition("=")
            if sep:
                env[k] = v
        try:
            return build(ExecRequest, cmd=tuple(e.config["Cmd"]),
                         cwd=e.config.get("WorkingDir") or None, env=env, stdin=stdin,
                         timeout=EXEC_TIMEOUT, max_output_bytes=LOG_LIMIT)
        except InvalidSpec as err:
            raise HttpError(400, f"invalid exec configuration: {err}") from None

    def exec_begin(self, e: Exec) -> Container:
        c = self.get(e.container)
        with self._lock:
            if e.started:
                raise HttpError(409, f"exec {e.id} has already been started")
            self._running(c)
            e.started = e.running = True
        return c

    def exec_end(self, e: Exec, result: ExecResult | None, error: SandboxError | None) -> None:
        if result is None and error is not None:
            result = getattr(error, "result", None)
        with self.changed:
            e.running = False
            e.exit_code = result.exit_code if result is not None else 126
            self.changed.notify_all()

    def exec_detached(self, e: Exec) -> None:
        c = self.exec_begin(e)
        try:
            self.node.background.start(c.id, self.exec_request(e, b""),
                                       on_done=lambda r, err: self.exec_end(e, r, err))
        except SandboxError as err:
            self.exec_end(e, None, err)
            raise to_http(err) from None

    # -- views -----------------------------------------------------------------------
    def inspect(self, ref: str) -> dict[str, Any]:
        c = self.get(ref)
        with self._lock:
            state = {"Status": c.status, "Running": c.status in ("running", "paused"),
                     "Paused": c.status == "paused", "Restarting": False,
                     "OOMKilled": c.oom_killed, "Dead": c.status == "dead", "Pid": 0,
                     "ExitCode": c.exit_code, "Error": c.error,
                     "StartedAt": iso(c.started_at), "FinishedAt": iso(c.finished_at)}
            config = {**c.config, "Image": c.image}
        return {"Id": c.id, "Created": iso(c.created), "Path": c.command[0],
                "Args": c.command[1:], "State": state, "Image": c.image_id,
                "Name": f"/{c.name}", "RestartCount": c.restarts, "Driver": "lazyfs",
                "Platform": "linux", "MountLabel": "", "ProcessLabel": "", "AppArmorProfile": "",
                "ExecIDs": [e.id for e in self.execs.values() if e.container == c.id] or None,
                "HostConfig": c.host_config, "Config": config, "Mounts": [],
                "GraphDriver": {"Name": "lazyfs", "Data": None},
                "NetworkSettings": {"Networks": {}, "IPAddress": "", "Ports": {}}}

    def summary(self, c: Container) -> dict[str, Any]:
        now = _now()
        if c.status == "running":
            status = f"Up {ago(now - c.started_at)}"
        elif c.status == "paused":
            status = f"Up {ago(now - c.started_at)} (Paused)"
        elif c.status == "exited":
            status = f"Exited ({c.exit_code}) {ago(now - c.finished_at)} ago"
        else:
            status = c.status.capitalize()
        return {"Id": c.id, "Names": [f"/{c.name}"], "Image": c.image, "ImageID": c.image_id,
                "Command": shlex.join(c.command), "Created": int(c.created), "State": c.status,
                "Status": status, "Labels": c.labels, "Ports": [], "Mounts": [],
                "HostConfig": {"NetworkMode": c.host_config.get("NetworkMode") or "none"},
                "NetworkSettings": {"Networks": {}}}

    def list(self, all_: bool, f: dict[str, list[str]], limit: int | None) -> list[dict[str, Any]]:
        check_filters(f, ("label", "status", "id", "name", "ancestor", "exited", "before",
                          "since"))
        with self._lock:
            cs = sorted(self.containers.values(), key=lambda c: c.created, reverse=True)
        out = []
        for c in cs:
            if not all_ and c.status not in ("running", "paused") and "status" not in f:
                continue
            if "label" in f and not labels_match(c.labels, f["label"]):
                continue
            if "status" in f and c.status not in f["status"]:
                continue
            if "id" in f and not any(c.id.startswith(x) for x in f["id"]):
                continue
            if "name" in f and not any(re.search(x, c.name) for x in f["name"]):
                continue
            if "exited" in f and not (c.status == "exited"
                                      and str(c.exit_code) in f["exited"]):
                continue
            if "ancestor" in f:
                wanted = set()
                for a in f["ancestor"]:
                    try:
                        wanted.add(self.images.find(a).digest)
                    except HttpError:
                        pass
                if c.image_id not in wanted:
                    continue
            out.append(self.summary(c))
        return out[:limit] if limit and limit > 0 else out

    # -- files ---------------------------------------------------------------------------
    def stat(self, c: Container, path: str) -> dict[str, Any]:
        try:
            info = self.node.stat(c.id, path)
        except FileError as e:
            raise HttpError(404, f"Could not find the file {path} in container {c.name}: "
                                 f"{e}") from None
        except SandboxError as e:
            raise to_http(e) from None
        mode = info.mode
        kinds = {"dir": 0o20000000000, "symlink": 0o1000000000}  # Go's os.ModeDir, ModeSymlink
        target = ""
        if info.type == "symlink":
            target = path
        return {"name": info.name, "size": info.size, "mode": mode | kinds.get(info.type, 0),
                "mtime": iso(info.mtime), "linkTarget": target}


def to_http(e: SandboxError) -> HttpError:
    """A node error in Docker's words and status."""
    if isinstance(e, SandboxNotFound):
        return HttpError(404, f"No such container: {e}")
    if isinstance(e, ImageNotFound):
        return HttpError(404, f"No such image: {e}")
    if isinstance(e, InvalidSpec | FileError):
        return HttpError(400, str(e))
    if isinstance(e, SandboxStateError):
        return HttpError(409, str(e))
    if isinstance(e, Unsupported):
        return HttpError(501, str(e))
    if isinstance(e, QuotaExceeded):
        return HttpError(503, str(e))
    return HttpError(500, str(e))


def parse_signal(sig: str | int) -> int:
    s = str(sig).upper()
    if s.isdigit():
        n = int(s)
    else:
        name = s if s.startswith("SIG") else f"SIG{s}"
        try:
            n = int(signal.Signals[name])
        except KeyError:
            raise HttpError(400, f"Invalid signal: {sig}") from None
    try:
        signal.Signals(n)
    except ValueError:
        raise HttpError(400, f"Invalid signal: {sig}") from None
    return n


def _network(hc: dict[str, Any]) -> NetworkPolicy:
    if str(hc.get("NetworkMode") or "") == "bridge":
        return NetworkPolicy(mode="allowlist", allow=(
            Rule(cidr="0.0.0.0/0", protocol="tcp"), Rule(cidr="0.0.0.0/0", protocol="udp")))
    return NetworkPolicy()


def _number(hc: dict[str, Any], key: str) -> int:
    """HostConfig.<key> as an integer (absent or null: 0); 400 naming it otherwise."""
    v = hc.get(key)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        raise HttpError(400, f"HostConfig.{key}: expected an integer, not {v!r}"[:200])
    return v


def _cpus(hc: dict[str, Any]) -> float | None:
    nano = _number(hc, "NanoCpus")
    if nano:
        return nano / 1e9
    quota, period = _number(hc, "CpuQuota"), _number(hc, "CpuPeriod")
    if quota > 0:
        return quota / (period or 100_000)
    return None


def _runtime_name(backend: str) -> str:
    return f"lazyfs-{backend}"


_LEFT = ("brave", "calm", "eager", "fond", "keen", "lucid", "quiet", "sharp", "swift", "witty")
_RIGHT = ("archimedes", "curie", "euler", "gauss", "hopper", "lovelace", "noether", "turing")


def _random_name() -> str:
    return (f"{secrets.choice(_LEFT)}_{secrets.choice(_RIGHT)}_"
            f"{secrets.token_hex(3)}")


def iter_lines(data: bytes) -> Iterator[bytes]:
    """data split after each newline (a last line without one included)."""
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end + 1
        yield data[start:end]
        start = end
