"""Which composed mount opened which layer file, on the kernel path.

On the FUSE trees the daemon sees every open with the reader's pid and
attributes it to the composed mount the reader runs in (daemon.Attribution).
On the kernel path (the default) it sees neither: a layer's EROFS mount is
shared by every root of the layer and opens the blob once, so the blob reads
it sends name no reader. This module gives the kernel path the same
per-mount view from the kernel's own record of opens: fanotify.

Each composed mount gets a fanotify group of its own, marking the mount's
overlay superblock (FAN_MARK_FILESYSTEM) for FAN_OPEN and FAN_OPEN_EXEC. A
superblock mark sees opens through every mount of that overlay, in any
mount namespace (a container's pivoted root included), and the group tells
which composed mount it was; no pid has to outlive its event. For each
event the daemon gets a descriptor of the opened file: overlayfs reports a
lower file's own device and inode number, so the device says which layer's
shared EROFS mount the file comes from (files of the writable layer, the
fixup layer or FUSE lowers are on other devices and are not counted) and
the path (the descriptor's link, relative to the overlay's root) says which
entry of that layer.

What it records per mount: the files opened (the same count as the FUSE
path's `files_touched`), and it remembers the mount that last opened each
layer file, so the blob reads that follow the open (the kernel reads the
file's blocks through the layer's blob) count as that mount's reads: its
touched chunks, bytes and trace events. The kernel queues the open event
before the open returns, so the reads that follow find it: the fetch
engine drains the queues (`drain`, one epoll_wait of zero timeout) before
attributing a blob read. Two mounts reading one file at the same moment
share the chunks the page cache serves once: the later opener gets them.

Bounds (a sandbox is hostile, and every event costs the daemon's CPU):
a file's second event puts an ignore mark on its overlay inode, which keeps
the kernel from queueing its later opens (at most IGNORE_MARKS per mount;
most files are opened once and cost no mark); each
mount's events are rationed (BURST, then RATE a second); a mount past its
ration stops being watched (its group is closed, a warning logged, its
state says so) rather than slowing the daemon; the kernel's queue drops
what overflows (16,384 events a group) and says so.

Needs root (CAP_SYS_ADMIN) and a kernel with fanotify; where fanotify_init
fails, mounts are not watched and their state says why.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import stat
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from composer.manifest import Kind

from .tree import LayerTree

log = logging.getLogger(__name__)

# fanotify (linux/fanotify.h); x86-64 and arm64 system call numbers
_SYS = {"x86_64": (300, 301), "aarch64": (262, 263)}
FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_CLASS_NOTIF = 0x0
FAN_MARK_ADD = 0x1
FAN_MARK_IGNORED_MASK = 0x20
FAN_MARK_IGNORED_SURV_MODIFY = 0x40
FAN_MARK_FILESYSTEM = 0x100
FAN_OPEN = 0x20
FAN_OPEN_EXEC = 0x1000
FAN_Q_OVERFLOW = 0x4000
AT_FDCWD = -100
_META = struct.Struct("=IBBHQii")  # fanotify_event_metadata
_METADATA_VERSION = 3

BURST = 50_000  # events a mount may send at once ...
RATE = 5_000.0  # ... and then per second
IGNORE_MARKS = 8_192  # files per mount whose later opens the kernel drops
SEEN = 200_000  # files per mount remembered as seen


class Unavailable(OSError):
    """fanotify cannot watch this mount (no permission, no support, limits)."""


def _syscalls() -> tuple[int, int] | None:
    return _SYS.get(os.uname().machine)


_libc = ctypes.CDLL(None, use_errno=True)


def _init(flags: int, event_flags: int) -> int:
    nrs = _syscalls()
    if nrs is None:
        raise Unavailable(errno.ENOSYS, f"fanotify: no system call numbers for {os.uname().machine}")
    fd = _libc.syscall(nrs[0], ctypes.c_uint(flags), ctypes.c_uint(event_flags))
    if fd < 0:
        e = ctypes.get_errno()
        raise Unavailable(e, f"fanotify_init: {os.strerror(e)}")
    return int(fd)


def _mark(group: int, flags: int, mask: int, dirfd: int, path: str | None) -> None:
    nrs = _syscalls()
    assert nrs is not None
    r = _libc.syscall(nrs[1], ctypes.c_int(group), ctypes.c_uint(flags), ctypes.c_uint64(mask),
                      ctypes.c_int(dirfd), None if path is None else os.fsencode(path))
    if r < 0:
        e = ctypes.get_errno()
        raise Unavailable(e, f"fanotify_mark {path or dirfd}: {os.strerror(e)}")


@dataclass
class Watch:
    """One composed mount's fanotify group."""

    mount: str
    fd: int
    layers: list[str]  # the image's layer digests, top first
    devices: dict[int, str] = field(default_factory=dict)  # overlay device -> layer
    # (device, inode) of each file seen opened -> the layer file, or None
    seen: dict[tuple[int, int], tuple[str, int] | None] = field(default_factory=dict)
    tokens: float = BURST
    stamp: float = field(default_factory=time.monotonic)
    ignored: int = 0  # ignore marks placed
    events: int = 0  # open events read
    counted: int = 0  # of them, opens of a layer file
    overflows: int = 0  # the kernel's queue overflowed

    def take(self, n: int) -> bool:
        now = time.monotonic()
        self.tokens = min(BURST, self.tokens + (now - self.stamp) * RATE)
        self.stamp = now
        self.tokens -= n
        return self.tokens >= 0


# (device, inode, path relative to the overlay root, watch, whether the path
# is the likeliest guess) -> the (layer digest, entry index) of the opened
# layer file, or None
Resolver = Callable[[int, int, str, "Watch", bool], "tuple[str, int] | None"]


class OpenWatches:
    """The fanotify groups of the node's composed mounts (kernel path).

    `resolve(dev, ino, relative path, watch)` names the layer file an event
    opened, or None; `on_open(mount, digest, index)` records it. Not
    thread-safe: the daemon's event loop owns it."""

    def __init__(self, resolve: Resolver, on_open: Callable[[str, str, int], None]) -> None:
        self.resolve = resolve
        self.on_open = on_open
        self.watches: dict[int, Watch] = {}  # group fd -> watch
        self.by_mount: dict[str, Watch] = {}
        self.stopped: dict[str, str] = {}  # mount -> why it is not watched
        self.openers: dict[tuple[str, int], str] = {}  # (digest, entry) -> last opener
        # the openers entries each mount set, so forgetting a mount touches
        # only its own (never a scan of every mount's)
        self._opened: dict[str, set[tuple[str, int]]] = {}
        self._epoll: select.epoll | None = None
        self.unavailable: str | None = None if _syscalls() else "fanotify: unsupported machine"

    @property
    def epoll_fd(self) -> int:
        """A descriptor readable whenever any watch has events (for the event loop)."""
        if self._epoll is None:
            self._epoll = select.epoll()
        return self._epoll.fileno()

    def watch(self, mount: str, layers: list[str]) -> str:
        """Start watching a composed mount (its path in the daemon's mount
        namespace) of an image of `layers` (top first); returns the
        watch's state."""
        mount = str(mount)
        if mount in self.by_mount:
            return "watching"
        self.stopped.pop(mount, None)
        if self.unavailable is not None:
            self.stopped[mount] = self.unavailable
            return self.unavailable
        try:
            try:
                fd = _init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK, _EVENT_FLAGS)
            except Unavailable as e:
                if e.errno != errno.EMFILE or not _raise_group_limit():
                    raise
                fd = _init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK, _EVENT_FLAGS)
        except Unavailable as e:
            why = str(e.strerror or e)
            if e.errno in (errno.EPERM, errno.ENOSYS, errno.EINVAL):
                self.unavailable = why  # it will not work for any mount
            else:
                log.warning("%s: opens not attributed: %s", mount, why)
            self.stopped[mount] = why
            return why
        try:
            _mark(fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_OPEN | FAN_OPEN_EXEC,
                  AT_FDCWD, mount)
        except Unavailable as e:
            os.close(fd)
            self.stopped[mount] = str(e.strerror or e)
            log.warning("%s: opens not attributed: %s", mount, e.strerror)
            return self.stopped[mount]
        w = self.watches[fd] = self.by_mount[mount] = Watch(mount, fd, list(layers))
        if self._epoll is None:
            self._epoll = select.epoll()
        self._epoll.register(w.fd, select.EPOLLIN)
        return "watching"

    def forget(self, mount: str) -> None:
        """Stop watching a mount (unmounted). Closing its group also frees
        events still queued, and the references they hold to the mount."""
        mount = str(mount)
        self.stopped.pop(mount, None)
        w = self.by_mount.pop(mount, None)
        if w is not None:
            self._close(w)
        for key in self._opened.pop(mount, ()):
            if self.openers.get(key) == mount:
                del self.openers[key]

    def _close(self, w: Watch) -> None:
        self.watches.pop(w.fd, None)
        if self._epoll is not None:
            try:
                self._epoll.unregister(w.fd)
            except OSError:
                pass
        os.close(w.fd)

    def close(self) -> None:
        for w in list(self.watches.values()):
            self._close(w)
        self.by_mount.clear()
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None

    def drain(self) -> int:
        """Read and record every queued event; returns how many were read."""
        if not self.watches or self._epoll is None:
            return 0
        n = 0
        for fd, _ in self._epoll.poll(0):
            w = self.watches.get(fd)
            if w is not None:
                n += self._read(w)
        return n

    def _read(self, w: Watch) -> int:
        n = 0
        while w.fd in self.watches:
            try:
                buf = os.read(w.fd, 64 * 1024)
            except BlockingIOError:
                break
            except OSError as e:
                log.warning("%s: reading its open events failed: %s", w.mount, e)
                self._stop(w, f"reading events failed: {e.strerror}")
                break
            events = list(_events(buf))
            n += len(events)
            rationed = w.take(len(events))
            for mask, efd in events:
                if mask & FAN_Q_OVERFLOW:
                    w.overflows += 1
                if efd < 0:
                    continue
                try:
                    if rationed:
                        self._one(w, efd)
                finally:
                    os.close(efd)
            if not rationed:
                self._stop(w, f"more than {BURST} opens at once, then {RATE:.0f}/s: "
                              "no longer attributed")
                break
        return n

    def _one(self, w: Watch, efd: int) -> None:
        w.events += 1
        try:
            st = os.fstat(efd)
        except OSError:
            return
        key = (st.st_dev, st.st_ino)
        if key in w.seen:
            # opened again: the kernel drops its later opens in this mount
            # from now on (a file opened once, as most are, costs no mark)
            found = w.seen[key]
            if w.ignored < IGNORE_MARKS:
                try:
                    _mark(w.fd, FAN_MARK_ADD | FAN_MARK_IGNORED_MASK
                          | FAN_MARK_IGNORED_SURV_MODIFY, FAN_OPEN | FAN_OPEN_EXEC, efd, None)
                    w.ignored += 1
                except Unavailable:
                    w.ignored = IGNORE_MARKS  # the user's mark budget: stop asking
            if found is not None:
                self._opener(found, w.mount)
            return
        try:
            link = os.readlink(f"/proc/self/fd/{efd}")
        except OSError:
            return
        found = None
        for k, rel in enumerate(_relative_paths(link, w.mount)):
            found = self.resolve(st.st_dev, st.st_ino, rel, w, k == 0)
            if found is not None:
                break
        if len(w.seen) < SEEN:
            w.seen[key] = found
        if found is None:
            return
        w.counted += 1
        self._opener(found, w.mount)
        self.on_open(w.mount, *found)

    def _stop(self, w: Watch, why: str) -> None:
        log.warning("%s: %s", w.mount, why)
        self.by_mount.pop(w.mount, None)
        self.stopped[w.mount] = why
        self._close(w)

    def _opener(self, key: tuple[str, int], mount: str) -> None:
        self.openers[key] = mount
        opened = self._opened.setdefault(mount, set())
        if len(opened) < SEEN:
            opened.add(key)
        if len(self.openers) > 1_000_000:  # bounded: the oldest go first
            for old in list(self.openers)[:100_000]:
                del self.openers[old]

    def opener(self, digest: str, index: int) -> str | None:
        return self.openers.get((digest, index))

    def snapshot(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {
            m: {"state": "watching", "events": w.events, "layer_files": w.counted,
                "overflows": w.overflows} for m, w in self.by_mount.items()}
        for m, why in self.stopped.items():
            out[m] = {"state": why}
        return out


_EVENT_FLAGS = os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC | os.O_NOATIME
GROUPS_SYSCTL = Path("/proc/sys/fs/fanotify/max_user_groups")
MAX_GROUPS = 1 << 16  # the most this raises it to: one group per composed mount


def _raise_group_limit() -> bool:
    """Double the host's fanotify groups per user (128 by default; the
    daemon's user holds one per composed mount), up to MAX_GROUPS; whether
    it was raised."""
    try:
        now = int(GROUPS_SYSCTL.read_text())
        if now >= MAX_GROUPS:
            return False
        GROUPS_SYSCTL.write_text(f"{min(MAX_GROUPS, now * 2)}\n")
    except (OSError, ValueError) as e:
        log.warning("cannot raise %s: %s", GROUPS_SYSCTL, e)
        return False
    log.info("raised %s from %d to %d", GROUPS_SYSCTL, now, min(MAX_GROUPS, now * 2))
    return True


def _relative_paths(link: str, mount: str) -> list[str]:
    """Where an opened file may be relative to its overlay's root, most
    likely first. The descriptor's link is its path in the opener's mount
    namespace: under `mount` in the daemon's, and elsewhere (a container's
    pivoted root: from "/"; a bind of the root under another path: below
    some prefix) in others; the resolver checks each by inode, so a wrong
    guess finds nothing."""
    prefix = mount.rstrip("/") + "/"
    if link.startswith(prefix):
        return [link[len(prefix):]]
    parts = [p for p in link.split("/") if p]
    return ["/".join(parts[k:]) for k in range(min(len(parts), 64))]


def _events(buf: bytes) -> list[tuple[int, int]]:
    """(mask, fd) of each event in a read; malformed tails are dropped."""
    out = []
    off = 0
    while off + _META.size <= len(buf):
        length, version, _, _, mask, fd, _ = _META.unpack_from(buf, off)
        if version != _METADATA_VERSION or length < _META.size:
            break
        out.append((mask, fd))
        off += length
    return out


class LayerFiles:
    """A Resolver over the daemon's loaded layers.

    overlayfs reports a lower file's own inode number (an EROFS nid) but not
    its device (each lower gets a pseudo device of the overlay's), so the
    layer is found by path and checked by inode: among the mount's image
    layers, top first, the one whose shared EROFS mount (`layer_mount`) has
    a regular file at that path with that inode number. A file of the
    writable layer (a copy-up, a new file) matches none. Each overlay
    device found is remembered per mount, so later events of it look at
    that one layer only, by path alone where the path is the likeliest
    guess (the mount's own path, or the root's in another namespace)."""

    def __init__(self, trees: Callable[[], Mapping[str, LayerTree]],
                 layer_mount: Callable[[str], Path]) -> None:
        self.trees = trees  # digest -> LayerTree of every loaded layer
        self.layer_mount = layer_mount

    def __call__(self, dev: int, ino: int, rel: str, w: Watch,
                 likeliest: bool) -> tuple[str, int] | None:
        trees = self.trees()
        known = w.devices.get(dev)
        for digest in ([known] if known is not None else w.layers):
            tree = trees.get(digest)
            if tree is None:
                continue
            i = tree.path_index(rel)
            if i is None or tree.entries[i].kind != Kind.FILE:
                continue
            if known is not None and likeliest:  # a device of this layer, the path as seen
                return digest, i
            try:
                st = os.stat(self.layer_mount(digest) / rel, follow_symlinks=False)
            except (OSError, ValueError):
                continue
            if st.st_ino == ino and stat.S_ISREG(st.st_mode):
                if len(w.devices) < 4096:
                    w.devices[dev] = digest
                return digest, i
        return None
