"""What the two VM backends share: a QEMU guest per sandbox, reached through
the guest agent (runtime/guest/protocol.py) over virtio-serial.

Per sandbox, under its directory:
    vm/agent.sock     the guest agent's virtio-serial port (QEMU's chardev socket)
    vm/qmp.sock       QMP, for pause (snapshot-and-exit) and for the tests
    vm/console.sock   the serial console, read only while booting
    vm/console.log    what the console said while booting (at most 64 KiB)
    vm/qemu.log       QEMU's own stderr
    vm/state/snapshot.bin  while paused: the VM's memory and device state

QemuBackend owns the life of a sandbox VM: create (the subclass prepares
the host side and names the devices, kernel parameters and initramfs; this
class boots it and waits for the agent's READY), exec and files through the
agent, pause and resume (runtime/backends/snapshots.py), kill and status.
The QEMU processes themselves are runtime/backends/qemuproc.py's. The
microvm and vm backends are siblings over it, differing only in how the
image reaches the guest.

Network: a sandbox created with an allowlist gets its own network namespace
(runtime/backends/netpolicy.py: veth to the host, a tap, the rules, NAT),
its VMM runs in it with one virtio-net NIC on the tap, and the guest's
initramfs gives eth0 the fixed guest address (lazyfs.net); without one the
VM has no NIC at all (only lo). set_network changes the rules of a VM that
has a network (none keeps the NIC and refuses everything); a VM created
without one cannot get one later (its VMM would need to move namespaces):
Unsupported.

Every call after boot goes through the agent with a deadline; an agent
that stops answering or a VMM that exits makes the call raise
BackendUnavailable and the sandbox unusable until killed. Calls into one VM
are serialized (one agent connection). VMs die with the node process
(qemuproc.py says why), so they are not "persistent" across node restarts.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from ..api import Sink
from ..config import RuntimeConfig
from ..errors import (
    BackendUnavailable,
    InvalidSpec,
    SandboxError,
    SandboxStateError,
    Unsupported,
)
from ..files import SandboxFiles
from ..guest import qemu
from ..guest.initramfs import tools_missing
from ..guest.kernel import GuestKernel, default_cache, guest_kernel
from ..guest.pmemimages import PmemLayer, pmem_layers
from ..guest.protocol import EXEC_GRACE, AgentClosed, AgentError, GuestCounts
from ..images import Images
from ..isolation import cgroups
from ..isolation.denials import DenialLog, merged
from ..native import qemu_preload, sandbox_init
from ..spec import (
    VM_STATE_FILE,
    EventKind,
    ExecRequest,
    ExecResult,
    NetworkPolicy,
    Qos,
    ResolvedImage,
    SandboxEvent,
    SandboxSpec,
    VmState,
)
from . import netpolicy, qemuproc, snapshots
from .base import BackendState, Handle, Signaller
from .guestfiles import GuestFiles
from .qemuproc import Vm

log = logging.getLogger(__name__)

PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PAUSE_WAIT = 2.0  # how long pause waits for a call in the guest to end
EXIT_WAIT = 2.0  # how long a call whose agent connection closed waits for the VMM's end
GUEST_RESERVE_MB = 64  # guest RAM kept from the commands' cgroup: kernel, agent, init
# Host memory a VMM may use beyond its guest's RAM: QEMU itself (~70 MiB), the
# TCG translation cache (bounded by qemu.TCG_TB_MB; none under KVM), device
# and I/O buffers. Measured: an idle 256 MiB TCG guest's VMM 248 MiB PSS of
# which ~126 MiB guest RAM.
VMM_OVERHEAD_MB = 256
COUNTS_WAIT = 0.1  # events(): how long to wait for a call holding the agent
COUNTS_TIMEOUT = 2.0  # ... and for the agent's COUNTS answer (then the last counts)
VMM_PIDS = 256  # host tasks of one QEMU (vCPU, I/O and RCU threads); the guest's own
# processes are limited inside the guest (spec.pids, see _limits)


def vmm_limits(spec: SandboxSpec) -> cgroups.GroupLimits:
    """The host cgroup limits of a sandbox's VMM: the spec's cpu as CFS
    quota and shares, guest RAM + VMM_OVERHEAD_MB of memory, VMM_PIDS tasks."""
    return cgroups.GroupLimits(cgroups.cpu_limits(spec.cpu),
                               (spec.memory_mb + VMM_OVERHEAD_MB) << 20, VMM_PIDS)


class QemuState(BackendState):
    """A VM sandbox's pieces on the host, for kill, status and resume."""

    vm_dir: Path | None = None
    accel: Literal["kvm", "tcg"] | None = None  # chosen at the first boot, kept for resume
    balloon: bool = False             # the VMM has the reporting balloon (kept for resume)
    pid: int | None = None            # the VMM, while one runs
    snapshot: Path | None = None      # while paused
    boot_s: float | None = None       # how long the first boot took
    cgroup: bool = False              # the VMM's host cgroups (lazyfs/<id>) exist
    net_slot: int | None = None       # the VMM's network namespace (an allowlist only)
    node_address: str | None = None

    def host_address(self) -> str | None:
        return self.node_address


Q = TypeVar("Q", bound=QemuState)


class QemuBackend(Generic[Q]):
    """The shared part of the microvm and vm backends (see the module
    docstring); subclasses set name, capabilities, state_type and implement
    _prepare and _config."""

    name: str
    state_type: type[Q]
    boot_timeout_env = "LAZYFS_MICROVM_BOOT_TIMEOUT"
    boot_timeout_default = 90.0
    # a virtio-balloon with free page reporting in new VMs: only for guests
    # whose initramfs loads virtio_balloon (the device without its driver
    # returns nothing)
    balloon = False

    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        self.config = config
        self.images = images
        self.boot_timeout = float(os.environ.get(self.boot_timeout_env,
                                                 str(self.boot_timeout_default)))
        self.kernel_cache = default_cache()
        self.agent_grace = EXEC_GRACE  # past an exec's timeout, before the agent counts as hung
        self.extra_append: list[str] = []  # kernel parameters added to every boot (tests)
        self._vms: dict[str, Vm] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # every VMM we started, until killed
        self._lock = threading.Lock()
        self.denials = DenialLog()
        self._guest_counts: dict[str, GuestCounts] = {}  # the highest the agent reported
        # a sandbox made from another's VM state: that guest's counters when it
        # started (its parent's refusals, not its own)
        self._guest_base: dict[str, GuestCounts] = {}

    # -- what a subclass says ------------------------------------------------
    def _tools_missing(self) -> str | None:
        """A host tool this backend needs and does not find, as an install hint."""
        return tools_missing()

    def _prepare(self, h: Handle[Q], vmdir: Path) -> None:
        """What a new sandbox needs on the host before its first boot."""
        raise NotImplementedError

    def _config(self, h: Handle[Q], vmdir: Path, incoming: str | None = None
                ) -> qemu.VmConfig:
        """The VMM of this sandbox: for its first boot, or (incoming) to
        restore it from a snapshot, with the same devices."""
        raise NotImplementedError

    def _vm_config(self, h: Handle[Q], vmdir: Path, incoming: str | None, *,
                   kernel: GuestKernel, initrd: Path, pmem: list[Path],
                   drives: list[qemu.Drive], append: list[str]) -> qemu.VmConfig:
        """A VmConfig with what every sandbox VM has: the accelerator (kept
        from the first boot on resume), memory, vCPUs and the sockets."""
        binary = qemu.qemu_binary()
        accel = (h.state.accel or "tcg") if incoming is not None else \
            qemu.accelerator(binary, kernel.vmlinuz)
        # resume: the devices the VM was booted with
        balloon = h.state.balloon if incoming is not None else self.balloon
        nic, slot = None, h.state.net_slot
        if slot is not None:
            nic = qemu.Nic(netpolicy.GUEST_IF, netpolicy.guest_mac(slot))
            append = [*append, f"lazyfs.net={netpolicy.GUEST_LINK}"]
        return qemu.VmConfig(
            qemu=binary, accel=accel, vmlinuz=kernel.vmlinuz, initrd=initrd,
            memory_mb=h.spec.memory_mb,  # >= spec.MIN_GUEST_MB, checked at validation
            cpus=self._cpus(h.spec),
            pmem=pmem, drives=drives, agent_socket=vmdir / "agent.sock",
            console_socket=vmdir / "console.sock", qmp_socket=vmdir / "qmp.sock",
            append=[*append, f"lazyfs.hostname={h.id}", *self.extra_append],
            incoming=incoming, nic=nic, balloon=balloon)

    def _pmem_layers(self, h: Handle[Q], cache: Path) -> list[PmemLayer]:
        """The image's layers as pmem files (pmemimages.py; metadata built
        where missing, told to the sandbox's progress), those of the VM the
        image's state is of for a state image."""
        image = h.image
        if image.vm_state is not None:  # the devices of the VM the state is of
            image = ResolvedImage(name=image.name, digest=image.vm_state.base,
                                  layers=image.layers)
        return pmem_layers(self.images, image, cache, h.progress)

    @staticmethod
    def _limits(h: Handle[Q]) -> list[str]:
        """The guest's cgroup for commands (set up by the initramfs, used by
        the agent): the sandbox's pids limit, and memory below the guest's
        RAM by GUEST_RESERVE_MB so its kernel and the agent always have room."""
        return [f"lazyfs.pids={h.spec.pids}",
                f"lazyfs.mem_mb={max(64, h.spec.memory_mb - GUEST_RESERVE_MB)}"]

    def _refused(self, spec: SandboxSpec) -> str | None:
        """A field of the spec this backend cannot honour, as the message of
        the Unsupported raised before anything starts (None: all honoured)."""
        if spec.open_files != SandboxSpec.model_fields["open_files"].default:
            return (f"open_files: the {self.name} backend cannot limit a guest's open files "
                    "yet; leave open_files unset")
        return None

    def _kernel(self) -> GuestKernel:
        return guest_kernel(self.kernel_cache)

    # -- helpers -------------------------------------------------------------
    def _check(self) -> Path:
        qemu.qemu_binary()
        missing = self._tools_missing()
        if missing is not None:
            raise BackendUnavailable(f"the {self.name} backend needs {missing}")
        return sandbox_init(self.config.bin_dir)

    def _vm(self, h: Handle[Q]) -> Vm:
        with self._lock:
            vm = self._vms.get(h.id)
        if vm is None:
            raise SandboxStateError(f"{h.id} has no running VM (paused or stopped)")
        if not vm.alive():
            raise BackendUnavailable(f"{h.id}: the VM exited ({qemuproc.exit_text(vm.proc)}); "
                                     "kill the sandbox")
        return vm

    def _unavailable(self, h: Handle[Q], vm: Vm, e: Exception) -> BackendUnavailable:
        if isinstance(e, AgentClosed) and vm.alive():
            # the VMM closed the channel as it exits: wait for how it ended
            # (SIGBUS names a fetch that failed under a guest page)
            try:
                vm.proc.wait(timeout=EXIT_WAIT)
            except subprocess.TimeoutExpired:
                pass
        if not vm.alive():
            return BackendUnavailable(f"{h.id}: the VM exited ({qemuproc.exit_text(vm.proc)}): "
                                      f"{e}")
        return BackendUnavailable(f"{h.id}: {e}; the VM is unusable, kill the sandbox")

    def _vmdir(self, h: Handle[Q]) -> Path:
        return h.state.vm_dir or h.dir / "vm"

    def _start(self, h: Handle[Q], cfg: qemu.VmConfig, init: Path) -> subprocess.Popen[bytes]:
        slot = h.state.net_slot
        proc = qemuproc.start(cfg, init, cgroups.procs_files(h.id) if h.state.cgroup else [],
                              idle=h.spec.qos is Qos.best_effort,
                              preload=qemu_preload(self.config.bin_dir),
                              netns=None if slot is None else
                              netpolicy.NETNS_DIR / netpolicy.names(slot)[0])
        h.state.pid = proc.pid
        with self._lock:
            self._procs[h.id] = proc
        return proc

    # -- lifecycle -----------------------------------------------------------
    def create(self, h: Handle[Q]) -> None:
        refused = self._refused(h.spec)
        if refused is not None:
            raise Unsupported(refused)
        init = self._check()
        vmdir = h.dir / "vm"
        vmdir.mkdir(mode=0o700)
        agent_sock = vmdir / "agent.sock"
        try:
            if len(os.fsencode(agent_sock)) > 100:
                raise BackendUnavailable(f"socket path {agent_sock} is too long for a Unix "
                                         "socket; use a shorter runtime state directory")
            h.state.vm_dir = vmdir
            self._make_cgroup(h)
            if h.spec.network.mode == "allowlist":
                slot = h.state.net_slot = netpolicy.allocate(h.id)
                h.state.node_address = netpolicy.addresses(slot)[0]
                netpolicy.create_for_vm(slot, h.spec.network)
            self._prepare(h, vmdir)
            if h.image.vm_state is not None:  # a snapshot: load its state, no boot
                self._check_shape(h, h.image.vm_state)
                h.state.accel = h.image.vm_state.accel
                h.state.balloon = h.image.vm_state.balloon
                state = self.images.ensure_daemon().layers / h.image.vm_state.layer / \
                    VM_STATE_FILE
                self._load(h, init, state)
                if h.image.vm_state.sandbox_id != h.id:  # not itself come back (preempted)
                    self._count_from_here(h)
            else:
                cfg = self._config(h, vmdir)
                h.state.accel = "kvm" if cfg.accel == "kvm" else "tcg"
                h.state.balloon = cfg.balloon
                self._boot(h, cfg, init)
        except BaseException:
            self.kill(h)
            raise

    def _make_cgroup(self, h: Handle[Q]) -> None:
        """The VMM's own cgroups on the host, as a container's: cpu quota and
        shares from spec.cpu, memory = guest RAM + VMM_OVERHEAD_MB, pids; an
        idle cpu group for qos="best_effort" (with SCHED_IDLE on QEMU)."""
        try:
            cgroups.create_group(h.id, vmm_limits(h.spec))
        except OSError as e:
            raise BackendUnavailable(f"{h.id}: cannot make the VMM's cgroups "
                                     f"({cgroups.path('cpu', h.id)}): {e}") from e
        h.state.cgroup = True
        if h.spec.qos is Qos.best_effort and not cgroups.set_cpu_idle(h.id):
            log.warning("this kernel has no cpu.idle: best-effort VMs run SCHED_IDLE "
                        "inside their own cpu group only")

    def _boot(self, h: Handle[Q], cfg: qemu.VmConfig, init: Path) -> None:
        h.step(f"booting the guest ({cfg.accel}, {cfg.memory_mb} MiB)")
        t0 = time.monotonic()
        deadline = t0 + self.boot_timeout
        proc = self._start(h, cfg, init)
        qemuproc.wait_sockets(proc, cfg, deadline)
        agent = qemuproc.wait_ready(h.id, proc, cfg, deadline, self.boot_timeout)
        h.state.boot_s = time.monotonic() - t0
        h.step(f"guest agent ready after {h.state.boot_s:.1f}s")
        with self._lock:
            self._vms[h.id] = Vm(proc, agent, cfg)
        log.info("%s booted in %.2fs (%s, %s)", h.id, h.state.boot_s, cfg.accel, agent.version)

    def kill(self, h: Handle[Q]) -> None:
        """Stop the VMM and remove its sockets, logs and snapshot; safe on
        half-created sandboxes and twice."""
        with self._lock:
            vm = self._vms.pop(h.id, None)
            proc = self._procs.pop(h.id, None)
        if vm is not None:
            vm.agent.close()
        vmdir = self._vmdir(h)
        if proc is not None:  # ours: kill and reap it
            qemuproc.stop(h.id, proc)
        elif h.state.pid is not None:  # a previous node's, if it still is that VMM
            qemuproc.stop_foreign(h.state.pid, vmdir)
        snapshots.remove(h.id, h.state.snapshot)
        if h.state.cgroup or cgroups.exists(h.id):
            cgroups.remove_empty(h.id)
        netpolicy.remove_all(h.id, h.state.net_slot)
        self.denials.forget(h.id)
        with self._lock:
            self._guest_counts.pop(h.id, None)
            self._guest_base.pop(h.id, None)
        shutil.rmtree(vmdir, ignore_errors=True)

    def status(self, h: Handle[Q]) -> str:
        if h.state.snapshot is not None and h.state.snapshot.exists():
            return "paused"
        pid = h.state.pid
        return "running" if pid is not None and qemuproc.is_vmm(pid, self._vmdir(h)) \
            else "stopped"

    def close(self) -> None:
        pass

    # -- network -------------------------------------------------------------
    def set_network(self, h: Handle[Q], policy: NetworkPolicy) -> None:
        """New rules for a VM created with a network, in one nftables
        transaction (connections they refuse are cut; the old rules'
        refused-destination counts are kept as events)."""
        slot = h.state.net_slot
        if slot is None:
            if policy.mode == "none":
                return
            raise Unsupported(f"network: {h.id} was created without a network and a "
                              f"{self.name} sandbox cannot get one later; create it with "
                              "an allowlist (it can be narrowed to none later)")
        for dest, n in netpolicy.refused(slot).items():
            if n:
                self.denials.record(h.id, "connect", dest, n)
        netpolicy.apply(slot, policy, netpolicy.GUEST_IF)

    def _count_from_here(self, h: Handle[Q]) -> None:
        """A sandbox started from another's VM state: its guest's counters
        hold that VM's refusals; its events count from what they say now."""
        with self._lock:
            vm = self._vms.get(h.id)
        try:
            base = vm.agent.counts(wait=5.0) if vm is not None else None
        except AgentError as e:
            log.info("%s: no guest counters at start: %s", h.id, e)
            base = None
        if base is not None:
            with self._lock:
                self._guest_base[h.id] = base
                self._guest_counts[h.id] = base

    def _note_counts(self, h: Handle[Q], counts: GuestCounts | None) -> GuestCounts | None:
        """Keep the agent's counters, each never lowered: a count the guest
        once reported stays counted, whatever it reports later."""
        with self._lock:
            old = self._guest_counts.get(h.id)
            if counts is None:
                return old
            if old is not None:
                counts = GuestCounts(max(old.oom_kills, counts.oom_kills),
                                     max(old.fork_refusals, counts.fork_refusals))
            self._guest_counts[h.id] = counts
            return counts

    def events(self, h: Handle[Q]) -> list[SandboxEvent]:
        """The guest's refused connections (counted by the rules in its
        VMM's namespace), and what the guest kernel refused its commands
        (OOM kills, forks at the pids limit: the commands' cgroup's counters
        as the guest agent reports them, asked now; while a call holds the
        agent's channel, the highest it reported before). Asking never
        makes a sandbox unusable: an agent that does not answer is logged
        here and met by the next call."""
        slot = h.state.net_slot
        counted: dict[tuple[EventKind, str], int] = {} if slot is None else {
            ("connect", dest): n for dest, n in netpolicy.refused(slot).items()}
        fresh = None
        with self._lock:
            vm = self._vms.get(h.id)
        if vm is not None and vm.alive():
            try:
                # bounded for the node's kill and metrics scrape too: a busy
                # agent is not waited for, a hung one costs COUNTS_TIMEOUT once
                fresh = vm.agent.counts(wait=COUNTS_WAIT, timeout=COUNTS_TIMEOUT)
            except AgentError as e:
                log.info("%s: no guest counters: %s", h.id, e)
        counts = self._note_counts(h, fresh)
        if counts is not None:
            with self._lock:
                base = self._guest_base.get(h.id, GuestCounts(0, 0))
            counted[("oom_kill", "memory limit")] = counts.oom_kills - base.oom_kills
            counted[("process_limit", f"pids={h.spec.pids}")] = \
                counts.fork_refusals - base.fork_refusals
        return merged(self.denials.events(h.id), counted)

    # -- pause: snapshot and exit --------------------------------------------
    def pause(self, h: Handle[Q]) -> dict[str, Any]:
        """Refused while a call runs in the guest: a snapshot taken mid-call
        would resume with the agent answering a call the new connection
        never made."""
        agent = self._vm(h).agent
        if not agent.lock.acquire(timeout=PAUSE_WAIT):
            raise SandboxStateError(f"{h.id} is running a command or a file call; "
                                    "pause it once that ends")
        try:
            snap = snapshots.snapshot_path(self.config.state_dir, h.id, self._vmdir(h),
                                           h.image.digest)
            figures = snapshots.save(h.id, self._vm(h), snap)
        finally:
            agent.lock.release()
        with self._lock:
            self._vms.pop(h.id, None)
            self._procs.pop(h.id, None)
        h.state.snapshot = snap
        h.state.pid = None
        return figures

    def resume(self, h: Handle[Q]) -> None:
        snap = h.state.snapshot
        if snap is None or not snap.is_file():
            raise SandboxStateError(f"{h.id} has no snapshot to resume from")
        self._load(h, self._check(), snap)
        snap.unlink(missing_ok=True)
        h.state.snapshot = None

    def _load(self, h: Handle[Q], init: Path, snap: Path) -> None:
        """A VMM of this sandbox's devices running the state in `snap`."""
        cfg = self._config(h, self._vmdir(h), incoming="defer")
        deadline = time.monotonic() + self.boot_timeout
        proc = self._start(h, cfg, init)
        try:
            qemuproc.wait_sockets(proc, cfg, deadline)
            try:
                agent = snapshots.restore(h.id, proc, cfg, snap, deadline)
            except SandboxError as e:
                if proc.poll() is None:
                    raise
                raise BackendUnavailable(
                    f"loading {h.id} from {snap}: QEMU exited ({qemuproc.exit_text(proc)}): "
                    f"{qemuproc.tail(cfg.agent_socket.parent / 'qemu.log')}") from e
        except BaseException:
            proc.kill()
            proc.wait()
            with self._lock:
                self._procs.pop(h.id, None)
            h.state.pid = None
            raise
        with self._lock:
            self._vms[h.id] = Vm(proc, agent, cfg)

    # -- the VM's state in the store (snapshot, preemption) ---------------------
    def _cpus(self, spec: SandboxSpec) -> int:
        return max(1, min(math.ceil(spec.cpu), os.cpu_count() or 1))

    def _check_shape(self, h: Handle[Q], state: VmState) -> None:
        """InvalidSpec unless this sandbox is a machine QEMU can load
        `state` into: the same backend, guest memory and vCPUs."""
        want = {"backend": (state.backend, self.name),
                "memory_mb": (state.memory_mb, h.spec.memory_mb),
                "vCPUs": (state.cpus, self._cpus(h.spec))}
        wrong = [f"{k} {have} (the snapshot's is {need})"
                 for k, (need, have) in want.items() if need != have]
        if wrong:
            raise InvalidSpec(f"{h.image.name} is the memory of a {state.backend} VM of "
                              f"{state.memory_mb} MB and {state.cpus} vCPUs: this sandbox "
                              f"has {', '.join(wrong)}")

    def save_state(self, h: Handle[Q]) -> tuple[Path, dict[str, Any]]:
        """The VM's memory and device state as a file alone in its directory:
        a running VM is paused for it (its VMM exits; the caller resumes it
        or kills it), a paused one's snapshot is taken as it is. (file,
        the pause's figures: empty when it was paused already)."""
        snap = h.state.snapshot
        if snap is not None and snap.is_file():
            return snap, {}
        figures = self.pause(h)
        assert h.state.snapshot is not None
        return h.state.snapshot, figures

    def state_record(self, h: Handle[Q], layer: str) -> VmState:
        """What an image of this VM's state (packed as `layer`) must say."""
        base = h.image.vm_state.base if h.image.vm_state is not None else h.image.digest
        return VmState(layer=layer, base=base, backend=self.name,
                       memory_mb=h.spec.memory_mb, cpus=self._cpus(h.spec),
                       accel=h.state.accel or "tcg", sandbox_id=h.id,
                       balloon=h.state.balloon)

    # -- exec and files --------------------------------------------------------
    def exec(self, h: Handle[Q], req: ExecRequest, on_stdout: Sink | None,
             on_stderr: Sink | None, *,
             on_started: Callable[[Signaller], None] | None = None) -> ExecResult:
        # (the guest agent cannot signal a command yet: on_started is never called)
        vm = self._vm(h)
        env = {"PATH": PATH_ENV, "HOME": "/root", "TERM": "xterm", **h.spec.env, **req.env}
        t0 = time.monotonic()
        try:
            st, out, err = vm.agent.exec(req.cmd, env=env, cwd=req.cwd or h.spec.workdir,
                                         stdin=req.stdin, timeout=req.timeout,
                                         max_output=req.max_output_bytes, on_stdout=on_stdout,
                                         on_stderr=on_stderr, grace=self.agent_grace)
        except AgentError as e:
            raise self._unavailable(h, vm, e) from e
        if st.code == 127 and b"lazyfs-agent: cannot run" in err:
            # as the container backend words it
            err = bytearray(bytes(err).replace(b"lazyfs-agent: cannot run ", b""))
        return ExecResult(exit_code=-1 if st.unreaped else st.code, stdout=bytes(out),
                          stderr=bytes(err), duration=time.monotonic() - t0,
                          truncated=st.truncated, timed_out=st.timed_out,
                          oom_killed=st.oom_killed, status_unknown=st.unreaped)

    def files(self, h: Handle[Q]) -> SandboxFiles:
        return GuestFiles(h.dir, lambda: self._vm(h),
                          lambda vm, e: self._unavailable(h, vm, e))
