"""Where a node's runtime keeps its state and finds its images.

Precedence: arguments > the machine's settings (lazyfs.settings: environment
LAZYFS_STORE, LAZYFS_CLUSTER, LAZYFS_RUNTIME_DIR, LAZYFS_NODE_ROOT,
LAZYFS_CACHE, LAZYFS_CACHE_SIZE, then the config file, then defaults that
work on one machine). The `lazyfs` CLI reads the same settings, so an
embedded node and `lazyfs mount` find the same store and the same daemon.

Light to import (no pyfuse3, trio or LMDB): the SDK imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazyfs.settings import Settings


class _FromSettings:
    """The default of the fields below: taken from the machine's settings,
    loaded once per RuntimeConfig (not once per field) in __post_init__."""

    def __repr__(self) -> str:
        return "<from settings>"


_FROM_SETTINGS: Any = _FromSettings()  # (Any: a default of every field's type)
_SETTINGS_FIELDS = ("store", "cluster", "state_dir", "node_root", "cache_dir", "cache_size")


def _from_settings(settings: Settings) -> dict[str, Any]:
    return {"store": settings.store_path, "cluster": settings.cluster,
            "state_dir": settings.state_dir, "node_root": settings.node_root,
            "cache_dir": settings.configured_cache_dir, "cache_size": settings.cache_size}


@dataclass(frozen=True)
class RuntimeConfig:
    store: Path = _FROM_SETTINGS
    cluster: str | None = _FROM_SETTINGS
    state_dir: Path = _FROM_SETTINGS
    # the node's lazyfs daemon (started by the runtime when none answers there)
    node_root: Path = _FROM_SETTINGS
    # node chunk cache [default: as configured, else lazyfs.settings.default_cache_dir]
    cache_dir: Path | None = _FROM_SETTINGS
    cache_size: str = _FROM_SETTINGS
    max_sandboxes: int = 4096
    reap_interval: float = 1.0
    fncall_workers: int = 2
    # turn on cgroup favordynmods at node start (runtime.cgroups): moving a
    # process into a cgroup then no longer waits for an RCU grace period, but
    # every fork and exit on the host gets dearer; off by default (measured:
    # docs/runtime.md, "A node at full load")
    favor_dynmods: bool = False
    # this node's id in a fleet (runtime/fleet): its sandboxes' ids name it
    # (sb-<hex>.<node id>) so any client finds their node; None outside one
    node_id: str | None = None
    # admission by memory: the memory the node's sandboxes may ask for in
    # all is `memory_mb` times the overcommit of their QoS class (best-effort
    # sandboxes packed denser); None: no memory admission, only max_sandboxes
    memory_mb: int | None = None
    overcommit_latency: float = 1.0
    overcommit_best_effort: float = 4.0

    def __post_init__(self) -> None:
        missing = [f for f in _SETTINGS_FIELDS if getattr(self, f) is _FROM_SETTINGS]
        if missing:
            values = _from_settings(Settings.load())
            for f in missing:
                object.__setattr__(self, f, values[f])

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> RuntimeConfig:
        """The runtime of a machine with these settings (kw: other fields)."""
        return cls(**{**_from_settings(settings), **kw})

    @property
    def sandboxes(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def runc_root(self) -> Path:
        return self.state_dir / "runc"

    @property
    def bin_dir(self) -> Path:
        return self.state_dir / "bin"

    @property
    def init_dir(self) -> Path:
        """A small tmpfs holding the sandbox-init that containers bind."""
        return self.state_dir / "init"
