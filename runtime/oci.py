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

from . import cgroups, seccomp
from .idmap import IdRange
from .spec import SandboxSpec

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
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


def _mounts(init_binary: Path) -> list[dict[str, Any]]:
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
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
        {"destination": INIT_PATH, "type": "bind", "source": str(init_binary),
         "options": ["bind", "ro", "nosuid", "nodev"]},
    ]


def config(sandbox_id: str, spec: SandboxSpec, rootfs: Path, init_binary: Path,
           ids: IdRange | None = None, seccomp_listener: Path | None = None
           ) -> dict[str, Any]:
    """config.json for `runc run`: the process is sandbox-init as PID 1, which
    reaps and starts the node's commands from the exec channel it gets as its
    stdin (runtime/backends/initexec.py).

    ids: the sandbox's host ids; its user namespace maps 0.. to them
    (runtime/idmap.py), so its root is an unprivileged host user, its
    capabilities hold only in its own namespaces, and the kernel's per-user
    budgets (inotify) are counted per sandbox (runtime/hostlimits.py).
    None: no user namespace."""
    user_namespace = ids is not None
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
        "hostname": sandbox_id[:63],
        "mounts": _mounts(init_binary),
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
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "seccomp": seccomp.oci_section(seccomp_listener),
        },
    }

