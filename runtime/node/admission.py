"""A node's admission: how many sandboxes it holds and how much memory they
ask, per QoS class, against its quota and memory budget. Running totals, not
a scan: a full node admits as fast as an empty one. Creations under way
count, so a burst cannot overshoot.
"""

from __future__ import annotations

import os
import threading

from ..config import RuntimeConfig
from ..errors import QuotaExceeded
from ..spec import Qos, SandboxSpec


class Admission:
    """The node's final say on a creation (Node.admission)."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._pending: dict[object, SandboxSpec] = {}  # creations under way
        self._asked = {q: 0 for q in Qos}  # memory_mb asked, per QoS class

    def reserve(self, spec: SandboxSpec, live: int) -> object:
        """Room for one more sandbox of `spec` beside `live` ones, or
        QuotaExceeded; the token is given back with made() or undone()."""
        with self._lock:
            if live + len(self._pending) >= self.config.max_sandboxes:
                raise QuotaExceeded(f"this node holds its maximum of "
                                    f"{self.config.max_sandboxes} sandboxes")
            self._admit(spec)
            token = object()
            self._pending[token] = spec
            self._asked[spec.qos] += spec.memory_mb
            return token

    def made(self, token: object) -> None:
        """The reserved sandbox runs (and counts among the live ones now)."""
        with self._lock:
            del self._pending[token]

    def undone(self, token: object) -> None:
        """The reserved sandbox was not made."""
        with self._lock:
            spec = self._pending.pop(token)
            self._asked[spec.qos] -= spec.memory_mb

    def adopted(self, spec: SandboxSpec) -> None:
        """A running sandbox a previous node process left (Node.recovery)."""
        with self._lock:
            self._asked[spec.qos] += spec.memory_mb

    def released(self, spec: SandboxSpec) -> None:
        """A sandbox went."""
        with self._lock:
            self._asked[spec.qos] -= spec.memory_mb

    def _admit(self, spec: SandboxSpec) -> None:
        """With a memory budget: the memory asked by the sandboxes of spec's
        QoS class, this one included, must fit in the budget times that
        class's overcommit (best-effort sandboxes count against their own,
        larger allowance)."""
        if self.config.memory_mb is None:
            return
        factor = (self.config.overcommit_best_effort if spec.qos == Qos.best_effort
                  else self.config.overcommit_latency)
        asked = self._asked[spec.qos] + spec.memory_mb
        if asked > self.config.memory_mb * factor:
            raise QuotaExceeded(
                f"this node admits {self.config.memory_mb * factor:.0f} MB of "
                f"{spec.qos.value} sandboxes' memory ({self.config.memory_mb} MB x "
                f"overcommit {factor:g}); {asked} MB would be asked")

    def asked(self) -> dict[Qos, int]:
        """Memory (MB) asked by the sandboxes of each QoS class, creations
        under way included."""
        with self._lock:
            return dict(self._asked)

    def memory_capacity_mb(self) -> int:
        """The memory this node gives its sandboxes (config, else the host's)."""
        if self.config.memory_mb is not None:
            return self.config.memory_mb
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20)
