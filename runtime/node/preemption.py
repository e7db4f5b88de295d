"""A node's preemptions: a sandbox snapshotted, recorded (runtime.node.preempt)
and stopped, and brought back under its id, here or on any node that sees
the same image store.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from chunkstore.errors import LazyfsError

from ..api import Labels
from ..backends.base import StateSaving
from ..errors import (
    InvalidSpec,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
)
from ..isolation import cgroups
from ..spec import (
    PreemptedSandbox,
    SandboxInfo,
    SnapshotInfo,
)

if TYPE_CHECKING:
    from .core import Node

log = logging.getLogger("runtime.node")


class Preemption:
    """The node's preempted sandboxes (Node.preemption)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def record(self, sandbox_id: str) -> PreemptedSandbox | None:
        try:
            return self.node.preempted.get(sandbox_id)
        except InvalidSpec:  # not even an id: not found
            return None

    def records(self, labels: Labels = None) -> list[PreemptedSandbox]:
        """The records of preempted sandboxes with these labels (every
        node's, with a cluster store)."""
        return self.node.preempted.list(labels)

    def preempt(self, sandbox_id: str) -> PreemptedSandbox:
        """Pause the sandbox, snapshot it (tag preempted/<id>), record it
        (spec, labels, snapshot: runtime.node.preempt) and stop it: its memory and
        its writable layer on disk go back to the node. restore() makes it again,
        with the same id, on any node that sees the same image store."""
        info, _ = self.node._get(sandbox_id)
        was = info.state
        if isinstance(self.node._require(info, "snapshot"), StateSaving):
            # the VM's memory (its upper with it) goes into the store; its VMM exits
            try:
                snap, figures = self.node.snapshots.vm_snapshot(sandbox_id, f"preempted/{sandbox_id}",
                                                  resume=False)
            except BaseException:
                if was != "paused" and self.node.get(sandbox_id).state == "paused":
                    self.node.resume(sandbox_id)
                raise
            memory, written = int(figures.get("vmm_pss_before", 0)), 0
        else:
            memory, written, snap = self._files(sandbox_id, was)
        info, _ = self.node._get(sandbox_id)
        record = PreemptedSandbox(
            id=sandbox_id, spec=info.spec, image=snap.image, tag=snap.tag,
            image_digest=info.image_digest, state="paused" if was == "paused" else "running",
            created=info.created, preempted=time.time(), node=info.node, memory_bytes=memory,
            disk_bytes=written, snapshot=snap)
        self.node.preempted.put(record)  # after its image is tagged, before the sandbox goes
        try:
            self.node.kill(sandbox_id)
        except BaseException:
            self.node.preempted.delete(sandbox_id)  # it still runs here: not preempted
            raise
        log.info("preempted %s: snapshot %s, %d MB of memory and %d MB of disk freed",
                 sandbox_id, snap.image, memory >> 20, record.disk_bytes >> 20)
        return record

    def _files(self, sandbox_id: str, was: str) -> tuple[int, int, SnapshotInfo]:
        """A container's part of preempt: paused, its upper snapshotted;
        (memory used, bytes of its upper, the snapshot)."""
        info, _ = self.node._get(sandbox_id)
        backend = self.node.snapshots.capturing(info, "snapshot")
        if was == "paused":
            memory = cgroups.memory_figures(sandbox_id)["usage"]
        else:  # frozen from here on: nothing it writes after the snapshot is lost
            memory = self.node.pause(sandbox_id)["before"]["usage"]
        try:
            snap = self.node.snapshot(sandbox_id, tag=f"preempted/{sandbox_id}")
        except BaseException:
            if was != "paused":
                self.node.resume(sandbox_id)
            raise
        _, h = self.node._get(sandbox_id)
        with backend.capture(h) as upper:  # still frozen: no thaw in between
            written = _disk_usage(upper)  # a tmpfs upper's are memory too
        return memory, written, snap

    def preempt_many(self, labels: Mapping[str, str] | None) -> list[PreemptedSandbox]:
        """Preempt every sandbox with these labels (running or paused).
        Unsupported, before any is touched, if one's backend cannot snapshot."""
        infos = self.node.list_sandboxes(labels)
        for info in infos:
            self.node._require(info, "snapshot")
        return [self.preempt(info.id) for info in infos]

    def restore(self, sandbox_id: str) -> SandboxInfo:
        """The preempted sandbox `sandbox_id` running again on this node:
        same id, spec and labels, its files from the snapshot (a process
        state is not kept: it starts afresh, running). Its lifetime goes on
        from where it was preempted (the time preempted does not count).
        A kill of it meanwhile waits for this to end (Node.kill)."""
        done = threading.Event()
        with self.node._lock:
            if sandbox_id in self.node._restoring:
                raise SandboxStateError(f"{sandbox_id} is being restored on this node")
            self.node._restoring[sandbox_id] = done
        try:
            record = self.node.preempted.get(sandbox_id)
            if record is None:
                if sandbox_id in self.node._sandboxes:
                    raise SandboxStateError(f"{sandbox_id} runs on this node: not preempted")
                raise SandboxNotFound(f"no preempted sandbox {sandbox_id!r} "
                                      f"in {self.node.config.cluster or self.node.config.state_dir}")
            # one restorer per record, across nodes: the others get RestoreConflict
            claim = self.node.preempted.claim(sandbox_id, f"{os.uname().nodename}:"
                                         f"{self.node.config.node_id or self.node.config.state_dir}")
            try:
                if self.node.preempted.get(sandbox_id) is None:  # restored by an earlier claim
                    raise SandboxNotFound(f"{sandbox_id} was restored meanwhile "
                                          "(not preempted)")
                spec = record.spec.model_copy(update={"image": record.image})
                info = self.node._create(spec, sandbox_id=record.id,
                                    created=time.time() - (record.preempted - record.created))
                self.node.preempted.delete(sandbox_id)
            finally:
                self.node.preempted.release(sandbox_id, claim)
        finally:
            with self.node._lock:
                del self.node._restoring[sandbox_id]
            done.set()
        try:  # the snapshot is the running sandbox's image now; the tag may go
            self.node.captures.remove_tag(record.tag)
        except (SandboxError, LazyfsError) as e:
            log.warning("restored %s; its snapshot tag %s stays: %s", sandbox_id, record.tag, e)
        log.info("restored %s from %s (preempted on %s)", sandbox_id, record.image, record.node)
        return info

    def discard(self, sandbox_id: str) -> bool:
        record = self.record(sandbox_id)
        if record is None:
            return False
        self.node.preempted.delete(sandbox_id)
        try:
            self.node.captures.remove_tag(record.tag)
        except (SandboxError, LazyfsError) as e:
            log.warning("discarded %s; its snapshot tag %s stays: %s", sandbox_id, record.tag, e)
        log.info("discarded the preempted sandbox %s", sandbox_id)
        return True

    def restore_many(self, labels: Mapping[str, str] | None) -> list[str]:
        """Restore every preempted sandbox with these labels on this node."""
        return [self.restore(r.id).id for r in self.node.preempted.list(labels)]


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
