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



# ---- the same sandbox without runc (runtime/native/sandbox-spawn.c) ---------

# What runc adds to every container's /dev without the config naming it: the
# default devices (with a user namespace, binds of the host's nodes, as runc
# makes them there), its links, and the device rules of its group
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"),
             ("/proc/self/fd/1", "/dev/stdout"), ("/proc/self/fd/2", "/dev/stderr"),
             ("pts/ptmx", "/dev/ptmx"), ("/proc/kcore", "/dev/core"))
# runc's default allowed devices (libcontainer/specconv AllowedDevices), after
# the config's deny-all: mknod of any node (which only CAP_MKNOD can use, and
# sandboxes lack it), the default devices, ptys, tun
DEVICE_RULES = ("c *:* m", "b *:* m", "c 1:3 rwm", "c 1:8 rwm", "c 1:7 rwm", "c 5:0 rwm",
                "c 1:5 rwm", "c 1:9 rwm", "c 136:* rwm", "c 5:2 rwm",
                "c 10:200 rwm")

# mount(2) flags of OCI mount options (runc's table); any other option is
# file-system data
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
_MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME,
                "strictatime": MS_STRICTATIME, "bind": MS_BIND, "rbind": MS_BIND | MS_REC}
_NO_FLAG = frozenset({"rw", "suid", "dev", "exec", "atime", "diratime"})

# capability numbers (linux/capability.h), by the OCI names
_CAP_NUMBERS = {name: n for n, name in enumerate((
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE"))}
_RLIMITS = {"RLIMIT_CPU": 0, "RLIMIT_FSIZE": 1, "RLIMIT_DATA": 2, "RLIMIT_STACK": 3,
            "RLIMIT_CORE": 4, "RLIMIT_RSS": 5, "RLIMIT_NPROC": 6, "RLIMIT_NOFILE": 7,
            "RLIMIT_MEMLOCK": 8, "RLIMIT_AS": 9}


class SpecError(ValueError):
    """The OCI config asks for something the native starter does not do."""


def mount_flags(options: list[str]) -> tuple[int, str]:
    """(flags, data) of an OCI mount's options, as runc parses them."""
    flags, data = 0, []
    for o in options:
        if o in _MOUNT_FLAGS:
            flags |= _MOUNT_FLAGS[o]
        elif o not in _NO_FLAG:
            data.append(o)
    return flags, ",".join(data)


def native_spec(sandbox_id: str, cfg: dict[str, Any], group_procs: list[Path],
                seccomp_program: Path | None, sysctls: dict[str, int] | None = None) -> bytes:
    """The spec sandbox-spawn takes for the sandbox `cfg` (config()'s
    output) describes, so one declaration makes both starters' sandboxes:
    NUL-terminated strings, a directive then its arguments.

    group_procs: the cgroup.procs files of the sandbox's groups (made and
    limited by cgroups.container_group from cfg's resources); seccomp_program:
    cfg's seccomp policy compiled (seccomp.Compiled) to a file; its
    listenerPath, if any, gets the notifying filter's listener (with the
    container state runc sends, naming sandbox_id). sysctls: files under
    /proc/sys written through the sandbox's own proc before it turns
    read-only (what config()'s createContainer hook does under runc: pass
    cfg made without budgets)."""
    out: list[str] = []

    def put(*fields: str) -> None:
        for f in fields:
            if "\0" in f:
                raise SpecError(f"a NUL byte in {f[:40]!r}")
        out.extend(fields)

    linux, proc = cfg["linux"], cfg["process"]
    put("root", cfg["root"]["path"])
    for ns in linux["namespaces"]:
        if "path" in ns:
            raise SpecError("joining an existing namespace is not done natively")
        put("ns", ns["type"])
    for kind in ("uid", "gid"):
        maps = linux.get(f"{kind}Mappings")
        if maps:
            put(f"{kind}map", "".join(f"{m['containerID']} {m['hostID']} {m['size']}\n"
                                      for m in maps))
    if "hostname" in cfg:
        put("hostname", cfg["hostname"])
    for p in group_procs:
        put("cgroup", str(p))
    for m in cfg["mounts"]:
        flags, data = mount_flags(m.get("options", []))
        kind = "bind" if m["type"] == "bind" or flags & MS_BIND else m["type"]
        if kind == "bind" and data:
            raise SpecError(f"bind {m['destination']}: options {data!r} are not known")
        put("mount", m["source"], m["destination"].lstrip("/"), kind, str(flags), data)
        if m["destination"] == "/dev":  # runc's devices, right after /dev (binds
            # also without a user namespace, where runc makes nodes: the same files)
            for d in DEVICES:
                put("mount", f"/dev/{d}", f"dev/{d}", "bind", "0", "")
    for target, link in DEV_LINKS:
        if link != "/dev/core" or Path("/proc/kcore").exists():
            put("symlink", target, link.lstrip("/"))
    if cfg.get("hooks"):
        raise SpecError("hooks are not run by the native starter: give it sysctls instead")
    for name, value in (sysctls or {}).items():
        put("sysctl", f"/proc/sys/{name}", str(value))
    for p in linux.get("readonlyPaths", []):
        put("ro", p)
    for p in linux.get("maskedPaths", []):
        put("mask", p)
    for r in proc.get("rlimits", []):
        if r["type"] not in _RLIMITS:
            raise SpecError(f"rlimit {r['type']} is not known")
        put("rlimit", str(_RLIMITS[r["type"]]), str(r["soft"]), str(r["hard"]))
    caps = proc.get("capabilities", {})
    if caps.get("inheritable") or caps.get("ambient") or \
            len({tuple(v) for v in caps.values()}) > 1:
        raise SpecError("the native starter gives one capability set (bounding = "
                        "effective = permitted)")
    unknown = [c for c in caps.get("bounding", []) if c.removeprefix("CAP_") not in _CAP_NUMBERS]
    if unknown:
        raise SpecError(f"capabilities {unknown} are not known")
    put("caps", str(sum(1 << _CAP_NUMBERS[c.removeprefix("CAP_")]
                        for c in caps.get("bounding", []))))
    if proc.get("noNewPrivileges"):
        put("nonewprivs")
    if proc.get("user", {}).get("uid", 0) or proc.get("user", {}).get("gid", 0):
        raise SpecError("the native starter runs init as the sandbox's root")
    sec = linux.get("seccomp")
    if sec is not None:
        if seccomp_program is None:
            raise SpecError("the config has a seccomp policy: its compiled program is needed")
        put("seccomp", str(seccomp_program), sec.get("listenerPath", ""), sandbox_id)
    put("cwd", proc.get("cwd", "/"))
    for a in proc["args"]:
        put("arg", a)
    for e in proc.get("env", []):
        put("env", e)
    return b"".join(s.encode() + b"\0" for s in out)
