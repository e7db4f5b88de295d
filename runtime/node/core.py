"""The node's runtime: every sandbox on this machine, whichever its backend.

It hands out ids, resolves each sandbox's image name once, at create (the
sandbox runs that digest for its whole life, whatever the tag names later:
SandboxInfo.image_digest), keeps one JSON state file per sandbox (its info,
its resolved image and its backend's typed state, so a restarted node agent
finds its sandboxes again: Node.recovery), enforces the node's quota
(Node.admission) and each sandbox's timeout and idle timeout (Node.reaper),
refuses calls a backend cannot do (Unsupported) or that do not fit the state
(exec while paused), and turns limit kills into typed errors with the result.

Synchronous and thread-safe: the node agent and AsyncSandbox call it from
worker threads; the embedded SDK calls it directly. A node left open is
closed when the interpreter exits; what a killed one left (fncall workers'
cgroups and mounts) the next node start sweeps.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..api import Labels, Progress, SandboxApi, Sink
from ..backends import Backend, Handle, capabilities, make_backend
from ..backends.base import Eventful, Networked, Readable, Signaller
from ..config import RuntimeConfig
from ..errors import (
    BackendUnavailable,
    InvalidSpec,
    SandboxError,
    SandboxNotFound,
    SandboxPreempted,
    SandboxStateError,
    Unsupported,
)
from ..files import FileInfo, SandboxFiles, remove_dir
from ..fleet.records import sandbox_id as fleet_sandbox_id
from ..images import Images
from ..isolation import cgroups, hostlimits
from ..spec import (
    BackgroundExec,
    CheckpointInfo,
    ExecRequest,
    ExecResult,
    Forked,
    NetworkPolicy,
    PreemptedSandbox,
    ReadLedger,
    ResolvedImage,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
    VerifyRequest,
)
from .admission import Admission
from .background import Background
from .bulk import Bulk
from .capture import Captures
from .execs import checked
from .preempt import PreemptedSandboxes
from .preemption import Preemption
from .reaping import Reaper
from .recovery import Recovery
from .snapshots import Snapshots

log = logging.getLogger("runtime.node")


def _matches(labels: Mapping[str, str], want: Mapping[str, str] | None) -> bool:
    return not want or all(labels.get(k) == v for k, v in want.items())


class Node(SandboxApi):
    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config or RuntimeConfig()
        self.images = Images(self.config)
        self.captures = Captures(self.config, self.images)
        self.preempted = PreemptedSandboxes(self.config, self.images)
        self._backends: dict[str, Backend] = {}
        self._lock = threading.RLock()
        self._sandboxes: dict[str, tuple[SandboxInfo, Handle[Any]]] = {}
        self._busy: dict[str, int] = {}  # running execs per sandbox
        self.config.sandboxes.mkdir(parents=True, exist_ok=True)
        os.chmod(self.config.state_dir, 0o700)
        self._lockfile = _lock_state(self.config.state_dir)
        self.admission = Admission(self.config)
        self.snapshots = Snapshots(self)
        self.preemption = Preemption(self)
        self.recovery = Recovery(self)
        self.reaper = Reaper(self)
        self.bulk = Bulk(self)
        self.background = Background(self)
        # ids of sandboxes being restored (a restore brings back a known id):
        # a kill of one waits for its restore, then stops what it made
        self._restoring: dict[str, threading.Event] = {}
        # events of killed sandboxes, by kind (denial_counts)
        self._killed_events: dict[str, int] = {}
        self._sandbox_locks: dict[str, threading.Lock] = {}
        # A script that never closes its node (the embedded SDK's, typically)
        # must not leave fncall workers, their cgroups and root mounts
        # behind: close at interpreter exit if still open. (Killed, it
        # cannot; the next node start sweeps: fncall.sweep in recover().)
        self._at_exit = weakref.finalize(self, _close_at_exit, weakref.ref(self))
        hostlimits.raise_own_open_files()
        if os.geteuid() == 0:
            hostlimits.prepare_host(self.config.max_sandboxes, self.config.budgets)
        if self.config.favor_dynmods and os.geteuid() == 0 and \
                (changed := cgroups.favor_dynamic_modifications()):
            log.info("cgroup favordynmods turned on (%s): a sandbox's cgroup "
                     "moves no longer wait for an RCU grace period", changed)
        self.recovery.recover()

    # -- plumbing ------------------------------------------------------------
    def backend(self, name: str) -> Backend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = make_backend(name, self.config, self.images)
            return self._backends[name]

    def _save(self, info: SandboxInfo, h: Handle[Any]) -> None:
        f = self.config.sandboxes / info.id / "sandbox.json"
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps({"info": info.model_dump(mode="json"),
                                   "image": h.image.model_dump(mode="json"),
                                   "state": h.state.model_dump(mode="json")}))
        os.replace(tmp, f)

    def _get(self, sandbox_id: str) -> tuple[SandboxInfo, Handle[Any]]:
        with self._lock:
            try:
                return self._sandboxes[sandbox_id]
            except KeyError:
                raise SandboxNotFound(f"no sandbox {sandbox_id!r} on this node") from None

    def _require(self, info: SandboxInfo, op: str) -> Backend:
        caps = capabilities(info.spec.backend)
        if op not in caps:
            raise Unsupported(f"the {info.spec.backend} backend does not support {op} "
                              f"(Sandbox.capabilities({info.spec.backend!r}))")
        return self.backend(info.spec.backend)

    def _touch(self, info: SandboxInfo, h: Handle[Any], **changes: Any) -> SandboxInfo:
        """Record activity (in memory: an exec must not cost a file write) and
        state changes (on disk too)."""
        new = info.model_copy(update={"last_active": time.time(), **changes})
        with self._lock:
            if info.id in self._sandboxes:
                self._sandboxes[info.id] = (new, h)
                if changes:
                    self._save(new, h)
        return new

    # -- lifecycle -----------------------------------------------------------
    def create(self, spec: SandboxSpec, progress: Progress | None = None) -> SandboxInfo:
        """A new sandbox; `progress` is told each long step of the create
        (VM backends: building an image's pmem metadata, booting),
        from the calling thread."""
        return self._create(spec, progress=progress)

    def _create(self, spec: SandboxSpec, sandbox_id: str | None = None,
                created: float | None = None,
                start: Callable[[Backend, Handle[Any]], None] | None = None,
                progress: Progress | None = None) -> SandboxInfo:
        """A new sandbox, brought up by `start` (default: the backend's
        create; a checkpoint's restore); `sandbox_id` and `created` given for
        one restored after a preemption."""
        backend = self.backend(spec.backend)
        with self._lock:  # (the count of live sandboxes and the reservation at once)
            token = self.admission.reserve(spec, len(self._sandboxes))
        made = False
        try:
            # the only time the name is looked up: backends get the digest
            if spec.network.mode == "allowlist" and \
                    "network_allowlist" not in capabilities(spec.backend):
                raise Unsupported(f"network: the {spec.backend} backend cannot enforce a network "
                                  "allowlist (it has no network at all; Sandbox.capabilities)")
            image = self.images.resolve_image(spec.image)
            if image.vm_state is not None and image.vm_state.backend != spec.backend:
                raise InvalidSpec(f"{spec.image} is the memory of a {image.vm_state.backend} "
                                  f"VM: create it with backend={image.vm_state.backend!r}")
            if spec.hidden:
                if "hidden" not in capabilities(spec.backend):
                    raise Unsupported(f"the {spec.backend} backend cannot hide paths "
                                      "(Sandbox.capabilities)")
                image = self.captures.hide(image, spec.hidden)
            sandbox_id = sandbox_id or fleet_sandbox_id(f"sb-{secrets.token_hex(8)}",
                                                        self.config.node_id)
            d = self.config.sandboxes / sandbox_id
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                raise SandboxStateError(f"{sandbox_id} already runs on this node") from None
            self.recovery.mark_if_due(d, sandbox_id)
            h = Handle(sandbox_id, spec, image, d, backend.state_type(), progress)
            try:
                if start is None:
                    backend.create(h)
                else:
                    start(backend, h)
            except BaseException:
                remove_dir(d)
                raise
            finally:
                h.progress = None  # the handle outlives the create; the callback does not
            info = SandboxInfo(id=sandbox_id, spec=spec, image_digest=image.digest,
                               state="running", host_address=h.state.host_address(),
                               node=os.uname().nodename,
                               **({"created": created} if created is not None else {}))
            with self._lock:
                self._sandboxes[sandbox_id] = (info, h)
                self._sandbox_locks[sandbox_id] = threading.Lock()
                self._save(info, h)
            made = True
        finally:
            if made:
                self.admission.made(token)
            else:
                self.admission.undone(token)
        log.info("created %s (%s, %s = %s)", sandbox_id, spec.backend, spec.image, image.digest)
        return info

    def census(self) -> list[tuple[SandboxInfo, ResolvedImage]]:
        """Every sandbox with the image it runs (for the fleet's load and
        image-locality reports)."""
        with self._lock:
            return [(i, h.image) for i, h in self._sandboxes.values()]

    def get(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox's info; SandboxPreempted when it waits in the image
        store to be restored (here or on another node)."""
        try:
            return self._get(sandbox_id)[0]
        except SandboxNotFound:
            record = self.preemption.record(sandbox_id)
            if record is None:
                raise
            raise SandboxPreempted(
                f"{sandbox_id} was preempted (its files are the snapshot {record.image}): "
                f"restore it (Sandbox.restore({sandbox_id!r}) or restore_many)") from None

    def list_sandboxes(self, labels: Labels = None) -> list[SandboxInfo]:
        with self._lock:
            return [i for i, _ in self._sandboxes.values() if _matches(i.spec.labels, labels)]

    def kill(self, sandbox_id: str) -> None:
        """Stop the sandbox and remove what it has on the node; a preempted
        one is discarded (its record and its snapshot's tag go); one being
        restored is stopped once its restore ends (not left running)."""
        with self._lock:
            restoring = self._restoring.get(sandbox_id)
        if restoring is not None:
            restoring.wait()
        try:
            info, h = self._get(sandbox_id)
        except SandboxNotFound:
            if self.preemption.discard(sandbox_id):
                return
            raise
        with self._lock:
            if self._sandboxes.pop(sandbox_id, None) is not None:
                self.admission.released(info.spec)
            self._sandbox_locks.pop(sandbox_id, None)
        backend = self.backend(info.spec.backend)
        if isinstance(backend, Eventful):  # its counts go with it: keep them in the totals
            try:
                final = backend.events(h)
            except (OSError, SandboxError) as e:
                log.warning("%s: could not read its events before the kill: %s", sandbox_id, e)
                final = []
            with self._lock:
                for ev in final:
                    self._killed_events[ev.kind] = self._killed_events.get(ev.kind, 0) + ev.count
        backend.kill(h)
        self.background.forget(sandbox_id)
        if h.dir.exists():  # (the container backend removes it itself)
            remove_dir(h.dir)
        log.info("killed %s", sandbox_id)

    def _state_lock(self, sandbox_id: str) -> threading.Lock:
        with self._lock:
            lock = self._sandbox_locks.setdefault(sandbox_id, threading.Lock())
        return lock

    def pause(self, sandbox_id: str) -> dict[str, Any]:
        with self._state_lock(sandbox_id):  # check and change as one step
            info, h = self._get(sandbox_id)
            if info.state == "paused":
                raise SandboxStateError(f"{sandbox_id} is already paused")
            figures = self._require(info, "pause").pause(h)
            self._touch(info, h, state="paused")
            return figures

    def resume(self, sandbox_id: str) -> None:
        with self._state_lock(sandbox_id):
            info, h = self._get(sandbox_id)
            if info.state != "paused":
                raise SandboxStateError(f"{sandbox_id} is not paused")
            self._require(info, "resume").resume(h)
            self._touch(info, h, state="running")

    def pause_many(self, labels: Labels, snapshot: bool = False) -> list[str]:
        return self.bulk.pause_many(labels, snapshot)

    def resume_many(self, labels: Labels) -> list[str]:
        return self.bulk.resume_many(labels)

    def kill_many(self, labels: Labels) -> list[str]:
        return self.bulk.kill_many(labels)

    # -- snapshots and preemption (runtime/node/snapshots.py, preemption.py) --
    def snapshot(self, sandbox_id: str, tag: str | None = None) -> SnapshotInfo:
        return self.snapshots.snapshot(sandbox_id, tag)

    def fork(self, sandbox_id: str, n: int) -> Forked:
        return self.snapshots.fork(sandbox_id, n)

    def checkpoint(self, sandbox_id: str, tag: str | None = None) -> CheckpointInfo:
        return self.snapshots.checkpoint(sandbox_id, tag)

    def restore_checkpoint(self, checkpoint: str, labels: Labels = None) -> SandboxInfo:
        return self.snapshots.restore_checkpoint(checkpoint, labels)

    def verify(self, sandbox_id: str, req: VerifyRequest) -> ExecResult:
        return self.snapshots.verify(sandbox_id, req)

    def preempt(self, sandbox_id: str) -> PreemptedSandbox:
        return self.preemption.preempt(sandbox_id)

    def restore(self, sandbox_id: str) -> SandboxInfo:
        return self.preemption.restore(sandbox_id)

    def restore_many(self, labels: Labels) -> list[str]:
        return self.preemption.restore_many(labels)

    def list_preempted(self, labels: Labels = None) -> list[PreemptedSandbox]:
        return self.preemption.records(labels)

    # -- exec and files ------------------------------------------------------
    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: Sink | None = None,
             on_stderr: Sink | None = None) -> ExecResult:
        return self.run_command(sandbox_id, req, on_stdout, on_stderr)

    def run_command(self, sandbox_id: str, req: ExecRequest, on_stdout: Sink | None = None,
                    on_stderr: Sink | None = None,
                    on_started: Callable[[Signaller], None] | None = None) -> ExecResult:
        """exec(); `on_started` gets its Signaller (a backend that can signal)."""
        info, h = self._get(sandbox_id)
        backend = self._require(info, "exec")
        if info.state == "paused":
            raise SandboxStateError(f"{sandbox_id} is paused: resume() it first")
        with self._lock:
            self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        try:
            r = backend.exec(h, req, on_stdout, on_stderr, on_started=on_started)
        finally:
            with self._lock:
                self._busy[sandbox_id] -= 1
                current = self._sandboxes.get(sandbox_id)  # a kill may have raced us
            if current is not None:
                self._touch(*current)
        return checked(r, req, info.spec.memory_mb)

    def exec_start(self, sandbox_id: str, req: ExecRequest) -> BackgroundExec:
        return self.background.start(sandbox_id, req)

    def wait(self, sandbox_id: str, exec_id: str, timeout: float | None = None) -> ExecResult:
        return self.background.wait(sandbox_id, exec_id, timeout)

    def signal(self, sandbox_id: str, exec_id: str, signal: int = 15) -> None:
        self.background.signal(sandbox_id, exec_id, signal)

    def files(self, sandbox_id: str, need: str = "files") -> SandboxFiles:
        info, h = self._get(sandbox_id)
        files = self._require(info, need).files(h)
        self._touch(info, h)
        return files

    def read(self, sandbox_id: str, path: str) -> bytes:
        return self.files(sandbox_id).read(path)

    def write(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files(sandbox_id).write(path, data, mode=mode)

    def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        self.files(sandbox_id).remove(path, recursive=recursive)

    def list_files(self, sandbox_id: str, path: str = "/") -> list[FileInfo]:
        return self.files(sandbox_id).list(path)

    def stat(self, sandbox_id: str, path: str) -> FileInfo:
        return self.files(sandbox_id).stat(path)

    def put_archive(self, sandbox_id: str, path: str, data: bytes, keep_owners: bool = False
                    ) -> None:
        self.files(sandbox_id, "archive").put_archive(path, data, keep_owners=keep_owners)

    def get_archive(self, sandbox_id: str, path: str) -> bytes:
        return self.files(sandbox_id, "archive").get_archive(path)

    def capabilities(self, backend: str) -> dict[str, Any]:
        return capabilities(backend).as_dict()

    def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        """Change a running sandbox's network policy (task phases: setup with
        a package mirror, the agent with none, ...); connections the new
        policy refuses are cut. Returns the sandbox's info with the policy."""
        with self._state_lock(sandbox_id):
            info, h = self._get(sandbox_id)
            backend = self._require(info, "network_allowlist")
            assert isinstance(backend, Networked), backend
            backend.set_network(h, policy)
            spec = info.spec.model_copy(update={"network": policy})
            new = self._touch(info, h, spec=spec, host_address=h.state.host_address())
        log.info("network of %s: %s", sandbox_id, policy.mode)
        return new

    def events(self, sandbox_id: str) -> list[SandboxEvent]:
        """What the sandbox was refused so far (runtime/isolation/denials.py)."""
        info, h = self._get(sandbox_id)
        backend = self._require(info, "events")
        assert isinstance(backend, Eventful), backend
        return backend.events(h)

    def reads(self, sandbox_id: str, trace: bool = False) -> ReadLedger:
        """What the sandbox read of its image so far (its root's figures in
        the node's lazyfs daemon; with trace, the first reads in order)."""
        info, h = self._get(sandbox_id)
        backend = self._require(info, "reads")
        assert isinstance(backend, Readable), backend
        return backend.reads(h, trace)

    def denial_counts(self) -> dict[str, int]:
        """Every event of this node's sandboxes, live and killed, by kind
        (the agent's lazyfs_sandbox_denials_total): read from each live
        sandbox's counters, so a scrape costs one events() per sandbox."""
        with self._lock:
            live = list(self._sandboxes.values())
            out = dict(self._killed_events)
        for info, h in live:
            backend = self.backend(info.spec.backend)
            if not isinstance(backend, Eventful):
                continue
            with contextlib.suppress(OSError, SandboxError):  # (going away meanwhile)
                for e in backend.events(h):
                    out[e.kind] = out.get(e.kind, 0) + e.count
        return out

    def close(self) -> None:
        """Stop the node's worker pools, and the lazyfs daemon it started
        once no sandbox is left. Container sandboxes stay (a new Node on the
        same state directory finds them, and the daemon serves them on);
        kill them first if they should go."""
        self._at_exit.detach()
        with self._lock:
            for b in self._backends.values():
                b.close()
            self._backends.clear()
        self.images.close(sandboxes=len(self._sandboxes))
        self.captures.close()
        if not self._sandboxes:
            cgroups.remove_parent()  # nothing of ours stays in the cgroup tree
        os.close(self._lockfile)


def _close_at_exit(ref: weakref.ref[Node]) -> None:
    node = ref()
    if node is not None:
        try:
            node.close()
        except Exception:  # exiting anyway: say what stayed, do not mask the exit
            log.exception("closing the node of %s at exit", node.config.state_dir)


def _lock_state(state_dir: Path) -> int:
    """One node process per state directory: two would clean up each
    other's creations under way and unmount each other's pools."""
    fd = os.open(state_dir / "node.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise BackendUnavailable(
            f"another node process (pid {owner or '?'}) owns {state_dir}: talk to its agent "
            f"(node=\"unix://{state_dir / 'agent.sock'}\") or use another state directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
