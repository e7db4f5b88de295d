"""The node's runtime: every sandbox on this machine, whichever its backend
(runtime.node.core.Node), with its collaborators: admission (quota and
memory), snapshots (captures, forks, checkpoints, verifiers), preemption,
recovery (what a previous node process left) and reaping (timeouts)."""

from .core import Node

__all__ = ["Node"]
