"""Starting a VM's QEMU (runtime/backends/qemuproc.py), the part that needs
no QEMU: waiting for its sockets.

The stand-in for QEMU here is a fake, and only to inject a fault: a process
preempted between bind(2) and listen(2) of its sockets. Real QEMU does
both back to back and cannot be made to stop between them on demand; on a
saturated host it was (a QMP connect right after the socket files appeared
was refused, test_snapshot_microvm)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from runtime.backends import qemuproc

_BOUND_THEN_LISTENING = """
import socket, sys, time
socks = []
for p in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    s.bind(p)
    socks.append(s)
time.sleep(1.0)  # bound, not yet listening
for s in socks:
    s.listen()
time.sleep(60)
"""


def test_the_wait_for_a_vms_sockets_ends_when_they_listen(tmp_path: Path) -> None:
    paths = [tmp_path / n for n in ("agent.sock", "console.sock", "qmp.sock")]
    cfg: Any = SimpleNamespace(agent_socket=paths[0], console_socket=paths[1],
                               qmp_socket=paths[2])
    proc = subprocess.Popen([sys.executable, "-c", _BOUND_THEN_LISTENING, *map(str, paths)])
    try:
        qemuproc.wait_sockets(proc, cfg, time.monotonic() + 30)
        for p in paths:  # each one takes a connection now
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(p))
    finally:
        proc.kill()
        proc.wait()
