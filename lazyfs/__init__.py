"""The lazy image filesystem of a node: one pyfuse3 + trio daemon per node
serving every layer as a read-only tree and a flat blob, chunks fetched on
first read through the node cache, access traces and prefetch (daemon.py,
fs.py, tree.py, blob.py, trace.py); composed roots over the layers
(mounts.py, erofsmounts.py); the node API that starts, finds and stops the
daemon and opens the catalog it serves (node.py); the machine's settings,
shared with the CLI and the runtime (settings.py).

Importing the package is light (nothing is imported here): lazyfs.settings
and lazyfs.errors are used by processes that only talk HTTP.
"""
