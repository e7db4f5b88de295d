"""Pause and resume of sandbox VMs: snapshot-and-exit, and restore.

Pause: QMP `stop`, `migrate` to a local file with the pmem regions left out
(x-ignore-shared: they are the shared, read-only image files), then `quit`:
the VMM exits and its memory is freed. Resume: a new VMM with the same
devices and `-incoming defer`, `migrate-incoming` from that file, `cont`,
and the guest agent is reconnected.

The snapshot lives in the sandbox's vm/state/ directory, unless the runtime
state directory is on tmpfs (RAM: writing the guest's memory there would
free nothing); then under SNAPSHOT_DIR/<sandbox id>/ on disk. A snapshot in
the store (the node's snapshot and preempt) packs that directory into a
layer; a VM made from it loads the stream straight from the node daemon's
`layers/<digest>/snapshot.bin` (fetched lazily, local store or cluster).

It does not start VMMs or choose their devices (runtime/backends/qemuproc.py
and the backends do).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from lazyfs import sysmount

from ..errors import BackendUnavailable, SandboxError
from ..guest import qemu
from ..guest.protocol import AgentConnection, AgentError
from ..spec import VM_STATE_FILE
from .qemuproc import KILL_WAIT, Vm, vmm_pss

MIGRATE_TIMEOUT = 120.0
SNAPSHOT_DIR = Path(os.environ.get("LAZYFS_MICROVM_SNAPSHOTS", "/var/lib/lazyfs/vm-snapshots"))
_IGNORE_SHARED = [{"capability": "x-ignore-shared", "state": True}]


def snapshot_path(state_dir: Path, sandbox_id: str, vmdir: Path) -> Path:
    """Where a pause writes the VM's state: the one file of a directory of
    its own (the directory is what a snapshot packs into a layer)."""
    info = sysmount.find_mount(state_dir)
    if info is not None and info.fstype == "tmpfs":  # RAM: would free nothing
        d = SNAPSHOT_DIR / sandbox_id
    else:
        d = vmdir / "state"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d / VM_STATE_FILE


def save(sandbox_id: str, vm: Vm, snap: Path) -> dict[str, Any]:
    """Snapshot the VM into snap and let its VMM exit; the caller holds the
    agent's lock (no call in flight). On failure the VM runs on."""
    pss = vmm_pss(vm.proc.pid)
    t0 = time.monotonic()
    try:
        q = qemu.Qmp(vm.config.qmp_socket)
        try:
            q.execute("stop")
            q.execute("migrate-set-capabilities", capabilities=_IGNORE_SHARED)
            q.execute("migrate", uri="exec:cat > " + shlex.quote(str(snap)))
            deadline = time.monotonic() + MIGRATE_TIMEOUT
            while True:
                st = q.execute("query-migrate").get("status")
                if st == "completed":
                    break
                if st in ("failed", "cancelled") or time.monotonic() > deadline:
                    raise SandboxError(f"snapshot of {sandbox_id} {st or 'timed out'}")
                time.sleep(0.02)
            saved = time.monotonic()
            q.execute("quit")
        finally:
            q.close()
    except (SandboxError, OSError) as e:
        snap.unlink(missing_ok=True)
        if vm.alive():
            try:
                q2 = qemu.Qmp(vm.config.qmp_socket)
                q2.execute("cont")
                q2.close()
            except (SandboxError, OSError):
                pass
        raise SandboxError(f"pausing {sandbox_id} failed: {e}") from e
    try:
        vm.proc.wait(timeout=KILL_WAIT)
    except subprocess.TimeoutExpired:
        vm.proc.kill()
        vm.proc.wait()
    vm.agent.close()
    return {"vmm_pss_before": pss, "vmm_pss_after": 0, "snapshot_bytes": snap.stat().st_size,
            "snapshot_s": saved - t0, "exit_s": time.monotonic() - saved}


def restore(sandbox_id: str, proc: subprocess.Popen[bytes], cfg: qemu.VmConfig, snap: Path,
            deadline: float) -> AgentConnection:
    """Load snap into a VMM started with `-incoming defer` (its sockets
    open), run it and reconnect to its agent."""
    q = qemu.Qmp(cfg.qmp_socket)
    try:
        # both ends must leave the shared pmem regions out of the stream
        q.execute("migrate-set-capabilities", capabilities=_IGNORE_SHARED)
        q.execute("migrate-incoming", uri="exec:cat " + shlex.quote(str(snap)))
        while True:
            st = q.execute("query-migrate").get("status")
            if st == "completed":
                break
            if st == "failed" or time.monotonic() > deadline or proc.poll() is not None:
                raise BackendUnavailable(f"restoring {sandbox_id} from {snap} {st}")
            time.sleep(0.02)
        q.execute("cont")
    finally:
        q.close()
    agent = AgentConnection.connect(str(cfg.agent_socket), alive=lambda: proc.poll() is None)
    try:
        agent.ping(timeout=max(1.0, deadline - time.monotonic()))
    except AgentError as e:
        agent.close()
        raise BackendUnavailable(f"the guest agent of {sandbox_id} did not answer after "
                                 f"resume: {e}") from e
    return agent


def remove(sandbox_id: str, snap: Path | None) -> None:
    """Remove a sandbox's snapshot, wherever it was written."""
    if snap is not None:
        snap.unlink(missing_ok=True)
    shutil.rmtree(SNAPSHOT_DIR / sandbox_id, ignore_errors=True)
    if SNAPSHOT_DIR.is_dir():  # (links a snapshot into the store was packing from)
        for d in SNAPSHOT_DIR.glob(f"{sandbox_id}-pack-*"):
            shutil.rmtree(d, ignore_errors=True)
