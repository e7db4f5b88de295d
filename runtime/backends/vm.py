"""Full-VM sandboxes: QEMU q35 guests whose root is a whole disk built from
the image, for workloads that need an OS of their own (its init and
services, a writable root file system with ordinary semantics).

Per sandbox, under its directory (the rest as in qemubase.py):
    vm/disk.qcow2     the sandbox's writes: a qcow2 overlay over the image's
                      cached base disk (runtime/guest/disk.py), removed by kill

Boot: Debian's cloud kernel with the "vm" initramfs (runtime/guest/
initramfs.py), which mounts the virtio-blk disk as ext4 and either hands
PID 1 to the image's own init (switch_root; the agent runs chrooted next to
it) or, for images without one, runs the guest agent as PID 1. The agent,
its protocol, exec, files, kill and pause (snapshot to disk and exit the
VMM; the overlay stays where it is) are the shared VM backend's
(runtime/backends/qemubase.py), as for microvm, its sibling: this class only
says which disk, initramfs and kernel parameters a guest gets. The base disk
is the one of the digest the node resolved when the sandbox was created.

What is not lazy: the base disk is made by reading the whole image once per
node (`mkfs.ext4 -d` over the lazy mount); every later VM of the image only
creates its overlay (a few ms). Guest page cache is per VM (no DAX on a
block device).
"""

from __future__ import annotations

from pathlib import Path

from ..config import RuntimeConfig
from ..errors import BackendUnavailable
from ..guest import disk, initramfs, qemu
from ..images import Images
from ..spec import SandboxSpec
from .base import Capabilities, Handle
from .qemubase import QemuBackend, QemuState


class VmState(QemuState):
    base_disk: Path | None = None  # the image's cached ext4 base, read-only
    disk: Path | None = None       # this sandbox's qcow2 overlay over it
    init: str | None = None        # the image's own init, if it has one


class VmBackend(QemuBackend[VmState]):
    name = "vm"
    state_type = VmState
    boot_timeout_env = "LAZYFS_VM_BOOT_TIMEOUT"
    boot_timeout_default = 120.0
    capabilities = Capabilities("vm", frozenset(
        {"exec", "stream", "files", "pause", "resume", "network_allowlist", "events"}),
        "QEMU q35 guests (KVM where it works, else TCG) booting Debian's cloud kernel from "
        "a whole ext4 disk built from the image (cached per image, read once per node) with "
        "a qcow2 copy-on-write overlay per sandbox; the image's own init runs as PID 1 when "
        "it has one; the same guest agent as microvm; pause = snapshot to disk and exit the "
        "VMM. Network allowlists as microvm's (none by default: no NIC); VMs end with the node process (not persistent).")

    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        super().__init__(config, images)
        self.disk_cache = config.vm_disk_cache or disk.DEFAULT_CACHE
        self.disk_headroom_mb = disk.HEADROOM_MB  # free space of a new VM's root file system

    def _refused(self, spec: SandboxSpec) -> str | None:
        if spec.disk_mb is not None:
            return (f"disk_mb: the vm backend cannot size a VM's root file system yet (its free "
                    f"space is the base disk's headroom, {self.disk_headroom_mb} MiB); leave "
                    "disk_mb unset")
        return super()._refused(spec)

    def _tools_missing(self) -> str | None:
        return disk.tools_missing() or super()._tools_missing()

    def _prepare(self, h: Handle[VmState], vmdir: Path) -> None:
        base = disk.base_disk(self.images, h.image, self.disk_cache, self.disk_headroom_mb,
                              h.progress)
        overlay = vmdir / "disk.qcow2"
        disk.make_overlay(base.path, overlay)
        h.state.base_disk, h.state.init, h.state.disk = base.path, base.init, overlay

    def _config(self, h: Handle[VmState], vmdir: Path, incoming: str | None = None
                ) -> qemu.VmConfig:
        kernel = self._kernel()
        overlay = h.state.disk or vmdir / "disk.qcow2"
        if not overlay.is_file():
            raise BackendUnavailable(f"{h.id}: its disk overlay {overlay} is gone")
        init = h.state.init
        return self._vm_config(
            h, vmdir, incoming, kernel=kernel,
            initrd=initramfs.initramfs(kernel, self.config.bin_dir, "vm"),
            pmem=[], drives=[qemu.Drive(overlay, "lazyfs-root", "qcow2", readonly=False)],
            append=[f"lazyfs.init={init}"] if init else self._limits(h))
