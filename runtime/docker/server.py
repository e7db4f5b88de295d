"""The Docker Engine API's routes (the part harnesses use) over Engine and
DockerImages, on a Unix socket: `lazyfs agent --docker-socket PATH`.

Node calls run in worker threads (at most THREADS at once); waiting calls
(wait, logs -f, attach, events) wait in threads too, a second at a time,
so a client that goes away is noticed at its next write.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import platform
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from ..errors import BackendUnavailable, FileError, InvalidSpec, SandboxError
from ..node import Node
from .engine import STDIN_LIMIT, Container, Engine, iter_lines, to_http
from .http import (
    API_VERSION,
    MIN_API_VERSION,
    MULTIPLEXED,
    RAW_STREAM,
    HttpError,
    Raw,
    Request,
    Router,
    bind_tcp,
    bind_unix,
    make_tls_context,
    serve,
)
from .images import DockerImages, hub_short, registry_auth
from .shapes import STDERR, STDOUT, filters, frame, iso, since_time

log = logging.getLogger(__name__)

THREADS = 256
EXEC_THREADS = 4096
WAIT_THREADS = 1024
T = TypeVar("T")
ARCHIVE_LIMIT = (1 << 30) + (64 << 20)  # files.MAX_ARCHIVE plus the tar's own headers
_NOT_SERVED = {
    "build": "building images: build with `lazyfs build` or `lazyfs convert`, then run the "
             "image by its tag",
    "volumes": "volumes: a sandbox's files are its image's and its own; copy files in with "
               "`docker cp` (PUT /containers/{id}/archive)",
    "networks": "networks: a sandbox's network is HostConfig.NetworkMode none (the default) "
                "or bridge",
    "swarm": "swarm", "services": "swarm services", "nodes": "swarm nodes",
    "tasks": "swarm tasks", "secrets": "secrets", "configs": "configs",
    "plugins": "plugins", "session": "build sessions", "distribution": "distribution",
}


class DockerServer:
    def __init__(self, node: Node, certs_dir: Path | None = None) -> None:
        self.node = node
        self.images = DockerImages(node, certs_dir)
        self.engine = Engine(node, self.images)
        self.limiter = trio.CapacityLimiter(THREADS)  # calls of the node
        # commands run (an exec holds its thread while it runs) and waits (a
        # second at a time): neither takes the calls' threads
        self.exec_limiter = trio.CapacityLimiter(EXEC_THREADS)
        self.wait_limiter = trio.CapacityLimiter(WAIT_THREADS)
        self.router = Router()
        r = self.router.add
        r("GET", "/_ping", self.ping)
        r("GET", "/version", self.version)
        r("GET", "/info", self.info)
        r("GET", "/events", self.events)
        r("POST", "/auth", self.auth)
        r("GET", "/images/json", self.images_list)
        r("POST", "/images/create", self.images_pull)
        r("GET", "/images/{name:path}/json", self.images_inspect)
        r("POST", "/images/{name:path}/tag", self.images_tag)
        r("DELETE", "/images/{name:path}", self.images_remove)
        r("POST", "/commit", self.commit)
        r("POST", "/containers/create", self.create)
        r("GET", "/containers/json", self.containers_list)
        r("GET", "/containers/{id}/json", self.inspect)
        r("POST", "/containers/{id}/start", self.start)
        r("POST", "/containers/{id}/wait", self.wait)
        r("POST", "/containers/{id}/attach", self.attach)
        r("GET", "/containers/{id}/logs", self.logs)
        r("POST", "/containers/{id}/stop", self.stop)
        r("POST", "/containers/{id}/kill", self.kill)
        r("POST", "/containers/{id}/restart", self.restart)
        r("POST", "/containers/{id}/pause", self.pause)
        r("POST", "/containers/{id}/unpause", self.unpause)
        r("POST", "/containers/{id}/rename", self.rename)
        r("POST", "/containers/{id}/resize", self.accept)
        r("DELETE", "/containers/{id}", self.remove)
        r("GET", "/containers/{id}/top", self.top)
        r("HEAD", "/containers/{id}/archive", self.archive_head)
        r("GET", "/containers/{id}/archive", self.archive_get)
        r("PUT", "/containers/{id}/archive", self.archive_put)
        r("POST", "/containers/{id}/exec", self.exec_create)
        r("POST", "/exec/{id}/start", self.exec_start)
        r("POST", "/exec/{id}/resize", self.accept)
        r("GET", "/exec/{id}/json", self.exec_inspect)
        self.router.fallback = self.not_served

    async def _thread(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        try:
            return await trio.to_thread.run_sync(functools.partial(fn, *args, **kw),
                                                 limiter=self.limiter)
        except SandboxError as e:
            raise to_http(e) from None

    async def _wait(self, fn: Callable[..., T], *args: Any) -> T:
        """A wait of a second or so, in a thread of the waits' own."""
        return await trio.to_thread.run_sync(functools.partial(fn, *args),
                                             limiter=self.wait_limiter)

    # -- system ----------------------------------------------------------------------
    async def ping(self, req: Request) -> None:
        await req.conn.send(200, b"OK", "text/plain; charset=utf-8", headers=[
            ("Ostype", "linux"), ("Docker-Experimental", "false"), ("Builder-Version", "1"),
            ("Cache-Control", "no-cache, no-store, must-revalidate"), ("Pragma", "no-cache")])

    async def version(self, req: Request) -> None:
        from importlib.metadata import version
        __version__ = version("lazyfs")
        await req.conn.json(200, {
            "Platform": {"Name": "lazyfs"}, "Version": __version__,
            "ApiVersion": API_VERSION, "MinAPIVersion": MIN_API_VERSION,
            "Os": "linux", "Arch": "amd64", "KernelVersion": platform.release(),
            "GitCommit": "", "GoVersion": "", "BuildTime": "",
            "Components": [{"Name": "lazyfs", "Version": __version__, "Details": {}}]})

    async def info(self, req: Request) -> None:
        with self.engine._lock:
            cs = list(self.engine.containers.values())
        caps = {"Name": "lazyfs-container"}
        await req.conn.json(200, {
            "ID": self.node.config.node_id or "lazyfs", "Name": platform.node(),
            "Containers": len(cs),
            "ContainersRunning": sum(c.status == "running" for c in cs),
            "ContainersPaused": sum(c.status == "paused" for c in cs),
            "ContainersStopped": sum(c.status in ("exited", "created") for c in cs),
            "Images": len(await self._thread(self.images.tags)), "Driver": "lazyfs",
            "OperatingSystem": "lazyfs sandboxes", "OSType": "linux", "Architecture": "x86_64",
            "KernelVersion": platform.release(), "ServerVersion": API_VERSION,
            "Runtimes": {"lazyfs-container": caps, "lazyfs-microvm": {"Name": "lazyfs-microvm"},
                         "lazyfs-vm": {"Name": "lazyfs-vm"}},
            "DefaultRuntime": "lazyfs-container", "CgroupDriver": "cgroupfs",
            "CgroupVersion": "1", "Swarm": {"LocalNodeState": "inactive"},
            "SecurityOptions": ["name=userns", "name=seccomp,profile=lazyfs",
                                "name=landlock"], "Warnings": None})

    async def not_served(self, req: Request) -> None:
        first = req.path.strip("/").split("/")[0]
        what = _NOT_SERVED.get(first)
        if what is None and req.path.startswith("/containers/") and req.path.endswith(
                ("/export", "/stats", "/changes", "/update")):
            what = req.path.rsplit("/", 1)[1]
        if what is None and req.path.startswith("/images/"):
            what = "this image operation (push, save, load, search, history)"
        raise HttpError(501 if what else 404,
                        f"lazyfs's Docker endpoint does not serve {what}" if what
                        else f"page not found: {req.method} {req.path}")

    async def auth(self, req: Request) -> None:
        body = await req.json()
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        await self._thread(self.images.login, body)
        await req.conn.json(200, {"Status": "Login Succeeded", "IdentityToken": ""})

    async def accept(self, req: Request) -> None:
        """(resizing a terminal that is not there)"""
        await req.body(1 << 16)
        await req.conn.send(200, b"")

    # -- images ----------------------------------------------------------------------
    async def images_list(self, req: Request) -> None:
        await req.conn.json(200, await self._thread(self.images.all))

    async def images_inspect(self, req: Request) -> None:
        await req.conn.json(200, await self._thread(self.images.inspect, req.params["name"]))

    async def images_tag(self, req: Request) -> None:
        repo = req.arg("repo")
        if not repo:
            raise HttpError(400, "repository name (repo) is required")
        await self._thread(self.images.tag, req.params["name"], repo, req.arg("tag"))
        await req.conn.send(201, b"")

    async def images_remove(self, req: Request) -> None:
        out = await self._thread(self.images.remove, req.params["name"], req.flag("force"),
                                 self.engine.using)
        await req.conn.json(200, out)

    async def images_pull(self, req: Request) -> None:
        image = req.arg("fromImage")
        if req.arg("fromSrc"):
            raise HttpError(501, "lazyfs's Docker endpoint does not import archives: use "
                                 "`lazyfs convert tar:FILE TAG`")
        if not image:
            raise HttpError(400, "fromImage is required")
        tag = req.arg("tag") or ""
        ref = f"{image}@{tag}" if tag.startswith("sha256:") else (
            f"{image}:{tag}" if tag else image)
        auth = registry_auth(req.headers.get("x-registry-auth"))
        send, receive = trio.open_memory_channel[dict[str, Any]](1000)
        out = await req.conn.start(200, "application/json")

        def report(line: dict[str, Any]) -> None:
            trio.from_thread.run_sync(send.send_nowait, line)

        async def pull() -> None:
            async with send:
                try:
                    await self._thread(self.images.pull, ref, auth, report)
                except HttpError as e:
                    await send.send({"errorDetail": {"message": e.message},
                                     "error": e.message})

        async with trio.open_nursery() as n:
            n.start_soon(pull)
            async with receive:
                async for line in receive:
                    await out.line(line)
        await out.end()

    async def commit(self, req: Request) -> None:
        c = self.engine.get(req.arg("container") or "")
        if req.query.get("changes") and any(req.query["changes"]):
            raise HttpError(400, "changes: Dockerfile instructions on commit are not supported "
                                 "(the committed image keeps its base image's config)")
        repo, tag = hub_short(req.arg("repo") or ""), req.arg("tag") or ""
        name = (f"{repo}:{tag}" if tag else repo) if repo else None
        snap = await self._thread(self.node.snapshot, c.id, name)
        await req.conn.json(201, {"Id": snap.image})

    # -- containers ------------------------------------------------------------------
    async def create(self, req: Request) -> None:
        body = await req.json()
        made: list[str] = []

        def create() -> Container:
            with self.node.recovery.answer_due(made):  # (until the client has its id)
                return self.engine.create(body, req.arg("name"))
        c = await self._thread(create)
        await req.conn.json(201, {"Id": c.id, "Warnings": []})
        self.node.recovery.answered(made)

    async def containers_list(self, req: Request) -> None:
        out = self.engine.list(req.flag("all"), filters(req.arg("filters")),
                               req.number("limit"))
        await req.conn.json(200, out)

    async def inspect(self, req: Request) -> None:
        await req.conn.json(200, self.engine.inspect(req.params["id"]))

    async def start(self, req: Request) -> None:
        started = await self._thread(self.engine.start, req.params["id"])
        await req.conn.send(204 if started else 304, b"")

    async def stop(self, req: Request) -> None:
        done = await self._thread(self.engine.stop, req.params["id"], req.number("t"),
                                  req.arg("signal"))
        await req.conn.send(204 if done else 304, b"")

    async def kill(self, req: Request) -> None:
        await self._thread(self.engine.kill, req.params["id"], req.arg("signal"))
        await req.conn.send(204, b"")

    async def restart(self, req: Request) -> None:
        await self._thread(self.engine.restart, req.params["id"], req.number("t"))
        await req.conn.send(204, b"")

    async def pause(self, req: Request) -> None:
        await self._thread(self.engine.pause, req.params["id"])
        await req.conn.send(204, b"")

    async def unpause(self, req: Request) -> None:
        await self._thread(self.engine.unpause, req.params["id"])
        await req.conn.send(204, b"")

    async def rename(self, req: Request) -> None:
        self.engine.rename(req.params["id"], req.arg("name") or "")
        await req.conn.send(204, b"")

    async def remove(self, req: Request) -> None:
        await self._thread(self.engine.remove, req.params["id"], req.flag("force"))
        await req.conn.send(204, b"")

    async def top(self, req: Request) -> None:
        titles, procs = await self._thread(self.engine.top, req.params["id"])
        await req.conn.json(200, {"Titles": titles, "Processes": procs})

    async def wait(self, req: Request) -> None:
        c = self.engine.get(req.params["id"])
        cond = req.arg("condition") or "not-running"
        e = self.engine
        with e._lock:
            if cond == "next-exit":
                n = c.finished + 1
                done: Callable[[], bool] = lambda: c.finished >= n or c.removed
            elif cond == "removed":
                done = lambda: c.status == "removed"
            elif cond == "not-running":
                done = lambda: c.status not in ("running", "paused")
            else:
                raise HttpError(400, f"invalid condition: {cond!r}")
        out = await req.conn.start(200, "application/json")  # the wait is registered
        while not await self._wait(e.wait_until, c, done, 1.0):
            pass
        err = {"Message": c.error} if c.error else None
        await out.line({"StatusCode": c.exit_code, "Error": err})
        await out.end()

    async def attach(self, req: Request) -> None:
        c = self.engine.get(req.params["id"])
        want_in = req.flag("stdin") and bool(c.config.get("OpenStdin"))
        wanted = {STDOUT: req.flag("stdout"), STDERR: req.flag("stderr")}
        with self.engine._lock:
            target = c.runs if c.status in ("running", "paused") else c.runs + 1
            cursor = 0 if req.flag("logs") else c.log_start + len(c.log)
            if want_in and c.status not in ("running", "paused"):
                c.stdin_wanted = True
        def give(data: bytes) -> None:  # the next run starts with this stdin
            with self.engine._lock:
                if not c.stdin_ready.is_set():
                    c.stdin = data
                    c.stdin_ready.set()

        try:
            raw = await req.conn.hijack(req, RAW_STREAM if c.tty else MULTIPLEXED)

            async def stdin() -> None:
                data = b""
                try:
                    data = await raw.read_all(STDIN_LIMIT)
                finally:  # (whatever ends it: the command never waits for ever)
                    give(data)

            async with trio.open_nursery() as n:
                if want_in:
                    n.start_soon(stdin)
                if req.flag("stream", True):
                    await self._follow(c, raw, cursor, wanted,
                                       lambda: c.finished >= target or c.status == "removed")
                    n.cancel_scope.cancel()
        finally:
            if want_in:
                give(b"")

    async def _follow(self, c: Container, raw: Raw | Any, cursor: int,
                      wanted: dict[int, bool], until: Callable[[], bool],
                      timestamps: bool = False) -> None:
        while True:
            over = until()
            entries, cursor = await self._wait(self.engine.log_after, c, cursor,
                                               0 if over else 1.0)
            for t, stream, data in entries:
                if wanted.get(stream):
                    if timestamps:
                        data = b"".join(iso(t).encode() + b" " + ln for ln in iter_lines(data))
                    await raw.write(data if c.tty else frame(stream, data))
            if over and not entries:
                return

    async def logs(self, req: Request) -> None:
        c = self.engine.get(req.params["id"])
        wanted = {STDOUT: req.flag("stdout"), STDERR: req.flag("stderr")}
        if not any(wanted.values()):
            raise HttpError(400, "You must choose at least one stream")
        since, until = since_time(req.arg("since")), since_time(req.arg("until"))
        tail = req.arg("tail") or "all"
        with self.engine._lock:
            kept = [x for x in c.log if wanted.get(x[1])
                    and (since is None or x[0] >= since) and (until is None or x[0] <= until)]
            end = c.log_start + len(c.log)
        if tail != "all":
            try:
                n = int(tail)
            except ValueError:
                raise HttpError(400, f"invalid tail {tail!r}") from None
            kept = _tail(kept, n)
        out = await req.conn.start(200, RAW_STREAM if c.tty else MULTIPLEXED)
        ts = req.flag("timestamps")
        for t, stream, data in kept:
            if ts:
                data = b"".join(iso(t).encode() + b" " + ln for ln in iter_lines(data))
            await out.write(data if c.tty else frame(stream, data))
        if req.flag("follow") and until is None:
            run = c.runs
            await self._follow(c, out, end, wanted,
                               lambda: c.status not in ("running", "paused")
                               or c.finished >= run, ts)
        await out.end()

    # -- files -----------------------------------------------------------------------
    def _path(self, req: Request) -> str:
        path = req.arg("path")
        if not path:
            raise HttpError(400, "path is required")
        return path if path.startswith("/") else "/" + path

    async def _stat_header(self, c: Container, path: str) -> tuple[str, str]:
        st = await self._thread(self.engine.stat, c, path)
        return ("X-Docker-Container-Path-Stat",
                base64.b64encode(json.dumps(st).encode()).decode())

    async def archive_head(self, req: Request) -> None:
        c = self.engine.get(req.params["id"])
        header = await self._stat_header(c, self._path(req))
        await req.conn.send(200, b"", "application/x-tar", headers=[header])

    async def archive_get(self, req: Request) -> None:
        c = self.engine.get(req.params["id"])
        path = self._path(req)
        header = await self._stat_header(c, path)
        try:
            data = await self._thread(self.node.get_archive, c.id, path.rstrip("/") or "/")
        except HttpError as e:
            raise HttpError(404 if e.status == 400 else e.status, e.message) from None
        await req.conn.send(200, data, "application/x-tar", headers=[header])

    async def archive_put(self, req: Request) -> None:
        c = self.engine.get(req.params["id"])
        path = self._path(req)
        data = await req.body(ARCHIVE_LIMIT)
        try:
            await trio.to_thread.run_sync(functools.partial(
                self.node.put_archive, c.id, path, data,
                req.flag("copyUIDGID")), limiter=self.limiter)
        except FileError as e:
            status = 404 if "No such file" in str(e) else 400
            raise HttpError(status, f"{e}") from None
        except SandboxError as e:
            raise to_http(e) from None
        await req.conn.send(200, b"")

    # -- exec ------------------------------------------------------------------------
    async def exec_create(self, req: Request) -> None:
        body = await req.json()
        e = self.engine.exec_create(req.params["id"], body)
        await req.conn.json(201, {"Id": e.id})

    async def exec_inspect(self, req: Request) -> None:
        e = self.engine.exec_of(req.params["id"])
        cfg = e.config
        await req.conn.json(200, {
            "ID": e.id, "ContainerID": e.container, "Running": e.running,
            "ExitCode": e.exit_code, "Pid": e.pid, "OpenStdin": bool(cfg.get("AttachStdin")),
            "OpenStdout": bool(cfg.get("AttachStdout")),
            "OpenStderr": bool(cfg.get("AttachStderr")), "CanRemove": False,
            "DetachKeys": "", "ProcessConfig": {
                "tty": bool(cfg.get("Tty")), "entrypoint": cfg["Cmd"][0],
                "arguments": cfg["Cmd"][1:], "privileged": False, "user": ""}})

    async def exec_start(self, req: Request) -> None:
        e = self.engine.exec_of(req.params["id"])
        body = await req.json()
        if body.get("Detach"):
            await self._thread(self.engine.exec_detached, e)
            await req.conn.send(200, b"")
            return
        c = self.engine.exec_begin(e)
        tty = bool(body.get("Tty", e.config.get("Tty")))
        try:
            raw = await req.conn.hijack(req, RAW_STREAM if tty else MULTIPLEXED)
        except BaseException:
            self.engine.exec_end(e, None, None)
            raise
        stdin = b""
        try:
            if e.config.get("AttachStdin"):
                stdin = await raw.read_all(STDIN_LIMIT)
            execreq = self.engine.exec_request(e, stdin)
        except HttpError as err:
            self.engine.exec_end(e, None, None)
            await raw.write(frame(STDERR, f"lazyfs: {err.message}\n".encode()))
            return
        send, receive = trio.open_memory_channel[bytes](256)
        attach = {STDOUT: e.config.get("AttachStdout", True),
                  STDERR: e.config.get("AttachStderr", True)}

        def sink(stream: int) -> Callable[[bytes], None]:
            def put(data: bytes) -> None:
                if attach[stream]:
                    trio.from_thread.run(send.send, data if tty else frame(stream, data))
            return put

        async def run() -> None:
            async with send:
                result, error = None, None
                try:
                    result = await trio.to_thread.run_sync(
                        functools.partial(self.node.exec, c.id, execreq, sink(STDOUT),
                                          sink(STDERR)), limiter=self.exec_limiter)
                except SandboxError as err:
                    error = err
                    if getattr(err, "result", None) is None:
                        msg = f"lazyfs: {err}\n".encode()
                        await send.send(msg if tty else frame(STDERR, msg))
                finally:
                    self.engine.exec_end(e, result, error)

        async with trio.open_nursery() as n:
            n.start_soon(run)
            async with receive:
                async for data in receive:
                    try:
                        await raw.write(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # (the command runs on; its exit code is kept)

    # -- events ----------------------------------------------------------------------
    async def events(self, req: Request) -> None:
        f = filters(req.arg("filters"))
        since, until = since_time(req.arg("since")), since_time(req.arg("until"))
        out = await req.conn.start(200, "application/json")
        seq = 0
        if since is None:
            seq = self.engine.event_seq
        while True:
            batch = await self._wait(self.engine.events_after, seq, 1.0)
            for ev in batch:
                seq = ev["seq"]
                if since is not None and ev["time"] < since:
                    continue
                if until is not None and ev["time"] > until:
                    continue
                if _event_matches(ev, f, self.engine):
                    await out.line({k: v for k, v in ev.items() if k != "seq"})
            if until is not None and time.time() > until:
                break
        await out.end()


def _event_matches(ev: dict[str, Any], f: dict[str, list[str]], engine: Engine) -> bool:
    attrs = ev["Actor"]["Attributes"]
    for k, vals in f.items():
        if k == "type" and ev["Type"] not in vals:
            return False
        if k == "event" and ev["Action"] not in vals:
            return False
        if k == "container" and not any(ev["id"].startswith(v) or attrs.get("name") == v
                                        for v in vals):
            return False
        if k == "image" and attrs.get("image") not in vals:
            return False
        if k == "label":
            for v in vals:
                key, sep, val = v.partition("=")
                if key not in attrs or (sep and attrs[key] != val):
                    return False
    return True


def _tail(entries: list[tuple[float, int, bytes]], n: int) -> list[tuple[float, int, bytes]]:
    """The last n lines of the kept output."""
    if n < 0:
        return entries
    lines = [(t, s, ln) for t, s, data in entries for ln in iter_lines(data)]
    return lines[-n:] if n else []


def bind(options: DockerOptions) -> list[tuple[socket.socket, ssl.SSLContext | None]]:
    """The endpoint's sockets, bound now (before the agent serves: a bad
    address or certificate is one error line, nothing left bound)."""
    out: list[tuple[socket.socket, ssl.SSLContext | None]] = []
    try:
        if options.socket is not None:
            options.socket.parent.mkdir(parents=True, exist_ok=True)
            try:
                out.append((bind_unix(str(options.socket)), None))
            except OSError as e:
                raise BackendUnavailable(f"--docker-socket {options.socket}: "
                                         f"{e.strerror or e}") from None
        if options.listen:
            assert options.tls is not None
            try:
                context = make_tls_context(*options.tls)
            except (OSError, ssl.SSLError) as e:
                raise InvalidSpec(f"the Docker endpoint's TLS files {', '.join(options.tls)}: "
                                  f"{e}") from None
            for address in options.listen:
                try:
                    out.append((bind_tcp(address), context))
                except (OSError, OverflowError, ValueError) as e:
                    raise BackendUnavailable(f"--docker-listen {address}: cannot bind it: "
                                             f"{getattr(e, 'strerror', None) or e}") from None
    except BaseException:
        for sock, _ in out:
            sock.close()
        raise
    return out


async def serve_docker(node: Node, options: DockerOptions,
                       sockets: list[tuple[socket.socket, ssl.SSLContext | None]]) -> None:
    """Serve the endpoint on `sockets` (bind(options)) until cancelled."""
    await serve(sockets, DockerServer(node, options.certs_dir).router)


@dataclass(frozen=True)
class DockerOptions:
    """Where the endpoint serves: a Unix socket (0600) and TCP listeners
    (HOST:PORT, only with `tls`: the CA that issues the clients'
    certificates, the server's certificate and key, dockerd's --tlsverify),
    and where registries' CA certificates are (HOST/ca.crt, as dockerd's
    /etc/docker/certs.d)."""

    socket: Path | None = None
    certs_dir: Path | None = None
    listen: tuple[str, ...] = ()
    tls: tuple[str, str, str] | None = None  # (ca, cert, key) files

    def where(self) -> str:
        return " ".join([*([f"unix://{self.socket}"] if self.socket else []),
                         *(f"tcp://{a} (TLS, client certificates)" for a in self.listen)])

    def __post_init__(self) -> None:
        if self.listen and self.tls is None:
            raise ValueError("the Docker endpoint serves TCP only with TLS client "
                             "certificates")
