"""Where a node's runtime keeps its state and finds its images.

Precedence: arguments > environment (LAZYFS_STORE, LAZYFS_CLUSTER,
LAZYFS_RUNTIME_DIR, LAZYFS_NODE_ROOT) > defaults that work on one machine (the
local store the `lazyfs` CLI uses, state under /run as root).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lazyfs.daemon import default_root


def _xdg(var: str, fallback: str) -> Path:
    return Path(os.environ.get(var) or Path.home() / fallback)


def default_store() -> Path:
    env = os.environ.get("LAZYFS_STORE")
    return Path(env) if env else _xdg("XDG_DATA_HOME", ".local/share") / "lazyfs" / "store"


def default_state_dir() -> Path:
    env = os.environ.get("LAZYFS_RUNTIME_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:  # on disk: sandboxes' writable layers live here
        return Path("/var/lib/lazyfs-runtime")
    return Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/lazyfs-{os.getuid()}") / "runtime"


@dataclass(frozen=True)
class RuntimeConfig:
    store: Path = field(default_factory=default_store)
    cluster: str | None = field(default_factory=lambda: os.environ.get("LAZYFS_CLUSTER"))
    state_dir: Path = field(default_factory=default_state_dir)
    # the node's lazyfs daemon (started by the runtime when none answers there)
    node_root: Path = field(default_factory=lambda: Path(
        os.environ.get("LAZYFS_NODE_ROOT") or default_root()))
    cache_dir: Path | None = None  # node chunk cache [default node_root/cache]
    cache_size: str = "4G"
    max_sandboxes: int = 4096
    reap_interval: float = 1.0
    fncall_workers: int = 2

    @property
    def sandboxes(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def runc_root(self) -> Path:
        return self.state_dir / "runc"

    @property
    def bin_dir(self) -> Path:
        return self.state_dir / "bin"
