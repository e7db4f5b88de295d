"""CLI configuration, in one place: precedence command line > environment >
config file > default.

File: $LAZYFS_CONFIG, else $XDG_CONFIG_HOME/lazyfs/config.toml (TOML):

    [store]
    path = "/var/lib/lazyfs/store"
    zstd_level = 3
    pack_size_mib = 64
    threads = 2

    [cluster]
    url = "s3://lazyfs/images?endpoint=http://seaweed:8333"

    [mount]
    lowers = "kernel"        # or "fuse": what `lazyfs mount` composes over

Environment: LAZYFS_STORE, LAZYFS_ZSTD_LEVEL, LAZYFS_PACK_SIZE_MIB,
LAZYFS_THREADS, LAZYFS_CLUSTER, LAZYFS_LOWERS. Unknown keys or sections are
errors.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from chunkstore import StoreConfig

from .errors import QuietError

_STORE_KEYS: dict[str, type] = {"path": str, "zstd_level": int, "pack_size_mib": int,
                                "threads": int}
_ENV = {"path": "LAZYFS_STORE", "zstd_level": "LAZYFS_ZSTD_LEVEL",
        "pack_size_mib": "LAZYFS_PACK_SIZE_MIB", "threads": "LAZYFS_THREADS"}


def _xdg(var: str, fallback: str) -> Path:
    return Path(os.environ.get(var) or Path.home() / fallback)


def default_store_path() -> Path:
    return _xdg("XDG_DATA_HOME", ".local/share") / "lazyfs" / "store"


def config_file_path() -> Path:
    env = os.environ.get("LAZYFS_CONFIG")
    return Path(env) if env else _xdg("XDG_CONFIG_HOME", ".config") / "lazyfs" / "config.toml"


@dataclass(frozen=True)
class Settings:
    store_path: Path
    store: StoreConfig
    # the cluster store images are served from (s3://BUCKET[/PREFIX]?endpoint=URL or
    # posix:///PATH); None: the local store. Option --cluster, env LAZYFS_CLUSTER.
    cluster: str | None = None
    # composed mounts' lowers: "kernel" (EROFS) or "fuse"; None: lazyfs.mounts'
    # default. Option --kernel/--fuse of `lazyfs mount`, env LAZYFS_LOWERS.
    lowers: str | None = None

    @classmethod
    def load(cls, **cli: Any) -> Settings:
        """Merge defaults, the config file, the environment and CLI values
        (those not None), validating each value with its source named."""
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        file_cluster: str | None = None
        lowers: tuple[str, str] | None = None  # (value, where it came from)
        path = config_file_path()
        if path.exists():
            try:
                doc = tomllib.loads(path.read_text())
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise QuietError(f"config file {path}: {e}") from e
            unknown = set(doc) - {"store", "cluster", "mount"}
            if unknown:
                raise QuietError(f"config file {path}: unknown section(s) {sorted(unknown)}")
            cluster_doc = doc.get("cluster", {})
            if set(cluster_doc) - {"url"}:
                raise QuietError(f"config file {path}: unknown key(s) in [cluster] "
                                 f"{sorted(set(cluster_doc) - {'url'})} (known: url)")
            file_cluster = cluster_doc.get("url")
            mount_doc = doc.get("mount", {})
            if set(mount_doc) - {"lowers"}:
                raise QuietError(f"config file {path}: unknown key(s) in [mount] "
                                 f"{sorted(set(mount_doc) - {'lowers'})} (known: lowers)")
            if "lowers" in mount_doc:
                lowers = (mount_doc["lowers"], f"config file {path}: mount.lowers")
            for key, value in doc.get("store", {}).items():
                if key not in _STORE_KEYS:
                    raise QuietError(f"config file {path}: unknown key store.{key} "
                                     f"(known: {', '.join(_STORE_KEYS)})")
                values[key], sources[key] = value, f"config file {path}"
        for key, var in _ENV.items():
            if os.environ.get(var):
                values[key], sources[key] = os.environ[var], f"environment {var}"
        for key, value in cli.items():
            if value is not None and key in _STORE_KEYS:
                values[key], sources[key] = value, f"option --{key.replace('_', '-')}"
        for key, value in list(values.items()):
            kind = _STORE_KEYS[key]
            try:
                values[key] = kind(value)
            except (TypeError, ValueError):
                raise QuietError(f"{sources[key]}: {key} must be {kind.__name__}, "
                                 f"got {value!r}") from None
        config = StoreConfig()
        try:
            if "zstd_level" in values:
                config = replace(config, zstd_level=values["zstd_level"])
            if "pack_size_mib" in values:
                config = replace(config, pack_size=values["pack_size_mib"] << 20)
            if "threads" in values:
                config = replace(config, threads=values["threads"])
        except ValueError as e:
            raise QuietError(f"invalid store setting: {e}") from e
        store_path = Path(values.get("path") or default_store_path()).expanduser()
        cluster = cli.get("cluster") or os.environ.get("LAZYFS_CLUSTER") or file_cluster
        if os.environ.get("LAZYFS_LOWERS"):
            lowers = (os.environ["LAZYFS_LOWERS"], "environment LAZYFS_LOWERS")
        if lowers is not None and lowers[0] not in ("kernel", "fuse"):
            raise QuietError(f"{lowers[1]}: expected \"kernel\" or \"fuse\", got {lowers[0]!r}")
        return cls(store_path, config, cluster, lowers[0] if lowers else None)
