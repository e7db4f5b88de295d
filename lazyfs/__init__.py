"""The FUSE lazy image filesystem (to be built by the lazyfs issue): one
pyfuse3 + trio daemon per node serving every layer as a read-only tree and a
flat blob, chunks fetched on first read through the node cache, access
traces and prefetch, mount helpers.

Nothing here yet; see ARCHITECTURE.md.
"""
