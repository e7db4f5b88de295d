"""Full-VM sandboxes: QEMU q35 guests with a writable root file system of
ordinary semantics and, when the image has one, the image's own init as
PID 1, for workloads that need an OS of their own (its init and services).

Per sandbox, under its directory (the rest as in qemubase.py):
    vm/upper.ext4     the sandbox's writes: an empty, sparse ext4 of disk_mb
                      (runtime/guest/disk.py), removed by kill

The root is built from the same chunks as a microVM's, lazily: the image's
layers are virtio-pmem devices (runtime/guest/pmemimages.py: a metadata
image per layer, and the node daemon's blob mapped shared, so a guest page
fault fetches just the chunk behind it through the node cache), mounted
EROFS -o dax in the guest under an overlayfs whose upper is the sandbox's
ext4 disk (virtio-blk). Nothing of the image is copied or read before the
first boot; every VM of the image reads one host page-cache copy of what
was fetched. The "vm" initramfs (runtime/guest/initramfs.py) composes that
root and either hands PID 1 to the image's init (switch_root; the agent
runs chrooted next to it) or runs the guest agent as PID 1.

The agent, its protocol, exec, files, kill and pause (snapshot to disk and
exit the VMM; the upper stays where it is) are the shared VM backend's
(runtime/backends/qemubase.py), as for microvm, its sibling: this class only
says which devices, initramfs and kernel parameters a guest gets. The
layers are those of the digest the node resolved when the sandbox was
created.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from pydantic import Field

from composer.snapshot import UpperRules
from lazyfs.settings import setting

from ..config import RuntimeConfig
from ..errors import BackendUnavailable, SandboxError, SandboxStateError
from ..guest import disk, initramfs, qemu
from ..guest.protocol import AgentError
from ..images import Images
from ..spec import VERIFIER_LABEL, SandboxSpec
from .base import Capabilities, Handle
from .qemubase import PATH_ENV, PAUSE_WAIT, QemuBackend, QemuState

SYNC_TIMEOUT = 60.0  # the guest's `sync` before its disk is captured
# what flushes the guest's page cache onto its disk, run from the image (the
# agent has no call for it): coreutils' or busybox's
SYNC_COMMANDS = (("sync",), ("busybox", "sync"))


class VmState(QemuState):
    disk: Path | None = None       # this sandbox's writable upper (ext4)
    disk_mb: int | None = None     # its size
    init: str | None = None        # the image's own init, if it has one
    # the pmem layers' digests, bottom first, then the fixups
    layers: list[str] = Field(default_factory=list)


class VmBackend(QemuBackend[VmState]):
    name = "vm"
    state_type = VmState
    boot_timeout_env = "LAZYFS_VM_BOOT_TIMEOUT"
    boot_timeout_default = 120.0
    capabilities = Capabilities("vm", frozenset(
        {"exec", "stream", "files", "pause", "resume", "network_allowlist", "events",
         "verify", "hidden"}),
        "QEMU q35 guests (KVM where it works, else TCG) booting Debian's cloud kernel; the "
        "root is the image's layers as lazy virtio-pmem EROFS lowers (as microvm's: nothing "
        "copied, guest page faults fetch chunks) under an overlayfs whose upper is a "
        "per-sandbox ext4 disk of disk_mb; the image's own init runs as PID 1 when it has "
        "one; the same guest agent as microvm; pause = snapshot to disk and exit the "
        "VMM. Network allowlists as microvm's (none by default: no NIC); VMs end with the node process (not persistent).")

    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        super().__init__(config, images)
        self.pmem_cache = config.pmem_cache or setting("pmem_cache")

    def _refused(self, spec: SandboxSpec) -> str | None:
        if spec.disk_mb is not None and spec.disk_mb < disk.MIN_UPPER_MB:
            return (f"disk_mb: {spec.disk_mb} MiB is below the vm backend's minimum of "
                    f"{disk.MIN_UPPER_MB} MiB (the root's writable ext4 disk)")
        return super()._refused(spec)

    def _tools_missing(self) -> str | None:
        return disk.tools_missing() or super()._tools_missing()

    def _prepare(self, h: Handle[VmState], vmdir: Path) -> None:
        # a verifier runs no init of its image: its layers include what the
        # agent wrote (an /sbin/init of its own would run before the grader)
        h.state.init = None if VERIFIER_LABEL in h.spec.labels else \
            disk.image_init(self.images, h.image)
        size = h.spec.disk_mb or self.config.disk_mb
        upper = vmdir / "upper.ext4"
        disk.make_upper(upper, size)
        h.state.disk, h.state.disk_mb = upper, size

    def _config(self, h: Handle[VmState], vmdir: Path, incoming: str | None = None
                ) -> qemu.VmConfig:
        kernel = self._kernel()
        upper = h.state.disk or vmdir / "upper.ext4"
        if not upper.is_file():
            raise BackendUnavailable(f"{h.id}: its writable disk {upper} is gone")
        layers = self._pmem_layers(h, self.pmem_cache)
        h.state.layers = [x.digest for x in layers]
        init = h.state.init
        return self._vm_config(
            h, vmdir, incoming, kernel=kernel,
            initrd=initramfs.initramfs(kernel, self.config.bin_dir, "vm"),
            pmem=[p for layer in layers for p in layer.files],
            drives=[qemu.Drive(upper, disk.UPPER_LABEL, "raw", readonly=False)],
            append=[f"lazyfs.layers={len(layers)}",
                    *([f"lazyfs.init={init}"] if init else self._limits(h))])

    def kill(self, h: Handle[VmState]) -> None:
        super().kill(h)
        disk.release(self._capture_dir(h))  # a capture a dead node left mounted

    # -- capture (verify) ------------------------------------------------------
    @staticmethod
    def _capture_dir(h: Handle[VmState]) -> Path:
        return h.dir / "capture"

    def capture_rules(self, h: Handle[VmState]) -> UpperRules:
        """The guest's root makes real device nodes (left out) and sparse
        files of any size (refused past the disk's size)."""
        return UpperRules(devices=False, max_bytes=(h.state.disk_mb or self.config.disk_mb) << 20)

    @contextlib.contextmanager
    def capture(self, h: Handle[VmState]) -> Iterator[Path]:
        """The upper on the VM's disk, with the VM stopped: the guest
        flushes its page cache (`sync` through the agent), QMP stops its
        vCPUs, the disk is checked and mounted read-only on the host
        (disk.reading); the VM goes on after. A paused VM's disk misses
        what its memory had not written back: resume it first."""
        if h.state.snapshot is not None:
            raise SandboxStateError(f"{h.id} is paused: resume it before capturing its disk "
                                    "(what it wrote may still be in its memory)")
        vm = self._vm(h)
        for argv in SYNC_COMMANDS:
            try:
                st, _, err = vm.agent.exec(argv, env={"PATH": PATH_ENV}, cwd="/", stdin=b"",
                                           timeout=SYNC_TIMEOUT, max_output=4096,
                                           on_stdout=None, on_stderr=None,
                                           grace=self.agent_grace)
            except AgentError as e:
                raise self._unavailable(h, vm, e) from e
            if st.code != 127:
                break
        if st.code != 0:
            raise SandboxError(f"{h.id}: the guest's {' '.join(argv)} exited {st.code} "
                               f"({bytes(err).decode(errors='replace').strip()[-200:]}): what "
                               "it wrote may not be on its disk (capturing a VM's disk needs "
                               "sync or busybox in its image)")
        upper = h.state.disk or self._vmdir(h) / "upper.ext4"
        if not vm.agent.lock.acquire(timeout=PAUSE_WAIT):
            raise SandboxStateError(f"{h.id} is running a command or a file call; "
                                    "capture it once that ends")
        try:
            q = qemu.Qmp(vm.config.qmp_socket)
            try:
                q.execute("stop")
                try:
                    with disk.reading(upper, self._capture_dir(h)) as root:
                        yield root
                finally:
                    q.execute("cont")
            finally:
                q.close()
        finally:
            vm.agent.lock.release()
