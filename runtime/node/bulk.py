"""A node's calls on many sandboxes at once: those with some labels paused,
resumed, preempted or killed (Node.bulk)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..api import Labels
from ..errors import SandboxError, SandboxNotFound

if TYPE_CHECKING:
    from .core import Node

log = logging.getLogger("runtime.node")

KILL_WORKERS = 8  # kill_many's parallel kills


class Bulk:
    """The node's calls by labels (Node.bulk)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def pause_many(self, labels: Labels, snapshot: bool = False
                   ) -> list[str]:
        """Pause the running sandboxes with these labels; with `snapshot`,
        preempt every one with them instead (see preempt)."""
        if snapshot:
            return [r.id for r in self.node.preemption.preempt_many(labels)]
        done = []
        for info in self.node.list_sandboxes(labels):
            if info.state == "running":
                self.node.pause(info.id)
                done.append(info.id)
        return done

    def resume_many(self, labels: Labels) -> list[str]:
        done = []
        for info in self.node.list_sandboxes(labels):
            if info.state == "paused":
                self.node.resume(info.id)
                done.append(info.id)
        return done

    def kill_many(self, labels: Labels) -> list[str]:
        """Kill every sandbox with these labels, KILL_WORKERS at a time (a
        kill mostly waits: on runc, on init's death, on rm). A failing kill
        does not stop the others; the first failure is raised at the end."""
        ids = [i.id for i in self.node.list_sandboxes(labels)]
        failures: list[BaseException] = []

        def one(sandbox_id: str) -> None:
            try:
                self.node.kill(sandbox_id)
            except SandboxNotFound:
                pass
            except (SandboxError, OSError) as e:  # the others still go; raised below
                log.warning("killing %s failed: %s", sandbox_id, e)
                failures.append(e)

        if len(ids) <= 1:
            for sandbox_id in ids:
                one(sandbox_id)
        else:
            with ThreadPoolExecutor(min(KILL_WORKERS, len(ids)),
                                    thread_name_prefix="kill_many") as pool:
                list(pool.map(one, ids))
        if failures:
            raise failures[0]
        return ids
