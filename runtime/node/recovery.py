"""A node's start: the sandboxes a previous node process left on its state
directory, adopted or cleaned up, and the VM backends' caches swept and
collected.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..backends import Handle, capabilities
from ..errors import (
    SandboxError,
)
from ..files import remove_dir
from ..spec import (
    VM_STATE_KEY,
    ResolvedImage,
    SandboxInfo,
    SandboxSpec,
    parse,
)

if TYPE_CHECKING:
    from .core import Node

log = logging.getLogger("runtime.node")

# The image of a creation cut short, which the state file never recorded:
# cleaning one up needs only its id and directory.
_NO_IMAGE = ResolvedImage.model_construct(name="-", digest="-", layers=())

# A sandbox made for a caller that has not been told its id yet carries this
# file in its directory until it has (Recovery.answer_due / answered): a node
# killed in between cannot tell its caller, and its next start removes it
# rather than keep a sandbox nobody knows of.
UNANSWERED = "unanswered"
# the ids a create made for a caller not told of them yet (Recovery.answer_due)
_answer_due: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "answer_due", default=None)


class Recovery:
    """What a node finds when it starts (Node.recovery)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    @contextlib.contextmanager
    def answer_due(self, made: list[str]) -> Iterator[None]:
        """Sandboxes made inside (in this thread) stay marked unanswered
        until `answered(made)`: a server calls this around a create and
        answered() once its answer is delivered, so that if it is killed in
        between, the node's next start removes what no caller learned of.
        Their ids are appended to `made`."""
        reset = _answer_due.set(made)
        try:
            yield
        finally:
            _answer_due.reset(reset)

    def mark_if_due(self, d: Path, sandbox_id: str) -> None:
        """(Node's create, for the sandbox in `d`, inside answer_due.)"""
        due = _answer_due.get()
        if due is not None:
            (d / UNANSWERED).touch()
            due.append(sandbox_id)

    def answered(self, ids: Iterable[str]) -> None:
        """The callers of these sandboxes' creates know their ids now."""
        for sandbox_id in ids:
            with contextlib.suppress(FileNotFoundError):
                (self.node.config.sandboxes / sandbox_id / UNANSWERED).unlink()

    def recover(self) -> None:
        """Load the sandboxes a previous node process left; those whose
        backend no longer runs them are cleaned up."""
        from ..backends.fncall import sweep
        sweep(self.node.config)
        self.node.captures.sweep()
        self._sweep_vm_caches()
        for f in sorted(self.node.config.sandboxes.glob("*/sandbox.json")):
            try:
                self._one(f)
            except Exception:  # one broken sandbox must not keep the node from starting
                log.exception("cannot recover %s; left for the next start", f.parent.name)
        for d in self.node.config.sandboxes.iterdir():  # creations cut short
            if not (d / "sandbox.json").exists() and d.name not in self.node._sandboxes:
                backend = self.node.backend("container")
                h = Handle(d.name, SandboxSpec(image="-"), _NO_IMAGE, d, backend.state_type())
                try:
                    backend.kill(h)
                except Exception:
                    log.exception("cleaning up the cut-short creation %s", d.name)
                    remove_dir(d)

    def _one(self, f: Path) -> None:
        try:
            raw = json.loads(f.read_text())
            info = parse(SandboxInfo, json.dumps(raw["info"]))
            image = parse(ResolvedImage, json.dumps(raw["image"]))
            backend = self.node.backend(info.spec.backend)
            # the digest recorded at create, not the name again: a tag moved
            # while the node was down does not change the sandbox
            h = Handle(info.id, info.spec, image, f.parent,
                       backend.state_type.model_validate(raw["state"]))
        except (OSError, ValueError, KeyError, SandboxError) as e:
            log.warning("ignoring unreadable sandbox state %s: %s", f, e)
            return
        if (h.dir / UNANSWERED).exists():
            log.warning("removing %s: the node stopped before its create's caller learned "
                        "its id", info.id)
            backend.kill(h)
            remove_dir(h.dir)
            return
        status = backend.status(h)
        if status == "stopped" or "persistent" not in capabilities(info.spec.backend):
            log.info("cleaning up %s: no longer running", info.id)
            backend.kill(h)
            remove_dir(h.dir)
            return
        try:
            preempted = self.node.preemption.record(info.id) is not None
        except SandboxError as e:  # the store is unreachable: keep it running
            log.warning("cannot tell whether %s was preempted: %s", info.id, e)
            preempted = False
        if preempted:
            # preempted (snapshot taken, recorded) but killed before it stopped
            log.info("stopping %s: its preemption was cut short", info.id)
            backend.kill(h)
            remove_dir(h.dir)
            return
        if info.state == "running" and status == "paused":
            # frozen by a snapshot that never thawed it (its node was killed)
            log.info("thawing %s: a capture was cut short", info.id)
            backend.resume(h)
            status = "running"
        with self.node._lock:  # idle time restarts: activity was only kept in memory
            self.node._sandboxes[info.id] = (info.model_copy(
                update={"state": status, "last_active": time.time()}), h)
            self.node.admission.adopted(info.spec)
        adopt = getattr(backend, "adopt", None)  # containers: their Landlock records
        if adopt is not None:
            adopt(h)

    def vm_cache_dirs(self) -> list[Path]:
        """The VM backends' node-wide cache directories (their pmem images)."""
        from ..backends.microvm import MicrovmBackend
        from ..backends.vm import VmBackend
        mvm, vm = self.node.backend("microvm"), self.node.backend("vm")
        assert isinstance(mvm, MicrovmBackend) and isinstance(vm, VmBackend)
        return list(dict.fromkeys([mvm.pmem_cache, vm.pmem_cache]))

    def _sweep_vm_caches(self) -> None:
        """What VM image builds cut short by a node that died left in the
        caches (runtime/guest/caches.py): temporary files."""
        from ..guest import caches
        try:
            caches.sweep(self.vm_cache_dirs())
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

        from ..backends import snapshots
        from ..guest import caches
        catalog = self.node.images.catalog()
        keep: set[str] = set()
        snapshot_ids: set[str] = set()  # sandboxes whose state a tagged image holds
        for _, digest in catalog.list_tags():
            _, image = catalog.resolve(digest)
            keep |= {digest_key(digest), *(digest_key(d) for d in image.layers)}
            state = image.config.get(VM_STATE_KEY)
            if isinstance(state, dict) and isinstance(state.get("sandbox_id"), str):
                snapshot_ids.add(state["sandbox_id"])
        with self.node._lock:
            images = [h.image for _, h in self.node._sandboxes.values()]
            live = set(self.node._sandboxes)
        in_use = {digest_key(d) for im in images for d in (im.digest, *im.layers)}
        removed = caches.collect(self.vm_cache_dirs(), keep, in_use, max_age)
        return removed + snapshots.collect(self.node.config.state_dir, live | snapshot_ids, max_age)
