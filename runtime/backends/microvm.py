"""microVM sandboxes: QEMU guests whose image layers are virtio-pmem devices
mounted with DAX, so every VM on the node reads the same host page cache.

Per sandbox, under its directory:
    vm/agent.sock     the guest agent's virtio-serial port (QEMU's chardev socket)
    vm/qmp.sock       QMP, for pause (snapshot-and-exit) and for the tests
    vm/console.sock   the serial console, read only while booting
    vm/console.log    what the console said while booting (at most 64 KiB)
    vm/qemu.log       QEMU's own stderr
    vm/snapshot.bin   while paused: the VM's memory and device state

Boot: the guest kernel (runtime/guest/kernel.py) with the project's
initramfs (runtime/guest/initramfs.py) mounts the layers from their pmem
devices (runtime/guest/pmemimages.py says how the files are made and why
they are local copies) as EROFS with `-o dax`, overlays a tmpfs upper in
guest memory, and execs the guest agent as PID 1. `create` returns when the
agent says READY; a guest that panics, fails its init or stays silent past
`boot_timeout` is BackendUnavailable naming the console's last lines.

Every call after that goes through the agent (runtime/guest/protocol.py)
with a deadline; an agent that stops answering or a VMM that exits makes
the call raise BackendUnavailable and the sandbox unusable until killed.
Calls into one VM are serialized (one agent connection).

QEMU runs under `sandbox-init pdeathsig`, started from one long-lived thread
of this process: PR_SET_PDEATHSIG fires when the *thread* that forked the VMM
exits, and the node calls backends from short-lived worker threads. So the
VMs die with the node process, and are not "persistent" across node restarts.

Pause is snapshot-and-exit: QMP `stop`, `migrate` to a local file with the
pmem regions left out (x-ignore-shared: they are the shared image files),
then the VMM exits and its memory is freed. Resume starts a new VMM with
`-incoming` from that file and the same image files, reconnects the agent.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import queue
import select
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazyfs import sysmount

from ..config import RuntimeConfig
from ..errors import BackendUnavailable, FileError, SandboxError, SandboxStateError
from ..files import MAX_READ, FileInfo, SandboxFiles, _clean, _printable
from ..guest import qemu
from ..guest.initramfs import initramfs, tools_missing
from ..guest.kernel import DEFAULT_CACHE, guest_kernel
from ..guest.pmemimages import pmem_layers
from ..guest.protocol import EXEC_GRACE, READY, AgentConnection, AgentError, entry_kind
from ..images import Images
from ..native import sandbox_init
from ..spec import ExecRequest, ExecResult
from .base import Capabilities, Handle, Sink

log = logging.getLogger(__name__)

PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CONSOLE_KEEP = 64 << 10
KILL_WAIT = 10.0
# Guest RAM floor: the cloud kernel with pmem devices ran out of memory while
# booting in 128 MiB. QEMU allocates guest RAM as the guest touches it, so a
# larger -m costs host memory only when used.
MIN_GUEST_MB = 256
MIGRATE_TIMEOUT = 120.0
PAUSE_WAIT = 2.0  # how long pause waits for a call in the guest to end
PMEM_CACHE = Path(os.environ.get("LAZYFS_PMEM_CACHE", "/var/cache/lazyfs/pmem"))
SNAPSHOT_DIR = Path(os.environ.get("LAZYFS_MICROVM_SNAPSHOTS", "/var/lib/lazyfs/vm-snapshots"))


class _Spawner:
    """Forks VMMs from one thread that lives as long as the process."""

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[list[str], dict[str, Any],
                                   concurrent.futures.Future[subprocess.Popen[bytes]]]] = \
            queue.Queue()
        threading.Thread(target=self._run, name="microvm-spawner", daemon=True).start()

    def _run(self) -> None:
        while True:
            cmd, kw, fut = self._q.get()
            try:
                fut.set_result(subprocess.Popen(cmd, **kw))
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                fut.set_exception(e)

    def popen(self, cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        fut: concurrent.futures.Future[subprocess.Popen[bytes]] = concurrent.futures.Future()
        self._q.put((cmd, kw, fut))
        return fut.result()


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _spawn(cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.popen(cmd, **kw)


@dataclass
class _Vm:
    proc: subprocess.Popen[bytes]
    agent: AgentConnection
    config: qemu.VmConfig

    def alive(self) -> bool:
        return self.proc.poll() is None


def vmm_pss(pid: int) -> int:
    """Proportional set size of a process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MicrovmBackend:
    name = "microvm"
    capabilities = Capabilities("microvm", frozenset(
        {"exec", "stream", "files", "pause", "resume"}),
        "QEMU q35 guests (KVM where it works, else TCG) booting Debian's cloud kernel; image "
        "layers are virtio-pmem devices mounted EROFS -o dax (one host page-cache copy for "
        "all VMs), upper in guest memory; a static guest agent over virtio-serial; pause = "
        "snapshot to disk and exit the VMM. No network (none or allowlist not built yet); "
        "VMs end with the node process (not persistent).")

    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        self.config = config
        self.images = images
        self.boot_timeout = float(os.environ.get("LAZYFS_MICROVM_BOOT_TIMEOUT", "90"))
        self.kernel_cache = DEFAULT_CACHE
        self.pmem_cache = PMEM_CACHE
        self.agent_grace = EXEC_GRACE  # past an exec's timeout, before the agent counts as hung
        self.extra_append: list[str] = []  # kernel parameters added to every boot (tests)
        # where the layers are attached: "pmem" (virtio-pmem + DAX: one host page-cache
        # copy for all VMs) or "blk" (virtio-blk, each guest caches its own copy: only
        # for comparing the two; LAZYFS_MICROVM_LAYERS)
        self.layers_on = os.environ.get("LAZYFS_MICROVM_LAYERS", "pmem")
        if self.layers_on not in ("pmem", "blk"):
            raise BackendUnavailable(f"LAZYFS_MICROVM_LAYERS={self.layers_on!r}: "
                                     "pmem or blk")
        self._vms: dict[str, _Vm] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # every VMM we started, until killed
        self._lock = threading.Lock()

    # -- helpers -------------------------------------------------------------
    def _check(self) -> tuple[str, Path]:
        binary = qemu.qemu_binary()
        missing = tools_missing()
        if missing is not None:
            raise BackendUnavailable(f"the microvm backend needs {missing}")
        return binary, sandbox_init(self.config.bin_dir)

    def _vm(self, h: Handle) -> _Vm:
        with self._lock:
            vm = self._vms.get(h.id)
        if vm is None:
            raise SandboxStateError(f"{h.id} has no running VM (paused or stopped)")
        if not vm.alive():
            raise BackendUnavailable(f"{h.id}: the VM exited ({_exit_text(vm.proc)}); "
                                     "kill the sandbox")
        return vm

    def _unavailable(self, h: Handle, vm: _Vm, e: Exception) -> BackendUnavailable:
        if not vm.alive():
            return BackendUnavailable(f"{h.id}: the VM exited ({_exit_text(vm.proc)}): {e}")
        return BackendUnavailable(f"{h.id}: {e}; the VM is unusable, kill the sandbox")

    # -- lifecycle -----------------------------------------------------------
    def create(self, h: Handle) -> None:
        _, init = self._check()
        vmdir = h.dir / "vm"
        vmdir.mkdir(mode=0o700)
        agent_sock = vmdir / "agent.sock"
        try:
            if len(os.fsencode(agent_sock)) > 100:
                raise BackendUnavailable(f"socket path {agent_sock} is too long for a Unix "
                                         "socket; use a shorter runtime state directory")
            h.state["vm_dir"] = str(vmdir)
            self._prepare(h, vmdir)
            cfg = self._config(h, vmdir)
            h.state["accel"] = cfg.accel
            self._boot(h, cfg, init)
        except BaseException:
            self.kill(h)
            raise

    def _prepare(self, h: Handle, vmdir: Path) -> None:
        """What a new sandbox needs on the host before its first boot."""
        h.state["layers_on"] = self.layers_on

    def _config(self, h: Handle, vmdir: Path, incoming: str | None = None) -> qemu.VmConfig:
        """The VMM of this sandbox: for its first boot, or (incoming) to
        restore it from a snapshot, with the same devices."""
        binary = qemu.qemu_binary()
        kernel = guest_kernel(self.kernel_cache)
        layers = pmem_layers(self.images, h.spec.image, self.pmem_cache)
        h.state["layers"] = [x.digest for x in layers]
        upper_mb = h.spec.disk_mb or max(16, h.spec.memory_mb // 2)
        on = str(h.state.get("layers_on", "pmem"))
        if on == "blk":  # the same files as read-only disks: each guest caches what it reads
            pmem: list[Path] = []
            drives = [qemu.Drive(f, f"lz{i}{kind}") for i, layer in enumerate(layers)
                      for f, kind in zip(layer.files, "mb", strict=True)]
        else:
            pmem, drives = [p for layer in layers for p in layer.files], []
        accel = (str(h.state.get("accel", "tcg")) if incoming is not None
                 else qemu.accelerator(binary, kernel.vmlinuz))
        return qemu.VmConfig(
            qemu=binary, accel=accel, vmlinuz=kernel.vmlinuz,
            initrd=initramfs(kernel, self.config.bin_dir),
            memory_mb=max(h.spec.memory_mb, MIN_GUEST_MB),
            cpus=max(1, min(math.ceil(h.spec.cpu), os.cpu_count() or 1)),
            pmem=pmem, drives=drives, agent_socket=vmdir / "agent.sock",
            console_socket=vmdir / "console.sock", qmp_socket=vmdir / "qmp.sock",
            append=[f"lazyfs.layers={len(layers)}", f"lazyfs.layers_on={on}",
                    f"lazyfs.upper_mb={upper_mb}", f"lazyfs.hostname={h.id}",
                    *self.extra_append],
            incoming=incoming)

    def _start(self, h: Handle, cfg: qemu.VmConfig, init: Path) -> subprocess.Popen[bytes]:
        for s in (cfg.agent_socket, cfg.console_socket, cfg.qmp_socket):
            s.unlink(missing_ok=True)
        with open(cfg.agent_socket.parent / "qemu.log", "ab") as errlog:
            proc = _spawn([str(init), "pdeathsig", "--", *qemu.command(cfg)],
                          stdin=subprocess.DEVNULL, stdout=errlog, stderr=errlog,
                          start_new_session=True)
        h.state["pid"] = proc.pid
        with self._lock:
            self._procs[h.id] = proc
        return proc

    def _wait_sockets(self, proc: subprocess.Popen[bytes], cfg: qemu.VmConfig,
                      deadline: float) -> None:
        while not all(s.exists() for s in (cfg.agent_socket, cfg.console_socket,
                                           cfg.qmp_socket)):
            if proc.poll() is not None:
                raise BackendUnavailable(f"QEMU exited ({_exit_text(proc)}): "
                                         f"{_tail(cfg.agent_socket.parent / 'qemu.log')}")
            if time.monotonic() > deadline:
                raise BackendUnavailable("QEMU did not open its sockets in time")
            time.sleep(0.01)

    def _boot(self, h: Handle, cfg: qemu.VmConfig, init: Path) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.boot_timeout
        proc = self._start(h, cfg, init)
        self._wait_sockets(proc, cfg, deadline)
        console = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        console.connect(str(cfg.console_socket))
        console.setblocking(False)
        agent = AgentConnection.connect(str(cfg.agent_socket), alive=lambda: proc.poll() is None)
        log_buf = bytearray()
        try:
            while True:
                if proc.poll() is not None:
                    _drain(console, log_buf)
                    raise BackendUnavailable(
                        f"the VM of {h.id} exited while booting ({_exit_text(proc)}): "
                        f"{_console_tail(log_buf)} {_tail(cfg.agent_socket.parent / 'qemu.log')}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BackendUnavailable(
                        f"the guest agent of {h.id} did not come up within "
                        f"{self.boot_timeout:g}s: {_console_tail(log_buf)}")
                ready, _, _ = select.select([console, agent.sock], [], [], min(left, 0.5))
                if console in ready:
                    _drain(console, log_buf)
                    if b"lazyfs-init: FAILED" in log_buf or b"Kernel panic" in log_buf:
                        time.sleep(0.2)
                        _drain(console, log_buf)
                        raise BackendUnavailable(f"the guest of {h.id} failed to boot: "
                                                 f"{_console_tail(log_buf)}")
                if agent.sock in ready:
                    kind, payload = agent.recv(deadline)
                    if kind == READY:
                        agent.version = payload.decode(errors="replace")
                        break
        except AgentError as e:
            agent.close()
            raise BackendUnavailable(f"the guest agent of {h.id} failed while booting: {e}; "
                                     f"{_console_tail(log_buf)}") from e
        except BaseException:
            agent.close()
            raise
        finally:
            console.close()  # from now on QEMU drops console output
            (cfg.agent_socket.parent / "console.log").write_bytes(log_buf[-CONSOLE_KEEP:])
        h.state["boot_s"] = time.monotonic() - t0
        with self._lock:
            self._vms[h.id] = _Vm(proc, agent, cfg)
        log.info("%s booted in %.2fs (%s, %s)", h.id, h.state["boot_s"], cfg.accel,
                 agent.version)

    def kill(self, h: Handle) -> None:
        """Stop the VMM and remove its sockets, logs and snapshot; safe on
        half-created sandboxes and twice."""
        with self._lock:
            vm = self._vms.pop(h.id, None)
            proc = self._procs.pop(h.id, None)
        if vm is not None:
            vm.agent.close()
        vmdir = Path(h.state.get("vm_dir", h.dir / "vm"))
        pid = h.state.get("pid")
        if proc is not None:  # ours: kill and reap it
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                log.warning("%s: QEMU %d did not die in %gs", h.id, proc.pid, KILL_WAIT)
        elif isinstance(pid, int) and _is_vmm(pid, vmdir):  # a previous node's
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_gone(pid, vmdir, KILL_WAIT)
        snap = h.state.get("snapshot")
        if isinstance(snap, str):
            Path(snap).unlink(missing_ok=True)
        shutil.rmtree(SNAPSHOT_DIR / h.id, ignore_errors=True)
        shutil.rmtree(vmdir, ignore_errors=True)

    def status(self, h: Handle) -> str:
        if h.state.get("snapshot") and Path(str(h.state["snapshot"])).exists():
            return "paused"
        pid = h.state.get("pid")
        vmdir = Path(h.state.get("vm_dir", h.dir / "vm"))
        return "running" if isinstance(pid, int) and _is_vmm(pid, vmdir) else "stopped"

    def close(self) -> None:
        pass

    # -- pause: snapshot and exit -------------------------------------------
    def _snapshot_path(self, h: Handle) -> Path:
        info = sysmount.find_mount(self.config.state_dir)
        if info is not None and info.fstype == "tmpfs":  # RAM: would free nothing
            d = SNAPSHOT_DIR / h.id
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            return d / "snapshot.bin"
        return h.dir / "vm" / "snapshot.bin"

    def pause(self, h: Handle) -> dict[str, Any]:
        """Refused while a call runs in the guest: a snapshot taken mid-call
        would resume with the agent answering a call the new connection
        never made."""
        vm = self._vm(h)
        agent = vm.agent
        if not agent.lock.acquire(timeout=PAUSE_WAIT):
            raise SandboxStateError(f"{h.id} is running a command or a file call; "
                                    "pause it once that ends")
        try:
            return self._pause(h)
        finally:
            agent.lock.release()

    def _pause(self, h: Handle) -> dict[str, Any]:
        vm = self._vm(h)
        pss = vmm_pss(vm.proc.pid)
        snap = self._snapshot_path(h)
        t0 = time.monotonic()
        try:
            q = qemu.Qmp(vm.config.qmp_socket)
            try:
                q.execute("stop")
                q.execute("migrate-set-capabilities", capabilities=[
                    {"capability": "x-ignore-shared", "state": True}])
                q.execute("migrate", uri="exec:cat > " + shlex.quote(str(snap)))
                deadline = time.monotonic() + MIGRATE_TIMEOUT
                while True:
                    st = q.execute("query-migrate").get("status")
                    if st == "completed":
                        break
                    if st in ("failed", "cancelled") or time.monotonic() > deadline:
                        raise SandboxError(f"snapshot of {h.id} {st or 'timed out'}")
                    time.sleep(0.02)
                saved = time.monotonic()
                q.execute("quit")
            finally:
                q.close()
        except (SandboxError, OSError) as e:
            snap.unlink(missing_ok=True)
            if vm.alive():
                try:
                    q2 = qemu.Qmp(vm.config.qmp_socket)
                    q2.execute("cont")
                    q2.close()
                except (SandboxError, OSError):
                    pass
            raise SandboxError(f"pausing {h.id} failed: {e}") from e
        try:
            vm.proc.wait(timeout=KILL_WAIT)
        except subprocess.TimeoutExpired:
            vm.proc.kill()
            vm.proc.wait()
        vm.agent.close()
        with self._lock:
            self._vms.pop(h.id, None)
            self._procs.pop(h.id, None)
        h.state["snapshot"] = str(snap)
        h.state.pop("pid", None)
        return {"vmm_pss_before": pss, "vmm_pss_after": 0, "snapshot_bytes": snap.stat().st_size,
                "snapshot_s": saved - t0, "exit_s": time.monotonic() - saved}

    def resume(self, h: Handle) -> None:
        snap = Path(str(h.state.get("snapshot", "")))
        if not snap.is_file():
            raise SandboxStateError(f"{h.id} has no snapshot to resume from")
        _, init = self._check()
        vmdir = Path(h.state.get("vm_dir", h.dir / "vm"))
        cfg = self._config(h, vmdir, incoming="defer")
        deadline = time.monotonic() + self.boot_timeout
        proc = self._start(h, cfg, init)
        try:
            self._wait_sockets(proc, cfg, deadline)
            q = qemu.Qmp(cfg.qmp_socket)
            try:
                # both ends must leave the shared pmem regions out of the stream
                q.execute("migrate-set-capabilities", capabilities=[
                    {"capability": "x-ignore-shared", "state": True}])
                q.execute("migrate-incoming", uri="exec:cat " + shlex.quote(str(snap)))
                while True:
                    st = q.execute("query-migrate").get("status")
                    if st == "completed":
                        break
                    if st == "failed" or time.monotonic() > deadline or proc.poll() is not None:
                        raise BackendUnavailable(f"restoring {h.id} from {snap} {st}")
                    time.sleep(0.02)
                q.execute("cont")
            finally:
                q.close()
            agent = AgentConnection.connect(str(cfg.agent_socket),
                                            alive=lambda: proc.poll() is None)
            try:
                agent.ping(timeout=max(1.0, deadline - time.monotonic()))
            except AgentError as e:
                agent.close()
                raise BackendUnavailable(f"the guest agent of {h.id} did not answer after "
                                         f"resume: {e}") from e
        except BaseException:
            proc.kill()
            proc.wait()
            with self._lock:
                self._procs.pop(h.id, None)
            h.state.pop("pid", None)
            raise
        with self._lock:
            self._vms[h.id] = _Vm(proc, agent, cfg)
        snap.unlink(missing_ok=True)
        h.state.pop("snapshot", None)

    # -- exec ----------------------------------------------------------------
    def exec(self, h: Handle, req: ExecRequest, on_stdout: Sink | None,
             on_stderr: Sink | None) -> ExecResult:
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
        return ExecResult(exit_code=st.code, stdout=bytes(out), stderr=bytes(err),
                          duration=time.monotonic() - t0, truncated=st.truncated,
                          timed_out=st.timed_out)

    def files(self, h: Handle) -> SandboxFiles:
        return GuestFiles(self, h)


class GuestFiles(SandboxFiles):
    """A VM's files, through its guest agent (paths resolve inside the
    sandbox's root in the guest: openat2 RESOLVE_IN_ROOT)."""

    def __init__(self, backend: MicrovmBackend, h: Handle) -> None:
        super().__init__(h.dir)
        self._backend = backend
        self._h = h

    def _call(self) -> tuple[_Vm, AgentConnection]:
        vm = self._backend._vm(self._h)
        return vm, vm.agent

    def read(self, path: str, *, limit: int = MAX_READ) -> bytes:
        _clean(path)
        vm, agent = self._call()
        try:
            return agent.read(path, limit)
        except FileError as e:
            if "File too large" in str(e):
                raise FileError(f"{path}: larger than {limit} bytes; use download()") from None
            raise
        except AgentError as e:
            raise self._backend._unavailable(self._h, vm, e) from e

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        p = _clean(path)
        if p.name in ("", ".", ".."):
            raise FileError(f"{path}: not a file path")
        vm, agent = self._call()
        try:
            agent.write(path, data, mode)
        except AgentError as e:
            raise self._backend._unavailable(self._h, vm, e) from e

    def list(self, path: str = "/") -> list[FileInfo]:
        p = _clean(path)
        vm, agent = self._call()
        try:
            entries = agent.list(path)
        except AgentError as e:
            raise self._backend._unavailable(self._h, vm, e) from e
        return [FileInfo(name=_printable(e.name), path=str(p / _printable(e.name)),
                         type=entry_kind(e.mode), size=e.size, mode=e.mode & 0o7777,
                         mtime=e.mtime_ns / 1e9)
                for e in sorted(entries, key=lambda e: e.name)]

    def remove(self, path: str, *, recursive: bool = False) -> None:
        p = _clean(path)
        if str(p) == "/":
            raise FileError("refusing to remove the sandbox's root")
        vm, agent = self._call()
        try:
            agent.remove(path, recursive)
        except AgentError as e:
            raise self._backend._unavailable(self._h, vm, e) from e

    def exists(self, path: str) -> bool:
        _clean(path)
        vm, agent = self._call()
        try:
            return agent.exists(path)
        except AgentError as e:
            raise self._backend._unavailable(self._h, vm, e) from e


def _exit_text(proc: subprocess.Popen[bytes]) -> str:
    rc = proc.poll()
    if rc is None:
        return "running"
    return f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"


def _drain(sock: socket.socket, buf: bytearray) -> None:
    while True:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, OSError):
            return
        if not data:
            return
        buf += data
        if len(buf) > 2 * CONSOLE_KEEP:
            del buf[:-CONSOLE_KEEP]


def _console_tail(buf: bytearray, lines: int = 6) -> str:
    text = bytes(buf[-4096:]).decode(errors="replace").replace("\r", "")
    tail = [x for x in text.splitlines() if x.strip()][-lines:]
    return "console: " + " | ".join(tail) if tail else "console: (nothing)"


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return " | ".join(text.splitlines()[-3:])


def _is_vmm(pid: int, vmdir: Path) -> bool:
    """Whether pid is the QEMU of this sandbox (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z" and os.fsencode(vmdir / "agent.sock") in cmd


def _wait_gone(pid: int, vmdir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _is_vmm(pid, vmdir) and time.monotonic() < deadline:
        time.sleep(0.02)
