"""Sandboxes: the SDK (`Sandbox`, `AsyncSandbox`), the node's runtime
(`runtime.node.Node`), the node agent (`runtime.agent`), and the backends
(fncall, container, microvm, vm) with their resources and security
(cgroups, seccomp, Landlock, network allowlists).

Importing this package loads the SDK, its errors and value types only (httpx,
pydantic); the node (FUSE, LMDB, trio, the chunk store) is imported when a
node runs in this process (runtime.client.transport)."""

from __future__ import annotations

from .client.sdk import AsyncSandbox, Checkpoint, Sandbox, Snapshot
from .errors import (
                     BackendUnavailable,
                     ExecError,
                     ExecStatusUnknown,
                     ExecTimeout,
                     FileError,
                     FleetUnavailable,
                     ImageNotFound,
                     InvalidSpec,
                     NodeLost,
                     NotCheckpointable,
                     OutOfMemory,
                     OutputTruncated,
                     Overloaded,
                     PermissionDenied,
                     QuotaExceeded,
                     RestoreConflict,
                     SandboxError,
                     SandboxNotFound,
                     SandboxPreempted,
                     SandboxStateError,
                     StoreUnavailable,
                     Unsupported,
)
from .spec import (
                     BackgroundExec,
                     CheckpointInfo,
                     ExecResult,
                     NetworkPolicy,
                     PreemptedSandbox,
                     ReadEvent,
                     ReadLedger,
                     Rule,
                     SandboxEvent,
                     SandboxInfo,
                     SandboxSpec,
                     SnapshotInfo,
)

__all__ = [
                     "AsyncSandbox",
                     "BackendUnavailable",
                     "BackgroundExec",
                     "Checkpoint",
                     "CheckpointInfo",
                     "ExecError",
                     "ExecResult",
                     "ExecStatusUnknown",
                     "ExecTimeout",
                     "FileError",
                     "FleetUnavailable",
                     "ImageNotFound",
                     "InvalidSpec",
                     "NetworkPolicy",
                     "NodeLost",
                     "NotCheckpointable",
                     "OutOfMemory",
                     "OutputTruncated",
                     "Overloaded",
                     "PermissionDenied",
                     "PreemptedSandbox",
                     "QuotaExceeded",
                     "ReadEvent",
                     "ReadLedger",
                     "RestoreConflict",
                     "Rule",
                     "Sandbox",
                     "SandboxError",
                     "SandboxEvent",
                     "SandboxInfo",
                     "SandboxNotFound",
                     "SandboxPreempted",
                     "SandboxSpec",
                     "SandboxStateError",
                     "Snapshot",
                     "SnapshotInfo",
                     "StoreUnavailable",
                     "Unsupported",
]
