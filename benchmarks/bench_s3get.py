"""What one ranged GET costs a cluster node (every cold chunk it serves is
one), through the cluster store's read paths (chunkstore.objects: libcurl,
signed with botocore's SigV4 signer; or, with `filer=` in the URL, plain
GETs from SeaweedFS's filer HTTP API) against the same GET through the
boto3 client (what the read path was before), in one run.

A SeaweedFS on loopback (`weed server`, started here, with one S3 identity,
so every S3 request is signed and checked) holds one 64 MiB pack object;
each variant makes --gets ranged GETs of --size bytes at spread offsets (a
chunk record of the dev image is ~40 KB on average), alternating between
the variants in batches of 50.

Per variant: wall time per GET (p50, p90, p99) and this process's CPU per
GET (the server's is not counted).

    python -m benchmarks.bench_s3get [--quick] [--gets N] [--size BYTES]

Prints a table and writes benchmarks/results/s3get.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report import (
    RESULTS,
    add_run_options,
    apply_profile,
    f2,
    log,
    machine_info,
    summary,
    table,
    write_json,
)
from chunkstore.objects import S3ObjectStore, open_object_store
from tests.helpers.seaweed import SeaweedFS

QUICK = {"gets": 400}
FULL = {"gets": 3000}
PACK = 64 << 20
BATCH = 50


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gets", type=int, default=None, help="GETs per variant")
    p.add_argument("--size", type=int, default=40_000, help="bytes per GET")
    add_run_options(p, RESULTS / "s3get.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    work = Path(tempfile.mkdtemp(prefix="bench-s3get-", dir="/var/tmp"))
    identity = ("bench-s3get", "bench-secret")
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = identity
    try:
        with SeaweedFS(work / "weed", s3_identity=identity) as server:
            results = run(args, server)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["machine"] = machine_info(Path("/var/tmp"))
    write_json(args.json, results)
    log(f"wrote {args.json}")


def run(args: argparse.Namespace, server: SeaweedFS) -> dict[str, Any]:
    data = os.urandom(PACK)
    store = open_object_store(server.store_url("bench"))
    assert isinstance(store, S3ObjectStore)
    store.put("packs/p.pack", data)
    size = args.size
    offsets = [(i * 7_919_111) % (PACK - size) for i in range(args.gets)]

    def lazyfs_get(off: int) -> bytes:
        return store.get_range("packs/p.pack", off, size)

    filer = open_object_store(server.url("bench", filer=True))

    def filer_get(off: int) -> bytes:
        return filer.get_range("packs/p.pack", off, size)

    def boto3_get(off: int) -> bytes:
        r = store.client.get_object(Bucket=store.bucket, Key=store.prefix + "packs/p.pack",
                                    Range=f"bytes={off}-{off + size - 1}")
        body: bytes = r["Body"].read()
        return body

    variants: dict[str, Callable[[int], bytes]] = {
        "lazyfs, S3 (libcurl + SigV4)": lazyfs_get, "boto3 client get_object": boto3_get,
        "lazyfs, filer= (libcurl)": filer_get}
    walls: dict[str, list[float]] = {v: [] for v in variants}
    cpus: dict[str, float] = dict.fromkeys(variants, 0.0)
    for fn in variants.values():  # connections up, code paths warm
        for off in offsets[:20]:
            fn(off)
    log(f"{args.gets} GETs of {size:,} bytes per variant, alternating in batches of {BATCH}")
    for start in range(0, len(offsets), BATCH):
        for name, fn in variants.items():
            c0 = time.process_time()
            for off in offsets[start:start + BATCH]:
                t0 = time.perf_counter()
                got = fn(off)
                walls[name].append(time.perf_counter() - t0)
                if got != data[off:off + size]:
                    raise SystemExit(f"{name}: wrong bytes at offset {off}")
            cpus[name] += time.process_time() - c0
    store.close()
    filer.close()
    rows = []
    out: dict[str, Any] = {"gets": args.gets, "size": size, "variants": {}}
    base = summary(walls["boto3 client get_object"])
    for name in variants:
        s = summary(walls[name])
        cpu_ms = cpus[name] / len(walls[name]) * 1e3
        out["variants"][name] = {"wall_s": s, "cpu_ms_per_get": cpu_ms}
        rows.append([name, f2(s["p50"] * 1e3), f2(s["p90"] * 1e3), f2(s["p99"] * 1e3),
                     f2(cpu_ms), f2(s["p50"] / base["p50"])])
    print(table(f"ranged S3 GET of {size:,} bytes from SeaweedFS on loopback ({args.gets} each)",
                ["path", "p50 ms", "p90 ms", "p99 ms", "CPU ms/GET", "p50 / boto3"], rows,
                notes=["CPU: this process's (the client's); the server's is not counted"]))
    return out


if __name__ == "__main__":
    main()
