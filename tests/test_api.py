"""The sandbox API is declared once (runtime/api.py) and every face of it
follows: the embedded Node implements each operation with the declared
signature, the agent's client and the fleet have one method per operation
made from the declaration, the agent serves a route per operation (its
OpenAPI schema lists them), and an operation added only to the declaration
and the Node (`stat`) works through all of them: embedded, over the agent's
Unix socket, over TCP with a token, and through a fleet."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime import (
    AsyncSandbox,
    ExecTimeout,
    FileError,
    Sandbox,
    SandboxNotFound,
    SandboxStateError,
)
from runtime.api import OPS, OWN, SandboxApi
from runtime.client.transport import Http, encode
from runtime.fleet.client import Fleet
from runtime.node import Node
from tests.helpers.agents import Agent, running_agent
from tests.helpers.sandboxes import IMAGE, busybox_node, runtime_missing


def _shape(fn: object) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_node_implements_each_operation_as_declared(name: str) -> None:
    declared = getattr(SandboxApi, name)
    assert name in vars(Node), f"Node does not define {name}: it would inherit a stub"
    assert _shape(vars(Node)[name]) == _shape(declared)


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_client_and_the_fleet_have_each_operation(name: str) -> None:
    declared = getattr(SandboxApi, name)
    for cls in (Http, Fleet):
        method = vars(cls).get(name)
        assert method is not None and method is not declared, f"{cls.__name__}.{name}"
        assert _shape(method) == _shape(declared), f"{cls.__name__}.{name}"
    if OPS[name].fleet != OWN:  # derived, not written: it carries the declaration's doc
        assert vars(Fleet)[name].__doc__ == OPS[name].doc


def test_a_call_travels_as_the_wire_rule_says() -> None:
    """Path segments are quoted (an id cannot walk the agent's routes),
    labels are repeated label= parameters, body fields one JSON object."""
    c = encode(OPS["read"], ("sb-0/../../v1/bulk", "/etc/x"), {})
    assert c.path == "/v1/sandboxes/sb-0%2F..%2F..%2Fv1%2Fbulk/files"
    assert c.params == [("path", "/etc/x")] and c.content is None and not c.streamed
    c = encode(OPS["list_sandboxes"], ({"a": "1", "b": "x=y"},), {})
    assert c.params == [("label", "a=1"), ("label", "b=x=y")]
    c = encode(OPS["pause_many"], ({"job": "7"},), {"snapshot": True})
    assert c.content == b'{"labels": {"job": "7"}, "snapshot": true}'
    assert not encode(OPS["create"], (), {"spec": _spec()}).streamed
    assert encode(OPS["create"], (), {"spec": _spec(), "progress": print}).params == [
        ("progress", "true")]
    with pytest.raises(TypeError):
        encode(OPS["stat"], ("sb-0",), {"nope": 1})


def _spec() -> object:
    from runtime.spec import SandboxSpec
    return SandboxSpec(image=IMAGE)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    if runtime_missing() is not None or os.geteuid() != 0:
        pytest.skip(str(runtime_missing() or "needs root"))
    with running_agent(tmp_path_factory.mktemp("api-agent")) as a:
        yield a


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_stat_through_the_agent(agent: Agent, via: str) -> None:
    """sb.files.stat, which only the declaration and the Node define:
    a file, a directory, a symlink the sandbox planted to a host secret
    (described, not followed), a missing path and the runtime's /proc are
    one FileError each."""
    node, token = (agent.unix, None) if via == "unix" else (agent.http, agent.token)
    with Sandbox.create(IMAGE, node=node, token=token) as sb:
        sb.exec("mkdir -p /w/d && printf 12345 > /w/f && chmod 0750 /w/f "
                "&& ln -s /etc/shadow /w/l")
        f = sb.files.stat("/w/f")
        assert (f.type, f.size, f.mode, f.name, f.path) == ("file", 5, 0o750, "f", "/w/f")
        assert sb.files.stat("/w/d").type == "dir"
        link = sb.files.stat("/w/l")
        assert link.type == "symlink" and link.size == len("/etc/shadow")
        listed = {i.name: i for i in sb.files.list("/w")}
        assert listed["f"] == f and listed["l"] == link  # the same as list() describes
        assert sb.files.stat("/").type == "dir"
        with pytest.raises(FileError, match="/w/nope"):
            sb.files.stat("/w/nope")
        with pytest.raises(FileError, match="runtime"):
            sb.files.stat("/proc/1")


def test_every_operation_is_a_route_of_the_agent(agent: Agent) -> None:
    r = httpx.get(f"{agent.http}/openapi.json",
                  headers={"authorization": f"Bearer {agent.token}"})
    paths = r.json()["paths"]
    for o in OPS.values():
        assert o.method.lower() in paths.get(o.path, {}), f"{o.name}: {o.method} {o.path}"


@pytest.mark.root
@pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))
def test_stat_on_an_embedded_node(tmp_path: Path) -> None:
    with busybox_node(tmp_path) as node:
        sb = Sandbox.create(IMAGE, node=node)
        try:
            sb.files.write("/a/b.txt", b"hi", mode=0o600)
            st = sb.files.stat("/a/b.txt")
            assert (st.type, st.size, st.mode) == ("file", 2, 0o600)
        finally:
            sb.kill()


def _background(sb: Sandbox) -> None:
    started = sb.start("sleep 1; echo done")
    assert started.id.startswith("ex-") and started.sandbox_id == sb.id
    with pytest.raises(SandboxStateError, match="still runs"):
        sb.wait(started, timeout=0.1)
    r = sb.wait(started)
    assert (r.exit_code, r.stdout) == (0, b"done\n")
    assert sb.wait(started.id).stdout == b"done\n"  # (kept: asked again, the same)
    assert sb.wait(sb.start(["/bin/sh", "-c", "exit 3"])).exit_code == 3
    with pytest.raises(ExecTimeout) as e:
        sb.wait(sb.start("echo partial; sleep 30", timeout=0.5))
    assert e.value.result is not None and e.value.result.stdout == b"partial\n"
    with pytest.raises(SandboxNotFound, match="ex-0000000000000000"):
        sb.wait("ex-0000000000000000")
    running = sb.start("sleep 30")
    sb.kill()
    with pytest.raises(SandboxNotFound):
        sb.wait(running)


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_a_command_started_in_the_background_is_waited_for(agent: Agent, via: str) -> None:
    """sb.start() returns at once; sb.wait() gives the result, exec's typed
    errors (a timeout with what it printed), or says it still runs; the
    operation exists only in the declaration and the Node."""
    node, token = (agent.unix, None) if via == "unix" else (agent.http, agent.token)
    _background(Sandbox.create(IMAGE, node=node, token=token))


def test_background_commands_from_asyncio(agent: Agent) -> None:
    """Five 0.5 s commands started from asyncio run at once: all their
    results in well under the 2.5 s they would take one after another."""
    async def main() -> tuple[list[bytes], float]:
        sb = await AsyncSandbox.create(IMAGE, node=agent.unix)
        try:
            t0 = time.monotonic()
            started = [await sb.start(f"sleep 0.5; echo {i}") for i in range(5)]
            outs = [(await sb.wait(s)).stdout for s in started]
            return outs, time.monotonic() - t0
        finally:
            await sb.kill()

    outs, took = asyncio.run(main())
    assert outs == [f"{i}\n".encode() for i in range(5)]
    assert took < 2.0, took


@pytest.mark.root
@pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))
def test_background_commands_on_an_embedded_node(tmp_path: Path) -> None:
    with busybox_node(tmp_path) as node:
        _background(Sandbox.create(IMAGE, node=node))
