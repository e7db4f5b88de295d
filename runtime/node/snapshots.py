"""A node's snapshots, forks, checkpoints and verifiers: a sandbox's files
(and a VM's memory) captured into the image store (runtime.node.capture), and
sandboxes made from them.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends import Backend, Handle
from ..backends.base import Capturing, Checkpointing, GuestCapturing, StateSaving
from ..backends.criu import CRIU_VERSION
from ..errors import (
    SandboxError,
    SandboxStateError,
    Unsupported,
)
from ..files import SandboxFiles, remove_tree
from ..spec import (
    VERIFIER_LABEL,
    CheckpointInfo,
    ExecResult,
    Forked,
    NetworkPolicy,
    SandboxInfo,
    SnapshotInfo,
    VerifyRequest,
)
from .capture import MEMORY_CHUNK_SIZE, Packed

if TYPE_CHECKING:
    from .core import Node

log = logging.getLogger("runtime.node")


class Snapshots:
    """The node's captures of its sandboxes (Node.snapshots)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def capturing(self, info: SandboxInfo, op: str) -> Capturing:
        backend = self.node._require(info, op)
        if not isinstance(backend, Capturing):
            raise Unsupported(f"the {info.spec.backend} backend cannot {op} a sandbox's files "
                              "apart from its memory (Sandbox.capabilities)")
        return backend

    def pack(self, sandbox_id: str, op: str) -> tuple[SandboxInfo, Handle[Any], Packed,
                                                        float]:
        """The sandbox's upper packed with its processes stopped: (info,
        handle, the packed layer, seconds frozen)."""
        with self.node._state_lock(sandbox_id):  # no pause/resume meanwhile
            info, h = self.node._get(sandbox_id)
            backend = self.capturing(info, op)
            rules = backend.capture_rules(h) if isinstance(backend, GuestCapturing) else None
            with backend.capture(h) as upper:
                t0 = time.monotonic()
                packed = self.node.captures.pack(sandbox_id, upper, op, ids=h.state.host_ids(),
                                            rules=rules)
                frozen = time.monotonic() - t0
        self.node._touch(info, h)
        return info, h, packed, frozen

    def snapshot(self, sandbox_id: str, tag: str | None = None) -> SnapshotInfo:
        """The sandbox's files as an image (its layers + its upper packed),
        committed under `tag` (default snapshots/<id>:<n>)."""
        started = time.monotonic()
        if isinstance(self.node._require(self.node._get(sandbox_id)[0], "snapshot"), StateSaving):
            return self.vm_snapshot(sandbox_id, tag, resume=True)[0]
        _, h, packed, frozen = self.pack(sandbox_id, "snapshot")
        snap = self.node.captures.snapshot(sandbox_id, h.image, packed, tag=tag,
                                      frozen_s=frozen, started=started)
        log.info("snapshot of %s: %s (%d entries, %d bytes new, frozen %.3fs)", sandbox_id,
                 snap.image, snap.entries, snap.bytes_new, frozen)
        return snap

    def vm_snapshot(self, sandbox_id: str, tag: str | None, *, resume: bool
                     ) -> tuple[SnapshotInfo, dict[str, Any]]:
        """A VM's memory and device state as an image in the store (its top
        layer the state, chunked and deduplicated like CRIU's images): the
        VM is paused into a file (its VMM exits) and resumed from it
        (`resume`) or left paused, and the file packed. (info, the pause's
        figures)."""
        started = time.monotonic()
        if tag is not None:
            self.node.captures.check_tag(tag, "snapshot")
        with self.node._state_lock(sandbox_id):  # no pause/resume meanwhile
            info, h = self.node._get(sandbox_id)
            backend = self.node._require(info, "snapshot")
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
                        self.node.backend(info.spec.backend).resume(h)
                finally:
                    if running and (not resume or
                                    self.node.backend(info.spec.backend).status(h) == "paused"):
                        info = self.node._touch(info, h, state="paused")  # (a resume that failed)
                frozen = time.monotonic() - t0
                packed = self.node.captures.pack(sandbox_id, kept, "vm-state", MEMORY_CHUNK_SIZE)
            finally:
                remove_tree(kept)
            record = backend.state_record(h, str(packed.manifest.digest))
        snap = self.node.captures.vm_snapshot(sandbox_id, h.image, packed, record, tag=tag,
                                         frozen_s=frozen, started=started)
        self.node._touch(info, h)
        log.info("VM snapshot of %s: %s (%d bytes, %d new, stopped %.3fs)", sandbox_id,
                 snap.image, snap.bytes, snap.bytes_new, frozen)
        return snap, figures

    def fork(self, sandbox_id: str, n: int) -> Forked:
        """n sandboxes from the current files of one (one capture), each with
        its own writable layer and identity (hostname = its id; the image's
        /etc/hostname, /etc/machine-id and random-seed files made anew)."""
        if not 1 <= n <= 1024:
            raise SandboxStateError(f"fork of {n}: between 1 and 1024 at a time")
        info = self.node.get(sandbox_id)
        if isinstance(self.node._require(info, "snapshot"), StateSaving):
            raise Unsupported(f"the {info.spec.backend} backend cannot fork: a copy of a VM's "
                              "memory shares its kernel's identity (hostname, random state); "
                              "snapshot() it and create one sandbox of the snapshot")
        snap = self.snapshot(sandbox_id)
        spec = info.spec.model_copy(update={"image": snap.image})
        children: list[SandboxInfo] = []
        try:
            for _ in range(n):
                child = self.node.create(spec)
                children.append(child)
                _fresh_identity(self.node.files(child.id), child.id)
        except BaseException:
            for c in children:
                self.node.kill(c.id)
            raise
        return Forked(snapshot=snap, children=children)

    def checkpoint(self, sandbox_id: str, tag: str | None = None) -> CheckpointInfo:
        """The sandbox's processes (CRIU) and files (its upper packed, as a
        snapshot) at one instant, stored in the image store; the sandbox
        runs on. Raises NotCheckpointable (naming CRIU's reason) when a
        process cannot be saved; the sandbox is left as it was."""
        started = time.monotonic()
        if self.node.config.cluster:
            raise Unsupported("checkpoints with a cluster store are not built yet (the memory "
                              "layer and record would need a push; use a local store)")
        if tag is not None:
            self.node.captures.check_tag(tag, "checkpoint")
        with self.node._state_lock(sandbox_id):  # no pause/resume meanwhile
            info, h = self.node._get(sandbox_id)
            backend = self.node._require(info, "checkpoint")
            assert isinstance(backend, Checkpointing), backend
            with self.node._lock:
                if self.node._busy.get(sandbox_id):
                    raise SandboxStateError(
                        f"a command is running in {sandbox_id}: checkpoint between commands "
                        "(a running command's pipes lead out of the sandbox, to the caller)")
            images = h.dir / "checkpoint"
            files: Packed | None = None
            try:
                t0 = time.monotonic()
                with backend.checkpoint(h, images) as upper:
                    dumped = time.monotonic()
                    files = self.node.captures.pack(sandbox_id, upper, "checkpoint",
                                               ids=h.state.host_ids())
                frozen = time.monotonic() - t0
                memory = self.node.captures.pack(sandbox_id, images, "checkpoint-memory",
                                            MEMORY_CHUNK_SIZE)
            except BaseException:
                if files is not None:
                    files.close()
                raise
            finally:
                with self.node._lock:  # the exec channel may have moved
                    if sandbox_id in self.node._sandboxes:
                        self.node._save(info, h)
                remove_tree(images)
            record = {"spec": info.spec.model_dump(mode="json"), "sandbox_id": sandbox_id,
                      "channel_name": h.state.channel_name, "criu": CRIU_VERSION,
                      "id_base": h.state.id_base}
            ckpt = self.node.captures.checkpoint(
                sandbox_id, h.image, files, memory, record=record, tag=tag,
                dump_s=dumped - t0, frozen_s=frozen, started=started)
        self.node._touch(info, h)
        log.info("checkpoint of %s: %s (memory %d bytes, %d new; frozen %.3fs)", sandbox_id,
                 ckpt.id, ckpt.memory_bytes, ckpt.memory_bytes_new, frozen)
        return ckpt

    def restore_checkpoint(self, checkpoint: str, labels: Mapping[str, str] | None = None
                           ) -> SandboxInfo:
        """A new sandbox from a checkpoint (its id or tag): the checkpoint's
        files under a fresh writable layer, its processes restored where
        they were. `labels` replace the checkpointed sandbox's when given."""
        with tempfile.TemporaryDirectory(dir=self.node.config.sandboxes) as tmp:
            staged = Path(tmp) / "images"
            record = self.node.captures.load_checkpoint(checkpoint, staged)
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

            info = self.node._create(spec, start=start)
        log.info("restored %s from checkpoint %s", info.id, checkpoint)
        return info

    def verify(self, sandbox_id: str, req: VerifyRequest) -> ExecResult:
        """Run `req.exec` in a fresh sandbox made from this one's current files
        (all of its writable layer, or what is under `req.keep`) over its image,
        with the hidden paths shown, no network and no process of this
        sandbox's: what a grader can trust."""
        info, h, packed, _ = self.pack(sandbox_id, "verify")
        digest, tag = self.node.captures.verifier_image(sandbox_id, h.image, info.spec.hidden,
                                                   packed, req.keep)
        spec = info.spec.model_copy(update={
            "image": digest, "hidden": (), "network": NetworkPolicy.none(),
            "labels": {VERIFIER_LABEL: sandbox_id}, "idle_timeout": None,
            "timeout": max(60.0, req.exec.timeout + 60.0)})
        try:
            verifier = self.node.create(spec)
            try:
                return self.node.exec(verifier.id, req.exec)
            finally:
                self.node.kill(verifier.id)
        finally:
            self.node.captures.remove_tag(tag)


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
