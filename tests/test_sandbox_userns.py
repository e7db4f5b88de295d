"""Container root is not host root: each sandbox's user namespace maps its
ids to an unprivileged host range of its own (runtime/idmap.py), while the
image still looks root-owned inside (idmapped lowers).

The escape tests enter only the sandbox's user namespace with nsenter (a
process with the sandbox's identity that got out of its mount and PID
namespaces, or holds a host descriptor): it must act as an unprivileged
host user, a different one for every sandbox."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Sandbox, idmap
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_node, runtime_missing

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
