"""CRIU for container sandboxes: where the binary is, and runc's checkpoint
and restore around it.

Debian 12's CRIU (3.17) cannot dump on this project's kernels (its vDSO
bounds check fails); install.sh builds CRIU_VERSION from Debian's source
package into CACHE/<version>/criu once per machine (docs/snapshots.md,
"Checkpoints"). LAZYFS_CRIU names another binary.

A dump is CRIU alone (`criu dump`, dump_argv), with the options runc 1.1's
`checkpoint --leave-running` gives it over RPC: whichever starter made the
container (runtime/native/sandbox-spawn.c or `runc run`), the images are
what `runc restore` takes. A restore is `runc --criu PATH restore`: runc
knows the container's namespaces, cgroups, masked paths and bind mounts
from the bundle's config, and knows the restored container after (state,
pause, delete). A dump that CRIU refuses (a descriptor of a kind it cannot
save, a device) raises NotCheckpointable with CRIU's own reason, taken from
its log; the sandbox runs on.

Not here: the exec channel's move before a dump (initexec.move_channel),
storing the images (runtime/node/capture.py).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

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


def _run(argv: list[str], log: Path, what: str) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"{what} did not finish in {TIMEOUT:.0f} s (log: {log})") from e
    return p.returncode, p.stderr.strip()


_DEFAULT_DEVICES = ("/dev/null", "/dev/random", "/dev/full", "/dev/tty", "/dev/zero",
                    "/dev/urandom")  # runc's specconv.AllowedDevices that have a path
_EXT_NS = {"network": ("net", "extRootNetNS"), "pid": ("pid", "extRootPidNS")}


def _host_mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of the host's mounts."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        fstype, _src, sopts = (right.split(" ") + ["", ""])[:3]
        out.append((left.split(" ")[4], fstype, sopts))
    return out


def _freezer(pid: int) -> str | None:
    """runc's freeze_cgroup: the v1 freezer group if mounted (hybrid), else the v2 one."""
    groups = dict(line.split(":", 2)[1:] for line in
                  Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    for mp, fstype, sopts in _host_mounts():
        if fstype == "cgroup" and "freezer" in sopts.split(",") and "freezer" in groups:
            return mp + groups["freezer"]
    for mp, fstype, _ in _host_mounts():
        if fstype == "cgroup2" and mp == "/sys/fs/cgroup" and "" in groups:
            return mp + groups[""]
    return None


def dump_argv(pid: int, config: dict[str, Any], images: Path, work: Path) -> list[str]:
    """`criu dump` as runc 1.1.5's `checkpoint --leave-running` asks it over RPC."""
    linux = config.get("linux", {})
    namespaces = linux.get("namespaces", [])
    cgroup2 = any(fs == "cgroup2" and mp == "/sys/fs/cgroup" for mp, fs, _ in _host_mounts())
    argv = [str(binary()), "dump", "-t", str(pid), "--images-dir", str(images),
            "--work-dir", str(work), "-o", "dump.log", "-v4", "--root", config["root"]["path"],
            "--manage-cgroups=soft", "--leave-running", "--empty-ns", "net"]
    if Path("/etc/criu/runc.conf").exists():
        argv += ["--config", "/etc/criu/runc.conf"]
    for ns in namespaces:  # a joined net or pid namespace: external
        if ns["type"] in _EXT_NS and ns.get("path"):
            kind, key = _EXT_NS[ns["type"]]
            argv += ["--external", f"{kind}[{os.stat(ns['path']).st_ino}]:{key}"]
    freezer = _freezer(pid)
    if freezer:
        argv += ["--freeze-cgroup", freezer]
    ext: list[tuple[str, str]] = []
    for m in config.get("mounts", []):
        dest = os.path.normpath("/" + m["destination"].lstrip("/"))
        if {"bind", "rbind"} & set(m.get("options", [])):
            ext.append((dest, dest))
        elif m.get("type") == "cgroup" and not (cgroup2 or any(
                n["type"] == "cgroup" for n in namespaces)):  # runc's getCgroupMounts
            ext += [(f"{dest}/{os.path.basename(mp)}",) * 2 for mp, fs, _ in _host_mounts()
                    if fs == "cgroup"]
    for path in linux.get("maskedPaths", []):  # runc's addMaskPaths
        try:
            if not stat.S_ISDIR(os.stat(f"/proc/{pid}/root/{path}").st_mode):
                ext.append((path, "/dev/null"))
        except FileNotFoundError:
            pass
    ext += [(d, d) for d in dict.fromkeys(
        [*_DEFAULT_DEVICES, *(d["path"] for d in linux.get("devices", []))])]
    return argv + [a for k, v in ext for a in ("--external", f"mnt[{k}]:{v}")]


def dump(pid: int, config: dict[str, Any] | Path, images: Path, work: Path,
         descriptors: list[str] | None = None, name: str | None = None) -> None:
    """Dump the container whose init is `pid` (config: its OCI config, or the
    bundle's config.json) into `images` with CRIU alone, for `runc restore`; it
    is left as it was (CRIU keeps a frozen cgroup frozen). descriptors: init's
    fds 0-2 as named when it started (runc's external_descriptors); None: now."""
    cfg: dict[str, Any] = json.loads(config.read_text()) if isinstance(config, Path) else config
    if isinstance(config, Path):  # (a relative root.path is the bundle's)
        cfg["root"]["path"] = str(config.parent / cfg["root"]["path"])
    name = name or f"pid {pid}"
    # default modes (0755): the restored tasks and CRIU's tar run as the
    # sandbox's host root in its user namespace and must reach both
    images.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if descriptors is None:
        descriptors = []
        for i in range(3):
            try:
                descriptors.append(os.readlink(f"/proc/{pid}/fd/{i}"))
            except PermissionError:
                descriptors.append("")
    fd = os.open(images / "descriptors.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(descriptors, separators=(",", ":")))
    code, err = _run(dump_argv(pid, cfg, images, work), work / "dump.log", f"criu dump of {name}")
    if code != 0:
        log = work / "dump.log"
        if log.exists():
            raise NotCheckpointable(f"{name} cannot be checkpointed: {reason(log)}")
        raise SandboxError(f"criu dump of {name} failed: {err[-400:]}")


def restore(runc: str, runc_root: Path, sandbox_id: str, bundle: Path, images: Path,
            work: Path) -> int:
    """Restore the container `sandbox_id` from `images` over the bundle's
    config and mounted rootfs, detached; returns its init's pid."""
    work.mkdir(parents=True, exist_ok=True)
    pid_file = bundle / "init.pid"
    code, err = _run([runc, "--root", str(runc_root), "--criu", str(binary()), "restore",
                      "--detach", "--image-path", str(images), "--work-path", str(work),
                      "--bundle", str(bundle), "--pid-file", str(pid_file), sandbox_id],
                     work / "restore.log", f"runc restore of {sandbox_id}")
    if code != 0:
        log = work / "restore.log"
        why = reason(log) if log.exists() else err[-400:]
        raise SandboxError(f"restoring {sandbox_id}: {why}")
    return int(pid_file.read_text())
