"""The SDK: `Sandbox` (blocking) and `AsyncSandbox` (asyncio or trio).

    with Sandbox.create("debian-py:1", cpu=1, memory_mb=2048, labels={"job": "rl-42"}) as sb:
        r = sb.exec("python3 -m pytest -q", timeout=600)
        sb.files.write("/workspace/patch.diff", b"...")

    sb = await AsyncSandbox.create("debian-py:1")
    try:
        r = await sb.exec(["bash", "-lc", "make test"])
    finally:
        await sb.kill()

The same calls reach a node agent (`node="unix:///var/lib/lazyfs-runtime/agent.sock"`
or "http://host:port" with `token=` or $LAZYFS_NODE_TOKEN, or $LAZYFS_NODE)
or, naming none, this machine's node: its agent when one serves the state
directory, else the runtime embedded in this process (runtime.client.connect.resolve).
Importing the SDK loads no node code; an embedded node is loaded when used.
Errors are runtime.errors classes: ImageNotFound,
SandboxNotFound, ExecTimeout / OutputTruncated / OutOfMemory (with `.result`),
Unsupported (a backend that cannot do a call says so), BackendUnavailable,
QuotaExceeded, InvalidSpec, NotCheckpointable.
"""

from __future__ import annotations

import builtins
import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import anyio
import anyio.to_thread

from ..api import OPS, Sink
from ..errors import InvalidSpec
from ..files import FileInfo
from ..spec import (
    DEFAULT_EXEC_TIMEOUT,
    DEFAULT_MAX_OUTPUT,
    SANDBOX_ID_PATTERN,
    Backend,
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
    build,
    command,
)
from .connect import resolve
from .transport import Http, Transport, async_agent_client

if TYPE_CHECKING:
    from ..node import Node

Snapshot = SnapshotInfo  # what sb.snapshot() returns; Sandbox.create(snapshot) runs it
Checkpoint = CheckpointInfo  # what sb.checkpoint() returns; Sandbox.restore(checkpoint)

# a string: Node is only a name here (importing it would load the node)
NodeRef: TypeAlias = "str | Node | Transport | None"
T = TypeVar("T")


def _spec(image: str, backend: Backend, **kw: Any) -> SandboxSpec:
    kw = {k: v for k, v in kw.items() if v is not None}
    if isinstance(kw.get("network"), str):
        kw["network"] = NetworkPolicy() if kw["network"] == "none" else kw["network"]
    return build(SandboxSpec, image=image, backend=backend, **kw)


def _exec_request(cmd: str | Sequence[str], cwd: str | None, env: Mapping[str, str] | None,
                  stdin: bytes | str | None, timeout: float, max_output_bytes: int
                  ) -> ExecRequest:
    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    return build(ExecRequest, cmd=command(cmd), cwd=cwd, env=dict(env or {}), stdin=data,
                 timeout=timeout, max_output_bytes=max_output_bytes)


def _prepare(image: str | SnapshotInfo, *, backend: Backend = "container",
             cpu: float | None = None, memory_mb: int | None = None,
             disk_mb: int | None = None, pids: int | None = None,
             open_files: int | None = None, timeout: float | None = None,
             idle_timeout: float | None = None, network: NetworkPolicy | str | None = None,
             env: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None,
             qos: str | None = None, workdir: str | None = None,
             hidden: Sequence[str] | None = None, node: NodeRef = None,
             token: str | None = None, fleet: str | None = None,
             node_labels: Mapping[str, str] | None = None) -> tuple[Transport, SandboxSpec]:
    """Where a create goes and what it asks (Sandbox.create's arguments)."""
    name = image.image if isinstance(image, SnapshotInfo) else image
    spec = _spec(name, backend, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, pids=pids,
                 open_files=open_files, timeout=timeout, idle_timeout=idle_timeout,
                 network=network, env=dict(env) if env else None,
                 labels=dict(labels) if labels else None, qos=qos, workdir=workdir,
                 hidden=tuple(hidden) if hidden else None)
    t = resolve(node, token, fleet)
    if node_labels:
        from ..fleet.client import Fleet
        if not isinstance(t, Fleet):
            raise InvalidSpec("node_labels= places in a fleet: give fleet= or LAZYFS_FLEET")
        t = t.with_labels(node_labels)
    return t, spec


class Files:
    """`sb.files`: read, write, list, stat, remove, upload, download."""

    def __init__(self, t: Transport, sandbox_id: str) -> None:
        self._t, self._id = t, sandbox_id

    def read(self, path: str) -> bytes:
        return self._t.read(self._id, path)

    def read_text(self, path: str) -> str:
        return self.read(path).decode()

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        self._t.write(self._id, path, data.encode() if isinstance(data, str) else data, mode)

    def list(self, path: str = "/") -> builtins.list[FileInfo]:
        return self._t.list_files(self._id, path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._t.remove(self._id, path, recursive)

    def stat(self, path: str) -> FileInfo:
        """The path's type, size, mode and mtime (a symlink itself, not its
        target); FileError when it does not exist."""
        return self._t.stat(self._id, path)

    def upload(self, local: str | os.PathLike[str], path: str) -> None:
        p = Path(local)
        self.write(path, p.read_bytes(), mode=p.stat().st_mode & 0o7777)

    def download(self, path: str, local: str | os.PathLike[str]) -> None:
        Path(local).write_bytes(self.read(path))

    def put_archive(self, path: str, data: bytes, *, keep_owners: bool = False) -> None:
        """Unpack a tar (plain, gzip, bzip2 or xz) into directory `path`;
        the whole archive is checked before anything is written."""
        self._t.put_archive(self._id, path, data, keep_owners)

    def get_archive(self, path: str) -> bytes:
        """`path` (a directory: with everything under it) as a tar."""
        return self._t.get_archive(self._id, path)


class Sandbox:
    def __init__(self, info: SandboxInfo, transport: Transport) -> None:
        self.info = info
        self._t = transport
        self.files = Files(transport, info.id)

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.spec.backend} {self.info.spec.image}>"

    @classmethod
    def create(cls, image: str | SnapshotInfo, *, backend: Backend = "container",
               cpu: float | None = None,
               memory_mb: int | None = None, disk_mb: int | None = None,
               pids: int | None = None, open_files: int | None = None,
               timeout: float | None = None, idle_timeout: float | None = None,
               network: NetworkPolicy | str | None = None, env: Mapping[str, str] | None = None,
               labels: Mapping[str, str] | None = None, qos: str | None = None,
               workdir: str | None = None, hidden: Sequence[str] | None = None,
               node: NodeRef = None, token: str | None = None, fleet: str | None = None,
               node_labels: Mapping[str, str] | None = None,
               on_progress: Callable[[str], None] | None = None) -> Sandbox:
        """A new sandbox from `image` (a name, a digest, or a Snapshot) on
        `node` (see the module docstring) or on a node of `fleet`
        ("etcd://host:2379" [$LAZYFS_FLEET]: placed by load and image
        locality, on a node carrying `node_labels`); `hidden`: paths of the
        image this sandbox does not see, which verify() shows; `token` is
        the bearer token of a TCP agent [$LAZYFS_NODE_TOKEN]; `on_progress`
        is told each long step of the create, one line each (a first VM of an
        image: building its pmem metadata, booting), from the thread
        that creates (an embedded node) or as the agent streams them."""
        t, spec = _prepare(image, backend=backend, cpu=cpu, memory_mb=memory_mb,
                           disk_mb=disk_mb, pids=pids, open_files=open_files, timeout=timeout,
                           idle_timeout=idle_timeout, network=network, env=env, labels=labels,
                           qos=qos, workdir=workdir, hidden=hidden, node=node, token=token,
                           fleet=fleet, node_labels=node_labels)
        return cls(t.create(spec, on_progress), t)

    @classmethod
    def connect(cls, sandbox_id: str, *, node: NodeRef = None,
                token: str | None = None, fleet: str | None = None) -> Sandbox:
        """The sandbox `sandbox_id` on `node`. A sandbox lives on one node at
        a time and keeps its id across a preemption: while preempted,
        connect raises SandboxPreempted (restore it); once restored, connect
        to the node that restored it (SandboxInfo.node), or name the
        fleet: a fleet sandbox's id names its node."""
        t = resolve(node, token, fleet)
        return cls(t.get(sandbox_id), t)

    @classmethod
    def list(cls, labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
             token: str | None = None, fleet: str | None = None) -> builtins.list[Sandbox]:
        t = resolve(node, token, fleet)
        return [cls(i, t) for i in t.list_sandboxes(labels)]

    @staticmethod
    def pause_many(labels: Mapping[str, str] | None = None, *, snapshot: bool = False,
                   node: NodeRef = None, token: str | None = None,
                   fleet: str | None = None) -> builtins.list[str]:
        """Pause the running sandboxes with these labels; returns their ids.
        With `snapshot`, preempt them instead: each one's files are
        snapshotted into the image store, a record of it kept there, and the
        sandbox stopped (its memory and disk go back to the node);
        restore_many / restore bring them back, here or on another node
        sharing the store, with the same ids, labels and files."""
        return resolve(node, token, fleet).pause_many(labels, snapshot)

    @classmethod
    def restore(cls, what: CheckpointInfo | str, *, labels: Mapping[str, str] | None = None,
                node: NodeRef = None, token: str | None = None,
                fleet: str | None = None) -> Sandbox:
        """Bring a sandbox back on `node`: a preempted sandbox (by its id:
        the same id, labels and files), or a checkpoint (a CheckpointInfo,
        or its id or tag: a new sandbox with its files and its processes
        going on where they were; `labels` replace the checkpointed
        sandbox's). Through `fleet` [$LAZYFS_FLEET], a preempted sandbox
        goes back to the node its id names, or, that one drained or gone,
        to a node placed as a create is, and its id follows it there
        (runtime.fleet.client.Fleet.restore)."""
        t = resolve(node, token, fleet)
        if isinstance(what, str) and re.fullmatch(SANDBOX_ID_PATTERN, what):
            if labels is not None:
                raise InvalidSpec("labels= is for a checkpoint: a preempted sandbox keeps its own")
            return cls(t.restore(what), t)
        name = what.id if isinstance(what, CheckpointInfo) else what
        return cls(t.restore_checkpoint(name, labels), t)

    @staticmethod
    def restore_many(labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                     token: str | None = None) -> builtins.list[str]:
        """Restore the preempted sandboxes with these labels on `node`; their ids."""
        return resolve(node, token).restore_many(labels)

    @staticmethod
    def preempted(labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                  token: str | None = None) -> builtins.list[PreemptedSandbox]:
        """The records of preempted sandboxes with these labels."""
        return resolve(node, token).list_preempted(labels)

    @staticmethod
    def resume_many(labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                    token: str | None = None, fleet: str | None = None) -> builtins.list[str]:
        """Resume the paused sandboxes with these labels; returns their ids."""
        return resolve(node, token, fleet).resume_many(labels)

    @staticmethod
    def kill_many(labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                  token: str | None = None, fleet: str | None = None) -> builtins.list[str]:
        return resolve(node, token, fleet).kill_many(labels)

    @staticmethod
    def capabilities(backend: str, *, node: NodeRef = None,
                     token: str | None = None, fleet: str | None = None) -> dict[str, Any]:
        return resolve(node, token, fleet).capabilities(backend)

    def exec(self, cmd: str | Sequence[str], *, cwd: str | None = None,
             env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
             timeout: float = DEFAULT_EXEC_TIMEOUT, max_output_bytes: int = DEFAULT_MAX_OUTPUT,
             on_stdout: Sink | None = None, on_stderr: Sink | None = None) -> ExecResult:
        """Run `cmd` (a string goes through /bin/sh -c) and wait for it.
        on_stdout/on_stderr receive output as it comes."""
        req = _exec_request(cmd, cwd, env, stdin, timeout, max_output_bytes)
        return self._t.exec(self.id, req, on_stdout, on_stderr)

    def start(self, cmd: str | Sequence[str], *, cwd: str | None = None,
              env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
              timeout: float = DEFAULT_EXEC_TIMEOUT,
              max_output_bytes: int = DEFAULT_MAX_OUTPUT) -> BackgroundExec:
        """Start `cmd` as exec() would and return at once; wait() for it."""
        req = _exec_request(cmd, cwd, env, stdin, timeout, max_output_bytes)
        return self._t.exec_start(self.id, req)

    def wait(self, started: BackgroundExec | str, timeout: float | None = None) -> ExecResult:
        """The result of a command start() started, once it ends (exec()'s
        errors); SandboxStateError when it still runs after `timeout` s."""
        exec_id = started.id if isinstance(started, BackgroundExec) else started
        return self._t.wait(self.id, exec_id, timeout)

    def signal(self, started: BackgroundExec | str, signal: int = 15) -> None:
        """Send `signal` (default SIGTERM) to a command start() started
        (container backend); SIGKILL ends everything it started too."""
        exec_id = started.id if isinstance(started, BackgroundExec) else started
        self._t.signal(self.id, exec_id, signal)

    def snapshot(self, tag: str | None = None) -> SnapshotInfo:
        """The sandbox's files as an image (its image's layers + its writable
        layer packed into one), committed under `tag` (default
        snapshots/<id>:<n>). The sandbox is frozen while its files are
        packed (SnapshotInfo.frozen_s) and runs on after."""
        return self._t.snapshot(self.id, tag)

    def fork(self, n: int) -> builtins.list[Sandbox]:
        """n new sandboxes with this one's current files (one snapshot), each
        with its own writable layer and identity; same spec otherwise."""
        return [Sandbox(c, self._t) for c in self._t.fork(self.id, n).children]

    def checkpoint(self, tag: str | None = None) -> CheckpointInfo:
        """The sandbox's processes (CRIU) and files at one instant, stored as
        a checkpoint (container backend); the sandbox runs on. Raises
        NotCheckpointable naming why when a process cannot be saved."""
        return self._t.checkpoint(self.id, tag)

    def verify(self, cmd: str | Sequence[str], *, cwd: str | None = None,
               env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
               timeout: float = DEFAULT_EXEC_TIMEOUT,
               max_output_bytes: int = DEFAULT_MAX_OUTPUT,
               keep: Sequence[str] | None = None) -> ExecResult:
        """Run `cmd` in a fresh sandbox made from this one's current files
        over its image, where the hidden paths are visible: no process of
        this sandbox's alive, no network. What a grader can trust.
        `keep`: take only these paths of the sandbox's files (e.g. the
        workspace); the rest, such as a /bin/sh or python the sandbox
        replaced, is the image's."""
        req = _exec_request(cmd, cwd, env, stdin, timeout, max_output_bytes)
        return self._t.verify(self.id, build(VerifyRequest, exec=req,
                                             keep=tuple(keep) if keep is not None else None))

    def refresh(self) -> SandboxInfo:
        self.info = self._t.get(self.id)
        return self.info

    def set_network(self, policy: NetworkPolicy) -> SandboxInfo:
        """The sandbox's network from now on, for a task's phases (setup with
        a package mirror, the agent with `NetworkPolicy.none()`, ...):
        connections the new policy refuses are cut. Containers only."""
        self.info = self._t.set_network(self.id, policy)
        return self.info

    def events(self) -> builtins.list[SandboxEvent]:
        """What the sandbox was refused so far: denied system calls, refused
        connections, OOM kills, forks refused at the pids limit; each a count
        with the first and last time seen."""
        return self._t.events(self.id)

    def reads(self, trace: bool = False) -> ReadLedger:
        """What the sandbox read of its image so far (files opened, chunks
        and bytes first read through its root; with trace, those reads in
        order): a rollout's read ledger. Containers."""
        return self._t.reads(self.id, trace)

    def pause(self) -> dict[str, Any]:
        """Freeze; returns memory figures before/after the reclaim."""
        return self._t.pause(self.id)

    def resume(self) -> None:
        self._t.resume(self.id)

    def preempt(self) -> PreemptedSandbox:
        """Snapshot, record and stop this sandbox (see pause_many's
        `snapshot`); Sandbox.restore(sb.id) brings it back."""
        return self._t.preempt(self.id)

    def kill(self) -> None:
        self._t.kill(self.id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        from ..errors import SandboxNotFound
        try:
            self.kill()
        except SandboxNotFound:
            pass


async def _thread(fn: Any, *args: Any, **kw: Any) -> Any:
    # One limiter per call: the SDK must not cap how many sandboxes a rollout
    # drives at once (anyio's default limiter allows 40 threads).
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kw),
                                          limiter=anyio.CapacityLimiter(1))


async def _call(t: Transport, name: str, *args: Any) -> Any:
    """Operation `name` of runtime.api on `t`: a node agent's through its
    AsyncHttp client in this event loop (no thread); an embedded node's or a
    fleet's in a worker thread."""
    if isinstance(t, Http):
        client = await async_agent_client(t.url, t.token, t.server_name)
        return await client.call(OPS[name], args, {})
    return await _thread(getattr(t, name), *args)


async def _resolve(node: NodeRef, token: str | None, fleet: str | None) -> Transport:
    if isinstance(node, str) and fleet is None:
        return resolve(node, token)  # (no I/O)
    t: Transport = await _thread(resolve, node, token, fleet)  # may start a node
    return t


class AsyncFiles:
    def __init__(self, t: Transport, sandbox_id: str) -> None:
        self._t, self._id = t, sandbox_id

    async def read(self, path: str) -> bytes:
        data: bytes = await _call(self._t, "read", self._id, path)
        return data

    async def read_text(self, path: str) -> str:
        return (await self.read(path)).decode()

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        await _call(self._t, "write", self._id, path,
                    data.encode() if isinstance(data, str) else data, mode)

    async def list(self, path: str = "/") -> builtins.list[FileInfo]:
        out: builtins.list[FileInfo] = await _call(self._t, "list_files", self._id, path)
        return out

    async def stat(self, path: str) -> FileInfo:
        out: FileInfo = await _call(self._t, "stat", self._id, path)
        return out

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await _call(self._t, "remove", self._id, path, recursive)

    async def upload(self, local: str | os.PathLike[str], path: str) -> None:
        p = Path(local)
        data: bytes = await _thread(p.read_bytes)
        await self.write(path, data, mode=p.stat().st_mode & 0o7777)

    async def download(self, path: str, local: str | os.PathLike[str]) -> None:
        data = await self.read(path)
        await _thread(Path(local).write_bytes, data)

    async def put_archive(self, path: str, data: bytes, *, keep_owners: bool = False) -> None:
        await _call(self._t, "put_archive", self._id, path, data, keep_owners)

    async def get_archive(self, path: str) -> bytes:
        out: bytes = await _call(self._t, "get_archive", self._id, path)
        return out


class AsyncSandbox:
    """The same calls as Sandbox, awaitable from asyncio or trio. To a node
    agent they go without threads (runtime.client.transport.AsyncHttp: one pool of
    connections per agent and event loop; thousands of calls in flight wait
    for a connection, not a thread), and on_stdout / on_stderr /
    on_progress are called in the event loop as output comes. An embedded
    node's and a fleet's calls run in worker threads, their callbacks
    called from those."""

    def __init__(self, info: SandboxInfo, transport: Transport) -> None:
        self.info = info
        self._t = transport
        self.files = AsyncFiles(transport, info.id)

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def sync(self) -> Sandbox:
        """The same sandbox, for blocking calls."""
        return Sandbox(self.info, self._t)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.spec.backend} {self.info.spec.image}>"

    @classmethod
    async def create(cls, image: str | SnapshotInfo, *,
                     on_progress: Callable[[str], None] | None = None,
                     **kw: Any) -> AsyncSandbox:
        """Sandbox.create's arguments."""
        if isinstance(kw.get("node"), str) and kw.get("fleet") is None:
            t, spec = _prepare(image, **kw)
        else:
            t, spec = await _thread(_prepare, image, **kw)
        info: SandboxInfo = await _call(t, "create", spec, on_progress)
        return cls(info, t)

    @classmethod
    async def connect(cls, sandbox_id: str, *, node: NodeRef = None,
                      token: str | None = None, fleet: str | None = None) -> AsyncSandbox:
        t = await _resolve(node, token, fleet)
        info: SandboxInfo = await _call(t, "get", sandbox_id)
        return cls(info, t)

    @classmethod
    async def list(cls, labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                   token: str | None = None, fleet: str | None = None
                   ) -> builtins.list[AsyncSandbox]:
        t = await _resolve(node, token, fleet)
        infos: builtins.list[SandboxInfo] = await _call(t, "list_sandboxes", labels)
        return [cls(i, t) for i in infos]

    @staticmethod
    async def pause_many(labels: Mapping[str, str] | None = None, *, snapshot: bool = False,
                         node: NodeRef = None, token: str | None = None,
                         fleet: str | None = None) -> builtins.list[str]:
        t = await _resolve(node, token, fleet)
        out: builtins.list[str] = await _call(t, "pause_many", labels, snapshot)
        return out

    @classmethod
    async def restore(cls, what: CheckpointInfo | str, *,
                      labels: Mapping[str, str] | None = None, node: NodeRef = None,
                      token: str | None = None, fleet: str | None = None) -> AsyncSandbox:
        s: Sandbox = await _thread(Sandbox.restore, what, labels=labels, node=node,
                                   token=token, fleet=fleet)
        return cls(s.info, s._t)

    @staticmethod
    async def restore_many(labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                           token: str | None = None) -> builtins.list[str]:
        t = await _resolve(node, token, None)
        out: builtins.list[str] = await _call(t, "restore_many", labels)
        return out

    @staticmethod
    async def resume_many(labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                          token: str | None = None, fleet: str | None = None
                          ) -> builtins.list[str]:
        t = await _resolve(node, token, fleet)
        out: builtins.list[str] = await _call(t, "resume_many", labels)
        return out

    @staticmethod
    async def preempted(labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                        token: str | None = None) -> builtins.list[PreemptedSandbox]:
        t = await _resolve(node, token, None)
        out: builtins.list[PreemptedSandbox] = await _call(t, "list_preempted", labels)
        return out

    @staticmethod
    async def kill_many(labels: Mapping[str, str] | None = None, *, node: NodeRef = None,
                        token: str | None = None, fleet: str | None = None
                        ) -> builtins.list[str]:
        t = await _resolve(node, token, fleet)
        out: builtins.list[str] = await _call(t, "kill_many", labels)
        return out

    async def exec(self, cmd: str | Sequence[str], *, cwd: str | None = None,
                   env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                   timeout: float = DEFAULT_EXEC_TIMEOUT,
                   max_output_bytes: int = DEFAULT_MAX_OUTPUT,
                   on_stdout: Sink | None = None, on_stderr: Sink | None = None) -> ExecResult:
        req = _exec_request(cmd, cwd, env, stdin, timeout, max_output_bytes)
        r: ExecResult = await _call(self._t, "exec", self.id, req, on_stdout, on_stderr)
        return r

    async def start(self, cmd: str | Sequence[str], *, cwd: str | None = None,
                    env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                    timeout: float = DEFAULT_EXEC_TIMEOUT,
                    max_output_bytes: int = DEFAULT_MAX_OUTPUT) -> BackgroundExec:
        req = _exec_request(cmd, cwd, env, stdin, timeout, max_output_bytes)
        out: BackgroundExec = await _call(self._t, "exec_start", self.id, req)
        return out

    async def wait(self, started: BackgroundExec | str, timeout: float | None = None
                   ) -> ExecResult:
        exec_id = started.id if isinstance(started, BackgroundExec) else started
        r: ExecResult = await _call(self._t, "wait", self.id, exec_id, timeout)
        return r

    async def signal(self, started: BackgroundExec | str, signal: int = 15) -> None:
        exec_id = started.id if isinstance(started, BackgroundExec) else started
        await _call(self._t, "signal", self.id, exec_id, signal)

    async def snapshot(self, tag: str | None = None) -> SnapshotInfo:
        out: SnapshotInfo = await _call(self._t, "snapshot", self.id, tag)
        return out

    async def set_network(self, policy: NetworkPolicy) -> SandboxInfo:
        self.info = await _call(self._t, "set_network", self.id, policy)
        return self.info

    async def events(self) -> builtins.list[SandboxEvent]:
        out: builtins.list[SandboxEvent] = await _call(self._t, "events", self.id)
        return out

    async def reads(self, trace: bool = False) -> ReadLedger:
        out: ReadLedger = await _call(self._t, "reads", self.id, trace)
        return out

    async def fork(self, n: int) -> builtins.list[AsyncSandbox]:
        forked: Forked = await _call(self._t, "fork", self.id, n)
        return [AsyncSandbox(c, self._t) for c in forked.children]

    async def checkpoint(self, tag: str | None = None) -> CheckpointInfo:
        out: CheckpointInfo = await _call(self._t, "checkpoint", self.id, tag)
        return out

    async def verify(self, cmd: str | Sequence[str], *, cwd: str | None = None,
                     env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                     timeout: float = DEFAULT_EXEC_TIMEOUT,
                     max_output_bytes: int = DEFAULT_MAX_OUTPUT,
                     keep: Sequence[str] | None = None) -> ExecResult:
        req = _exec_request(cmd, cwd, env, stdin, timeout, max_output_bytes)
        r: ExecResult = await _call(self._t, "verify", self.id, build(
            VerifyRequest, exec=req, keep=tuple(keep) if keep is not None else None))
        return r

    async def refresh(self) -> SandboxInfo:
        self.info = await _call(self._t, "get", self.id)
        return self.info

    async def pause(self) -> dict[str, Any]:
        out: dict[str, Any] = await _call(self._t, "pause", self.id)
        return out

    async def resume(self) -> None:
        await _call(self._t, "resume", self.id)

    async def preempt(self) -> PreemptedSandbox:
        out: PreemptedSandbox = await _call(self._t, "preempt", self.id)
        return out

    async def kill(self) -> None:
        await _call(self._t, "kill", self.id)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        from ..errors import SandboxNotFound
        try:
            await self.kill()
        except SandboxNotFound:
            pass
