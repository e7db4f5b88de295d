"""The node agent as users run it (`lazyfs agent`, a separate process) and the
SDK talking to it over its Unix socket and over TCP with a token: the same
calls and typed errors as the embedded runtime, streaming output, the OpenAPI
schema, and what happens when the agent dies mid-exec and comes back."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime import (
    AsyncSandbox,
    BackendUnavailable,
    ExecTimeout,
    ImageNotFound,
    InvalidSpec,
    NetworkPolicy,
    Sandbox,
    SandboxNotFound,
    Unsupported,
)
from runtime.isolation import landlock_audit
from tests.helpers.agents import REPO, Agent, running_agent
from tests.helpers.sandboxes import IMAGE, runtime_missing
from tests.helpers.support import (
    gone,
    processes_with,
    wait_until,
)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    with running_agent(tmp_path_factory.mktemp("agent")) as a:
        yield a


def test_set_network_over_http(agent: Agent) -> None:
    """The task-phase network change through the agent: the policy and the
    node-side address come back, and a bad backend is one typed error."""
    with Sandbox.create(IMAGE, node=agent.unix) as sb:
        info = sb.set_network(NetworkPolicy.allow_only("node:9"))
        assert info.spec.network.mode == "allowlist" and info.host_address
        assert Sandbox.connect(sb.id, node=agent.unix).info.host_address == info.host_address
        r = sb.exec(f"busybox nc -w 2 {info.host_address} 9 </dev/null; echo rc=$?")
        assert r.stdout.endswith(b"rc=1\n")  # nothing listens there; refused by the host
        assert sb.set_network(NetworkPolicy.none()).spec.network.mode == "none"
    with Sandbox.create(IMAGE, backend="fncall", node=agent.unix) as fn, \
            pytest.raises(Unsupported, match="network"):
        fn.set_network(NetworkPolicy.none())


def test_read_ledger_over_http(agent: Agent) -> None:
    """sb.reads() through the agent: the sandbox root's own figures and,
    asked for, its trace; a backend without a root of its own says so."""
    with Sandbox.create(IMAGE, node=agent.unix) as sb:
        assert sb.exec("cat /etc/motd /data/big.bin | wc -c").exit_code == 0
        r = sb.reads(trace=True)
        assert r.files >= 3 and r.trace is not None, r  # busybox, motd, big.bin opened
        assert all(e.layer.startswith("blake3:") for e in r.trace)
        assert sb.reads().trace is None
    with Sandbox.create(IMAGE, backend="fncall", node=agent.unix) as fn, \
            pytest.raises(Unsupported, match="reads"):
        fn.reads()


def test_sdk_over_the_unix_socket(agent: Agent) -> None:
    with Sandbox.create(IMAGE, node=agent.unix, labels={"via": "unix"}) as sb:
        got: list[bytes] = []
        r = sb.exec("echo one; busybox sleep 0.2; echo two; echo err >&2; exit 5",
                    on_stdout=got.append)
        assert (r.exit_code, r.stdout, r.stderr) == (5, b"one\ntwo\n", b"err\n")
        assert got[0] == b"one\n"  # streamed before the command ended
        assert sb.exec(["cat"], stdin=bytes(range(256))).stdout == bytes(range(256))
        sb.files.write("/tmp/f.bin", b"\x00\x01\xff")
        assert sb.files.read("/tmp/f.bin") == b"\x00\x01\xff"
        assert [f.name for f in sb.files.list("/tmp")] == ["f.bin"]
        figures = sb.pause()
        assert "before" in figures and "after" in figures
        sb.resume()
        # in bulk: POST /v1/bulk/pause, /v1/bulk/resume
        assert Sandbox.pause_many({"via": "unix"}, node=agent.unix) == [sb.id]
        assert sb.refresh().state == "paused"
        assert Sandbox.resume_many({"via": "unix"}, node=agent.unix) == [sb.id]
        assert Sandbox.resume_many({"via": "unix"}, node=agent.unix) == []
        assert sb.refresh().state == "running"
        assert sb.info.host_address is None  # no network asked for
        assert [s.id for s in Sandbox.list({"via": "unix"}, node=agent.unix)] == [sb.id]
        assert Sandbox.connect(sb.id, node=agent.unix).exec("echo again").stdout == b"again\n"
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sb.id, node=agent.unix)


def test_typed_errors_cross_http(agent: Agent) -> None:
    with pytest.raises(ImageNotFound, match="nope:1"):
        Sandbox.create("nope:1", node=agent.unix)
    with pytest.raises(InvalidSpec, match="memory_mb"):
        Sandbox.create(IMAGE, node=agent.unix, memory_mb=1)
    with pytest.raises(InvalidSpec, match="backend"):
        Sandbox.create(IMAGE, backend="kvm", node=agent.unix)  # type: ignore[arg-type]
    with Sandbox.create(IMAGE, backend="fncall", node=agent.unix) as fn:
        with pytest.raises(Unsupported):
            fn.files.read("/etc/motd")
        with pytest.raises(ExecTimeout) as e:
            fn.exec("echo partial; busybox sleep 10", timeout=0.5)
        assert e.value.result is not None and e.value.result.stdout == b"partial\n"


def test_tcp_needs_the_token(agent: Agent) -> None:
    with pytest.raises(BackendUnavailable, match="token"):
        Sandbox.list(node=agent.http)
    os.environ["LAZYFS_NODE_TOKEN"] = "wrong"
    try:
        with pytest.raises(BackendUnavailable, match="token"):
            Sandbox.list(node=agent.http)
        os.environ["LAZYFS_NODE_TOKEN"] = agent.token
        with Sandbox.create(IMAGE, node=agent.http) as sb:
            assert sb.exec("cat /etc/motd").stdout == b"hello from the image\n"
    finally:
        del os.environ["LAZYFS_NODE_TOKEN"]
    # or as an argument (it wins over the environment)
    with pytest.raises(BackendUnavailable, match="token"):
        Sandbox.list(node=agent.http, token="wrong")
    with Sandbox.create(IMAGE, node=agent.http, token=agent.token) as sb:
        assert Sandbox.connect(sb.id, node=agent.http, token=agent.token).exec(
            "echo via-arg").stdout == b"via-arg\n"
    assert (agent.sock.stat().st_mode & 0o777) == 0o600


def test_openapi_schema_is_published(agent: Agent) -> None:
    r = httpx.get(f"{agent.http}/openapi.json",
                  headers={"authorization": f"Bearer {agent.token}"})
    paths = r.json()["paths"]
    assert "/v1/sandboxes" in paths and "/v1/sandboxes/{sandbox_id}/exec" in paths
    assert "SandboxSpec" in r.json()["components"]["schemas"]


def test_async_sdk_over_http(agent: Agent) -> None:
    async def main() -> list[bytes]:
        boxes = await asyncio.gather(*[AsyncSandbox.create(IMAGE, node=agent.unix)
                                       for _ in range(3)])
        try:
            rs = await asyncio.gather(*[b.exec(f"echo {i}") for i, b in enumerate(boxes)])
            return [r.stdout for r in rs]
        finally:
            await asyncio.gather(*[b.kill() for b in boxes])

    assert asyncio.run(main()) == [b"0\n", b"1\n", b"2\n"]


def test_async_sdk_keeps_a_thousand_execs_in_flight_without_threads(agent: Agent) -> None:
    """One asyncio task group of 1,000 exec calls over 3 sandboxes: all
    succeed, and the client never starts a thread (AsyncHttp's pool, not a
    thread per call); output streams to on_stdout while the command runs."""
    async def main() -> tuple[list[int], int, int, list[float], float]:
        boxes = [await AsyncSandbox.create(IMAGE, node=agent.unix) for _ in range(3)]
        try:
            await boxes[0].exec("true")
            before = threading.active_count()
            peak = before
            running = True

            async def sample() -> None:
                nonlocal peak
                while running:
                    peak = max(peak, threading.active_count())
                    await asyncio.sleep(0.005)

            sampler = asyncio.create_task(sample())
            rs = await asyncio.gather(*[boxes[i % 3].exec(["/bin/sh", "-c", f"exit {i % 7}"])
                                        for i in range(1000)])
            running = False
            await sampler
            seen: list[float] = []
            t0 = time.monotonic()
            await boxes[1].exec("for i in 1 2 3; do echo $i; sleep 0.4; done",
                                on_stdout=lambda b: seen.append(time.monotonic() - t0))
            total = time.monotonic() - t0
            return [r.exit_code for r in rs], before, peak, seen, total
        finally:
            await asyncio.gather(*[b.kill() for b in boxes])

    codes, before, peak, seen, total = asyncio.run(main())
    assert codes == [i % 7 for i in range(1000)]
    assert peak == before, f"the client started threads: {before} -> {peak}"
    assert len(seen) == 3 and seen[0] < total - 0.6  # the first line came while it ran


def test_the_client_connections_setting_caps_the_commands_running_at_once(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """With client.connections 2, six 0.5 s commands of one process run two
    at a time (three waves: at least 1.5 s), none failing; a value below 1
    is one clear error."""
    monkeypatch.setenv("LAZYFS_CLIENT_CONNECTIONS", "2")

    async def main() -> tuple[list[bytes], float]:
        sb = await AsyncSandbox.create(IMAGE, node=agent.unix)
        try:
            t0 = time.monotonic()
            rs = await asyncio.gather(*[sb.exec(f"sleep 0.5; echo {i}") for i in range(6)])
            return [r.stdout for r in rs], time.monotonic() - t0
        finally:
            await sb.kill()

    outs, took = asyncio.run(main())
    assert outs == [f"{i}\n".encode() for i in range(6)]
    assert took >= 1.5, took
    monkeypatch.setenv("LAZYFS_CLIENT_CONNECTIONS", "0")
    with pytest.raises(InvalidSpec, match="client.connections 0"):
        asyncio.run(AsyncSandbox.list(node=agent.unix))


def test_an_overloaded_agent_answers_a_typed_error_the_sdk_retries(tmp_path: Path) -> None:
    """An agent taking 2 calls at once: a third gets 503 Overloaded at once
    (not a dropped connection); the SDK sends such calls again, so 20 at
    once all succeed, and the agent counts the refusals."""
    with running_agent(tmp_path, extra=["--max-in-flight", "2"]) as a:
        async def main() -> tuple[httpx.Response, list[bytes]]:
            sb = await AsyncSandbox.create(IMAGE, node=a.unix)
            try:
                hold = [asyncio.create_task(sb.exec("sleep 2")) for _ in range(2)]
                await asyncio.sleep(1.0)
                async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(
                        uds=str(a.sock))) as raw:
                    refused = await raw.get("http://agent/v1/sandboxes")
                await asyncio.gather(*hold)
                rs = await asyncio.gather(*[sb.exec(f"sleep 0.2; echo {i}") for i in range(20)])
                return refused, [r.stdout for r in rs]
            finally:
                await sb.kill()

        refused, outs = asyncio.run(main())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "Overloaded"
        assert outs == [f"{i}\n".encode() for i in range(20)]
        metrics = httpx.get(f"{a.http}/metrics",
                            headers={"authorization": f"Bearer {a.token}"}).text
        overloaded = re.search(r"^lazyfs_agent_overloaded_total (\S+)$", metrics, re.MULTILINE)
        assert overloaded and float(overloaded.group(1)) >= 1


def test_agent_killed_mid_exec_then_restarted(agent: Agent) -> None:
    sb = Sandbox.create(IMAGE, node=agent.unix)
    sb.exec("echo kept > /tmp/state")
    tag = str(time.time_ns() % 10**9)
    errors: list[BaseException] = []

    def long_exec() -> None:
        try:
            sb.exec(f"busybox sleep 4{tag}", timeout=60)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    import threading
    t = threading.Thread(target=long_exec)
    t.start()
    wait_until(lambda: processes_with(tag), 20, "the long call runs in the sandbox")
    agent.kill()
    t.join(10)
    assert not t.is_alive()
    assert errors and isinstance(errors[0], BackendUnavailable)
    assert gone(tag)
    agent.start()
    again = Sandbox.connect(sb.id, node=agent.unix)  # the new agent found it
    assert again.exec("cat /tmp/state").stdout == b"kept\n"
    again.kill()


def test_snapshot_fork_and_verify_over_http(agent: Agent) -> None:
    with Sandbox.create(IMAGE, node=agent.unix, hidden=["/data"]) as sb:
        sb.exec("echo over-http > /root/f; mkdir -p /data; echo forged > /data/big.bin")
        snap = sb.snapshot()
        assert snap.sandbox_id == sb.id and snap.bytes_new > 0
        with Sandbox.create(snap, node=agent.unix) as child:
            assert child.exec("cat /root/f").stdout == b"over-http\n"
        kids = sb.fork(2)
        assert len({k.exec("hostname").stdout for k in kids}) == 2
        for k in kids:
            k.kill()
        r = sb.verify("cat /root/f; wc -c < /data/big.bin; exit 4", keep=["/root"])
        assert (r.exit_code, r.stdout) == (4, b"over-http\n3145728\n")


def _denials(agent: Agent) -> dict[str, float]:
    """lazyfs_sandbox_denials_total by kind, scraped as Prometheus would."""
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(agent.sock))) as c:
        r = c.get("http://agent/metrics")
    assert r.status_code == 200
    return {s.labels["kind"]: s.value for fam in text_string_to_metric_families(r.text)
            for s in fam.samples if s.name == "lazyfs_sandbox_denials_total"}


def test_denials_are_counted_in_the_node_metrics(agent: Agent) -> None:
    """A denied mount(2) is an event of the sandbox and a count of the node
    by kind, still counted once the sandbox is gone; a sandbox refused
    nothing adds nothing."""
    before = _denials(agent)
    with Sandbox.create(IMAGE, node=agent.unix) as quiet:
        assert quiet.exec("true").exit_code == 0
        assert _denials(agent) == before
        with Sandbox.create(IMAGE, node=agent.unix) as sb:
            r = sb.exec("mount -t tmpfs x /mnt; unshare -n true; echo rc=$?")
            assert r.stdout == b"rc=1\n"
            assert {(e.kind, e.detail) for e in sb.events()} == {("syscall", "mount"),
                                                                  ("syscall", "unshare")}
            assert _denials(agent).get("syscall", 0) == before.get("syscall", 0) + 2
    after = _denials(agent)
    assert after.get("syscall", 0) == before.get("syscall", 0) + 2  # killed, still counted


def test_tampering_is_an_event_over_http_and_a_count_in_the_metrics(agent: Agent) -> None:
    """A command signalling the sandbox's init (outside the command's
    Landlock domain) is refused, and the refusal is a `tampering` event read
    over the agent's HTTP API and a count of the node's metric."""
    reason = landlock_audit.unreadable()
    if reason is not None:
        pytest.skip(reason)
    before = _denials(agent).get("tampering", 0)
    with Sandbox.create(IMAGE, node=agent.unix) as sb:
        assert sb.exec("kill -0 1; echo rc=$?").stdout == b"rc=1\n"
        wait_until(lambda: [(e.kind, e.detail) for e in sb.events()] ==
                   [("tampering", "scope.signal")], 5, "the event over HTTP")
        assert _denials(agent).get("tampering", 0) == before + 1


def test_an_agent_on_port_0_serves_where_it_says(tmp_path: Path) -> None:
    """`--listen HOST:0`: the kernel picks the port, bound before the agent
    serves (a fleet node registers it), and the agent prints where; a bad
    address is one line, exit code 2."""
    cli = [sys.executable, "-m", "tools.cli", "agent", "--state", str(tmp_path / "state"),
           "--node-root", str(tmp_path / "root"), "--socket", str(tmp_path / "agent.sock"),
           "--token-file", str(tmp_path / "token"), "--insecure"]
    plain = subprocess.run([*cli[:-1], "--listen", "127.0.0.1:0"], cwd=REPO,
                           capture_output=True, text=True, check=False)
    assert plain.returncode == 2 and "--insecure" in plain.stderr  # (never plain by default)
    bad = subprocess.run([*cli, "--listen", "127.0.0.1:http"], cwd=REPO, capture_output=True,
                         text=True, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "127.0.0.1:http" in bad.stderr and not (tmp_path / "agent.sock").exists()
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*cli, "--listen", "127.0.0.1:0"], cwd=REPO, stdout=out,
                                stderr=out, stdin=subprocess.DEVNULL)
    try:
        line = wait_until(lambda: re.search(r"serving unix://\S+ (http://127\.0\.0\.1:(\d+))",
                                            log.read_text()), 30, "the agent's serving line")
        assert line is not None
        url, port = line.group(1), int(line.group(2))
        assert port != 0
        token = (tmp_path / "token").read_text().strip()
        r = httpx.get(f"{url}/v1/health", headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json()["ok"] is True
        assert httpx.get(f"{url}/v1/health").status_code == 401
    finally:
        subprocess.run([*cli[:-3], "--stop"], cwd=REPO, check=False, capture_output=True)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-2000:]


def test_an_agent_killed_amid_creates_leaves_only_sandboxes_callers_know(
        tmp_path: Path) -> None:
    """kill -9 of an agent while creates are in flight (half of them
    streamed, with progress): after it restarts, every sandbox on the node
    is one whose caller got its id. One made but not yet answered (its
    caller got an error) is removed, init, groups and all, not kept running
    with nobody knowing of it."""
    from runtime.isolation import cgroups
    with running_agent(tmp_path) as agent:
        known: set[str] = set()
        errors: list[BaseException] = []
        lock = threading.Lock()
        enough = threading.Event()

        def creates(streamed: bool) -> None:
            while True:
                try:
                    sb = Sandbox.create(IMAGE, node=agent.unix, on_progress=(
                        (lambda step: None) if streamed else None))
                except BaseException as e:  # noqa: BLE001 - the test inspects it
                    with lock:
                        errors.append(e)
                    return
                with lock:
                    known.add(sb.id)
                    if len(known) >= 12:
                        enough.set()

        ts = [threading.Thread(target=creates, args=(i % 2 == 0,)) for i in range(16)]
        for t in ts:
            t.start()
        assert enough.wait(120)
        # stopped the moment a sandbox is recorded, before its answer can go
        # out most of the time (the window a kill -9 in the field falls in)
        states = agent.d / "state" / "sandboxes"
        seen = {f.parent.name for f in states.glob("*/sandbox.json")}
        assert agent.proc is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(not (d.name in seen) and (d / "sandbox.json").exists()
                   for d in states.iterdir()):
                break
        os.kill(agent.proc.pid, signal.SIGSTOP)
        agent.kill()
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts)
        assert errors and all(isinstance(e, BackendUnavailable) for e in errors), errors
        made = {d.name for d in (agent.d / "state" / "sandboxes").iterdir()}
        agent.start()
        after = {s.id for s in Sandbox.list(node=agent.unix)}
        left = {d.name for d in (agent.d / "state" / "sandboxes").iterdir()}
        try:
            assert after <= known, f"running, no caller knows of: {sorted(after - known)}"
            assert left == after
            for sid in made - after:  # nothing of them stays on the host
                assert not cgroups.pids(sid), sid
        finally:
            for sid in after:
                Sandbox.connect(sid, node=agent.unix).kill()
