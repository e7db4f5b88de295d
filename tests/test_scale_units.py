"""What a node does per sandbox must not grow with the sandboxes it holds:
the pieces of a create and a kill that once did, each checked by the
effect that grew (no timings)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from runtime.denials import DenialLog, SeccompListener


def _child_fds() -> set[str]:
    """The descriptors a process the node spawns inherits (runc, nsenter:
    posix_spawn keeps every descriptor not marked close-on-exec)."""
    out = subprocess.run(["/bin/sh", "-c", "ls /proc/$$/fd"], close_fds=False,
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_seccomp_listener_descriptors_are_not_inherited(tmp_path: Path) -> None:
    """Each container hands the node its seccomp notification descriptor.
    Received inheritable, every runc the node started held one per sandbox
    on the node (3,000 at 3,000 idle sandboxes, each marked close-on-exec by
    runc in turn). Here 40 "sandboxes" hand the listener a descriptor (a
    pipe's: the listener only polls it); a child spawned afterwards inherits
    none of them."""
    listener = SeccompListener(tmp_path / "seccomp.sock", DenialLog())
    pipes = [os.pipe() for _ in range(40)]
    try:
        before = _child_fds()
        for i, (r, _) in enumerate(pipes):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect(str(listener.path))
                socket.send_fds(c, [f'{{"state": {{"id": "sb-{i}"}}}}'.encode()], [r])
        deadline = time.monotonic() + 10
        while len(listener._sandbox_of) < len(pipes) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(listener._sandbox_of) == len(pipes)
        for r, _ in pipes:
            os.close(r)  # the listener's copies stay
        grown = _child_fds() - before
        assert not grown, f"a spawned process inherited {len(grown)} of the listener's " \
                          f"descriptors"
    finally:
        listener.close()
        for r, w in pipes:
            os.close(w)
