"""How the SDK and the CLI reach a node: in-process (embedded Node) or the
node agent over HTTP (Unix socket or TCP + bearer token). Both answer the
same calls with the same types and raise the same runtime.errors classes.

Which of them (a node, an agent, a fleet) a caller means is
runtime.client.connect.resolve's rule. `local()` is the one rule for a caller that names no node, the SDK's and the
CLI's alike: if an agent serves the state directory (STATE/agent.sock
answers), talk to it; else run the node embedded in this process, unless
what is created must outlive the process (`lazyfs sandbox create`,
`detached=True`): then start that state directory's agent in the background
(runtime.agent.launch) and talk to it.

Light to import: nothing here loads the node (pyfuse3, trio, LMDB, the
chunk store) until a node runs embedded, so a client of a remote agent
needs only httpx and pydantic.
"""

from __future__ import annotations

import atexit
import base64
import itertools
import json
import random
import ssl
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import anyio
import httpx
import sniffio
from pydantic import ValidationError

from lazyfs.settings import setting

from ..api import ALWAYS, ON_REQUEST, OPS, Op, SandboxApi, adapter, is_labels
from ..errors import ERRORS, BackendUnavailable, ExecError, InvalidSpec, Overloaded, SandboxError
from ..spec import ExecResult

if TYPE_CHECKING:
    from ..config import RuntimeConfig
    from ..node import Node

# exec streams stay open as long as their command runs; waiting for a pooled
# connection must not time out either (a rollout may run thousands at once)
TIMEOUT = httpx.Timeout(60.0, read=None, pool=None)
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=256)
# AsyncHttp's connections to one agent come in pools of ASYNC_SHARD (how
# many: the client.connections setting, LAZYFS_CLIENT_CONNECTIONS)
ASYNC_SHARD = 32
# how long a call the agent refused as Overloaded is sent again (backoff up
# to OVERLOAD_BACKOFF_MAX seconds between tries) before Overloaded reaches
# the caller
OVERLOAD_RETRY_S = 30.0
OVERLOAD_BACKOFF_MAX = 1.0


# What the SDK calls, whichever node answers (runtime.api declares it once).
Transport = SandboxApi


def raise_for(body: Mapping[str, Any], status: int) -> None:
    err = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(err, Mapping):
        raise SandboxError(f"node agent answered HTTP {status}")
    cls = ERRORS.get(str(err.get("type")), SandboxError)
    message = str(err.get("message", ""))
    if issubclass(cls, ExecError):
        result = ExecResult.model_validate(err["result"]) if err.get("result") else None
        raise cls(message, result)
    raise cls(message)


def _check(r: httpx.Response) -> httpx.Response:
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code == 401:
            raise BackendUnavailable("the node agent refused the token")
        if r.status_code == 422:  # FastAPI's validation error for a bad body
            raise InvalidSpec("; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}"
                                        for d in body.get("detail", [])) or r.text)
        raise_for(body, r.status_code)
    return r


def client_args(url: str, token: str | None) -> tuple[str, dict[str, Any]]:
    """(base_url, keyword arguments for httpx clients) for a node URL."""
    token = token or setting("client_token")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if url.startswith("unix://"):
        return "http://agent", {"uds": url[len("unix://"):], "headers": headers}
    if url.startswith(("http://", "https://")):
        return url.rstrip("/"), {"headers": headers}
    raise BackendUnavailable(f"node {url!r}: expected unix:///PATH, http(s)://HOST:PORT")


def tls_context(url: str) -> ssl.SSLContext | None:
    """For an https:// agent: the fleet CA and this caller's certificate
    ($LAZYFS_TLS_DIR, `[client] tls_dir`; runtime.fleet.ca), or None
    (httpx's default verification) when no identity is set."""
    if not url.startswith("https://"):
        return None
    d = setting("client_tls_dir")
    if d is None:
        return None
    from ..fleet.ca import Identity, client_context
    return client_context(Identity(Path(d)))


class _Named(httpx.BaseTransport):
    """Connects asking for `name` (TLS SNI), which the server's certificate
    must carry: a fleet node's certificate names its node id."""

    def __init__(self, inner: httpx.HTTPTransport, name: str) -> None:
        self.inner, self.name = inner, name

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions["sni_hostname"] = self.name
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class _AsyncNamed(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncHTTPTransport, name: str) -> None:
        self.inner, self.name = inner, name

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions["sni_hostname"] = self.name
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def sync_transport(url: str, uds: str | None, limits: httpx.Limits,
                   server_name: str | None) -> httpx.BaseTransport | None:
    if uds:
        return httpx.HTTPTransport(uds=uds, limits=limits)
    ctx = tls_context(url)
    if ctx is None and server_name is None:
        return None
    inner = httpx.HTTPTransport(verify=ctx if ctx is not None else True, limits=limits)
    return _Named(inner, server_name) if server_name else inner


def async_transport(url: str, uds: str | None, limits: httpx.Limits,
                    server_name: str | None) -> httpx.AsyncBaseTransport | None:
    if uds:
        return httpx.AsyncHTTPTransport(uds=uds, limits=limits)
    ctx = tls_context(url)
    if ctx is None and server_name is None:
        return None
    inner = httpx.AsyncHTTPTransport(verify=ctx if ctx is not None else True, limits=limits)
    return _AsyncNamed(inner, server_name) if server_name else inner


@dataclass
class Call:
    """One operation's call as an HTTP request (runtime.api's wire rule)."""

    op: Op
    method: str
    path: str
    params: list[tuple[str, str | int | float | bool | None]]
    content: bytes | None
    headers: dict[str, str]
    callbacks: dict[str, Callable[[Any], None]]  # wire key -> the caller's function
    streamed: bool


def encode(o: Op, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Call:
    """The request for a call of `o` with these arguments."""
    a = o.bind(args, kwargs)
    path = o.path
    params: list[tuple[str, str | int | float | bool | None]] = []
    body: dict[str, Any] = {}
    content: bytes | None = None
    headers: dict[str, str] = {}
    callbacks: dict[str, Callable[[Any], None]] = {}
    for name, value in a.items():
        where = o.where(name)
        hint = o.hints[name]
        if where == "path":
            path = path.replace(f"{{{name}}}", quote(str(value), safe=""))
        elif where == "callback":
            if value is not None:
                callbacks[o.callbacks[name]] = value
                if o.stream == ON_REQUEST:
                    params.append((name, "true"))
        elif where == "body":
            body[name] = adapter(hint).dump_python(value, mode="json")
        elif where == "json_body":
            content = adapter(hint).dump_json(value)
            headers["content-type"] = "application/json"
        elif where == "raw_body":
            content = bytes(value)
            headers["content-type"] = "application/octet-stream"
        elif value is None:
            continue
        elif is_labels(hint):
            params.extend(("label", f"{k}={v}") for k, v in value.items())
        elif isinstance(value, bool):
            params.append((name, "true" if value else "false"))
        else:
            params.append((name, str(value)))
    if o.body:
        content = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    streamed = o.stream == ALWAYS or (o.stream == ON_REQUEST and bool(callbacks))
    return Call(o, o.method, path, params, content, headers, callbacks, streamed)


def decode(o: Op, content: bytes) -> Any:
    """A non-streamed answer as the declared type (validated: an agent's
    answer is not trusted)."""
    if o.returns is type(None):
        return None
    if o.returns is bytes:
        return content
    try:
        return adapter(o.returns).validate_json(content)
    except ValidationError as e:
        raise BackendUnavailable(f"the node agent's answer to {o.name} is malformed: "
                                 f"{str(e).splitlines()[0]}") from None


def decode_line(c: Call, line: str) -> tuple[bool, Any]:
    """One line of a streamed answer: (True, the answer) for the last one;
    a callback's line is handed to it; an error line raises it."""
    try:
        msg = json.loads(line)
    except ValueError:
        msg = None
    if not isinstance(msg, dict) or len(msg) != 1:
        raise BackendUnavailable(f"the node agent sent a {c.op.name} stream line that is not "
                                 "an object of one key")
    (key, value), = msg.items()
    if key == c.op.result_key:
        try:
            return True, adapter(c.op.returns).validate_python(value)
        except ValidationError as e:
            raise BackendUnavailable(f"the node agent's answer to {c.op.name} is malformed: "
                                     f"{str(e).splitlines()[0]}") from None
    if key == "error":
        raise_for(msg, 200)
    for param, wire in c.op.callbacks.items():
        if wire == key:
            fn = c.callbacks.get(key)
            if fn is not None:
                if c.op.callback_type(param) is bytes:
                    fn(base64.b64decode(str(value)))
                else:
                    fn(str(value))
            return False, None
    raise BackendUnavailable(f"the node agent sent an unknown {c.op.name} stream line {key!r}")


def _stream_ended(c: Call) -> BackendUnavailable:
    return BackendUnavailable(f"the node agent closed the {c.op.name} stream before its answer "
                              "(it may have died)")


def _backoff(attempt: int) -> float:
    return min(OVERLOAD_BACKOFF_MAX, 0.05 * 2.0 ** attempt) * (0.5 + random.random())


class Http(SandboxApi):
    """Calls a node agent over HTTP: one method per operation of
    runtime.api, made from its declaration (below the class)."""

    def __init__(self, url: str, token: str | None = None,
                 server_name: str | None = None) -> None:
        base, kw = client_args(url, token)
        transport = sync_transport(url, kw.pop("uds", None), LIMITS, server_name)
        self.url, self.token, self.server_name = url, token, server_name
        self.client = httpx.Client(base_url=base, transport=transport, timeout=TIMEOUT,
                                   limits=LIMITS, **kw)

    def call(self, o: Op, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        c = encode(o, args, kwargs)
        deadline = time.monotonic() + OVERLOAD_RETRY_S
        for attempt in itertools.count():
            try:
                return self._send(c)
            except Overloaded:  # refused before the node saw it: send it again
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    def _send(self, c: Call) -> Any:
        o = c.op
        try:
            if not c.streamed:
                r = _check(self.client.request(c.method, c.path, params=c.params,
                                               content=c.content, headers=c.headers))
                return decode(o, r.content)
            with self.client.stream(c.method, c.path, params=c.params, content=c.content,
                                    headers=c.headers) as r:
                if r.status_code >= 400:
                    r.read()
                    _check(r)
                for line in r.iter_lines():
                    if line:
                        done, answer = decode_line(c, line)
                        if done:
                            return answer
                raise _stream_ended(c)
        except httpx.TransportError as e:
            raise BackendUnavailable(f"node agent {self.url}: {e}") from e


def _http_method(o: Op) -> Callable[..., Any]:
    def method(self: Http, *args: Any, **kwargs: Any) -> Any:
        return self.call(o, args, kwargs)
    method.__name__ = method.__qualname__ = o.name
    method.__doc__ = o.doc
    method.__signature__ = o.signature  # type: ignore[attr-defined]
    return method


for _o in OPS.values():
    setattr(Http, _o.name, _http_method(_o))


class _Shard:
    """One httpx pool of AsyncHttp and how many of its connections are taken."""

    def __init__(self, url: str, token: str | None, size: int,
                 server_name: str | None = None) -> None:
        base, kw = client_args(url, token)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        transport = async_transport(url, kw.pop("uds", None), limits, server_name)
        self.client = httpx.AsyncClient(base_url=base, transport=transport, timeout=TIMEOUT,
                                        limits=limits, **kw)
        self.size, self.taken = size, 0


class AsyncHttp:
    """Calls a node agent from asyncio or trio without threads: the
    declaration's operations through `call` (AsyncSandbox's path to an
    agent), over at most `max_connections` connections kept alive between
    calls; more calls than that wait for one (back pressure, not errors).
    A streamed call (exec) holds its connection while its command runs;
    its output reaches the callbacks as it comes, called in the event loop.
    One per agent, token and event loop (`async_agent_client`); its
    connections close when that loop ends.

    The connections are split into pools of ASYNC_SHARD (httpx's pool scans
    all its connections for every call it hands one: with 512 in one pool,
    1,000 calls cost the client 3.6 s of CPU in that scan), and calls wait
    on a semaphore here, never in httpx's queue (which costs time in the
    number waiting at every step: 32 s of CPU for 1,000 calls queued)."""

    def __init__(self, url: str, token: str | None = None, *,
                 max_connections: int | None = None, server_name: str | None = None) -> None:
        self.server_name = server_name
        if max_connections is None:
            max_connections = int(setting("client_connections"))
        if max_connections < 1:
            raise InvalidSpec(f"client.connections {max_connections}: at least 1 connection")
        self.url, self.token = url, token
        self._shards: list[_Shard] = []
        self._slots = anyio.Semaphore(max_connections)
        self._max = max_connections

    def _shard(self) -> _Shard:
        """A pool with a free connection (a new one if none has): called
        holding a slot, so one exists or may be made."""
        for shard in self._shards:
            if shard.taken < shard.size:
                return shard
        made = sum(s.size for s in self._shards)
        shard = _Shard(self.url, self.token, min(ASYNC_SHARD, self._max - made),
                       self.server_name)
        self._shards.append(shard)
        return shard

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.client.aclose()
        self._shards = []

    async def call(self, o: Op, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        c = encode(o, args, kwargs)
        deadline = time.monotonic() + OVERLOAD_RETRY_S
        for attempt in itertools.count():
            try:
                async with self._slots:
                    shard = self._shard()
                    shard.taken += 1
                    try:
                        return await self._send(shard.client, c)
                    finally:
                        shard.taken -= 1
            except Overloaded:
                if time.monotonic() >= deadline:
                    raise
                await anyio.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    async def _send(self, client: httpx.AsyncClient, c: Call) -> Any:
        o = c.op
        try:
            if not c.streamed:
                r = _check(await client.request(c.method, c.path, params=c.params,
                                                content=c.content, headers=c.headers))
                return decode(o, r.content)
            async with client.stream(c.method, c.path, params=c.params,
                                          content=c.content, headers=c.headers) as r:
                if r.status_code >= 400:
                    await r.aread()
                    _check(r)
                async for line in r.aiter_lines():
                    if line:
                        done, answer = decode_line(c, line)
                        if done:
                            return answer
                raise _stream_ended(c)
        except httpx.TransportError as e:
            raise BackendUnavailable(f"node agent {self.url}: {e}") from e


async def _close_with_the_loop(client: AsyncHttp) -> AsyncIterator[None]:
    # An async generator left suspended: asyncio.run and trio.run finalize
    # such generators as their loop ends, which closes the client's
    # connections there (left open, they would warn when collected).
    try:
        yield
    finally:
        await client.aclose()


_async_clients: weakref.WeakKeyDictionary[Any, dict[tuple[str, str | None, str | None], tuple[
    AsyncHttp, AsyncIterator[None]]]] = weakref.WeakKeyDictionary()


def _event_loop() -> Any:
    if sniffio.current_async_library() == "trio":
        import trio
        return trio.lowlevel.current_root_task()
    import asyncio
    return asyncio.get_running_loop()


async def async_agent_client(url: str, token: str | None, server_name: str | None = None
                             ) -> AsyncHttp:
    """The AsyncHttp of this agent, token and TLS name in the running event loop."""
    key = (url, token or setting("client_token"), server_name)
    loop = _event_loop()
    clients = _async_clients.setdefault(loop, {})
    if key not in clients:
        client = AsyncHttp(url, key[1], server_name=server_name)
        closer = _close_with_the_loop(client)
        await closer.__anext__()
        clients[key] = (client, closer)
    return clients[key][0]


_lock = threading.Lock()
_embedded: dict[RuntimeConfig | None, Node] = {}


def embedded_node(config: RuntimeConfig | None = None) -> Node:
    """The process-wide embedded Node for `config` (None: RuntimeConfig's
    defaults and environment), made on first use."""
    with _lock:
        if config not in _embedded:
            from ..node import Node
            _embedded[config] = Node(config)
        return _embedded[config]


def close_embedded() -> None:
    """Close the embedded nodes of this process (their worker pools go;
    sandboxes stay for the next node on their state directory)."""
    with _lock:
        nodes = list(_embedded.values())
        _embedded.clear()
    for n in nodes:
        n.close()


def local(config: RuntimeConfig | None = None, *, detached: bool = False) -> Transport:
    """The node of this machine's state directory (`config`, default
    RuntimeConfig()), by the rule in this module's docstring: its agent when
    one answers, else embedded, or with `detached` a started agent."""
    with _lock:
        node = _embedded.get(config)
    if node is not None:  # this process owns the state: no agent can serve it
        return node
    from ..agent.launch import agent_socket, answers, start
    if config is None:
        from ..config import RuntimeConfig
        state = RuntimeConfig().state_dir
    else:
        state = config.state_dir
    sock = agent_socket(state)
    if answers(sock):
        return agent_client(f"unix://{sock}", None)
    if detached:
        from ..config import RuntimeConfig
        return agent_client(f"unix://{start(config or RuntimeConfig())}", None)
    return embedded_node(config)


_clients: dict[tuple[str, str | None, str | None], Http] = {}


def agent_client(url: str, token: str | None, server_name: str | None = None) -> Http:
    """One HTTP client (connection pool) per agent, token and TLS name in
    this process, shared by every Sandbox and thread. `server_name`: what
    an https:// agent's certificate must name (a fleet node's: its id)."""
    key = (url, token or setting("client_token"), server_name)
    with _lock:
        if key not in _clients:
            _clients[key] = Http(url, key[1], server_name)
        return _clients[key]


def _close_clients() -> None:
    with _lock:
        for c in _clients.values():
            c.client.close()
        _clients.clear()


atexit.register(_close_clients)
