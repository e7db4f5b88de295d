"""verify() of microVM sandboxes: the guest agent streams its tmpfs upper
(the UPPER call) with the guest's processes stopped; the host writes it into
a fresh directory (runtime/guest/upper.py), packs it as a full VM's disk is
packed, and boots a fresh microVM of the image, that layer and the image's
hidden paths.

End to end (real QEMU, TCG here; two boots: the agent VM and one
verifier): the agent cannot see the hidden answer; it plants a fake answer,
a symlink to a host secret, a setuid file, a name with a newline, a hard
link, a deleted image file (a whiteout), a directory made again (opaque) and
background processes; verify returns the verifier's exit code, shows the
real answer and the agent's files, reads no host file, runs none of the
agent's processes; the agent VM's processes go on after the capture. An
upper with more entries than the host takes is refused by the agent (the
VM stays usable) and leaves nothing on the host.

Hostile streams (no VM: a fake guest on a socket pair speaks the agent's
protocol to the host's real AgentConnection): `..`, absolute paths, NUL,
duplicates, a path through a symlink, too many entries, files past the
upper's size, data past a file's size, a device, a wrong request id: each
refused with one line, nothing left on the host, the connection broken.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.convert import convert
from composer.manifest import Kind
from composer.snapshot import UpperRules, pack_diff
from lazyfs.node import store_catalog
from runtime import Sandbox, SandboxError
from runtime.guest import protocol
from runtime.guest.protocol import AgentConnection, AgentError
from runtime.guest.upper import (
    DIR,
    ENTRY_HEAD,
    FIFO,
    FILE,
    LINK,
    OPAQUE,
    SYMLINK,
    WHITEOUT,
    UpperRefused,
    UpperTree,
)
from runtime.node import Node
from tests.helpers.images import build_busybox_rootfs
from tests.helpers.sandboxes import node_for, vm_missing

TASK = "mvtask:1"
ANSWER = b"the-hidden-answer-42\n"
MISSING = vm_missing()
vm = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


# -- hostile streams, against a fake guest -----------------------------------
def entry(path: bytes, kind: int = FILE, *, mode: int = 0o644, size: int = 0, flags: int = 0,
          target: bytes = b"", uid: int = 0, gid: int = 0) -> tuple[int, bytes]:
    return protocol.ENTRY, ENTRY_HEAD.pack(kind, mode, uid, gid, 10**18, size, flags,
                                           len(path)) + path + \
        struct.pack("<I", len(target)) + target


def data(b: bytes) -> tuple[int, bytes]:
    return protocol.FDATA, b


OK = (protocol.OK, b"")


def run_guest(frames: list[tuple[int, bytes]], dest: Path, *, max_bytes: int = 1 << 20,
              max_entries: int = 100, rid_offset: int = 0) -> None:
    """The host's UPPER call against a guest that answers with `frames`."""
    host, guest = socket.socketpair()
    conn = AgentConnection(host)

    def serve() -> None:
        head = guest.recv(8, socket.MSG_WAITALL)
        length, word = protocol.HEADER.unpack(head)
        req = guest.recv(length, socket.MSG_WAITALL)
        assert word & 0xFF == protocol.UPPER
        assert struct.unpack("<QI", req) == (max_bytes, max_entries)
        rid = (word >> 8) + rid_offset
        try:
            for kind, payload in frames:
                guest.sendall(protocol.HEADER.pack(len(payload), kind | rid << 8) + payload)
        except OSError:
            pass  # the host stopped reading: what a refusal does

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with UpperTree(dest, max_bytes=max_bytes, max_entries=max_entries) as tree:
            conn.upper(tree, lock_wait=1)
    finally:
        guest.close()
        t.join(5)
        conn.close()


@pytest.mark.root
def test_a_well_formed_stream_becomes_an_overlayfs_upper_pack_diff_packs(tmp_path: Path
                                                                         ) -> None:
    dest = tmp_path / "capture"
    frames = [entry(b"workspace", DIR, mode=0o755),
              entry(b"workspace/answer", size=3, uid=1000, gid=1000), data(b"42\n"),
              entry(b"workspace/suid", mode=0o4755, size=2), data(b"#!"),
              entry(b"workspace/same", LINK, target=b"workspace/answer"),
              entry(b"workspace/new\nline", size=0),
              entry(b"workspace/leak", SYMLINK, mode=0o777, target=b"/etc/shadow"),
              entry(b"workspace/sparse", size=1 << 17), data(bytes(1 << 16)),
              data(bytes(1 << 16)),
              entry(b"etc", DIR, mode=0o755), entry(b"etc/motd", WHITEOUT, mode=0),
              entry(b"task", DIR, mode=0o755, flags=OPAQUE),
              entry(b"task/fifo", FIFO, mode=0o600), OK]
    run_guest(frames, dest)
    w = dest / "workspace"
    assert (w / "answer").read_bytes() == b"42\n"
    assert (w / "answer").stat().st_uid == 1000
    assert stat.S_IMODE((w / "suid").stat().st_mode) == 0o4755  # kept, as a VM disk's
    assert (w / "same").stat().st_ino == (w / "answer").stat().st_ino
    assert os.readlink(w / "leak") == "/etc/shadow"
    assert (w / "sparse").stat().st_blocks == 0  # holes stay holes
    st = os.lstat(dest / "etc" / "motd")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert os.getxattr(dest / "task", "trusted.overlay.opaque") == b"y"
    assert os.stat(w).st_mtime_ns == 10**18
    with ChunkStore.open(tmp_path / "store", create=True) as s:
        m = pack_diff(s, dest, rules=UpperRules(devices=False, max_bytes=1 << 20))
    kinds = {e.path: e.kind for e in m.entries}
    assert kinds["etc/motd"] == Kind.WHITEOUT and kinds["workspace/leak"] == Kind.SYMLINK
    assert kinds["workspace/same"] == Kind.HARDLINK and kinds["task/fifo"] == Kind.FIFO
    assert next(e for e in m.entries if e.path == "task").opaque


HOSTILE: list[tuple[str, list[tuple[int, bytes]], str]] = [
    ("dotdot", [entry(b"../escape", size=0), OK], "'..'"),
    ("dotdot-inside", [entry(b"a", DIR), entry(b"a/../../x"), OK], "'..'"),
    ("absolute", [entry(b"/etc/passwd"), OK], "not a relative path"),
    ("nul", [entry(b"a\0b"), OK], "NUL"),
    ("empty-component", [entry(b"a", DIR), entry(b"a//b"), OK], "empty"),
    ("duplicate", [entry(b"a"), entry(b"a"), OK], "sent twice"),
    ("through-a-symlink", [entry(b"l", SYMLINK, target=b"/"), entry(b"l/etc"), OK],
     "parent is not a directory"),
    ("through-a-file", [entry(b"f"), entry(b"f/x"), OK], "parent is not a directory"),
    ("orphan", [entry(b"nodir/x"), OK], "parent is not a directory"),
    ("too-many", [entry(b"f%d" % i) for i in range(101)] + [OK], "more than 100 entries"),
    ("sparse-past-size", [entry(b"huge", size=(1 << 20) + 1), OK], "sparse"),
    ("more-data-than-size", [entry(b"f", size=1), data(b"ab"), OK], "more data"),
    ("data-outside-a-file", [data(b"ab"), OK], "outside a file"),
    ("short-file", [entry(b"f", size=4), data(b"ab"), entry(b"g"), OK], "bytes of file data"),
    ("unknown-kind", [entry(b"dev", 9), OK], "unknown kind"),
    ("mode-bits", [entry(b"dev", mode=stat.S_IFBLK | 0o600), OK], "out of range"),
    ("link-outside", [entry(b"l", LINK, target=b"../../etc/shadow"), OK], "not a file sent"),
    ("symlink-nul", [entry(b"l", SYMLINK, target=b"a\0b"), OK], "NUL"),
    ("long-name", [entry(b"x" * 256), OK], "over-long"),
    ("short-entry", [(protocol.ENTRY, b"\0" * 10), OK], "too short"),
    ("target-on-a-file", [entry(b"f", target=b"x"), OK], "with a target"),
    ("stray-frame", [(protocol.STDOUT, b"x"), OK], "unexpected frame"),
]


@pytest.mark.root
@pytest.mark.parametrize("name,frames,why", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_stream_is_refused_on_one_line_and_leaves_nothing(
        tmp_path: Path, name: str, frames: list[tuple[int, bytes]], why: str) -> None:
    dest = tmp_path / "capture"
    outside = tmp_path / "escape"
    with pytest.raises(UpperRefused) as e:
        run_guest(frames, dest)
    msg = str(e.value)
    assert why in msg and "\n" not in msg, msg
    assert not dest.exists() and not outside.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.root
def test_a_refused_stream_breaks_the_connection_a_guest_refusal_does_not(
        tmp_path: Path) -> None:
    host, guest = socket.socketpair()
    conn = AgentConnection(host)
    err = struct.pack("<i", 7) + b"upper workspace: the upper has more entries\n\x1b[2J"

    def serve(frames: list[tuple[int, bytes]]) -> None:
        head = guest.recv(8, socket.MSG_WAITALL)
        length, word = protocol.HEADER.unpack(head)
        guest.recv(length, socket.MSG_WAITALL)
        for kind, payload in frames:
            guest.sendall(protocol.HEADER.pack(len(payload), kind | (word >> 8) << 8) + payload)

    for frames, broken in (([(protocol.ERROR, err)], False),
                           ([entry(b"../x"), OK], True)):
        t = threading.Thread(target=serve, args=(frames,), daemon=True)
        t.start()
        with pytest.raises(UpperRefused) as e, \
                UpperTree(tmp_path / "c", max_bytes=1 << 20, max_entries=10) as tree:
            conn.upper(tree, lock_wait=1)
        t.join(5)
        assert "\n" not in str(e.value) and "\x1b" not in str(e.value), e.value
        assert (conn.broken is not None) == broken
        assert not (tmp_path / "c").exists()
    with pytest.raises(AgentError, match="unusable"):
        conn.ping()
    guest.close()
    conn.close()


@pytest.mark.root
def test_a_frame_for_another_request_breaks_the_channel(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match="out of step"):
        run_guest([entry(b"a"), OK], tmp_path / "capture", rid_offset=1)
    assert os.listdir(tmp_path) == []


# -- end to end ----------------------------------------------------------------
@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Path]]:
    d = tmp_path_factory.mktemp("mvverify")
    root = build_busybox_rootfs(d / "rootfs")
    (root / "task" / "answers").mkdir(parents=True)
    (root / "task" / "answers" / "expected").write_bytes(ANSWER)
    (root / "task" / "README").write_text("solve it\n")
    (root / "task" / "old").mkdir()
    (root / "task" / "old" / "stale").write_text("from the image\n")
    (root / "etc" / "motd").write_text("image motd\n")
    (root / "workspace").mkdir()
    store = d / "store"
    with ChunkStore.open(store, create=True) as s, store_catalog(s) as cat:
        convert(s, cat, f"dir:{root}", TASK)
    with node_for(store, d) as n:
        n.backend("microvm").pmem_cache = d / "pmem"  # type: ignore[attr-defined]
        yield n, d


def _captures(node: Node) -> list[Path]:
    return list(Path(node.config.sandboxes).glob("*/capture*"))


@pytest.mark.root
@pytest.mark.slow
@vm
def test_microvm_verify_sees_the_answer_and_nothing_of_the_agents(
        env: tuple[Node, Path]) -> None:
    node, d = env
    secret = d / "host-secret"
    secret.write_bytes(b"HOST-ONLY-SECRET\n")
    atime = secret.stat().st_atime_ns
    caps = Sandbox.capabilities("microvm", node=node)
    assert caps["verify"] and caps["hidden"]
    with Sandbox.create(TASK, backend="microvm", node=node, memory_mb=256, cpu=1,
                        hidden=["/task/answers"]) as sb:
        r = sb.exec("ls -a /task; cat /task/answers/expected; find / -xdev -name expected; "
                    "echo end")
        assert r.stdout == b".\n..\nREADME\nold\nend\n", r
        r = sb.exec(
            "echo 42 > /workspace/answer && mkdir -p /task/answers && "
            "echo fake > /task/answers/expected && "
            f"ln -s {secret} /workspace/leak && "
            "printf x > \"/workspace/new\nline\" && "
            "ln /workspace/answer /workspace/same && "
            "cp /bin/busybox /workspace/suid && chmod 4755 /workspace/suid && "
            "rm /etc/motd && rm -r /task/old && mkdir /task/old && echo new > /task/old/mine && "
            "(sleep 1000 </dev/null >/dev/null 2>&1 &) && echo planted")
        assert r.exit_code == 0 and r.stdout == b"planted\n", r
        r = sb.exec("(while :; do echo x >> /workspace/ticks; sleep 0.2; done "
                    "</dev/null >/dev/null 2>&1 &)")
        assert r.exit_code == 0, r
        assert sb.exec("while [ ! -s /workspace/ticks ]; do sleep 0.1; done",
                       timeout=30).exit_code == 0
        v = sb.verify(
            "cat /workspace/answer /task/answers/expected; ls /workspace | wc -l; "
            "ls -l /workspace/suid | cut -c1-10; cat /workspace/leak; "
            "ps | grep -c '[s]leep 1000'; ls /sys/class/net; "
            "ls /etc/motd; ls /task/old; stat -c %h /workspace/answer; "
            "[ \"$(cat \"$(printf '/workspace/new\\nline')\")\" = x ] && echo newline-ok; exit 3")
        assert v.exit_code == 3, v
        out = v.stdout.decode()
        assert out.startswith("42\n" + ANSWER.decode()), v  # the image's answer over the fake
        lines = out.splitlines()
        # answer, leak, new\nline (ls shows it as new?line), same, suid, ticks
        assert lines[2].strip() == "6", v
        assert lines[3] == "-rwsr-xr-x", v
        assert b"HOST-ONLY-SECRET" not in v.stdout + v.stderr
        assert "'/workspace/leak': No such file" in v.stderr.decode(), v
        assert lines[4:6] == ["0", "lo"], v  # none of the agent's processes, no network
        assert "/etc/motd: No such file" in v.stderr.decode(), v  # the whiteout
        # the opaque directory, the hard link, the name with a newline
        assert lines[6:] == ["mine", "2", "newline-ok"], v
        assert secret.stat().st_atime_ns == atime  # the host never read it
        # the agent VM runs on: its files, its processes (stopped, then continued)
        n = len(sb.files.read("/workspace/ticks"))
        r = sb.exec("sleep 1; cat /workspace/answer /task/answers/expected; "
                    "ps | grep -c '[s]leep 1000'")
        assert r.stdout == b"42\nfake\n1\n", r
        assert len(sb.files.read("/workspace/ticks")) > n
        assert not [s for s in node.list_sandboxes() if s.id != sb.id]  # the verifier is gone
        assert not _captures(node)

        # more entries than the host takes: the agent refuses, the VM goes on
        backend = node.backend("microvm")
        bounds = backend.upper_bounds  # type: ignore[attr-defined]
        backend.upper_bounds = lambda h: (bounds(h)[0], 20)  # type: ignore[attr-defined]
        try:
            assert sb.exec("mkdir /workspace/many && cd /workspace/many && "
                           "for i in $(seq 40); do : > f$i; done").exit_code == 0
            with pytest.raises(SandboxError) as e:
                sb.verify("true")
            assert "more entries than the host takes" in str(e.value), e.value
            assert "\n" not in str(e.value)
        finally:
            del backend.upper_bounds  # type: ignore[attr-defined]
        assert not _captures(node)
        assert sb.exec("echo alive").stdout == b"alive\n"

        # a sparse file past the upper's size: refused by the agent, before any boot
        assert sb.exec("dd if=/dev/zero of=/workspace/huge bs=1 count=1 seek=8G "
                       "2>/dev/null").exit_code == 0
        with pytest.raises(SandboxError, match="sparse"):
            sb.verify("true", keep=["/workspace"])
        assert not _captures(node)
        assert not [s for s in node.list_sandboxes() if s.id != sb.id]
        assert sb.exec("echo alive").stdout == b"alive\n"



@pytest.mark.root
@pytest.mark.slow
@vm
def test_microvm_verify_stops_the_guests_processes_while_its_upper_is_read(
        env: tuple[Node, Path]) -> None:
    """A background process truncating and refilling a 4 MiB file without
    pause: unstopped, the agent would read the file shorter than it said
    (the call fails) or the host would see other bytes than the file held
    at one instant; stopped, the verifier sees one state of it (zeros, of a
    size the writes reached) and the writer goes on after."""
    node, _ = env
    with Sandbox.create(TASK, backend="microvm", node=node, memory_mb=256, cpu=1) as sb:
        r = sb.exec("(while :; do dd if=/dev/zero of=/workspace/churn bs=64k count=64 "
                    "2>/dev/null; echo x >> /workspace/rounds; done </dev/null >/dev/null "
                    "2>&1 &); while [ ! -s /workspace/rounds ]; do sleep 0.1; done",
                    timeout=60)
        assert r.exit_code == 0, r
        for _ in range(2):
            v = sb.verify("s=$(stat -c %s /workspace/churn); [ $s -le 4194304 ] && "
                          "[ $(tr -d '\\0' < /workspace/churn | wc -c) = 0 ] && echo $s")
            assert v.exit_code == 0 and int(v.stdout) % 4096 == 0, v
        n = len(sb.files.read("/workspace/rounds"))
        assert sb.exec("sleep 2").exit_code == 0
        assert len(sb.files.read("/workspace/rounds")) > n  # it runs on
    assert not _captures(node)
