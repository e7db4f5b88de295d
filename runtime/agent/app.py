"""HTTP API of the node agent (OpenAPI schema at /openapi.json, docs at /docs).

    GET    /v1/health
    GET    /metrics                           Prometheus text format (metrics.py)
    GET    /v1/capabilities/{backend}
    POST   /v1/sandboxes                      SandboxSpec → SandboxInfo
    POST   /v1/sandboxes?progress=true        SandboxSpec → NDJSON stream:
           {"step": "booting the guest ..."} … then {"sandbox": SandboxInfo}
           or {"error": {"type", "message"}}; a create whose client went
           away is undone (at its next step, or once it is made)
    GET    /v1/sandboxes?label=k=v            → [SandboxInfo]
    GET    /v1/sandboxes/{id}                 → SandboxInfo
    DELETE /v1/sandboxes/{id}
    POST   /v1/sandboxes/{id}/pause | /resume
    POST   /v1/sandboxes/{id}/exec            ExecRequest → NDJSON stream:
           {"stdout": b64} / {"stderr": b64} … then {"result": ExecResult}
           or {"error": {"type", "message", "result"}}
    GET|PUT|DELETE /v1/sandboxes/{id}/files?path=…   raw bytes
    GET    /v1/sandboxes/{id}/files/list?path=…
    POST   /v1/bulk/pause | /resume | /kill   {"labels": {…}} → [ids]
    POST   /v1/bulk/pause                     {"labels": {…}, "snapshot": true}: preempt → [ids]
    POST   /v1/bulk/restore                   {"labels": {…}} → [ids] restored here
    GET    /v1/preempted?label=k=v            → [PreemptedSandbox]
    POST   /v1/sandboxes/{id}/preempt         → PreemptedSandbox
    POST   /v1/preempted/{id}/restore         → SandboxInfo (same id, on this node)

Errors: {"error": {"type": <runtime.errors class>, "message": …}} with the
class's HTTP status. A bearer token, when the agent has one, is required on
every call (TCP listeners); the Unix socket is protected by its permissions.
"""

from __future__ import annotations

import base64
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
import anyio.from_thread
import anyio.to_thread
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from ..backends import capabilities
from ..errors import ExecError, SandboxError
from ..files import FileInfo
from ..node import Node
from ..spec import (
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
from .metrics import CONTENT_TYPE, AgentMetrics

STREAM_BUFFER = 64
EXEC_THREADS = 8192  # execs hold a thread for their whole run; control calls must not wait

_exec_limiter: anyio.CapacityLimiter | None = None


def exec_limiter() -> anyio.CapacityLimiter:
    global _exec_limiter
    if _exec_limiter is None:  # created inside the event loop
        _exec_limiter = anyio.CapacityLimiter(EXEC_THREADS)
    return _exec_limiter


class Labels(BaseModel):
    labels: dict[str, str] = {}


class PauseMany(Labels):
    snapshot: bool = False  # preempt: snapshot, record and stop them


class SnapshotRequest(BaseModel):
    tag: str | None = None


class RestoreRequest(BaseModel):
    checkpoint: str  # a checkpoint's id or tag
    labels: dict[str, str] | None = None


class ForkRequest(BaseModel):
    n: int


class Forked(BaseModel):
    snapshot: SnapshotInfo
    children: list[SandboxInfo]


def _labels(raw: list[str]) -> dict[str, str]:
    out = {}
    for item in raw:
        k, sep, v = item.partition("=")
        if not sep:
            raise SandboxError(f"label filter {item!r} is not key=value")
        out[k] = v
    return out


def error_body(e: SandboxError) -> dict[str, Any]:
    body: dict[str, Any] = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, ExecError) and e.result is not None:
        body["result"] = e.result.model_dump(mode="json")
    return {"error": body}


def make_app(node: Node, token: str | None = None,
             metrics: AgentMetrics | None = None) -> FastAPI:
    """The API over `node`; `metrics`: shared by every app over the same
    node (the agent's Unix-socket and TCP servers count into one)."""
    app = FastAPI(title="lazyfs node agent", version="1",
                  description="Sandboxes on this node: create, exec, files, pause, kill.")
    m = metrics or AgentMetrics(node)

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args)

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, e: SandboxError) -> JSONResponse:
        status = 400 if type(e) is SandboxError else e.status
        return JSONResponse(error_body(e), status_code=status)

    if token is not None:
        @app.middleware("http")
        async def _auth(request: Request, call_next: Callable[..., Any]) -> Any:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return JSONResponse({"error": {"type": "Unauthorized",
                                               "message": "missing or wrong bearer token"}},
                                    status_code=401)
            return await call_next(request)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "sandboxes": len(node.sandboxes())}

    @app.get("/v1/capabilities/{backend}")
    async def caps(backend: str) -> dict[str, Any]:
        return capabilities(backend).as_dict()

    @app.get("/metrics")
    async def metrics_() -> Response:
        return Response(await run(m.render), media_type=CONTENT_TYPE)

    @app.post("/v1/sandboxes", status_code=201, response_model=SandboxInfo)
    async def create(spec: SandboxSpec, progress: bool = False) -> Any:
        if progress:  # each step as it happens: a first VM of an image takes seconds
            return StreamingResponse(_create_stream(node, spec, m),
                                     media_type="application/x-ndjson")
        try:
            info: SandboxInfo = await run(node.create, spec)
        except SandboxError as e:
            m.refusals.labels(type(e).__name__).inc()
            raise
        m.creates.labels(spec.backend).inc()
        return info

    @app.get("/v1/sandboxes")
    async def list_sandboxes(label: Annotated[list[str] | None, Query()] = None
                             ) -> list[SandboxInfo]:
        return node.sandboxes(_labels(label or []))

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get(sandbox_id: str) -> SandboxInfo:
        info: SandboxInfo = await run(node.get, sandbox_id)  # (a miss may read the store)
        return info

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204)
    async def kill(sandbox_id: str) -> Response:
        await run(node.kill, sandbox_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str) -> dict[str, Any]:
        figures: dict[str, Any] = await run(node.pause, sandbox_id)
        return figures

    @app.post("/v1/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str) -> dict[str, Any]:
        await run(node.resume, sandbox_id)
        return {"ok": True}

    @app.post("/v1/bulk/pause")
    async def pause_many(body: PauseMany) -> list[str]:
        ids: list[str] = await run(node.pause_many, body.labels, body.snapshot)
        return ids

    @app.post("/v1/bulk/restore")
    async def restore_many(body: Labels) -> list[str]:
        ids: list[str] = await run(node.restore_many, body.labels)
        return ids

    @app.get("/v1/preempted")
    async def list_preempted(label: Annotated[list[str] | None, Query()] = None
                             ) -> list[PreemptedSandbox]:
        out: list[PreemptedSandbox] = await run(node.preempted_sandboxes,
                                                _labels(label or []))
        return out

    @app.post("/v1/sandboxes/{sandbox_id}/preempt")
    async def preempt(sandbox_id: str) -> PreemptedSandbox:
        record: PreemptedSandbox = await run(node.preempt, sandbox_id)
        return record

    @app.post("/v1/preempted/{sandbox_id}/restore")
    async def restore(sandbox_id: str) -> SandboxInfo:
        info: SandboxInfo = await run(node.restore, sandbox_id)
        return info

    @app.post("/v1/bulk/resume")
    async def resume_many(body: Labels) -> list[str]:
        ids: list[str] = await run(node.resume_many, body.labels)
        return ids

    @app.post("/v1/bulk/kill")
    async def kill_many(body: Labels) -> list[str]:
        ids: list[str] = await run(node.kill_many, body.labels)
        return ids

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_(sandbox_id: str, req: ExecRequest) -> StreamingResponse:
        node.get(sandbox_id)  # a missing sandbox is a 404, not a stream
        return StreamingResponse(_exec_stream(node, sandbox_id, req, m),
                                 media_type="application/x-ndjson")

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot")
    async def snapshot(sandbox_id: str, body: SnapshotRequest) -> SnapshotInfo:
        snap: SnapshotInfo = await run(node.snapshot, sandbox_id, body.tag)
        return snap

    @app.post("/v1/sandboxes/{sandbox_id}/fork")
    async def fork(sandbox_id: str, body: ForkRequest) -> Forked:
        snap, children = await run(node.fork, sandbox_id, body.n)
        return Forked(snapshot=snap, children=children)

    @app.post("/v1/sandboxes/{sandbox_id}/checkpoint")
    async def checkpoint(sandbox_id: str, body: SnapshotRequest) -> CheckpointInfo:
        ckpt: CheckpointInfo = await run(node.checkpoint, sandbox_id, body.tag)
        return ckpt

    @app.post("/v1/checkpoints/restore")
    async def restore_checkpoint(body: RestoreRequest) -> SandboxInfo:
        info: SandboxInfo = await run(node.restore_checkpoint, body.checkpoint, body.labels)
        return info

    @app.post("/v1/sandboxes/{sandbox_id}/verify")
    async def verify(sandbox_id: str, req: VerifyRequest) -> ExecResult:
        result: ExecResult = await run(node.verify, sandbox_id, req.exec, req.keep)
        return result

    @app.put("/v1/sandboxes/{sandbox_id}/network")
    async def set_network(sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        out: SandboxInfo = await run(node.set_network, sandbox_id, policy)
        return out

    @app.get("/v1/sandboxes/{sandbox_id}/events")
    async def events(sandbox_id: str) -> list[SandboxEvent]:
        out: list[SandboxEvent] = await run(node.events, sandbox_id)
        return out

    @app.get("/v1/sandboxes/{sandbox_id}/reads")
    async def reads(sandbox_id: str, trace: bool = False) -> ReadLedger:
        out: ReadLedger = await run(node.reads, sandbox_id, trace)
        return out

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def read_file(sandbox_id: str, path: str) -> Response:
        files = node.files(sandbox_id)
        data: bytes = await run(files.read, path)
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def write_file(sandbox_id: str, path: str, request: Request,
                         mode: int = 0o644) -> Response:
        files = node.files(sandbox_id)
        data = await request.body()
        await anyio.to_thread.run_sync(lambda: files.write(path, data, mode=mode))
        return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove_file(sandbox_id: str, path: str, recursive: bool = False) -> Response:
        files = node.files(sandbox_id)
        await anyio.to_thread.run_sync(lambda: files.remove(path, recursive=recursive))
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list")
    async def list_files(sandbox_id: str, path: str = "/") -> list[FileInfo]:
        result: list[FileInfo] = await run(node.list_files, sandbox_id, path)
        return result

    return app


class _ClientGone(SandboxError):
    """The client of a streamed create stopped reading: the create is undone."""


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


async def _create_stream(node: Node, spec: SandboxSpec, metrics: AgentMetrics
                         ) -> AsyncIterator[bytes]:
    send, receive = anyio.create_memory_object_stream[bytes](STREAM_BUFFER)

    def emit(obj: dict[str, Any]) -> None:
        try:
            anyio.from_thread.run(send.send, _line(obj))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            raise _ClientGone("the client of this create went away") from e

    def work() -> None:
        try:
            info = node.create(spec, lambda step: emit({"step": step}))
        except SandboxError as e:
            if not isinstance(e, _ClientGone):
                metrics.refusals.labels(type(e).__name__).inc()
                try:
                    emit(error_body(e))
                except _ClientGone:
                    pass
            return
        metrics.creates.labels(spec.backend).inc()
        try:
            emit({"sandbox": info.model_dump(mode="json")})
        except _ClientGone:  # nobody will learn its id: do not leave it running
            node.kill(info.id)

    async def drive() -> None:
        async with send:
            await anyio.to_thread.run_sync(work)

    async with anyio.create_task_group() as tg:
        tg.start_soon(drive)
        async with receive:
            async for chunk in receive:
                yield chunk


async def _exec_stream(node: Node, sandbox_id: str, req: ExecRequest,
                       metrics: AgentMetrics) -> AsyncIterator[bytes]:
    send, receive = anyio.create_memory_object_stream[bytes](STREAM_BUFFER)

    def line(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj).encode() + b"\n"

    def sink(key: str) -> Callable[[bytes], None]:
        def emit(data: bytes) -> None:
            anyio.from_thread.run(send.send, line({key: base64.b64encode(data).decode()}))
        return emit

    def work() -> None:
        t0 = time.monotonic()
        try:
            r = node.exec(sandbox_id, req, sink("stdout"), sink("stderr"))
            msg = line({"result": r.model_dump(mode="json")})
        except SandboxError as e:
            msg = line(error_body(e))
        backend: str
        try:
            backend = node.get(sandbox_id).spec.backend
        except SandboxError:  # killed meanwhile
            backend = "unknown"
        metrics.exec_seconds.labels(backend).observe(time.monotonic() - t0)
        anyio.from_thread.run(send.send, msg)

    async def drive() -> None:
        async with send:
            await anyio.to_thread.run_sync(work, limiter=exec_limiter())

    async with anyio.create_task_group() as tg:
        tg.start_soon(drive)
        async with receive:
            async for chunk in receive:
                yield chunk
