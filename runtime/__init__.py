"""Sandboxes: the SDK (`Sandbox`, `AsyncSandbox`), the node's runtime
(`runtime.node.Node`), the node agent (`runtime.agent`), and the backends
(fncall, container; microvm and vm to come) with their resources and
security (cgroups, seccomp, Landlock, network allowlists)."""

from .errors import (
                     BackendUnavailable,
                     ExecError,
                     ExecTimeout,
                     FileError,
                     ImageNotFound,
                     InvalidSpec,
                     OutOfMemory,
                     OutputTruncated,
                     QuotaExceeded,
                     SandboxError,
                     SandboxNotFound,
                     SandboxStateError,
                     Unsupported,
)
from .sdk import AsyncSandbox, Sandbox
from .spec import ExecResult, NetworkPolicy, Rule, SandboxInfo, SandboxSpec

__all__ = ["AsyncSandbox", "BackendUnavailable", "ExecError", "ExecResult", "ExecTimeout",
           "FileError", "ImageNotFound", "InvalidSpec", "NetworkPolicy", "OutOfMemory",
           "OutputTruncated", "QuotaExceeded", "Rule", "Sandbox", "SandboxError", "SandboxInfo",
           "SandboxNotFound", "SandboxSpec", "SandboxStateError", "Unsupported"]
