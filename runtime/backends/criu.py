"""CRIU for container sandboxes: where the binary is, and runc's checkpoint
and restore around it.

Debian 12's CRIU (3.17) cannot dump on this project's kernels (its vDSO
bounds check fails); install.sh builds CRIU_VERSION from Debian's source
package into CACHE/<version>/criu once per machine (docs/snapshots.md,
"Checkpoints"). LAZYFS_CRIU names another binary.

runc drives CRIU (`runc --criu PATH checkpoint|restore`): it knows the
container's namespaces, cgroups, masked paths and bind mounts, and after a
restore it knows the container again (state, pause, delete). A dump that
CRIU refuses (a descriptor of a kind it cannot save, a device) raises
NotCheckpointable with CRIU's own reason, taken from its log; the sandbox
runs on.

Not here: the exec channel's move before a dump (initexec.move_channel),
storing the images (runtime/node/capture.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from lazyfs.settings import setting

from ..errors import BackendUnavailable, NotCheckpointable, SandboxError

CRIU_VERSION = "4.1.1"
TIMEOUT = 120.0
_ERROR = re.compile(r"^\([\d.]+\) (?:\d+: )?Error \(([^)]*)\): (.*)$")
# CRIU's wrap-up lines after the first real error say nothing of the cause
_NOISE = ("Dumping FAILED", "Dump files (pid:", "Restoring FAILED", "----",
          "rlimit: ")  # (CRIU raises its own RLIMIT_NOFILE where allowed, then goes on)


def binary() -> Path:
    """The CRIU binary checkpoints use (raises BackendUnavailable naming
    what to run when it is missing)."""
    named = setting("criu")  # (settings vm.criu, LAZYFS_CRIU)
    path: Path = named or setting("criu_cache") / CRIU_VERSION / "criu"
    if not os.access(path, os.X_OK):
        raise BackendUnavailable(
            f"checkpoints need CRIU {CRIU_VERSION} at {path} (built by install.sh from "
            f"Debian's source package; Debian 12's criu 3.17 fails on this kernel)")
    return path


def missing() -> str | None:
    """Why checkpoints cannot run here (for tests and capabilities), or None."""
    try:
        binary()
    except BackendUnavailable as e:
        return str(e)
    return None


def reason(log: Path) -> str:
    """CRIU's first error in `log`, as one line (or the log's last line)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no CRIU log at {log})"
    for line in lines:
        m = _ERROR.match(line.strip())
        if m and not m.group(2).startswith(_NOISE):
            return f"{m.group(2).strip()} [{m.group(1)}]"
    return lines[-1].strip() if lines else "(empty CRIU log)"


def _run(argv: list[str], log: Path) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"{argv[3]} did not finish in {TIMEOUT:.0f} s (log: {log})") from e
    return p.returncode, p.stderr.strip()


def dump(runc: str, runc_root: Path, sandbox_id: str, images: Path, work: Path) -> None:
    """Dump the container into `images`, leaving it as it was (running, or
    frozen when the caller froze it: CRIU keeps a frozen cgroup frozen)."""
    images.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    code, err = _run([runc, "--root", str(runc_root), "--criu", str(binary()), "checkpoint",
                      "--leave-running", "--image-path", str(images), "--work-path", str(work),
                      sandbox_id], work / "dump.log")
    if code != 0:
        log = work / "dump.log"
        if log.exists():
            raise NotCheckpointable(f"{sandbox_id} cannot be checkpointed: {reason(log)}")
        raise SandboxError(f"runc checkpoint of {sandbox_id} failed: {err[-400:]}")


def restore(runc: str, runc_root: Path, sandbox_id: str, bundle: Path, images: Path,
            work: Path) -> int:
    """Restore the container `sandbox_id` from `images` over the bundle's
    config and mounted rootfs, detached; returns its init's pid."""
    work.mkdir(parents=True, exist_ok=True)
    pid_file = bundle / "init.pid"
    code, err = _run([runc, "--root", str(runc_root), "--criu", str(binary()), "restore",
                      "--detach", "--image-path", str(images), "--work-path", str(work),
                      "--bundle", str(bundle), "--pid-file", str(pid_file), sandbox_id],
                     work / "restore.log")
    if code != 0:
        log = work / "restore.log"
        why = reason(log) if log.exists() else err[-400:]
        raise SandboxError(f"restoring {sandbox_id}: {why}")
    return int(pid_file.read_text())
