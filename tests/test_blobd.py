"""lazyfs-blobd alone, against random layouts: every byte of every read is
the model's, whatever the extents look like.

The daemon's side is a stand-in here (it says so: a small protocol speaker
in this file), because the real daemon only writes tables of real images,
and an image cannot be made to hold, on demand, the hostile layouts this
checks: thousands of extents of a few bytes in one 1 MiB read, extents
back to back with no gap, gaps of every size, a chunk used by many
extents. The server, its FUSE mount and the kernel's reads are real."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from lazyfs import nativeblobs
from tests.helpers.lazynode import fuse_missing
from tests.helpers.support import wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))]

DIGEST = "blake3:" + "ab" * 32


class StandIn:
    """The daemon's end of the socket: accepts the server, records reports,
    answers every fetch with EIO (every chunk is in the cache dir: one the
    server cannot use there, the daemon could not get either), or, with
    `hang`, never answers a fetch (a daemon stuck on a dead backend)."""

    def __init__(self, path: Path, hang: bool = False) -> None:
        self.hang = hang
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(path))
        self.sock.listen(64)
        self.reports: list[tuple[int, int]] = []
        self.events: list[int] = []
        self.mounted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the accepting thread)
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    m = conn.recv(512)
                except OSError:
                    return
                if not m:
                    return
                if m[:1] == b"R":
                    _, off, n = struct.unpack_from("<IQI", m, 4)
                    self.reports.append((off, n))
                elif m[:1] == b"E":
                    kind = struct.unpack_from("<I", m, 12)[0]
                    self.events.append(kind)
                    if kind == 0:
                        self.mounted.set()
                elif not self.hang:
                    conn.send(struct.pack("<I12x", errno.EIO))


def _layout(rng: random.Random, size: int, tiny: bool
            ) -> tuple[list[bytes], list[tuple[int, int, int, int]]]:
    """Random chunks, and segments (blob offset, length, chunk, chunk offset)."""
    chunks = [rng.randbytes(rng.randint(1, 200_000)) for _ in range(40)]
    segs = []
    pos = 0
    while pos < size:
        pos += rng.choice([0, 0, 1, 7, 300, 4095, 70_000]) if not tiny else rng.choice([0, 1, 3])
        c = rng.randrange(len(chunks))
        co = rng.randrange(len(chunks[c]))
        n = min(len(chunks[c]) - co, rng.randint(1, 6) if tiny else rng.randint(1, 150_000),
                max(1, size - pos))
        if pos + n > size:
            break
        segs.append((pos, n, c, co))
        pos += n
    return chunks, segs


def _table(cache: Path, size: int, chunks: list[bytes],
           segs: list[tuple[int, int, int, int]]) -> bytes:
    cdir = os.fsencode(str(cache))
    out = bytearray(struct.pack("<8sIIQIIHHI", nativeblobs.MAGIC, 1, 0, size, len(chunks),
                                len(segs), len(cdir), 0, 0))
    out += cdir + bytes(-(len(out) + len(cdir)) % 8)
    for data in chunks:
        out += struct.pack("<16sIIQQB3xI", xxhash.xxh3_128_digest(data), len(data), 0, 0, 0,
                           0, 0)
    for s in segs:
        out += struct.pack("<QIII4x", *s)
    return bytes(out)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []
    mounts: list[Path] = []
    daemons: list[StandIn] = []

    def start(size: int, chunks: list[bytes], segs: list[tuple[int, int, int, int]],
              corrupt: int | None = None, missing: int | None = None,
              hang: bool = False) -> tuple[Path, StandIn]:
        d = tmp_path / f"s{len(procs)}"
        cache, tables, mnt = d / "cache", d / "tables", d / "mnt"
        for p in (cache, tables, mnt):
            p.mkdir(parents=True)
        for i, data in enumerate(chunks):
            if i == missing:
                continue
            h = xxhash.xxh3_128_hexdigest(data)
            (cache / h[:2]).mkdir(exist_ok=True)
            bad = bytes([data[0] ^ 1]) + data[1:] if i == corrupt else data
            (cache / h[:2] / h).write_bytes(bad)
        (tables / f"{DIGEST}.ext").write_bytes(_table(cache, size, chunks, segs))
        (tables / "generation").write_bytes(bytes(8))
        daemon = StandIn(d / "s.sock", hang)
        daemons.append(daemon)
        procs.append(subprocess.Popen([str(nativeblobs.binary()), str(mnt), str(tables),
                                       str(d / "s.sock"), "8", "5"]))
        mounts.append(mnt)
        assert daemon.mounted.wait(20), "the server did not mount"
        return mnt / f"{DIGEST}.data", daemon

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)  # (with a worker hung on the daemon too)
    for m in mounts:
        gone = m
        wait_until(lambda: not os.path.ismount(gone), 10, f"{m} unmounted")  # noqa: B023
    for daemon in daemons:
        daemon.close()


def _model(size: int, chunks: list[bytes], segs: list[tuple[int, int, int, int]]) -> bytes:
    blob = bytearray(size)
    for off, n, c, co in segs:
        blob[off:off + n] = chunks[c][co:co + n]
    return bytes(blob)


@pytest.mark.parametrize("tiny", [False, True], ids=["mixed-extents", "tiny-extents"])
def test_every_read_of_a_random_layout_is_the_models_bytes(serve: object, tiny: bool) -> None:
    rng = random.Random(1 + tiny)
    size = 3 << 20
    chunks, segs = _layout(rng, size, tiny)
    want = _model(size, chunks, segs)
    path, daemon = serve(size, chunks, segs)  # type: ignore[operator]
    assert os.stat(path).st_size == size
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(150):
            off = rng.choice([0, rng.randrange(size), size - rng.randint(1, 5000)])
            n = rng.choice([1, 4096, 131072, 1 << 20, rng.randint(1, 1 << 20)])
            assert os.pread(fd, n, off) == want[off:off + n], (off, n)
        assert os.pread(fd, 100, size) == b""
    finally:
        os.close(fd)
    assert daemon.reports and all(off + n <= size for off, n in daemon.reports)
    if tiny:  # a 1 MiB read of these holds far more pieces than one writev takes
        assert len(segs) > 100_000


def test_a_chunk_whose_bytes_fail_their_id_is_eio_and_the_rest_reads(serve: object) -> None:
    rng = random.Random(7)
    size = 2 << 20
    chunks, segs = _layout(rng, size, False)
    want = _model(size, chunks, segs)
    path, daemon = serve(size, chunks, segs, corrupt=3)  # type: ignore[operator]
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, n, c, _ in segs[:60]:
            if c == 3:
                with pytest.raises(OSError) as e:
                    os.pread(fd, n, off)
                assert e.value.errno == errno.EIO
            else:
                assert os.pread(fd, n, off) == want[off:off + n]
    finally:
        os.close(fd)
    if any(c == 3 for _, _, c, _ in segs[:60]):
        assert 1 in daemon.events  # told the daemon: the cached copy is corrupt


def test_a_read_the_daemon_never_answers_is_eio_after_the_fetch_timeout(serve: object) -> None:
    """A chunk only the daemon can get, and a daemon that never answers: the
    read gets EIO once the server's fetch timeout (5 s here) has passed, not
    a hang; it is not reported as served; other chunks still read; and the
    server still stops with that worker stuck."""
    rng = random.Random(11)
    size = 2 << 20
    chunks, segs = _layout(rng, size, False)
    want = _model(size, chunks, segs)
    lost = segs[0][2]
    path, daemon = serve(size, chunks, segs, missing=lost, hang=True)  # type: ignore[operator]
    fd = os.open(path, os.O_RDONLY)
    try:
        off, n = segs[0][0], segs[0][1]
        t0 = time.monotonic()
        with pytest.raises(OSError) as e:
            os.pread(fd, n, off)
        took = time.monotonic() - t0
        assert e.value.errno == errno.EIO
        assert 4.5 < took < 8, f"answered after {took:.1f} s"  # (the socket gives up at 10)
        wait_until(lambda: 4 in daemon.events, 5, "the timeout event")
        assert (off, n) not in daemon.reports
        other = next(s for s in segs if s[2] != lost)
        assert os.pread(fd, other[1], other[0]) == want[other[0]:other[0] + other[1]]
    finally:
        os.close(fd)
