"""A private, throw-away Docker daemon for tests; never the system's Docker.

DockerDaemon(workdir) runs /usr/sbin/dockerd (which starts its own containerd)
with everything of its own:

* --data-root      <workdir>/data-root    (images, layers, containers)
* --exec-root      /run/lzd-XXXXXX/x      (short: unix socket paths are limited
                                           to 108 bytes; /tmp if /run is not writable)
* -H unix://       /run/lzd-XXXXXX/docker.sock
* --pidfile        <workdir>/dockerd.pid
* --config-file    <workdir>/daemon.json  (so /etc/docker/daemon.json is never read;
                                           on dockerd < 23 it also moves the trust
                                           key away from /etc/docker/key.json)
* --cgroup-parent  /lazyfs-dockerd-XXXXXX (its containers' cgroups, removed on stop)
* no networking:   --bridge=none --iptables=false --ip6tables=false
                   --ip-forward=false --ip-masq=false; run containers and RUN
                   steps with network_mode="none".

The storage driver is dockerd's own choice (overlay2 where the kernel and the
data root's file system allow it); if the daemon fails to start because of its
graph driver, it is started again with --storage-driver=vfs. The driver in use
is `DockerDaemon.storage_driver`.

stop() (also on a failed start, and from __exit__) SIGKILLs running containers
through the API, closes the client, sends SIGTERM to dockerd (SIGKILL after
15 s), kills whatever it left behind (containerd, containerd-shim-runc-v2 and
container processes: found via /proc by ancestry, by their command line naming
our exec root and by our cgroup parent), lazily unmounts every mount left
under the data root and the exec root (deepest first), removes the empty
cgroups and the exec root. The data root stays in workdir (the caller's
tmp_path) for inspection.

Side effects outside our directories, all unavoidable with dockerd 20.10 and
containerd 1.6: the plugin discovery directory /run/docker/plugins and the
shim socket directory /run/containerd/s (both removed again on stop if this
daemon created them and they are empty; sockets that SIGKILLed shims of our
containers left there are removed).

Image helpers: import_rootfs() turns a rootfs tar into an image (like
`docker import`), build_image() builds a context directory with the classic
builder (no network; RUN steps work with network_mode="none")."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors

from .process import ServerProcess

DOCKERD_CANDIDATES = ("/usr/sbin/dockerd", "/usr/bin/dockerd")
REQUIRED_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc")
TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

STARTUP_TIMEOUT = 30.0
STOP_GRACE = 15.0
SHUTDOWN_TIMEOUT = 3   # dockerd --shutdown-timeout: SIGKILL containers after 3 s

SHIM_SOCKET_DIR = Path("/run/containerd/s")
# Directories dockerd/containerd create outside their roots whatever the flags.
GLOBAL_DIRS = (Path("/run/docker/plugins"), Path("/run/docker"),
               SHIM_SOCKET_DIR, SHIM_SOCKET_DIR.parent)

# dockerd's words when no (or not the requested) graph driver can be used.
_GRAPHDRIVER_FAILURE = re.compile(r"error initializing graphdriver|driver not supported",
                                  re.IGNORECASE)


class DockerDaemonError(RuntimeError):
    """The private dockerd could not be started, stopped cleanly or used."""


# ---------------------------------------------------------------------------
# environment checks


def find_dockerd() -> str | None:
    for cand in DOCKERD_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    return shutil.which("dockerd")


def tools_missing() -> str | None:
    """Why a private dockerd cannot run here, or None if it can."""
    if find_dockerd() is None:
        return "dockerd not found (apt-get install docker.io)"
    if os.geteuid() != 0:
        return "a private dockerd needs root"
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool, path=TOOL_PATH) is None:
            return f"{tool} not found (apt-get install docker.io)"
    return None


def dockerd_version(dockerd: str) -> tuple[int, ...]:
    """(major, minor, patch) of `dockerd --version` ("Docker version 20.10.24+dfsg1, ...")."""
    p = subprocess.run([dockerd, "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"version (\d+)\.(\d+)\.(\d+)", p.stdout)
    return tuple(int(x) for x in m.groups()) if m else (0, 0, 0)


# ---------------------------------------------------------------------------
# /proc helpers


def _unescape_mountinfo(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mountinfo() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount, in mount order."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            out.append((_unescape_mountinfo(fields[4]), right.split()[0]))
    return out


def _is_under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def mounts_under(*roots: Path | str) -> list[str]:
    """Mount points at or below any of roots (symlinks in roots resolved)."""
    real = [os.path.realpath(r) for r in roots]
    return [mnt for mnt, _ in _mountinfo() if _is_under(mnt, real)]


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, starttime) of pid, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()
    # rest[0] is field 3 (state), rest[1] field 4 (ppid), rest[19] field 22 (starttime)
    return rest[0], int(rest[1]), int(rest[19])


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _alive(pid: int, starttime: int | None = None) -> bool:
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return starttime is None or st[2] == starttime


def _own_ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 0 and pid not in pids:
        pids.add(pid)
        st = _proc_stat(pid)
        pid = st[1] if st else 0
    return pids




def _accepts(path: Path) -> bool:
    """Does a unix socket at path accept connections? (Probed with a socket of our
    own: the docker SDK leaks the socket of a refused connection.)"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _short_base() -> Path:
    for base in ("/run", "/tmp"):
        if os.access(base, os.W_OK | os.X_OK):
            return Path(base)
    return Path(tempfile.gettempdir())


# ---------------------------------------------------------------------------
# the daemon


class DockerDaemon(ServerProcess):
    """A private dockerd; use as a context manager or call start()/stop().

    After start(): `socket_url` ("unix:///run/lzd-.../docker.sock"), `client`
    (a docker.DockerClient on it), `storage_driver` ("overlay2", "vfs", ...),
    `pid`, `data_root`, `exec_root`, `log_path`. Ready when its socket
    accepts and it answers a ping."""

    name = "dockerd"
    error = DockerDaemonError

    def __init__(self, workdir: Path, *, storage_driver: str | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT, stop_grace: float = STOP_GRACE,
                 extra_args: Iterable[str] = ()) -> None:
        self.workdir = Path(workdir).resolve()
        super().__init__(self.workdir / "dockerd.log", startup_timeout=startup_timeout,
                         stop_grace=stop_grace)
        self.requested_driver = storage_driver
        self.extra_args = list(extra_args)
        self.data_root = self.workdir / "data-root"
        self.pidfile = self.workdir / "dockerd.pid"
        self.config_path = self.workdir / "daemon.json"
        self.cgroup_parent = f"/lazyfs-dockerd-{secrets.token_hex(4)}"
        self.short_dir: Path | None = None      # /run/lzd-XXXX: exec root + socket
        self._client: docker.DockerClient | None = None
        self.storage_driver: str | None = None
        self._created_global_dirs: list[Path] = []

    # -- addresses ---------------------------------------------------------

    @property
    def exec_root(self) -> Path:
        if self.short_dir is None:
            raise DockerDaemonError("daemon not started")
        return self.short_dir / "x"

    @property
    def socket_path(self) -> Path:
        if self.short_dir is None:
            raise DockerDaemonError("daemon not started")
        return self.short_dir / "docker.sock"

    @property
    def socket_url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            raise DockerDaemonError("daemon not running")
        return self._client

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Start dockerd and wait (startup_timeout) until it answers a ping.
        Raises DockerDaemonError with the tail of its log; cleans up first."""
        if self.running:
            raise DockerDaemonError("daemon already started")
        dockerd = find_dockerd()
        why = tools_missing()
        if why or dockerd is None:
            raise DockerDaemonError(why or "dockerd not found")
        drivers: list[str | None] = [self.requested_driver]
        if self.requested_driver is None:
            drivers.append("vfs")
        for attempt, driver in enumerate(drivers):
            try:
                self._start_once(dockerd, driver)
                return
            except DockerDaemonError as e:
                self.stop()
                last = attempt + 1 == len(drivers)
                if last or not _GRAPHDRIVER_FAILURE.search(str(e)):
                    raise
                # A half-initialised data root of the failed driver would make
                # dockerd complain about a "prior storage driver".
                if not mounts_under(self.data_root):
                    shutil.rmtree(self.data_root, ignore_errors=True)
            except BaseException:  # KeyboardInterrupt, pytest timeouts: never leak it
                self.stop()
                raise

    def _start_once(self, dockerd: str, driver: str | None) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data_root.mkdir(exist_ok=True)
        self._created_global_dirs = [d for d in GLOBAL_DIRS if not d.exists()]
        self.short_dir = Path(tempfile.mkdtemp(prefix="lzd-", dir=_short_base()))
        self.exec_root.mkdir()
        config: dict[str, Any] = {}
        if dockerd_version(dockerd) < (23,):
            # Else dockerd 20.10 writes its trust key to /etc/docker/key.json.
            config["deprecated-key-path"] = str(self.workdir / "key.json")
        self.config_path.write_text(json.dumps(config) + "\n")
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()
        cmd = [dockerd,
               "--config-file", str(self.config_path),
               "--data-root", str(self.data_root),
               "--exec-root", str(self.exec_root),
               "--pidfile", str(self.pidfile),
               "-H", self.socket_url,
               "--bridge=none", "--iptables=false", "--ip6tables=false",
               "--ip-forward=false", "--ip-masq=false",
               "--cgroup-parent", self.cgroup_parent,
               "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
        if driver is not None:
            cmd += ["--storage-driver", driver]
        cmd += self.extra_args
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DOCKER_", "CONTAINERD_")) and k != "NOTIFY_SOCKET"}
        env["PATH"] = TOOL_PATH
        self.spawn(cmd, cwd=self.workdir, env=env, new_session=True, header=True)
        self.wait_ready()
        self.storage_driver = str(self.client.info().get("Driver"))

    def ready(self) -> bool:
        if not _accepts(self.socket_path):
            self.last = f"no answer on {self.socket_url}"
            return False
        client: docker.DockerClient | None = None
        try:
            client = docker.DockerClient(base_url=self.socket_url, version="auto", timeout=10)
            if client.ping():
                self._client = client
                return True
            self.last = "ping returned False"
        except (docker.errors.DockerException, OSError) as e:
            self.last = repr(e)
        if client is not None:
            client.close()
        return False

    def stop(self) -> None:
        """Stop dockerd and remove every trace of it but the data root. Idempotent.

        Raises DockerDaemonError if processes or mounts could not be removed."""
        if self._client is not None:
            # Containers would get their stop timeout (10 s) at dockerd's shutdown;
            # test containers are disposable, so SIGKILL them first. (Only while
            # dockerd runs: the SDK leaks the socket of a refused connection.)
            if self.running:
                with contextlib.suppress(Exception):
                    for container in self._client.containers.list():
                        container.kill()
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        doomed = self.processes() if self.short_dir is not None else []
        self.stop_process()
        problems = []
        if self.short_dir is not None:
            left = self._kill_leftovers(doomed)
            if left:
                problems.append(f"processes left: {left}")
        roots = [self.data_root] + ([self.short_dir] if self.short_dir else [])
        left_mounts = self._unmount_all(roots)
        if left_mounts:
            problems.append(f"mounts left: {left_mounts}")
        self._remove_cgroups()
        if self.short_dir is not None:
            for sock in self.shim_sockets():  # a killed shim leaves its socket
                with contextlib.suppress(OSError):
                    sock.unlink()
        if self.short_dir is not None and not left_mounts:
            shutil.rmtree(self.short_dir, ignore_errors=True)
            self.short_dir = None
        for d in self._created_global_dirs:  # deepest first by GLOBAL_DIRS' order
            with contextlib.suppress(OSError):
                d.rmdir()
        self._created_global_dirs = []
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()
        if problems:
            raise DockerDaemonError("dockerd cleanup incomplete: " + "; ".join(problems))

    # -- processes ---------------------------------------------------------

    def _is_ours(self, pid: int) -> bool:
        """Does pid name our exec root (dockerd, containerd, shims) or sit in our cgroups?"""
        assert self.short_dir is not None
        if str(self.short_dir) in _read_text(f"/proc/{pid}/cmdline"):
            return True
        for line in _read_text(f"/proc/{pid}/cgroup").splitlines():
            path = line.split(":", 2)[-1]
            if _is_under(path, [self.cgroup_parent]):
                return True
        return False

    def processes(self) -> list[tuple[int, int, str]]:
        """(pid, starttime, command line) of dockerd and everything it started that is
        still alive: its descendants, processes naming our exec root (containerd,
        containerd-shim-runc-v2, which are re-parented to init) and processes in our
        cgroups (containers), plus their descendants."""
        if self.short_dir is None:
            return []
        stats = {pid: st for pid in _all_pids() if (st := _proc_stat(pid)) is not None}
        mine = _own_ancestors()
        seeds = {pid for pid in stats if pid not in mine and self._is_ours(pid)}
        if self.proc is not None and self.proc.poll() is None:
            seeds.add(self.proc.pid)
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        found: set[int] = set()
        todo = list(seeds)
        while todo:
            pid = todo.pop()
            if pid in found or pid in mine:
                continue
            found.add(pid)
            todo.extend(children.get(pid, []))
        return [(pid, stats[pid][2], _read_text(f"/proc/{pid}/cmdline").strip())
                for pid in sorted(found) if stats[pid][0] not in ("Z", "X")]

    def _kill_leftovers(self, doomed: list[tuple[int, int, str]]) -> list[str]:
        """SIGKILL what is left of doomed (checked by start time against pid reuse)
        and of a fresh scan; return descriptions of processes that survive 5 s."""
        targets = {pid: start for pid, start, _ in doomed}
        for pid, start, _ in self.processes():
            targets[pid] = start
        for pid, start in targets.items():
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while True:
            left = [pid for pid, start in targets.items() if _alive(pid, start)]
            if not left or time.monotonic() > deadline:
                return [f"{pid} {_read_text(f'/proc/{pid}/cmdline').strip()}" for pid in left]
            time.sleep(0.05)

    def shim_sockets(self) -> list[Path]:
        """Existing sockets of our containers' shims. containerd 1.6 puts them in
        /run/containerd/s/<sha256(containerd address/namespace/container id)>,
        whatever its state directory; a SIGKILLed shim leaves its socket there."""
        if self.short_dir is None:
            return []
        address = self.exec_root / "containerd" / "containerd.sock"
        try:
            ids = os.listdir(self.data_root / "containers")
        except OSError:
            return []
        found = []
        for cid in ids:
            digest = hashlib.sha256(f"{address}/moby/{cid}".encode()).hexdigest()
            sock = SHIM_SOCKET_DIR / digest
            if sock.is_socket():
                found.append(sock)
        return found

    # -- mounts and cgroups ------------------------------------------------

    @staticmethod
    def _unmount_all(roots: list[Path]) -> list[str]:
        """umount -l every mount under roots, deepest first; return what stays."""
        for _ in range(5):
            mounts = mounts_under(*roots)
            if not mounts:
                return []
            for mnt in sorted(set(mounts), key=lambda m: (m.count("/"), len(m)), reverse=True):
                subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
        return mounts_under(*roots)

    def _remove_cgroups(self) -> None:
        """rmdir our cgroup parent (and any empty children) in every hierarchy."""
        for mnt, fstype in _mountinfo():
            if fstype not in ("cgroup", "cgroup2"):
                continue
            top = Path(mnt + self.cgroup_parent)
            if not top.is_dir():
                continue
            dirs = [Path(dp) for dp, _, _ in os.walk(top)]
            for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()


# ---------------------------------------------------------------------------
# images


def _split_name(name: str) -> tuple[str, str]:
    """("repo", "tag") of "repo[:tag]" (a ":" before the last "/" is a registry port)."""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1:]
    return name, "latest"


def _json_lines(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        line = line.strip()
        if line:
            with contextlib.suppress(json.JSONDecodeError):
                obj = json.loads(line)
                if isinstance(obj, dict):
                    yield obj


def import_rootfs(daemon: DockerDaemon, rootfs_tar: Path, name: str, *,
                  changes: list[str] | None = None) -> str:
    """`docker import rootfs_tar name`: a one-layer image of a rootfs tar (plain,
    gzip, bzip2 or xz), tagged name ("repo[:tag]", tag defaults to latest).

    changes are Dockerfile instructions applied to the config, e.g.
    ["ENV PATH=/bin", 'CMD ["/bin/sh"]', "WORKDIR /"] (CMD, ENTRYPOINT, ENV,
    EXPOSE, ONBUILD, USER, VOLUME, WORKDIR). Returns the image id ("sha256:...")."""
    repo, tag = _split_name(name)
    result = daemon.client.api.import_image_from_file(
        str(rootfs_tar), repository=repo, tag=tag, changes=changes)
    text = result if isinstance(result, str) else json.dumps(result)
    for obj in _json_lines(text):
        if "error" in obj or "errorDetail" in obj:
            raise DockerDaemonError(f"import of {rootfs_tar} as {name} failed: {obj}")
    image_id: str = daemon.client.images.get(f"{repo}:{tag}").id
    return image_id


def build_image(daemon: DockerDaemon, context_dir: Path, tag: str, *,
                dockerfile: str = "Dockerfile", buildargs: dict[str, str] | None = None) -> str:
    """`docker build -t tag context_dir` with the classic builder, no network
    (network_mode="none"), no pulls, intermediate containers removed.

    FROM must name a local image (e.g. one made by import_rootfs). COPY/ADD
    and RUN both work (RUN containers get no network), so a Dockerfile like
    `FROM base` / `COPY d /d` / `RUN rm /etc/group && rm -r /d && mkdir /d`
    gives a multi-layer image with whiteouts and an opaque directory. Note that
    RUN steps cannot remove /etc/hostname, /etc/hosts or /etc/resolv.conf
    (bind-mounted by Docker). Returns the image id; raises DockerDaemonError
    with the build log on failure."""
    try:
        image, _logs = daemon.client.images.build(
            path=str(context_dir), tag=tag, dockerfile=dockerfile, buildargs=buildargs,
            network_mode="none", rm=True, forcerm=True, pull=False, use_config_proxy=False)
    except docker.errors.BuildError as e:
        log = "".join(str(chunk.get("stream") or chunk.get("error") or "")
                      for chunk in e.build_log)
        raise DockerDaemonError(f"docker build of {context_dir} failed: {e.msg}\n{log}") from e
    except docker.errors.APIError as e:  # e.g. no such Dockerfile
        raise DockerDaemonError(f"docker build of {context_dir} failed: {e}") from e
    image_id: str = image.id
    return image_id
