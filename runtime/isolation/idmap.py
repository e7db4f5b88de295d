"""Host ids of container sandboxes: each sandbox's user namespace maps its
ids 0..65535 to a range of unprivileged host ids of its own.

Root in a sandbox is then host uid `base`, not 0: a process that got out of
its namespaces, or reached a host file through a descriptor it should not
hold, acts as an unprivileged user of the host, and as a different one in
every sandbox (the kernel lets a uid signal and ptrace its own processes,
so a shared range would let an escaped process reach every other sandbox's).
The image's files (root-owned in the shared EROFS lowers) show through
idmapped copies of the lower mounts (lazyfs.mounts.IdShift); the writable
layer holds host ids as the sandbox's processes wrote them.

Ranges: slot s is host ids FIRST + s * RANGE ... + RANGE - 1, above the
fncall uids (hostlimits.FNCALL_UID_BASE, 2**30 of them) and below 2**32 - 1
(which is no uid). A slot is a directory SLOT_DIR/<s> holding one file per
sandbox using it (host-wide, like the network slots: two nodes on one host
never hand out one range twice). A sandbox restored from a checkpoint joins
its checkpointed sandbox's slot: CRIU restores the user namespace with the
map it dumped.

Not here: the OCI mappings (runtime/isolation/oci.py) and mounting (lazyfs.mounts).
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from composer.snapshot import HostIds

from ..errors import BackendUnavailable, QuotaExceeded

SLOT_DIR = Path("/run/lazyfs-idranges")
FIRST = 1 << 31
RANGE = 1 << 16
SLOTS = ((1 << 32) - 1 - FIRST) // RANGE  # 32,767


@dataclass(frozen=True)
class IdRange:
    """One sandbox's host ids: its id N is host id base + N, N < RANGE."""

    slot: int

    @property
    def base(self) -> int:
        return FIRST + self.slot * RANGE

    def host_ids(self) -> HostIds:
        return HostIds(self.base, RANGE)

    def oci_mappings(self) -> list[dict[str, int]]:
        return [{"containerID": 0, "hostID": self.base, "size": RANGE}]

    @classmethod
    def of_base(cls, base: int) -> IdRange:
        slot, rest = divmod(base - FIRST, RANGE)
        if rest or not 0 <= slot < SLOTS:
            raise ValueError(f"{base} is not the first host id of a sandbox range")
        return cls(slot)


def allocate(sandbox_id: str, slots: Path = SLOT_DIR) -> IdRange:
    """A range no other live sandbox uses (probing from the id's hash)."""
    slots.mkdir(mode=0o700, parents=True, exist_ok=True)
    start = int.from_bytes(hashlib.blake2s(sandbox_id.encode(), digest_size=4).digest(), "big")
    for i in range(SLOTS):
        slot = (start + i) % SLOTS
        try:
            os.mkdir(slots / str(slot), 0o700)
        except FileExistsError:
            continue
        (slots / str(slot) / sandbox_id).touch()
        return IdRange(slot)
    raise QuotaExceeded(f"all {SLOTS} sandbox id ranges are in use")


def join(r: IdRange, sandbox_id: str, slots: Path = SLOT_DIR) -> None:
    """`sandbox_id` uses range r too (a restore of r's checkpointed sandbox)."""
    d = slots / str(r.slot)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    (d / sandbox_id).touch()


def release(r: IdRange, sandbox_id: str, slots: Path = SLOT_DIR) -> None:
    """`sandbox_id` no longer uses r; the range is free once nobody does."""
    d = slots / str(r.slot)
    (d / sandbox_id).unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise


def holders(slots: Path = SLOT_DIR) -> dict[int, list[str]]:
    """Slot -> the sandboxes using it (leak checks, listings)."""
    out: dict[int, list[str]] = {}
    for d in slots.iterdir() if slots.is_dir() else []:
        if d.name.isdigit():
            out[int(d.name)] = sorted(f.name for f in d.iterdir())
    return out


class RangePool:
    """Ranges and their user namespaces for one node process. A released
    range's namespace is kept (up to `spare` of them) and the range is the
    first tried by the next sandbox: under create/kill churn a create then
    starts no process for its namespace (measured: 7 ms p50 on a loaded
    2-core host, docs/security.md). Thread-safe."""

    def __init__(self, slots: Path = SLOT_DIR, spare: int = 256) -> None:
        self.slots = slots
        self.spare = spare
        self._lock = threading.Lock()
        self._userns: dict[int, int] = {}  # slot -> its namespace (held ranges and spares)
        self._free: list[int] = []  # spare slots, most recently released last

    def acquire(self, sandbox_id: str) -> IdRange:
        """A range of the sandbox's own (a spare one first)."""
        while True:
            with self._lock:
                slot = self._free.pop() if self._free else None
            if slot is None:
                return allocate(sandbox_id, self.slots)
            try:
                os.mkdir(self.slots / str(slot), 0o700)
            except FileExistsError:  # another node on this host took it meanwhile
                self._forget(slot)
                continue
            (self.slots / str(slot) / sandbox_id).touch()
            return IdRange(slot)

    def user_namespace(self, r: IdRange) -> int:
        """A user namespace with r's map, owned by the pool (do not close)."""
        with self._lock:
            fd = self._userns.get(r.slot)
        if fd is not None:
            return fd
        fd = user_namespace(r)
        with self._lock:
            if r.slot in self._userns:  # made twice at once: keep one
                os.close(fd)
                return self._userns[r.slot]
            self._userns[r.slot] = fd
        return fd

    def release(self, r: IdRange, sandbox_id: str) -> None:
        release(r, sandbox_id, self.slots)
        if (self.slots / str(r.slot)).exists():
            return  # still used (a restore shares it)
        with self._lock:
            if r.slot in self._userns and r.slot not in self._free \
                    and len(self._free) < self.spare:
                self._free.append(r.slot)
                return
        self._forget(r.slot)

    def _forget(self, slot: int) -> None:
        with self._lock:
            fd = self._userns.pop(slot, None)
            if slot in self._free:
                self._free.remove(slot)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            fds, self._userns, self._free = list(self._userns.values()), {}, []
        for fd in fds:
            os.close(fd)


def user_namespace(r: IdRange) -> int:
    """A descriptor of a user namespace with r's map (ids 0.. to r.base..),
    for idmapped mounts; the caller closes it. The namespace lives as long
    as a descriptor or a mount made with it does."""
    # a process that unshares its user namespace and waits: `unshare`
    # (util-linux) then sh, which says it runs (the namespace exists) and
    # ends when its stdin closes
    try:
        p = subprocess.Popen(["unshare", "--user", "--", "sh", "-c", "echo; read _"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, close_fds=True)
    except OSError as e:
        raise BackendUnavailable(f"cannot start unshare(1) for a user namespace: {e}") from e
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    try:
        if p.stdout.readline() != b"\n":
            raise BackendUnavailable("unshare --user failed: "
                                     f"{p.stderr.read().decode(errors='replace').strip()}")
        line = f"0 {r.base} {RANGE}\n"
        try:
            Path(f"/proc/{p.pid}/uid_map").write_text(line)
            Path(f"/proc/{p.pid}/gid_map").write_text(line)
            return os.open(f"/proc/{p.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise BackendUnavailable(f"cannot map host ids {r.base}+{RANGE} into a user "
                                     f"namespace: {e}") from e
    finally:
        p.stdin.close()
        p.wait()
        p.stdout.close()
        p.stderr.close()
