"""A real etcd (Debian's etcd-server, v3 API) on loopback (and an address
of the tests' own, for nodes in network namespaces: tests/helpers/netns.py), one member in a
temporary data directory, for the fleet tests and benchmarks: a
ServerProcess (one log, one startup timeout, the log's tail in errors, a
parent-death signal so a killed test run leaves no etcd behind).

    with EtcdServer(tmp_path / "etcd") as etcd:
        etcd.url                    # etcd://127.0.0.1:PORT (or HOST:PORT)
        etcd.kill(); etcd.start()   # down, then back with the same data
"""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import httpx

from runtime.errors import FleetUnavailable

from .process import ServerProcess
from .support import free_port


def etcd_missing() -> str | None:
    if shutil.which("etcd") is None:
        return "needs etcd (apt-get install etcd-server)"
    return None



class EtcdServer(ServerProcess):
    name = "etcd"
    error = FleetUnavailable

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1",
                 tls: tuple[Path, Path, Path] | None = None) -> None:
        """`host`: the address clients reach it at (netns.FleetNet's service
        address for nodes in network namespaces); it listens on loopback too.
        `tls`: (its certificate, key, the CA) to serve https (url etcds://)."""
        super().__init__(workdir / "etcd.log", startup_timeout=20, stop_grace=5)
        self.workdir = workdir
        self.host = host
        self.tls = tls
        self.scheme = "https" if tls else "http"
        self.client_port = free_port()
        self.peer_port = free_port()

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://{self.host}:{self.client_port}"

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        listen = {self.client_url, f"{self.scheme}://127.0.0.1:{self.client_port}"}
        # every caller must present a client certificate of the CA (etcd's
        # own gateway dials it with its server certificate, a node
        # certificate: clientAuth too); users and roles by password
        # (runtime.fleet.etcdauth)
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls[0]), "--key-file", str(self.tls[1]),
            "--client-cert-auth", "--trusted-ca-file", str(self.tls[2])]
        self.launch(["etcd", "--name", "test", "--data-dir", str(self.workdir / "data"), *tls,
                    "--listen-client-urls", ",".join(sorted(listen)),
                    "--advertise-client-urls", self.client_url,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"test={peer}",
                    "--listen-metrics-urls", "", "--log-level", "warn"],
                   cwd=self.workdir)

    def ready(self) -> bool:
        try:
            r = httpx.get(f"{self.client_url}/health", timeout=1.0,
                          verify=self._health_context() if self.tls else True)
        except httpx.HTTPError as e:
            self.last = str(e)
            return False
        self.last = r.text
        return r.status_code == 200 and '"true"' in r.text

    def _health_context(self) -> ssl.SSLContext:
        assert self.tls is not None
        ctx = ssl.create_default_context(cafile=str(self.tls[2]))
        ctx.load_cert_chain(str(self.tls[0]), str(self.tls[1]))  # (it asks for one)
        return ctx

    def kill(self) -> None:
        """SIGKILL, as a crash: the data directory stays for start()."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
