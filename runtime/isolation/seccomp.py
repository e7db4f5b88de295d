"""The default seccomp policy of every sandbox: allow by default, deny (EPERM)
the system calls that reach the kernel's administrative or rarely-audited
surfaces. Expressed once; rendered as an OCI runtime config section for runc
and loaded through libseccomp (pyseccomp) in fncall workers.

Why a deny list and not Docker's allow list: the sandboxes run arbitrary
developer tool chains (compilers, debuggers, package managers) whose syscall
sets change with every glibc; the calls below are the ones no such tool needs
and that keep appearing in container escapes.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path
from typing import Any

from . import landlock

DENIED = (
    # mounts and namespaces: the sandbox's view of the host is fixed at creation
    "mount", "umount2", "pivot_root", "unshare", "setns", "fsopen", "fsmount", "fsconfig",
    "fspick", "move_mount", "open_tree", "mount_setattr",
    # kernel modules, kexec, reboot, swap, accounting, quotas, the kernel log
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
    # file handles bypass path checks (the "shocker" escape)
    "open_by_handle_at", "name_to_handle_at",
    # frequent kernel-bug surfaces with no use for build/test tools
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "lookup_dcookie",
    # hardware and clocks
    "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "nfsservctl", "kcmp",
)

# clone() flags that create namespaces; clone3 passes flags in a struct that
# seccomp cannot read, so it answers ENOSYS and libc falls back to clone().
CLONE_NS_FLAGS = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET


# landlock_restrict_self flags (ABI 7+) with which a command's own nested
# Landlock domain would keep its refusals out of the audit log, so a
# refused ptrace or signal of another command's process would go
# unrecorded: no LOG_NEW_EXEC_ON (2), or LOG_SAME_EXEC_OFF (1), or
# LOG_SUBDOMAINS_OFF (4). As (mask, value) pairs, any one matching. Such a
# call is not refused: it raises a notification the node records (a
# `landlock` event, `restrict_self unlogged`) and lets it go on.
UNLOGGED_LANDLOCK = ((2, 0), (1, 1), (4, 4))


@functools.cache
def _landlock_logs() -> bool:
    """Landlock here has ABI 7 (its refusals reach the audit log); asked
    once (every create and every fncall call builds a policy)."""
    return landlock.abi() >= 7


def _ns_bits() -> list[int]:
    # one rule per flag (rules OR): "any namespace flag set" is not one comparison
    return [1 << b for b in range(32) if CLONE_NS_FLAGS & (1 << b)]


def oci_section(listener: Path | None = None) -> dict[str, Any]:
    """The policy for runc. With `listener` (the node's socket, runtime/
    denials.py), a denied call raises a notification the node answers with
    EPERM and records; without, the kernel answers EPERM itself. clone3's
    ENOSYS is libc's cue to fall back to clone, not a denial: never notified."""
    deny: dict[str, Any] = ({"action": "SCMP_ACT_NOTIFY"} if listener else
                            {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM})
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        **({"listenerPath": str(listener)} if listener else {}),
        "syscalls": [
            {"names": list(DENIED), **deny},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
            *({"names": ["clone"], **deny,
               "args": [{"index": 0, "value": bit, "valueTwo": bit,
                         "op": "SCMP_CMP_MASKED_EQ"}]} for bit in _ns_bits()),
            *({"names": ["landlock_restrict_self"], "action": "SCMP_ACT_NOTIFY",
               "args": [{"index": 1, "value": mask, "valueTwo": value,
                         "op": "SCMP_CMP_MASKED_EQ"}]}
              for mask, value in (UNLOGGED_LANDLOCK if listener and _landlock_logs() else ())),
        ],
    }


class Compiled:
    """The policy as a ready BPF program, loaded with one prctl: for code
    that applies it per process (fncall calls) where libseccomp's own load
    (which recompiles, ~0.7 ms) would be most of the cost. With `notify`, a
    denied call raises a user notification (the loader asks the kernel for
    the listener descriptor and hands it to the node, runtime/isolation/denials.py)."""

    def __init__(self, notify: bool = False, all_x86: bool = False) -> None:
        import tempfile
        with tempfile.TemporaryFile() as f:
            build_filter(notify, all_x86).export_bpf(f)
            f.seek(0)
            code = f.read()
        self.code = code
        self._buf = ctypes.create_string_buffer(code, len(code))
        self._prog = _SockFprog(len(code) // 8, ctypes.cast(self._buf, ctypes.c_void_p))
        self._libc = ctypes.CDLL(None, use_errno=True)

    def load(self) -> None:
        """Apply to the calling thread's process (needs no_new_privs)."""
        if self._libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self._prog),
                            0, 0) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"seccomp: {os.strerror(e)}")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


@functools.cache
def program_file(directory: Path, notify: bool) -> Path:
    """oci_section's policy as a BPF program in a file of `directory` (named
    by its hash, written once), for the native container starter: the three
    x86 ABIs runc's policy names, a notifying filter with `notify`."""
    import hashlib
    code = Compiled(notify, all_x86=True).code
    out = directory / f"seccomp-{hashlib.sha256(code).hexdigest()[:16]}.bpf"
    if not out.exists():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        tmp.write_bytes(code)
        os.replace(tmp, out)
    return out


def build_filter(notify: bool = False, all_x86: bool = False) -> Any:
    """The same policy as a libseccomp filter; `.load()` applies it to the
    calling process (inherited by children). Build it before a chroot: the
    library is loaded here. `notify`: denied calls raise a user notification
    instead of failing with EPERM at once (whoever holds the listener answers;
    with no listener left the kernel answers ENOSYS: still refused)."""
    import pyseccomp as seccomp  # imported late: only fncall workers need it

    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    if all_x86:  # (oci_section's architectures; else the native one only)
        for arch in (seccomp.Arch.X86, seccomp.Arch.X32):
            f.add_arch(arch)
    deny = seccomp.NOTIFY if notify else seccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(deny, name)
        except (RuntimeError, ValueError, OSError):
            pass  # not a syscall on this architecture / libseccomp
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for bit in _ns_bits():
        f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, bit, bit))
    if notify and _landlock_logs():
        for mask, value in UNLOGGED_LANDLOCK:
            f.add_rule(seccomp.NOTIFY, "landlock_restrict_self",
                       seccomp.Arg(1, seccomp.MASKED_EQ, mask, value))
    return f
