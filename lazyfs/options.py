"""The lazyfs daemon's serving options, declared once: each field of Options
is an option, with its default, its help and its bounds. Everything else is
derived from these fields:

- the flags of `lazyfs daemon` (tools/daemon_cmd.py, `click_options`) and of
  `python -m lazyfs` (lazyfs.node.DaemonSpec.parse, `add_arguments`), named
  after the field (`fetch_timeout` -> `--fetch-timeout`, booleans
  `--x/--no-x`);
- the `[daemon]` section of the config file (lazyfs.settings: the same
  names, checked by `check`);
- what a daemon process is started with: the options as one JSON object
  (`--config`, `to_json` / `from_json`), as the sandbox agent gets its
  configuration.

Who reads them: the FUSE adapter (lazyfs/fs.py: kernel cache timeouts,
keep_cache, direct_io of blobs), the fetch engine (lazyfs/fetch.py: pools,
timeout, hot set, readahead), the daemon (lazyfs/daemon.py: readahead of the
mount, automatic traces, attribution) and the native blob server
(lazyfs/nativeblobs.py). Where a value comes from (flags, config file) is
the callers' business, not this module's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

READ_AHEAD_KB = 1024  # FUSE's default 128 KiB halves cold sequential reads


@dataclass(frozen=True)
class Spec:
    """What a field's option is: its help and the bounds of its value."""

    help: str
    min: float | None = None
    max: float | None = None
    metavar: str | None = None
    cli: bool = True  # a flag of `lazyfs daemon` (False: config file and --config only)


def _opt(default: Any, help: str, *, min: float | None = None, max: float | None = None,
         metavar: str | None = None, cli: bool = True) -> Any:
    return field(default=default, metadata={"spec": Spec(help, min, max, metavar, cli)})


@dataclass(frozen=True)
class Options:
    # -- the fetch engine (lazyfs/fetch.py) --
    fetch_timeout: float = _opt(30.0, "A read whose chunks take longer fails with EIO.",
                                min=0.1, metavar="SECONDS")
    fetch_threads: int = _opt(8, "Concurrent chunk fetches for reads.", min=1, max=256)
    prefetch_threads: int = _opt(2, "Threads of background fetches (readahead, trace "
                                 "replay).", min=1, max=64, cli=False)
    readahead_chunks: int = _opt(2, "Chunks fetched ahead of a sequential reader (0: off).",
                                 min=0, max=64)
    # recently read chunks kept in memory (a 256 KiB chunk serves two 128 KiB
    # FUSE reads; the second should not go to a thread)
    hot_bytes: int = _opt(32 << 20, "Bytes of recently read chunks kept in memory.",
                          min=0, cli=False)
    # chunks fetched ahead of a sequential reader of a blob: EROFS asks for
    # 128 KiB at a time, one request in flight, so the next chunks must be
    # in memory before it asks (0: off)
    blob_readahead_chunks: int = _opt(8, "Chunks fetched ahead of a sequential reader of a "
                                      "layer's blob (0: off).", min=0, max=256, cli=False)
    # a foreground fetch of at most this many bytes from a local source (the
    # store on this node's disk, or chunks already in the node cache) runs on
    # the event loop itself: one pread and a zstd decode take ~50 us, a
    # round trip through a worker thread ~250 us on a 2-core VM, and a cold
    # read-all is one serial request per small file (0: always a thread)
    inline_fetch_bytes: int = _opt(1 << 20, "Small reads from local disk are fetched on the "
                                   "event loop (0: threads).", min=0, max=64 << 20)
    # chunks read from a local store are copied into the node cache too
    # (off: the store already is on local disk, and writing one cache file per
    # chunk halved cold reads; trace prefetch keeps them either way)
    keep_local_reads: bool = _opt(False, "Copy chunks read from a local store into the node "
                                  "cache.")
    # automatic traces (lazyfs/autotrace.py): how long each use of an image
    # on a node is recorded and merged into its trace (0: no automatic
    # recording or replay)
    auto_trace_seconds: float = _opt(30.0, "Record each use of an image this long and learn "
                                     "its trace from it; later mounts on any node prefetch "
                                     "it (0: off).", min=0, metavar="SECONDS")
    # the kernel path's per-mount attribution (lazyfs/opens.py): each composed
    # mount's opens, read from a fanotify group of its own
    attribute_opens: bool = _opt(True, "On the kernel path, attribute each composed mount's "
                                 "opens and reads to it (a fanotify group per mount).")
    # the kernel path's blobs (the data devices of the layers' EROFS mounts)
    # served by the native server, lazyfs-blobd (lazyfs/nativeblobs.py), not
    # by this process; `native_sanitize` builds it with ASan + UBSan (debugging)
    native_blobs: bool = _opt(True, "On the kernel path, serve layers' data from the native "
                              "server (lazyfs-blobd) instead of the Python daemon.")
    native_sanitize: bool = _opt(False, "Run the native server built with AddressSanitizer "
                                 "and UBSan (debugging).", cli=False)
    # -- the FUSE adapter (lazyfs/fs.py) and the mount --
    keep_cache: bool = _opt(True, "Keep file pages cached across opens (for measurements).")
    cache_timeout: float = _opt(24 * 3600.0, "Kernel entry/attribute cache timeout (for "
                                "measurements).", min=0, metavar="SECONDS")
    read_ahead_kb: int = _opt(READ_AHEAD_KB, "Kernel readahead of the FUSE mount (the kernel's "
                              "default is 128).", min=4, max=1 << 16)
    # blob files bypass the FUSE page cache: the kernel EROFS mount over a blob
    # caches file pages itself (one copy, not two), and FUSE readahead on the
    # blob would fetch the neighbouring files' chunks. Off for users that must
    # mmap a blob (FUSE refuses shared mmap of direct_io files).
    blob_direct_io: bool = _opt(True, "Blob files bypass the FUSE page cache.", cli=False)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, where: str = "--config") -> Options:
        """Options from a JSON object of some of the fields; ValueError naming
        what is wrong."""
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where}: not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: expected a JSON object of daemon options")  # noqa: TRY004
        return cls().replace(doc, where)

    def replace(self, values: Mapping[str, Any], where: str) -> Options:
        """These options with some fields set (each checked: check)."""
        return dataclasses.replace(self, **{k: check(k, v, where) for k, v in values.items()})


_FIELDS = {f.name: f for f in dataclasses.fields(Options)}


def names() -> list[str]:
    return list(_FIELDS)


def spec(name: str) -> Spec:
    s: Spec = _FIELDS[name].metadata["spec"]
    return s


def kind(name: str) -> type:
    return {"int": int, "float": float, "bool": bool}[str(_FIELDS[name].type)]


def default(name: str) -> Any:
    return _FIELDS[name].default


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check(name: str, value: Any, where: str) -> Any:
    """A value of option `name`, converted and checked; ValueError naming
    `where` and what was expected."""
    if name not in _FIELDS:
        raise ValueError(f"{where}: unknown daemon option {name!r} (known: {', '.join(names())})")
    k, s = kind(name), spec(name)
    if k is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            (k is int and not isinstance(value, int)):
        raise ValueError(f"{where}: {name} must be {'an integer' if k is int else 'a number'}, "
                         f"got {value!r}")
    if (s.min is not None and value < s.min) or (s.max is not None and value > s.max):
        raise ValueError(f"{where}: {name} must be in {s.min:g}..{s.max:g}, got {value!r}"
                         if s.max is not None else
                         f"{where}: {name} must be at least {s.min:g}, got {value!r}")
    return k(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option as a flag of an argparse parser (default: not given)."""
    for name in names():
        if kind(name) is bool:
            p.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction,
                           default=None)
        else:
            p.add_argument(flag(name), dest=name, type=kind(name), default=None)


def given(ns: Any) -> dict[str, Any]:
    """The options a parsed argparse namespace (add_arguments) was given."""
    return {n: getattr(ns, n) for n in names() if getattr(ns, n, None) is not None}


def click_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every option with `cli` as a click option of a command (default None:
    not given, so the config file's value or the field's default applies;
    the help shows the field's default)."""
    import click
    for name in reversed([n for n in names() if spec(n).cli]):
        s, k = spec(name), kind(name)
        shown = f"{default(name)!r}" if k is not bool else (
            flag(name) if default(name) else "--no-" + name.replace("_", "-"))
        if k is bool:
            deco = click.option(f"{flag(name)}/--no-{name.replace('_', '-')}", name,
                                default=None, help=f"{s.help}  [default: {shown}]")
        else:
            rng: Any = (click.IntRange(None if s.min is None else int(s.min),
                                       None if s.max is None else int(s.max))
                        if k is int else click.FloatRange(s.min, s.max))
            deco = click.option(flag(name), name, default=None, type=rng, metavar=s.metavar,
                                help=f"{s.help}  [default: {shown}]")
        fn = deco(fn)
    return fn
