"""Container root is not host root: each sandbox's user namespace maps its
ids to an unprivileged host range of its own (runtime/isolation/idmap.py), while the
image still looks root-owned inside (idmapped lowers).

The escape tests enter only the sandbox's user namespace with nsenter (a
process with the sandbox's identity that got out of its mount and PID
namespaces, or holds a host descriptor): it must act as an unprivileged
host user, a different one for every sandbox."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.convert import convert
from lazyfs.node import store_catalog
from runtime import Sandbox
from runtime.isolation import idmap
from runtime.node import Node
from tests.helpers.images import build_busybox_rootfs
from tests.helpers.sandboxes import IMAGE, busybox_node, node_for, runtime_missing

# root (mounts, cgroups) and runc
pytestmark = [pytest.mark.root, pytest.mark.skipif(runtime_missing() is not None,
                                                   reason=str(runtime_missing()))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node for the module's sandboxes (each test makes its own)."""
    with busybox_node(tmp_path_factory.mktemp("userns")) as n:
        yield n


def _init(node: Node, sb: Sandbox) -> int:
    pid = node._get(sb.id)[1].state.init_pid
    assert pid is not None
    return int(pid)


def _base(node: Node, sb: Sandbox) -> int:
    base = node._get(sb.id)[1].state.id_base
    assert base is not None
    return int(base)


def _escaped(node: Node, sb: Sandbox, script: str) -> subprocess.CompletedProcess[str]:
    """`script` as root of the sandbox's user namespace, in the host's
    mount and PID namespaces."""
    return subprocess.run(["nsenter", "--target", str(_init(node, sb)), "--user", "--",
                           "/bin/sh", "-c", script], capture_output=True, text=True,
                          timeout=30, check=False)


def test_root_inside_is_an_unprivileged_host_range(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        base = _base(node, sb)
        assert base >= 1 << 31  # above every uid a host hands out
        r = sb.exec("cat /proc/self/uid_map /proc/self/gid_map; id -u; id -g")
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.decode().split("\n")
        assert lines[0].split() == ["0", str(base), "65536"]
        assert lines[1].split() == ["0", str(base), "65536"]
        assert lines[2:4] == ["0", "0"]
        # the image (root-owned in the shared lowers) still looks root-owned
        r = sb.exec("stat -c '%u:%g' /bin/busybox /etc /")
        assert r.stdout.decode().split() == ["0:0"] * 3, r.stdout
        # and root may change it (copy-up keeps the owner): a tool chain's chown works
        r = sb.exec("echo x >> /etc/motd && chown 1000:1000 /etc/motd && "
                    "mkdir -p /work && touch /work/made && stat -c '%u:%g' /etc/motd /work/made")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode().split() == ["1000:1000", "0:0"]
        # on the host those files belong to the sandbox's range, not to root
        root = Path(f"/proc/{_init(node, sb)}/root")
        st = os.stat(root / "work" / "made")
        assert (st.st_uid, st.st_gid) == (base, base)
        assert os.stat(root / "etc" / "motd").st_uid == base + 1000
        upper = Path(f"/proc/{_init(node, sb)}/fd/3/upper")  # the writable layer itself
        assert os.stat(upper / "work" / "made").st_uid == base


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A host directory every user can reach (the test's tmp_path is under
    pytest's root-only directory)."""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="lazyfs-userns-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


def test_an_escaped_process_is_not_host_root(node: Node, host_dir: Path) -> None:
    """Through a host path (what a leaked descriptor or a mount-namespace
    escape gives): root's files refuse it, what it creates is its range's."""
    protected = host_dir / "root-owned"
    protected.write_text("host\n")
    os.chmod(protected, 0o644)
    drop = host_dir / "drop"
    drop.mkdir()
    os.chmod(drop, 0o1777)
    with Sandbox.create(IMAGE, node=node) as sb:
        r = _escaped(node, sb, f"echo forged >> {protected}")
        assert r.returncode != 0 and "denied" in r.stderr.lower(), (r.returncode, r.stderr)
        assert protected.read_text() == "host\n"
        r = _escaped(node, sb, f"echo mine > {drop}/made")
        assert r.returncode == 0, r.stderr
        assert (drop / "made").stat().st_uid == _base(node, sb)


def test_sandboxes_get_ranges_of_their_own(node: Node) -> None:
    """A uid may signal and ptrace its own processes: with one range for all,
    an escaped process would reach every other sandbox's."""
    with Sandbox.create(IMAGE, node=node) as a, Sandbox.create(IMAGE, node=node) as b:
        assert _base(node, a) != _base(node, b)
        assert b.exec("sleep 600 </dev/null >/dev/null 2>&1 & echo started").exit_code == 0
        victims = [p for p in _pids_of(_base(node, b)) if p != _init(node, b)]
        assert victims
        r = _escaped(node, a, f"kill -0 {victims[0]}")
        assert r.returncode != 0 and "not permitted" in r.stderr.lower(), r.stderr
        r = _escaped(node, b, f"kill -0 {victims[0]}")  # control: its own range's may
        assert r.returncode == 0, r.stderr
        slots = idmap.holders()
        assert slots[(_base(node, a) - idmap.FIRST) // idmap.RANGE] == [a.id]
    # killed sandboxes give their ranges back
    assert not {a.id, b.id} & {s for ids in idmap.holders().values() for s in ids}


def _pids_of(uid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid == uid:
                    out.append(int(p))
            except OSError:
                continue
    return out


def test_files_the_node_writes_belong_to_the_sandbox_root(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        sb.files.write("/work/new/up.txt", b"from the node\n")
        r = sb.exec("stat -c '%u:%g' /work/new /work/new/up.txt && "
                    "echo more >> /work/new/up.txt && cat /work/new/up.txt")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode().split("\n")[:4] == ["0:0", "0:0", "from the node", "more"]


def test_a_snapshot_keeps_the_owners_the_sandbox_saw(node: Node) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        r = sb.exec("mkdir -p /work && touch /work/r /work/u && chown 1000:100 /work/u")
        assert r.exit_code == 0, r.stderr
        snap = sb.snapshot()
    with Sandbox.create(snap, node=node) as child:
        r = child.exec("stat -c '%n %u:%g' /work/r /work/u /bin/busybox")
        assert r.stdout.decode().split("\n")[:3] == ["/work/r 0:0", "/work/u 1000:100",
                                                     "/bin/busybox 0:0"], r.stdout


FILECAP_SOURCE = Path(__file__).parent / "helpers" / "filecap.c"
CAPS_IMAGE = "caps:1"
# security.capability, revision 2: CAP_DAC_READ_SEARCH permitted + effective
CAP_V2 = (0x02000001).to_bytes(4, "little") + (4).to_bytes(4, "little") + bytes(12)
CAP = b"rev 2 permitted 0x4\n"  # as the root of a sandbox's namespace reads it


@pytest.fixture(scope="module")
def filecap(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (filecap.c)")
    out = tmp_path_factory.mktemp("filecap") / "filecap"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(FILECAP_SOURCE)], check=True,
                   capture_output=True)
    return out.read_bytes()


@pytest.fixture(scope="module")
def caps_node(tmp_path_factory: pytest.TempPathFactory, filecap: bytes) -> Iterator[Node]:
    """A node whose image has a file with a capability (/capcat, a copy of
    busybox, as an image's ping or an installed tool would carry one)."""
    d = tmp_path_factory.mktemp("caps")
    root = build_busybox_rootfs(d / "rootfs")
    shutil.copyfile(root / "bin" / "busybox", root / "capcat")
    os.chmod(root / "capcat", 0o755)
    os.setxattr(root / "capcat", "security.capability", CAP_V2)
    (root / "filecap").write_bytes(filecap)
    os.chmod(root / "filecap", 0o755)
    with ChunkStore.open(d / "store", create=True) as store, store_catalog(store) as cat:
        convert(store, cat, f"dir:{root}", CAPS_IMAGE)
    with node_for(d / "store", d) as n:
        yield n


def test_a_file_capability_follows_a_snapshot_into_another_range(caps_node: Node) -> None:
    """A sandbox that touches an image file with a capability copies it up:
    the kernel writes the capability into the upper for the sandbox's root,
    by its host id (revision 3, rootid = the range's base). A snapshot
    records it for the root of whatever sandbox it becomes, so a sandbox made
    from it (another range) and a fork read the capability the writer read;
    recorded as written, it named the first sandbox's host root and read as
    no capability at all (EOVERFLOW) in every other sandbox. A sandbox cannot
    set one itself (no CAP_SETFCAP: EPERM)."""
    node = caps_node
    with Sandbox.create(CAPS_IMAGE, node=node) as sb:
        assert sb.exec("/filecap get /capcat").stdout == CAP  # control: the image's own
        r = sb.exec("touch /capcat && /filecap get /capcat && cp /bin/busybox /mine && "
                    "/filecap set /mine")
        assert r.stdout == CAP + b"error 1\n", r
        # as the host reads it: for this range's root
        raw = os.getxattr(f"/proc/{_init(node, sb)}/root/capcat", "security.capability")
        assert len(raw) == 24 and int.from_bytes(raw[20:24], "little") == _base(node, sb), raw
        snap = sb.snapshot()
        [fork] = sb.fork(1)
        with fork:
            assert _base(node, fork) != _base(node, sb)
            assert fork.exec("/filecap get /capcat").stdout == CAP
    with Sandbox.create(snap, node=node) as child:
        assert child.exec("/filecap get /capcat").stdout == CAP
        assert child.exec("/filecap get /mine").stdout == b"error 61\n"  # none (ENODATA)


def test_a_released_range_and_its_namespace_serve_the_next(tmp_path: Path) -> None:
    pool = idmap.RangePool(tmp_path / "slots", spare=1)
    try:
        a = pool.acquire("sb-a")
        ns = pool.user_namespace(a)
        maps = Path(f"/proc/self/fd/{ns}")  # a user namespace's descriptor
        assert maps.exists()
        shared = pool.acquire("sb-b")
        assert shared != a
        pool.release(a, "sb-a")
        c = pool.acquire("sb-c")  # the spare: same range, same namespace
        assert c == a and pool.user_namespace(c) == ns
        assert idmap.holders(tmp_path / "slots") == {a.slot: ["sb-c"], shared.slot: ["sb-b"]}
        idmap.join(c, "sb-restored", tmp_path / "slots")  # a restore of c's checkpoint shares it
        pool.release(c, "sb-c")
        assert idmap.holders(tmp_path / "slots")[c.slot] == ["sb-restored"]
        assert pool.acquire("sb-d") not in (a, shared)
    finally:
        pool.close()
