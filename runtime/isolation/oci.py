"""The OCI runtime config (config.json) of a container sandbox.

What a sandbox can reach is decided here: its own mount, pid, uts, ipc,
network and cgroup namespaces; a composed root whose writes land in its own
upper layer; /proc and /sys masked the way runc's default spec masks them; no
host path except the read-only sandbox-init binary (bound from a tmpfs of the
node's, so its mountinfo entry names no host directory, onto /dev, a tmpfs of
the container's own, so it adds nothing to the image's tree); a small capability
set; no new privileges; the default seccomp policy; cgroup limits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..spec import SandboxSpec
from . import cgroups, hostlimits, seccomp
from .idmap import IdRange

INIT_PATH = "/dev/.sandbox-init"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# What build and test tool chains need as root in a sandbox (chown files,
# override permissions, drop to a user as apt does, signal their children).
# Not included, among others: SYS_ADMIN, NET_ADMIN, NET_RAW, MKNOD, SYS_PTRACE,
# SETFCAP, AUDIT_WRITE.
CAPABILITIES = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
                "CAP_SETGID", "CAP_SETUID", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT"]

# runc's defaults, then files that describe the host or other sandboxes
# (docs/security.md says why each): physical page state (the kpage* files can
# be read in bulk to map the host's memory, and have crashed kernels), kernel
# heap and address layout, the host's hardware, disks, boot line and
# configuration, and file locks held by every process on the host. A file
# becomes /dev/null, a directory an empty read-only tmpfs (runc); paths this
# kernel lacks are skipped.
MASKED_PATHS = [
    # runc's default spec
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/sys/firmware", "/sys/devices/virtual/powercap",
    # physical memory: page counts, flags and owning cgroups of every host page
    "/proc/kpagecount", "/proc/kpageflags", "/proc/kpagecgroup",
    # kernel heap, allocator and address layout
    "/proc/slabinfo", "/proc/vmallocinfo", "/proc/pagetypeinfo", "/proc/zoneinfo",
    "/proc/buddyinfo", "/proc/iomem", "/proc/ioports", "/proc/kallsyms", "/proc/mtrr",
    "/proc/dma", "/sys/kernel/vmcoreinfo", "/sys/kernel/notes",
    # the host's kernel, boot and disks
    "/proc/config.gz", "/proc/cmdline", "/proc/partitions", "/proc/diskstats", "/proc/swaps",
    "/proc/key-users",
    # every lock on the host (pids and inode numbers of other sandboxes)
    "/proc/locks",
    # kernel debugging and tracing interfaces
    "/sys/kernel/debug", "/sys/kernel/tracing", "/sys/kernel/security", "/sys/fs/bpf",
]
# Directories of MASKED_PATHS under /sys, masked by one read-only bind each
# of a single empty directory of the node's instead (config's node_dir): runc's mask
# for a directory is a tmpfs of its own, a superblock per path and sandbox,
# and the kernel walks every superblock's memcg-aware lists whenever a memory
# cgroup goes (each kill), so those walks grew with the sandboxes on the node
# (5 of a sandbox's 15 superblocks were these masks). runc allows no bind
# inside /proc: /proc/acpi stays a tmpfs.
SYS_MASKED_DIRS = ["/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug",
                   "/sys/kernel/tracing", "/sys/kernel/security", "/sys/fs/bpf"]
MASK_DIR = "empty"  # under config's node_dir
CGROUP_DIR = "cgroup"
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


def make_node_dirs(d: Path) -> None:
    """The directories of the node's that config's node_dir names, in d (a
    tmpfs of the node's: a bind's source then names no host directory in a
    sandbox's mountinfo)."""
    (d / MASK_DIR).mkdir(mode=0o555, exist_ok=True)
    (d / CGROUP_DIR).mkdir(mode=0o755, exist_ok=True)
    for h in cgroups.v1_hierarchies():
        (d / CGROUP_DIR / h).mkdir(mode=0o555, exist_ok=True)


def _mounts(sandbox_id: str, init_binary: Path, masks: list[str], node_dir: Path | None
            ) -> list[dict[str, Any]]:
    # the mount points of the sandbox's groups: empty directories of the
    # node's, bound read-only (one superblock less than a tmpfs of its own)
    cgroup_root: dict[str, Any] = {
        "destination": "/sys/fs/cgroup", "type": "tmpfs", "source": "tmpfs",
        "options": ["nosuid", "noexec", "nodev", "mode=755", "size=64k"]} \
        if node_dir is None else {
        "destination": "/sys/fs/cgroup", "type": "bind", "source": str(node_dir / CGROUP_DIR),
        "options": ["bind", "ro", "nosuid", "noexec", "nodev"]}
    mask_mounts = [] if node_dir is None else [
        {"destination": d, "type": "bind", "source": str(node_dir / MASK_DIR),
         "options": ["bind", "ro", "nosuid", "nodev", "noexec"]} for d in masks]
    return [
        {"destination": "/proc", "type": "proc", "source": "proc",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        # the sandbox's own groups, read-only, as binds: runc's "cgroup"
        # mount is a cgroup1 mount(2) per hierarchy, and each walks every
        # cgroup of the host's v2 tree (one per sandbox) and waits until the
        # dying ones (those of sandboxes just killed) are gone
        # (cgroup_lock_and_drain_offline): 9 walks and waits per create,
        # growing with the sandboxes on the node
        cgroup_root,
        *({"destination": f"/sys/fs/cgroup/{h}", "type": "bind",
           "source": str(cgroups.path(h, sandbox_id)),
           "options": ["bind", "ro", "nosuid", "noexec", "nodev"]}
          for h in cgroups.v1_hierarchies()),
        {"destination": INIT_PATH, "type": "bind", "source": str(init_binary),
         "options": ["bind", "ro", "nosuid", "nodev"]},
        *mask_mounts,
    ]


def config(sandbox_id: str, spec: SandboxSpec, rootfs: Path, init_binary: Path,
           ids: IdRange | None = None, seccomp_listener: Path | None = None,
           node_dir: Path | None = None, budgets: hostlimits.Budgets | None = None
           ) -> dict[str, Any]:
    """config.json for `runc run`: the process is sandbox-init as PID 1, which
    reaps and starts the node's commands from the exec channel it gets as its
    stdin (runtime/backends/initexec.py).

    ids: the sandbox's host ids; its user namespace maps 0.. to them
    (runtime/isolation/idmap.py), so its root is an unprivileged host user, its
    capabilities hold only in its own namespaces, and the kernel's per-user
    budgets (inotify) are counted per sandbox (runtime/isolation/hostlimits.py).
    None: no user namespace.

    node_dir (make_node_dirs): its empty directory masks SYS_MASKED_DIRS
    (those this host has: a bind needs its mount point, where runc skips a
    missing masked path), its cgroup directory holds the mount points of the
    sandbox's groups; None: a tmpfs for each (runc's masks). budgets (with a
    user namespace): the namespace's inotify budgets, set by a
    createContainer hook, which runc runs in the sandbox's namespaces with
    every capability there, after the mounts and before /proc/sys turns
    read-only: through the sandbox's own proc, a lookup costs the same
    however many sandboxes the node holds."""
    user_namespace = ids is not None
    masks = [d for d in SYS_MASKED_DIRS if Path(d).is_dir()] if node_dir else []
    args = [INIT_PATH, "init", "-l", "0"] + (["-i"] if spec.qos.value == "best_effort" else [])
    env = [PATH_ENV, "HOME=/root", "TERM=xterm", *(f"{k}={v}" for k, v in spec.env.items())]
    cpu = cgroups.cpu_limits(spec.cpu)
    # the network namespace is the sandbox's own (made with its user
    # namespace); an allowlist gives it a veth and rules once init runs
    # (netpolicy.create)
    namespaces = [{"type": t} for t in ("user", "pid", "ipc", "uts", "mount", "cgroup",
                                        "network") if user_namespace or t != "user"]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": env,
            "cwd": "/",
            "capabilities": {k: CAPABILITIES for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": True,
            # per process; the kernel's file table is host-wide, and every
            # open file's memory counts in the sandbox's memory limit
            "rlimits": [{"type": "RLIMIT_NOFILE", "soft": spec.open_files,
                         "hard": spec.open_files}],
        },
        "root": {"path": str(rootfs), "readonly": False},
        **({"hooks": {"createContainer": [
            {"path": "/bin/sh",
             "args": ["sh", "-c", hostlimits.budget_script(budgets, f"{rootfs}/proc")]}]}}
           if budgets is not None and user_namespace else {}),
        "hostname": sandbox_id[:63],
        "mounts": _mounts(sandbox_id, init_binary, masks, node_dir),
        "linux": {
            "cgroupsPath": cgroups.cgroups_path(sandbox_id),
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "memory": {"limit": spec.memory_mb << 20, "swap": spec.memory_mb << 20},
                "cpu": {"quota": cpu.quota, "period": cpu.period, "shares": cpu.shares},
                "pids": {"limit": spec.pids},
            },
            "namespaces": namespaces,
            **({"uidMappings": ids.oci_mappings(), "gidMappings": ids.oci_mappings()}
               if ids is not None else {}),
            "maskedPaths": [p for p in MASKED_PATHS if p not in masks],
            "readonlyPaths": READONLY_PATHS,
            "seccomp": seccomp.oci_section(seccomp_listener),
        },
    }

