"""The least a FUSE server can do for a kernel EROFS mount: one read-only,
direct_io file `blob` whose reads are preads of a local file, served by
pyfuse3 under trio like the lazyfs daemon (same libfuse, same options, one
worker task by default). bench_cold mounts EROFS from it to measure what the
FUSE round trip itself costs, apart from what lazyfs does per read (fetch,
decode, checks, tracing).

    python -m benchmarks.fuse_proxy MOUNTPOINT FILE [--max-tasks N]

Prints "ready" once mounted; unmounts on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys

import pyfuse3
import trio

ROOT, BLOB = pyfuse3.ROOT_INODE, 2


class Proxy(pyfuse3.Operations):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self.reads = 0

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.st_mode = (stat.S_IFDIR | 0o755) if inode == ROOT else (stat.S_IFREG | 0o444)
        a.st_nlink = 1
        a.st_size = 0 if inode == ROOT else self.size
        a.st_blksize = 128 << 10
        a.st_blocks = a.st_size // 512
        a.entry_timeout = a.attr_timeout = 86400
        return a

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        if inode not in (ROOT, BLOB):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if parent_inode != ROOT or name != b"blob":
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(BLOB)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        if inode != BLOB:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=1, direct_io=True)  # as lazyfs serves a layer's blob

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.reads += 1
        return os.pread(self.fd, size, off)


async def _serve(max_tasks: int) -> None:
    async with trio.open_nursery() as nursery:
        async def stop() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    pyfuse3.terminate()
                    return
        nursery.start_soon(stop)
        print("ready", flush=True)
        await pyfuse3.main(max_tasks=max_tasks)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mountpoint")
    ap.add_argument("file")
    ap.add_argument("--max-tasks", type=int, default=1)
    args = ap.parse_args(argv)
    fs = Proxy(args.file)
    pyfuse3.init(fs, args.mountpoint, set(pyfuse3.default_options) | {
        "fsname=fuse-proxy", "ro", "allow_other"})
    try:
        trio.run(_serve, args.max_tasks)
    finally:
        pyfuse3.close(unmount=True)
    print(f"reads {fs.reads}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
