"""Sandbox backends and the registry that picks one by name.

    fncall     pre-forked restricted workers over an image's tree (stateless calls)
    container  runc over a lazily loaded composed root
    microvm    QEMU guests with the image layers as virtio-pmem + DAX (EROFS)
    vm         full QEMU VMs: the same lazy layers under a writable ext4 disk, the image's init

microvm and vm are siblings over qemubase.py (the guest agent, exec, files,
kill), which uses qemuproc.py (QEMU processes), snapshots.py (pause/resume)
and guestfiles.py (files through the agent).

Every backend is given the image as a digest the node resolved once, at
create (Handle.image), and keeps its per-sandbox state in its own typed
BackendState subclass (Handle.state), which the node persists as JSON.
"""

from __future__ import annotations

from ..api import Sink
from ..config import RuntimeConfig
from ..errors import BackendUnavailable
from ..images import Images
from .base import Backend, BackendState, Capabilities, Handle

__all__ = ["Backend", "BackendState", "Capabilities", "Handle", "Sink", "capabilities",
           "make_backend"]

def capabilities(name: str) -> Capabilities:
    if name == "container":
        from .container import ContainerBackend
        return ContainerBackend.capabilities
    if name == "fncall":
        from .fncall import FncallBackend
        return FncallBackend.capabilities
    if name == "microvm":
        from .microvm import MicrovmBackend
        return MicrovmBackend.capabilities
    if name == "vm":
        from .vm import VmBackend
        return VmBackend.capabilities
    raise BackendUnavailable(f"unknown backend {name!r}: fncall, container, microvm or vm")


def make_backend(name: str, config: RuntimeConfig, images: Images) -> Backend:
    if name == "container":
        from .container import ContainerBackend
        return ContainerBackend(config, images)
    if name == "fncall":
        from .fncall import FncallBackend
        return FncallBackend(config, images)
    if name == "microvm":
        from .microvm import MicrovmBackend
        return MicrovmBackend(config, images)
    if name == "vm":
        from .vm import VmBackend
        return VmBackend(config, images)
    raise BackendUnavailable(capabilities(name).notes or f"backend {name} is not available")
