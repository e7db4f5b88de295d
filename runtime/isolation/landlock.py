"""Landlock through raw system calls (no binding exists in the standard
library): restrict the calling process, and everything it starts, to read
(and execute) a set of paths and write only below others; deny TCP bind and
connect; scope abstract unix sockets and signals to the sandbox (ABI >= 6).

Rights this kernel's ABI does not know are left out, so the same call works
on older kernels with what they can enforce; `abi()` says which.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
READ = EXECUTE | READ_FILE | READ_DIR
_FS_BITS_BY_ABI = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16}  # number of fs access bits
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1, 2

_libc = ctypes.CDLL(None, use_errno=True)


class LandlockError(OSError):
    pass


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise LandlockError(e, f"landlock {what}: {os.strerror(e)}")
    return ret


def abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is not enabled."""
    v = _libc.syscall(SYS_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    return int(v) if v > 0 else 0


def restrict(read_only: Iterable[str], writable: Iterable[str], *,
             executable_fds: Iterable[int] = (), deny_tcp: bool = True) -> int:
    """Restrict this process: read/execute under `read_only`, everything under
    `writable`, execute the open files `executable_fds` (programs outside the
    view, such as sandbox-init), nothing elsewhere. Sets no_new_privs.
    Returns the ABI used."""
    version = abi()
    if version == 0:
        raise LandlockError(0, "Landlock is not enabled in this kernel")
    all_fs = (1 << _FS_BITS_BY_ABI.get(version, 16)) - 1
    attr = _RulesetAttr(all_fs, 0, 0)
    size = 8
    if version >= 4 and deny_tcp:
        attr.net, size = NET_BIND_TCP | NET_CONNECT_TCP, 16
    if version >= 6:
        attr.scoped, size = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL, 24
    fd = _check(_libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), size, 0), "create")
    try:
        for paths, rights in ((read_only, READ), (writable, all_fs)):
            for p in paths:
                pfd = os.open(p, os.O_PATH | os.O_CLOEXEC)
                try:
                    rule = _PathBeneath(rights, pfd)
                    _check(_libc.syscall(SYS_ADD_RULE, fd, RULE_PATH_BENEATH,
                                         ctypes.byref(rule), 0), f"rule for {p}")
                finally:
                    os.close(pfd)
        for efd in executable_fds:
            rule = _PathBeneath(EXECUTE | READ_FILE, efd)
            _check(_libc.syscall(SYS_ADD_RULE, fd, RULE_PATH_BENEATH, ctypes.byref(rule), 0),
                   "rule for an executable")
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(_libc.syscall(SYS_RESTRICT_SELF, fd, 0), "restrict_self")
    finally:
        os.close(fd)
    return version
