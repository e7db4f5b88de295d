"""What every sandbox backend provides, and what each one can do.

A backend turns a SandboxSpec into something that runs and answers exec,
files, pause/resume and kill. The node (runtime.node.Node) owns ids, state
files, timeouts and the choice of backend; backends own their processes,
mounts and cgroups and must undo all of them when create fails or kill runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..files import SandboxFiles
from ..spec import ExecRequest, ExecResult, SandboxSpec

Sink = Callable[[bytes], None]

OPERATIONS = ("exec", "stream", "files", "pause", "resume", "snapshot", "network_allowlist",
              "persistent")


@dataclass(frozen=True)
class Capabilities:
    backend: str
    supports: frozenset[str]
    notes: str = ""

    def __contains__(self, op: str) -> bool:
        return op in self.supports

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "notes": self.notes,
                **{op: op in self.supports for op in OPERATIONS}}


@dataclass
class Handle:
    """A live sandbox as its backend sees it; `state` is persisted as JSON by
    the node so a restarted agent finds its sandboxes again."""

    id: str
    spec: SandboxSpec
    dir: Path
    state: dict[str, Any]


class Backend(Protocol):
    name: str
    capabilities: Capabilities

    def create(self, handle: Handle) -> None: ...
    def exec(self, handle: Handle, req: ExecRequest, on_stdout: Sink | None,
             on_stderr: Sink | None) -> ExecResult: ...
    def files(self, handle: Handle) -> SandboxFiles: ...
    def pause(self, handle: Handle) -> dict[str, Any]: ...
    def resume(self, handle: Handle) -> None: ...
    def kill(self, handle: Handle) -> None: ...
    def status(self, handle: Handle) -> str: ...  # running, paused or stopped
    def close(self) -> None: ...
