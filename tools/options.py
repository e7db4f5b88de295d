"""Option definitions shared by several subcommands, and opening the store
and the node from the settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from chunkstore import ChunkId, ChunkStore, TrustDomain
from lazyfs.settings import Settings, setting

from .errors import QuietError

if TYPE_CHECKING:
    from composer.registry import RegistryOptions

F = TypeVar("F", bound=Callable[..., Any])


def domain_option(f: F) -> F:
    return click.option(
        "--domain", default="trusted", show_default=True, metavar="NAME",
        help="Trust domain of the chunks (image builds use 'trusted').")(f)


def root_option(f: F) -> F:
    return click.option("--root", "root", type=click.Path(file_okay=False, path_type=Path),
                        default=None, help="Node directory of the daemon (mnt/, control.sock) "
                        "[env LAZYFS_NODE_ROOT; default /run/lazyfs as root, else "
                        "$XDG_RUNTIME_DIR/lazyfs].")(f)


def cache_options(f: F) -> F:
    f = click.option("--cache", "cache_dir", type=click.Path(file_okay=False, path_type=Path),
                     default=None, help="Node chunk cache directory [env LAZYFS_CACHE; "
                     "default ~/.cache/lazyfs/chunks for the default root, else ROOT/cache].")(f)
    return click.option("--cache-size", default=None,
                        help="Node chunk cache bound, e.g. 512M, 4G "
                             "[env LAZYFS_CACHE_SIZE; default 4G].")(f)


def parse_chunk_id(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    try:
        if isinstance(value, tuple):
            return tuple(ChunkId.from_hex(v) for v in value)
        return ChunkId.from_hex(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from e


def open_store(settings: Settings, *, readonly: bool = False,
               create: bool = False) -> ChunkStore:
    return ChunkStore.open(settings.store_path, config=settings.store_config(),
                           readonly=readonly, create=create)


def registry_options(**given: Any) -> RegistryOptions:
    """A registry client's options: those given (not None), the credentials,
    when none are given, from the settings ([registry], LAZYFS_REGISTRY_USER / _PASSWORD)."""
    from composer.registry import RegistryOptions  # (requests, dxf: only when used)
    if not given.get("username") and not given.get("password"):  # (a pair: both or none)
        given["username"] = setting("registry_user")
        given["password"] = setting("registry_password")
    return RegistryOptions.given(**given)


def as_domain(name: str) -> TrustDomain:
    try:
        return TrustDomain(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--domain") from e


def parse_labels(items: tuple[str, ...], option: str = "--label") -> dict[str, str]:
    """KEY=VALUE options as a dict; one line naming a bad one."""
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise QuietError(f"{option} {item!r}: expected KEY=VALUE", exit_code=2)
        out[k] = v
    return out
