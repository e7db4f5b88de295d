"""One sandbox start of the burst benchmark (bench_burst.py runs N at once).

    python -m benchmarks.burst_worker lazy  CLUSTER_URL NODE_ROOT IMAGE WORKDIR CMD
    python -m benchmarks.burst_worker eager CLUSTER_URL -         IMAGE WORKDIR CMD

lazy:  compose the image's root from the node daemon's lazy layers (overlayfs,
       a writable upper of its own), run CMD in it with chroot, unmount.
eager: download every chunk of the image from the cluster store and extract
       the whole tree into WORKDIR (what a registry pull + unpack does), run
       CMD in it with chroot, remove the tree.
Prints one JSON line: start/end wall times, CMD's output and exit code,
bytes this worker read from the cluster store.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from composer.export import export_tree
from lazyfs.mounts import mount_image, unmount
from lazyfs.node import NodePaths, open_images


def main() -> None:
    mode, url, node_root, image, workdir, cmd = sys.argv[1:7]
    t0 = time.time()
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, object] = {"mode": mode, "start": t0}
    with open_images(None, url) as (catalog, reader):  # the cluster's, as a node reads it
        if mode == "lazy":
            paths = NodePaths(Path(node_root))
            mp = work / "root"
            mp.mkdir(exist_ok=True)
            mount_image(paths, catalog, image, mp, writable=work / "rw")
            try:
                p = subprocess.run(["chroot", str(mp), "/bin/sh", "-c", cmd],
                                   capture_output=True, text=True, timeout=600, check=False)
            finally:
                unmount(paths, mp, lazy=True)
        else:
            _, img = catalog.resolve(image)
            tree = work / "tree"
            export_tree(reader, [catalog.load_layer(d) for d in img.layers],  # type: ignore[arg-type]
                        tree)
            p = subprocess.run(["chroot", str(tree), "/bin/sh", "-c", cmd],
                               capture_output=True, text=True, timeout=600, check=False)
        out["store_bytes"] = reader.stats.bytes_read  # type: ignore[attr-defined]
    out["end"] = time.time()
    out["rc"] = p.returncode
    out["output"] = p.stdout.strip()[-200:]
    out["stderr"] = p.stderr.strip()[-300:]
    print(json.dumps(out), flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
