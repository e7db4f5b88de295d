"""QEMU as the VMM of sandbox VMs: the accelerator choice, the command line of
a small q35 guest with virtio-pmem layers and/or virtio-blk disks (found in
the guest by their serial), and a minimal QMP client.

Why q35 and not `-M microvm`: with `-M microvm` (QEMU 7.2, Debian 12), the
virtio-pmem device's region is mapped at guest physical address 0, so the
guest's nd_pmem driver cannot reserve it and no /dev/pmem appears; on q35
the region sits above guest RAM and works. The configuration is trimmed to what a sandbox needs: -nodefaults (no
VGA, no NIC, no default serial/parallel/monitor), no network unless asked
(then one virtio-net NIC on a tap device that already exists in the network
namespace QEMU runs in: runtime/backends/netpolicy.py),
one virtio-serial port for the agent, a virtio-balloon used only for free
page reporting (when the backend's guests load its driver: memory the guest
frees is returned to the host, never inflated to take memory away), the 8250 console on a socket that the
host reads only while booting (later output is dropped by QEMU, so a guest
flooding its console costs CPU, never host disk; LAZYFS_VM_CONSOLE=keep keeps
reading it for diagnostics, runtime/backends/qemuproc.py), and QMP on a socket.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lazyfs.settings import setting

from ..errors import BackendUnavailable, SandboxError

log = logging.getLogger(__name__)

QEMU = "qemu-system-x86_64"
KVM_PROBE_TIMEOUT = 30.0
# swiotlb=noforce: no 64 MiB DMA bounce buffer (virtio without an IOMMU never
# bounces); measured: a 256 MiB guest's resident RAM after boot 192 -> 126 MiB.
KERNEL_ARGS = ("console=ttyS0", "panic=-1", "loglevel=4", "swiotlb=noforce")
# TCG's translation cache (MiB): QEMU's default is 1 GiB, filled as the guest
# runs new code; bounded so a VMM's host memory stays within its cgroup's limit
# (runtime/backends/qemubase.py VMM_OVERHEAD_MB)
TCG_TB_MB = 128
_accel_lock = threading.Lock()
_accel: str | None = None


def qemu_binary() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise BackendUnavailable(f"the microvm backend needs {QEMU} "
                                 "(apt-get install qemu-system-x86)")
    return path


def accelerator(qemu: str, vmlinuz: Path) -> str:
    """"kvm" when KVM can run an ordinary guest here, else "tcg". Decided
    once per process by booting the guest kernel under KVM up to its
    "no root" panic (~1 s where KVM works; here /dev/kvm exists but QEMU
    aborts setting MSRs). LAZYFS_MICROVM_ACCEL=kvm|tcg overrides."""
    global _accel
    forced = setting("vm_accel")  # (settings vm.accel)
    if forced in ("kvm", "tcg"):
        return str(forced)
    with _accel_lock:
        if _accel is None:
            _accel = "kvm" if _kvm_works(qemu, vmlinuz) else "tcg"
            log.info("microVMs run under %s", _accel)
        return _accel


def _kvm_works(qemu: str, vmlinuz: Path) -> bool:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    try:
        p = subprocess.run([qemu, "-accel", "kvm", "-M", "q35", "-cpu", "host", "-nodefaults",
                            "-no-user-config", "-display", "none", "-no-reboot", "-m", "128M",
                            "-kernel", str(vmlinuz), "-append", "console=ttyS0 panic=-1",
                            "-serial", "stdio"], stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=KVM_PROBE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and b"Linux version" in p.stdout


@dataclass(frozen=True)
class Drive:
    """A virtio-blk disk: the guest finds it by its serial (/sys/block/vd*/serial)."""

    path: Path
    serial: str
    format: str = "raw"        # or qcow2 (a sandbox's copy-on-write overlay)
    readonly: bool = True


@dataclass(frozen=True)
class Nic:
    """A virtio-net NIC on an existing tap device of QEMU's network namespace."""

    tap: str
    mac: str


@dataclass
class VmConfig:
    qemu: str
    accel: str
    vmlinuz: Path
    initrd: Path
    memory_mb: int
    cpus: int
    pmem: list[Path]                       # in device order: meta, blob, meta, blob, ...
    agent_socket: Path
    console_socket: Path
    qmp_socket: Path
    append: list[str] = field(default_factory=list)
    incoming: str | None = None            # restore from a migration stream
    drives: list[Drive] = field(default_factory=list)  # virtio-blk, after the pmem devices
    nic: Nic | None = None                 # no NIC at all without
    # virtio-balloon with free page reporting: pages the guest frees go back
    # to the host (QEMU discards them); the guest needs its driver loaded
    balloon: bool = False


def command(c: VmConfig) -> list[str]:
    sizes = [p.stat().st_size for p in c.pmem]
    maxmem = c.memory_mb + sum(sizes) // (1 << 20) + 2 * len(sizes) + 64
    if c.accel == "kvm":
        accel = ["-accel", "kvm", "-cpu", "host"]
    else:
        accel = ["-accel", f"tcg,thread=multi,tb-size={TCG_TB_MB}", "-cpu", "max"]
    memory = f"{c.memory_mb}M,slots={len(sizes)},maxmem={maxmem}M" if sizes else f"{c.memory_mb}M"
    cmd = [c.qemu, "-M", "q35", *accel, "-smp", str(c.cpus), "-m", memory,
           "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
           "-kernel", str(c.vmlinuz), "-initrd", str(c.initrd),
           "-append", " ".join([*KERNEL_ARGS, *c.append]),
           "-chardev", f"socket,id=con,path={c.console_socket},server=on,wait=off",
           "-serial", "chardev:con",
           "-chardev", f"socket,id=agent,path={c.agent_socket},server=on,wait=off",
           "-device", "virtio-serial-pci,id=vs",
           "-device", "virtserialport,chardev=agent,name=lazyfs.agent,bus=vs.0",
           "-qmp", f"unix:{c.qmp_socket},server=on,wait=off"]
    for i, (path, size) in enumerate(zip(c.pmem, sizes, strict=True)):
        # fixed PCI slots: the guest's /dev/pmemN follow the slot order
        backend = (f"memory-backend-file,id=pm{i},share=on,readonly=on,"
                   f"mem-path={path},size={size}")
        device = f"virtio-pmem-pci,memdev=pm{i},id=pmem{i},bus=pcie.0,addr={0x10 + i:#x}"
        cmd += ["-object", backend, "-device", device]
    for i, d in enumerate(c.drives):
        file = str(d.path).replace(",", ",,")  # QEMU's option syntax escapes commas
        mode = "readonly=on" if d.readonly else "readonly=off,discard=unmap"
        cmd += ["-drive", f"file={file},if=none,id=disk{i},format={d.format},{mode}",
                "-device", f"virtio-blk-pci,drive=disk{i},serial={d.serial}"]
    if c.balloon:  # auto-placed; never inflated: only free page reporting
        cmd += ["-device", "virtio-balloon-pci,id=balloon0,free-page-reporting=on"]
    if c.nic is not None:  # last: auto-placed, after the pmem devices' fixed slots
        cmd += ["-netdev", f"tap,id=net0,ifname={c.nic.tap},script=no,downscript=no",
                "-device", f"virtio-net-pci,netdev=net0,mac={c.nic.mac}"]
    if c.incoming is not None:
        cmd += ["-incoming", c.incoming]
    return cmd


class Qmp:
    """Just enough QMP: connect, negotiate, execute, wait for an event."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        self.buf = b""
        try:
            self.sock.connect(str(path))
            self._line()  # greeting
            self.execute("qmp_capabilities")
        except (OSError, ValueError) as e:
            self.sock.close()
            raise SandboxError(f"QMP at {path}: {e}") from e

    def _line(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise SandboxError("QMP connection closed")
            self.buf += data
            if len(self.buf) > (16 << 20):
                raise SandboxError("QMP reply too large")
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if not isinstance(msg, dict):
            raise SandboxError("QMP sent a non-object")
        return msg

    def execute(self, cmd: str, **args: Any) -> Any:
        self.sock.sendall(json.dumps({"execute": cmd, "arguments": args}).encode() + b"\n")
        while True:
            msg = self._line()
            if "return" in msg:
                return msg["return"]
            if "error" in msg:
                raise SandboxError(f"QMP {cmd}: {msg['error'].get('desc', msg['error'])}")

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._line()
            if msg.get("event") == name:
                return msg
        raise SandboxError(f"no QMP event {name} within {timeout:g}s")

    def close(self) -> None:
        self.sock.close()
