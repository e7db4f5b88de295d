"""HTTP API of the node agent (OpenAPI schema at /openapi.json, docs at /docs).

Every sandbox operation is a route made from its declaration in runtime.api
(method, path, where each parameter travels, what it answers, whether it
streams); nothing here names one but to count it (metrics). Besides them:

    GET    /v1/health
    GET    /metrics                           Prometheus text format (metrics.py)

A streamed create whose client went away is undone (the operation's `undo`,
at its next step or once it is made). Errors: {"error": {"type":
<runtime.errors class>, "message": …}} with the class's HTTP status. A
bearer token, when the agent has one, is required on every call (TCP
listeners); the Unix socket is protected by its permissions.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import inspect
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any

import anyio
import anyio.from_thread
import anyio.to_thread
from fastapi import Body, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from ..api import ALWAYS, NEVER, ON_REQUEST, OPS, Op, adapter, is_labels
from ..errors import ExecError, Overloaded, SandboxError
from ..node import Node
from .metrics import CONTENT_TYPE, AgentMetrics

STREAM_BUFFER = 64
EXEC_THREADS = 8192  # execs hold a thread for their whole run; control calls must not wait

_exec_limiter: anyio.CapacityLimiter | None = None


def exec_limiter() -> anyio.CapacityLimiter:
    global _exec_limiter
    if _exec_limiter is None:  # created inside the event loop
        _exec_limiter = anyio.CapacityLimiter(EXEC_THREADS)
    return _exec_limiter


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


class Admission:
    """At most `limit` calls in flight over every app of one agent (its
    Unix socket and TCP servers): the next is answered 503 Overloaded at
    once, before the node sees it (a typed error the SDK retries), never a
    dropped connection. A call is in flight until its answer's last byte
    (a streamed exec for its whole run)."""

    def __init__(self, metrics: AgentMetrics, limit: int) -> None:
        self.metrics, self.limit = metrics, limit
        self.in_flight = 0

    def wrap(self, app: Any) -> Any:
        async def admitted(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            if self.in_flight >= self.limit:
                self.metrics.overloaded.inc()
                e = Overloaded(f"the node agent has {self.in_flight} calls in flight, its "
                               f"limit: retry")
                await JSONResponse(error_body(e), status_code=e.status,
                                   headers={"retry-after": "1"})(scope, receive, send)
                return
            self.in_flight += 1
            self.metrics.in_flight.inc()
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1
                self.metrics.in_flight.dec()
        return admitted


def make_app(node: Node, token: str | None = None,
             metrics: AgentMetrics | None = None) -> FastAPI:
    """The API over `node`; `metrics`: shared by every app over the same
    node (the agent's Unix-socket and TCP servers count into one). The
    agent serves it through an Admission (server.py)."""
    app = FastAPI(title="lazyfs node agent", version="1",
                  description="Sandboxes on this node: create, exec, files, pause, kill.")
    m = metrics or AgentMetrics(node)

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, e: SandboxError) -> JSONResponse:
        status = 400 if type(e) is SandboxError else e.status
        return JSONResponse(error_body(e), status_code=status)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        # (a bug: the caller learns what failed in one line; the log has the traceback)
        return JSONResponse({"error": {"type": "SandboxError", "message":
                                       f"the node agent failed: {type(e).__name__}: {e}"}},
                            status_code=500)

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
        return {"ok": True, "sandboxes": len(node.list_sandboxes())}

    @app.get("/metrics")
    async def metrics_() -> Response:
        return Response(await anyio.to_thread.run_sync(m.render), media_type=CONTENT_TYPE)

    for o in OPS.values():
        no_body = o.returns is type(None) or o.returns is bytes
        app.add_api_route(o.path, _endpoint(node, o, m), methods=[o.method], name=o.name,
                          status_code=204 if o.returns is type(None) else o.status,
                          response_model=None if no_body else o.returns,
                          summary=o.doc.splitlines()[0] if o.doc else None)
    return app


def _server_hint(hint: Any) -> Any:
    """A declared type as FastAPI takes it in a body."""
    return dict[str, str] | None if is_labels(hint) else hint


def _endpoint(node: Node, o: Op, m: AgentMetrics) -> Callable[..., Any]:
    """The route of one operation: its parameters where runtime.api's wire
    rule puts them (a signature FastAPI reads: validation and the OpenAPI
    schema come from it), the node's method called in a worker thread."""
    params = [inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request)]
    for p in o.params():
        where, hint = o.where(p.name), o.hints[p.name]
        default = p.default
        if where == "path":
            ann: Any = hint
        elif where == "query":
            ann = (Annotated[list[str] | None, Query(alias="label")] if is_labels(hint)
                   else Annotated[hint, Query()])
        elif where == "body":
            ann = Annotated[_server_hint(hint), Body(embed=True)]
        elif where == "json_body":
            ann = hint
        elif where == "callback" and o.stream == ON_REQUEST:
            ann, default = Annotated[bool, Query()], False  # the caller asks for its lines
        else:  # a raw body (read below) or a callback always streamed
            continue
        params.append(inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY,
                                        annotation=ann, default=default))

    async def endpoint(request: Request, **kw: Any) -> Any:
        args: dict[str, Any] = {}
        for p in o.params():
            where = o.where(p.name)
            if where == "callback":
                continue
            if where == "raw_body":
                args[p.name] = await request.body()
            elif where == "query" and is_labels(o.hints[p.name]):
                args[p.name] = _labels(kw[p.name] or [])
            else:
                args[p.name] = kw[p.name]
        wanted = {n: w for n, w in o.callbacks.items()
                  if o.stream == ALWAYS or (o.stream == ON_REQUEST and kw.get(n))}
        if o.stream != NEVER and (o.stream == ALWAYS or wanted):
            if "sandbox_id" in args:  # a missing sandbox is a 404, not a stream
                await anyio.to_thread.run_sync(node.get, args["sandbox_id"])
            return StreamingResponse(_stream(node, o, args, wanted, m),
                                     media_type="application/x-ndjson")
        t0 = time.monotonic()
        made: list[str] = []

        def call() -> Any:
            with _unanswered(node, o, made):
                return getattr(node, o.name)(**args)
        try:
            result = await anyio.to_thread.run_sync(call)
        except SandboxError as e:
            _observe(node, m, o, args, e, time.monotonic() - t0)
            raise
        _observe(node, m, o, args, None, time.monotonic() - t0)
        response = _answer(o, result)
        if made:  # (a background task runs once the answer is sent)
            response.background = BackgroundTask(node.recovery.answered, made)
        return response

    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__name__ = o.name
    return endpoint


def _unanswered(node: Node, o: Op, made: list[str]) -> contextlib.AbstractContextManager[None]:
    """Around an operation that makes sandboxes its caller must learn of
    (one with an `undo`): they stay marked until the answer is sent, so a
    killed agent's node removes them at its next start (Recovery.answer_due)."""
    return node.recovery.answer_due(made) if o.undo is not None else contextlib.nullcontext()


def _answer(o: Op, result: Any) -> Response:
    if o.returns is type(None):
        return Response(status_code=204)
    if o.returns is bytes:
        return Response(result, status_code=o.status, media_type="application/octet-stream")
    return Response(adapter(o.returns).dump_json(result), status_code=o.status,
                    media_type="application/json")


def _observe(node: Node, m: AgentMetrics, o: Op, args: Mapping[str, Any],
             error: SandboxError | None, seconds: float) -> None:
    """The agent's counts of creates and execs."""
    if o.name == "create":
        if error is None:
            m.creates.labels(args["spec"].backend).inc()
        elif not isinstance(error, _ClientGone):
            m.refusals.labels(type(error).__name__).inc()
    elif o.name == "exec":
        backend: str
        try:
            backend = node.get(args["sandbox_id"]).spec.backend
        except SandboxError:  # killed meanwhile
            backend = "unknown"
        m.exec_seconds.labels(backend).observe(seconds)


class _ClientGone(SandboxError):
    """The client of a streamed create stopped reading: the create is undone."""


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


async def _stream(node: Node, o: Op, args: Mapping[str, Any], wanted: Mapping[str, str],
                  m: AgentMetrics) -> AsyncIterator[bytes]:
    """The streamed answer of `o` (runtime.api): a line per callback call
    as it happens, then the answer or the error."""
    send, receive = anyio.create_memory_object_stream[bytes](STREAM_BUFFER)

    def emit(obj: dict[str, Any]) -> None:
        try:
            anyio.from_thread.run(send.send, _line(obj))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            raise _ClientGone(f"the client of this {o.name} went away") from e

    def callback(param: str, wire: str) -> Callable[[Any], None]:
        if o.callback_type(param) is bytes:
            return lambda data: emit({wire: base64.b64encode(data).decode()})
        return lambda value: emit({wire: value})

    made: list[str] = []

    def work() -> None:
        kw = dict(args)
        kw.update({p: callback(p, w) for p, w in wanted.items()})
        t0 = time.monotonic()
        try:
            with _unanswered(node, o, made):
                result = getattr(node, o.name)(**kw)
        except SandboxError as e:
            _observe(node, m, o, args, e, time.monotonic() - t0)
            if not isinstance(e, _ClientGone):
                try:
                    emit(error_body(e))
                except _ClientGone:
                    pass
            return
        _observe(node, m, o, args, None, time.monotonic() - t0)
        try:
            emit({o.result_key: adapter(o.returns).dump_python(result, mode="json")})
        except _ClientGone:  # nobody will learn of it: do not leave it running
            if o.undo is not None:
                getattr(node, o.undo)(result.id)

    async def drive() -> None:
        async with send:
            await anyio.to_thread.run_sync(work, limiter=exec_limiter())

    async with anyio.create_task_group() as tg:
        tg.start_soon(drive)
        async with receive:
            async for chunk in receive:
                yield chunk
    # (the server asks for more once the last line is written to the socket)
    node.recovery.answered(made)
