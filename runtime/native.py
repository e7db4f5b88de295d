"""The sandbox's own small programs, built on first use: sandbox-init
(native/sandbox-init.c, containers and the host side of VMs), sandbox-spawn
(native/sandbox-spawn.c, the host side: starts a container's init), the guest
agent of VMs (native/guest-agent.c) and the library preloaded into their
QEMU (native/qemu-preload.c, a shared object: it runs in QEMU's process).

They are compiled statically, so they run in any image (no libc needed there),
with -Wall -Wextra -Werror, and cached under the runtime's state directory by
the hash of their source and flags: editing the source rebuilds it, nothing
else does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import BackendUnavailable

SOURCE = Path(__file__).with_name("native") / "sandbox-init.c"
SPAWN_SOURCE = Path(__file__).with_name("native") / "sandbox-spawn.c"
GUEST_AGENT_SOURCE = Path(__file__).with_name("native") / "guest-agent.c"
QEMU_PRELOAD_SOURCE = Path(__file__).with_name("native") / "qemu-preload.c"


WARNINGS = ("-Wall", "-Wextra", "-Werror")


def sandbox_init(cache_dir: Path) -> Path:
    """Path of the built sandbox-init binary (built now if missing)."""
    return build_static(SOURCE, cache_dir)


def sandbox_spawn(cache_dir: Path) -> Path:
    """Path of the built sandbox-spawn binary (the native container starter)."""
    return build_static(SPAWN_SOURCE, cache_dir)


def guest_agent(cache_dir: Path) -> Path:
    """Path of the built guest agent (lazyfs-agent, PID 1 of sandbox VMs)."""
    return build_static(GUEST_AGENT_SOURCE, cache_dir)


def qemu_preload(cache_dir: Path) -> Path:
    """Path of the built qemu-preload.so (LD_PRELOAD of sandbox VMs' QEMU)."""
    return build_static(QEMU_PRELOAD_SOURCE, cache_dir, shared=True)


def build_static(source: Path, cache_dir: Path, shared: bool = False) -> Path:
    """Path of the static binary built from one C file (built now if missing);
    `shared`: a shared object instead, to preload into a dynamic program."""
    src = source.read_bytes()
    name = source.stem
    kind = ["-shared", "-fPIC"] if shared else ["-static"]
    flags = [*kind, "-O2", *WARNINGS]
    key = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir / f"{name}-{key}{'.so' if shared else ''}"
    if out.exists():
        return out
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendUnavailable(f"building {name} needs a C compiler (apt-get install gcc)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".build-")
    os.close(fd)
    try:
        p = subprocess.run([cc, *flags, "-o", tmp, str(source)],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise BackendUnavailable(
                f"building {name} failed (static libc from libc6-dev needed): "
                f"{p.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
