"""Option definitions shared by several subcommands, and opening the store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from chunkstore import ChunkId, ChunkStore, TrustDomain

from .config import Settings

F = TypeVar("F", bound=Callable[..., Any])


def domain_option(f: F) -> F:
    return click.option(
        "--domain", default="trusted", show_default=True, metavar="NAME",
        help="Trust domain of the chunks (image builds use 'trusted').")(f)


def parse_chunk_id(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    try:
        if isinstance(value, tuple):
            return tuple(ChunkId.from_hex(v) for v in value)
        return ChunkId.from_hex(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from e


def open_store(settings: Settings, *, readonly: bool = False,
               create: bool = False) -> ChunkStore:
    return ChunkStore.open(settings.store_path, config=settings.store, readonly=readonly,
                           create=create)


def as_domain(name: str) -> TrustDomain:
    try:
        return TrustDomain(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--domain") from e
