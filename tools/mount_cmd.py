"""Composed mount commands: `lazyfs mount` (an image at a directory, the
node daemon started if none runs) and `lazyfs umount` (a composed mount, or
the daemon when given its ROOT/mnt)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import click

from lazyfs import sysmount
from lazyfs.errors import DaemonError
from lazyfs.mounts import MountError, mount_image, node_of, stop_daemon, unmount
from lazyfs.node import DaemonSpec, NodePaths, ensure_daemon, open_catalog, request, store_catalog
from lazyfs.settings import Settings
from lazyfs.trace import load_trace

from .errors import QuietError
from .options import cache_options, open_store, registry_options, root_option


def _trace(path: str | None) -> list[dict[str, Any]] | None:
    if not path:
        return None
    try:
        return load_trace(path)
    except ValueError as e:
        raise QuietError(str(e)) from e


def _check_mountpoint(mountpoint: Path, nonempty: bool) -> None:
    """Refuse, before anything starts, a mount point that is missing, not a
    directory, or (without --nonempty) not empty: mounting over files hides
    them until the unmount, which looks like data loss to whoever looks."""
    if not mountpoint.exists():
        raise QuietError(f"mount point {mountpoint} does not exist (create it with "
                         f"mkdir -p {mountpoint})")
    if not mountpoint.is_dir():
        raise QuietError(f"mount point {mountpoint} is not a directory")
    if sysmount.find_mount(os.path.realpath(mountpoint)) is not None:
        raise QuietError(f"{mountpoint} is already a mount point")
    if nonempty:
        return
    try:
        with os.scandir(mountpoint) as it:
            entries = sum(1 for _ in it)
    except OSError as e:
        raise QuietError(f"cannot read mount point {mountpoint}: {e.strerror}") from e
    if entries:
        raise QuietError(f"mount point {mountpoint} is not empty ({entries} "
                         f"entr{'y' if entries == 1 else 'ies'}): the mount would hide them; "
                         "use an empty directory, or --nonempty to mount over them")


def _image_name(settings: Settings, target: str) -> str:
    if target.endswith(".toml") and Path(target).is_file():
        # an environment spec: the builder (and its registry client) only then
        from composer.envspec import build as build_env
        from composer.envspec import load_spec
        spec = load_spec(Path(target))
        with open_store(settings, create=True) as store, store_catalog(store) as catalog:
            build_env(store, catalog, spec, registry=registry_options())
        return spec.name
    return target


@click.command(name="mount")
@click.argument("image")
@click.argument("mountpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option("--writable", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for a writable layer (upper/ and work/ inside); "
                   "without it the view is read-only.")
@click.option("--foreground", "-f", is_flag=True,
              help="Stay in the foreground; Ctrl-C unmounts.")
@click.option("--prefetch", type=click.Path(exists=True, dir_okay=False),
              help="Replay this access trace into the node cache in the background.")
@click.option("--allow-devices", is_flag=True,
              help="Let setuid binaries and device nodes of the image work (default: the "
                   "mount is nosuid,nodev; only for images you trust).")
@click.option("--kernel/--fuse", "kernel", default=None,
              help="Lowers: the layers' shared kernel EROFS mounts, or the daemon's FUSE "
                   "trees [default: [mount] lowers in the config file, LAZYFS_LOWERS, "
                   "else kernel].")
@click.option("--nonempty", is_flag=True,
              help="Mount even if MOUNTPOINT is not empty (its contents are hidden until "
                   "the unmount).")
@root_option
@cache_options
@click.pass_obj
def mount(settings: Settings, image: str, mountpoint: Path, writable: Path | None,
          foreground: bool, prefetch: str | None, allow_devices: bool, kernel: bool | None,
          nonempty: bool, root: Path | None, cache_dir: Path | None,
          cache_size: str | None) -> None:
    """Mount IMAGE (a catalog name, or an environment SPEC.toml) at MOUNTPOINT.

    The layers are composed with overlayfs, over their kernel EROFS mounts
    (metadata local, data from the node daemon's blobs) or over the daemon's
    FUSE trees (--fuse); the daemon is started if it is not running. Nothing
    is read from the store until a file is read. Unmount with `lazyfs umount
    MOUNTPOINT`. MOUNTPOINT must be an empty directory (--nonempty: any).
    """
    if kernel is None and settings.lowers is not None:
        kernel = settings.lowers == "kernel"
    spec = DaemonSpec.from_settings(settings.override(node_root=root, cache_dir=cache_dir,
                                                      cache_size=cache_size))
    paths = spec.paths
    name = _image_name(settings, image)
    events = _trace(prefetch)
    with open_catalog(spec.store, spec.cluster) as catalog:
        catalog.resolve(name)  # a missing image fails before any daemon starts
    _check_mountpoint(mountpoint, nonempty)  # and so does a mount point that would hide files
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    if foreground:  # blocked before mounting: a Ctrl-C right after still unmounts
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    pid = ensure_daemon(spec)
    if pid is not None:
        click.echo(f"started lazyfs daemon {pid} at {paths.mnt}", err=True)
    with open_catalog(spec.store, spec.cluster) as catalog:
        m = mount_image(paths, catalog, name, mountpoint, writable=writable,
                        allow_devices=allow_devices, kernel=kernel)
    if events:
        try:
            request(paths, {"op": "prefetch", "events": events})
        except (OSError, DaemonError) as e:
            click.echo(f"lazyfs: warning: mounted, but the prefetch was refused: {e}", err=True)
    click.echo(f"mounted {name} ({len(m.layers)} layers, "
               f"{'writable' if writable else 'read-only'}, "
               f"{'kernel EROFS' if m.kernel else 'FUSE'} lowers) at {m.mountpoint}")
    if not foreground:
        return
    click.echo("Ctrl-C to unmount", err=True)
    # (not a Python signal handler setting an Event: Event.set() from a
    # handler can deadlock against the Event.wait() it interrupted)
    signal.sigwait(stop_signals)
    try:
        unmount(paths, m.mountpoint)
    except MountError:
        unmount(paths, m.mountpoint, lazy=True)
    click.echo(f"unmounted {m.mountpoint}")


@click.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--lazy", "-l", is_flag=True,
              help="Detach now even if busy (for a composed mount: it goes away when no "
                   "longer used; for ROOT/mnt: stops the daemon under live mounts).")
@root_option
@click.pass_obj
def umount(settings: Settings, mountpoint: Path, lazy: bool, root: Path | None) -> None:
    """Unmount a composed MOUNTPOINT, or stop the daemon when given its ROOT/mnt."""
    paths = node_of(mountpoint, NodePaths(settings.override(node_root=root).node_root.absolute()))
    if Path(os.path.realpath(mountpoint)) == Path(os.path.realpath(paths.mnt)):
        stop_daemon(paths, lazy)
        click.echo(f"stopped the lazyfs daemon at {paths.mnt}")
        return
    unmount(paths, mountpoint, lazy=lazy)
    click.echo(f"unmounted {mountpoint}")
