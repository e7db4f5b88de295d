"""Kernel tables the whole host shares, turned into budgets per sandbox.

Open files. The kernel's file table (fs.file-max) is one count for the host,
and a default sandbox could hold more than it has free (RLIMIT_NOFILE per
process times its pids). Each open file's memory (~222 bytes, measured: a
struct file) is charged to its opener's memory cgroup, so a sandbox's files
are already bounded by its memory limit (and per process by its spec's
open_files, RLIMIT_NOFILE in its OCI config). What remains is the count: the
node raises fs.file-max to what the host's memory could hold, so that the
count never runs out before memory does, and no sandbox's files can take
another's (or the host's).

inotify. Instances and watches are counted per user within a user namespace,
and again, for the namespace's owner, at every namespace above it: without
user namespaces every container's root is the host's root and all of them
share root's 128 instances. Each container sandbox has a user namespace of
its own (runtime/isolation/oci.py), owned by the host's root: its use is counted
against the budget set here, in its namespace (user.max_inotify_instances
and user.max_inotify_watches, which it cannot raise: it has no
CAP_SYS_RESOURCE), and against root at the host's level, whose limits the
node raises to cover every sandbox's budget plus the host's own. fncall
calls run as a uid of their sandbox's own (fncall_uid), which has its own
per-user budget at the host's level.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lazyfs.node import raise_open_files

from ..errors import BackendUnavailable

log = logging.getLogger(__name__)

FILE_BYTES = 200  # at least this much memory per open file (222 measured)
# the kernel's defaults: what the host's own root keeps besides the sandboxes
HOST_INOTIFY_INSTANCES = 128
HOST_INOTIFY_WATCHES = 65536
SYSCTL = Path("/proc/sys")
FNCALL_UID_BASE = 1 << 30  # fncall uids: FNCALL_UID_BASE + a hash of the sandbox id
FNCALL_UIDS = 1 << 30


@dataclass(frozen=True)
class Budgets:
    """What each sandbox of a node may hold of the host-wide tables."""

    inotify_instances: int = 128
    inotify_watches: int = 8192


def _read(name: str, root: Path = SYSCTL) -> int:
    return int((root / name).read_text().split()[0])


def _raise(name: str, want: int, root: Path = SYSCTL) -> bool:
    """Set sysctl `name` to `want` if it is lower; True if it changed."""
    if _read(name, root) >= want:
        return False
    (root / name).write_text(f"{want}\n")
    return True


def raise_own_open_files() -> int:
    """The node holds a descriptor or more per sandbox (its exec channel
    while a command runs, its seccomp notifications): raise this process's
    soft RLIMIT_NOFILE to the hard limit (lazyfs.node.raise_open_files).
    Children that must not inherit it set their own (sandboxes: open_files;
    fncall workers: 1024)."""
    return raise_open_files()


def prepare_host(max_sandboxes: int, budgets: Budgets, root: Path = SYSCTL) -> list[str]:
    """Raise the host-level counts so that only per-sandbox budgets bind:
    fs.file-max to what memory could hold, root's inotify limits to every
    sandbox's budget plus the host's own. Never lowers anything; returns
    what changed."""
    mem_total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) << 10
    wants = {"fs/file-max": mem_total // FILE_BYTES,
             "fs/inotify/max_user_instances":
                 HOST_INOTIFY_INSTANCES + max_sandboxes * budgets.inotify_instances,
             "fs/inotify/max_user_watches":
                 HOST_INOTIFY_WATCHES + max_sandboxes * budgets.inotify_watches}
    changed = [f"{name.replace('/', '.')}={want}" for name, want in wants.items()
               if _raise(name, want, root)]
    if changed:
        log.info("host-wide limits raised so that per-sandbox budgets bind: %s",
                 ", ".join(changed))
    return changed


def budget_sysctls(budgets: Budgets) -> dict[str, int]:
    """A user namespace's inotify budgets, by their names under /proc/sys,
    written by a process in it with CAP_SYS_RESOURCE there."""
    return {"user/max_inotify_instances": budgets.inotify_instances,
            "user/max_inotify_watches": budgets.inotify_watches}


def budget_script(budgets: Budgets, proc: str = "/proc") -> str:
    """budget_sysctls as shell commands, through the proc mounted at `proc`."""
    return " && ".join(f"echo {v} > {proc}/sys/{k}" for k, v in budget_sysctls(budgets).items())


def limit_sandbox(init_pid: int, budgets: Budgets) -> None:
    """Set the inotify budgets of the user namespace of process `init_pid`
    (a container sandbox's init). The user namespace's own sysctls are seen
    only from inside it, so a short-lived nsenter writes them (the node has
    every capability there; the sandbox has no CAP_SYS_RESOURCE to undo it).
    For a restored sandbox only: a created one sets them from runc's
    createContainer hook (oci.config), through its own proc. Through the
    host's proc, each lookup walks a dcache hash chain with one entry per
    user namespace that looked there, one per sandbox on the node
    (proc_sys_compare: 3 % of all CPU samples at 2,000-3,000 idle)."""
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        raise BackendUnavailable("container sandboxes need nsenter (util-linux)")
    script = budget_script(budgets)
    p = subprocess.run([nsenter, f"--user=/proc/{init_pid}/ns/user", "--", "/bin/sh", "-c",
                        script], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=10, check=False)
    if p.returncode != 0:
        raise BackendUnavailable(f"setting the sandbox's inotify budgets: "
                                 f"{p.stderr.strip()[-300:]}")


def fncall_uid(sandbox_id: str) -> int:
    """The uid every call of an fncall sandbox runs as: the kernel's per-user
    budgets (inotify, processes) are then the sandbox's own. A hash over a
    2**30 range: two of 4,096 sandboxes share one with odds below 1 %."""
    h = int.from_bytes(hashlib.blake2s(sandbox_id.encode(), digest_size=4).digest(), "big")
    return FNCALL_UID_BASE + h % FNCALL_UIDS
