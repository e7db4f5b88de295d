"""What a test session left behind on the host: mounts and processes under
its temporary directory, sandbox cgroups, network namespaces and network
slots, counting only what THIS session made.

The host may run other lazyfs sandboxes meanwhile (a user's agent, another
test run): they are not ours to report. Ours are:

* mounts at or below the session's base temporary directory, and processes
  whose command line names it (every node, store and state directory of the
  tests lives there);
* sandbox cgroups (<controller>/lazyfs/<name>) that did not exist when the
  session started and that this session named: a sandbox id (sb-…) the
  runtime in this process logged, or a log file under the base directory
  names (nodes in child processes: agents, the CLI), or an fncall pool
  cgroup of a state directory under the base directory;
* network namespaces and slots whose slot file names one of those ids, and
  host id ranges (runtime/isolation/idmap.py) one of them still holds.

Mounts are detached and processes killed on the way (so a leak fails the run
once, not every later test); cgroups and network state are only reported.
Not here: the check itself (tests/conftest.py runs it as a session fixture).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from runtime.backends.fncall import cgroup_prefix
from runtime.backends.netpolicy import NETNS_DIR, SLOT_DIR
from runtime.config import RuntimeConfig
from runtime.isolation import cgroups, idmap

SANDBOX_ID = re.compile(r"\bsb-[0-9a-f]{16}\b")
SEARCH_DEPTH = 5  # how deep under the base directory node state and logs are looked for
NETNS_PREFIX = "lzsb-"


def sandbox_cgroups() -> set[Path]:
    return {p for p in cgroups.CGROUP_ROOT.glob(f"*/{cgroups.PARENT}/*") if p.is_dir()}


def netns_names() -> set[str]:
    try:
        return {n for n in os.listdir(NETNS_DIR) if n.startswith(NETNS_PREFIX)}
    except OSError:
        return set()


def slot_owners() -> dict[str, str]:
    """Network slot number -> the sandbox id its file names."""
    out = {}
    for f in SLOT_DIR.glob("*") if SLOT_DIR.is_dir() else []:
        try:
            out[f.name] = f.read_text().strip()
        except OSError:
            continue
    return out


def _shallow(base: Path, pattern: str) -> list[Path]:
    """Files matching `pattern` at most SEARCH_DEPTH levels below base (not
    a full walk: image trees and stores under it can be large)."""
    return [p for depth in range(SEARCH_DEPTH) for p in base.glob("*/" * depth + pattern)]


class _SandboxIds(logging.Handler):
    """Collects the sandbox ids the runtime in this process names in its log."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ids: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.ids.update(SANDBOX_ID.findall(record.getMessage()))
        except (TypeError, ValueError):  # a record whose arguments do not fit its format
            self.handleError(record)


def _audit_enabled() -> int | None:
    """The kernel's audit `enabled`, None where it cannot be read."""
    from runtime.isolation import landlock_audit
    try:
        ctl = landlock_audit._control_socket()
    except landlock_audit.AuditUnavailable:
        return None
    try:
        return landlock_audit.audit_enabled(ctl)
    except (OSError, landlock_audit.AuditUnavailable):
        return None
    finally:
        ctl.close()


@dataclass
class SessionWatch:
    """Started with the session (start()), checked at its end (finish())."""

    base: Path
    cgroups_before: set[Path] = field(default_factory=set)
    netns_before: set[str] = field(default_factory=set)
    _ids: _SandboxIds = field(default_factory=_SandboxIds)
    _runtime_level: int = logging.NOTSET
    audit_before: int | None = None

    @classmethod
    def start(cls, base: Path) -> SessionWatch:
        w = cls(base, sandbox_cgroups(), netns_names())
        w.audit_before = _audit_enabled()
        runtime_log = logging.getLogger("runtime")
        w._runtime_level = runtime_log.level
        if runtime_log.getEffectiveLevel() > logging.INFO:  # the runtime logs creations at INFO
            runtime_log.setLevel(logging.INFO)
        runtime_log.addHandler(w._ids)
        return w

    def session_ids(self) -> set[str]:
        """Sandbox ids this session made, as far as its logs tell."""
        ids = set(self._ids.ids)
        for log in _shallow(self.base, "*.log"):
            try:
                ids.update(SANDBOX_ID.findall(log.read_text(errors="replace")))
            except OSError:
                continue
        return ids

    def fncall_prefixes(self) -> set[str]:
        """The fncall pool cgroup prefixes of the node state directories under base."""
        out = set()
        for lock in _shallow(self.base, "node.lock"):
            config = RuntimeConfig(store=self.base, cluster=None, state_dir=lock.parent,
                                   node_root=self.base)
            out.add(cgroup_prefix(config) + "-")
        return out

    def leaked_mounts(self) -> list[str]:
        """Mounts under base, detached (lazily) on the way."""
        from lazyfs import sysmount
        prefix = str(self.base) + "/"
        leaked = [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)]
        for mp in reversed(leaked):
            try:
                sysmount.umount(mp, lazy=True)
            except OSError:
                pass
        return leaked

    def leaked_processes(self) -> list[str]:
        """Processes naming base in their command line, SIGKILLed on the way."""
        prefix = str(self.base) + "/"
        procs = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            text = cmd.decode(errors="replace")
            if prefix in text:
                procs.append(f"{pid}: {text[:200]}")
                try:
                    os.kill(int(pid), 9)
                except OSError:
                    pass
        return procs

    def leaked_sandbox_state(self) -> tuple[list[str], list[str]]:
        """(sandbox cgroup names, network namespaces and slots) this session left."""
        ids = self.session_ids()
        prefixes = tuple(self.fncall_prefixes())
        cgs = sorted({p.name for p in sandbox_cgroups() - self.cgroups_before
                      if p.name in ids or (prefixes and p.name.startswith(prefixes))})
        owners = slot_owners()
        netns = sorted(n for n in netns_names() - self.netns_before
                       if owners.get(n[len(NETNS_PREFIX):]) in ids)
        netns += [f"slot {s}" for s, owner in sorted(owners.items()) if owner in ids]
        netns += [f"id range {s}" for s, users in sorted(idmap.holders().items())
                  if set(users) & ids]
        return cgs, netns

    def finish(self) -> str:
        """What this session left behind, as one message ("" if nothing)."""
        runtime_log = logging.getLogger("runtime")
        runtime_log.removeHandler(self._ids)
        runtime_log.setLevel(self._runtime_level)
        mounts = self.leaked_mounts()
        procs = self.leaked_processes()
        cgs, netns = self.leaked_sandbox_state()
        audit = self.audit_left_on()
        if not (mounts or procs or cgs or netns or audit):
            return ""
        return (f"left behind: mounts {mounts[:10]}, processes {procs[:10]}, sandbox cgroups "
                f"{cgs[:10]}, network namespaces {netns}"
                + (", the kernel's audit enabled (it was off)" if audit else ""))

    def audit_left_on(self) -> bool:
        """The session's nodes turned the kernel's audit on (to read
        Landlock's records) and none turned it back off, though no reader
        of the records is left (runtime/isolation/landlock_audit.py)."""
        if self.audit_before != 0:
            return False
        from runtime.isolation import landlock_audit
        return bool(_audit_enabled()) and not landlock_audit._other_readers()
