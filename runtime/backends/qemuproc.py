"""The QEMU processes of sandbox VMs: starting one, waiting for its sockets
and for its guest agent's READY, recognising it by pid (also one a previous
node process started) and killing it, and its memory figures.

It does not know what a VM is made of (runtime/guest/qemu.py builds the
command line; the backends choose devices and kernel parameters) nor how it
is paused (runtime/backends/snapshots.py).

QEMU runs under `sandbox-init pdeathsig`, started from one long-lived thread
of this process: PR_SET_PDEATHSIG fires when the *thread* that forked the VMM
exits, and the node calls backends from short-lived worker threads. So the
VMs die with the node process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable
from ..guest import qemu
from ..guest.protocol import READY, AgentConnection, AgentError, ready_fields
from . import procio

log = logging.getLogger(__name__)

CONSOLE_KEEP = 64 << 10  # bytes of boot console kept in console.log
# LAZYFS_VM_CONSOLE=keep (diagnostics, off by default: a thread per VM): the
# console stays read after boot, appended to console.log up to this many
# bytes (later output is read and dropped, so the guest never stalls on it)
CONSOLE_ENV = "LAZYFS_VM_CONSOLE"
CONSOLE_AFTER_BOOT = 1 << 20
KILL_WAIT = 10.0


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
class Vm:
    """A running VMM and the connection to its guest agent."""

    proc: subprocess.Popen[bytes]
    agent: AgentConnection
    config: qemu.VmConfig

    def alive(self) -> bool:
        return self.proc.poll() is None


def start(cfg: qemu.VmConfig, init: Path, cgroup_procs: list[Path] | None = None,
          idle: bool = False, preload: Path | None = None,
          netns: Path | None = None) -> subprocess.Popen[bytes]:
    """Start the VMM of cfg (it dies with this process); its stderr goes to
    qemu.log next to its sockets. It joins the cgroups whose cgroup.procs
    files are given before it execs QEMU (so its first page is charged
    there), runs under SCHED_IDLE if `idle` (qos="best_effort"), with
    `preload` (runtime/native/qemu-preload.c: no MADV_HUGEPAGE on the lazily
    served pmem files) as LD_PRELOAD, in the network namespace `netns` (a
    VM with a network: its tap is there) if given."""
    for s in (cfg.agent_socket, cfg.console_socket, cfg.qmp_socket):
        s.unlink(missing_ok=True)
    fds = [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in cgroup_procs or []]
    try:
        opts = [*(["-i"] if idle else []), *(a for fd in fds for a in ("-j", str(fd)))]
        if netns is not None:
            try:
                fds.append(os.open(netns, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as e:
                raise BackendUnavailable(f"the VM's network namespace {netns}: {e}") from e
            opts += ["-n", str(fds[-1])]
        with open(cfg.agent_socket.parent / "qemu.log", "ab") as errlog:
            return _spawn([str(init), "pdeathsig", *opts, "--", *qemu.command(cfg)],
                          stdin=subprocess.DEVNULL, stdout=errlog, stderr=errlog,
                          start_new_session=True, pass_fds=fds,
                          env={**os.environ, "LD_PRELOAD": str(preload)} if preload else None)
    finally:
        for fd in fds:
            os.close(fd)


_SO_ACCEPTCON = 0x10000  # /proc/net/unix's Flags of a listening socket


def _listening(pid: int, paths: list[Path]) -> bool:
    """Whether a socket bound to each of `paths` listens, as the network
    namespace of process `pid` lists its unix sockets."""
    try:
        text = Path(f"/proc/{pid}/net/unix").read_text()
    except OSError:
        return False
    want = {str(p) for p in paths}
    for line in text.splitlines()[1:]:
        f = line.split(maxsplit=7)
        if len(f) == 8 and f[7] in want and int(f[3], 16) & _SO_ACCEPTCON:
            want.discard(f[7])
    return not want


def wait_sockets(proc: subprocess.Popen[bytes], cfg: qemu.VmConfig, deadline: float) -> None:
    """Wait until QEMU listens on its three sockets. A socket's file appears
    at bind(2) and refuses connections until listen(2): on a busy host QEMU
    can be preempted between the two, so the files' existence is not
    enough (a QMP connect made then was refused)."""
    paths = [cfg.agent_socket, cfg.console_socket, cfg.qmp_socket]
    while not (all(s.exists() for s in paths) and _listening(proc.pid, paths)):
        if proc.poll() is not None:
            raise BackendUnavailable(f"QEMU exited ({exit_text(proc)}): "
                                     f"{tail(cfg.agent_socket.parent / 'qemu.log')}")
        if time.monotonic() > deadline:
            raise BackendUnavailable("QEMU did not open its sockets in time")
        time.sleep(0.01)


def wait_ready(sandbox_id: str, proc: subprocess.Popen[bytes], cfg: qemu.VmConfig,
               deadline: float, timeout: float) -> AgentConnection:
    """Read the console while the guest boots until its agent says READY; a
    guest that panics, fails its init or stays silent past the deadline is
    BackendUnavailable naming the console's last lines (kept in console.log)."""
    console = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    console.connect(str(cfg.console_socket))
    console.setblocking(False)
    agent = AgentConnection.connect(str(cfg.agent_socket), alive=lambda: proc.poll() is None)
    log_buf = bytearray()
    try:
        while True:
            if proc.poll() is not None:
                drain(console, log_buf)
                raise BackendUnavailable(
                    f"the VM of {sandbox_id} exited while booting ({exit_text(proc)}): "
                    f"{console_tail(log_buf)} {tail(cfg.agent_socket.parent / 'qemu.log')}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendUnavailable(
                    f"the guest agent of {sandbox_id} did not come up within "
                    f"{timeout:g}s: {console_tail(log_buf)}")
            ready, _ = procio.ready([console, agent.sock], timeout=min(left, 0.5))
            if console in ready:
                drain(console, log_buf)
                if b"lazyfs-init: FAILED" in log_buf or b"Kernel panic" in log_buf:
                    time.sleep(0.2)
                    drain(console, log_buf)
                    raise BackendUnavailable(f"the guest of {sandbox_id} failed to boot: "
                                             f"{console_tail(log_buf)}")
            if agent.sock in ready:
                kind, payload = agent.recv(deadline)
                if kind == READY:
                    agent.version = ready_fields(payload)[0]
                    return agent
    except AgentError as e:
        agent.close()
        raise BackendUnavailable(f"the guest agent of {sandbox_id} failed while booting: {e}; "
                                 f"{console_tail(log_buf)}") from e
    except BaseException:
        agent.close()
        raise
    finally:
        path = cfg.agent_socket.parent / "console.log"
        path.write_bytes(log_buf[-CONSOLE_KEEP:])
        if os.environ.get(CONSOLE_ENV) == "keep" and proc.poll() is None:
            threading.Thread(target=_keep_console, args=(console, path),
                             name=f"console-{sandbox_id}", daemon=True).start()
        else:
            console.close()  # from now on QEMU drops console output


def _keep_console(console: socket.socket, path: Path) -> None:
    """Append what the guest's console says to path (CONSOLE_AFTER_BOOT bytes
    at most, the rest read and dropped) until QEMU closes it."""
    room = CONSOLE_AFTER_BOOT
    try:
        console.setblocking(True)
        with open(path, "ab") as f:
            while data := console.recv(65536):
                if room > 0:
                    f.write(data[:room])
                    f.flush()
                    room -= len(data)
    except OSError:
        pass
    finally:
        console.close()


def stop(sandbox_id: str, proc: subprocess.Popen[bytes]) -> None:
    """Kill and reap a VMM this process started."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=KILL_WAIT)
    except subprocess.TimeoutExpired:
        log.warning("%s: QEMU %d did not die in %gs", sandbox_id, proc.pid, KILL_WAIT)


def stop_foreign(pid: int, vmdir: Path) -> None:
    """Kill the VMM a previous node process started for vmdir, if pid is it."""
    if not is_vmm(pid, vmdir):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + KILL_WAIT
    while is_vmm(pid, vmdir) and time.monotonic() < deadline:
        time.sleep(0.02)


def is_vmm(pid: int, vmdir: Path) -> bool:
    """Whether pid is the QEMU of the sandbox in vmdir (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z" and os.fsencode(vmdir / "agent.sock") in cmd


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


def exit_text(proc: subprocess.Popen[bytes]) -> str:
    rc = proc.poll()
    if rc is None:
        return "running"
    if rc == -signal.SIGBUS:
        # a page of a file QEMU maps (the image's pmem blobs, served lazily
        # by the node daemon) could not be read: the daemon failed the fetch
        return (f"killed by signal {-rc}, SIGBUS: a page of its mapped image could not be "
                "read (a chunk the node daemon failed to fetch; see its log)")
    return f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"


def drain(sock: socket.socket, buf: bytearray) -> None:
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


def console_tail(buf: bytearray, lines: int = 6) -> str:
    text = bytes(buf[-4096:]).decode(errors="replace").replace("\r", "")
    last = [x for x in text.splitlines() if x.strip()][-lines:]
    return "console: " + " | ".join(last) if last else "console: (nothing)"


def tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return " | ".join(text.splitlines()[-3:])
