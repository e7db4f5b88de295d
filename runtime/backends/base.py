"""What every sandbox backend provides, and what each one can do.

A backend turns a SandboxSpec into something that runs and answers exec,
files, pause/resume and kill. The node (runtime.node.Node) owns ids, state
files, timeouts and the choice of backend; backends own their processes,
mounts and cgroups and must undo all of them when create fails or kill runs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict

from composer.snapshot import HostIds, UpperRules

from ..api import Progress, Sink

# sends a signal to a command while it runs (its leading process; SIGKILL:
# everything it started); what a backend's exec gives `on_started`
Signaller = Callable[[int], None]
from ..files import SandboxFiles
from ..spec import (
    ExecRequest,
    ExecResult,
    NetworkPolicy,
    ReadLedger,
    ResolvedImage,
    SandboxEvent,
    SandboxSpec,
    VmState,
)

OPERATIONS = ("exec", "stream", "files", "pause", "resume", "snapshot", "fork", "verify",
              "hidden", "checkpoint", "network_allowlist", "persistent", "events", "reads",
              "signal", "archive")


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


class BackendState(BaseModel):
    """What a backend keeps about one of its sandboxes (pids, paths, slots).

    Each backend subclasses it with its own typed fields. The node writes it
    into the sandbox's state file as JSON (model_dump) and reads it back on
    recovery (model_validate), so a restarted node finds the sandbox's
    processes and mounts; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    def host_address(self) -> str | None:
        """The node's side of the sandbox's network (SandboxInfo.host_address);
        None when the sandbox has no network of its own."""
        return None

    def host_ids(self) -> HostIds | None:
        """The host ids the sandbox's processes write files with, when they
        are not the ids the sandbox sees (a container's user namespace)."""
        return None


S = TypeVar("S", bound=BackendState)


@dataclass
class Handle(Generic[S]):
    """A live sandbox as its backend sees it: the image it was created from
    (a digest, resolved once by the node; never a name) and the backend's
    own state."""

    id: str
    spec: SandboxSpec
    image: ResolvedImage
    dir: Path
    state: S
    progress: Progress | None = None  # during create only

    def step(self, what: str) -> None:
        """Tell the creator what this create does now (a long step)."""
        if self.progress is not None:
            self.progress(what)


@runtime_checkable
class Capturing(Protocol):
    """A backend whose sandboxes' files can be captured (snapshot, fork,
    verify): the writable upper, with the sandbox's processes stopped."""

    def capture(self, handle: Handle[Any]) -> AbstractContextManager[Path]: ...


@runtime_checkable
class GuestCapturing(Protocol):
    """A Capturing backend whose uppers a guest kernel wrote (a VM's disk):
    what packing them is held to beyond a container's."""

    def capture(self, handle: Handle[Any]) -> AbstractContextManager[Path]: ...
    def capture_rules(self, handle: Handle[Any]) -> UpperRules: ...


@runtime_checkable
class Checkpointing(Protocol):
    """A backend whose sandboxes' processes can be checkpointed with their
    files, and restored into new sandboxes."""

    def checkpoint(self, handle: Handle[Any], images: Path) -> AbstractContextManager[Path]:
        """Dump the processes into `images`; yield the upper, every process
        still stopped; the sandbox runs on after."""
        ...

    def restore(self, handle: Handle[Any], images: Path) -> None: ...


@runtime_checkable
class StateSaving(Protocol):
    """A backend whose sandboxes' whole state (memory, devices, and with
    them the files of an upper in guest memory) can be saved into a file
    and loaded into a new sandbox (of a ResolvedImage with vm_state) on any
    node: microVMs."""

    def save_state(self, handle: Handle[Any]) -> tuple[Path, dict[str, Any]]:
        """Pause the sandbox into a state file alone in its directory (a
        paused one's as it is); (that file, the pause's figures)."""
        ...

    def state_record(self, handle: Handle[Any], layer: str) -> VmState: ...


@runtime_checkable
class Networked(Protocol):
    """A backend whose sandboxes' network policy can change while they run."""

    def set_network(self, handle: Handle[Any], policy: NetworkPolicy) -> None: ...


@runtime_checkable
class Eventful(Protocol):
    """A backend that records what its sandboxes were refused (events)."""

    def events(self, handle: Handle[Any]) -> list[SandboxEvent]: ...


@runtime_checkable
class Readable(Protocol):
    """A backend whose sandboxes each read their image through a root of
    their own (reads: a ledger of what each read)."""

    def reads(self, handle: Handle[Any], trace: bool) -> ReadLedger: ...


class Backend(Protocol):
    name: str
    capabilities: Capabilities

    @property
    def state_type(self) -> type[BackendState]: ...  # its sandboxes' Handle.state

    def create(self, handle: Handle[Any]) -> None: ...
    def exec(self, handle: Handle[Any], req: ExecRequest, on_stdout: Sink | None,
             on_stderr: Sink | None, *,
             on_started: Callable[[Signaller], None] | None = None) -> ExecResult: ...
    def files(self, handle: Handle[Any]) -> SandboxFiles: ...
    def pause(self, handle: Handle[Any]) -> dict[str, Any]: ...
    def resume(self, handle: Handle[Any]) -> None: ...
    def kill(self, handle: Handle[Any]) -> None: ...
    def status(self, handle: Handle[Any]) -> str: ...  # running, paused or stopped
    def close(self) -> None: ...
