"""The guest kernel: Debian's cloud kernel package, unpacked into a cache.

    k = guest_kernel()                       # downloads on first use (apt-get download)
    k.vmlinuz, k.modules                     # /var/cache/lazyfs/guest-kernel/<version>/...
    load_order(k, ["erofs", "virtio_pmem"])  # .ko paths, dependencies first

The version is the one the `linux-image-cloud-amd64` metapackage names on
this host's apt mirror (`apt-cache depends`); the package is fetched with
`apt-get download` (no install, nothing of the host's kernel changes) and
unpacked with `dpkg -x`. The cloud flavour is small (26 MB), boots without
firmware, and carries virtio, virtio-pmem, EROFS and overlayfs as modules.

The package has no modules.dep (depmod runs at install time, and the host
may have no kmod), so dependencies are read from each module's `.modinfo`
`depends=` field: what `modprobe --show-depends` would print.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lazyfs.settings import setting

from ..errors import BackendUnavailable
from .cachelock import locked

METAPACKAGE = "linux-image-cloud-amd64"
APT_TIMEOUT = 300.0
_IMAGE_PKG = re.compile(r"Depends:\s*(linux-image-(\d[\w.+-]*-cloud-amd64))\s*$", re.MULTILINE)


@dataclass(frozen=True)
class GuestKernel:
    version: str          # e.g. 6.1.0-57-cloud-amd64
    vmlinuz: Path
    modules: Path         # .../lib/modules/<version>

    def module_index(self) -> dict[str, Path]:
        """Module name (dashes as underscores) -> .ko path."""
        out: dict[str, Path] = {}
        for p in self.modules.joinpath("kernel").rglob("*.ko"):
            out[p.name[:-3].replace("-", "_")] = p
        return out


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=APT_TIMEOUT,
                           check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise BackendUnavailable(f"fetching the guest kernel needs {cmd[0]} (Debian's apt "
                                 "and dpkg)") from e
    except subprocess.TimeoutExpired as e:
        raise BackendUnavailable(f"{' '.join(cmd)} took longer than {APT_TIMEOUT:g}s") from e
    if p.returncode != 0:
        raise BackendUnavailable(f"{' '.join(cmd)} failed: {p.stderr.strip()[-400:]}")
    return p.stdout


def cloud_kernel_package() -> tuple[str, str]:
    """(package, version) of the cloud kernel the metapackage depends on."""
    m = _IMAGE_PKG.search(_run(["apt-cache", "depends", METAPACKAGE]))
    if m is None:
        raise BackendUnavailable(f"apt-cache does not know {METAPACKAGE}: run apt-get update "
                                 "(the guest kernel comes from Debian's mirror)")
    return m.group(1), m.group(2)


def _cached(cache: Path) -> GuestKernel | None:
    """The newest complete unpacked kernel in cache, without asking apt."""
    found = []
    for d in cache.glob("*/.complete") if cache.is_dir() else []:
        version = d.parent.name
        k = GuestKernel(version, d.parent / "boot" / f"vmlinuz-{version}",
                        d.parent / "lib" / "modules" / version)
        if k.vmlinuz.is_file() and k.modules.is_dir():
            found.append(k)
    return max(found, key=lambda k: k.version) if found else None


def default_cache() -> Path:
    """Where guest kernels are kept (settings vm.kernel_cache,
    LAZYFS_GUEST_KERNEL_CACHE)."""
    path: Path = setting("guest_kernel_cache")
    return path


def guest_kernel(cache: Path | None = None, *, refresh: bool = False) -> GuestKernel:
    """The unpacked guest kernel, fetched first if the cache has none (or,
    with refresh, if apt names a newer one). Safe to call concurrently
    (a lock file in cache) and again after an interrupted download."""
    cache = cache or default_cache()
    if not refresh and (k := _cached(cache)) is not None:
        return k
    with locked(cache):
        if not refresh and (k := _cached(cache)) is not None:
            return k
        package, version = cloud_kernel_package()
        dest = cache / version
        if (dest / ".complete").exists():
            return GuestKernel(version, dest / "boot" / f"vmlinuz-{version}",
                               dest / "lib" / "modules" / version)
        for tool in ("apt-get", "dpkg"):
            if shutil.which(tool) is None:
                raise BackendUnavailable(f"fetching the guest kernel needs {tool}")
        with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
            # apt's sandbox user cannot write into a root-only directory
            os.chmod(tmp, 0o755)
            _run(["apt-get", "download", "-q", package], cwd=Path(tmp))
            debs = list(Path(tmp).glob("*.deb"))
            if len(debs) != 1:
                raise BackendUnavailable(f"apt-get download {package} gave {debs}")
            root = Path(tmp) / "root"
            _run(["dpkg", "-x", str(debs[0]), str(root)])
            k = GuestKernel(version, root / "boot" / f"vmlinuz-{version}",
                            root / "lib" / "modules" / version)
            if not k.vmlinuz.is_file() or not k.modules.is_dir():
                raise BackendUnavailable(f"{debs[0].name} holds no vmlinuz-{version} "
                                         "and modules")
            (root / ".complete").touch()
            shutil.rmtree(dest, ignore_errors=True)
            os.rename(root, dest)
        return GuestKernel(version, dest / "boot" / f"vmlinuz-{version}",
                           dest / "lib" / "modules" / version)


def _depends(ko: Path) -> list[str]:
    """The `depends=` names of a module's .modinfo (NUL-separated strings)."""
    data = ko.read_bytes()
    i = data.find(b"\0depends=")
    if i < 0:
        return []
    end = data.find(b"\0", i + 1)
    value = data[i + len(b"\0depends="):end].decode()
    return [d.replace("-", "_") for d in value.split(",") if d]


def load_order(kernel: GuestKernel, names: Iterable[str]) -> list[Path]:
    """The .ko files to insmod, in order, so that each module's dependencies
    come before it; modules built into the kernel are skipped."""
    index = kernel.module_index()
    builtin = set()
    b = kernel.modules / "modules.builtin"
    if b.exists():
        builtin = {Path(line).name[:-3].replace("-", "_")
                   for line in b.read_text().split()}
    out: list[Path] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        name = name.replace("-", "_")
        if name in seen or name in builtin:
            return
        if name in chain:
            raise BackendUnavailable(f"module dependency cycle: {' -> '.join(chain + (name,))}")
        ko = index.get(name)
        if ko is None:
            raise BackendUnavailable(f"the guest kernel {kernel.version} has no module {name}")
        for dep in _depends(ko):
            visit(dep, chain + (name,))
        seen.add(name)
        out.append(ko)

    for n in names:
        visit(n, ())
    return out
