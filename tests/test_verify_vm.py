"""Hidden paths and verify on VM sandboxes, end to end through the SDK: real
QEMU (TCG here), the image's layers as lazy pmem EROFS lowers.

vm: an agent VM created with a hidden answer cannot find it (not in its
file system at all), writes its own files and plants a fake answer, a
symlink to a host file, device nodes and a name with a newline; verify()
boots a fresh VM from the image plus the agent's disk as packed on the host:
the agent's files, the image's answer, none of the agent's processes, no
network, no device node, no host file; an upper with a sparse file past the
disk's size is refused before any VM boots. Boots: the agent VM, one
verifier. microvm: a VM created with a hidden path does not see it (one boot);
verify is Unsupported (its upper is in guest memory).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.catalog import Catalog
from composer.convert import convert
from runtime import SandboxError, Sandbox, Unsupported
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
    with ChunkStore.open(store, create=True) as s, Catalog(s) as cat:
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
    with Sandbox.create(TASK, backend="vm", node=node, memory_mb=256, cpu=1,
                        hidden=["/task/answers"]) as sb:
        # the agent cannot find the answer: not there, not merely unreadable
        r = sb.exec("ls -a /task; cat /task/answers/expected; find / -xdev -name expected; "
                    "grep -r hidden-answer /task /workspace; echo end")
        assert r.stdout == b".\n..\nREADME\nend\n", r
        assert b"No such file" in r.stderr
        assert not sb.files.exists("/task/answers")
        # its work, a fake answer, and what it plants for the verifier or the host
        r = sb.exec(
            "echo 42 > /workspace/answer && mkdir -p /task/answers && "
            "echo fake > /task/answers/expected && "
            f"ln -s {secret} /workspace/leak && "
            "mknod /workspace/hostdisk b 8 0 && mknod /workspace/mem c 1 1 && "
            "printf x > \"/workspace/new\nline\" && "
            "cp /bin/busybox /workspace/suid && chmod 4755 /workspace/suid && "
            "(sleep 1000 </dev/null >/dev/null 2>&1 &) && echo planted")
        assert r.exit_code == 0 and r.stdout == b"planted\n", r
        v = sb.verify(
            "cat /workspace/answer /task/answers/expected; ls /workspace | wc -l; "
            "ls -l /workspace/suid | cut -c1-10; cat /workspace/leak; "
            "ls /workspace/hostdisk /workspace/mem; ps | grep -c '[s]leep 1000'; "
            "ls /sys/class/net; exit 3")
        assert v.exit_code == 3, v
        out = v.stdout.decode()
        # the agent's file, the image's answer over the fake one
        assert out.startswith("42\n" + ANSWER.decode()), v
        lines = out.splitlines()
        # answer, leak, new\nline (2 lines of ls), suid: hostdisk and mem left out
        assert lines[2].strip() == "5", v
        assert lines[3] == "-rwsr-xr-x", v
        assert b"HOST-ONLY-SECRET" not in v.stdout + v.stderr
        assert f"{secret}: No such file" in v.stderr.decode(), v  # the link resolves in the guest
        assert "/workspace/hostdisk: No such file" in v.stderr.decode(), v
        assert "/workspace/mem: No such file" in v.stderr.decode(), v
        assert lines[4:] == ["0", "lo"], v  # none of the agent's processes, no network
        # the agent VM runs on, as it was: still no answer, its files there
        assert sb.exec("cat /workspace/answer /task/answers/expected").stdout == b"42\nfake\n"
        assert not [s for s in node.sandboxes() if s.id != sb.id]  # the verifier is gone

        # a sparse file past the disk's size: refused while packing, no VM booted
        r = sb.exec("dd if=/dev/zero of=/workspace/huge bs=1 count=1 seek=8G 2>&1")
        assert r.exit_code == 0, r
        with pytest.raises(SandboxError, match=r"'workspace/huge'.*sparse"):
            sb.verify("true", keep=["/workspace"])
        assert sb.exec("echo alive").stdout == b"alive\n"


def test_microvm_hidden_path_is_not_there_and_verify_is_unsupported(
        env: tuple[Node, Path]) -> None:
    node, _ = env
    with Sandbox.create(TASK, backend="microvm", node=node, memory_mb=256, cpu=1,
                        hidden=["/task/answers"]) as sb:
        r = sb.exec("ls -a /task; find / -xdev -name expected; echo end")
        assert r.stdout == b".\n..\nREADME\nend\n", r
        assert not sb.files.exists("/task/answers/expected")
        with pytest.raises(Unsupported, match="verify"):
            sb.verify("true")
    assert os.path.isdir(node.config.sandboxes)
