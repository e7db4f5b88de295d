"""Hidden paths and verify on VM sandboxes, end to end through the SDK: real
QEMU (TCG here), the image's layers as lazy pmem EROFS lowers.

vm: an agent VM created with a hidden answer cannot find it (not in its
file system at all), writes its own files and plants a fake answer, a
symlink to a host file, a setuid file, a name with a newline and a
background process (mknod is refused to its commands); verify() boots a
fresh VM from the image plus the agent's disk as packed on the host: the
agent's files, the image's answer, none of the agent's processes, no
network, no host file; an upper with a sparse file past the disk's size is
refused before any VM boots; a disk e2fsck finds wrong is never mounted. Boots: the agent VM, one verifier. Device
nodes a guest kernel could make (no command can) are checked where the
host packs an upper. microvm: a VM created with a hidden path does not see
it (one boot); its verify is tests/test_verify_microvm.py's.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.convert import convert
from composer.errors import DiffError
from composer.manifest import Kind
from composer.snapshot import UpperRules, pack_diff
from lazyfs.node import store_catalog
from runtime import Sandbox, SandboxError
from runtime.guest import disk
from runtime.node import Node
from tests.helpers.images import build_busybox_rootfs
from tests.helpers.sandboxes import node_for, vm_missing

TASK = "vmtask:1"
ANSWER = b"the-hidden-answer-42\n"
MISSING = vm_missing(("mkfs.ext4", "e2fsprogs"), ("e2fsck", "e2fsprogs"))
pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Path]]:
    d = tmp_path_factory.mktemp("vmverify")
    root = build_busybox_rootfs(d / "rootfs")
    (root / "task" / "answers").mkdir(parents=True)
    (root / "task" / "answers" / "expected").write_bytes(ANSWER)
    (root / "task" / "README").write_text("solve it\n")
    (root / "workspace").mkdir()
    store = d / "store"
    with ChunkStore.open(store, create=True) as s, store_catalog(s) as cat:
        convert(s, cat, f"dir:{root}", TASK)
    with node_for(store, d) as n:
        n.backend("vm").pmem_cache = d / "pmem"  # type: ignore[attr-defined]
        n.backend("microvm").pmem_cache = d / "pmem"  # type: ignore[attr-defined]
        yield n, d


def test_vm_hidden_answer_and_a_verifier_the_agent_cannot_touch(
        env: tuple[Node, Path]) -> None:
    node, d = env
    secret = d / "host-secret"
    secret.write_bytes(b"HOST-ONLY-SECRET\n")
    caps = Sandbox.capabilities("vm", node=node)
    assert caps["verify"] and caps["hidden"] and not caps["fork"]
    with Sandbox.create(TASK, backend="vm", node=node, memory_mb=256, cpu=1,
                        hidden=["/task/answers"]) as sb:
        # the agent cannot find the answer: not there, not merely unreadable
        r = sb.exec("ls -a /task; cat /task/answers/expected; find / -xdev -name expected; "
                    "grep -r hidden-answer /task /workspace; echo end")
        assert r.stdout == b".\n..\nREADME\nend\n", r
        assert b"No such file" in r.stderr
        assert [f.name for f in sb.files.list("/task")] == ["README"]
        # its work, a fake answer, and what it plants for the verifier or the host
        r = sb.exec(
            "echo 42 > /workspace/answer && mkdir -p /task/answers && "
            "echo fake > /task/answers/expected && "
            f"ln -s {secret} /workspace/leak && "
            "printf x > \"/workspace/new\nline\" && "
            "cp /bin/busybox /workspace/suid && chmod 4755 /workspace/suid && "
            "(sleep 1000 </dev/null >/dev/null 2>&1 &) && echo planted")
        assert r.exit_code == 0 and r.stdout == b"planted\n", r
        # commands have no CAP_MKNOD (a compromised guest kernel could: below, packing)
        r = sb.exec("mknod /workspace/hostdisk b 8 0")
        assert r.exit_code != 0 and b"Permission denied" in r.stderr, r
        v = sb.verify(
            "cat /workspace/answer /task/answers/expected; ls /workspace | wc -l; "
            "ls -l /workspace/suid | cut -c1-10; cat /workspace/leak; "
            "ps | grep -c '[s]leep 1000'; "
            "ls /sys/class/net; exit 3")
        assert v.exit_code == 3, v
        out = v.stdout.decode()
        # the agent's file, the image's answer over the fake one
        assert out.startswith("42\n" + ANSWER.decode()), v
        lines = out.splitlines()
        assert lines[2].strip() == "4", v  # answer, leak, new\nline (2 lines of ls), suid
        assert lines[3] == "-rwsr-xr-x", v
        assert b"HOST-ONLY-SECRET" not in v.stdout + v.stderr
        # the link came along as a link, resolved in the verifier's guest
        assert "'/workspace/leak': No such file" in v.stderr.decode(), v
        assert lines[4:] == ["0", "lo"], v  # none of the agent's processes, no network
        # the agent VM runs on, as it was: still no answer, its files there
        assert sb.exec("cat /workspace/answer /task/answers/expected").stdout == b"42\nfake\n"
        assert not [s for s in node.list_sandboxes() if s.id != sb.id]  # the verifier is gone

        # a sparse file past the disk's size: refused while packing, no VM booted
        r = sb.exec("dd if=/dev/zero of=/workspace/huge bs=1 count=1 seek=8G 2>&1")
        assert r.exit_code == 0, r
        with pytest.raises(SandboxError, match=r"'workspace/huge'.*sparse"):
            sb.verify("true", keep=["/workspace"])
        assert sb.exec("echo alive").stdout == b"alive\n"


def test_microvm_hidden_path_is_not_there(env: tuple[Node, Path]) -> None:
    """(verify of microVMs: tests/test_verify_microvm.py)"""
    node, _ = env
    caps = Sandbox.capabilities("microvm", node=node)
    assert caps["hidden"] and caps["verify"]
    with Sandbox.create(TASK, backend="microvm", node=node, memory_mb=256, cpu=1,
                        hidden=["/task/answers"]) as sb:
        r = sb.exec("ls -a /task; find / -xdev -name expected; echo end")
        assert r.stdout == b".\n..\nREADME\nend\n", r
        assert [f.name for f in sb.files.list("/task")] == ["README"]
    assert os.path.isdir(node.config.sandboxes)


def test_device_nodes_a_guest_kernel_made_are_left_out_of_its_layer(tmp_path: Path) -> None:
    """What a VM's upper could hold that no command of ours can make (a guest
    kernel's root: real device nodes), packed by the rules the vm backend
    captures with; a container's upper keeps them (its sandbox cannot make
    one: they are the image's)."""
    upper = tmp_path / "upper"
    (upper / "workspace").mkdir(parents=True)
    (upper / "workspace" / "answer").write_bytes(b"42\n")
    os.mknod(upper / "workspace" / "hostdisk", 0o600 | stat.S_IFBLK, os.makedev(8, 0))
    os.mknod(upper / "workspace" / "mem", 0o600 | stat.S_IFCHR, os.makedev(1, 1))
    os.mknod(upper / "workspace" / "gone", 0o600 | stat.S_IFCHR, 0)  # overlayfs' whiteout
    with ChunkStore.open(tmp_path / "store", create=True) as s:
        vm = pack_diff(s, upper, rules=UpperRules(devices=False, max_bytes=1 << 20))
        container = pack_diff(s, upper)
    kinds = {e.path: e.kind for e in vm.entries}
    assert kinds == {"": Kind.DIR, "workspace": Kind.DIR, "workspace/answer": Kind.FILE,
                     "workspace/gone": Kind.WHITEOUT}, kinds
    assert {e.path: e.kind for e in container.entries}["workspace/hostdisk"] == Kind.BLOCK
    with ChunkStore.open(tmp_path / "store") as s, \
            pytest.raises(DiffError, match="workspace/answer.*past 2 bytes"):
        pack_diff(s, upper, rules=UpperRules(max_bytes=2))


def test_a_disk_e2fsck_finds_wrong_is_never_mounted_on_the_host(tmp_path: Path) -> None:
    """What the guest's root cannot do from a command (it has no raw access
    to its disk) but a guest kernel could: write bad metadata. The bytes are
    corrupted here from the host (the fault injection), on a disk made as a
    VM's is."""
    good = tmp_path / "good.ext4"
    disk.make_upper(good, 32)
    with disk.reading(good, tmp_path / "mnt") as upper:
        assert os.path.ismount(tmp_path / "mnt")
        assert not upper.exists()  # a fresh disk: the guest makes /upper at boot
    assert not (tmp_path / "mnt").exists()
    bad = tmp_path / "bad.ext4"
    disk.make_upper(bad, 32)
    # where the root inode (2) is, as debugfs says: "located at block N, offset 0xM"
    imap = subprocess.run(["debugfs", "-R", "imap <2>", str(bad)], capture_output=True,
                          text=True, check=True).stdout
    m = re.search(r"located at block (\d+), offset (0x[0-9a-f]+)", imap)
    assert m, imap
    with open(bad, "r+b") as f:
        f.seek(int(m.group(1)) * _block_size(bad) + int(m.group(2), 16))
        f.write(b"\xff" * 128)  # garbage where the root directory's inode was
    with pytest.raises(SandboxError, match="fails e2fsck -fn"), \
            disk.reading(bad, tmp_path / "mnt2"):
        pass
    assert not (tmp_path / "mnt2").exists()
    assert not any(m.split()[1].startswith(str(tmp_path))
                   for m in Path("/proc/mounts").read_text().splitlines())


def _block_size(image: Path) -> int:
    with open(image, "rb") as f:
        f.seek(1024 + 24)  # s_log_block_size
        return 1024 << int.from_bytes(f.read(4), "little")
