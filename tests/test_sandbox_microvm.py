"""microVM sandboxes end to end through the SDK: real QEMU (TCG on these
machines, KVM where it works), Debian's cloud kernel, the project's
initramfs and guest agent, the image's layers as virtio-pmem devices
mounted EROFS with DAX in the guest.

VM boots are few (each takes seconds under TCG): one VM shared by most
tests, and one each for kill, a hung guest, a panicking guest and an agent
that never comes up."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.convert import convert
from lazyfs.node import request, store_catalog
from runtime import (
    BackendUnavailable,
    ExecStatusUnknown,
    ExecTimeout,
    FileError,
    OutOfMemory,
    OutputTruncated,
    Sandbox,
    SandboxNotFound,
    SandboxStateError,
    Unsupported,
)
from runtime.backends.microvm import MicrovmBackend
from runtime.backends.qemubase import VMM_OVERHEAD_MB
from runtime.backends.qemuproc import vmm_pss
from runtime.guest.qemu import Qmp
from runtime.isolation import cgroups
from runtime.node import Node
from runtime.spec import Backend
from tests.helpers.images import build_busybox_rootfs
from tests.helpers.sandboxes import (
    IMAGE,
    SECOND,
    add_second_image,
    busybox_store,
    node_for,
    retag,
    vm_missing,
)
from tests.helpers.support import flip_byte, pack_path, processes_with, wait_until

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(vm_missing() is not None, reason=str(vm_missing()))]


FAULT_IMAGE = "bb:fault"  # busybox + FAULT_FILE, read only by the fetch-fault test
FAULT_FILE = "zz/fault.bin"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, tuple[Path, int]]:
    """The store, its directory, and where in a pack a chunk of FAULT_IMAGE's
    /data/fault.bin lies (found now: once the node runs, this process holds
    the store's catalog open)."""
    d = tmp_path_factory.mktemp("vm")
    store = busybox_store(d)
    add_second_image(store, d)
    root = build_busybox_rootfs(d / "rootfs-fault")
    (root / "zz").mkdir()
    # last in the blob, after a gap wider than the host's readahead around a
    # page fault (1 MiB): only reading the file itself fetches its chunks
    (root / "zz" / "a-gap.bin").write_bytes(os.urandom(4 << 20))
    (root / FAULT_FILE).write_bytes(os.urandom(1 << 20))
    with ChunkStore.open(store) as s, store_catalog(s) as cat:
        convert(s, cat, f"dir:{root}", FAULT_IMAGE)
        m = cat.load_layer(cat.resolve(FAULT_IMAGE)[1].layers[-1])
        cid = next(e for e in m.entries if e.path == FAULT_FILE).chunks[-1].id
        assert cid is not None
        info = s.stat(cid)
    return store, d, (pack_path(store, info.pack), info.offset + info.stored_len - 3)


@pytest.fixture(scope="module")
def node(store_dir: tuple[Path, Path, tuple[Path, int]]) -> Iterator[Node]:
    store, d, _ = store_dir
    with node_for(store, d) as n:
        # this run's layers are new (random data): keep their pmem files with the run
        _backend(n).pmem_cache = d / "pmem"
        yield n


@pytest.fixture(scope="module")
def sb(node: Node) -> Iterator[Sandbox]:
    with Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256, cpu=1) as s:
        yield s


def _backend(node: Node) -> MicrovmBackend:
    b = node.backend("microvm")
    assert isinstance(b, MicrovmBackend)
    return b


def _event_counts(sb: Sandbox) -> dict[tuple[str, str], int]:
    return {(str(e.kind), e.detail): e.count for e in sb.events()}


def _vm_dir(node: Node, sandbox_id: str) -> Path:
    return node.config.sandboxes / sandbox_id / "vm"


def test_capabilities_and_boot(sb: Sandbox, node: Node) -> None:
    caps = Sandbox.capabilities("microvm", node=node)  # (without node=: the host's default node)
    assert "exec" in caps and "files" in caps and "pause" in caps
    h = node._get(sb.id)[1]
    assert h.state.accel in ("tcg", "kvm") and (h.state.boot_s or 0) > 0
    assert sb.exec("hostname").stdout.strip() == sb.id.encode()


def test_exec_output_exit_code_stdin_env_cwd(sb: Sandbox) -> None:
    r = sb.exec("cat /etc/motd; echo oops >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"hello from the image\n", b"oops\n")
    assert r.duration > 0 and not r.truncated
    assert sb.exec(["cat"], stdin=b"\x00\xffbinary").stdout == b"\x00\xffbinary"
    big = os.urandom(300_000)  # several stdin frames
    assert sb.exec(["cat"], stdin=big).stdout == big
    assert sb.exec("echo $GREETING; pwd", env={"GREETING": "hi"}, cwd="/etc").stdout == \
        b"hi\n/etc\n"
    chunks: list[bytes] = []
    r = sb.exec("for i in 1 2 3; do echo $i; sleep 0.2; done", on_stdout=chunks.append)
    assert b"".join(chunks) == r.stdout == b"1\n2\n3\n" and len(chunks) >= 2
    r = sb.exec(["no-such-command", "x"])
    assert r.exit_code == 127 and b"no-such-command: command not found" in r.stderr


def test_layers_are_dax_erofs_on_pmem(sb: Sandbox, store_dir: tuple[Path, Path, tuple[Path, int]]
                                      ) -> None:
    # /proc/1 is the agent, outside the sandbox's root: its mounts show the layers
    mounts = sb.exec("cat /proc/1/mounts").stdout.decode()
    erofs = [line.split() for line in mounts.splitlines() if " erofs " in line]
    assert erofs and all(m[0].startswith("/dev/pmem") for m in erofs)
    assert all("dax=always" in m[3] and "ro" in m[3].split(",") for m in erofs)
    assert any(line.startswith("overlay /sandbox overlay") for line in mounts.splitlines())
    want = hashlib.sha256((store_dir[1] / "rootfs" / "data" / "big.bin").read_bytes()).hexdigest()
    assert sb.exec("sha256sum /data/big.bin").stdout.split()[0].decode() == want


def test_files_round_trip_and_stay_inside(sb: Sandbox, tmp_path: Path) -> None:
    sb.files.write("/work/a/b.txt", b"patch")
    assert sb.exec("cat /work/a/b.txt").stdout == b"patch"
    assert [e.name for e in sb.files.list("/work/a")] == ["b.txt"]
    info = sb.files.list("/work/a")[0]
    assert info.type == "file" and info.size == 5 and info.mode == 0o644
    sb.exec("ln -s /../../etc/motd /work/link; echo made-here > /work/made")
    assert sb.files.read("/work/made") == b"made-here\n"
    assert sb.files.read("/work/link") == b"hello from the image\n"  # resolved in the root
    local = tmp_path / "up.bin"
    local.write_bytes(os.urandom(200_000))
    sb.files.upload(local, "/work/up.bin")
    sb.files.download("/work/up.bin", tmp_path / "down.bin")
    assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
    sb.files.remove("/work", recursive=True)
    assert sb.exec("ls /work").exit_code != 0
    with pytest.raises(FileError, match="No such file"):
        sb.files.read("/nope")


def test_writes_land_in_the_upper(sb: Sandbox, node: Node) -> None:
    layers = node._get(sb.id)[1].state.layers
    cache = _backend(node).pmem_cache
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in cache.glob("*.pmem")}
    assert sb.exec("echo mine > /etc/motd && rm /data/big.bin").exit_code == 0
    assert sb.exec("cat /etc/motd").stdout == b"mine\n"
    # the agent's root (layers and upper below the command's root) is closed to
    # commands: the agent is non-dumpable and commands lack CAP_SYS_PTRACE
    r = sb.exec("cat /proc/1/root/layers/0/etc/motd")
    assert r.exit_code != 0 and b"Permission denied" in r.stderr, r
    assert sb.exec("echo x > /proc/1/root/layers/0/etc/motd").exit_code != 0
    assert len(layers) == 2  # the image's layer + the directory fixups layer
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in cache.glob("*.pmem")}
    assert before == after  # the shared image files never change


def test_timeout_kills_the_tree(sb: Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(ExecTimeout) as e:
        sb.exec("sleep 1000 & (setsid sleep 1001 &); sleep 1002", timeout=2)
    assert time.monotonic() - t0 < 15
    assert e.value.result is not None and e.value.result.timed_out
    ps = sb.exec("ps -o pid,args").stdout
    assert b"sleep 100" not in ps


def test_big_stdin_while_output_flows(sb: Sandbox) -> None:
    # the host must read output while it still sends stdin (found by review:
    # 1 MiB each way deadlocked the channel)
    n = 2 << 20
    r = sb.exec(f"head -c {n} /dev/zero; cat | wc -c", stdin=b"x" * n, timeout=120,
                max_output_bytes=4 << 20)
    assert r.exit_code == 0 and len(r.stdout) == n + len(f"{n}\n")
    assert r.stdout.endswith(f"{n}\n".encode())


def test_commands_get_default_sigpipe(sb: Sandbox) -> None:
    r = sb.exec("yes | head -c 1")  # yes dies of SIGPIPE quietly, as on any host
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"y", b"")


def test_pause_waits_for_no_running_call(node: Node, sb: Sandbox) -> None:
    import threading
    t = threading.Thread(target=lambda: sb.exec("sleep 4"))
    t.start()
    agent = _backend(node)._vm(node._get(sb.id)[1]).agent
    wait_until(agent.lock.locked, 10, "the call running in the guest")
    with pytest.raises(SandboxStateError, match="running a command"):
        sb.pause()
    t.join()
    assert sb.exec("echo still-running").stdout == b"still-running\n"


def test_output_cap(sb: Sandbox) -> None:
    with pytest.raises(OutputTruncated) as e:
        sb.exec("yes", max_output_bytes=100_000, timeout=60)
    assert e.value.result is not None and len(e.value.result.stdout) == 100_000
    assert sb.exec("echo still-here").stdout == b"still-here\n"


def test_pause_snapshots_and_resume_restores(sb: Sandbox, node: Node) -> None:
    sb.exec("echo kept-in-guest-memory > /tmp/state")
    h = node._get(sb.id)[1]
    pid, layers = h.state.pid, list(h.state.layers)
    first = node.images.resolve(IMAGE)
    assert sb.info.image_digest == first
    figures = sb.pause()
    assert figures["snapshot_bytes"] > 0 and figures["vmm_pss_before"] > 0
    assert not processes_with(str(_vm_dir(node, sb.id)))  # the VMM exited
    assert node.get(sb.id).state == "paused"
    retag(node.config.store, IMAGE, SECOND)  # resume maps the layers of the digest, not the tag
    try:
        sb.resume()
    finally:
        retag(node.config.store, IMAGE, first)
    assert node._get(sb.id)[1].state.layers == layers
    # (an earlier test wrote /etc/motd in the upper: a file only the image has)
    assert sb.exec("cat /etc/image-name").stdout == f"{IMAGE}\n".encode()
    assert node._get(sb.id)[1].state.pid != pid
    assert sb.exec("cat /tmp/state").stdout == b"kept-in-guest-memory\n"
    assert node._get(sb.id)[1].state.snapshot is None


def test_calls_right_after_resume_stay_in_step(sb: Sandbox) -> None:
    """A restored guest sees its port close and open again (QEMU tells it the
    saved connection state, then the new one), and its agent then greets
    with a READY frame, which may reach the host in the middle of the next
    call. Each call skips it: events (a COUNTS request), exec and a file call
    at once after each of three resumes all answer, in step."""
    for i in range(3):
        sb.pause()
        sb.resume()
        sb.events()  # first: the greeting may come in its reply
        assert sb.exec(f"echo {i}").stdout == f"{i}\n".encode()
        sb.files.write("/tmp/resumed", b"x")
        assert sb.files.read("/tmp/resumed") == b"x"
        sb.events()


def test_kill_leaves_nothing_and_writes_stayed_in_their_vm(node: Node) -> None:
    s = Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256)  # spec.MIN_GUEST_MB
    vmdir = _vm_dir(node, s.id)
    assert (vmdir / "agent.sock").exists() and processes_with(str(vmdir))
    # another VM's writes (test_writes_land_in_the_upper) are not here
    assert s.exec("cat /etc/motd").stdout == b"hello from the image\n"
    s.kill()
    assert not processes_with(str(vmdir))
    assert not (node.config.sandboxes / s.id).exists()


def test_hung_guest_is_a_typed_error_in_bounded_time(node: Node) -> None:
    backend = _backend(node)
    s = Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256)  # spec.MIN_GUEST_MB
    try:
        q = Qmp(_vm_dir(node, s.id) / "qmp.sock")
        q.execute("stop")  # every vCPU frozen: the agent never answers
        q.close()
        backend.agent_grace = 3.0
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match="did not answer"):
            s.exec("echo hi", timeout=1)
        assert time.monotonic() - t0 < 10
        with pytest.raises(BackendUnavailable, match="unusable"):
            s.files.read("/etc/motd")
    finally:
        backend.agent_grace = 30.0
        s.kill()
    assert not processes_with(str(_vm_dir(node, s.id)))


def test_vmm_killed_from_outside_is_reaped(node: Node) -> None:
    s = Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256)
    vmdir = _vm_dir(node, s.id)
    try:
        os.kill(node._get(s.id)[1].state.pid, signal.SIGKILL)
        wait_until(lambda: s.id in node.reaper.reap(), 10, "the reaper finding the dead VMM")
        with pytest.raises(SandboxNotFound):
            s.exec("true")
    finally:
        try:
            s.kill()
        except SandboxNotFound:
            pass
    assert not processes_with(str(vmdir)) and not vmdir.exists()


def test_guest_panic_is_a_typed_error(node: Node) -> None:
    s = Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256)  # spec.MIN_GUEST_MB
    try:
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match="VM exited"):
            s.exec("echo c > /proc/sysrq-trigger; sleep 100", timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        s.kill()


def test_a_failed_fetch_under_a_pmem_page_is_a_bounded_typed_error(
        node: Node, store_dir: tuple[Path, Path, tuple[Path, int]]) -> None:
    """The image's data reaches the guest lazily: the VM boots without
    reading /data/fault.bin; reading it is a page fault on the daemon's blob.
    Fault injection (not a fake: a store that fails a chunk's check): a
    flipped byte in the pack under one of its chunks, after the VM booted.
    The daemon answers the fault with EIO, QEMU gets SIGBUS (a DAX load has
    no way to return an error into the guest) and the call raises at once,
    naming it, instead of a vCPU hanging on the page."""
    pack, offset = store_dir[2]
    with Sandbox.create(FAULT_IMAGE, backend="microvm", node=node, memory_mb=256) as s:
        layer = node.images.resolve_image(FAULT_IMAGE).layers[-1]
        assert s.exec("busybox | head -c 7").stdout == b"BusyBox"
        trace = request(node.images.ensure_daemon(), {"op": "trace", "mount": None})["trace"]
        read = {e["path"] for e in trace["events"] if e.get("layer", layer) == layer}
        assert "bin/busybox" in read and FAULT_FILE not in read  # booted without its data
        # and without its neighbours': a fault fetched its own page's chunk, no
        # read-around (qemu-preload.c; with QEMU's MADV_HUGEPAGE, 4 MiB around)
        assert "zz/a-gap.bin" not in read
        flip_byte(pack, offset)
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match="SIGBUS: a page of its mapped image"):
            s.exec(f"cat /{FAULT_FILE} > /dev/null; echo read-it", timeout=60)
        assert time.monotonic() - t0 < 30
    assert not processes_with(str(_vm_dir(node, s.id)))


def _sandbox_cgroups() -> set[Path]:
    return set(cgroups.CGROUP_ROOT.glob(f"*/{cgroups.PARENT}/sb-*"))


def _vmm_threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_the_vmm_is_in_its_own_cgroup_and_throttled_to_cpu(node: Node) -> None:
    """QEMU runs in the sandbox's cgroups (as a container's processes do): a
    guest spinning on its one vCPU gets no more than cpu=0.5 of a host core,
    and kill removes the groups."""
    with Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256, cpu=0.5) as s:
        pid = node._get(s.id)[1].state.pid
        for procs in cgroups.procs_files(s.id):  # cpu, cpuacct, memory, pids
            assert str(pid) in procs.read_text().split(), procs
        assert set(_vmm_threads(pid)) <= {
            int(x) for x in (cgroups.path("cpu", s.id) / "tasks").read_text().split()}
        limit = int((cgroups.path("memory", s.id) / "memory.limit_in_bytes").read_text())
        assert limit == (256 + VMM_OVERHEAD_MB) << 20
        throttled0, used0, t0 = (cgroups.cpu_stat(s.id)["nr_throttled"],
                                 cgroups.cpu_usage(s.id), time.monotonic())
        r = s.exec("timeout 4 sh -c 'while :; do :; done'; echo spun", timeout=60)
        used, wall = cgroups.cpu_usage(s.id) - used0, time.monotonic() - t0
        assert r.stdout == b"spun\n"
        # unthrottled, a spinning TCG vCPU uses a whole host core (or more)
        assert used / wall < 0.5 * 1.25, (used, wall)
        assert cgroups.cpu_stat(s.id)["nr_throttled"] > throttled0
        sid = s.id
    assert not any(p.name == sid for p in _sandbox_cgroups())


def test_best_effort_vmm_is_idle_class(node: Node) -> None:
    backend = _backend(node)
    backend.boot_timeout = 300.0  # an idle-class VM boots only as fast as the node is quiet
    try:
        with Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256,
                            qos="best_effort") as s:
            pid = node._get(s.id)[1].state.pid
            assert {os.sched_getscheduler(t) for t in _vmm_threads(pid)} == {os.SCHED_IDLE}
            assert cgroups.cpu_idle(s.id)
            assert s.exec("echo up").stdout == b"up\n"
    finally:
        backend.boot_timeout = 90.0


@pytest.mark.parametrize("backend", ["microvm", "vm"])
def test_options_a_vm_cannot_honour_are_refused(node: Node, backend: Backend) -> None:
    before = set(os.listdir(node.config.sandboxes))
    with pytest.raises(Unsupported, match=f"^open_files: the {backend} backend cannot limit"):
        Sandbox.create(IMAGE, backend=backend, node=node, memory_mb=256, open_files=4096)
    if backend == "vm":
        with pytest.raises(Unsupported, match="^disk_mb: 8 MiB is below the vm backend's"):
            Sandbox.create(IMAGE, backend=backend, node=node, memory_mb=256, disk_mb=8)
    assert set(os.listdir(node.config.sandboxes)) == before  # refused before it started


def test_agent_that_never_comes_up(node: Node) -> None:
    backend = _backend(node)
    backend.extra_append = ["lazyfs.test=noagent"]
    backend.boot_timeout = 10.0
    before = set(os.listdir(node.config.sandboxes))
    vmms = set(processes_with(str(node.config.sandboxes)))
    try:
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match="did not come up") as e:
            Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256)  # spec.MIN_GUEST_MB
        assert time.monotonic() - t0 < 25
    finally:
        backend.extra_append = []
        backend.boot_timeout = 90.0
    assert set(os.listdir(node.config.sandboxes)) == before  # nothing left of it
    assert set(processes_with(str(node.config.sandboxes))) == vmms
    failed = re.search(r"sb-[0-9a-f]{16}", str(e.value))
    assert failed is not None
    assert not any(p.name == failed.group() for p in _sandbox_cgroups())  # its VMM's groups


def test_a_fork_bomb_is_held_and_the_vm_stays_usable(sb: Sandbox, node: Node) -> None:
    """The guest's commands run in a cgroup with the sandbox's pids limit; the
    agent, outside it, keeps answering, and reports the refused forks as an
    event (the guest kernel's pids.events counter, read by the agent).
    events() during the bomb does not wait for the exec holding the agent
    (it gives the counts reported last)."""
    import threading
    key = ("process_limit", f"pids={sb.info.spec.pids}")
    before = _event_counts(sb).get(key, 0)
    out: list[bool] = []

    def bomb() -> None:
        try:
            r = sb.exec("b() { b | b & }; b; sleep 3", timeout=20, max_output_bytes=1 << 16)
            out.append(b"can't fork" in r.stderr)
        except (ExecTimeout, OutputTruncated) as e:
            out.append(e.result is not None and b"can't fork" in e.result.stderr)

    t = threading.Thread(target=bomb)
    t.start()
    agent = _backend(node)._vm(node._get(sb.id)[1]).agent
    wait_until(agent.lock.locked, 10, "the bomb running in the guest")
    t0 = time.monotonic()
    sb.events()  # while the exec holds the agent: the last counts, at once
    assert time.monotonic() - t0 < 5
    t.join()
    assert out == [True]  # the limit refused forks inside the guest
    r = sb.exec("echo alive", timeout=60)
    assert r.stdout == b"alive\n"
    assert sb.exec("cat /proc/self/cgroup").stdout == b"0::/sandbox\n"  # the limited cgroup
    got = _event_counts(sb)
    assert got.get(key, 0) > before, got


def test_a_memory_bomb_is_typed_out_of_memory(sb: Sandbox) -> None:
    """Typed OutOfMemory, the VM goes on, and the guest's OOM kill is an
    event (the commands' cgroup's oom_kill counter, read by the agent)."""
    key = ("oom_kill", "memory limit")
    before = _event_counts(sb).get(key, 0)
    with pytest.raises(OutOfMemory) as e:
        sb.exec("head -c 2000m /dev/zero | tail > /dev/null", timeout=120)
    assert e.value.result is not None and e.value.result.oom_killed
    assert sb.exec("echo alive").stdout == b"alive\n"
    got = _event_counts(sb)
    assert got.get(key, 0) > before, got  # counted in the guest


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (forge.c)")
def test_a_huge_listing_is_refused_and_the_channel_stays_in_step(node: Node,
                                                                 tmp_path: Path) -> None:
    """A directory over the listing cap: a one-line FileError, and the agent
    connection stays in step (it used to break for good). 1 GiB of guest
    RAM: the guest's tmpfs counts every name against its inode limit."""
    forge = tmp_path / "forge"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(forge),
                    str(Path(__file__).parent / "helpers" / "forge.c")], check=True)
    with Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=1024) as sb:
        sb.files.write("/tmp/forge", forge.read_bytes(), mode=0o755)
        r = sb.exec("mkdir /tmp/many && /tmp/forge names /tmp/many 100001 && ls /tmp/many | "
                    "wc -l", timeout=300)
        assert r.stdout == b"100001\n", r
        with pytest.raises(FileError, match="more than 100000 entries"):
            sb.files.list("/tmp/many")
        assert sb.exec("echo next").stdout == b"next\n"
        assert len(sb.files.list("/etc")) > 0


def test_memory_the_guest_frees_goes_back_to_the_host(node: Node) -> None:
    """Free page reporting (virtio-balloon): a 160 MiB tmpfs file a command
    writes in a fresh guest shows in the VMM's PSS on the host, and once the
    guest frees it, at least 96 MiB leave the VMM; without reporting a guest
    never gives back memory it touched. (A VM of its own: the guest reports
    only free 2 MiB blocks, and a guest that ran many tests is fragmented.)"""
    with Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=512) as s:
        pid = node._get(s.id)[1].state.pid
        assert pid is not None
        assert s.exec("grep -c '^virtio_balloon ' /proc/modules").stdout == b"1\n"
        base = vmm_pss(pid)
        s.exec("dd if=/dev/zero of=/dev/shm/fill bs=1M count=160 2>/dev/null", timeout=120)
        held = vmm_pss(pid)
        assert held - base > 96 << 20, (base >> 20, held >> 20)  # the guest's pages, on the host
        s.exec("rm /dev/shm/fill")
        wait_until(lambda: vmm_pss(pid) < held - (96 << 20), 60,
                   "the VMM's PSS falling once the guest freed the file")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (forge.c)")
def test_a_command_the_agent_cannot_reap_is_not_exit_0(sb: Sandbox, tmp_path: Path) -> None:
    """The attack: a command whose child (own session, none of its output)
    ptrace-attaches to it, then exits 3. A zombie tracee is visible to its
    tracer only, so the agent could not reap it and used to report exit 0
    after the whole timeout. Now the agent kills the tracer, gets the
    zombie back and reports its status, at once."""
    forge = tmp_path / "forge"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(forge),
                    str(Path(__file__).parent / "helpers" / "forge.c")], check=True)
    sb.files.write("/tmp/forge", forge.read_bytes(), mode=0o755)
    t0 = time.monotonic()
    r = sb.exec("/tmp/forge zombie 3", timeout=60)
    assert r.exit_code == 3, r
    assert time.monotonic() - t0 < 30  # not the timeout
    assert b"forge" not in sb.exec("ps -o pid,args").stdout  # its tracer was killed


def test_an_exit_status_the_agent_lost_is_a_typed_error(node: Node) -> None:
    """Fault injection (lazyfs.test=noreap: the agent discards every
    command's status, standing in for a command it cannot reap even after
    killing its tracer, e.g. stuck in the kernel, which cannot be made on
    demand): exec raises ExecStatusUnknown with exit code -1, never 0."""
    backend = _backend(node)
    backend.extra_append = ["lazyfs.test=noreap"]
    try:
        s = Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256)
    finally:
        backend.extra_append = []
    with s:
        t0 = time.monotonic()
        with pytest.raises(ExecStatusUnknown, match="exit status is unknown") as e:
            s.exec("echo ran; exit 0", timeout=60)
        assert time.monotonic() - t0 < 30
        res = e.value.result
        assert res is not None and res.exit_code == -1 and res.status_unknown
        assert res.stdout == b"ran\n"
