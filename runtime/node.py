"""The node's runtime: every sandbox on this machine, whichever its backend.

It hands out ids, resolves each sandbox's image name once, at create (the
sandbox runs that digest for its whole life, whatever the tag names later:
SandboxInfo.image_digest), keeps one JSON state file per sandbox (its info,
its resolved image and its backend's typed state, so a restarted node agent
finds its sandboxes again: `recover()`), enforces the node's quota and
each sandbox's timeout and idle timeout (`reap()`), refuses calls a backend
cannot do (Unsupported) or that do not fit the state (exec while paused), and
turns limit kills into typed errors carrying the partial result.

Synchronous and thread-safe: the node agent and AsyncSandbox call it from
worker threads; the embedded SDK calls it directly. A node left open is
closed when the interpreter exits; what a killed one left (fncall workers'
cgroups and mounts) the next node start sweeps.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from chunkstore.errors import LazyfsError

from . import cgroups, hostlimits
from .api import Labels, Progress, SandboxApi, Sink
from .backends import Backend, Handle, capabilities, make_backend
from .backends.base import (
    Capturing,
    Checkpointing,
    Eventful,
    GuestCapturing,
    Networked,
    Readable,
    StateSaving,
)
from .backends.criu import CRIU_VERSION
from .capture import MEMORY_CHUNK_SIZE, Captures, Packed
from .config import RuntimeConfig
from .errors import (
    BackendUnavailable,
    ExecStatusUnknown,
    ExecTimeout,
    InvalidSpec,
    OutOfMemory,
    OutputTruncated,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    SandboxPreempted,
    SandboxStateError,
    Unsupported,
)
from .files import FileInfo, SandboxFiles, remove_tree
from .fleet.records import sandbox_id as fleet_sandbox_id
from .images import Images
from .preempt import PreemptedSandboxes
from .spec import (
    VERIFIER_LABEL,
    VM_STATE_KEY,
    CheckpointInfo,
    ExecRequest,
    ExecResult,
    Forked,
    NetworkPolicy,
    PreemptedSandbox,
    Qos,
    ReadLedger,
    ResolvedImage,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
    VerifyRequest,
    parse,
)

log = logging.getLogger(__name__)


KILL_WORKERS = 8  # kill_many's parallel kills
WATCHED = ("microvm", "vm")  # backends whose status is a cheap process check
# The image of a creation cut short, which the state file never recorded:
# cleaning one up needs only its id and directory.
_NO_IMAGE = ResolvedImage.model_construct(name="-", digest="-", layers=())


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
        # creations under way, counted against the quota and admission
        self._pending: dict[object, SandboxSpec] = {}
        # ids of sandboxes being restored (a restore brings back a known id):
        # a kill of one waits for its restore, then stops what it made
        self._restoring: dict[str, threading.Event] = {}
        self._asked = {q: 0 for q in Qos}  # memory_mb asked, per QoS class
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
        if self.config.favor_dynmods and os.geteuid() == 0:
            changed = cgroups.favor_dynamic_modifications()
            if changed:
                log.info("cgroup favordynmods turned on (%s): a sandbox's cgroup "
                         "moves no longer wait for an RCU grace period", changed)
        self.recover()

    # -- plumbing ------------------------------------------------------------
    def backend(self, name: str) -> Backend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = make_backend(name, self.config, self.images)
            return self._backends[name]

    def _state_file(self, sandbox_id: str) -> Path:
        return self.config.sandboxes / sandbox_id / "sandbox.json"

    def _save(self, info: SandboxInfo, h: Handle[Any]) -> None:
        f = self._state_file(info.id)
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
        with self._lock:  # creations under way count, so a burst cannot overshoot
            if len(self._sandboxes) + len(self._pending) >= self.config.max_sandboxes:
                raise QuotaExceeded(f"this node holds its maximum of "
                                    f"{self.config.max_sandboxes} sandboxes")
            self._admit(spec)
            token = object()
            self._pending[token] = spec
            self._asked[spec.qos] += spec.memory_mb
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
            h = Handle(sandbox_id, spec, image, d, backend.state_type(), progress)
            try:
                if start is None:
                    backend.create(h)
                else:
                    start(backend, h)
            except BaseException:
                _remove(d)
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
            with self._lock:
                del self._pending[token]
                if not made:
                    self._asked[spec.qos] -= spec.memory_mb
        log.info("created %s (%s, %s = %s)", sandbox_id, spec.backend, spec.image, image.digest)
        return info

    def _admit(self, spec: SandboxSpec) -> None:
        """The node's final say (called under the lock) when it has a memory
        budget: the memory asked by the sandboxes of spec's QoS class, this
        one included, must fit in the budget times that class's overcommit
        (best-effort sandboxes count against their own, larger allowance).
        Running totals, not a scan: a full node admits as fast as an empty one."""
        if self.config.memory_mb is None:
            return
        factor = (self.config.overcommit_best_effort if spec.qos == Qos.best_effort
                  else self.config.overcommit_latency)
        asked = self._asked[spec.qos] + spec.memory_mb
        if asked > self.config.memory_mb * factor:
            raise QuotaExceeded(
                f"this node admits {self.config.memory_mb * factor:.0f} MB of "
                f"{spec.qos.value} sandboxes' memory ({self.config.memory_mb} MB x "
                f"overcommit {factor:g}); {asked} MB would be asked")

    def asked(self) -> dict[Qos, int]:
        """Memory (MB) asked by the sandboxes of each QoS class, creations
        under way included."""
        with self._lock:
            return dict(self._asked)

    def memory_capacity_mb(self) -> int:
        """The memory this node gives its sandboxes (config, else the host's)."""
        if self.config.memory_mb is not None:
            return self.config.memory_mb
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20)

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
            record = self._preempted_record(sandbox_id)
            if record is None:
                raise
            raise SandboxPreempted(
                f"{sandbox_id} was preempted (its files are the snapshot {record.image}): "
                f"restore it (Sandbox.restore({sandbox_id!r}) or restore_many)") from None

    def _preempted_record(self, sandbox_id: str) -> PreemptedSandbox | None:
        try:
            return self.preempted.get(sandbox_id)
        except InvalidSpec:  # not even an id: not found
            return None

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
            if self._discard_preempted(sandbox_id):
                return
            raise
        with self._lock:
            if self._sandboxes.pop(sandbox_id, None) is not None:
                self._asked[info.spec.qos] -= info.spec.memory_mb
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
        if h.dir.exists():  # (the container backend removes it itself)
            _remove(h.dir)
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

    def pause_many(self, labels: Mapping[str, str] | None, snapshot: bool = False
                   ) -> list[str]:
        """Pause the running sandboxes with these labels; with `snapshot`,
        preempt every one with them instead (see preempt)."""
        if snapshot:
            return [r.id for r in self.preempt_many(labels)]
        done = []
        for info in self.list_sandboxes(labels):
            if info.state == "running":
                self.pause(info.id)
                done.append(info.id)
        return done

    def resume_many(self, labels: Mapping[str, str] | None) -> list[str]:
        done = []
        for info in self.list_sandboxes(labels):
            if info.state == "paused":
                self.resume(info.id)
                done.append(info.id)
        return done

    def kill_many(self, labels: Mapping[str, str] | None) -> list[str]:
        """Kill every sandbox with these labels, KILL_WORKERS at a time (a
        kill mostly waits: on runc, on init's death, on rm). A failing kill
        does not stop the others; the first failure is raised at the end."""
        ids = [i.id for i in self.list_sandboxes(labels)]
        failures: list[BaseException] = []

        def one(sandbox_id: str) -> None:
            try:
                self.kill(sandbox_id)
            except SandboxNotFound:
                pass
            except (SandboxError, OSError) as e:  # the others still go; raised below
                log.warning("killing %s failed: %s", sandbox_id, e)
                failures.append(e)

        if len(ids) <= 1:
            for sandbox_id in ids:
                one(sandbox_id)
        else:
            with ThreadPoolExecutor(min(KILL_WORKERS, len(ids)),
                                    thread_name_prefix="kill_many") as pool:
                list(pool.map(one, ids))
        if failures:
            raise failures[0]
        return ids

    # -- snapshot, fork, verify ---------------------------------------------
    def _capturing(self, info: SandboxInfo, op: str) -> Capturing:
        backend = self._require(info, op)
        if not isinstance(backend, Capturing):
            raise Unsupported(f"the {info.spec.backend} backend cannot {op} a sandbox's files "
                              "apart from its memory (Sandbox.capabilities)")
        return backend

    def _pack(self, sandbox_id: str, op: str) -> tuple[SandboxInfo, Handle[Any], Packed,
                                                        float]:
        """The sandbox's upper packed with its processes stopped: (info,
        handle, the packed layer, seconds frozen)."""
        with self._state_lock(sandbox_id):  # no pause/resume meanwhile
            info, h = self._get(sandbox_id)
            backend = self._capturing(info, op)
            rules = backend.capture_rules(h) if isinstance(backend, GuestCapturing) else None
            with backend.capture(h) as upper:
                t0 = time.monotonic()
                packed = self.captures.pack(sandbox_id, upper, op, ids=h.state.host_ids(),
                                            rules=rules)
                frozen = time.monotonic() - t0
        self._touch(info, h)
        return info, h, packed, frozen

    def snapshot(self, sandbox_id: str, tag: str | None = None) -> SnapshotInfo:
        """The sandbox's files as an image (its layers + its upper packed),
        committed under `tag` (default snapshots/<id>:<n>)."""
        started = time.monotonic()
        if isinstance(self._require(self._get(sandbox_id)[0], "snapshot"), StateSaving):
            return self._vm_snapshot(sandbox_id, tag, resume=True)[0]
        _, h, packed, frozen = self._pack(sandbox_id, "snapshot")
        snap = self.captures.snapshot(sandbox_id, h.image, packed, tag=tag,
                                      frozen_s=frozen, started=started)
        log.info("snapshot of %s: %s (%d entries, %d bytes new, frozen %.3fs)", sandbox_id,
                 snap.image, snap.entries, snap.bytes_new, frozen)
        return snap

    def _vm_snapshot(self, sandbox_id: str, tag: str | None, *, resume: bool
                     ) -> tuple[SnapshotInfo, dict[str, Any]]:
        """A VM's memory and device state as an image in the store (its top
        layer the state, chunked and deduplicated like CRIU's images): the
        VM is paused into a file (its VMM exits) and resumed from it
        (`resume`) or left paused, and the file packed. (info, the pause's
        figures)."""
        started = time.monotonic()
        if tag is not None:
            self.captures.check_tag(tag, "snapshot")
        with self._state_lock(sandbox_id):  # no pause/resume meanwhile
            info, h = self._get(sandbox_id)
            backend = self._require(info, "snapshot")
            assert isinstance(backend, StateSaving), backend
            t0 = time.monotonic()
            running = info.state != "paused"
            state, figures = backend.save_state(h)
            # packed from a link of its own: the VM runs on meanwhile (a
            # resume loads the file and removes its name)
            kept = state.parent.with_name(f"{state.parent.name}-pack-{secrets.token_hex(4)}")
            kept.mkdir(mode=0o700)
            try:
                os.link(state, kept / state.name)
                try:
                    if running and resume:
                        self.backend(info.spec.backend).resume(h)
                finally:
                    if running and (not resume or
                                    self.backend(info.spec.backend).status(h) == "paused"):
                        info = self._touch(info, h, state="paused")  # (a resume that failed)
                frozen = time.monotonic() - t0
                packed = self.captures.pack(sandbox_id, kept, "vm-state", MEMORY_CHUNK_SIZE)
            finally:
                remove_tree(kept)
            record = backend.state_record(h, str(packed.manifest.digest))
        snap = self.captures.vm_snapshot(sandbox_id, h.image, packed, record, tag=tag,
                                         frozen_s=frozen, started=started)
        self._touch(info, h)
        log.info("VM snapshot of %s: %s (%d bytes, %d new, stopped %.3fs)", sandbox_id,
                 snap.image, snap.bytes, snap.bytes_new, frozen)
        return snap, figures

    def fork(self, sandbox_id: str, n: int) -> Forked:
        """n sandboxes from the current files of one (one capture), each with
        its own writable layer and identity (hostname = its id; the image's
        /etc/hostname, /etc/machine-id and random-seed files made anew)."""
        if not 1 <= n <= 1024:
            raise SandboxStateError(f"fork of {n}: between 1 and 1024 at a time")
        info = self.get(sandbox_id)
        if isinstance(self._require(info, "snapshot"), StateSaving):
            raise Unsupported(f"the {info.spec.backend} backend cannot fork: a copy of a VM's "
                              "memory shares its kernel's identity (hostname, random state); "
                              "snapshot() it and create one sandbox of the snapshot")
        snap = self.snapshot(sandbox_id)
        spec = info.spec.model_copy(update={"image": snap.image})
        children: list[SandboxInfo] = []
        try:
            for _ in range(n):
                child = self.create(spec)
                children.append(child)
                _fresh_identity(self.files(child.id), child.id)
        except BaseException:
            for c in children:
                self.kill(c.id)
            raise
        return Forked(snapshot=snap, children=children)

    def checkpoint(self, sandbox_id: str, tag: str | None = None) -> CheckpointInfo:
        """The sandbox's processes (CRIU) and files (its upper packed, as a
        snapshot) at one instant, stored in the image store; the sandbox
        runs on. Raises NotCheckpointable (naming CRIU's reason) when a
        process cannot be saved; the sandbox is left as it was."""
        started = time.monotonic()
        if self.config.cluster:
            raise Unsupported("checkpoints with a cluster store are not built yet (the memory "
                              "layer and record would need a push; use a local store)")
        if tag is not None:
            self.captures.check_tag(tag, "checkpoint")
        with self._state_lock(sandbox_id):  # no pause/resume meanwhile
            info, h = self._get(sandbox_id)
            backend = self._require(info, "checkpoint")
            assert isinstance(backend, Checkpointing), backend
            with self._lock:
                if self._busy.get(sandbox_id):
                    raise SandboxStateError(
                        f"a command is running in {sandbox_id}: checkpoint between commands "
                        "(a running command's pipes lead out of the sandbox, to the caller)")
            images = h.dir / "checkpoint"
            files: Packed | None = None
            try:
                t0 = time.monotonic()
                with backend.checkpoint(h, images) as upper:
                    dumped = time.monotonic()
                    files = self.captures.pack(sandbox_id, upper, "checkpoint",
                                               ids=h.state.host_ids())
                frozen = time.monotonic() - t0
                memory = self.captures.pack(sandbox_id, images, "checkpoint-memory",
                                            MEMORY_CHUNK_SIZE)
            except BaseException:
                if files is not None:
                    files.close()
                raise
            finally:
                with self._lock:  # the exec channel may have moved
                    if sandbox_id in self._sandboxes:
                        self._save(info, h)
                remove_tree(images)
            record = {"spec": info.spec.model_dump(mode="json"), "sandbox_id": sandbox_id,
                      "channel_name": h.state.channel_name, "criu": CRIU_VERSION,
                      "id_base": h.state.id_base}
            ckpt = self.captures.checkpoint(
                sandbox_id, h.image, files, memory, record=record, tag=tag,
                dump_s=dumped - t0, frozen_s=frozen, started=started)
        self._touch(info, h)
        log.info("checkpoint of %s: %s (memory %d bytes, %d new; frozen %.3fs)", sandbox_id,
                 ckpt.id, ckpt.memory_bytes, ckpt.memory_bytes_new, frozen)
        return ckpt

    def restore_checkpoint(self, checkpoint: str, labels: Mapping[str, str] | None = None
                           ) -> SandboxInfo:
        """A new sandbox from a checkpoint (its id or tag): the checkpoint's
        files under a fresh writable layer, its processes restored where
        they were. `labels` replace the checkpointed sandbox's when given."""
        with tempfile.TemporaryDirectory(dir=self.config.sandboxes) as tmp:
            staged = Path(tmp) / "images"
            record = self.captures.load_checkpoint(checkpoint, staged)
            update: dict[str, Any] = {"image": record.files}
            if labels is not None:
                update["labels"] = dict(labels)
            spec = record.spec.model_copy(update=update)

            def start(backend: Backend, h: Handle[Any]) -> None:
                if not isinstance(backend, Checkpointing):
                    raise Unsupported(f"the {spec.backend} backend cannot restore checkpoints")
                images = h.dir / "checkpoint"
                os.replace(staged, images)
                h.state.channel_name = record.channel_name
                h.state.id_base = record.id_base  # CRIU restores the dumped id map
                try:
                    backend.restore(h, images)
                finally:
                    remove_tree(images)

            info = self._create(spec, start=start)
        log.info("restored %s from checkpoint %s", info.id, checkpoint)
        return info

    def verify(self, sandbox_id: str, req: VerifyRequest) -> ExecResult:
        """Run `req.exec` in a fresh sandbox made from this one's current files
        (all of its writable layer, or what is under `req.keep`) over its image,
        with the hidden paths shown, no network and no process of this
        sandbox's: what a grader can trust."""
        info, h, packed, _ = self._pack(sandbox_id, "verify")
        digest, tag = self.captures.verifier_image(sandbox_id, h.image, info.spec.hidden,
                                                   packed, req.keep)
        spec = info.spec.model_copy(update={
            "image": digest, "hidden": (), "network": NetworkPolicy.none(),
            "labels": {VERIFIER_LABEL: sandbox_id}, "idle_timeout": None,
            "timeout": max(60.0, req.exec.timeout + 60.0)})
        try:
            verifier = self.create(spec)
            try:
                return self.exec(verifier.id, req.exec)
            finally:
                self.kill(verifier.id)
        finally:
            self.captures.remove_tag(tag)

    # -- preemption ----------------------------------------------------------
    def preempt(self, sandbox_id: str) -> PreemptedSandbox:
        """Pause the sandbox, snapshot it (tag preempted/<id>), record it
        (spec, labels, snapshot: runtime.preempt) and stop it: its memory and
        its writable layer on disk go back to the node. restore() makes it again,
        with the same id, on any node that sees the same image store."""
        info, _ = self._get(sandbox_id)
        was = info.state
        if isinstance(self._require(info, "snapshot"), StateSaving):
            # the VM's memory (its upper with it) goes into the store; its VMM exits
            try:
                snap, figures = self._vm_snapshot(sandbox_id, f"preempted/{sandbox_id}",
                                                  resume=False)
            except BaseException:
                if was != "paused" and self.get(sandbox_id).state == "paused":
                    self.resume(sandbox_id)
                raise
            memory, written = int(figures.get("vmm_pss_before", 0)), 0
        else:
            memory, written, snap = self._preempt_files(sandbox_id, was)
        info, _ = self._get(sandbox_id)
        record = PreemptedSandbox(
            id=sandbox_id, spec=info.spec, image=snap.image, tag=snap.tag,
            image_digest=info.image_digest, state="paused" if was == "paused" else "running",
            created=info.created, preempted=time.time(), node=info.node, memory_bytes=memory,
            disk_bytes=written, snapshot=snap)
        self.preempted.put(record)  # after its image is tagged, before the sandbox goes
        try:
            self.kill(sandbox_id)
        except BaseException:
            self.preempted.delete(sandbox_id)  # it still runs here: not preempted
            raise
        log.info("preempted %s: snapshot %s, %d MB of memory and %d MB of disk freed",
                 sandbox_id, snap.image, memory >> 20, record.disk_bytes >> 20)
        return record

    def _preempt_files(self, sandbox_id: str, was: str) -> tuple[int, int, SnapshotInfo]:
        """A container's part of preempt: paused, its upper snapshotted;
        (memory used, bytes of its upper, the snapshot)."""
        info, _ = self._get(sandbox_id)
        backend = self._capturing(info, "snapshot")
        if was == "paused":
            memory = cgroups.memory_figures(sandbox_id)["usage"]
        else:  # frozen from here on: nothing it writes after the snapshot is lost
            memory = self.pause(sandbox_id)["before"]["usage"]
        try:
            snap = self.snapshot(sandbox_id, tag=f"preempted/{sandbox_id}")
        except BaseException:
            if was != "paused":
                self.resume(sandbox_id)
            raise
        _, h = self._get(sandbox_id)
        with backend.capture(h) as upper:  # still frozen: no thaw in between
            written = _disk_usage(upper)  # a tmpfs upper's are memory too
        return memory, written, snap

    def preempt_many(self, labels: Mapping[str, str] | None) -> list[PreemptedSandbox]:
        """Preempt every sandbox with these labels (running or paused).
        Unsupported, before any is touched, if one's backend cannot snapshot."""
        infos = self.list_sandboxes(labels)
        for info in infos:
            self._require(info, "snapshot")
        return [self.preempt(info.id) for info in infos]

    def list_preempted(self, labels: Labels = None) -> list[PreemptedSandbox]:
        """The records of preempted sandboxes with these labels (every
        node's, with a cluster store)."""
        return self.preempted.list(labels)

    def restore(self, sandbox_id: str) -> SandboxInfo:
        """The preempted sandbox `sandbox_id` running again on this node:
        same id, spec and labels, its files from the snapshot (a process
        state is not kept: it starts afresh, running). Its lifetime goes on
        from where it was preempted (the time preempted does not count).
        A kill of it meanwhile waits for this to end (runtime.node.kill)."""
        done = threading.Event()
        with self._lock:
            if sandbox_id in self._restoring:
                raise SandboxStateError(f"{sandbox_id} is being restored on this node")
            self._restoring[sandbox_id] = done
        try:
            record = self.preempted.get(sandbox_id)
            if record is None:
                if sandbox_id in self._sandboxes:
                    raise SandboxStateError(f"{sandbox_id} runs on this node: not preempted")
                raise SandboxNotFound(f"no preempted sandbox {sandbox_id!r} "
                                      f"in {self.config.cluster or self.config.state_dir}")
            # one restorer per record, across nodes: the others get RestoreConflict
            claim = self.preempted.claim(sandbox_id, f"{os.uname().nodename}:"
                                         f"{self.config.node_id or self.config.state_dir}")
            try:
                if self.preempted.get(sandbox_id) is None:  # restored by an earlier claim
                    raise SandboxNotFound(f"{sandbox_id} was restored meanwhile "
                                          "(not preempted)")
                spec = record.spec.model_copy(update={"image": record.image})
                info = self._create(spec, sandbox_id=record.id,
                                    created=time.time() - (record.preempted - record.created))
                self.preempted.delete(sandbox_id)
            finally:
                self.preempted.release(sandbox_id, claim)
        finally:
            with self._lock:
                del self._restoring[sandbox_id]
            done.set()
        try:  # the snapshot is the running sandbox's image now; the tag may go
            self.captures.remove_tag(record.tag)
        except (SandboxError, LazyfsError) as e:
            log.warning("restored %s; its snapshot tag %s stays: %s", sandbox_id, record.tag, e)
        log.info("restored %s from %s (preempted on %s)", sandbox_id, record.image, record.node)
        return info

    def _discard_preempted(self, sandbox_id: str) -> bool:
        record = self._preempted_record(sandbox_id)
        if record is None:
            return False
        self.preempted.delete(sandbox_id)
        try:
            self.captures.remove_tag(record.tag)
        except (SandboxError, LazyfsError) as e:
            log.warning("discarded %s; its snapshot tag %s stays: %s", sandbox_id, record.tag, e)
        log.info("discarded the preempted sandbox %s", sandbox_id)
        return True

    def restore_many(self, labels: Mapping[str, str] | None) -> list[str]:
        """Restore every preempted sandbox with these labels on this node."""
        return [self.restore(r.id).id for r in self.preempted.list(labels)]

    # -- exec and files ------------------------------------------------------
    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: Sink | None = None,
             on_stderr: Sink | None = None) -> ExecResult:
        info, h = self._get(sandbox_id)
        backend = self._require(info, "exec")
        if info.state == "paused":
            raise SandboxStateError(f"{sandbox_id} is paused: resume() it first")
        with self._lock:
            self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        try:
            r = backend.exec(h, req, on_stdout, on_stderr)
        finally:
            with self._lock:
                self._busy[sandbox_id] -= 1
                current = self._sandboxes.get(sandbox_id)  # a kill may have raced us
            if current is not None:
                self._touch(*current)
        what = " ".join(req.cmd)[:200]
        if r.status_unknown:
            raise ExecStatusUnknown(f"{what!r}: its exit status is unknown (the guest agent "
                                    "could not reap it; a process of it may be left)", r)
        if r.timed_out:
            raise ExecTimeout(f"{what!r} ran past its {req.timeout:g}s timeout; its "
                              "processes were killed", r)
        if r.truncated:
            raise OutputTruncated(f"{what!r} printed more than {req.max_output_bytes} bytes "
                                  "on a stream; it was killed", r)
        if r.oom_killed:
            raise OutOfMemory(f"{what!r} was killed: the sandbox hit its memory limit of "
                              f"{info.spec.memory_mb} MB", r)
        return r

    def files(self, sandbox_id: str) -> SandboxFiles:
        info, h = self._get(sandbox_id)
        files = self._require(info, "files").files(h)
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
        """What the sandbox was refused so far (runtime/denials.py)."""
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
            try:
                events = backend.events(h)
            except (OSError, SandboxError):
                continue  # going away meanwhile
            for e in events:
                out[e.kind] = out.get(e.kind, 0) + e.count
        return out

    # -- timeouts and restarts -----------------------------------------------
    def reap(self, now: float | None = None) -> list[str]:
        """Kill sandboxes past their lifetime or idle for longer than their
        idle timeout (a running exec keeps a sandbox from being idle), and
        clean up those whose VMM died under them (a process check; container
        states would cost a runc call each, so they are checked on use)."""
        now = time.time() if now is None else now
        expired = []
        with self._lock:
            entries = list(self._sandboxes.values())
        for info, h in entries:
            s = info.spec
            if s.timeout is not None and now - info.created > s.timeout:
                expired.append((info.id, "timeout"))
            elif (s.idle_timeout is not None and not self._busy.get(info.id)
                  and now - info.last_active > s.idle_timeout):
                expired.append((info.id, "idle timeout"))
            elif (info.state == "running" and s.backend in WATCHED
                  and self.backend(s.backend).status(h) == "stopped"):
                expired.append((info.id, "its VM exited"))
        for sandbox_id, why in expired:
            try:
                self.kill(sandbox_id)
                log.info("reaped %s (%s)", sandbox_id, why)
            except SandboxNotFound:
                pass
            except SandboxError as e:
                log.warning("reaping %s failed: %s", sandbox_id, e)
        return [i for i, _ in expired]

    def recover(self) -> None:
        """Load the sandboxes a previous node process left; those whose
        backend no longer runs them are cleaned up."""
        from .backends.fncall import sweep
        sweep(self.config)
        self.captures.sweep()
        self._sweep_vm_caches()
        for f in sorted(self.config.sandboxes.glob("*/sandbox.json")):
            try:
                self._recover_one(f)
            except Exception:  # one broken sandbox must not keep the node from starting
                log.exception("cannot recover %s; left for the next start", f.parent.name)
        for d in self.config.sandboxes.iterdir():  # creations cut short
            if not (d / "sandbox.json").exists() and d.name not in self._sandboxes:
                backend = self.backend("container")
                h = Handle(d.name, SandboxSpec(image="-"), _NO_IMAGE, d, backend.state_type())
                try:
                    backend.kill(h)
                except Exception:
                    log.exception("cleaning up the cut-short creation %s", d.name)
                    _remove(d)

    def _vm_cache_dirs(self) -> list[Path]:
        """The VM backends' node-wide cache directories (their pmem images)."""
        from .backends.microvm import MicrovmBackend
        from .backends.vm import VmBackend
        mvm, vm = self.backend("microvm"), self.backend("vm")
        assert isinstance(mvm, MicrovmBackend) and isinstance(vm, VmBackend)
        return list(dict.fromkeys([mvm.pmem_cache, vm.pmem_cache]))

    def _sweep_vm_caches(self) -> None:
        """What VM image builds cut short by a node that died left in the
        caches (runtime/guest/caches.py): temporary files."""
        from .guest import caches
        try:
            caches.sweep(self._vm_cache_dirs())
        except (OSError, SandboxError) as e:  # a broken cache must not keep the node from starting
            log.warning("sweeping the VM caches: %s", e)

    def collect_vm_caches(self, max_age: float | None = None) -> list[Path]:
        """Remove the VM backends' cache files (pmem metadata images) of
        images and layers no tag of the catalog names any more, laid out by
        another version of the code, or (max_age, seconds) unused for
        longer; never those of this node's live sandboxes (paused ones
        included). Returns the files removed; they are rebuilt when needed.
        Then the microVM snapshots in the host's shared snapshot directory
        that no sandbox can resume from (snapshots.collect: never a live
        sandbox's, nor one a tagged snapshot image names)."""
        from chunkstore.digests import digest_key

        from .backends import snapshots
        from .guest import caches
        catalog = self.images.catalog()
        keep: set[str] = set()
        snapshot_ids: set[str] = set()  # sandboxes whose state a tagged image holds
        for _, digest in catalog.list_tags():
            _, image = catalog.resolve(digest)
            keep |= {digest_key(digest), *(digest_key(d) for d in image.layers)}
            state = image.config.get(VM_STATE_KEY)
            if isinstance(state, dict) and isinstance(state.get("sandbox_id"), str):
                snapshot_ids.add(state["sandbox_id"])
        with self._lock:
            images = [h.image for _, h in self._sandboxes.values()]
            live = set(self._sandboxes)
        in_use = {digest_key(d) for im in images for d in (im.digest, *im.layers)}
        removed = caches.collect(self._vm_cache_dirs(), keep, in_use, max_age)
        return removed + snapshots.collect(self.config.state_dir, live | snapshot_ids, max_age)

    def _recover_one(self, f: Path) -> None:
        try:
            raw = json.loads(f.read_text())
            info = parse(SandboxInfo, json.dumps(raw["info"]))
            image = parse(ResolvedImage, json.dumps(raw["image"]))
            backend = self.backend(info.spec.backend)
            # the digest recorded at create, not the name again: a tag moved
            # while the node was down does not change the sandbox
            h = Handle(info.id, info.spec, image, f.parent,
                       backend.state_type.model_validate(raw["state"]))
        except (OSError, ValueError, KeyError, SandboxError) as e:
            log.warning("ignoring unreadable sandbox state %s: %s", f, e)
            return
        status = backend.status(h)
        if status == "stopped" or "persistent" not in capabilities(info.spec.backend):
            log.info("cleaning up %s: no longer running", info.id)
            backend.kill(h)
            _remove(h.dir)
            return
        try:
            preempted = self._preempted_record(info.id) is not None
        except SandboxError as e:  # the store is unreachable: keep it running
            log.warning("cannot tell whether %s was preempted: %s", info.id, e)
            preempted = False
        if preempted:
            # preempted (snapshot taken, recorded) but killed before it stopped
            log.info("stopping %s: its preemption was cut short", info.id)
            backend.kill(h)
            _remove(h.dir)
            return
        if info.state == "running" and status == "paused":
            # frozen by a snapshot that never thawed it (its node was killed)
            log.info("thawing %s: a capture was cut short", info.id)
            backend.resume(h)
            status = "running"
        with self._lock:  # idle time restarts: activity was only kept in memory
            self._sandboxes[info.id] = (info.model_copy(
                update={"state": status, "last_active": time.time()}), h)
            self._asked[info.spec.qos] += info.spec.memory_mb
        adopt = getattr(backend, "adopt", None)  # containers: their Landlock records
        if adopt is not None:
            adopt(h)

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


IDENTITY_FILES = ("/etc/hostname", "/etc/machine-id", "/var/lib/systemd/random-seed",
                  "/var/lib/dbus/machine-id")


def _fresh_identity(files: SandboxFiles, sandbox_id: str) -> None:
    """A forked sandbox's own identity, in the files its image keeps (only
    those that exist: a fork adds no file)."""
    for path in IDENTITY_FILES:
        try:
            old = files.read(path)
        except SandboxError:
            continue
        if path == "/etc/hostname":
            new = sandbox_id[:63].encode() + b"\n"
        elif path.endswith("machine-id"):
            if not old.strip():  # an empty machine-id means "make one at boot"
                continue
            new = secrets.token_hex(16).encode() + b"\n"
        else:
            new = secrets.token_bytes(max(len(old), 32))
        files.write(path, new, mode=0o644 if path != "/var/lib/systemd/random-seed" else 0o600)


def _close_at_exit(ref: weakref.ref[Node]) -> None:
    node = ref()
    if node is not None:
        try:
            node.close()
        except Exception:  # exiting anyway: say what stayed, do not mask the exit
            log.exception("closing the node of %s at exit", node.config.state_dir)


def _disk_usage(d: Path) -> int:
    """Bytes of disk the files under d take (what removing them frees)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(d):
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _remove(d: Path) -> None:
    try:
        remove_tree(d)
    except OSError as e:
        log.warning("%s", e)


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
