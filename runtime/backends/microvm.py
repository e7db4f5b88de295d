"""microVM sandboxes: QEMU guests whose image layers are virtio-pmem devices
mounted with DAX, so every VM on the node reads the same host page cache.

Boot: the guest kernel (runtime/guest/kernel.py) with the project's
initramfs (runtime/guest/initramfs.py) mounts the layers from their pmem
devices (runtime/guest/pmemimages.py: a local metadata image per layer, and
the node daemon's blob mapped shared, so guest page faults fetch lazily) as
EROFS with `-o dax`, overlays a tmpfs upper in
guest memory, and execs the guest agent as PID 1. The layers are those of
the digest the node resolved when the sandbox was created (Handle.image):
a resume after the tag moved maps the same files.

Everything else (the sandbox's files on the host, boot, the agent, exec,
files, pause as snapshot-and-exit, kill) is the shared VM backend's
(runtime/backends/qemubase.py). With the pmem regions left out of the
snapshot (x-ignore-shared: they are the shared image files), a paused
microVM's snapshot holds only guest memory and device state.

verify (capture): the upper is a tmpfs in guest memory, outside the root
the agent serves; the agent's UPPER call streams it to the host with every
other process of the guest stopped (runtime/guest/upper.py checks the
stream and writes it into a fresh directory, packed as a full VM's disk).

Memory the guest frees goes back to the host: the VMM has a virtio-balloon
with free page reporting (never inflated), whose driver the initramfs loads;
the guest reports free 2 MiB blocks and QEMU discards them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import Field

from composer.snapshot import UpperRules
from lazyfs.settings import setting

from ..config import RuntimeConfig
from ..errors import BackendUnavailable, SandboxError, SandboxStateError
from ..files import remove_tree
from ..guest import qemu
from ..guest.initramfs import initramfs
from ..guest.protocol import AgentError
from ..guest.upper import UpperRefused, UpperTree
from ..images import Images
from .base import Capabilities, Handle
from .qemubase import PAUSE_WAIT, QemuBackend, QemuState
from .qemuproc import vmm_pss

__all__ = ["MicrovmBackend", "MicrovmState", "vmm_pss"]

LayersOn = Literal["pmem", "blk"]
MAX_UPPER_ENTRIES = 1_000_000  # entries of one captured upper, whatever the guest's size


class MicrovmState(QemuState):
    layers_on: LayersOn = "pmem"
    # the pmem layers' digests, bottom first, then the fixups
    layers: list[str] = Field(default_factory=list)


class MicrovmBackend(QemuBackend[MicrovmState]):
    name = "microvm"
    state_type = MicrovmState
    capabilities = Capabilities("microvm", frozenset(
        {"exec", "stream", "files", "pause", "resume", "snapshot", "network_allowlist",
         "events", "hidden", "verify"}),
        "QEMU q35 guests (KVM where it works, else TCG) booting Debian's cloud kernel; image "
        "layers are virtio-pmem devices mounted EROFS -o dax (one host page-cache copy for "
        "all VMs), upper in guest memory; a static guest agent over virtio-serial; pause = "
        "snapshot to disk and exit the VMM; snapshot and preemption = that state (memory, "
        "devices, the upper) as a layer in the store, loaded into a VM of the same shape on "
        "any node (no fork: a copy would share the guest kernel's identity); hidden paths and "
        "verify (the agent streams its upper, the guest's processes stopped, into a host "
        "directory packed as a container's upper; the verifier a fresh microVM). QEMU in per-sandbox host cgroups (cpu, memory, "
        "pids; best_effort = cpu.idle + SCHED_IDLE). Network allowlists as containers' (a "
        "virtio-net NIC on a tap in the VMM's own network namespace, the same nftables rules "
        "there; none by default: no NIC). VMs end with the node process (not persistent).")

    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        super().__init__(config, images)
        self.pmem_cache = config.pmem_cache or setting("pmem_cache")
        # where the layers are attached: "pmem" (virtio-pmem + DAX: one host page-cache
        # copy for all VMs) or "blk" (virtio-blk, each guest caches its own copy: only
        # for comparing the two; settings vm.layers, LAZYFS_MICROVM_LAYERS)
        on = setting("vm_layers")
        if on not in ("pmem", "blk"):
            raise BackendUnavailable(f"vm.layers (LAZYFS_MICROVM_LAYERS) {on!r}: pmem or blk")
        self.layers_on: LayersOn = "blk" if on == "blk" else "pmem"
        # free page reporting (docs/microvm.md, "Memory reclaim"): on unless
        # vm.balloon (LAZYFS_MICROVM_BALLOON) is off (the benchmark's baseline)
        balloon = setting("vm_balloon")
        if balloon not in ("on", "off"):
            raise BackendUnavailable(f"vm.balloon (LAZYFS_MICROVM_BALLOON) {balloon!r}: "
                                     "on or off")
        self.balloon = balloon == "on"

    def _prepare(self, h: Handle[MicrovmState], vmdir: Path) -> None:
        h.state.layers_on = self.layers_on

    @staticmethod
    def _upper_mb(h: Handle[MicrovmState]) -> int:
        """The size of the guest's tmpfs upper."""
        return h.spec.disk_mb or max(16, h.spec.memory_mb // 2)

    def _config(self, h: Handle[MicrovmState], vmdir: Path, incoming: str | None = None
                ) -> qemu.VmConfig:
        kernel = self._kernel()
        layers = self._pmem_layers(h, self.pmem_cache)
        h.state.layers = [x.digest for x in layers]
        upper_mb = self._upper_mb(h)
        on = h.state.layers_on
        if on == "blk":  # the same files as read-only disks: each guest caches what it reads
            pmem: list[Path] = []
            drives = [qemu.Drive(f, f"lz{i}{kind}") for i, layer in enumerate(layers)
                      for f, kind in zip(layer.files, "mb", strict=True)]
        else:
            pmem, drives = [p for layer in layers for p in layer.files], []
        return self._vm_config(
            h, vmdir, incoming, kernel=kernel, initrd=initramfs(kernel, self.config.bin_dir),
            pmem=pmem, drives=drives,
            append=[f"lazyfs.layers={len(layers)}", f"lazyfs.layers_on={on}",
                    f"lazyfs.upper_mb={upper_mb}", *self._limits(h)])

    def kill(self, h: Handle[MicrovmState]) -> None:
        super().kill(h)
        remove_tree(self._capture_dir(h))  # a capture a dead node left

    # -- capture (verify) ------------------------------------------------------
    @staticmethod
    def _capture_dir(h: Handle[MicrovmState]) -> Path:
        return h.dir / "capture"

    def upper_bounds(self, h: Handle[MicrovmState]) -> tuple[int, int]:
        """What one captured upper may hold: (bytes of regular files, entries).
        The bytes are the tmpfs upper's size (files past it are sparse);
        the entries twice the inodes a tmpfs of the guest's RAM holds by
        default (one per 2 pages), for hard links."""
        return self._upper_mb(h) << 20, min(MAX_UPPER_ENTRIES,
                                            max(10_000, h.spec.memory_mb * 256))

    def capture_rules(self, h: Handle[MicrovmState]) -> UpperRules:
        """As a full VM's disk: device nodes left out (the stream carries
        none; a compromised agent's would be refused before), files past the
        upper's size refused."""
        return UpperRules(devices=False, max_bytes=self.upper_bounds(h)[0])

    @contextlib.contextmanager
    def capture(self, h: Handle[MicrovmState]) -> Iterator[Path]:
        """The guest's upper (a tmpfs in its memory), streamed by its agent
        with every other process of the guest stopped (SIGSTOP from PID 1,
        SIGCONT after: the VM runs on, its processes with it) into a fresh
        host directory (runtime/guest/upper.py: what the stream is held to),
        removed after. A paused VM's upper is in its snapshot: resume it
        first."""
        if h.state.snapshot is not None:
            raise SandboxStateError(f"{h.id} is paused: resume it before verifying it (its "
                                    "upper is in its memory)")
        vm = self._vm(h)
        dest = self._capture_dir(h)
        remove_tree(dest)  # a capture cut short
        max_bytes, max_entries = self.upper_bounds(h)
        try:
            with UpperTree(dest, max_bytes=max_bytes, max_entries=max_entries) as tree:
                try:
                    vm.agent.upper(tree, lock_wait=PAUSE_WAIT)
                except UpperRefused as e:
                    raise SandboxError(f"{h.id}: its upper was refused: {e}") from None
                except SandboxStateError as e:
                    raise SandboxStateError(f"{h.id}: {e}") from None
                except AgentError as e:
                    raise self._unavailable(h, vm, e) from e
            yield dest
        finally:
            remove_tree(dest)
