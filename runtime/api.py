"""The sandbox API, declared once.

Every operation a node answers is one method of `SandboxApi`: its name,
parameters, their types and what it returns, and (the `op` decorator) how
it travels over HTTP and how a fleet routes it. The rest is derived from
this declaration:

- runtime.node.Node implements the methods itself (it subclasses SandboxApi;
  tests/test_api.py checks every signature against this one);
- runtime.agent.app serves each operation as an HTTP route (`wire(op)`
  gives its parameters' places), with its OpenAPI schema;
- runtime.client.transport.Http, the client of an agent, is made from it: one
  method per operation, none written by hand;
- runtime.fleet.client.Fleet forwards each by its `fleet` kind: BY_ID to
  the node the sandbox id names, EVERYWHERE to every node with the answers
  joined; the few it routes itself (OWN) it defines;
- the SDK (runtime.client.sdk) calls any of them through this interface.

Adding an operation: a method here, the same method on Node, and the SDK's
call. Nothing else.

On the wire (one rule for every operation):
- a parameter named in the path template is a path segment; `body` names
  fields of one JSON object; `json_body` is a model sent as the whole JSON
  body; `raw_body` is bytes sent as the body; the rest are query
  parameters (a `Labels` one as repeated `label=key=value`);
- the answer: None is 204 and no body, bytes are the body as they are,
  anything else the JSON of its declared type, which the client validates
  (an agent's answer is untrusted input);
- a callback parameter (Progress, Sink) makes the answer a stream of NDJSON
  lines: {WIRE_KEY: value} per call (bytes in base64), then
  {result_key: answer} or {"error": {"type", "message"[, "result"]}}.
  `stream=ALWAYS` streams every call (exec: output comes as it runs);
  `stream=ON_REQUEST` only when the caller gives a callback, flagged by the
  query parameter of the callback's name (create?progress=true);
- errors: {"error": {"type": <runtime.errors class>, "message": ...}} with
  that class's HTTP status.

Light to import: pydantic and the value types only.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar

from pydantic import TypeAdapter

from .files import FileInfo
from .spec import (
    BackgroundExec,
    CheckpointInfo,
    ExecRequest,
    ExecResult,
    Forked,
    NetworkPolicy,
    PreemptedSandbox,
    ReadLedger,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
    VerifyRequest,
)

# output of a command as it comes (on_stdout / on_stderr)
Sink = Callable[[bytes], None]
# what a long create is doing now, one line at a time ("building the EROFS
# metadata of layer 1/2", "booting the guest (tcg)"): the caller's on_progress
Progress = Callable[[str], None]
# a label filter: sandboxes carrying every one of these (None or {}: all)
Labels: TypeAlias = Mapping[str, str] | None

F = TypeVar("F", bound=Callable[..., Any])
Fleet = Literal["by_id", "everywhere", "own"]
BY_ID: Fleet = "by_id"  # to the node the sandbox id (first parameter) names
EVERYWHERE: Fleet = "everywhere"  # to every node, the lists joined
OWN: Fleet = "own"  # runtime.fleet.client.Fleet routes it itself

Stream = Literal["never", "always", "on_request"]
NEVER: Stream = "never"
ALWAYS: Stream = "always"
ON_REQUEST: Stream = "on_request"


@dataclass(frozen=True)
class Op:
    """One operation, as declared (see the module docstring)."""

    name: str
    method: str
    path: str
    fleet: Fleet = BY_ID
    body: tuple[str, ...] = ()
    json_body: str | None = None
    raw_body: str | None = None
    callbacks: Mapping[str, str] = field(default_factory=dict)  # parameter -> wire key
    stream: Stream = NEVER
    result_key: str = "result"
    status: int = 200
    undo: str | None = None  # an operation undoing one whose answer was never delivered
    doc: str = ""
    signature: inspect.Signature = field(default=inspect.Signature(), compare=False)
    hints: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def returns(self) -> Any:
        return self.hints["return"]

    def params(self) -> list[inspect.Parameter]:
        """The parameters, without self."""
        return list(self.signature.parameters.values())[1:]

    def where(self, name: str) -> str:
        """Where parameter `name` travels: path, query, body, json_body,
        raw_body or callback."""
        if name in self.callbacks:
            return "callback"
        if f"{{{name}}}" in self.path:
            return "path"
        if name in self.body:
            return "body"
        if name == self.json_body:
            return "json_body"
        if name == self.raw_body:
            return "raw_body"
        return "query"

    def callback_type(self, name: str) -> type:
        """What a callback parameter is called with (str or bytes)."""
        hint = self.hints[name]
        for alt in typing.get_args(hint) or (hint,):
            args = typing.get_args(alt)
            if args and isinstance(args[0], list) and args[0]:
                t: type = args[0][0]
                return t
        raise TypeError(f"{self.name}: callback {name} is not a Callable[[T], None]")

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A call's arguments by name, defaults filled in (TypeError as a
        call of the declared method would raise)."""
        bound = self.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        out = dict(bound.arguments)
        out.pop("self")
        return out


def op(method: str, path: str, *, fleet: Fleet = BY_ID, body: tuple[str, ...] = (),
       json_body: str | None = None, raw_body: str | None = None,
       callbacks: Mapping[str, str] | None = None, stream: Stream = NEVER,
       result_key: str = "result", status: int = 200, undo: str | None = None
       ) -> Callable[[F], F]:
    """Mark a SandboxApi method as an operation, with its wire form."""
    def mark(fn: F) -> F:
        fn.__api_op__ = dict(  # type: ignore[attr-defined]  # noqa: C408
            method=method, path=path, fleet=fleet, body=body, json_body=json_body,
            raw_body=raw_body, callbacks=dict(callbacks or {}), stream=stream,
            result_key=result_key, status=status, undo=undo)
        return fn
    return mark


class SandboxApi:
    """What a node answers about its sandboxes: runtime.node.Node (in this
    process), runtime.client.transport.Http (an agent), runtime.fleet.client.Fleet
    subclass it. The bodies here only say "not implemented": a subclass
    defines or derives each (tests/test_api.py checks)."""

    # -- lifecycle ------------------------------------------------------------
    @op("POST", "/v1/sandboxes", fleet=OWN, json_body="spec", status=201,
        callbacks={"progress": "step"}, stream=ON_REQUEST, result_key="sandbox", undo="kill")
    def create(self, spec: SandboxSpec, progress: Progress | None = None) -> SandboxInfo:
        """A new sandbox; `progress` is told each long step."""
        raise NotImplementedError

    @op("GET", "/v1/sandboxes/{sandbox_id}")
    def get(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox's info (SandboxPreempted while it is preempted)."""
        raise NotImplementedError

    @op("GET", "/v1/sandboxes", fleet=EVERYWHERE)
    def list_sandboxes(self, labels: Labels = None) -> list[SandboxInfo]:
        """The sandboxes carrying these labels."""
        raise NotImplementedError

    @op("DELETE", "/v1/sandboxes/{sandbox_id}", fleet=OWN)
    def kill(self, sandbox_id: str) -> None:
        """Stop the sandbox and remove what it has on the node."""
        raise NotImplementedError

    @op("POST", "/v1/sandboxes/{sandbox_id}/pause")
    def pause(self, sandbox_id: str) -> dict[str, Any]:
        """Freeze it; memory figures before and after the reclaim."""
        raise NotImplementedError

    @op("POST", "/v1/sandboxes/{sandbox_id}/resume")
    def resume(self, sandbox_id: str) -> None:
        """Thaw a paused sandbox."""
        raise NotImplementedError

    @op("POST", "/v1/bulk/pause", fleet=EVERYWHERE, body=("labels", "snapshot"))
    def pause_many(self, labels: Labels, snapshot: bool = False) -> list[str]:
        """Pause (with `snapshot`: preempt) the running sandboxes with these labels."""
        raise NotImplementedError

    @op("POST", "/v1/bulk/resume", fleet=EVERYWHERE, body=("labels",))
    def resume_many(self, labels: Labels) -> list[str]:
        """Resume the paused sandboxes with these labels."""
        raise NotImplementedError

    @op("POST", "/v1/bulk/kill", fleet=OWN, body=("labels",))
    def kill_many(self, labels: Labels) -> list[str]:
        """Kill the sandboxes with these labels."""
        raise NotImplementedError

    # -- preemption -----------------------------------------------------------
    @op("POST", "/v1/sandboxes/{sandbox_id}/preempt")
    def preempt(self, sandbox_id: str) -> PreemptedSandbox:
        """Snapshot, record and stop it."""
        raise NotImplementedError

    @op("POST", "/v1/preempted/{sandbox_id}/restore", fleet=OWN)
    def restore(self, sandbox_id: str) -> SandboxInfo:
        """A preempted sandbox running again, same id."""
        raise NotImplementedError

    @op("POST", "/v1/bulk/restore", fleet=EVERYWHERE, body=("labels",))
    def restore_many(self, labels: Labels) -> list[str]:
        """Restore the preempted sandboxes with these labels."""
        raise NotImplementedError

    @op("GET", "/v1/preempted", fleet=OWN)
    def list_preempted(self, labels: Labels = None) -> list[PreemptedSandbox]:
        """The records of preempted sandboxes with these labels."""
        raise NotImplementedError

    # -- exec -------------------------------------------------------------------
    @op("POST", "/v1/sandboxes/{sandbox_id}/exec", json_body="req", stream=ALWAYS,
        callbacks={"on_stdout": "stdout", "on_stderr": "stderr"})
    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: Sink | None = None,
             on_stderr: Sink | None = None) -> ExecResult:
        """Run a command and wait for it; output to the sinks as it comes."""
        raise NotImplementedError

    @op("POST", "/v1/sandboxes/{sandbox_id}/execs", json_body="req", status=201)
    def exec_start(self, sandbox_id: str, req: ExecRequest) -> BackgroundExec:
        """Start a command and return at once; wait() gives its result."""
        raise NotImplementedError

    @op("GET", "/v1/sandboxes/{sandbox_id}/execs/{exec_id}/wait", stream=ALWAYS)
    def wait(self, sandbox_id: str, exec_id: str, timeout: float | None = None) -> ExecResult:
        """The result of a command exec_start started, once it ends (exec's
        errors); still running after `timeout` seconds: SandboxStateError."""
        raise NotImplementedError

    @op("POST", "/v1/sandboxes/{sandbox_id}/execs/{exec_id}/signal", body=("signal",))
    def signal(self, sandbox_id: str, exec_id: str, signal: int = 15) -> None:
        """Send a signal to a running background command (its leading
        process; SIGKILL: everything it started too). A command that ended
        already: SandboxStateError."""
        raise NotImplementedError

    @op("POST", "/v1/sandboxes/{sandbox_id}/verify", json_body="req")
    def verify(self, sandbox_id: str, req: VerifyRequest) -> ExecResult:
        """Run a command in a fresh sandbox of this one's files (a grader's)."""
        raise NotImplementedError

    # -- files ------------------------------------------------------------------
    @op("GET", "/v1/sandboxes/{sandbox_id}/files")
    def read(self, sandbox_id: str, path: str) -> bytes:
        """A file's bytes."""
        raise NotImplementedError

    @op("PUT", "/v1/sandboxes/{sandbox_id}/files", raw_body="data")
    def write(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file (atomically), making its directories."""
        raise NotImplementedError

    @op("DELETE", "/v1/sandboxes/{sandbox_id}/files")
    def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        """Remove a file, or a directory (with `recursive`, its contents too)."""
        raise NotImplementedError

    @op("GET", "/v1/sandboxes/{sandbox_id}/files/list")
    def list_files(self, sandbox_id: str, path: str = "/") -> list[FileInfo]:
        """A directory's entries."""
        raise NotImplementedError

    @op("GET", "/v1/sandboxes/{sandbox_id}/files/stat")
    def stat(self, sandbox_id: str, path: str) -> FileInfo:
        """One path's type, size, mode and mtime (a symlink itself, not its target)."""
        raise NotImplementedError

    @op("PUT", "/v1/sandboxes/{sandbox_id}/archive", raw_body="data")
    def put_archive(self, sandbox_id: str, path: str, data: bytes, keep_owners: bool = False
                    ) -> None:
        """Unpack a tar into directory `path` (files, directories, symlinks,
        hard links, modes, times; the owners in the tar with `keep_owners`,
        else the sandbox's root). The whole archive is checked before
        anything is written."""
        raise NotImplementedError

    @op("GET", "/v1/sandboxes/{sandbox_id}/archive")
    def get_archive(self, sandbox_id: str, path: str) -> bytes:
        """`path` and, for a directory, everything under it, as a tar whose
        entries are named from the path's last component."""
        raise NotImplementedError

    # -- snapshots and checkpoints ----------------------------------------------
    @op("POST", "/v1/sandboxes/{sandbox_id}/snapshot", body=("tag",))
    def snapshot(self, sandbox_id: str, tag: str | None = None) -> SnapshotInfo:
        """Its files as an image, committed under `tag`."""
        raise NotImplementedError

    @op("POST", "/v1/sandboxes/{sandbox_id}/fork", body=("n",))
    def fork(self, sandbox_id: str, n: int) -> Forked:
        """n sandboxes of its current files (one snapshot)."""
        raise NotImplementedError

    @op("POST", "/v1/sandboxes/{sandbox_id}/checkpoint", body=("tag",))
    def checkpoint(self, sandbox_id: str, tag: str | None = None) -> CheckpointInfo:
        """Its processes and files at one instant."""
        raise NotImplementedError

    @op("POST", "/v1/checkpoints/restore", fleet=OWN, body=("checkpoint", "labels"))
    def restore_checkpoint(self, checkpoint: str, labels: Labels = None) -> SandboxInfo:
        """A new sandbox from a checkpoint (its id or tag)."""
        raise NotImplementedError

    # -- policy and figures -------------------------------------------------------
    @op("PUT", "/v1/sandboxes/{sandbox_id}/network", json_body="policy")
    def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        """Its network policy from now on."""
        raise NotImplementedError

    @op("GET", "/v1/sandboxes/{sandbox_id}/events")
    def events(self, sandbox_id: str) -> list[SandboxEvent]:
        """What it was refused so far."""
        raise NotImplementedError

    @op("GET", "/v1/sandboxes/{sandbox_id}/reads")
    def reads(self, sandbox_id: str, trace: bool = False) -> ReadLedger:
        """What it read of its image so far."""
        raise NotImplementedError

    @op("GET", "/v1/capabilities/{backend}", fleet=OWN)
    def capabilities(self, backend: str) -> dict[str, Any]:
        """What a backend can do."""
        raise NotImplementedError


def _declared() -> dict[str, Op]:
    out: dict[str, Op] = {}
    for name, fn in vars(SandboxApi).items():
        wire = getattr(fn, "__api_op__", None)
        if wire is None:
            continue
        hints = typing.get_type_hints(fn)
        signature = inspect.signature(fn)
        o = Op(name=name, doc=inspect.getdoc(fn) or "", signature=signature, hints=hints,
               **wire)
        for p in o.params():
            where = o.where(p.name)
            if where == "callback" and o.stream == NEVER:
                raise TypeError(f"{name}: a callback needs a stream")
        for listed in (*o.body, o.json_body, o.raw_body, *o.callbacks):
            if listed is not None and listed not in signature.parameters:
                raise TypeError(f"{name}: {listed} is not one of its parameters")
        out[name] = o
    return out


OPS: dict[str, Op] = _declared()


def is_labels(hint: Any) -> bool:
    return hint == Labels or hint is Mapping[str, str]


@functools.cache
def adapter(hint: Any) -> TypeAdapter[Any]:
    """The pydantic adapter of a declared type (made once per type)."""
    return TypeAdapter(hint)
