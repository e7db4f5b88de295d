"""The node's images as the runtime needs them: the catalog (local store or
cluster) to resolve names, and the node's lazyfs daemon to serve layers.

The daemon is a separate process shared by every sandbox on the node; when
none answers at the configured root, one is started in the background with
the `lazyfs daemon` command (the same code path operators run) and its log in
NODE_ROOT/daemon.log.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.errors import ChunkStoreError
from chunkstore.objects import open_object_store
from composer.catalog import Catalog, ImageCatalog
from composer.errors import ComposerError
from composer.errors import ImageNotFound as CatalogImageNotFound
from composer.remote import ClusterCatalog
from lazyfs.daemon import NodePaths, running

from .config import RuntimeConfig
from .errors import BackendUnavailable, ImageNotFound
from .spec import ResolvedImage

READY_TIMEOUT = 30.0
REPO = Path(__file__).resolve().parent.parent


# LMDB allows one open environment per store per process: nodes in one
# process (an embedded node and a test's second node) share it.
_local: dict[Path, tuple[ChunkStore, Catalog, int]] = {}
_local_lock = threading.Lock()


def _local_catalog(store_path: Path) -> Catalog:
    key = store_path.resolve()
    with _local_lock:
        if key in _local:
            store, cat, n = _local[key]
            _local[key] = (store, cat, n + 1)
            return cat
        store = ChunkStore.open(key, readonly=True)
        try:
            cat = Catalog(store)
        except BaseException:
            store.close()
            raise
        _local[key] = (store, cat, 1)
        return cat


def _release_local(store_path: Path) -> None:
    key = store_path.resolve()
    with _local_lock:
        store, cat, n = _local[key]
        if n > 1:
            _local[key] = (store, cat, n - 1)
            return
        del _local[key]
    cat.close()
    store.close()


class Images:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.paths = NodePaths(config.node_root.absolute())
        self._lock = threading.Lock()
        self._stack = contextlib.ExitStack()
        self._catalog: ImageCatalog | None = None

    def catalog(self) -> ImageCatalog:
        with self._lock:
            if self._catalog is None:
                try:
                    if self.config.cluster:
                        cluster = self._stack.enter_context(
                            Cluster(open_object_store(self.config.cluster)))
                        self._catalog = ClusterCatalog(cluster)
                    else:
                        self._catalog = _local_catalog(self.config.store)
                        self._stack.callback(_release_local, self.config.store)
                except (ChunkStoreError, ComposerError, OSError) as e:
                    where = self.config.cluster or self.config.store
                    raise BackendUnavailable(f"cannot open the image store {where}: {e}") from e
            return self._catalog

    def resolve(self, name: str) -> str:
        """The image's digest; ImageNotFound names what was asked."""
        return self.resolve_image(name).digest

    def resolve_image(self, name: str) -> ResolvedImage:
        """What `name` names now: its content digest and layers, in one catalog
        read. The node calls this once per sandbox, at create."""
        try:
            digest, image = self.catalog().resolve(name)
        except CatalogImageNotFound:
            raise ImageNotFound(f"no image {name!r} in {self.config.cluster or self.config.store}"
                                " (lazyfs images lists them)") from None
        return ResolvedImage(name=name, digest=digest, layers=tuple(image.layers))

    def ensure_daemon(self) -> NodePaths:
        with self._lock:
            if running(self.paths):
                return self.paths
            if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
                raise BackendUnavailable("lazy image roots need root and /dev/fuse "
                                         "(the lazyfs daemon mounts FUSE with allow_other)")
            self.paths.root.mkdir(parents=True, exist_ok=True)
            cluster = ["--cluster", self.config.cluster] if self.config.cluster else []
            cache = self.config.cache_dir or self.paths.root / "cache"
            cmd = [sys.executable, "-m", "tools.cli", "--store", str(self.config.store.absolute()),
                   *cluster, "daemon", "--root", str(self.paths.root), "--cache", str(cache),
                   "--cache-size", self.config.cache_size]
            with open(self.paths.logfile, "ab") as logf:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                        start_new_session=True, cwd=REPO)
            deadline = time.monotonic() + READY_TIMEOUT
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    tail = self.paths.logfile.read_text(errors="replace").strip()
                    raise BackendUnavailable(f"the lazyfs daemon exited with {proc.returncode}: "
                                             + " | ".join(tail.splitlines()[-3:]))
                if running(self.paths):
                    return self.paths
                time.sleep(0.05)
            proc.kill()
            raise BackendUnavailable(f"the lazyfs daemon did not answer within "
                                     f"{READY_TIMEOUT:g}s (log: {self.paths.logfile})")

    def close(self) -> None:
        self._stack.close()
