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

SNAPSHOT_DIR is shared by the host's nodes and outlives them: each
sandbox's directory there holds an owner record (OWNER_FILE: the node's
state directory and the sandbox's image digest) next to the snapshot, and
collect() removes what no live sandbox needs (see there).

It does not start VMMs or choose their devices (runtime/backends/qemuproc.py
and the backends do).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from lazyfs import sysmount
from lazyfs.settings import setting

from ..errors import BackendUnavailable, SandboxError
from ..guest import qemu
from ..guest.protocol import AgentConnection, AgentError
from ..spec import VM_STATE_FILE
from .qemuproc import KILL_WAIT, Vm, vmm_pss

log = logging.getLogger(__name__)

MIGRATE_TIMEOUT = 120.0


def snapshot_dir() -> Path:
    """SNAPSHOT_DIR: where paused VMs' states live (settings vm.snapshots,
    LAZYFS_MICROVM_SNAPSHOTS)."""
    path: Path = setting("vm_snapshots")
    return path


_IGNORE_SHARED = [{"capability": "x-ignore-shared", "state": True}]
OWNER_FILE = "owner.json"  # in SNAPSHOT_DIR/<id>/: whose snapshot it is
PACK = "-pack-"  # SNAPSHOT_DIR/<id>-pack-<hex>/: the link a store snapshot packs from
PACK_GRACE = 3600.0  # packing takes seconds: a pack directory this old was cut short


def snapshot_path(state_dir: Path, sandbox_id: str, vmdir: Path, image: str) -> Path:
    """Where a pause of a VM of `image` (its digest) writes the VM's state:
    a directory of its own (a store snapshot packs a link to the file)."""
    info = sysmount.find_mount(state_dir)
    if info is not None and info.fstype == "tmpfs":  # RAM: would free nothing
        d = owned_dir(sandbox_id, state_dir, image)
    else:
        d = vmdir / "state"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d / VM_STATE_FILE


def owned_dir(sandbox_id: str, state_dir: Path, image: str) -> Path:
    """SNAPSHOT_DIR/<sandbox_id>, with its owner record: the node (its state
    directory) and the image whose VM it holds."""
    d = snapshot_dir() / sandbox_id
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    owner = {"state_dir": str(state_dir.resolve()), "image": image}
    (d / OWNER_FILE).write_text(json.dumps(owner))
    return d


def _owner(d: Path) -> dict[str, str] | None:
    try:
        raw = json.loads((d / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str)
                                            for k in ("state_dir", "image")):
        return None
    return {k: raw[k] for k in ("state_dir", "image")}


def _age(d: Path, now: float) -> float:
    """Seconds since anything in d last changed (its newest mtime)."""
    times = [d.stat().st_mtime]
    for p in d.iterdir():
        with contextlib.suppress(OSError):
            times.append(p.stat().st_mtime)
    return now - max(times)


def collect(state_dir: Path, live: set[str], max_age: float | None = None,
            now: float | None = None) -> list[Path]:
    """Remove the directories of SNAPSHOT_DIR no sandbox can resume from:
    this node's (their owner record names `state_dir`) whose sandbox is not
    in `live`; another node's whose sandbox that node no longer records
    (<its state_dir>/sandboxes/<id>); pack directories older than PACK_GRACE
    (a store snapshot cut short); with `max_age`, any other unchanged for
    longer (those without an owner record: written by older code). Never one
    of `live` (this node's sandboxes, paused ones included, and those a
    tagged snapshot image names) nor one another node still records. A
    snapshot is resumed only by its own sandbox, so whether that sandbox
    exists decides, not whether its image is still tagged. Returns what was
    removed."""
    root = snapshot_dir()
    now = time.time() if now is None else now
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    mine = str(state_dir.resolve())
    for d in sorted(root.iterdir()):
        if d.is_symlink() or not d.is_dir():
            continue
        sandbox_id, pack, _ = d.name.partition(PACK)
        if sandbox_id in live:
            continue
        owner = None if pack else _owner(d)
        if owner is not None and owner["state_dir"] != mine and \
                (Path(owner["state_dir"]) / "sandboxes" / sandbox_id / "sandbox.json").exists():
            continue  # another node's sandbox (maybe paused): its node decides
        try:
            age = _age(d, now)
        except OSError:
            continue
        why = ("a store snapshot's pack cut short" if pack and age > PACK_GRACE
               else "its sandbox is gone" if owner is not None
               else f"unused {age:.0f}s" if max_age is not None and age > max_age else None)
        if why is None:
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            log.info("collected the VM snapshot %s (%s)", d, why)
            removed.append(d)
    return removed


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
    root = snapshot_dir()
    shutil.rmtree(root / sandbox_id, ignore_errors=True)
    if root.is_dir():  # (links a snapshot into the store was packing from)
        for d in root.glob(f"{sandbox_id}-pack-*"):
            shutil.rmtree(d, ignore_errors=True)
