"""A snapshot (or a preemption) killed midway, for real: a node in a child
process creates a sandbox, writes 200 MB into it and snapshots (preempts)
it; the test SIGKILLs that process once the packing has written `threshold`
bytes under a directory it watches (the store's, or the node's staging
store), or once a file appears (the preemption's record), then looks at
what was left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .lazynode import REPO

_SNAPSHOT_AND_WAIT = """
import sys
from pathlib import Path
from runtime.config import RuntimeConfig
from runtime.node import Node
from runtime.spec import ExecRequest, SandboxSpec
store, cluster, state, root, image, tag, op = sys.argv[1:]
node = Node(RuntimeConfig(store=Path(store), cluster=cluster or None, state_dir=Path(state),
                          node_root=Path(root)))
info = node.create(SandboxSpec(image=image))
node.exec(info.id, ExecRequest(cmd=("/bin/sh", "-c",
          "head -c 209715200 /dev/urandom > /root/big; echo alive > /root/alive")))
print(info.id, flush=True)
sys.stdin.readline()
node.snapshot(info.id, tag) if op == "snapshot" else node.preempt(info.id)
print("finished", flush=True)
"""


def size_under(d: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(d):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def kill_snapshot_midway(*, store: Path, cluster: str | None, state: Path, node_root: Path,
                         image: str, tag: str, watch: Path, threshold: int = 32 << 20,
                         preempt: bool = False) -> str:
    """Run the snapshot (`preempt`: the preemption) of a fresh sandbox in a
    child node process and kill it (SIGKILL) while it packs, or with
    `preempt` once a record (*.json) is in the directory `watch`; returns the
    sandbox's id (it stays: the caller's node on `state` recovers it)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _SNAPSHOT_AND_WAIT, str(store), cluster or "", str(state),
         str(node_root), image, tag, "preempt" if preempt else "snapshot"], cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        sandbox_id = child.stdout.readline().strip()
        assert sandbox_id.startswith("sb-"), f"the child node failed: {sandbox_id!r}"
        before = size_under(watch)
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 60

        def under_way() -> bool:
            if preempt:  # a record in place (not a put's temporary file)
                return any(watch.glob("*.json"))
            return size_under(watch) >= before + threshold

        while not under_way():
            assert child.poll() is None, "the snapshot finished before it could be killed"
            assert time.monotonic() < deadline, "the snapshot did not start packing"
            time.sleep(0.001 if preempt else 0.01)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        return sandbox_id
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()
