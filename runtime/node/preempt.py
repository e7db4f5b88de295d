"""The records of preempted sandboxes: one JSON document per sandbox
(spec.PreemptedSandbox: its id, spec, labels, snapshot image, figures),
where every node that may restore it finds it.

With a cluster store the records live in its object store, next to the
snapshot images (`preempted/<id>.json`), so any node sharing it restores
them; with a local store, in the node's state directory (restored on this
node). Each write is one atomic object put; a record is written after its
snapshot image is committed and tagged, and deleted after the sandbox runs
again, so a record always names an image that is there.

A restore first claims the record: `preempted/<id>.claim`, written with an
exclusive create (ObjectStore.put_new: a conditional PUT, If-None-Match, on
S3/SeaweedFS; a hard link on POSIX). Of two nodes restoring one sandbox at
once exactly one gets the claim; the other gets RestoreConflict naming the
holder. The claim goes once the restore is done (or failed). A claim older
than CLAIM_STALE_S is a restorer that died and is taken over.

Not here: taking the snapshot, stopping and creating sandboxes
(runtime.node).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from chunkstore.errors import LazyfsError
from chunkstore.objects import ObjectNotFound, ObjectStore, open_object_store
from composer.remote import ClusterCatalog

from ..config import RuntimeConfig
from ..errors import BackendUnavailable, InvalidSpec, RestoreConflict, SandboxError
from ..images import Images
from ..spec import SANDBOX_ID_PATTERN, PreemptedSandbox, parse

_PREFIX = "preempted/"
_SUFFIX = ".json"
_CLAIM = ".claim"
# longer than any restore takes (an image's first fetch included): a claim this
# old was left by a restorer that died
CLAIM_STALE_S = 900.0
_ID = re.compile(SANDBOX_ID_PATTERN)
T = TypeVar("T")


def _matches(labels: Mapping[str, str], want: Mapping[str, str] | None) -> bool:
    return not want or all(labels.get(k) == v for k, v in want.items())


class PreemptedSandboxes:
    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        self.config = config
        self.images = images
        self._lock = threading.Lock()
        self._local: ObjectStore | None = None

    def _objects(self) -> ObjectStore:
        if self.config.cluster:
            catalog = self.images.catalog()
            assert isinstance(catalog, ClusterCatalog), catalog
            return catalog.cluster.objects
        with self._lock:
            if self._local is None:
                self.config.state_dir.mkdir(parents=True, exist_ok=True)
                self._local = open_object_store(f"posix://{self.config.state_dir.absolute()}")
            return self._local

    @staticmethod
    def key(sandbox_id: str) -> str:
        if not _ID.fullmatch(sandbox_id):
            raise InvalidSpec(f"{sandbox_id!r} is not a sandbox id (sb- and 16 hex digits)")
        return f"{_PREFIX}{sandbox_id}{_SUFFIX}"

    def put(self, record: PreemptedSandbox) -> None:
        self._call("saving", lambda o: o.put(self.key(record.id),
                                             record.model_dump_json().encode()))

    def get(self, sandbox_id: str) -> PreemptedSandbox | None:
        key = self.key(sandbox_id)

        def read(o: ObjectStore) -> bytes | None:
            try:
                return o.get(key)
            except ObjectNotFound:
                return None
        raw = self._call("reading", read)
        if raw is None:
            return None
        try:
            record = parse(PreemptedSandbox, raw)
        except InvalidSpec as e:
            raise SandboxError(f"the record {key} is not a preempted sandbox: {e}") from None
        if record.id != sandbox_id:
            raise SandboxError(f"the record {key} names another sandbox ({record.id})")
        return record

    def list(self, labels: Mapping[str, str] | None = None) -> list[PreemptedSandbox]:
        keys = self._call("listing", lambda o: list(o.list(_PREFIX)))
        out = []
        for key in keys:
            sandbox_id = key[len(_PREFIX):-len(_SUFFIX)] if key.endswith(_SUFFIX) else ""
            if not _ID.fullmatch(sandbox_id):
                continue  # not a record of ours (a put's temporary file, say)
            record = self.get(sandbox_id)
            if record is not None and _matches(record.spec.labels, labels):
                out.append(record)
        return out

    def delete(self, sandbox_id: str) -> None:
        self._call("deleting", lambda o: o.delete(self.key(sandbox_id)))

    def claim(self, sandbox_id: str, holder: str) -> bytes:
        """Claim the restore of `sandbox_id` for `holder` (a node's name):
        the claim's bytes, for release(). RestoreConflict when another holds
        it (a stale claim, older than CLAIM_STALE_S, is taken over)."""
        key = self.key(sandbox_id).removesuffix(_SUFFIX) + _CLAIM
        body = json.dumps({"holder": holder, "token": secrets.token_hex(16),
                           "at": time.time()}).encode()
        for _ in range(2):
            if self._call("claiming", lambda o: o.put_new(key, body)):
                return body
            try:
                held = json.loads(self._call("reading", lambda o: o.get(key)))
                who, since = str(held["holder"]), float(held["at"])
            except ObjectNotFound:  # released meanwhile: try again
                continue
            except (ValueError, KeyError, TypeError):
                who, since = "an unreadable claim", time.time()
            if time.time() - since < CLAIM_STALE_S:
                raise RestoreConflict(
                    f"{sandbox_id} is being restored by {who} (claimed "
                    f"{time.time() - since:.0f}s ago, {key}): it runs there once restored")
            self._call("deleting", lambda o: o.delete(key))  # its restorer died
        raise RestoreConflict(f"{sandbox_id}: the restore claim {key} keeps changing hands")

    def release(self, sandbox_id: str, claim: bytes) -> None:
        """Drop our claim (only if it is still ours)."""
        key = self.key(sandbox_id).removesuffix(_SUFFIX) + _CLAIM

        def drop(o: ObjectStore) -> None:
            try:
                if o.get(key) == claim:
                    o.delete(key)
            except ObjectNotFound:
                pass
        self._call("releasing the claim of", drop)

    def _call(self, what: str, fn: Callable[[ObjectStore], T]) -> T:
        try:
            return fn(self._objects())
        except (LazyfsError, OSError) as e:
            if isinstance(e, SandboxError):
                raise
            where = self.config.cluster or self.config.state_dir
            raise BackendUnavailable(f"{what} preempted sandboxes in {where}: {e}") from e
