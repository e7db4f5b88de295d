"""The settings of a lazyfs machine, read in one place by the `lazyfs` CLI
and the sandbox runtime (embedded or agent), so both find the same store and
the same node daemon.

Precedence, for every setting: options (the CLI's flags, or the arguments a
program passes) > environment > config file > defaults.

Config file: $LAZYFS_CONFIG, else $XDG_CONFIG_HOME/lazyfs/config.toml
(~/.config/lazyfs/config.toml). TOML; every section and key is optional;
unknown sections or keys are errors, as are values of the wrong type:

    [store]                     # the local chunk store
    path = "/var/lib/lazyfs/store"   # env LAZYFS_STORE   [~/.local/share/lazyfs/store]
    zstd_level = 3                   # env LAZYFS_ZSTD_LEVEL (1-22)
    pack_size_mib = 64               # env LAZYFS_PACK_SIZE_MIB
    threads = 2                      # env LAZYFS_THREADS

    [cluster]                   # serve images from a cluster store instead
    url = "s3://lazyfs/images?endpoint=http://seaweed:8333"   # env LAZYFS_CLUSTER
                                     # (or posix:///PATH)

    [node]                      # the node's lazyfs daemon
    root = "/run/lazyfs"             # env LAZYFS_NODE_ROOT [/run/lazyfs as root,
                                     #   else $XDG_RUNTIME_DIR/lazyfs]
    cache = "/var/cache/lazyfs"      # env LAZYFS_CACHE  [~/.cache/lazyfs/chunks for
                                     #   the default root, else ROOT/cache]
    cache_size = "4G"                # env LAZYFS_CACHE_SIZE

    [mount]
    lowers = "kernel"                # env LAZYFS_LOWERS: "kernel" (EROFS) or "fuse"

    [daemon]                    # the node daemon's serving options: any field of
    fetch_timeout = 30.0             #   lazyfs.options.Options, by its name (the
    native_blobs = true              #   flags of `lazyfs daemon` win over these)

    [runtime]                   # the sandbox runtime
    state_dir = "/var/lib/lazyfs-runtime"   # env LAZYFS_RUNTIME_DIR [as root; else
                                            #   $XDG_RUNTIME_DIR/lazyfs/runtime]
    max_snapshot_layers = 4     # env LAZYFS_MAX_SNAPSHOT_LAYERS: sandbox-written layers
                                #   an image keeps before a snapshot flattens them
    container_starter = "native"   # env LAZYFS_CONTAINER_STARTER: "native"
                                   #   (sandbox-spawn) or "runc" (`runc run`)

    [client]                    # where the SDK and `lazyfs sandbox` send sandboxes
    node = "unix:///run/lazyfs-runtime/agent.sock"   # env LAZYFS_NODE (or http://...)
    fleet = "etcd://10.0.0.1:2379"   # env LAZYFS_FLEET (when no node is named)
    token = "..."                    # env LAZYFS_NODE_TOKEN
    connections = 1024               # env LAZYFS_CLIENT_CONNECTIONS: AsyncSandbox's per agent

    [vm]                        # the microVM and full-VM backends
    layers = "pmem"                  # env LAZYFS_MICROVM_LAYERS: pmem (DAX) or blk
    balloon = "on"                   # env LAZYFS_MICROVM_BALLOON: free page reporting
    accel = "kvm"                    # env LAZYFS_MICROVM_ACCEL [probed: kvm, else tcg]
    snapshots = "/var/lib/lazyfs/vm-snapshots"    # env LAZYFS_MICROVM_SNAPSHOTS
    pmem_cache = "/var/cache/lazyfs/pmem"          # env LAZYFS_PMEM_CACHE
    kernel_cache = "/var/cache/lazyfs/guest-kernel"   # env LAZYFS_GUEST_KERNEL_CACHE
    criu_cache = "/var/cache/lazyfs/criu"          # env LAZYFS_CRIU_CACHE
    criu = "/usr/local/bin/criu"     # env LAZYFS_CRIU [criu_cache/VERSION/criu]

    [cluster]
    s3_endpoint = "http://seaweed:8333"   # env LAZYFS_S3_ENDPOINT (when the URL
                                          #   names none; else AWS_ENDPOINT_URL)
    [registry]                  # pulls (`lazyfs convert`, environment specs)
    user = "..."                     # env LAZYFS_REGISTRY_USER (--creds wins)
    password = "..."                 # env LAZYFS_REGISTRY_PASSWORD

Those of [client], [registry], [vm] and cluster.s3_endpoint are read where
they are used (setting()), the rest by Settings.load(); chunkstore and
composer, below this package, take them as arguments.

What it does not do: open anything (stores, daemons) — lazyfs.node does,
from these values. Importing it is light (no pyfuse3, trio or LMDB): the
SDK's runtime configuration imports it.
"""

from __future__ import annotations

import os
import re
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:  # (imported where used: a process that only talks HTTP reads
    # its [client] settings with nothing but this module and lazyfs.errors)
    from chunkstore.config import StoreConfig

    from .options import Options

DEFAULT_CACHE_SIZE = "4G"
DEFAULT_MAX_SNAPSHOT_LAYERS = 4
CONTAINER_STARTERS = ("native", "runc")  # runtime.backends.container
DEFAULT_CONTAINER_STARTER = "native"


@dataclass(frozen=True)
class _Key:
    section: str
    key: str
    env: str
    kind: type
    option: str  # how the CLI spells it, for messages
    default: Any = None  # (of the keys read one at a time: setting())


# attribute name -> where it is read from; the one table of settings
_KEYS: dict[str, _Key] = {
    "store_path": _Key("store", "path", "LAZYFS_STORE", Path, "--store"),
    "zstd_level": _Key("store", "zstd_level", "LAZYFS_ZSTD_LEVEL", int, "--zstd-level"),
    "pack_size_mib": _Key("store", "pack_size_mib", "LAZYFS_PACK_SIZE_MIB", int,
                          "--pack-size-mib"),
    "threads": _Key("store", "threads", "LAZYFS_THREADS", int, "--threads"),
    "cluster": _Key("cluster", "url", "LAZYFS_CLUSTER", str, "--cluster"),
    "node_root": _Key("node", "root", "LAZYFS_NODE_ROOT", Path, "--root"),
    "cache_dir": _Key("node", "cache", "LAZYFS_CACHE", Path, "--cache"),
    "cache_size": _Key("node", "cache_size", "LAZYFS_CACHE_SIZE", str, "--cache-size"),
    "lowers": _Key("mount", "lowers", "LAZYFS_LOWERS", str, "--kernel/--fuse"),
    "state_dir": _Key("runtime", "state_dir", "LAZYFS_RUNTIME_DIR", Path, "--state"),
    "max_snapshot_layers": _Key("runtime", "max_snapshot_layers", "LAZYFS_MAX_SNAPSHOT_LAYERS",
                                int, "runtime.max_snapshot_layers"),
    "container_starter": _Key("runtime", "container_starter", "LAZYFS_CONTAINER_STARTER", str,
                              "runtime.container_starter"),
    # read one at a time where they are used (setting()): the SDK's target,
    # the S3 endpoint, the registry's credentials, the VM backends' choices
    # and caches
    "client_node": _Key("client", "node", "LAZYFS_NODE", str, "--node"),
    "client_fleet": _Key("client", "fleet", "LAZYFS_FLEET", str, "--fleet"),
    "client_token": _Key("client", "token", "LAZYFS_NODE_TOKEN", str, "--token"),
    # the caller's TLS identity for https:// agents (runtime.fleet.ca: ca.pem, cert.pem, key.pem)
    "client_tls_dir": _Key("client", "tls_dir", "LAZYFS_TLS_DIR", Path, "client.tls_dir"),
    # AsyncSandbox's connections to one node agent (runtime.client.transport.AsyncHttp)
    "client_connections": _Key("client", "connections", "LAZYFS_CLIENT_CONNECTIONS", int,
                               "client.connections", 1024),
    "s3_endpoint": _Key("cluster", "s3_endpoint", "LAZYFS_S3_ENDPOINT", str,
                        "cluster.s3_endpoint"),
    "registry_user": _Key("registry", "user", "LAZYFS_REGISTRY_USER", str, "--creds"),
    "registry_password": _Key("registry", "password", "LAZYFS_REGISTRY_PASSWORD", str,
                              "--creds"),
    "vm_layers": _Key("vm", "layers", "LAZYFS_MICROVM_LAYERS", str, "vm.layers", "pmem"),
    "vm_balloon": _Key("vm", "balloon", "LAZYFS_MICROVM_BALLOON", str, "vm.balloon", "on"),
    "vm_accel": _Key("vm", "accel", "LAZYFS_MICROVM_ACCEL", str, "vm.accel"),
    "vm_snapshots": _Key("vm", "snapshots", "LAZYFS_MICROVM_SNAPSHOTS", Path, "vm.snapshots",
                         Path("/var/lib/lazyfs/vm-snapshots")),
    "pmem_cache": _Key("vm", "pmem_cache", "LAZYFS_PMEM_CACHE", Path, "vm.pmem_cache",
                       Path("/var/cache/lazyfs/pmem")),
    "guest_kernel_cache": _Key("vm", "kernel_cache", "LAZYFS_GUEST_KERNEL_CACHE", Path,
                               "vm.kernel_cache", Path("/var/cache/lazyfs/guest-kernel")),
    "criu_cache": _Key("vm", "criu_cache", "LAZYFS_CRIU_CACHE", Path, "vm.criu_cache",
                       Path("/var/cache/lazyfs/criu")),
    "criu": _Key("vm", "criu", "LAZYFS_CRIU", Path, "vm.criu"),
}
# the keys Settings.load() resolves into fields; the rest: setting()
_ONE_AT_A_TIME = frozenset(a for a, k in _KEYS.items()
                           if k.section in ("client", "registry", "vm")
                           or a == "s3_endpoint")
_DAEMON = "daemon"  # the section of the daemon's options (lazyfs.options: their own names)
_SECTIONS = sorted({k.section for k in _KEYS.values()} | {_DAEMON})


def setting(attr: str) -> Any:
    """One setting where it is used (the SDK's target, the VM backends'
    caches...): its environment variable, else the config file's key, else
    its default (None for most). The same table and precedence as
    Settings.load(); ConfigError names a bad source."""
    key = _KEYS[attr]
    if os.environ.get(key.env):
        return _convert(attr, os.environ[key.env], f"environment {key.env}")
    found = _read_file(config_file_path()).get(attr)
    if found is not None:
        return _convert(attr, *found)
    return key.default


def _xdg(var: str, fallback: str) -> Path:
    return Path(os.environ.get(var) or Path.home() / fallback)


def _user_runtime_dir() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/lazyfs-{os.getuid()}")


def config_file_path() -> Path:
    env = os.environ.get("LAZYFS_CONFIG")
    return Path(env) if env else _xdg("XDG_CONFIG_HOME", ".config") / "lazyfs" / "config.toml"


def default_store_path() -> Path:
    return _xdg("XDG_DATA_HOME", ".local/share") / "lazyfs" / "store"


def default_root() -> Path:
    """The node root of the machine's one lazyfs daemon."""
    if os.geteuid() == 0:
        return Path("/run/lazyfs")
    return _user_runtime_dir() / "lazyfs"


def default_cache_dir(node_root: Path) -> Path:
    """The default root's node cache lives on disk (it outlives a reboot's
    /run); any other root keeps its own cache inside it (two daemons never
    share one)."""
    if node_root.absolute() == default_root():
        return _xdg("XDG_CACHE_HOME", ".cache") / "lazyfs" / "chunks"
    return node_root / "cache"


def default_state_dir() -> Path:
    if os.geteuid() == 0:  # on disk: sandboxes' writable layers live here
        return Path("/var/lib/lazyfs-runtime")
    return _user_runtime_dir() / "runtime"


def parse_size(text: str) -> int:
    """Bytes of a size like 512M or 4G (at least 1 MiB); ValueError if not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    size = int(float(m[1]) * 1024 ** "_kmgt".index(m[2] or "_")) if m else 0
    if size < 1 << 20:
        raise ValueError(f"{text!r}: expected a size of at least 1M, like 512M or 4G")
    return size


def check_cluster_url(url: str) -> None:
    """A cheap check of a cluster store URL's form (opening it is
    chunkstore.objects'); ValueError says what is expected."""
    parsed = urllib.parse.urlsplit(url)
    expected = "expected s3://BUCKET[/PREFIX][?endpoint=URL] or posix:///PATH"
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{url!r}: no bucket ({expected})")
    elif parsed.scheme in ("posix", "file"):
        if parsed.netloc or not parsed.path.startswith("/"):
            raise ValueError(f"{url!r}: a POSIX cluster path must be absolute: "
                             f"posix:///{parsed.netloc}{parsed.path}")
    else:
        raise ValueError(f"unknown cluster store URL {url!r} ({expected})")


@dataclass(frozen=True)
class Settings:
    """Every setting, resolved: defaults applied, values checked."""

    store_path: Path
    node_root: Path
    cache_dir: Path
    cache_size: str
    state_dir: Path
    # the cluster store images are served from; None: the local store
    cluster: str | None = None
    # composed mounts' lowers, "kernel" or "fuse"; None: lazyfs.mounts' default
    lowers: str | None = None
    zstd_level: int | None = None
    pack_size_mib: int | None = None
    threads: int | None = None
    # sandbox-written layers an image keeps on top of the image it was made
    # from before a snapshot squashes them into one (runtime.node.capture)
    max_snapshot_layers: int = DEFAULT_MAX_SNAPSHOT_LAYERS
    # what starts container sandboxes (CONTAINER_STARTERS)
    container_starter: str = DEFAULT_CONTAINER_STARTER
    # the options this was loaded with (None values dropped), for override()
    options: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # where each setting not left at its default came from ("environment
    # LAZYFS_STORE", ...), by attribute name
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # the config file's [daemon] section: daemon options (lazyfs.options), checked
    daemon: dict[str, Any] = field(default_factory=dict)

    def daemon_options(self, given: Mapping[str, Any] | None = None) -> Options:
        """The daemon's serving options: the [daemon] section over the
        defaults, `given` (those not None: a command's flags) over both."""
        from .options import Options
        opts = Options().replace(self.daemon, "config file [daemon]")
        extra = {k: v for k, v in (given or {}).items() if v is not None}
        try:
            return opts.replace(extra, "option")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def load(cls, **options: Any) -> Settings:
        """Resolve every setting: options (those not None) > environment >
        config file > defaults. ConfigError names the offending source."""
        unknown = set(options) - (set(_KEYS) - _ONE_AT_A_TIME)
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)} "
                            f"(known: {sorted(set(_KEYS) - _ONE_AT_A_TIME)})")
        given = {k: v for k, v in options.items() if v is not None}
        raw: dict[str, tuple[Any, str]] = {}  # attribute -> (value, where from)
        daemon: dict[str, Any] = {}
        for attr, (value, _src) in _read_file(config_file_path()).items():
            if attr.startswith(_DAEMON + "."):
                daemon[attr.removeprefix(_DAEMON + ".")] = value
            else:
                raw[attr] = (value, _src)
        for attr, key in _KEYS.items():
            if attr in _ONE_AT_A_TIME:
                raw.pop(attr, None)
                continue
            if os.environ.get(key.env):
                raw[attr] = (os.environ[key.env], f"environment {key.env}")
        for attr, value in given.items():
            raw[attr] = (value, f"option {_KEYS[attr].option}")
        values = {attr: _convert(attr, value, src) for attr, (value, src) in raw.items()}

        def where(attr: str) -> str:
            return raw[attr][1] if attr in raw else "default"

        if values.get("lowers") not in (None, "kernel", "fuse"):
            raise ConfigError(f"{where('lowers')}: lowers: expected \"kernel\" or \"fuse\", "
                              f"got {values['lowers']!r}")
        if "cluster" in values:
            try:
                check_cluster_url(values["cluster"])
            except ValueError as e:
                raise ConfigError(f"{where('cluster')}: {e}") from None
        cache_size = values.get("cache_size", DEFAULT_CACHE_SIZE)
        try:
            parse_size(cache_size)
        except ValueError as e:
            raise ConfigError(f"{where('cache_size')}: cache size {e}") from None
        max_layers = values.get("max_snapshot_layers", DEFAULT_MAX_SNAPSHOT_LAYERS)
        if max_layers < 1:
            raise ConfigError(f"{where('max_snapshot_layers')}: max_snapshot_layers must be "
                              f"at least 1, got {max_layers}")
        starter = values.get("container_starter", DEFAULT_CONTAINER_STARTER)
        if starter not in CONTAINER_STARTERS:
            raise ConfigError(f"{where('container_starter')}: container_starter: expected one "
                              f"of {', '.join(CONTAINER_STARTERS)}, got {starter!r}")
        node_root = Path(values.get("node_root") or default_root()).expanduser()
        settings = cls(
            store_path=Path(values.get("store_path") or default_store_path()).expanduser(),
            node_root=node_root,
            cache_dir=Path(values.get("cache_dir") or default_cache_dir(node_root)).expanduser(),
            cache_size=cache_size,
            state_dir=Path(values.get("state_dir") or default_state_dir()).expanduser(),
            cluster=values.get("cluster") or None,
            lowers=values.get("lowers"),
            zstd_level=values.get("zstd_level"),
            pack_size_mib=values.get("pack_size_mib"),
            threads=values.get("threads"),
            max_snapshot_layers=max_layers,
            container_starter=starter,
            options=given,
            sources={attr: src for attr, (_, src) in raw.items()},
            daemon=daemon)
        settings.store_config()  # checks the store's values now, naming them
        return settings

    def override(self, **options: Any) -> Settings:
        """These settings with more options (those not None) on top, through
        the same precedence (a new --root also moves the default cache)."""
        return Settings.load(**{**self.options, **options})

    @property
    def configured_cache_dir(self) -> Path | None:
        """The node cache if one was configured, None when it is the
        default (which follows the node root)."""
        return self.cache_dir if "cache_dir" in self.sources else None

    @property
    def cache_bytes(self) -> int:
        return parse_size(self.cache_size)

    def store_config(self) -> StoreConfig:
        """The local chunk store's tuning."""
        from chunkstore.config import StoreConfig
        config = StoreConfig()
        try:
            if self.zstd_level is not None:
                config = replace(config, zstd_level=self.zstd_level)
            if self.pack_size_mib is not None:
                config = replace(config, pack_size=self.pack_size_mib << 20)
            if self.threads is not None:
                config = replace(config, threads=self.threads)
        except ValueError as e:
            raise ConfigError(f"invalid store setting: {e}") from e
        return config


def _read_file(path: Path) -> dict[str, tuple[Any, str]]:
    if not path.exists():
        return {}
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}") from e
    unknown = set(doc) - set(_SECTIONS)
    if unknown:
        raise ConfigError(f"config file {path}: unknown section(s) {sorted(unknown)} "
                          f"(known: {', '.join(_SECTIONS)})")
    out: dict[str, tuple[Any, str]] = {}
    for section, table in doc.items():
        keys = {k.key: attr for attr, k in _KEYS.items() if k.section == section}
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: [{section}] must be a table")
        if section == _DAEMON:
            for key, value in table.items():
                try:
                    from . import options as daemon_options
                    value = daemon_options.check(key, value, f"config file {path}: daemon")
                except ValueError as e:
                    raise ConfigError(str(e)) from None
                out[f"{_DAEMON}.{key}"] = (value, f"config file {path}: daemon.{key}")
            continue
        for key, value in table.items():
            if key not in keys:
                raise ConfigError(f"config file {path}: unknown key {section}.{key} "
                                  f"(known: {', '.join(keys)})")
            out[keys[key]] = (value, f"config file {path}: {section}.{key}")
    return out


def _convert(attr: str, value: Any, where: str) -> Any:
    kind = _KEYS[attr].kind
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f"{where}: {attr} must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: {attr} must be an integer, got {value!r}") from None
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"{where}: {attr} must be a string, got {value!r}")
    return Path(value) if kind is Path else str(value)
