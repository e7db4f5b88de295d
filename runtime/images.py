"""The node's images as the runtime needs them: the catalog (local store or
cluster) to resolve names, and the node's lazyfs daemon to serve layers.

Both come from the node API (lazyfs.node): the catalog from open_catalog
(the local store's LMDB environment shared by every node of the process),
the daemon from ensure_daemon, which starts `python -m lazyfs` in the
background when none answers at the configured root (its log in
NODE_ROOT/daemon.log) and refuses a running one that serves another store.
A daemon started here is stopped when the node closes with no sandbox and no
composed mount left on it (one someone else started stays theirs). Node
errors become BackendUnavailable here.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from chunkstore.errors import LazyfsError
from composer.catalog import ImageCatalog
from composer.errors import ImageNotFound as CatalogImageNotFound
from lazyfs.mounts import stop_daemon
from lazyfs.node import DaemonSpec, NodePaths, ensure_daemon, open_catalog

from .config import RuntimeConfig
from .errors import BackendUnavailable, ImageNotFound, InvalidSpec, SandboxError, StoreUnavailable
from .spec import CHECKPOINT_KEY, VM_STATE_KEY, ResolvedImage, VmState

log = logging.getLogger(__name__)


class Images:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.spec = DaemonSpec.for_node(config.node_root, config.store, config.cluster,
                                        config.cache_dir, config.cache_size,
                                        options=config.daemon)
        self.paths: NodePaths = self.spec.paths
        self._lock = threading.Lock()
        self._stack = contextlib.ExitStack()
        self._catalog: ImageCatalog | None = None
        self._started: int | None = None  # the daemon's pid, if this started it

    def catalog(self) -> ImageCatalog:
        with self._lock:
            if self._catalog is None:
                try:
                    self._catalog = self._stack.enter_context(
                        open_catalog(self.config.store, self.config.cluster))
                except (LazyfsError, OSError) as e:
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
        except SandboxError:
            raise
        except (LazyfsError, OSError) as e:  # (a store down: nothing was made)
            shared = self.config.cluster is not None  # (every node of a fleet reads it)
            raise (StoreUnavailable if shared else BackendUnavailable)(
                f"cannot resolve {name!r}: the image store "
                f"{self.config.cluster or self.config.store} does not answer: {e}") from e
        if CHECKPOINT_KEY in image.config:  # its one layer is CRIU's images, not a root
            raise InvalidSpec(f"{name} is a checkpoint, not an image: Sandbox.restore it")
        if VM_STATE_KEY in image.config:  # a microVM snapshot: its top layer is the state
            try:
                state = VmState.model_validate(image.config[VM_STATE_KEY])
            except ValueError as e:  # (pydantic's ValidationError)
                raise InvalidSpec(f"{name}: its VM state record is not one: "
                                  f"{str(e).splitlines()[0]}") from None
            if not image.layers or image.layers[-1] != state.layer:
                raise InvalidSpec(f"{name}: its VM state layer {state.layer} is not its top "
                                  "layer")
            return ResolvedImage(name=name, digest=digest, layers=tuple(image.layers[:-1]),
                                 vm_state=state)
        return ResolvedImage(name=name, digest=digest, layers=tuple(image.layers))

    def ensure_daemon(self) -> NodePaths:
        try:  # (a daemon needs root and /dev/fuse: lazyfs.node.check_fuse says so)
            pid = ensure_daemon(self.spec)
        except (LazyfsError, OSError) as e:
            raise BackendUnavailable(str(e)) from e
        if pid is not None:
            self._started = pid
        return self.paths

    def close(self, *, sandboxes: int = 0) -> None:
        """Close the catalog; stop the daemon this started if nothing uses it
        (no sandbox of the node's, no composed mount: else one line says
        what keeps it)."""
        self._stack.close()
        pid, self._started = self._started, None
        if pid is None or not self.paths.pidfile.exists():
            return
        try:
            if int(self.paths.pidfile.read_text()) != pid:
                return  # (another daemon now: not ours to stop)
        except (OSError, ValueError):
            return
        if sandboxes:
            log.info("the lazyfs daemon at %s keeps serving: %d sandboxes use it",
                     self.paths.mnt, sandboxes)
            return
        try:
            stop_daemon(self.paths)
        except LazyfsError as e:
            log.info("the lazyfs daemon at %s keeps serving: %s", self.paths.mnt, e)
