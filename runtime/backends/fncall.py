"""fncall: stateless, restricted tool calls from a warm pool.

Per image, a pool of pre-forked workers (runtime/backends/fncall_worker.py)
chrooted into the image's read-only lazy root, without network. Each exec is
a fresh process in its own PID namespace under Landlock, seccomp, rlimits and
a uid of its sandbox's own (hostlimits.fncall_uid: the kernel's per-user
budgets, such as inotify's, are per sandbox), with a fresh tmpfs /tmp as its only writable place; nothing of a
call survives into the next one. A "sandbox" here is a name for the pool plus
its labels and timeouts: there is no state to pause, snapshot or browse.

Pools are keyed by image digest: the one the node resolved when the sandbox
was created. An exec finds its pool by that digest without reading the
catalog, so a tag moved later never switches an existing sandbox to another
image, and a call costs no catalog round trip (two object reads and a hash
in cluster mode).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from chunkstore.digests import Digest
from lazyfs import sysmount
from lazyfs.mounts import MountError, mount_image, unmount
from lazyfs.node import NodePaths

from ..api import Sink
from ..config import RuntimeConfig
from ..errors import BackendUnavailable, Unsupported
from ..files import SandboxFiles
from ..images import Images
from ..isolation import cgroups, hostlimits
from ..isolation.denials import Denials, SeccompListener
from ..native import sandbox_init
from ..spec import ExecRequest, ExecResult, ResolvedImage, SandboxEvent, SandboxSpec
from .base import BackendState, Capabilities, Handle, Signaller

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 20.0
WAIT_FOR_WORKER = 60.0
CLEAN_TIMEOUT = 30.0  # kill_all waits up to 5 s, then the scratch is emptied
SCRATCH_MB = 64


CONTROLLERS = ("memory", "pids", "freezer", "cpu")


def _cgroup_dirs(name: str) -> list[Path]:
    return [cgroups.CGROUP_ROOT / c / cgroups.PARENT / name for c in CONTROLLERS]


def _remove_cgroup(name: str) -> None:
    procs = cgroups.CGROUP_ROOT / "pids" / cgroups.PARENT / name / "cgroup.procs"
    deadline = time.monotonic() + 5
    while procs.exists() and procs.read_text().split() and time.monotonic() < deadline:
        for pid in procs.read_text().split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.01)
    for d in _cgroup_dirs(name):
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove cgroup %s: %s", d, e)


class Worker:
    """A worker process and its own cgroup (`name`), created here and removed
    by close(). With a `listener`, the worker's calls' seccomp listeners go
    to it over a socket pair made here (its node end is the listener's)."""

    def __init__(self, rootfs: Path, init: Path, scratch_mb: int, logfile: Path,
                 name: str, listener: SeccompListener | None = None) -> None:
        self.cgroup = name
        for d in _cgroup_dirs(name):
            d.mkdir(parents=True, exist_ok=True)
        node_end, worker_end = (socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                                if listener else (None, None))
        notify = ["--notify-fd", str(worker_end.fileno())] if worker_end else []
        try:
            with open(logfile, "ab") as log_f:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "runtime.backends.fncall_worker", "--root",
                     str(rootfs), "--init", str(init), "--scratch-mb", str(scratch_mb),
                     "--cgroup", f"{cgroups.PARENT}/{name}", *notify],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_f, cwd=REPO,
                    start_new_session=True,
                    pass_fds=[worker_end.fileno()] if worker_end else [])
        except BaseException:
            if node_end and worker_end:
                node_end.close()
                worker_end.close()
            raise
        if listener and node_end and worker_end:
            worker_end.close()  # the worker's now: its end closes when it exits
            listener.feed(node_end)
        self.unpacker = msgpack.Unpacker(raw=False, max_buffer_size=256 << 20)
        self.cleaning = False  # a call returned; its cleanup not yet confirmed
        ready = self._next(START_TIMEOUT)
        if "ready" not in ready:
            raise BackendUnavailable(f"fncall worker did not start (log: {logfile})")

    def _next(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            for msg in self.unpacker:
                return dict(msg)
            if time.monotonic() > deadline:
                raise BackendUnavailable("fncall worker stopped answering")
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not data:
                raise BackendUnavailable(f"fncall worker exited ({self.proc.poll()})")
            self.unpacker.feed(data)

    def usable(self) -> bool:
        """True once the last call's processes are gone and its /tmp is
        empty; False if the worker could not get there (it exits): the
        next call then goes to a fresh worker, so one sandbox's leftovers
        never fail another sandbox's call."""
        if self.cleaning:
            try:
                msg = self._next(CLEAN_TIMEOUT)
            except BackendUnavailable:
                return False
            self.cleaning = False
            if not msg.get("clean"):
                return False
        return self.proc.poll() is None

    def call(self, sandbox_id: str, req: ExecRequest, spec: SandboxSpec, uid: int,
             on_stdout: Sink | None, on_stderr: Sink | None,
             denials: Denials | None = None) -> ExecResult:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(msgpack.packb({
                "cmd": list(req.cmd), "cwd": req.cwd, "env": req.env, "stdin": req.stdin,
                "timeout": req.timeout, "max_output": req.max_output_bytes,
                "memory": spec.memory_mb << 20, "pids": spec.pids, "cpu": spec.cpu,
                "uid": uid, "sandbox": sandbox_id}))
            self.proc.stdin.flush()
        except OSError as e:
            raise BackendUnavailable(f"fncall worker {self.proc.pid} is gone: {e}") from e
        out, err = bytearray(), bytearray()
        while True:
            msg = self._next(req.timeout + 60)
            if "o" in msg:
                out += msg["o"]
                if on_stdout:
                    on_stdout(msg["o"])
            elif "e" in msg:
                err += msg["e"]
                if on_stderr:
                    on_stderr(msg["e"])
            elif "x" in msg:
                if msg.get("err"):
                    err += f"fncall: {msg['err']}\n".encode()
                code = int(msg["x"])
                self.cleaning = True
                oom = bool(msg.get("oom"))
                if denials is not None:  # the worker's cgroup served this call alone
                    if oom:
                        denials.record(sandbox_id, "oom_kill", "memory limit")
                    if int(msg.get("pf", 0)) > 0:
                        denials.record(sandbox_id, "process_limit", f"pids={spec.pids}",
                                       int(msg["pf"]))
                return ExecResult(exit_code=code, stdout=bytes(out), stderr=bytes(err),
                                  duration=float(msg["d"]), truncated=bool(msg["t"]),
                                  timed_out=bool(msg["to"]), oom_killed=oom and code == 137)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        _remove_cgroup(self.cgroup)


class Pool:
    def __init__(self, backend: FncallBackend, image: ResolvedImage) -> None:
        digest = image.digest
        self.dir = backend.config.state_dir / "fncall" / digest
        self.rootfs = self.dir / "rootfs"
        self.rootfs.mkdir(parents=True, exist_ok=True)
        paths = backend.images.ensure_daemon()
        try:
            mount_image(paths, backend.images.catalog(), digest, self.rootfs)
        except MountError as e:
            raise BackendUnavailable(f"mounting {image.name} ({digest}) for fncall: {e}") from e
        self.paths = paths
        self.digest = digest
        self._serial = 0
        self.idle: queue.Queue[Worker] = queue.Queue()
        self.workers: list[Worker] = []
        try:
            for _ in range(backend.config.fncall_workers):
                self._spawn(backend)
        except BaseException:
            self.close()
            raise
        self.backend = backend

    def _worker(self, backend: FncallBackend) -> Worker:
        self._serial += 1
        # the owner pid in the name: a node starting later can tell a dead
        # node's leftovers from a live one's, whatever its state directory
        name = (f"{backend.prefix}-p{os.getpid()}-{Digest.parse(self.digest).hex[:12]}"
                f"-{self._serial}")
        return Worker(self.rootfs, backend.init(), SCRATCH_MB, self.dir / "workers.log", name,
                      backend.denials.listener())

    def _spawn(self, backend: FncallBackend) -> None:
        w = self._worker(backend)
        self.workers.append(w)
        self.idle.put(w)

    def call(self, sandbox_id: str, req: ExecRequest, spec: SandboxSpec, uid: int,
             on_stdout: Sink | None, on_stderr: Sink | None) -> ExecResult:
        try:
            w = self.idle.get(timeout=WAIT_FOR_WORKER)
        except queue.Empty:
            raise BackendUnavailable("every fncall worker stayed busy for "
                                     f"{WAIT_FOR_WORKER:g}s") from None
        if not w.usable():  # it died between calls: a fresh one takes the call
            log.warning("fncall worker %d could not clean up after its last call (%s); "
                        "replacing it", w.proc.pid, w.proc.poll())
            w.proc.kill()
            self.workers.remove(w)
            w.close()
            w = self._worker(self.backend)
            self.workers.append(w)
        try:
            r = w.call(sandbox_id, req, spec, uid, on_stdout, on_stderr, self.backend.denials)
        except BaseException:
            self.workers.remove(w)
            w.proc.kill()
            w.close()
            self._spawn(self.backend)  # keep the pool full
            raise
        self.idle.put(w)
        return r

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers.clear()
        if sysmount.find_mount(self.rootfs) is not None:
            try:
                unmount(self.paths, self.rootfs)
            except MountError:
                unmount(self.paths, self.rootfs, lazy=True)


def cgroup_prefix(config: RuntimeConfig) -> str:
    """fncall cgroups are named per node state directory, so nodes sharing a
    host never sweep each other's."""
    h = hashlib.blake2s(str(config.state_dir.absolute()).encode(), digest_size=4).hexdigest()
    return f"fncall-{h}"


_OWNER = re.compile(r"fncall-[0-9a-f]{8}-p([0-9]+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_cgroups(config: RuntimeConfig) -> list[str]:
    """Worker cgroups no live node owns: every one of this state directory
    (the caller holds its node lock, so no other node process uses it), and
    those of any state directory whose owner process (named in the cgroup:
    `-p<pid>-`) is gone. Another live node's are never among them (a reused
    pid keeps a dead node's cgroups until that process ends: the safe side)."""
    mine = cgroup_prefix(config) + "-"
    names = {d.name for c in CONTROLLERS
             for d in (cgroups.CGROUP_ROOT / c / cgroups.PARENT).glob("fncall-*")}
    out = []
    for name in sorted(names):
        owner = _OWNER.match(name)
        if name.startswith(mine) or (owner is not None and int(owner[1]) != os.getpid()
                                     and not _alive(int(owner[1]))):
            out.append(name)
    return out


def sweep(config: RuntimeConfig) -> None:
    """Remove what pools of a previous node process left: root mounts and
    worker cgroups (pools do not survive their node: their workers were its
    children), also those of dead nodes of other state directories
    (leftover_cgroups)."""
    paths = NodePaths(config.node_root.absolute())
    for rootfs in (config.state_dir / "fncall").glob("*/rootfs"):
        if sysmount.find_mount(rootfs) is not None:
            try:  # through lazyfs: the layers' shared mounts are released too
                unmount(paths, rootfs, lazy=True)
            except MountError:
                sysmount.umount(rootfs, lazy=True)
    for name in leftover_cgroups(config):
        log.info("removing the fncall cgroup %s a previous node left", name)
        _remove_cgroup(name)


class FncallState(BackendState):
    """Nothing: a fncall sandbox is its pool (found by Handle.image.digest)."""


Fncall = Handle[FncallState]


class FncallBackend:
    name = "fncall"
    state_type = FncallState
    capabilities = Capabilities("fncall", frozenset({"exec", "stream", "events"}),
                                "stateless calls: fresh restricted process per exec, "
                                "read-only image, fresh /tmp, no network")

    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        self.config = config
        self.images = images
        self._pools: dict[str, Pool] = {}
        self._lock = threading.Lock()
        self._init: Path | None = None
        self.prefix = cgroup_prefix(config)
        self.denials = Denials(self._whose)
        self._by_uid: dict[int, set[str]] = {}  # live sandboxes by the uid their calls run as
        self._uid_lock = threading.Lock()

    def init(self) -> Path:
        if self._init is None:
            self._init = sandbox_init(self.config.bin_dir)
        return self._init

    def _whose(self, uid: int, pid: int | None) -> str | None:
        """The sandbox of a Landlock audit record (runtime/isolation/landlock_audit.py):
        the one live sandbox whose calls run as `uid` (the domain's creator,
        sandbox-init, takes the call's uid before it makes the domain). Two
        sandboxes sharing a uid (hostlimits.fncall_uid) cannot be told apart:
        not recorded."""
        with self._uid_lock:
            ids = self._by_uid.get(uid, set())
            return next(iter(ids)) if len(ids) == 1 else None

    def _pool(self, image: ResolvedImage) -> Pool:
        """The pool of the image's digest; made (mounting by digest) the
        first time a sandbox of it is created."""
        with self._lock:
            if image.digest not in self._pools:
                if os.geteuid() != 0:
                    raise BackendUnavailable("fncall workers need root (namespaces, chroot)")
                self._pools[image.digest] = Pool(self, image)
            return self._pools[image.digest]

    def create(self, h: Fncall) -> None:
        self._pool(h.image)
        with self._uid_lock:
            self._by_uid.setdefault(hostlimits.fncall_uid(h.id), set()).add(h.id)
        self.denials.watch(h.id)

    def exec(self, h: Fncall, req: ExecRequest, on_stdout: Sink | None,
             on_stderr: Sink | None, *,
             on_started: Callable[[Signaller], None] | None = None) -> ExecResult:
        # (a call cannot be signalled: on_started is never called)
        # each sandbox's calls run as a uid of its own: the kernel's per-user
        # budgets (inotify instances and watches) are the sandbox's
        return self._pool(h.image).call(h.id, req, h.spec, hostlimits.fncall_uid(h.id),
                                        on_stdout, on_stderr)

    def events(self, h: Fncall) -> list[SandboxEvent]:
        """What the sandbox's calls were refused: denied system calls
        (answered by the node, runtime/isolation/denials.py), OOM kills and forks
        refused at the pids limit."""
        return self.denials.events(h.id)

    def files(self, h: Fncall) -> SandboxFiles:
        raise Unsupported("fncall sandboxes are stateless: pass data through stdin/stdout")

    def pause(self, h: Fncall) -> dict[str, Any]:
        raise Unsupported("fncall sandboxes cannot pause")

    def resume(self, h: Fncall) -> None:
        raise Unsupported("fncall sandboxes cannot resume")

    def kill(self, h: Fncall) -> None:
        # nothing of a call outlives it; the pool stays warm for others
        with self._uid_lock:
            uid = hostlimits.fncall_uid(h.id)
            self._by_uid.get(uid, set()).discard(h.id)
            if not self._by_uid.get(uid, True):
                del self._by_uid[uid]
        self.denials.forget(h.id)

    def status(self, h: Fncall) -> str:
        return "running" if self._pools else "stopped"

    def close(self) -> None:
        with self._lock:
            for p in self._pools.values():
                p.close()
            self._pools.clear()
        self.denials.close()
