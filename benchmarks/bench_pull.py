"""Registry pull: `lazyfs convert registry://…` against the Docker engine
pulling the same image from the same local registry, in the same run.

Image: the Debian bookworm minbase rootfs cached by the tests
(/var/cache/lazyfs-tests/debian-minbase, made by debootstrap; built here if
missing), pushed as one gzip layer to a Debian `docker-registry` on loopback.

lazyfs side: a fresh chunk store, convert (download, gunzip, untar, chunk,
compress, index) and close. Docker side: a private dockerd (overlay2), `pull`
(download, gunzip, extract into the storage driver) and, to match what a
sandbox start needs, `create` of a container (no run). Both sides end with
`sync` inside the timing, so the bytes are on disk. Bytes written are read
from /proc/diskstats of the device holding the work directory (noisy: the
machine's other writers count too; both sides are measured the same way).
A second conversion of the same image into the same store shows dedup (a
registry pull of an image already present is a no-op for Docker too).

Prints a table and writes benchmarks/results/pull.json. Needs root,
docker.io, docker-registry and debootstrap (install.sh installs them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.host import disk_written
from benchmarks.report import machine_info, write_json
from chunkstore import ChunkStore
from composer.convert import convert
from lazyfs.node import store_catalog
from tests.helpers.dockerd import DockerDaemon
from tests.helpers.images import tar_of
from tests.helpers.registry import Registry, push_image

ROOT = Path(__file__).resolve().parent.parent

CACHE = Path("/var/cache/lazyfs-tests/debian-minbase")


def _timed(fn: Any, where: Path) -> tuple[float, int]:
    os.sync()
    w0, t0 = disk_written(where), time.perf_counter()
    fn()
    os.sync()
    return time.perf_counter() - t0, disk_written(where) - w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs per side (best shown)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/pull.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_pull.py needs root (dockerd, debootstrap)")
    if not (CACHE / "usr/bin/dpkg").exists():
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(CACHE)], check=True)
    work = Path(tempfile.mkdtemp(prefix="bench-pull-", dir=args.workdir))
    rows: list[dict[str, Any]] = []
    try:
        layer = tar_of(CACHE, work / "debian.tar.gz", compression="gzip")
        plain_bytes = int(subprocess.run(["gzip", "-l", "-q", str(layer)], check=True,
                                         capture_output=True, text=True).stdout.split()[1])
        gz_bytes = layer.stat().st_size
        with Registry(work / "reg") as reg:
            push_image(reg, "debian", "minbase", [layer], {"Cmd": ["/bin/bash"]},
                       media="docker")
            ref = f"{reg.host}/debian:minbase"
            for r in range(args.repeats):
                store_dir = work / f"store{r}"

                def lazy(store_dir: Path = store_dir) -> None:
                    with ChunkStore.open(store_dir) as s, store_catalog(s) as c:
                        convert(s, c, f"registry://{ref}", "debian:minbase")
                secs, wrote = _timed(lazy, work)
                with ChunkStore.open(store_dir) as s:
                    stored = s.stats().pack_bytes

                def again(store_dir: Path = store_dir) -> None:
                    with ChunkStore.open(store_dir) as s, store_catalog(s) as c:
                        convert(s, c, f"registry://{ref}", "debian:again")
                secs2, wrote2 = _timed(again, work)
                rows.append({"side": "lazyfs convert", "run": r, "seconds": secs,
                             "disk_written": wrote, "stored": stored,
                             "again_seconds": secs2, "again_written": wrote2})
                shutil.rmtree(store_dir)

                with DockerDaemon(work / f"docker{r}") as d:
                    def pull() -> None:
                        d.client.images.pull(ref)
                        d.client.containers.create(ref, "/bin/true", network_mode="none")
                    secs, wrote = _timed(pull, work)
                    du = int(subprocess.run(["du", "-sb", str(d.data_root)], check=True,
                                            capture_output=True, text=True).stdout.split()[0])
                    secs2, wrote2 = _timed(lambda: d.client.images.pull(ref), work)
                    rows.append({"side": "docker pull + create", "run": r, "seconds": secs,
                                 "disk_written": wrote, "stored": du,
                                 "again_seconds": secs2, "again_written": wrote2,
                                 "driver": d.storage_driver})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def best(side: str) -> dict[str, Any]:
        return min((r for r in rows if r["side"] == side), key=lambda r: r["seconds"])
    lz, dk = best("lazyfs convert"), best("docker pull + create")
    lines = [(f"image: Debian bookworm minbase, one gzip layer, {plain_bytes / 1e6:.0f} MB "
              f"uncompressed, {gz_bytes / 1e6:.0f} MB gzip; best of {args.repeats}"),
             (f"{'side':24s} {'seconds':>8s} {'MB/s':>7s} {'disk MB':>8s} {'kept MB':>8s} "
              f"{'again s':>8s}")]
    for row in (lz, dk):
        lines.append(f"{row['side']:24s} {row['seconds']:8.2f} "
                     f"{plain_bytes / row['seconds'] / 1e6:7.0f} "
                     f"{row['disk_written'] / 1e6:8.0f} {row['stored'] / 1e6:8.0f} "
                     f"{row['again_seconds']:8.2f}")
    lines.append(f"ratio (docker time / lazyfs time): {dk['seconds'] / lz['seconds']:.2f}; "
                 f"disk written lazyfs/docker: {lz['disk_written'] / max(1, dk['disk_written']):.2f}; "
                 f"kept on disk lazyfs/docker: {lz['stored'] / max(1, dk['stored']):.2f}")
    text = "\n".join(lines)
    print(text)
    write_json(args.json, {
        "benchmark": "pull", "timestamp": time.time(), "machine": machine_info(args.workdir),
        "image_plain_bytes": plain_bytes, "rows": rows, "table": text})


if __name__ == "__main__":
    main()
