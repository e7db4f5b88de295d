"""The lazyfs daemon's serving options: one value, read by the FUSE adapter
(lazyfs/fs.py: kernel cache timeouts, keep_cache, direct_io of blobs) and by
the fetch engine (lazyfs/fetch.py: thread pools, timeout, hot set,
readahead). Where the values come from (command line, config file) is the
callers' business, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Options:
    # -- the fetch engine (lazyfs/fetch.py) --
    fetch_threads: int = 8
    prefetch_threads: int = 2
    fetch_timeout: float = 30.0
    readahead_chunks: int = 2
    hot_bytes: int = 32 << 20  # recently read chunks kept in memory (a 256 KiB chunk
    # serves two 128 KiB FUSE reads; the second should not go to a thread)
    # chunks fetched ahead of a sequential reader of a blob: EROFS asks for
    # 128 KiB at a time, one request in flight, so the next chunks must be
    # in memory before it asks (0: off)
    blob_readahead_chunks: int = 8
    # a foreground fetch of at most this many bytes from a local source (the
    # store on this node's disk, or chunks already in the node cache) runs on
    # the event loop itself: one pread and a zstd decode take ~50 us, a
    # round trip through a worker thread ~250 us on a 2-core VM, and a cold
    # read-all is one serial request per small file (0: always a thread)
    inline_fetch_bytes: int = 1 << 20
    # chunks read from a local store are copied into the node cache too
    # (off: the store already is on local disk, and writing one cache file per
    # chunk halved cold reads; trace prefetch keeps them either way)
    keep_local_reads: bool = False
    # automatic traces (lazyfs/autotrace.py): how long the first use of an
    # image on a node is recorded when the store has no trace of it (0: no
    # automatic recording or replay)
    auto_trace_seconds: float = 30.0
    # the kernel path's per-mount attribution (lazyfs/opens.py): each composed
    # mount's opens, read from a fanotify group of its own
    attribute_opens: bool = True
    # the kernel path's blobs (the data devices of the layers' EROFS mounts)
    # served by the native server, lazyfs-blobd (lazyfs/nativeblobs.py), not
    # by this process; `native_sanitize` builds it with ASan + UBSan (debugging)
    native_blobs: bool = True
    native_sanitize: bool = False
    # -- the FUSE adapter (lazyfs/fs.py) --
    keep_cache: bool = True  # keep the page cache across opens (content is immutable)
    cache_timeout: float = 24 * 3600.0  # entry/attr timeouts (metadata is immutable)
    # blob files bypass the FUSE page cache: the kernel EROFS mount over a blob
    # caches file pages itself (one copy, not two), and FUSE readahead on the
    # blob would fetch the neighbouring files' chunks. Off for users that must
    # mmap a blob (FUSE refuses shared mmap of direct_io files).
    blob_direct_io: bool = True
