"""The HTTP/1.1 server under the Docker endpoint: h11 over trio streams.

Docker's API needs what an ASGI server does not give: a connection
"hijacked" after the response head (attach and exec start answer
`101 UPGRADED` and then carry raw stdin and multiplexed output both ways
on the socket, as dockerd does), and responses streamed for minutes (logs
-f, wait, events, pull progress). h11 parses and frames; this module
routes one request at a time per connection and bounds what a client can
make it hold: a request head of at most MAX_HEAD bytes (431 past it), a
body of at most what the route allows (413, read as it comes), an idle
keep-alive connection for IDLE_S.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import logging
import os
import re
import socket as socketlib
import ssl
import termios
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

log = logging.getLogger(__name__)

MAX_HEAD = 64 << 10
MAX_JSON = 4 << 20  # a JSON request body
IDLE_S = 120.0
TLS_HEAD_PAUSE_S = 0.02  # see _read_by_peer
HANDSHAKE_S = 10.0
BODY_IDLE_S = 60.0  # a request body that stops coming: the connection goes
READ_SIZE = 1 << 16
RAW_STREAM = "application/vnd.docker.raw-stream"
MULTIPLEXED = "application/vnd.docker.multiplexed-stream"


class HttpError(Exception):
    """An answer other than success: Docker's {"message": ...} with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Closed(Exception):
    """The client went away."""


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    conn: Connection
    params: dict[str, str] = field(default_factory=dict)  # from the route's pattern

    def arg(self, name: str, default: str | None = None) -> str | None:
        v = self.query.get(name)
        return v[-1] if v else default

    def flag(self, name: str, default: bool = False) -> bool:
        v = self.arg(name)
        if v is None:
            return default
        return v.lower() not in ("", "0", "false", "no")

    def number(self, name: str, default: int | None = None) -> int | None:
        v = self.arg(name)
        if v is None or v == "":
            return default
        try:
            return int(v)
        except ValueError:
            raise HttpError(400, f"invalid value for {name}: {v!r} is not a number") from None

    async def body(self, limit: int) -> bytes:
        return await self.conn.read_body(self, limit)

    async def json(self, limit: int = MAX_JSON) -> Any:
        raw = await self.body(limit)
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise HttpError(400, f"invalid JSON in the request body: {e}") from None


Handler = Callable[[Request], Awaitable[None]]


class Connection:
    """One client connection: requests one after another, and the answer to
    the current one (json / send / stream / hijack)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.answered = False
        self.method = ""
        self.hijacked = False
        self.keep = True  # keep the connection for another request
        self._body_done = False

    async def _next(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                if self.h11.they_are_waiting_for_100_continue:
                    await self._send(h11.InformationalResponse(status_code=100, headers=[]))
                data = await self.stream.receive_some(READ_SIZE)
                self.h11.receive_data(bytes(data))
                continue
            return event

    async def _send(self, event: Any) -> None:
        data = self.h11.send(event)
        if data:
            await self.stream.send_all(data)

    async def read_body(self, req: Request, limit: int) -> bytes:
        if self._body_done:
            return b""
        length = req.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            self.keep = False
            raise HttpError(413, f"the request body is {int(length):,} bytes; at most "
                                 f"{limit:,} are accepted here")
        parts: list[bytes] = []
        size = 0
        while True:
            with trio.move_on_after(BODY_IDLE_S) as idle:
                event = await self._next()
            if idle.cancelled_caught:
                self.keep = False
                raise HttpError(408, f"the request body stopped coming for {BODY_IDLE_S:g} s")
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    self.keep = False
                    raise HttpError(413, f"the request body is over {limit:,} bytes, the most "
                                         "accepted here")
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._body_done = True
                return b"".join(parts)
            elif isinstance(event, h11.ConnectionClosed):
                raise _Closed()

    # -- answers -----------------------------------------------------------------
    async def send(self, status: int, body: bytes = b"", content_type: str = "application/json",
                   headers: Iterable[tuple[str, str]] = ()) -> None:
        self.answered = True
        hs = [("Content-Type", content_type), ("Content-Length", str(len(body))),
              ("Api-Version", API_VERSION), ("Server", SERVER), *headers]
        if not self.keep:
            hs.append(("Connection", "close"))
        await self._send(h11.Response(status_code=status, headers=hs))
        if body and self.method != "HEAD":  # (a HEAD answer has the head only)
            await self._send(h11.Data(data=body))
        await self._send(h11.EndOfMessage())

    async def json(self, status: int, obj: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
        await self.send(status, json.dumps(obj).encode(), headers=headers)

    async def start(self, status: int, content_type: str) -> Streamed:
        """A streamed answer (chunked): write() its parts, end() it. (To a
        HEAD: the head only; the parts are dropped.)"""
        self.answered = True
        if self.method == "HEAD":
            await self._send(h11.Response(status_code=status, headers=[
                ("Content-Type", content_type), ("Api-Version", API_VERSION),
                ("Server", SERVER), ("Content-Length", "0")]))
            await self._send(h11.EndOfMessage())
            return _Dropped(self)
        await self._send(h11.Response(status_code=status, headers=[
            ("Content-Type", content_type), ("Api-Version", API_VERSION), ("Server", SERVER),
            ("Transfer-Encoding", "chunked")]))
        return Streamed(self)

    async def hijack(self, req: Request, content_type: str = RAW_STREAM) -> Raw:
        """Take the connection over: `101 UPGRADED` (the client asked for
        the upgrade, as the docker CLI and docker-py do) or `200` with no
        framing, then raw bytes both ways until it closes."""
        await self.read_body(req, MAX_JSON)  # (the request's own body comes first)
        self.answered = True
        self.keep = False
        self.hijacked = True
        upgrade = "upgrade" in req.headers.get("connection", "").lower()
        head = ("HTTP/1.1 101 UPGRADED\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n" if upgrade
                else "HTTP/1.1 200 OK\r\nConnection: close\r\n")
        head += f"Content-Type: {content_type}\r\nApi-Version: {API_VERSION}\r\n\r\n"
        await self.stream.send_all(head.encode())
        leftover, closed = self.h11.trailing_data
        return Raw(self.stream, bytes(leftover), closed)


async def _read_by_peer(stream: trio.abc.Stream, timeout: float = 2.0) -> None:
    """Wait until the client has read what was sent (a Unix socket's send
    queue, TIOCOUTQ, is empty). docker-py reads a hijacked answer's head
    through a buffered reader and then takes the raw socket: output sent
    before it read the head would sit in that buffer, lost. (dockerd's
    commands start slowly enough that this rarely shows; ours do not.)"""
    sock = getattr(stream, "socket", None)
    if sock is None or sock.family != trio.socket.AF_UNIX:
        # over TLS there is no telling what the client's process has read
        # (a TCP send queue empties when the peer's kernel has it): a pause
        await trio.sleep(TLS_HEAD_PAUSE_S)
        return
    buf = array.array("i", [0])
    with trio.move_on_after(timeout):
        while True:
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf, True)
            if buf[0] == 0:
                return
            await trio.sleep(0.0005)


class Streamed:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def write(self, data: bytes) -> None:
        if data:
            await self.conn._send(h11.Data(data=data))

    async def line(self, obj: Any) -> None:
        await self.write(json.dumps(obj).encode() + b"\r\n")

    async def end(self) -> None:
        await self.conn._send(h11.EndOfMessage())


class _Dropped(Streamed):
    async def write(self, data: bytes) -> None:
        return None

    async def end(self) -> None:
        return None


class Raw:
    """A hijacked connection."""

    def __init__(self, stream: trio.abc.Stream, leftover: bytes, closed: bool) -> None:
        self.stream = stream
        self._leftover = leftover
        self._eof = closed
        self._head_read = False

    async def write(self, data: bytes) -> None:
        if data:
            if not self._head_read:  # (the command starts meanwhile)
                await _read_by_peer(self.stream)
                self._head_read = True
            await self.stream.send_all(data)

    async def read(self) -> bytes:
        """What the client sends next; b"" once it closed its side."""
        if self._leftover:
            data, self._leftover = self._leftover, b""
            return data
        if self._eof:
            return b""
        try:
            data = bytes(await self.stream.receive_some(READ_SIZE))
        except trio.BrokenResourceError:
            data = b""
        if not data:
            self._eof = True
        return data

    async def read_all(self, limit: int) -> bytes:
        parts, size = [], 0
        while data := await self.read():
            size += len(data)
            if size > limit:
                raise HttpError(413, f"stdin is over {limit:,} bytes")
            parts.append(data)
        return b"".join(parts)


API_VERSION = "1.47"
MIN_API_VERSION = "1.24"
SERVER = "lazyfs"
_VERSION_PREFIX = re.compile(r"^/v(\d+\.\d+)(/.*)$")


@dataclass
class Route:
    method: str
    pattern: re.Pattern[str]
    handler: Handler


class Router:
    def __init__(self) -> None:
        self.routes: list[Route] = []
        self.fallback: Handler | None = None

    def add(self, method: str, path: str, handler: Handler) -> None:
        """`path` with {name} parts (one segment) and {name:path} (the rest)."""
        rx = re.sub(r"\{(\w+):path\}", r"(?P<\1>.+)", path)
        rx = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", rx)
        self.routes.append(Route(method, re.compile(f"^{rx}$"), handler))

    def find(self, method: str, path: str) -> tuple[Handler, dict[str, str]] | None:
        allowed = False
        for r in self.routes:
            m = r.pattern.match(path)
            if m:
                if r.method == method or (method == "HEAD" and r.method == "GET"):
                    return r.handler, {k: urllib.parse.unquote(v)
                                       for k, v in m.groupdict().items()}
                allowed = True
        if allowed:
            raise HttpError(405, f"{method} is not allowed on {path}")
        return None


async def serve_connection(stream: trio.abc.Stream, router: Router) -> None:
    conn = Connection(stream)
    try:
        while conn.keep:
            with trio.move_on_after(IDLE_S) as idle:
                event = await conn._next()
            if idle.cancelled_caught or isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                return
            await _answer(conn, event, router)
            if not conn.keep or conn.h11.our_state is not h11.DONE:
                return
            if conn.h11.their_state is not h11.DONE:  # a body the handler did not read
                with trio.move_on_after(10):
                    while not isinstance(await conn._next(),
                                         (h11.EndOfMessage, h11.ConnectionClosed)):
                        pass
                if conn.h11.their_state is not h11.DONE:
                    return
            conn.h11.start_next_cycle()
            conn.answered = False
            conn._body_done = False
    except h11.RemoteProtocolError as e:
        if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not conn.answered:
            status = max(e.error_status_hint, 400)
            reason = (f"the request head is over {MAX_HEAD:,} bytes" if status == 431
                      else f"a malformed request: {e}")
            body = json.dumps({"message": reason}).encode()
            with _quiet():  # (h11 will not write after a protocol error: by hand)
                await stream.send_all(
                    f"HTTP/1.1 {status} Bad Request\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body)
    except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        if conn.hijacked:
            await _end_hijacked(stream)
        with _quiet():
            await stream.aclose()


async def _end_hijacked(stream: trio.abc.Stream) -> None:
    """End a hijacked connection so that the client sees the end, not a
    reset: what it sent last (the docker CLI's TLS close_notify after its
    CloseWrite) is read, not left unread at close. A plain socket: our EOF
    first, then the client's (it closes on ours). TLS has no half-close
    here: only what arrived within a moment is read."""
    with _quiet():
        if isinstance(stream, trio.SocketStream):
            await stream.send_eof()
            wait = 1.0
        else:
            wait = 0.005
        with trio.move_on_after(wait):
            while await stream.receive_some(READ_SIZE):
                pass


class _quiet:
    """Ignore what a client that went away makes a last write raise."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, t: object, e: BaseException | None, tb: object) -> bool:
        return isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError,
                              h11.LocalProtocolError, OSError))


async def _answer(conn: Connection, event: h11.Request, router: Router) -> None:
    conn.method = event.method.decode()
    if len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers) > MAX_HEAD:
        conn.keep = False  # (h11 bounds a head that arrives in parts; this, one read whole)
        await conn.json(431, {"message": f"the request head is over {MAX_HEAD:,} bytes"})
        return
    target = event.target.decode("latin-1")
    raw_path, _, qs = target.partition("?")
    path = raw_path  # (a route's parts are unquoted once matched)
    m = _VERSION_PREFIX.match(path)
    if m:
        version, path = m.group(1), m.group(2)
        if _older(version, MIN_API_VERSION):
            await conn.json(400, {"message": f"client version {version} is too old. Minimum "
                                  f"supported API version is {MIN_API_VERSION}, please "
                                  "upgrade your client to a newer version"})
            return
    req = Request(method=event.method.decode(), path=path,
                  query=urllib.parse.parse_qs(qs, keep_blank_values=True),
                  headers={k.decode().lower(): v.decode("latin-1") for k, v in event.headers},
                  conn=conn)
    try:
        found = router.find(req.method, path)
        if found is None:
            if router.fallback is None:
                raise HttpError(404, f"page not found: {path}")
            await router.fallback(req)
            return
        handler, req.params = found
        await handler(req)
        if not conn.answered:
            await conn.send(204, b"")
    except HttpError as e:
        if conn.answered:
            conn.keep = False
            return
        await conn.json(e.status, {"message": e.message})
    except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError):
        raise
    except BaseExceptionGroup as eg:  # (trio's nurseries group what their tasks raise)
        leaves = _leaves(eg)
        http = [x for x in leaves if isinstance(x, HttpError)]
        gone = (_Closed, trio.BrokenResourceError, trio.ClosedResourceError, trio.Cancelled)
        if http and not conn.answered:
            await conn.json(http[0].status, {"message": http[0].message})
        elif all(isinstance(x, gone) for x in leaves) or http:
            conn.keep = False
        else:
            log.error("docker endpoint: %s %s failed", req.method, path, exc_info=eg)
            conn.keep = False
            if not conn.answered:
                await conn.json(500, {"message": "; ".join(
                    f"{type(x).__name__}: {x}" for x in leaves)[:500]})
    except Exception as e:
        log.exception("docker endpoint: %s %s failed", req.method, path)
        if conn.answered:
            conn.keep = False
            return
        await conn.json(500, {"message": f"{type(e).__name__}: {e}"})


def _leaves(eg: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for x in eg.exceptions:
        out.extend(_leaves(x) if isinstance(x, BaseExceptionGroup) else [x])
    return out


def _older(a: str, b: str) -> bool:
    return tuple(int(x) for x in a.split(".")) < tuple(int(x) for x in b.split("."))


def make_tls_context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    """A server context that requires a client certificate issued by `ca`
    (dockerd's --tlsverify); one that names a fleet node is served nothing
    (a node's certificate carries clientAuth for etcd: with the fleet's CA
    as `ca`, it must not make a node root over another's sandboxes)."""
    from ..fleet.ca import guard

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    guard(ctx)
    return ctx


def bind_unix(path: str, mode: int = 0o600) -> socketlib.socket:
    """A listening Unix socket at `path` (replacing a stale one), `mode`."""
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        old = os.umask(0o777 & ~mode)  # (made with its mode: never briefly open)
        try:
            s.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        s.listen(4096)
    except OSError:
        s.close()
        raise
    return s


def bind_tcp(address: str) -> socketlib.socket:
    """A listening TCP socket on HOST:PORT."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    s = socketlib.socket(socketlib.AF_INET6 if ":" in host else socketlib.AF_INET,
                         socketlib.SOCK_STREAM)
    try:
        s.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        s.listen(4096)
    except (OSError, OverflowError):
        s.close()
        raise
    return s


async def serve(sockets: list[tuple[socketlib.socket, ssl.SSLContext | None]],
                router: Router) -> None:
    """Serve `router` on bound sockets (bind_unix / bind_tcp), each plain or
    TLS with its context (make_tls_context: client certificates required, a
    client without one never gets past the handshake), until cancelled."""
    listeners: list[trio.abc.Listener[Any]] = []
    for sock, context in sockets:
        plain = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        listeners.append(plain if context is None else trio.SSLListener(
            plain, context, https_compatible=True))

    async def handle(stream: trio.abc.Stream) -> None:
        if isinstance(stream, trio.SSLStream):
            try:
                with trio.fail_after(HANDSHAKE_S):
                    await stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError) as e:
                log.warning("docker endpoint: a TLS client refused: %s", e.__cause__ or e)
                with _quiet():
                    await stream.transport_stream.aclose()
                return
        try:
            await serve_connection(stream, router)
        except Exception:  # one connection never ends the server
            log.exception("docker endpoint: a connection failed")

    try:
        await trio.serve_listeners(handle, listeners)
    finally:
        close_all(sockets)


def close_all(sockets: list[tuple[socketlib.socket, ssl.SSLContext | None]]) -> None:
    """Close bound sockets (a Unix one's path removed)."""
    for sock, _ in sockets:
        if sock.family == socketlib.AF_UNIX and sock.fileno() >= 0:
            with contextlib.suppress(OSError):
                path = sock.getsockname()
                if path:
                    os.unlink(path)
        sock.close()
