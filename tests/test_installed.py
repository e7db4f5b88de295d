"""lazyfs as a user installs it: a wheel built from this tree, installed into
a directory of its own and run from a working directory that is not the
source tree. The daemon, a composed mount and a container sandbox must work
from the installed copy alone (its child processes start with
`python -m lazyfs` and `python -m runtime.agent`, and the runtime compiles
its C helpers from sources shipped inside the package)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.lazynode import fuse_missing
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("installed")
    wheels = d / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True, cwd=d)
    (wheel,) = wheels.glob("lazyfs-*.whl")
    site = d / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(site), str(wheel)], check=True, capture_output=True, cwd=d)
    return site


def _env(site: Path, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYFS_")}
    env.update(PYTHONPATH=str(site), LAZYFS_NODE_ROOT=str(tmp / "node"),
               LAZYFS_RUNTIME_DIR=str(tmp / "state"), LAZYFS_CONFIG=str(tmp / "none.toml"),
               XDG_CACHE_HOME=str(tmp / "cache"))
    return env


def test_the_installed_packages_are_the_ones_imported(installed: Path, tmp_path: Path) -> None:
    code = ("import chunkstore, composer, lazyfs, pmem, runtime, tools, runtime.native as n\n"
            "for m in (chunkstore, composer, lazyfs, pmem, runtime, tools):\n"
            "    print(m.__file__)\n"
            "print(n.SOURCE.is_file(), n.GUEST_AGENT_SOURCE.is_file())\n")
    p = subprocess.run([sys.executable, "-c", code], env=_env(installed, tmp_path), cwd=tmp_path,
                       capture_output=True, text=True, check=True)
    *files, sources = p.stdout.splitlines()
    assert all(f.startswith(str(installed)) for f in files), files
    assert sources == "True True", "the C sources of the runtime's helpers are not installed"


def test_mount_and_sandbox_from_the_installed_copy(installed: Path, tmp_path: Path) -> None:
    why = fuse_missing() or runtime_missing()
    if why:
        pytest.skip(why)
    store = busybox_store(tmp_path / "img")
    env = _env(installed, tmp_path)
    cli = [sys.executable, "-m", "tools.cli", "--store", str(store)]
    mp = tmp_path / "root"
    mp.mkdir()
    p = subprocess.run([*cli, "mount", IMAGE, str(mp)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, check=False)
    try:
        assert p.returncode == 0, p.stderr
        assert (mp / "bin" / "busybox").is_file()
    finally:
        subprocess.run([*cli, "umount", str(mp)], env=env, cwd=tmp_path, capture_output=True,
                       check=False)
    code = ("from runtime import Sandbox\n"
            f"with Sandbox.create({IMAGE!r}) as sb:\n"
            "    r = sb.exec('echo installed; ls /bin/busybox')\n"
            "    print(r.exit_code, r.stdout.decode().split())\n")
    env["LAZYFS_STORE"] = str(store)
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, check=False)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.strip() == "0 ['installed', '/bin/busybox']"
    finally:
        subprocess.run([*cli, "umount", "--lazy", str(tmp_path / "node" / "mnt")], env=env,
                       cwd=tmp_path, capture_output=True, check=False)
