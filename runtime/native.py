"""The sandbox's own small program (native/sandbox-init.c), built on first use.

It is compiled statically, so it runs in any image (no libc needed there), and
cached under the runtime's state directory by the hash of its source: editing
the source rebuilds it, nothing else does.
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


def sandbox_init(cache_dir: Path) -> Path:
    """Path of the built sandbox-init binary (built now if missing)."""
    src = SOURCE.read_bytes()
    out = cache_dir / f"sandbox-init-{hashlib.sha256(src).hexdigest()[:16]}"
    if out.exists():
        return out
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendUnavailable("building sandbox-init needs a C compiler (apt-get install gcc)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".build-")
    os.close(fd)
    try:
        p = subprocess.run([cc, "-static", "-O2", "-Wall", "-o", tmp, str(SOURCE)],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise BackendUnavailable(
                f"building sandbox-init failed (static libc from libc6-dev needed): "
                f"{p.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
