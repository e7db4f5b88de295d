"""The native data path: layers' blobs served by lazyfs-blobd (native/blobd.c).

The kernel path reads a layer through its EROFS mount, whose data device is
the layer's blob. With `native_blobs` on, that blob is a file of a second
FUSE mount served by a small C program instead of this Python daemon:

    ROOT/blobs-native/<digest>.data   the blob, served natively (fstype
                                      fuse.lazyfs-blobs); the EROFS mounts
                                      made while it runs read it
                                      (lazyfs.erofsmounts.acquire)
    ROOT/native-tables/<digest>.ext   the layer's extent table (written here,
                                      once per layer, when the server first
                                      looks the blob up)
    ROOT/native-tables/generation     8 bytes mapped by both: bumped to make
                                      the server forget its hot set
    ROOT/blobd.sock                   the server's requests and reports

The server reads chunks from the node cache and the local store's packs
itself (pread, zstd, an xxh3 check against the id: a mismatch is EIO and an
event, never bytes). What it cannot read (a cluster store, a chunk the
store's GC moved, a corrupt copy) it asks for here: BlobServer fetches it
through the fetch engine (the node cache's single flight, the store's
coalescing and retries, the fetch timeout) and answers with a memfd of the
bytes, which the server checks again.

Every read it serves is reported on the same socket before its reply
leaves, and BlobServer turns the report into exactly what the Python path
records for a blob read (lazyfs.fetch.FetchEngine.read_blob): the files
opened and read, per layer and per composed mount (the read ledger, traces,
`lazyfs stats`), cache hits and misses, bytes fetched. Reports are drained
before the control socket answers anything, so a question asked after a
read returns sees it.

Fail closed: the server connects before it mounts; only a peer whose pid is
the server's is listened to; when the daemon dies or closes the socket the
server unmounts (PR_SET_PDEATHSIG, and any failed send), and readers get
errors. When the server dies, BlobServer lazily detaches its mount and
starts another; EROFS mounts made over the dead one read errors, never
zeros (the next acquire remounts the layer, as after a daemon restart).

The extent table (see native/blobd.c for the byte layout) is the blob's
layout resolved once: each chunk's id, lengths and, for a local store, its
pack and offset, looked up in the store's index when the table is written
(not in LMDB per read: one lookup per chunk per daemon instead of one per
read). A location the store's GC has since moved reads another record's
header; the server then asks here, and the store looks the chunk up again.
"""

from __future__ import annotations

import array
import contextlib
import errno
import hashlib
import logging
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from chunkstore import ChunkId, ChunkStore
from chunkstore.cache import _domain_dir
from chunkstore.ids import id_digest

from . import sysmount
from .blob import LayerBlob
from .errors import DaemonError, FetchError

if TYPE_CHECKING:
    from .fs import LazyFS
    from .node import NodePaths

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "blobd.c"
FSTYPE = "fuse.lazyfs-blobs"

MAGIC = b"LZEXT\0\0\1"
VERSION = 1
_HEADER = struct.Struct("<8sIIQIIHHI")  # 40 bytes
_CHUNK = struct.Struct("<16sIIQQB3xI")  # 48
_SEG = struct.Struct("<QIII4x")  # 24
_REPORT = struct.Struct("<4xIQIIHHHHQQQ")  # 56 of a 64-byte message
_EVENT = struct.Struct("<4xIII")
_FETCH = struct.Struct("<4xII")
EV_MOUNTED, EV_CACHE_CORRUPT, EV_PACK_CORRUPT, EV_FAILED, EV_TIMEOUT = range(5)
READY_TIMEOUT = 10.0
# a reader walking the blob's files in order (a read-all, a compile of a
# tree): after WALK_AFTER misses in a row on the next files, the files ahead
# are fetched too, WALK_START at first, doubling to WALK_MAX files or
# WALK_BYTES per step (remote stores only: a local store needs no help)
WALK_AFTER = 3
WALK_START = 8
WALK_MAX = 256
WALK_BYTES = 16 << 20
MAX_READ = 1 << 20  # the mount's max_read, as blobd.c's MAX_READ
MAX_RESTARTS = 5  # in a minute; then the Python path serves new mounts


def _close(s: socket.socket) -> None:
    """Close a socket a task may be waiting on (trio is told first)."""
    if s.fileno() >= 0:
        with contextlib.suppress(RuntimeError):  # (outside trio: nobody waits)
            trio.lowlevel.notify_closing(s)
        s.close()


# -- building the server ---------------------------------------------------------

def build_dir() -> Path:
    """Where built servers are kept: root's /var/cache/lazyfs (no other user
    can write there: root runs what is in it), else the user's cache."""
    if os.geteuid() == 0:
        return Path("/var/cache/lazyfs")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lazyfs"


def binary(*, sanitize: bool = False, cache_dir: Path | None = None) -> Path:
    """The built lazyfs-blobd (built now if missing; cached by the hash of
    its source and flags). `sanitize`: with AddressSanitizer and UBSan."""
    cc = shutil.which("gcc") or shutil.which("cc")
    flags = ["-O2", "-g", "-Wall", "-Wextra", "-Werror", "-D_FILE_OFFSET_BITS=64"]
    if sanitize:
        flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                  "-fno-sanitize-recover=undefined"]
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    cache_dir = cache_dir or build_dir()
    out = cache_dir / f"lazyfs-blobd-{key}{'-asan' if sanitize else ''}"
    if out.exists():
        return out
    if cc is None:
        raise DaemonError("building lazyfs-blobd needs a C compiler (apt-get install gcc)")
    try:
        pc = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                            text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as e:
        raise DaemonError("building lazyfs-blobd needs libfuse3-dev and pkg-config "
                          f"(apt-get install libfuse3-dev pkg-config): {e}") from None
    cache_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".build-")
    os.close(fd)
    try:
        p = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), *pc, "-lzstd", "-lxxhash",
                            "-lpthread"], capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise DaemonError("building lazyfs-blobd failed (libfuse3-dev, libzstd-dev and "
                              f"libxxhash-dev needed): {p.stderr.strip()[-600:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def check_table(path: Path, *, server: Path | None = None) -> tuple[bool, str]:
    """Whether the server accepts a table file, and what it said."""
    p = subprocess.run([str(server or binary()), "--check", str(path)], capture_output=True,
                       text=True, check=False, timeout=60)
    return p.returncode == 0, (p.stdout + p.stderr).strip()


# -- extent tables ------------------------------------------------------------------

def table_bytes(layer_id: int, blob: LayerBlob, cache_dir: str,
                store: ChunkStore | None
                ) -> tuple[bytes, list[ChunkId], list[int], list[int]]:
    """The extent table of a layer's blob: every file chunk's blob range,
    its id and lengths, and (with a local store) where its record is; and
    the table's chunks (ids, and the entry of the first file holding each)."""
    tree, layout = blob.tree, blob.layout
    chunks: dict[bytes, int] = {}
    chunk_rows: list[tuple[bytes, int]] = []  # id, plain length
    first_entry: list[int] = []  # per chunk: the first file holding it, and where
    first_k: list[int] = []
    segs = bytearray()
    n_segs = 0
    for start, entry, offset, length in zip(layout.starts, layout.entries, layout.offsets,
                                            layout.lengths, strict=True):
        data = tree.file_data(entry)
        end = offset + length
        for k in data.span(offset, length):
            cid = data.ids[k]
            if cid is None:
                continue  # a hole: zeros
            c0, cn = data.starts[k], data.lengths[k]
            lo, hi = max(offset, c0), min(end, c0 + cn)
            if hi <= lo:
                continue
            raw = bytes(cid)
            ci = chunks.get(raw)
            if ci is None:
                ci = chunks[raw] = len(chunk_rows)
                chunk_rows.append((raw, cn))
                first_entry.append(entry)
                first_k.append(k)
            segs += _SEG.pack(start + lo - offset, hi - lo, ci, lo - c0)
            n_segs += 1
    located = {}
    packs = b""
    if store is not None:
        located = store.locate_many([ChunkId(r) for r, _ in chunk_rows], tree.domain)
        packs = os.fsencode(str(getattr(store.backend, "dir", "")))
        if not packs.startswith(b"/"):
            packs, located = b"", {}
    cache = os.fsencode(cache_dir)
    out = bytearray(_HEADER.pack(MAGIC, VERSION, layer_id, layout.size, len(chunk_rows),
                                 n_segs, len(cache), len(packs), 0))
    out += cache + packs
    out += bytes(-len(out) % 8)
    for raw, length in chunk_rows:
        e = located.get(ChunkId(raw))
        if e is not None and e.plain_len == length:
            out += _CHUNK.pack(raw, length, e.stored_len, e.pack, e.offset, e.codec, 0)
        else:
            out += _CHUNK.pack(raw, length, 0, 0, 0, 0, 0)
    out += segs
    return bytes(out), [ChunkId(r) for r, _ in chunk_rows], first_entry, first_k


# -- the server, from the daemon's side --------------------------------------------------

@dataclass
class _Layer:
    blob: LayerBlob
    ids: list[ChunkId]
    entries: list[int]  # per chunk: the first file holding it
    ks: list[int]  # and which of its chunks it is
    ahead: dict[int, int] = field(default_factory=dict)  # file -> last chunk queued
    # a walk through the blob's files (see BlobServer._walk): where the last
    # miss was, how many misses in a row were the next files, how far the
    # files ahead were queued, and how many at a time
    walk_at: int = -10
    walk_run: int = 0
    walk_to: int = -1
    walk_window: int = WALK_START
    _extent: dict[int, int] = field(default_factory=dict)

    def extent_of(self, entry: int) -> int:
        """The index of a file's first extent in the blob layout."""
        if not self._extent:
            for k, e in enumerate(self.blob.layout.entries):
                self._extent.setdefault(e, k)
        return self._extent.get(entry, -1)

    def what(self, ci: int) -> str:
        """A chunk of the table, for a log line: its id and its file."""
        tree = self.blob.tree
        return f"chunk {self.ids[ci]} of {tree.entries[self.entries[ci]].path}"


class BlobServer:
    """lazyfs-blobd run by the daemon: started after the FUSE mount, its
    requests answered and its reports accounted in the daemon's event loop,
    restarted if it dies, stopped (`close`) when the daemon stops."""

    def __init__(self, fs: LazyFS, paths: NodePaths, *, sanitize: bool = False) -> None:
        self.fs = fs
        self.paths = paths
        self.mnt = paths.native_blobs
        self.tables = paths.native_tables
        self.sock_path = paths.native_socket
        self.sanitize = sanitize
        self.proc: subprocess.Popen[bytes] | None = None
        self._fuse: int | None = None  # the FUSE connection (/dev/fuse), held across servers
        self.restarts: list[float] = []
        self.events = {"cache_corrupt": 0, "pack_corrupt": 0, "failed": 0, "timed_out": 0,
                       "restarts": 0}
        self.reports = 0
        self.spilled = 0  # chunks the server handed over for the node cache
        self._layers: list[_Layer] = []
        self._ids: dict[str, int] = {}
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._generation: mmap.mmap | None = None
        self._mounted = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._binary: Path | None = None

    # -- lifecycle --

    async def start(self, nursery: trio.Nursery) -> None:
        """Build (once), listen, spawn, and wait until its mount is up."""
        self._nursery = nursery
        self._binary = await trio.to_thread.run_sync(
            lambda: binary(sanitize=self.sanitize))
        self._prepare()
        nursery.start_soon(self._accept)
        await self._spawn()
        nursery.start_soon(self._watch)

    def _prepare(self) -> None:
        shutil.rmtree(self.tables, ignore_errors=True)
        self.tables.mkdir(mode=0o700)
        gen = self.tables / "generation"
        gen.write_bytes(bytes(8))
        with open(gen, "r+b") as f:
            self._generation = mmap.mmap(f.fileno(), 8)
        self.sock_path.unlink(missing_ok=True)
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        os.fchmod(ls.fileno(), 0o600)  # (the mode bind gives it; never the shared umask)
        ls.bind(str(self.sock_path))
        ls.listen(128)
        ls.setblocking(False)
        self._listener = ls

    async def _spawn(self, *, resume: bool = False) -> None:
        self._mounted = trio.Event()
        self._popen(resume=resume)
        assert self.proc is not None
        with trio.move_on_after(READY_TIMEOUT):
            while self.proc.poll() is None and not self._mounted.is_set():
                with trio.move_on_after(0.1):
                    await self._mounted.wait()
        if not self._mounted.is_set():
            code = self.proc.poll()
            self._kill()
            raise DaemonError(f"lazyfs-blobd did not mount {self.mnt} "
                              f"({'exit code ' + str(code) if code is not None else 'timed out'}; "
                              "see the daemon's log)")
        log.info("native blob server pid %d serving %s", self.proc.pid, self.mnt)

    def _popen(self, *, resume: bool) -> None:
        """Start a server: on a new mount, or (`resume`) on the connection a
        dead one served, which this process held: its readers waited."""
        if not resume or self._fuse is None:
            resume = False
            self._abort()
            self.mnt.mkdir(mode=0o700, exist_ok=True)
            self._fuse = self._mount()
        o = self.fs.options
        assert self._binary is not None
        env = dict(os.environ)
        if self.sanitize:  # a finding ends the server with a report in the daemon's log
            env.setdefault("ASAN_OPTIONS", "abort_on_error=0:exitcode=66:detect_leaks=0")
            env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1:exitcode=67")
        # (from the event loop's thread: PR_SET_PDEATHSIG follows the thread that forks)
        self.proc = subprocess.Popen(
            [str(self._binary), str(self.mnt), str(self.tables), str(self.sock_path),
             str(max(1, o.hot_bytes >> 20)), str(max(1, round(o.fetch_timeout))),
             str(self._fuse), *(["resume"] if resume else [])],
            stdin=subprocess.DEVNULL, env=env, close_fds=True, pass_fds=(self._fuse,))

    def _mount(self) -> int:
        """The blobs' FUSE mount, made here (fd=N): the connection is this
        process's, so a server's death leaves it up for the next server."""
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            sysmount.mount("lazyfs-blobs", self.mnt, FSTYPE,
                           sysmount.MS_RDONLY | sysmount.MS_NOSUID | sysmount.MS_NODEV,
                           f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,"
                           f"default_permissions,max_read={MAX_READ}")
        except OSError:
            os.close(fd)
            raise
        return fd

    def _abort(self) -> None:
        """End the connection (its readers get errors) and detach the mount."""
        if self._fuse is not None:
            os.close(self._fuse)
            self._fuse = None
        self._detach_mount()

    async def _watch(self) -> None:
        """Restart a server that died (its readers got errors)."""
        while True:
            await trio.sleep(0.2)
            if self.proc is None or self.proc.poll() is None:
                continue
            code = self.proc.returncode
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < 60] + [now]
            self.events["restarts"] += 1
            self.fs.fetch.tracer.error()
            self._close_conns()
            if len(self.restarts) > MAX_RESTARTS:
                log.error("native blob server died (exit %s) %d times in a minute; its "
                          "readers get errors, new mounts read through the Python path",
                          code, len(self.restarts))
                self._abort()
                self.proc = None
                return
            log.error("native blob server died (exit %s): starting another on its "
                      "connection (its readers wait for it)", code)
            try:
                await self._spawn(resume=True)
            except DaemonError as e:  # (its readers got errors: a new mount for new readers)
                log.error("%s; its readers got errors, starting one on a new mount", e)
                try:
                    await self._spawn()
                except DaemonError as e2:
                    log.error("%s", e2)
                    self.proc = None
                    return

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._abort()

    def _detach_mount(self) -> None:
        if sysmount.is_mount_point(self.mnt):
            with contextlib.suppress(OSError):
                sysmount.umount(self.mnt, lazy=True)

    def close(self) -> None:
        """Stop the server and leave nothing: no process, mount, socket, tables."""
        self._kill()
        self.proc = None
        self._close_conns()
        if self._listener is not None:
            _close(self._listener)
            self._listener = None
        self.sock_path.unlink(missing_ok=True)
        if self._generation is not None:
            self._generation.close()
            self._generation = None
        shutil.rmtree(self.tables, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.mnt.rmdir()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def drop_hot(self) -> None:
        """Make the server forget the chunks it holds in memory."""
        if self._generation is not None:
            (n,) = struct.unpack_from("<Q", self._generation)
            struct.pack_into("<Q", self._generation, 0, n + 1)

    def snapshot(self) -> dict[str, object]:
        return {"pid": self.pid, "mount": str(self.mnt), "layers": len(self._layers),
                "reports": self.reports, "spilled": self.spilled, **self.events}

    # -- the socket --

    async def _accept(self) -> None:
        assert self._listener is not None and self._nursery is not None
        ls = self._listener
        while True:
            await trio.lowlevel.wait_readable(ls)
            try:
                conn, _ = ls.accept()
            except BlockingIOError:
                continue
            except OSError as e:
                log.warning("native blob socket: accept failed: %s", e)
                await trio.sleep(0.1)
                continue
            pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      12))[0]
            if self.proc is None or pid != self.proc.pid:
                log.warning("native blob socket: connection from pid %d refused (not the "
                            "server)", pid)
                conn.close()
                continue
            conn.setblocking(False)
            self._conns.append(conn)
            self._nursery.start_soon(self._serve_conn, conn)

    async def _serve_conn(self, conn: socket.socket) -> None:
        try:
            while conn.fileno() >= 0:
                await trio.lowlevel.wait_readable(conn)
                if not self._pump(conn):
                    break
        except (OSError, trio.ClosedResourceError):
            pass
        finally:
            if conn in self._conns:
                self._conns.remove(conn)
            _close(conn)

    def _close_conns(self) -> None:
        for c in self._conns:
            _close(c)
        self._conns.clear()

    def drain(self) -> None:
        """Account every report the server has sent so far."""
        for conn in list(self._conns):
            if not self._pump(conn):
                self._conns.remove(conn)
                _close(conn)

    def _pump(self, conn: socket.socket) -> bool:
        """Handle what one connection has queued; False once it closed."""
        while True:
            try:
                m, anc, _flags, _ = conn.recvmsg(512, socket.CMSG_SPACE(4))
            except BlockingIOError:
                return True
            except OSError:
                return False
            fds = [fd for level, typ, data in anc
                   if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS
                   for fd in array.array("i", data[:len(data) - len(data) % 4])]
            if not m:
                for fd in fds:
                    os.close(fd)
                return False
            kind = m[:1]
            spill = fds.pop() if kind == b"S" and len(m) == 64 and len(fds) == 1 else None
            for fd in fds:  # (a descriptor only a spill carries)
                os.close(fd)
            if spill is not None:
                self._spill(m, spill)
            elif kind == b"R" and len(m) == 64:
                self._report(m)
            elif kind == b"E" and len(m) == 64:
                self._event(m)
            elif kind in (b"F", b"T"):
                assert self._nursery is not None
                self._nursery.start_soon(self._request, conn, m)
            else:
                log.error("native blob socket: malformed message (%d bytes)", len(m))
                return False

    async def _request(self, conn: socket.socket, m: bytes) -> None:
        fd = -1
        try:
            if m[:1] == b"T":
                status = await self._table(m)
            else:
                status, fd = await self._fetch(m)
        except Exception:  # the server gets EIO, the daemon lives
            log.exception("native blob request failed")
            status = errno.EIO
        reply = struct.pack("<I12x", status)
        try:
            while True:
                try:
                    if fd >= 0:
                        conn.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                array.array("i", [fd]))])
                    else:
                        conn.send(reply)
                    break
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(conn)
        except OSError:
            pass  # (the server is gone)
        finally:
            if fd >= 0:
                os.close(fd)

    async def _table(self, m: bytes) -> int:
        n = m[4]
        try:
            digest = m[8:8 + n].decode("ascii")
        except UnicodeDecodeError:
            return errno.ENOENT
        if len(m) != 8 + n:
            return errno.EINVAL
        try:
            blob = await self.fs._lookup_blob(digest)
        except Exception:  # noqa: BLE001 - FUSEError(ENOENT/EIO), logged by the lookup
            return errno.ENOENT if digest not in self.fs.layers.by_digest else errno.EIO
        lid = self._ids.get(digest)
        if lid is None:
            lid = len(self._layers)
            self._layers.append(_Layer(blob, [], [], []))
            self._ids[digest] = lid
        layer = self._layers[lid]
        store = self.fs.fetch.local_store
        cache_dir = f"{self.fs.fetch.cache.root}/{_domain_dir(str(blob.tree.domain))}"
        data, layer.ids, layer.entries, layer.ks = await trio.to_thread.run_sync(
            table_bytes, lid, blob, cache_dir, store)
        path = self.tables / f"{digest}.ext"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return 0

    async def _fetch(self, m: bytes) -> tuple[int, int]:
        lid, ci = _FETCH.unpack_from(m)
        if lid >= len(self._layers) or ci >= len(self._layers[lid].ids):
            return errno.EINVAL, -1
        layer = self._layers[lid]
        tree = layer.blob.tree
        try:
            [data] = await self.fs.fetch._fetch(tree, layer.what(ci),
                                                [layer.ids[ci]], foreground=True, keep=True)
        except FetchError:
            return errno.EIO, -1  # (logged and counted by the engine)
        self._readahead(layer, ci)
        self._walk(layer, ci)
        fd = os.memfd_create("lazyfs-chunk", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            os.close(fd)
            raise
        return 0, fd

    def _readahead(self, layer: _Layer, ci: int) -> None:
        """A chunk the server could not read itself (a cluster store) was
        fetched: the next chunks of the same file follow in the background
        (EROFS reads a file's blocks in order), never its neighbours in the
        blob, as the Python path's blob readahead does."""
        n = self.fs.options.blob_readahead_chunks
        fetch = self.fs.fetch
        if not n or fetch.nursery is None or fetch.quiet_layers[layer.blob.tree.digest]:
            return
        tree, i, k = layer.blob.tree, layer.entries[ci], layer.ks[ci]
        ids = tree.file_data(i).ids
        first = max(k + 1, layer.ahead.get(i, -1) + 1)
        stop = min(k + n, len(ids) - 1)
        ahead = [c for c in ids[first:stop + 1] if c is not None]
        if not ahead:
            return
        if len(layer.ahead) > 1024:
            layer.ahead.clear()
        layer.ahead[i] = stop
        fetch.nursery.start_soon(fetch._prefetch, tree, i, ahead)

    def _walk(self, layer: _Layer, ci: int) -> None:
        """A miss on the first chunk of a file: when the last misses were
        the files right before it in the blob (or the reader caught up with
        the files queued ahead), fetch the next files' chunks in the
        background, in blob order (neighbours in the blob are neighbours in
        the cluster's packs: one ranged GET for many). A reader that jumps
        around resets it, so a workload reading a few files of a tree
        fetches what it reads."""
        fetch = self.fs.fetch
        if (fetch.local_store is not None or not self.fs.options.blob_readahead_chunks
                or fetch.nursery is None or fetch.quiet_layers[layer.blob.tree.digest]
                or layer.ks[ci] != 0):
            return
        pos = layer.extent_of(layer.entries[ci])
        if pos < 0:
            return
        caught_up = layer.walk_to >= 0 and layer.walk_at < pos <= layer.walk_to + 2
        if caught_up or 0 < pos - layer.walk_at <= 2:
            layer.walk_run += 1
        else:
            layer.walk_run, layer.walk_to, layer.walk_window = 0, -1, WALK_START
        layer.walk_at = pos
        if layer.walk_run < WALK_AFTER:
            return
        layout, tree = layer.blob.layout, layer.blob.tree
        first = max(pos + 1, layer.walk_to + 1)
        stop = min(len(layout.entries), pos + 1 + layer.walk_window)
        ids: list[ChunkId] = []
        nbytes = 0
        k = first
        while k < stop and nbytes < WALK_BYTES:
            data = tree.file_data(layout.entries[k])
            for j in data.span(layout.offsets[k], layout.lengths[k]):
                cid = data.ids[j]
                if cid is not None and not fetch.cache.contains(cid, tree.domain):
                    ids.append(cid)
                    nbytes += data.lengths[j]
            k += 1
        layer.walk_to = k - 1
        layer.walk_window = min(WALK_MAX, layer.walk_window * 2)
        ids = list(dict.fromkeys(ids))
        for n in range(0, len(ids), 64):
            fetch.nursery.start_soon(fetch._fetch_batch, tree, ids[n:n + 64])

    def _spill(self, m: bytes, fd: int) -> None:
        """A chunk the server decoded from a pack and dropped from its hot set
        before serving all of it: kept in the node cache (checked first), so
        its other parts do not come from the store again (as
        FetchEngine._spill_partial). The descriptor is closed here."""
        try:
            lid, ci = struct.unpack_from("<II", m, 4)
            layer = self._layers[lid] if lid < len(self._layers) else None
            if layer is None or ci >= len(layer.ids) or layer.ids[ci] is None:
                return
            cid = layer.ids[ci]
            data = os.pread(fd, min(os.fstat(fd).st_size, 64 << 20), 0)
            if id_digest(data) != bytes(cid):
                log.error("native blob socket: a spilled chunk fails its id; not kept")
                return
            self.spilled += 1
            self.fs.fetch.cache.keep(cid, layer.blob.tree.domain, data)
        finally:
            os.close(fd)

    def _event(self, m: bytes) -> None:
        lid, ci, kind = _EVENT.unpack_from(m)
        if kind == EV_MOUNTED:
            self._mounted.set()
            return
        layer = self._layers[lid] if lid < len(self._layers) else None
        cid = layer.ids[ci] if layer is not None and ci < len(layer.ids) else None
        digest = layer.blob.tree.digest if layer is not None else "?"
        what = layer.what(ci) if layer is not None and cid is not None else f"chunk {ci}"
        if kind == EV_CACHE_CORRUPT and layer is not None and cid is not None:
            self.events["cache_corrupt"] += 1
            log.error("node cache: %s in layer %s is corrupt; dropped and fetched again",
                      what, digest)
            cache = self.fs.fetch.cache
            cache._forget((str(layer.blob.tree.domain), bytes(cid)), unlink=True)
            cache.stats.corrupt_dropped += 1
        elif kind == EV_PACK_CORRUPT:
            self.events["pack_corrupt"] += 1
            log.error("local store: %s in layer %s fails its check in its pack", what, digest)
        elif kind == EV_TIMEOUT:
            self.events["timed_out"] += 1
            self.fs.fetch.tracer.error()
            log.error("native read in layer %s timed out after %ss: answered EIO",
                      digest, self.fs.options.fetch_timeout)
        elif kind == EV_FAILED:
            self.events["failed"] += 1
            self.fs.fetch.tracer.error()
            log.error("native read of %s in layer %s failed", what, digest)

    def _report(self, m: bytes) -> None:
        """One read the server served: accounted as FetchEngine.read_blob
        accounts one (files opened and read, per mount; cache figures)."""
        (lid, off, length, pid, hot, cached, packed, fetched, pack_bytes, _fetched_bytes,
         latency_us) = _REPORT.unpack_from(m)
        if lid >= len(self._layers):
            return
        self.reports += 1
        fetch = self.fs.fetch
        tree = self._layers[lid].blob.tree
        stats = fetch.cache.stats
        stats.hits += cached
        stats.misses += packed
        stats.fetched_bytes += pack_bytes
        stats.served_bytes += length
        pieces = self._layers[lid].blob.pieces(off, length)
        ranges = [(p.entry, p.file_offset, p.length) for p in pieces if p.entry >= 0]
        if not ranges:
            return
        fallback = self.fs.attribute(pid) if pid else ""
        if fetch.opens is not None:
            fetch.opens.drain()
            mounts = [fetch.opens.opener(tree.digest, i) or fallback for i, _, _ in ranges]
        else:
            mounts = [fallback] * len(ranges)
        for (i, _, _), mount in zip(ranges, mounts, strict=True):
            fetch.tracer.opened(tree, i, mount)
        latency = latency_us / 1e6
        for n, ((i, o, size), mount) in enumerate(zip(ranges, mounts, strict=True)):
            span = tree.file_data(i).span(o, size)
            fetch.tracer.read(tree, i, span, mount, latency,
                              hits=hot + cached if n == 0 else 0,
                              misses=packed + fetched if n == 0 else 0)


def main(argv: list[str] | None = None) -> int:
    """`python -m lazyfs.nativeblobs build [--sanitize]`: build the server
    (install.sh does, so a daemon never waits for gcc) and print its path."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m lazyfs.nativeblobs",
                                description="Build lazyfs-blobd, the native blob server.")
    p.add_argument("what", choices=["build"])
    p.add_argument("--sanitize", action="store_true", help="with ASan + UBSan")
    a = p.parse_args(argv)
    try:
        print(binary(sanitize=a.sanitize))
    except DaemonError as e:
        print(f"lazyfs-blobd: error: {e}", file=__import__("sys").stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
