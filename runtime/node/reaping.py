"""A node's reaper: sandboxes past their lifetime or idle timeout, or whose
VMM died under them, killed (the agent calls it every reap_interval).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..errors import (
    SandboxError,
    SandboxNotFound,
)

if TYPE_CHECKING:
    from .core import Node

log = logging.getLogger("runtime.node")

WATCHED = ("microvm", "vm")  # backends whose status is a cheap process check


class Reaper:
    """The node's timeouts (Node.reaper)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def reap(self, now: float | None = None) -> list[str]:
        """Kill sandboxes past their lifetime or idle for longer than their
        idle timeout (a running exec keeps a sandbox from being idle), and
        clean up those whose VMM died under them (a process check; container
        states would cost a runc call each, so they are checked on use)."""
        now = time.time() if now is None else now
        expired = []
        with self.node._lock:
            entries = list(self.node._sandboxes.values())
        for info, h in entries:
            s = info.spec
            if s.timeout is not None and now - info.created > s.timeout:
                expired.append((info.id, "timeout"))
            elif (s.idle_timeout is not None and not self.node._busy.get(info.id)
                  and now - info.last_active > s.idle_timeout):
                expired.append((info.id, "idle timeout"))
            elif (info.state == "running" and s.backend in WATCHED
                  and self.node.backend(s.backend).status(h) == "stopped"):
                expired.append((info.id, "its VM exited"))
        for sandbox_id, why in expired:
            try:
                self.node.kill(sandbox_id)
                log.info("reaped %s (%s)", sandbox_id, why)
            except SandboxNotFound:
                pass
            except SandboxError as e:
                log.warning("reaping %s failed: %s", sandbox_id, e)
        return [i for i, _ in expired]
