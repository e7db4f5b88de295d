"""A real SeaweedFS on loopback for tests and benchmarks, a ServerProcess
like the registry, dockerd and the node daemon: one log, one startup
timeout, the log's tail in its errors, a parent-death signal so a killed
test run leaves no server behind.

What SeaweedFS is to run as (ports, data directory, the `weed server`
command line, when its S3 gateway serves) is the package's
(chunkstore/seaweed.py), which `lazyfs seaweed` runs for users; this class
only runs it the tests' way.

    with SeaweedFS(tmp_path / "weed") as sw:
        url = sw.url("prefix")        # s3://lazyfs/prefix?endpoint=http://127.0.0.1:PORT
        sw.kill(); sw.start()         # a crash and a restart, same data
"""

from __future__ import annotations

import time
from pathlib import Path

from chunkstore import seaweed as _seaweed
from chunkstore.errors import ClusterServerError
from chunkstore.seaweed import weed_binary

from .process import ServerProcess

__all__ = ["SeaweedFS", "weed_binary"]

STOP_GRACE = 10.0


class SeaweedFS(ServerProcess):
    name = "SeaweedFS"
    error = ClusterServerError

    def __init__(self, workdir: Path, *, startup_timeout: float = _seaweed.STARTUP_TIMEOUT,
                 ip: str = "127.0.0.1", s3_identity: tuple[str, str] | None = None) -> None:
        """`ip`: the address it listens on (netns.FleetNet's service address
        for nodes in network namespaces); `s3_identity`: the one (access key,
        secret key) it accepts (None: any credentials)."""
        # its ports and paths; not started by it
        self.server = _seaweed.SeaweedFS(workdir, ip=ip, s3_identity=s3_identity)
        super().__init__(self.server.log, startup_timeout=startup_timeout,
                         stop_grace=STOP_GRACE)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def bucket_url(self, bucket: str) -> str:
        return self.server.bucket_url(bucket)

    def url(self, prefix: str, bucket: str = "lazyfs", *, filer: bool = False) -> str:
        return self.server.url(prefix, bucket, filer=filer)

    def store_url(self, prefix: str, bucket: str = "lazyfs", *, filer: bool = False) -> str:
        """url(prefix), its bucket made (S3 wants one before the first put)."""
        from chunkstore.objects import S3ObjectStore, open_object_store
        url = self.url(prefix, bucket, filer=filer)
        objects = open_object_store(url)
        assert isinstance(objects, S3ObjectStore)
        objects.ensure_bucket()
        return url

    def start(self) -> None:
        cmd = self.server.command()
        self.server.data.mkdir(parents=True, exist_ok=True)
        self.launch(cmd, cwd=self.server.workdir)

    def ready(self) -> bool:
        if not self.server.s3_ready():
            return False
        time.sleep(0.2)  # answered: make sure it was this weed, still alive
        return self.running

    def kill(self) -> None:
        """A crash: SIGKILL, no shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
