"""What a node leaves when its process ends without closing it: a script
that creates an fncall sandbox through the embedded SDK and simply exits
leaves no worker, cgroup or mount (the node closes at interpreter exit); a
script SIGKILLed mid-way leaves them, and the next node start on the same
state directory sweeps them. The sweep also takes the worker cgroups of dead
nodes of other state directories, never a live node's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lazyfs import sysmount
from runtime.backends.fncall import CONTROLLERS, cgroup_prefix, leftover_cgroups
from runtime.config import RuntimeConfig
from runtime.isolation import cgroups
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]
REPO = Path(__file__).resolve().parent.parent

# a user's script: an fncall sandbox through the embedded SDK, never closed
SCRIPT = f"""
import os, signal, sys
from runtime import Sandbox
from runtime.isolation.hostlimits import fncall_uid
fn = Sandbox.create({IMAGE!r}, backend="fncall")
assert fn.exec("id -u").stdout == b"%d\\n" % fncall_uid(fn.id)
print("made", fn.id, flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


class Env:
    def __init__(self, d: Path, store: Path, node_root: Path) -> None:
        self.d, self.store, self.node_root = d, store, node_root

    def state(self, name: str) -> Path:
        return self.d / name

    def run(self, state: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LAZYFS_STORE": str(self.store), "LAZYFS_RUNTIME_DIR": str(state),
               "LAZYFS_NODE_ROOT": str(self.node_root), "PYTHONPATH": str(REPO)}
        env.pop("LAZYFS_NODE", None)
        return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    def left(self, state: Path) -> tuple[list[str], list[str], list[str]]:
        """(fncall cgroups of the state directory, mounts under it, processes naming it)"""
        config = RuntimeConfig(store=self.store, cluster=None, state_dir=state,
                               node_root=self.node_root)
        prefix = cgroup_prefix(config) + "-"
        cgs = sorted({d.name for c in CONTROLLERS
                      for d in (cgroups.CGROUP_ROOT / c / cgroups.PARENT).glob(f"{prefix}*")})
        mounts = [m.mount_point for m in sysmount.mounts()
                  if m.mount_point.startswith(f"{state}/")]
        procs = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                if str(state).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    procs.append(pid)
            except OSError:
                continue
        return cgs, mounts, procs


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    d = tmp_path_factory.mktemp("leftovers")
    store = busybox_store(d)
    with LazyNode(d / "lazynode", store) as lazy:
        yield Env(d, store, lazy.paths.root)


def test_a_script_that_exits_without_closing_leaves_nothing(env: Env) -> None:
    state = env.state("rt-exit")
    p = env.run(state, SCRIPT, "exit")
    assert p.returncode == 0 and p.stdout.startswith("made sb-"), p.stderr
    assert env.left(state) == ([], [], [])


def test_a_killed_scripts_leftovers_are_swept_by_the_next_node_start(env: Env) -> None:
    state = env.state("rt-kill")
    p = env.run(state, SCRIPT, "kill")
    assert p.returncode == -9 and p.stdout.startswith("made sb-"), p.stderr
    cgs, mounts, _ = env.left(state)
    assert cgs and mounts  # what a SIGKILL leaves: no exit handler ran
    # the next node on the state directory (here: a script listing sandboxes)
    p = env.run(state, "from runtime import Sandbox; print(len(Sandbox.list()))")
    assert (p.returncode, p.stdout) == (0, "0\n"), p.stderr
    assert env.left(state) == ([], [], [])


def test_the_sweep_takes_dead_nodes_cgroups_never_a_live_ones(env: Env) -> None:
    """Worker cgroups of other state directories: a dead owner's go, a live
    owner's and those naming no owner stay."""
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    parent = cgroups.CGROUP_ROOT / "pids" / cgroups.PARENT
    made_parent = not parent.exists()
    names = {"dead": f"fncall-0badc0de-p{dead.pid}-0123456789ab-1",
             "live": f"fncall-0badc0de-p{live.pid}-0123456789ab-1",
             "unowned": "fncall-0badc0de-0123456789ab-1"}
    try:
        for n in names.values():
            (parent / n).mkdir(parents=True)
        config = RuntimeConfig(store=env.store, cluster=None, state_dir=env.state("rt-other"),
                               node_root=env.node_root)
        found = set(leftover_cgroups(config)) & set(names.values())
        assert found == {names["dead"]}
    finally:
        live.kill()
        live.wait()
        for n in names.values():
            try:
                (parent / n).rmdir()
            except FileNotFoundError:
                pass
        if made_parent:
            cgroups.remove_parent()
