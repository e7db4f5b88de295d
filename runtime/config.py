"""Where a node's runtime keeps its state and finds its images.

Precedence: arguments > the machine's settings (lazyfs.settings: environment
LAZYFS_STORE, LAZYFS_CLUSTER, LAZYFS_RUNTIME_DIR, LAZYFS_NODE_ROOT,
LAZYFS_CACHE, LAZYFS_CACHE_SIZE, then the config file, then defaults that
work on one machine). The `lazyfs` CLI reads the same settings, so an
embedded node and `lazyfs mount` find the same store and the same daemon.

Light to import (no pyfuse3, trio or LMDB): the SDK imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lazyfs.settings import Settings


def _settings() -> Settings:
    return Settings.load()


@dataclass(frozen=True)
class RuntimeConfig:
    store: Path = field(default_factory=lambda: _settings().store_path)
    cluster: str | None = field(default_factory=lambda: _settings().cluster)
    state_dir: Path = field(default_factory=lambda: _settings().state_dir)
    # the node's lazyfs daemon (started by the runtime when none answers there)
    node_root: Path = field(default_factory=lambda: _settings().node_root)
    # node chunk cache [default: as configured, else lazyfs.settings.default_cache_dir]
    cache_dir: Path | None = field(default_factory=lambda: _settings().configured_cache_dir)
    cache_size: str = field(default_factory=lambda: _settings().cache_size)
    max_sandboxes: int = 4096
    reap_interval: float = 1.0
    fncall_workers: int = 2

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> RuntimeConfig:
        """The runtime of a machine with these settings (kw: other fields)."""
        base: dict[str, Any] = {
            "store": settings.store_path, "cluster": settings.cluster,
            "state_dir": settings.state_dir, "node_root": settings.node_root,
            "cache_dir": settings.configured_cache_dir, "cache_size": settings.cache_size}
        return cls(**{**base, **kw})

    @property
    def sandboxes(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def runc_root(self) -> Path:
        return self.state_dir / "runc"

    @property
    def bin_dir(self) -> Path:
        return self.state_dir / "bin"
