"""The native container starter (runtime/native/sandbox-spawn.c) builds the
sandbox runc builds from the same OCI config: two nodes, one per starter,
real runc, real namespaces, cgroups and seccomp; what a process inside sees
and what the host holds for it are compared field by field. And what the
native starter refuses: an image whose /proc is a symbolic link out of its
root gets no sandbox, and nothing of the attempt is left."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.convert import convert
from lazyfs.node import store_catalog
from runtime import Sandbox, SandboxError
from runtime.config import RuntimeConfig
from runtime.isolation import cgroups
from runtime.native import SPAWN_SOURCE, WARNINGS
from runtime.node import Node
from tests.helpers.images import build_busybox_rootfs
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import (
    IMAGE,
    busybox_node,
    busybox_store,
    node_for,
    runtime_missing,
)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]

# what a process of the sandbox reads about itself
PROBE = r"""
grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp|Seccomp_filters|Uid|Gid|Groups|SigIgn|SigBlk):' /proc/self/status
echo --umask; umask
echo --net; cat /sys/class/net/lo/flags; ls /sys/class/net
echo --maps; cat /proc/self/uid_map /proc/self/gid_map
echo --limits; grep -E 'open files|processes|core' /proc/self/limits
echo --cgroup; cat /proc/self/cgroup
echo --dev; ls -la /dev | awk 'NR>1 {print $1, $NF}' | sed 's/[.]$//'
echo --mounts; awk '{o=$6; for(i=7;$i!="-";i++); print $5, o, $(i+1), $(i+3)}' /proc/self/mountinfo
echo --sysctl; cat /proc/sys/user/max_inotify_instances /proc/sys/user/max_inotify_watches
echo --writes; for f in /proc/sys/kernel/hostname /proc/sysrq-trigger /sys/kernel/uevent_helper; do
  (echo x > $f) 2>/dev/null && echo "$f writable" || echo "$f refused"; done
echo --masked; for f in /proc/kallsyms /proc/cmdline /proc/locks; do wc -c < $f; done
ls /sys/firmware /proc/acpi 2>&1 | wc -l
echo --denied; unshare -U true 2>&1 | sed 's/^unshare: //'; mount -t tmpfs x /mnt 2>&1 | sed 's/^mount: //'
echo --host; hostname | wc -c
"""

# host-side files of the sandbox's groups
GROUP_FILES = [("memory", "memory.limit_in_bytes"), ("memory", "memory.memsw.limit_in_bytes"),
               ("cpu", "cpu.cfs_quota_us"), ("cpu", "cpu.cfs_period_us"), ("cpu", "cpu.shares"),
               ("pids", "pids.max"), ("devices", "devices.list"), ("freezer", "freezer.state")]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    with busybox_node(tmp_path_factory.mktemp("native"), container_starter="native") as a, \
            busybox_node(tmp_path_factory.mktemp("runc"), container_starter="runc") as b:
        yield {"native": a, "runc": b}


def _seen(node: Node) -> tuple[str, dict[str, list[str]], str]:
    with Sandbox.create(IMAGE, node=node, memory_mb=300, cpu=0.5, pids=77) as s:
        r = s.exec(["sh", "-c", PROBE])
        assert r.exit_code == 0, r.stderr
        # the sandbox's own host uid range and id differ per sandbox
        handle = node._get(s.id)[1]
        base = handle.state.id_base
        out = r.stdout.decode().replace(str(base), "BASE")
        out = re.sub(r"/proc/self/fd/\d+", "/proc/self/fd/N", out)  # (the overlay's lowers)
        host = {f"{c}/{f}": sorted((cgroups.path(c, s.id) / f).read_text().splitlines())
                for c, f in GROUP_FILES}
        groups = {line.split(":", 2)[1] for line in
                  Path(f"/proc/{handle.state.init_pid}/cgroup").read_text().splitlines()
                  if s.id in line}
        host["joined"] = sorted(groups)
        return out, host, s.id


def test_both_starters_build_the_same_sandbox(nodes: dict[str, Node]) -> None:
    seen = {name: _seen(node) for name, node in nodes.items()}
    (native, native_host, _), (runc, runc_host, _) = seen["native"], seen["runc"]
    assert native_host == runc_host
    # signals ignored: none natively; runc leaves one (32, its Go runtime's)
    ign = {k: int(re.search(r"^SigIgn:\s+(\w+)$", t, re.MULTILINE).group(1), 16)  # type: ignore[union-attr]
           for k, t in (("native", native), ("runc", runc))}
    assert ign["native"] == 0 and ign["runc"] & ~(1 << 31) == 0, ign
    native, runc = (re.sub(r"^SigIgn:.*\n", "", t, flags=re.MULTILINE) for t in (native, runc))
    # every section line by line, so a difference names its place
    for part_n, part_r in zip(native.split("--"), runc.split("--"), strict=True):
        assert sorted(part_n.splitlines()) == sorted(part_r.splitlines()), part_n[:20]
    # and what the comparison stands on, spelled out: no capability beyond the
    # small set, seccomp filtering, no_new_privs, ids mapped, masks in place
    assert re.search(r"^CapBnd:\s+00000000000404fb$", native, re.MULTILINE), native
    assert re.search(r"^Seccomp:\s+2$", native, re.MULTILINE) and re.search(r"^NoNewPrivs:\s+1$", native,
                                                                     re.MULTILINE)
    assert re.search(r"^\s*0\s+BASE\s+65536$", native, re.MULTILINE)
    assert native.split("--net")[1].split()[:2] == ["0x9", "lo"]  # loopback up, nothing else
    assert "/proc/sysrq-trigger refused" in native and "/proc/sys/kernel/hostname refused" in native
    assert native.split("--masked")[1].split()[:3] == ["0", "0", "0"]
    assert "Operation not permitted" in native.split("--denied")[1]
    assert "a *:* rwm" not in native_host["devices/devices.list"]
    assert "c 1:3 rwm" in native_host["devices/devices.list"]


def test_a_proc_symlink_out_of_the_root_gets_no_sandbox(tmp_path: Path) -> None:
    """The image makes /proc a link to the host's /etc: runc follows links
    inside the root only; the native starter refuses the mount point, in one
    line, and nothing of the sandbox is left (mounts, groups, processes)."""
    store = busybox_store(tmp_path)
    root = build_busybox_rootfs(tmp_path / "evil")
    shutil.rmtree(root / "proc", ignore_errors=True)
    (root / "proc").symlink_to("/etc")
    with ChunkStore.open(store) as st, store_catalog(st) as cat:
        convert(st, cat, f"dir:{root}", "evil:1")
    with node_for(store, tmp_path, container_starter="native") as node:
        with Sandbox.create(IMAGE, node=node) as s:  # (the node's own mounts, made once)
            assert s.exec(["true"]).exit_code == 0
        before = set(Path("/proc/self/mountinfo").read_text().splitlines())
        with pytest.raises(SandboxError, match="symbolic link") as e:
            Sandbox.create("evil:1", node=node)
        assert "\n" not in str(e.value)
        assert not node.list_sandboxes()
        assert set(Path("/proc/self/mountinfo").read_text().splitlines()) <= before
        assert not [p for p in (cgroups.CGROUP_ROOT / "memory" / cgroups.PARENT).glob("sb-*")
                    if (p / "cgroup.procs").read_text().strip()]
        # the same node starts a sandbox from a sound image right after
        with Sandbox.create(IMAGE, node=node) as s:
            assert s.exec(["true"]).exit_code == 0


def _sanitized(tmp_path: Path) -> Path:
    """sandbox-spawn built with AddressSanitizer + UBSan (dynamic: ASan has
    no static runtime), aborting on the first report."""
    out = tmp_path / "sandbox-spawn-asan"
    subprocess.run(["gcc", "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                    "-fno-sanitize-recover=all", *WARNINGS, "-o", str(out), str(SPAWN_SOURCE)],
                   check=True, capture_output=True)
    return out


def test_malformed_specs_get_one_line_and_start_nothing(tmp_path: Path) -> None:
    """The spec parser under ASan + UBSan, fed truncated, unknown, oversized
    and random specs: exit 1 and one line naming what was wrong; no clone
    happens (no pid file), no sanitizer report."""
    spawn = _sanitized(tmp_path)
    good = (b"root\0/nonexistent-root\0ns\0mount\0arg\0/dev/.sandbox-init\0")
    rnd = random.Random(7)
    cases = {
        "empty": b"",
        "unknown": b"frobnicate\0x\0",
        "truncated": good[:-3],
        "no args": b"mount\0a\0b\0",
        "not a number": b"rlimit\0seven\x001\x001\0",
        "no mount ns": b"root\0/\0arg\0/bin/true\0",
        "relative root": b"root\0rel\0ns\0mount\0arg\0/x\0",
        "too many": b"ro\0/x\0" * 300,
        "unterminated": b"root\0/x",
        **{f"random {k}": bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 400)))
           for k in range(40)},
        **{f"mutated {k}": bytes(b if rnd.random() > 0.1 else rnd.randrange(256) for b in good)
           for k in range(40)},
    }
    for name, spec in cases.items():
        f = tmp_path / "spec"
        f.write_bytes(spec)
        pid_file = tmp_path / "pid"
        p = subprocess.run([str(spawn), str(f), str(pid_file)], capture_output=True, text=True,
                           check=False,
                           errors="replace", timeout=60,
                           env={"ASAN_OPTIONS": "detect_leaks=0"})
        assert "Sanitizer" not in p.stderr and "runtime error" not in p.stderr, (name, p.stderr)
        assert p.returncode == 1, (name, p.returncode, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sandbox-spawn: "), (name, p.stderr)
        assert not pid_file.exists(), name


@pytest.mark.parametrize("starter", ["native", "runc"])
def test_a_create_cut_short_leaves_nothing_running(tmp_path: Path, starter: str) -> None:
    """The node dies between starting a sandbox's init and recording it
    (its sandbox.json never written): the next node on the state directory
    kills that init and its groups, whichever starter made it."""
    store = busybox_store(tmp_path)
    with LazyNode(tmp_path / "lazynode", store) as lazy:
        config = RuntimeConfig(store=store, cluster=None, state_dir=tmp_path / "state",
                               node_root=lazy.paths.root, container_starter=starter)
        old = Node(config)
        try:
            s = Sandbox.create(IMAGE, node=old)
            pid = old._get(s.id)[1].state.init_pid
        finally:
            old.close()  # its sandbox stays running
        assert Path(f"/proc/{pid}").exists()
        (config.sandboxes / s.id / "sandbox.json").unlink()  # as if never recorded
        restarted = Node(config)
        try:
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}/stat").exists() and time.monotonic() < deadline:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
                time.sleep(0.05)
            assert not Path(f"/proc/{pid}/stat").exists() or \
                Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            assert not cgroups.pids(s.id)
            assert not restarted.list_sandboxes()
        finally:
            restarted.kill_many(None)
            restarted.close()
