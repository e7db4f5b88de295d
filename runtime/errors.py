"""Errors of the sandbox runtime, the same in the embedded runtime, the node
agent and the SDK (the agent sends the class name; the SDK raises the class). Under chunkstore.errors.LazyfsError:

    SandboxError
    ├── SandboxNotFound        no sandbox with that id (or it was killed)
    ├── ImageNotFound          the image is not in the catalog
    ├── InvalidSpec            a create/exec argument is out of range or unknown
    ├── Unsupported            the backend cannot do this call (capabilities())
    ├── BackendUnavailable     the backend cannot run on this node (runc missing,
    │   │                      not root, agent unreachable) or failed to start
    │   ├── NodeLost           the sandbox's node left the fleet (its lease
    │   │                      expired) or does not answer
    │   ├── Overloaded         the node agent has more calls in flight than it
    │   │                      takes; nothing was done: retry (the SDK does, with
    │   │                      backoff, for OVERLOAD_RETRY_S seconds)
    │   ├── FleetUnavailable   etcd does not answer, or no node of the fleet
    │   │                      can take the sandbox
    │   └── StoreUnavailable   the image store does not answer (a cluster
    │                          store the nodes share: no other node is tried)
    ├── PermissionDenied       the caller may not do this (etcd's roles)
    ├── QuotaExceeded          the node refuses more sandboxes
    ├── SandboxStateError      the call does not fit the state (exec while paused)
    │   ├── SandboxPreempted   the sandbox was preempted (pause_many(snapshot=True)):
    │   │                      its files wait in the image store; restore() it
    │   └── RestoreConflict    another caller (node) claimed the restore of that
    │                          preempted sandbox first: it runs there
    ├── NotCheckpointable      CRIU cannot save a process of the sandbox (a device,
    │                          a descriptor of a kind it cannot dump); it runs on
    ├── FileError              a files.* call failed (missing path, not a dir, escape)
    └── ExecError              a command did not finish normally; .result holds
        │                      what it printed before it was stopped
        ├── ExecTimeout        its timeout passed; its process tree was killed
        ├── OutputTruncated    it printed more than max_output_bytes; killed
        ├── OutOfMemory        the sandbox's memory limit was hit; the kernel
        │                      killed it (nothing outside the sandbox was touched)
        └── ExecStatusUnknown  it ran, but its exit status could not be collected
                               (a VM's agent could not reap it); exit_code is -1
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chunkstore.errors import LazyfsError

if TYPE_CHECKING:
    from .spec import ExecResult


class SandboxError(LazyfsError):
    """Base of every runtime error (a chunkstore.errors.LazyfsError)."""

    status = 500


class SandboxNotFound(SandboxError):
    status = 404


class ImageNotFound(SandboxError):
    status = 404


class InvalidSpec(SandboxError, ValueError):
    status = 400


class Unsupported(SandboxError):
    status = 501


class BackendUnavailable(SandboxError):
    status = 503


class NodeLost(BackendUnavailable):
    pass


class Overloaded(BackendUnavailable):
    status = 503  # refused before the node saw the call: safe to send again


class FleetUnavailable(BackendUnavailable):
    pass


class StoreUnavailable(BackendUnavailable):
    """The image store (the cluster store the fleet shares) does not answer:
    no node of the fleet can resolve the image, so the fleet tries no other."""


class PermissionDenied(SandboxError):
    """The caller may not do this (etcd's roles: a node writes only its own
    record)."""

    status = 403


class QuotaExceeded(SandboxError):
    status = 429


class SandboxStateError(SandboxError):
    status = 409


class NotCheckpointable(SandboxError):
    status = 409  # (not 422: the agent's clients read that as a request body FastAPI refused)


class SandboxPreempted(SandboxStateError):
    pass


class RestoreConflict(SandboxStateError):
    pass


class FileError(SandboxError):
    status = 400


class ExecError(SandboxError):
    status = 200  # sent inside a finished exec stream, not as an HTTP status

    def __init__(self, message: str, result: ExecResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class ExecTimeout(ExecError):
    pass


class OutputTruncated(ExecError):
    pass


class OutOfMemory(ExecError):
    pass


class ExecStatusUnknown(ExecError):
    pass


def _classes(cls: type[SandboxError]) -> list[type[SandboxError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _classes(sub))]


# every class above by name (what the agent sends, what the SDK raises)
ERRORS: dict[str, type[SandboxError]] = {c.__name__: c for c in _classes(SandboxError)
                                         if c.__module__ == __name__}
