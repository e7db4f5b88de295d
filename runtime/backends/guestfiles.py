"""A VM sandbox's files, through its guest agent (runtime/guest/protocol.py).

Paths resolve inside the sandbox's root in the guest (openat2
RESOLVE_IN_ROOT), as SandboxFiles resolves them on the host for containers.
It does not find or start the VM: it is given a function returning the live
one and one wording an agent failure.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import BackendUnavailable, FileError, Unsupported
from ..files import MAX_READ, FileInfo, SandboxFiles, _clean, _printable
from ..guest.protocol import AgentConnection, AgentError, entry_kind
from .qemuproc import Vm


class GuestFiles(SandboxFiles):
    def __init__(self, sandbox_dir: Path, vm: Callable[[], Vm],
                 unavailable: Callable[[Vm, Exception], BackendUnavailable]) -> None:
        super().__init__(sandbox_dir)
        self._vm = vm
        self._unavailable = unavailable

    def _call(self) -> tuple[Vm, AgentConnection]:
        vm = self._vm()
        return vm, vm.agent

    def read(self, path: str, *, limit: int = MAX_READ) -> bytes:
        _clean(path)
        vm, agent = self._call()
        try:
            return agent.read(path, limit)
        except FileError as e:
            if "File too large" in str(e):
                raise FileError(f"{path}: larger than {limit} bytes; use download()") from None
            raise
        except AgentError as e:
            raise self._unavailable(vm, e) from e

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        p = _clean(path)
        if p.name in ("", ".", ".."):
            raise FileError(f"{path}: not a file path")
        vm, agent = self._call()
        try:
            agent.write(path, data, mode)
        except AgentError as e:
            raise self._unavailable(vm, e) from e

    def list(self, path: str = "/") -> list[FileInfo]:
        p = _clean(path)
        vm, agent = self._call()
        try:
            entries = agent.list(path)
        except AgentError as e:
            raise self._unavailable(vm, e) from e
        return [FileInfo(name=_printable(e.name), path=str(p / _printable(e.name)),
                         type=entry_kind(e.mode), size=e.size, mode=e.mode & 0o7777,
                         mtime=e.mtime_ns / 1e9)
                for e in sorted(entries, key=lambda e: e.name)]

    def stat(self, path: str) -> FileInfo:
        """Through the listing of its directory (the guest agent has no
        stat of its own); the root is not in one: FileError."""
        p = _clean(path)
        if str(p) == "/":
            raise FileError("/: a VM's root is not in a directory listing; list('/') instead")
        for info in self.list(str(p.parent)):
            if info.name == _printable(p.name):
                return info
        raise FileError(f"{path}: No such file or directory")

    def remove(self, path: str, *, recursive: bool = False) -> None:
        p = _clean(path)
        if str(p) == "/":
            raise FileError("refusing to remove the sandbox's root")
        vm, agent = self._call()
        try:
            agent.remove(path, recursive)
        except AgentError as e:
            raise self._unavailable(vm, e) from e

    def exists(self, path: str) -> bool:
        _clean(path)
        vm, agent = self._call()
        try:
            return agent.exists(path)
        except AgentError as e:
            raise self._unavailable(vm, e) from e

    def put_archive(self, path: str, data: bytes, *, keep_owners: bool = False) -> None:
        raise Unsupported("archives of a VM's files are not built yet (use write / read)")

    def get_archive(self, path: str) -> bytes:
        raise Unsupported("archives of a VM's files are not built yet (use write / read)")
