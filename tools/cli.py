"""Entry point of the `lazyfs` command: global options and error handling.
Subcommands live in their own modules and register here."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from chunkstore.errors import LazyfsError, StoreFormatError, StoreFull, StoreReadOnly
from lazyfs import logs
from lazyfs.settings import Settings

from .errors import EXIT_FAILED, EXIT_STORE, QuietError


class LazyfsGroup(click.Group):
    """Turns every LazyfsError (the root of the packages' errors) into a
    one-line message and an exit code (tracebacks with --debug); loads a
    subcommand's module only when it is asked for (_COMMANDS)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS and cmd_name not in self.commands:
            self.add_command(_load(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except QuietError:
            raise
        except LazyfsError as e:
            if ctx.meta.get("lazyfs.debug"):
                raise
            code = EXIT_STORE if isinstance(e, StoreReadOnly | StoreFull | StoreFormatError) \
                else EXIT_FAILED
            raise QuietError(str(e), code) from e


@click.group(cls=LazyfsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", "store_path", metavar="PATH", default=None,
              help="Chunk store directory [env LAZYFS_STORE; default "
                   "~/.local/share/lazyfs/store].")
@click.option("--zstd-level", type=int, default=None,
              help="zstd level for new chunks (1-22) [env LAZYFS_ZSTD_LEVEL; default 3].")
@click.option("--threads", type=int, default=None,
              help="Threads for hashing and compression [env LAZYFS_THREADS].")
@click.option("--cluster", metavar="URL", default=None,
              help="Cluster store to push to and serve from: s3://BUCKET[/PREFIX]"
                   "[?endpoint=URL] or posix:///PATH [env LAZYFS_CLUSTER].")
@click.option("-v", "--verbose", count=True,
              help="More log output: warnings and progress (-vv: debug).")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.option("--log-json", is_flag=True,
              help="Log structured JSON lines, as do the daemons and agents this command "
                   "starts [env LAZYFS_LOG=json].")
@click.version_option(package_name="lazyfs")
@click.pass_context
def cli(ctx: click.Context, store_path: str | None, zstd_level: int | None,
        threads: int | None, cluster: str | None, verbose: int, debug: bool,
        log_json: bool) -> None:
    """lazyfs: lazy, content-addressed images and sandboxes.

    Images are stored as deduplicated, compressed chunks in a chunk store
    and loaded on demand. Settings come from options, then LAZYFS_*
    environment variables, then ~/.config/lazyfs/config.toml ($LAZYFS_CONFIG),
    then defaults; the sandbox runtime reads the same (lazyfs/settings.py).
    """
    # errors only by default: a failing command prints its one line, not the
    # retries on the way there (a daemon in the foreground shows warnings)
    logs.setup(logging.DEBUG if verbose > 1 or debug else
               logging.INFO if verbose else logging.ERROR, json_lines=log_json)
    ctx.meta["lazyfs.debug"] = debug
    ctx.obj = Settings.load(store_path=store_path, zstd_level=zstd_level, threads=threads,
                            cluster=cluster)


# command name -> module (under tools) and attribute: each is imported when
# it runs (or for --help), so `lazyfs mount` does not load the sandbox SDK,
# the fleet client or the daemon's FUSE stack
_COMMANDS = {
    "demo": "demo_cmd:demo", "store": "store_cmd:store", "convert": "image_cmd:convert",
    "images": "image_cmd:images", "inspect": "image_cmd:inspect",
    "export": "image_cmd:export", "rm": "image_cmd:rm", "gc": "image_cmd:gc",
    "build": "image_cmd:build", "daemon": "daemon_cmd:daemon", "mount": "mount_cmd:mount",
    "umount": "mount_cmd:umount", "stats": "daemon_cmd:stats", "push": "cluster_cmd:push",
    "seaweed": "cluster_cmd:seaweed", "cluster": "cluster_cmd:cluster",
    "trace": "trace_cmd:trace",
    "agent": "sandbox_cmd:agent", "sandbox": "sandbox_cmd:sandbox", "fleet": "fleet_cmd:fleet",
}


def _load(name: str) -> click.Command:
    import importlib
    module, attr = _COMMANDS[name].split(":")
    cmd = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
    assert isinstance(cmd, click.Command)
    return cmd


def main() -> None:
    try:
        cli.main(prog_name="lazyfs", standalone_mode=True)
    except KeyboardInterrupt:  # pragma: no cover - interactive
        click.echo("lazyfs: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
