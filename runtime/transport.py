"""How the SDK and the CLI reach a node: in-process (embedded Node) or the
node agent over HTTP (Unix socket or TCP + bearer token). Both answer the
same calls with the same types and raise the same runtime.errors classes.

Which node (`resolve`): the `node=` argument > the `fleet=` argument >
$LAZYFS_NODE > $LAZYFS_FLEET > `local()`. Node forms: "unix:///PATH",
"http://HOST:PORT" (token: `token=` > $LAZYFS_NODE_TOKEN), a Node, or a
Transport; a fleet is "etcd://HOST:PORT[,HOST:PORT...]" (runtime.fleet.client:
placement over the nodes etcd lists, calls by id to the node the id names).

`local()` is the one rule for a caller that names no node, the SDK's and the
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
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from lazyfs.settings import setting

from .errors import ERRORS, BackendUnavailable, ExecError, SandboxError
from .files import FileInfo
from .spec import (
    CheckpointInfo,
    ExecRequest,
    ExecResult,
    NetworkPolicy,
    PreemptedSandbox,
    ReadLedger,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
    VerifyRequest,
)

if TYPE_CHECKING:
    from .backends.base import Sink
    from .config import RuntimeConfig
    from .node import Node

# exec streams stay open as long as their command runs; waiting for a pooled
# connection must not time out either (a rollout may run thousands at once)
TIMEOUT = httpx.Timeout(60.0, read=None, pool=None)
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=256)


class Transport(Protocol):
    def create(self, spec: SandboxSpec, progress: Callable[[str], None] | None = None
               ) -> SandboxInfo: ...
    def get(self, sandbox_id: str) -> SandboxInfo: ...
    def list_sandboxes(self, labels: Mapping[str, str] | None) -> list[SandboxInfo]: ...
    def kill(self, sandbox_id: str) -> None: ...
    def pause(self, sandbox_id: str) -> dict[str, Any]: ...
    def resume(self, sandbox_id: str) -> None: ...
    def pause_many(self, labels: Mapping[str, str] | None, snapshot: bool = False
                   ) -> list[str]: ...
    def preempt(self, sandbox_id: str) -> PreemptedSandbox: ...
    def restore(self, sandbox_id: str) -> SandboxInfo: ...
    def restore_many(self, labels: Mapping[str, str] | None) -> list[str]: ...
    def list_preempted(self, labels: Mapping[str, str] | None) -> list[PreemptedSandbox]: ...
    def resume_many(self, labels: Mapping[str, str] | None) -> list[str]: ...
    def kill_many(self, labels: Mapping[str, str] | None) -> list[str]: ...
    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: Sink | None,
             on_stderr: Sink | None) -> ExecResult: ...
    def read(self, sandbox_id: str, path: str) -> bytes: ...
    def write(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None: ...
    def remove(self, sandbox_id: str, path: str, recursive: bool) -> None: ...
    def list_files(self, sandbox_id: str, path: str) -> list[FileInfo]: ...
    def capabilities(self, backend: str) -> dict[str, Any]: ...
    def snapshot(self, sandbox_id: str, tag: str | None) -> SnapshotInfo: ...
    def fork(self, sandbox_id: str, n: int) -> tuple[SnapshotInfo, list[SandboxInfo]]: ...
    def checkpoint(self, sandbox_id: str, tag: str | None) -> CheckpointInfo: ...
    def restore_checkpoint(self, checkpoint: str, labels: Mapping[str, str] | None
                           ) -> SandboxInfo: ...
    def verify(self, sandbox_id: str, req: VerifyRequest) -> ExecResult: ...
    def events(self, sandbox_id: str) -> list[SandboxEvent]: ...
    def reads(self, sandbox_id: str, trace: bool) -> ReadLedger: ...
    def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo: ...


class Embedded:
    """Calls a Node in this process."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def create(self, spec: SandboxSpec, progress: Callable[[str], None] | None = None
               ) -> SandboxInfo:
        return self.node.create(spec, progress)

    def get(self, sandbox_id: str) -> SandboxInfo:
        return self.node.get(sandbox_id)

    def list_sandboxes(self, labels: Mapping[str, str] | None) -> list[SandboxInfo]:
        return self.node.sandboxes(labels)

    def kill(self, sandbox_id: str) -> None:
        self.node.kill(sandbox_id)

    def pause(self, sandbox_id: str) -> dict[str, Any]:
        return self.node.pause(sandbox_id)

    def resume(self, sandbox_id: str) -> None:
        self.node.resume(sandbox_id)

    def pause_many(self, labels: Mapping[str, str] | None, snapshot: bool = False
                   ) -> list[str]:
        return self.node.pause_many(labels, snapshot)

    def preempt(self, sandbox_id: str) -> PreemptedSandbox:
        return self.node.preempt(sandbox_id)

    def restore(self, sandbox_id: str) -> SandboxInfo:
        return self.node.restore(sandbox_id)

    def restore_many(self, labels: Mapping[str, str] | None) -> list[str]:
        return self.node.restore_many(labels)

    def list_preempted(self, labels: Mapping[str, str] | None) -> list[PreemptedSandbox]:
        return self.node.preempted_sandboxes(labels)

    def resume_many(self, labels: Mapping[str, str] | None) -> list[str]:
        return self.node.resume_many(labels)

    def kill_many(self, labels: Mapping[str, str] | None) -> list[str]:
        return self.node.kill_many(labels)

    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: Sink | None,
             on_stderr: Sink | None) -> ExecResult:
        return self.node.exec(sandbox_id, req, on_stdout, on_stderr)

    def read(self, sandbox_id: str, path: str) -> bytes:
        return self.node.files(sandbox_id).read(path)

    def write(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        self.node.files(sandbox_id).write(path, data, mode=mode)

    def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        self.node.files(sandbox_id).remove(path, recursive=recursive)

    def list_files(self, sandbox_id: str, path: str) -> list[FileInfo]:
        return self.node.list_files(sandbox_id, path)

    def capabilities(self, backend: str) -> dict[str, Any]:
        from .backends import capabilities
        return capabilities(backend).as_dict()

    def snapshot(self, sandbox_id: str, tag: str | None) -> SnapshotInfo:
        return self.node.snapshot(sandbox_id, tag)

    def fork(self, sandbox_id: str, n: int) -> tuple[SnapshotInfo, list[SandboxInfo]]:
        return self.node.fork(sandbox_id, n)

    def checkpoint(self, sandbox_id: str, tag: str | None) -> CheckpointInfo:
        return self.node.checkpoint(sandbox_id, tag)

    def restore_checkpoint(self, checkpoint: str, labels: Mapping[str, str] | None
                           ) -> SandboxInfo:
        return self.node.restore_checkpoint(checkpoint, labels)

    def verify(self, sandbox_id: str, req: VerifyRequest) -> ExecResult:
        return self.node.verify(sandbox_id, req.exec, req.keep)

    def events(self, sandbox_id: str) -> list[SandboxEvent]:
        return self.node.events(sandbox_id)

    def reads(self, sandbox_id: str, trace: bool) -> ReadLedger:
        return self.node.reads(sandbox_id, trace)

    def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        return self.node.set_network(sandbox_id, policy)


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
            from .errors import InvalidSpec
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
    raise BackendUnavailable(f"node {url!r}: expected unix:///PATH or http://HOST:PORT")


def parse_create_stream(lines: Iterator[str], progress: Callable[[str], None]
                        ) -> SandboxInfo:
    for line in lines:
        if not line:
            continue
        msg = json.loads(line)
        if not isinstance(msg, dict):
            raise BackendUnavailable("the node agent sent a create stream line that is not "
                                     "an object")
        if "step" in msg:
            progress(str(msg["step"]))
        elif "sandbox" in msg:
            return SandboxInfo.model_validate(msg["sandbox"])
        elif "error" in msg:
            raise_for(msg, 200)
    raise BackendUnavailable("the node agent closed the create stream before the sandbox "
                             "was made (it may have died: list its sandboxes)")


def parse_exec_stream(lines: Iterator[str], on_stdout: Sink | None, on_stderr: Sink | None
                      ) -> ExecResult:
    for line in lines:
        if not line:
            continue
        msg = json.loads(line)
        if "stdout" in msg:
            if on_stdout:
                on_stdout(base64.b64decode(msg["stdout"]))
        elif "stderr" in msg:
            if on_stderr:
                on_stderr(base64.b64decode(msg["stderr"]))
        elif "result" in msg:
            return ExecResult.model_validate(msg["result"])
        elif "error" in msg:
            raise_for(msg, 200)
    raise BackendUnavailable("the node agent closed the exec stream before the command ended")


class Http:
    """Calls a node agent over HTTP."""

    def __init__(self, url: str, token: str | None = None) -> None:
        base, kw = client_args(url, token)
        uds = kw.pop("uds", None)
        transport = httpx.HTTPTransport(uds=uds, limits=LIMITS) if uds else None
        self.url = url
        self.client = httpx.Client(base_url=base, transport=transport, timeout=TIMEOUT,
                                   limits=LIMITS, **kw)

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return _check(self.client.request(method, path, **kw))
        except httpx.TransportError as e:
            raise BackendUnavailable(f"node agent {self.url}: {e}") from e

    def create(self, spec: SandboxSpec, progress: Callable[[str], None] | None = None
               ) -> SandboxInfo:
        if progress is None:
            r = self._call("POST", "/v1/sandboxes", content=spec.model_dump_json(),
                           headers={"content-type": "application/json"})
            return SandboxInfo.model_validate(r.json())
        try:  # the agent streams the create's steps, then the sandbox
            with self.client.stream("POST", "/v1/sandboxes", params={"progress": "true"},
                                    content=spec.model_dump_json(),
                                    headers={"content-type": "application/json"}) as r:
                if r.status_code >= 400:
                    r.read()
                    _check(r)
                if not r.headers.get("content-type", "").startswith("application/x-ndjson"):
                    r.read()  # an agent from before progress: one answer, no steps
                    return SandboxInfo.model_validate(r.json())
                return parse_create_stream(r.iter_lines(), progress)
        except httpx.TransportError as e:
            raise BackendUnavailable(f"node agent {self.url}: {e}") from e

    def get(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.model_validate(self._call("GET", f"/v1/sandboxes/{sandbox_id}").json())

    def list_sandboxes(self, labels: Mapping[str, str] | None) -> list[SandboxInfo]:
        q = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return [SandboxInfo.model_validate(x)
                for x in self._call("GET", "/v1/sandboxes", params=q).json()]

    def kill(self, sandbox_id: str) -> None:
        self._call("DELETE", f"/v1/sandboxes/{sandbox_id}")

    def pause(self, sandbox_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self._call("POST", f"/v1/sandboxes/{sandbox_id}/pause").json()
        return out

    def resume(self, sandbox_id: str) -> None:
        self._call("POST", f"/v1/sandboxes/{sandbox_id}/resume")

    def pause_many(self, labels: Mapping[str, str] | None, snapshot: bool = False
                   ) -> list[str]:
        return list(self._call("POST", "/v1/bulk/pause",
                               json={"labels": dict(labels or {}), "snapshot": snapshot}).json())

    def preempt(self, sandbox_id: str) -> PreemptedSandbox:
        return PreemptedSandbox.model_validate(
            self._call("POST", f"/v1/sandboxes/{sandbox_id}/preempt").json())

    def restore(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.model_validate(
            self._call("POST", f"/v1/preempted/{sandbox_id}/restore").json())

    def restore_many(self, labels: Mapping[str, str] | None) -> list[str]:
        return list(self._call("POST", "/v1/bulk/restore", json={"labels": dict(labels or {})}
                               ).json())

    def list_preempted(self, labels: Mapping[str, str] | None) -> list[PreemptedSandbox]:
        q = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return [PreemptedSandbox.model_validate(x)
                for x in self._call("GET", "/v1/preempted", params=q).json()]

    def resume_many(self, labels: Mapping[str, str] | None) -> list[str]:
        return list(self._call("POST", "/v1/bulk/resume", json={"labels": dict(labels or {})}
                               ).json())

    def kill_many(self, labels: Mapping[str, str] | None) -> list[str]:
        return list(self._call("POST", "/v1/bulk/kill", json={"labels": dict(labels or {})}
                               ).json())

    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: Sink | None,
             on_stderr: Sink | None) -> ExecResult:
        try:
            with self.client.stream("POST", f"/v1/sandboxes/{sandbox_id}/exec",
                                    content=req.model_dump_json(),
                                    headers={"content-type": "application/json"}) as r:
                if r.status_code >= 400:
                    r.read()
                    _check(r)
                return parse_exec_stream(r.iter_lines(), on_stdout, on_stderr)
        except httpx.TransportError as e:
            raise BackendUnavailable(f"node agent {self.url}: {e}") from e

    def read(self, sandbox_id: str, path: str) -> bytes:
        return self._call("GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path}
                          ).content

    def write(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        self._call("PUT", f"/v1/sandboxes/{sandbox_id}/files",
                   params={"path": path, "mode": mode}, content=data)

    def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        self._call("DELETE", f"/v1/sandboxes/{sandbox_id}/files",
                   params={"path": path, "recursive": recursive})

    def list_files(self, sandbox_id: str, path: str) -> list[FileInfo]:
        return [FileInfo.model_validate(x) for x in self._call(
            "GET", f"/v1/sandboxes/{sandbox_id}/files/list", params={"path": path}).json()]

    def capabilities(self, backend: str) -> dict[str, Any]:
        out: dict[str, Any] = self._call("GET", f"/v1/capabilities/{backend}").json()
        return out

    def snapshot(self, sandbox_id: str, tag: str | None) -> SnapshotInfo:
        r = self._call("POST", f"/v1/sandboxes/{sandbox_id}/snapshot", json={"tag": tag})
        return SnapshotInfo.model_validate(r.json())

    def fork(self, sandbox_id: str, n: int) -> tuple[SnapshotInfo, list[SandboxInfo]]:
        body = self._call("POST", f"/v1/sandboxes/{sandbox_id}/fork", json={"n": n}).json()
        return (SnapshotInfo.model_validate(body["snapshot"]),
                [SandboxInfo.model_validate(c) for c in body["children"]])

    def checkpoint(self, sandbox_id: str, tag: str | None) -> CheckpointInfo:
        r = self._call("POST", f"/v1/sandboxes/{sandbox_id}/checkpoint", json={"tag": tag})
        return CheckpointInfo.model_validate(r.json())

    def restore_checkpoint(self, checkpoint: str, labels: Mapping[str, str] | None
                           ) -> SandboxInfo:
        r = self._call("POST", "/v1/checkpoints/restore", json={
            "checkpoint": checkpoint, "labels": dict(labels) if labels is not None else None})
        return SandboxInfo.model_validate(r.json())

    def verify(self, sandbox_id: str, req: VerifyRequest) -> ExecResult:
        r = self._call("POST", f"/v1/sandboxes/{sandbox_id}/verify",
                       content=req.model_dump_json(), headers={"content-type": "application/json"})
        return ExecResult.model_validate(r.json())

    def events(self, sandbox_id: str) -> list[SandboxEvent]:
        return [SandboxEvent.model_validate(x) for x in self._call(
            "GET", f"/v1/sandboxes/{sandbox_id}/events").json()]

    def reads(self, sandbox_id: str, trace: bool) -> ReadLedger:
        return ReadLedger.model_validate(self._call(
            "GET", f"/v1/sandboxes/{sandbox_id}/reads",
            params={"trace": "true" if trace else "false"}).json())

    def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        return SandboxInfo.model_validate(self._call(
            "PUT", f"/v1/sandboxes/{sandbox_id}/network",
            json=policy.model_dump(mode="json")).json())


_lock = threading.Lock()
_embedded: dict[RuntimeConfig | None, Node] = {}


def embedded_node(config: RuntimeConfig | None = None) -> Node:
    """The process-wide embedded Node for `config` (None: RuntimeConfig's
    defaults and environment), made on first use."""
    with _lock:
        if config not in _embedded:
            from .node import Node
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
        return Embedded(node)
    from .agent.launch import agent_socket, answers, start
    if config is None:
        from .config import RuntimeConfig
        state = RuntimeConfig().state_dir
    else:
        state = config.state_dir
    sock = agent_socket(state)
    if answers(sock):
        return agent_client(f"unix://{sock}", None)
    if detached:
        from .config import RuntimeConfig
        return agent_client(f"unix://{start(config or RuntimeConfig())}", None)
    return Embedded(embedded_node(config))


_clients: dict[tuple[str, str | None], Http] = {}


def agent_client(url: str, token: str | None) -> Http:
    """One HTTP client (connection pool) per agent and token in this
    process, shared by every Sandbox and thread."""
    key = (url, token or setting("client_token"))
    with _lock:
        if key not in _clients:
            _clients[key] = Http(url, key[1])
        return _clients[key]


def _close_clients() -> None:
    with _lock:
        for c in _clients.values():
            c.client.close()
        _clients.clear()


atexit.register(_close_clients)


def resolve(node: str | Node | Transport | None, token: str | None = None,
            fleet: str | None = None) -> Transport:
    """The transport for `node` or `fleet` (see the module docstring)."""
    if node is None and fleet is None:
        node = setting("client_node")  # (settings client.node, LAZYFS_NODE)
        if node is None:
            fleet = setting("client_fleet")
    if node is None and fleet is not None:
        from .fleet.client import fleet_client
        return fleet_client(fleet, token or setting("client_token"))
    if node is None:
        return local()
    if isinstance(node, str):
        return agent_client(node, token)
    if isinstance(node, Http | Embedded):
        return node
    from .node import Node  # loaded already: the caller made one
    if isinstance(node, Node):
        return Embedded(node)
    return node
