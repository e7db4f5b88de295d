"""Where a node's runtime keeps its state and finds its images.

Precedence: arguments > the machine's settings (lazyfs.settings: environment
LAZYFS_STORE, LAZYFS_CLUSTER, LAZYFS_RUNTIME_DIR, LAZYFS_NODE_ROOT,
LAZYFS_CACHE, LAZYFS_CACHE_SIZE, LAZYFS_MAX_SNAPSHOT_LAYERS, then the config
file, then defaults that work on one machine). The `lazyfs` CLI reads the same settings, so an
embedded node and `lazyfs mount` find the same store and the same daemon.

Light to import (no pyfuse3, trio or LMDB): the SDK imports it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazyfs.errors import ConfigError
from lazyfs.options import Options
from lazyfs.settings import CONTAINER_STARTERS, Settings

from .isolation.hostlimits import Budgets

# RuntimeConfig.container_dir: one directory per state directory below it
CONTAINER_ROOTS = Path("/run/lazyfs-containers")


class _FromSettings:
    """The default of the fields below: taken from the machine's settings,
    loaded once per RuntimeConfig (not once per field) in __post_init__."""

    def __repr__(self) -> str:
        return "<from settings>"


_FROM_SETTINGS: Any = _FromSettings()  # (Any: a default of every field's type)
_SETTINGS_FIELDS = ("store", "cluster", "state_dir", "node_root", "cache_dir", "cache_size",
                    "max_snapshot_layers", "daemon", "container_starter")


def _from_settings(settings: Settings) -> dict[str, Any]:
    return {"store": settings.store_path, "cluster": settings.cluster,
            "state_dir": settings.state_dir, "node_root": settings.node_root,
            "cache_dir": settings.configured_cache_dir, "cache_size": settings.cache_size,
            "max_snapshot_layers": settings.max_snapshot_layers,
            "daemon": settings.daemon_options(),
            "container_starter": settings.container_starter}


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
    # the daemon's serving options it starts with (a lazyfs.options.Options, or
    # a mapping of its field names to values over the defaults; [settings: the
    # config file's [daemon] section])
    daemon: Options = _FROM_SETTINGS
    max_sandboxes: int = 4096
    # API calls the node agent answers at once; more are refused as Overloaded
    # (the SDK retries them): runtime.agent.app.Admission
    max_in_flight: int = 8192
    # the VM backends' node-wide cache of pmem metadata images (None:
    # LAZYFS_PMEM_CACHE or /var/cache/lazyfs/pmem)
    pmem_cache: Path | None = None
    reap_interval: float = 1.0
    fncall_workers: int = 2
    # MiB of writable layer of a sandbox whose spec names no disk_mb, so none
    # writes without a bound: a container's is a tmpfs (in memory, counted in
    # its memory limit), a full VM's its ext4 disk (sparse on the host's disk)
    disk_mb: int = 1024
    # what each sandbox may hold of the host's per-user inotify tables
    # (runtime/isolation/hostlimits.py); the node raises the host's own limits to fit
    inotify_instances: int = 128
    inotify_watches: int = 8192
    # a user namespace per container sandbox (runtime/isolation/oci.py); off only where
    # the host has none: then every sandbox's root shares the host root's
    # inotify budget
    user_namespaces: bool = True
    # what starts a container sandbox's init: "native" (runtime/native/
    # sandbox-spawn.c, the OCI config's sandbox without runc's two Go
    # processes) or "runc" (`runc run`) [settings: runtime.container_starter,
    # LAZYFS_CONTAINER_STARTER]
    container_starter: str = _FROM_SETTINGS
    # turn on cgroup favordynmods at node start (runtime.isolation.cgroups): moving a
    # process into a cgroup then no longer waits for an RCU grace period, but
    # every fork and exit on the host gets dearer; off by default (measured:
    # docs/runtime.md, "A node at full load")
    favor_dynmods: bool = False
    # sandbox-written layers an image may carry on top of the image it was
    # made from (a snapshot of a sandbox restored from a snapshot adds one);
    # a snapshot going past this squashes them into one layer
    # [settings: runtime.max_snapshot_layers, LAZYFS_MAX_SNAPSHOT_LAYERS]
    max_snapshot_layers: int = _FROM_SETTINGS
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
        if not isinstance(self.daemon, Options):  # (a mapping: checked, made hashable)
            try:
                object.__setattr__(self, "daemon", Options().replace(
                    dict(self.daemon), "runtime daemon options"))
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from None
        if self.container_starter not in CONTAINER_STARTERS:
            raise ConfigError(f"container_starter must be one of {', '.join(CONTAINER_STARTERS)}"
                              f", got {self.container_starter!r}")
        if self.max_snapshot_layers < 1:
            raise ConfigError(f"max_snapshot_layers must be at least 1, got "
                              f"{self.max_snapshot_layers}")

    @classmethod
    def from_settings(cls, settings: Settings, **kw: Any) -> RuntimeConfig:
        """The runtime of a machine with these settings (kw: other fields)."""
        return cls(**{**_from_settings(settings), **kw})

    @property
    def budgets(self) -> Budgets:
        return Budgets(self.inotify_instances, self.inotify_watches)

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
    def container_dir(self) -> Path:
        """Where runc's container init, which runs as the sandbox's
        unprivileged host ids (runtime/isolation/idmap.py), finds each container's
        root (<sandbox id>) and sandbox-init (init/): a directory of this
        state directory's own that every user may traverse (the state
        directory's parents need not be)."""
        key = hashlib.blake2s(os.fsencode(os.path.realpath(self.state_dir)),
                              digest_size=8).hexdigest()
        return CONTAINER_ROOTS / key

    @property
    def init_dir(self) -> Path:
        """A small tmpfs holding the sandbox-init that containers bind."""
        return self.container_dir / "init"
