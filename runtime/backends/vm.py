"""Full-VM sandboxes: QEMU q35 guests whose root is a whole disk built from
the image, for workloads that need an OS of their own (its init and
services, a writable root file system with ordinary semantics).

Per sandbox, under its directory (the rest as in microvm.py):
    vm/disk.qcow2     the sandbox's writes: a qcow2 overlay over the image's
                      cached base disk (runtime/guest/disk.py), removed by kill

Boot: Debian's cloud kernel with the "vm" initramfs (runtime/guest/
initramfs.py), which mounts the virtio-blk disk as ext4 and either hands
PID 1 to the image's own init (switch_root; the agent runs chrooted next to
it) or, for images without one, runs the guest agent as PID 1. The agent,
its protocol, exec, files, kill and pause (snapshot to disk and exit the
VMM; the overlay stays where it is) are the microVM backend's: this class
only says which disk, initramfs and kernel parameters a guest gets.

What is not lazy: the base disk is made by reading the whole image once per
node (`mkfs.ext4 -d` over the lazy mount); every later VM of the image only
creates its overlay (a few ms). Guest page cache is per VM (no DAX on a
block device).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..config import RuntimeConfig
from ..errors import BackendUnavailable
from ..guest import qemu
from ..guest.disk import DEFAULT_CACHE, HEADROOM_MB, base_disk, make_overlay, tools_missing
from ..guest.initramfs import initramfs
from ..guest.kernel import guest_kernel
from ..images import Images
from .base import Capabilities, Handle
from .microvm import MIN_GUEST_MB, MicrovmBackend


class VmBackend(MicrovmBackend):
    name = "vm"
    capabilities = Capabilities("vm", frozenset(
        {"exec", "stream", "files", "pause", "resume"}),
        "QEMU q35 guests (KVM where it works, else TCG) booting Debian's cloud kernel from "
        "a whole ext4 disk built from the image (cached per image, read once per node) with "
        "a qcow2 copy-on-write overlay per sandbox; the image's own init runs as PID 1 when "
        "it has one; the same guest agent as microvm; pause = snapshot to disk and exit the "
        "VMM. No network; VMs end with the node process (not persistent).")

    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        super().__init__(config, images)
        self.boot_timeout = float(os.environ.get("LAZYFS_VM_BOOT_TIMEOUT", "120"))
        self.disk_cache = DEFAULT_CACHE
        self.disk_headroom_mb = HEADROOM_MB  # free space of a new VM's root file system

    def _check(self) -> tuple[str, Path]:
        missing = tools_missing()
        if missing is not None:
            raise BackendUnavailable(f"the vm backend needs {missing}")
        return super()._check()

    def _prepare(self, h: Handle, vmdir: Path) -> None:
        base = base_disk(self.images, h.spec.image, self.disk_cache, self.disk_headroom_mb)
        overlay = vmdir / "disk.qcow2"
        make_overlay(base.path, overlay)
        h.state.update(base_disk=str(base.path), init=base.init, disk=str(overlay))

    def _config(self, h: Handle, vmdir: Path, incoming: str | None = None) -> qemu.VmConfig:
        binary = qemu.qemu_binary()
        kernel = guest_kernel(self.kernel_cache)
        disk = Path(str(h.state.get("disk", vmdir / "disk.qcow2")))
        if not disk.is_file():
            raise BackendUnavailable(f"{h.id}: its disk overlay {disk} is gone")
        init = h.state.get("init")
        accel = (str(h.state.get("accel", "tcg")) if incoming is not None
                 else qemu.accelerator(binary, kernel.vmlinuz))
        return qemu.VmConfig(
            qemu=binary, accel=accel, vmlinuz=kernel.vmlinuz,
            initrd=initramfs(kernel, self.config.bin_dir, "vm"),
            memory_mb=max(h.spec.memory_mb, MIN_GUEST_MB),
            cpus=max(1, min(math.ceil(h.spec.cpu), os.cpu_count() or 1)),
            pmem=[], drives=[qemu.Drive(disk, "lazyfs-root", "qcow2", readonly=False)],
            agent_socket=vmdir / "agent.sock", console_socket=vmdir / "console.sock",
            qmp_socket=vmdir / "qmp.sock",
            append=[f"lazyfs.hostname={h.id}", *([f"lazyfs.init={init}"] if init else []),
                    *self.extra_append],
            incoming=incoming)
