"""Checkpoints of container sandboxes: real runc, real CRIU (the build
install.sh makes), real overlayfs uppers packed into a real chunk store.

What a user checks: a process checkpointed, killed and restored goes on from
where it was (its counter in memory and its open file's offset), the files
written before the checkpoint are there and nothing written after it is,
commands run in the restored sandbox, a second checkpoint stores little that
is new, a sandbox CRIU cannot save says why and runs on, and no process of
the sandbox can use the exec channel the checkpoint moved into its network
namespace."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from composer.snapshot import UNTRUSTED
from runtime import (
    AsyncSandbox,
    FileError,
    ImageNotFound,
    InvalidSpec,
    NetworkPolicy,
    NotCheckpointable,
    Sandbox,
    SandboxStateError,
    Unsupported,
)
from runtime.backends import criu
from runtime.backends.container import ContainerBackend
from runtime.config import RuntimeConfig
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, runtime_missing
from tests.helpers.support import Hello, wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing())),
              pytest.mark.skipif(criu.missing() is not None, reason=str(criu.missing()))]

# a shell counting in memory (i) and appending through a descriptor it
# opened once (fd 3: its offset is part of the process's state)
COUNTER = ("(i=0; exec 3>/root/log; while true; do i=$((i+1)); echo $i >&3; sleep 0.02; "
           "done) </dev/null >/dev/null 2>&1 &")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("ckpt")
    with node_for(busybox_store(d), d) as n:
        yield n


def counted(sb: Sandbox) -> list[int]:
    try:
        return [int(x) for x in sb.files.read("/root/log").split()]
    except FileError:  # (the counter has not opened it yet)
        return []


def test_a_process_goes_on_after_checkpoint_kill_restore(node: Node) -> None:
    sb = Sandbox.create(IMAGE, node=node)
    try:
        assert sb.exec(f"echo before > /root/before; {COUNTER}").exit_code == 0
        wait_until(lambda: len(counted(sb)) >= 5, timeout=10, what="the counter going on")
        ckpt = sb.checkpoint()
        assert ckpt.tag == f"checkpoints/{sb.id}:1" and ckpt.sandbox_id == sb.id
        assert ckpt.memory_bytes > 0 and ckpt.files.layer != ckpt.memory_layer
        with pytest.raises(InvalidSpec, match="is a checkpoint"):
            Sandbox.create(ckpt.id, node=node)  # (its one layer is CRIU's images)
        # the parent runs on: its counter goes past where the checkpoint was
        at = len(counted(sb))
        wait_until(lambda: len(counted(sb)) > at + 3, timeout=10, what="the counter going on")
        sb.exec("echo after > /root/after")
    finally:
        sb.kill()
    with Sandbox.restore(ckpt, node=node) as again:
        assert again.id != sb.id
        assert again.files.read("/root/before") == b"before\n"
        assert again.exec("test -e /root/after").exit_code == 1  # written after the checkpoint
        first = counted(again)
        wait_until(lambda: len(counted(again)) > len(first) + 5, timeout=10, what="the counter going on")
        got = counted(again)
        # one count, no restart from 1 and no gap or overwrite: the value in
        # memory and the file's offset both went on from the checkpoint
        assert got == list(range(1, len(got) + 1))
        r = again.exec("ls /root; hostname")
        assert r.exit_code == 0 and b"before" in r.stdout
        assert r.stdout.split()[-1].decode() == sb.id  # its UTS namespace came back too


def holder_kb(sb: Sandbox) -> int:
    """VmRSS of the sandbox's `tail` (KiB; 0 before it runs)."""
    out = sb.exec("for p in /proc/[0-9]*; do grep -qx 'Name:.tail' $p/status 2>/dev/null "
                  "&& grep VmRSS $p/status; done").stdout.split()
    return int(out[1]) if len(out) >= 2 else 0


def test_a_second_checkpoint_stores_little_new_and_restores(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        # and a process holding 4 MB that does not change
        sb.exec(f"((head -c 4000000 /dev/urandom; sleep 600) | tail -c 4000000) "
                f"</dev/null >/dev/null 2>&1 & {COUNTER}")
        wait_until(lambda: holder_kb(sb) >= 3900, timeout=30, what="4 MB resident")
        first = sb.checkpoint()
        wait_until(lambda: len(counted(sb)) >= 10, timeout=10, what="the counter going on")
        second = sb.checkpoint(tag="mine/ckpt:two")  # (its exec channel moved already)
        assert second.tag == "mine/ckpt:two"
    # the processes' memory is mostly the same pages: deduplicated
    assert first.memory_bytes > 4_000_000
    assert second.memory_bytes_new < second.memory_bytes / 4, second
    # the images are the sandbox's data: in the untrusted trust domain
    _, cat = node.captures._open()
    assert cat.load_layer(first.memory_layer).domain == UNTRUSTED
    assert cat.load_layer(first.files.layer).domain == UNTRUSTED
    with Sandbox.restore("mine/ckpt:two", node=node) as again:
        n = len(counted(again))
        assert n >= 10
        wait_until(lambda: len(counted(again)) > n + 3, timeout=10, what="the counter going on")
        got = counted(again)
        assert got == list(range(1, len(got) + 1))


def test_a_restored_sandbox_in_a_user_namespace_says_why_it_cannot_checkpoint_again(
        node: Node) -> None:
    assert node.config.user_namespaces  # (the default)
    with Sandbox.create(IMAGE, node=node) as sb:
        sb.exec(COUNTER)
        wait_until(lambda: len(counted(sb)) >= 3, timeout=10, what="the counter going on")
        ckpt = sb.checkpoint()
    with Sandbox.restore(ckpt, node=node) as again:
        with pytest.raises(NotCheckpointable, match="restored from a checkpoint and runs in a "
                                                    "user namespace"):
            again.checkpoint()
        # refused before anything was touched: it runs on, commands and all
        n = len(counted(again))
        wait_until(lambda: len(counted(again)) > n + 3, timeout=10, what="the counter going on")
        assert again.exec("echo still").stdout == b"still\n"


def test_checkpoint_restore_checkpoint_restore_without_user_namespaces(
        tmp_path: Path) -> None:
    """The same chain on a node without user namespaces: CRIU checks the
    namespaces as the host's root, and the state goes through both moves."""
    with node_for(busybox_store(tmp_path), tmp_path, user_namespaces=False) as n:
        with Sandbox.create(IMAGE, node=n) as sb:
            sb.exec(f"echo one > /root/one; {COUNTER}")
            wait_until(lambda: len(counted(sb)) >= 3, timeout=10, what="the counter going on")
            first = sb.checkpoint()
        with Sandbox.restore(first, node=n) as again:
            wait_until(lambda: len(counted(again)) > 5, timeout=10, what="the counter going on")
            again.exec("echo two > /root/two")
            before = len(counted(again))
            second = again.checkpoint()
        with Sandbox.restore(second, node=n) as third:
            assert third.files.read("/root/one") == b"one\n"
            assert third.files.read("/root/two") == b"two\n"
            n3 = len(counted(third))
            assert n3 >= before  # from the second checkpoint on, not the first
            wait_until(lambda: len(counted(third)) > n3 + 3, timeout=10,
                       what="the counter going on")
            got = counted(third)
            # one count through both moves: no restart from 1, no gap
            assert got == list(range(1, len(got) + 1))
            assert third.exec("hostname").stdout.strip().decode() == sb.id


def test_what_criu_cannot_save_is_named_and_the_sandbox_runs_on(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        # a POSIX message queue with a message in it (the sandbox's own
        # mqueue mount): CRIU refuses to dump one
        r = sb.exec("echo msg > /dev/mqueue/q && (exec 4</dev/mqueue/q; sleep 600) "
                    f"</dev/null >/dev/null 2>&1 & {COUNTER}")
        assert r.exit_code == 0, r.stderr
        wait_until(lambda: len(counted(sb)) >= 2, timeout=10, what="the counter going on")
        with pytest.raises(NotCheckpointable, match="mqueue"):
            sb.checkpoint()
        at = len(counted(sb))
        wait_until(lambda: len(counted(sb)) > at + 3, timeout=10, what="the counter going on")  # thawed
        assert sb.exec("echo alive").stdout == b"alive\n"


def test_restore_refuses_what_is_not_a_checkpoint(node: Node) -> None:
    with pytest.raises(InvalidSpec, match="not a checkpoint"):
        Sandbox.restore(IMAGE, node=node)
    with pytest.raises(ImageNotFound):
        Sandbox.restore("checkpoints/none:1", node=node)


def test_checkpoint_refuses_what_it_cannot_do(node: Node) -> None:
    assert Sandbox.capabilities("container", node=node)["checkpoint"]
    assert not Sandbox.capabilities("fncall", node=node)["checkpoint"]
    with Sandbox.create(IMAGE, backend="fncall", node=node) as fn, \
            pytest.raises(Unsupported, match="checkpoint"):
        fn.checkpoint()
    with Sandbox.create(IMAGE, node=node) as sb:
        sb.pause()
        with pytest.raises(SandboxStateError, match="not running"):
            sb.checkpoint()
        sb.resume()
        # a command in flight (its pipes and connection lead to the node)
        running = threading.Thread(target=sb.exec, args=("sleep 2",))
        running.start()
        try:
            wait_until(lambda: node._busy.get(sb.id), timeout=10, what="the command running")
            with pytest.raises(SandboxStateError, match="a command is running"):
                sb.checkpoint()
        finally:
            running.join()
        assert sb.checkpoint().sandbox_id == sb.id  # between commands it works
        with pytest.raises(InvalidSpec, match="tag"):
            sb.checkpoint(tag="Bad Name!")
        _, cat = node.captures._open()  # nothing of the refused one was committed
        assert sorted(t for t, _ in cat.list_tags() if sb.id in t) == [
            f"checkpoints/{sb.id}/files:1", f"checkpoints/{sb.id}:1"]


@pytest.mark.skipif(shutil.which("nsenter") is None, reason="needs nsenter (util-linux)")
def test_sandbox_processes_cannot_use_the_moved_exec_channel(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        sb.checkpoint()
        backend = node.backend("container")
        assert isinstance(backend, ContainerBackend)
        h = node._get(sb.id)[1]
        name, init = h.state.channel_name, h.state.init_pid
        assert name is not None and init is not None
        # a process in the sandbox's PID and network namespaces (as any of
        # its processes is) connecting to the abstract name: init closes the
        # connection without reading a request
        probe = ("import socket\ns=socket.socket(socket.AF_UNIX)\n"
                 f"s.connect(b'\\0{name}')\ns.settimeout(5)\n"
                 "try:\n    s.sendall(b'x'*24)\n    print(repr(s.recv(64)))\n"
                 "except (BrokenPipeError, ConnectionResetError):\n    print('closed')")
        t0 = time.monotonic()
        p = subprocess.run(["nsenter", "-t", str(init), "-n", "-p", "--", sys.executable,
                            "-c", probe], capture_output=True, text=True, timeout=30, check=False)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() in ("b''", "closed") and time.monotonic() - t0 < 5
        # the node's own connections are served
        assert sb.exec("echo served").stdout == b"served\n"


def test_an_allowlisted_sandbox_restores_into_a_network_of_its_own(node: Node) -> None:
    srv = ThreadingHTTPServer(("0.0.0.0", 0), Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        policy = NetworkPolicy.allow_only(f"node:{port}")
        with Sandbox.create(IMAGE, node=node, network=policy) as sb:
            old = sb.info.host_address
            sb.exec(COUNTER)
            wait_until(lambda: len(counted(sb)) >= 3, timeout=10, what="the counter going on")
            ckpt = sb.checkpoint()
        with Sandbox.restore(ckpt, node=node) as again:
            new = again.info.host_address
            assert new is not None and old is not None and new != old  # a slot of its own
            r = again.exec(f"busybox wget -O - http://{new}:{port}/")
            assert r.stdout == b"mirror says hi", r
            assert again.exec(f"busybox wget -O - http://{old}:{port}/").exit_code != 0
            n = len(counted(again))
            wait_until(lambda: len(counted(again)) > n + 3, timeout=10,
                       what="the counter going on")
    finally:
        srv.shutdown()
        srv.server_close()


def test_async_checkpoint_and_restore(node: Node) -> None:
    async def rollout() -> bytes:
        async with await AsyncSandbox.create(IMAGE, node=node) as s:
            await s.exec("echo async > /root/a")
            ckpt = await s.checkpoint()
        async with await AsyncSandbox.restore(ckpt, node=node) as again:
            r = await again.exec("cat /root/a")
            return r.stdout

    assert asyncio.run(rollout()) == b"async\n"


def test_a_restarted_node_keeps_serving_a_checkpointed_sandbox(node: Node,
                                                               tmp_path: Path) -> None:
    """The moved exec channel is part of the sandbox's recorded state: a node
    started again finds it, and restores from the checkpoint."""
    config = RuntimeConfig(store=node.config.store, cluster=None, state_dir=tmp_path / "state",
                           node_root=node.config.node_root)
    old = Node(config)
    try:
        sb = Sandbox.create(IMAGE, node=old)
        sb.exec("echo again > /root/a")
        ckpt = sb.checkpoint()
    except BaseException:
        old.kill_many(None)
        raise
    finally:
        old.close()  # the sandbox stays
    restarted = Node(config)
    try:
        again = Sandbox.connect(sb.id, node=restarted)
        assert again.exec("cat /root/a").stdout == b"again\n"
        assert again.checkpoint().sandbox_id == sb.id  # and checkpoints again through it
        with Sandbox.restore(ckpt, node=restarted) as restored:
            assert restored.exec("cat /root/a").stdout == b"again\n"
    finally:
        restarted.kill_many(None)
        restarted.close()
