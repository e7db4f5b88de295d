"""Full-VM sandboxes end to end through the SDK: real QEMU (TCG on these
machines), Debian's cloud kernel, the "vm" initramfs, the image's layers as
lazy virtio-pmem EROFS lowers under an overlayfs whose upper is the
sandbox's own ext4 disk, the same guest agent as the microVMs.

VM boots: one shared VM of the busybox image (no init of its own: the agent
is PID 1), a second VM of the same image (isolation, kill), one of an image
whose own init takes PID 1, one with a small disk_mb, and one of a fresh
image on a fresh node (what it fetches, next to a container's)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.convert import convert
from lazyfs.node import request, store_catalog
from runtime import ExecTimeout, FileError, OutOfMemory, OutputTruncated, Sandbox, Unsupported
from runtime.backends.vm import VmBackend
from runtime.node import Node
from runtime.spec import Backend
from tests.helpers.images import build_busybox_rootfs
from tests.helpers.sandboxes import IMAGE, node_for, vm_missing
from tests.helpers.support import processes_with

INIT_IMAGE = "bbinit:1"
LAZY_IMAGE = "bblazy:1"  # busybox + 24 MiB nobody reads
LAZY_CMD = "cat /etc/motd && ls /data"
INITTAB = b"::sysinit:/bin/sh -c 'echo ran-by-the-image-init > /var/init-ran'\n"


MISSING = vm_missing(("mkfs.ext4", "e2fsprogs"))
pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """IMAGE (busybox, no init) and INIT_IMAGE (busybox whose init runs an inittab)."""
    d = tmp_path_factory.mktemp("fullvm")
    plain = build_busybox_rootfs(d / "rootfs")
    (plain / "etc" / "motd").write_text("hello from the image\n")
    (plain / "data").mkdir()
    (plain / "data" / "big.bin").write_bytes(os.urandom(3 << 20))
    with_init = build_busybox_rootfs(d / "rootfs-init")
    os.symlink("../bin/busybox", with_init / "sbin" / "init")
    (with_init / "etc" / "inittab").write_bytes(INITTAB)
    store = d / "store"
    with ChunkStore.open(store, create=True) as s, store_catalog(s) as cat:
        convert(s, cat, f"dir:{plain}", IMAGE)
        convert(s, cat, f"dir:{with_init}", INIT_IMAGE)
    return store, d


@pytest.fixture(scope="module")
def node(store_dir: tuple[Path, Path]) -> Iterator[Node]:
    store, d = store_dir
    with node_for(store, d) as n:
        _backend(n).pmem_cache = d / "pmem"  # this run's images are new: keep them with it
        yield n


@pytest.fixture(scope="module")
def sb(node: Node) -> Iterator[Sandbox]:
    with Sandbox.create(IMAGE, backend="vm", node=node, memory_mb=256, cpu=1) as s:
        yield s


def _backend(node: Node) -> VmBackend:
    b = node.backend("vm")
    assert isinstance(b, VmBackend)
    return b


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def test_boots_from_lazy_layers_with_the_agent_as_pid1(sb: Sandbox, node: Node) -> None:
    caps = Sandbox.capabilities("vm", node=node)  # (without node=: the host's default node)
    assert "exec" in caps and "files" in caps
    h = node._get(sb.id)[1]
    assert h.state.init is None and (h.state.boot_s or 0) > 0
    assert h.state.disk.is_file() and h.state.disk_mb == node.config.disk_mb
    # the lowers are the microVMs' pmem files: the daemon's blobs, local metadata
    cfg = _backend(node)._vm(h).config
    blobs = node.images.ensure_daemon().blobs
    assert [p.parent for p in cfg.pmem[1:-2:2]] == [blobs] * (len(cfg.pmem) // 2 - 1)
    assert sb.exec("hostname").stdout.strip() == sb.id.encode()
    mounts = sb.exec("cat /proc/mounts").stdout.decode()
    root = [line.split() for line in mounts.splitlines() if line.split()[1] == "/"]
    assert root and root[-1][0] == "overlay" and root[-1][2] == "overlay", mounts
    options = root[-1][3].split(",")
    assert "rw" in options and "upperdir=/rw/upper" in options, options
    assert any(o.startswith("lowerdir=/layers/") for o in options), options
    assert sb.exec("cat /proc/1/comm").stdout == b"lazyfs-agent\n"


def test_exec_and_image_content(sb: Sandbox, store_dir: tuple[Path, Path]) -> None:
    r = sb.exec("cat /etc/motd; echo oops >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"hello from the image\n", b"oops\n")
    assert sb.exec(["cat"], stdin=b"\x00\xffbinary").stdout == b"\x00\xffbinary"
    assert sb.exec("echo $GREETING; pwd", env={"GREETING": "hi"}, cwd="/etc").stdout == \
        b"hi\n/etc\n"
    want = hashlib.sha256((store_dir[1] / "rootfs" / "data" / "big.bin").read_bytes())
    assert sb.exec("sha256sum /data/big.bin").stdout.split()[0].decode() == want.hexdigest()


def test_files_round_trip(sb: Sandbox, tmp_path: Path) -> None:
    sb.files.write("/work/a/b.txt", b"patch")
    assert sb.exec("cat /work/a/b.txt").stdout == b"patch"
    info = sb.files.list("/work/a")[0]
    assert (info.name, info.type, info.size) == ("b.txt", "file", 5)
    local = tmp_path / "up.bin"
    local.write_bytes(os.urandom(200_000))
    sb.files.upload(local, "/work/up.bin")
    sb.files.download("/work/up.bin", tmp_path / "down.bin")
    assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
    sb.files.remove("/work/a", recursive=True)
    assert sb.exec("ls /work").stdout == b"up.bin\n"
    with pytest.raises(FileError, match="No such file"):
        sb.files.read("/nope")


def test_writes_land_in_the_upper_not_the_image(sb: Sandbox, node: Node) -> None:
    h = node._get(sb.id)[1]
    upper = h.state.disk
    metas = [p for p in _backend(node)._vm(h).config.pmem if p.parent == _backend(node).pmem_cache]
    before, upper_blocks = {p: _sha(p) for p in metas}, upper.stat().st_blocks
    assert sb.exec("echo mine > /etc/motd && rm /data/big.bin && "
                   "head -c 2000000 /dev/urandom > /root/new && sync").exit_code == 0
    assert sb.exec("cat /etc/motd").stdout == b"mine\n"
    assert sb.exec("ls /data").stdout == b""
    # written through to the sandbox's ext4 disk; the image's files are as they were
    assert upper.stat().st_blocks * 512 >= upper_blocks * 512 + 2_000_000
    assert metas and {p: _sha(p) for p in metas} == before
    assert all(p.stat().st_mode & 0o222 == 0 for p in metas)


def test_pause_and_resume_keep_the_disk_and_memory(sb: Sandbox, node: Node) -> None:
    sb.exec("echo in-memory > /dev/shm/x; echo on-disk > /root/y")
    figures = sb.pause()
    assert figures["snapshot_bytes"] > 0
    assert not processes_with(str(node.config.sandboxes / sb.id / "vm"))
    sb.resume()
    assert sb.exec("cat /dev/shm/x /root/y").stdout == b"in-memory\non-disk\n"


def _event_counts(sb: Sandbox) -> dict[tuple[str, str], int]:
    return {(str(e.kind), e.detail): e.count for e in sb.events()}


def test_bombs_are_held_typed_and_recorded_as_events(sb: Sandbox) -> None:
    """As in a microVM (the agent is PID 1 here, commands in the guest's
    limited cgroup): a fork bomb is held and its refused forks are an event,
    a memory bomb is typed OutOfMemory and its OOM kill is an event, and
    the VM answers on after each."""
    forks = ("process_limit", f"pids={sb.info.spec.pids}")
    ooms = ("oom_kill", "memory limit")
    before = _event_counts(sb)
    try:
        r = sb.exec("b() { b | b & }; b; sleep 3", timeout=20, max_output_bytes=1 << 16)
        held = b"can't fork" in r.stderr
    except (ExecTimeout, OutputTruncated) as bomb:
        held = bomb.result is not None and b"can't fork" in bomb.result.stderr
    assert held
    assert sb.exec("echo alive", timeout=60).stdout == b"alive\n"
    with pytest.raises(OutOfMemory) as oom:
        sb.exec("head -c 2000m /dev/zero | tail > /dev/null", timeout=120)
    assert oom.value.result is not None and oom.value.result.oom_killed
    assert sb.exec("echo alive").stdout == b"alive\n"
    got = _event_counts(sb)
    assert got.get(forks, 0) > before.get(forks, 0), got
    assert got.get(ooms, 0) > before.get(ooms, 0), got


def test_another_vm_sees_the_image_and_kill_leaves_nothing(sb: Sandbox, node: Node) -> None:
    sb.exec("echo only-in-the-first > /root/mark")
    s = Sandbox.create(IMAGE, backend="vm", node=node, memory_mb=256)
    vmdir = node.config.sandboxes / s.id / "vm"
    try:
        assert s.exec("cat /etc/motd").stdout == b"hello from the image\n"
        assert s.exec("cat /root/mark").exit_code != 0
        assert (vmdir / "upper.ext4").is_file() and processes_with(str(vmdir))
    finally:
        s.kill()
    assert not processes_with(str(vmdir))
    assert not (node.config.sandboxes / s.id).exists()  # upper, sockets, logs
    assert sb.exec("cat /root/mark").stdout == b"only-in-the-first\n"


def test_the_image_init_runs_as_pid1(node: Node) -> None:
    with Sandbox.create(INIT_IMAGE, backend="vm", node=node, memory_mb=256) as s:
        assert node._get(s.id)[1].state.init == "/sbin/init"
        assert s.exec("cat /proc/1/comm").stdout == b"init\n"
        deadline = time.monotonic() + 30  # the agent answers before init's sysinit is done
        while (r := s.exec("cat /var/init-ran")).stdout != b"ran-by-the-image-init\n" and \
                time.monotonic() < deadline:  # (created by the shell before echo writes)
            time.sleep(0.2)
        assert r.stdout == b"ran-by-the-image-init\n"
        assert s.exec("echo x > /tmp/y && cat /tmp/y").stdout == b"x\n"
        # next to an image's init the agent is not PID 1: a timeout must kill
        # the command, not the agent (found by review)
        with pytest.raises(ExecTimeout):
            s.exec("sleep 100", timeout=2)
        assert s.exec("echo agent-alive").stdout == b"agent-alive\n"
        # no commands' cgroup next to an image's init: no guest counts, no error
        assert [e for e in s.events() if e.kind in ("oom_kill", "process_limit")] == []


def test_disk_mb_is_the_size_of_the_writable_root(node: Node) -> None:
    with Sandbox.create(IMAGE, backend="vm", node=node, memory_mb=256, disk_mb=32) as s:
        upper = node._get(s.id)[1].state.disk
        assert upper.stat().st_size == 32 << 20
        assert upper.stat().st_blocks * 512 < 4 << 20  # sparse: the host pays for writes
        total_kb = int(s.exec("df -k / | tail -n 1").stdout.split()[1])
        assert 24 << 10 < total_kb <= 32 << 10
        r = s.exec("dd if=/dev/zero of=/root/fill bs=1M count=64", timeout=300)
        assert r.exit_code != 0 and b"No space left on device" in r.stderr, r
        assert s.exec("rm /root/fill && echo ok > /root/after && cat /root/after").stdout == \
            b"ok\n"
    with pytest.raises(Unsupported, match="^disk_mb: 8 MiB is below the vm backend's minimum"):
        Sandbox.create(IMAGE, backend="vm", node=node, memory_mb=256, disk_mb=8)


def _fetched(node: Node) -> int:
    stats = request(node.images.ensure_daemon(), {"op": "stats"})["stats"]
    return int(stats["cache"]["fetched_bytes"])


def _first_run(store: Path, d: Path, backend: Backend) -> tuple[int, bytes, Path]:
    """LAZY_CMD in the first sandbox of LAZY_IMAGE on a fresh node (its cache
    has never seen the image): (bytes the node fetched, stdout, pmem cache)."""
    with node_for(store, d) as n:
        b = n.backend("vm")
        assert isinstance(b, VmBackend)
        b.pmem_cache = d / "pmem"
        before = _fetched(n)
        with Sandbox.create(LAZY_IMAGE, backend=backend, node=n, memory_mb=256) as s:
            r = s.exec(LAZY_CMD)
            assert r.exit_code == 0, r
            return _fetched(n) - before, r.stdout, b.pmem_cache


def test_a_first_vm_fetches_what_a_container_fetches(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No per-image copy before the first boot: the VM of an image its node
    never saw fetches only the chunks the guest touches (boot touches none
    of the image: init, agent and modules are in the initramfs), as a
    container of the image does. A store of its own: each node of it opens
    the store in this process, one at a time."""
    lazy = build_busybox_rootfs(tmp_path / "rootfs")
    (lazy / "etc" / "motd").write_text("hello from the lazy image\n")
    (lazy / "data").mkdir()
    for i in range(6):
        (lazy / "data" / f"unread-{i}.bin").write_bytes(os.urandom(4 << 20))
    store = tmp_path / "store"
    with ChunkStore.open(store, create=True) as st, store_catalog(st) as cat:
        convert(st, cat, f"dir:{lazy}", LAZY_IMAGE)
        _, image = cat.resolve(LAZY_IMAGE)
        size = sum(e.size for d in image.layers for e in cat.load_layer(d).entries)
    # short paths: the VM's sockets live under its node's state directory
    vm, out, pmem = _first_run(store, tmp_path_factory.mktemp("v"), "vm")
    ct, ct_out, _ = _first_run(store, tmp_path_factory.mktemp("c"), "container")
    assert out == ct_out == b"hello from the lazy image\n" + b"".join(
        b"unread-%d.bin\n" % i for i in range(6))
    print(f"fetched by a first {LAZY_CMD!r}: vm {vm} B, container {ct} B, image {size} B")
    assert 0 < vm < size * 0.2, (vm, size)
    assert vm <= 1.5 * ct, (vm, ct)
    # what the node keeps for the VM is metadata, not the image
    kept = sum(f.stat().st_blocks * 512 for f in pmem.iterdir() if f.is_file())
    assert kept < size * 0.05, (kept, size)
