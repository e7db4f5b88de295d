"""What `runc run` costs a container sandbox, and how much of it is our
configuration: the OCI config the container backend writes
(runtime/isolation/oci.py: user namespace, hook, seccomp, masks, cgroup
binds) against the same config with parts taken out, down to runc's own
default spec (`runc spec`), each run starting a container whose process
exits at once.

    python -m benchmarks.bench_runc [--runs 20] [--json PATH]

--runs rounds, each starting one container of every variant in turn (so
a machine's drift hits them all alike): `runc run` timed (wall) and its CPU
(the children's rusage: runc, runc init, the hook), then `runc delete`
(not timed). The root is a copy of the tests' busybox tree (owned by
the sandbox's host ids when a user namespace is used), so no lazyfs mount
is in the figure. Writes benchmarks/results/runc.json. Needs root and runc.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report import log, machine_info, table, write_json

ROOT = Path(__file__).resolve().parent.parent
Config = dict[str, Any]


def _without_user_namespace(c: Config) -> None:
    c["linux"]["namespaces"] = [n for n in c["linux"]["namespaces"] if n["type"] != "user"]
    c["linux"].pop("uidMappings", None)
    c["linux"].pop("gidMappings", None)
    c.pop("hooks", None)  # (the hook sets the user namespace's budgets)


def _without_masks(c: Config) -> None:
    c["linux"]["maskedPaths"], c["linux"]["readonlyPaths"] = [], []
    c["mounts"] = [m for m in c["mounts"] if not m["source"].endswith("/empty")]


def _only_proc_dev(c: Config) -> None:
    c["mounts"] = [m for m in c["mounts"] if m["destination"] in ("/proc", "/dev")
                   or m["destination"].endswith(".sandbox-init")]


VARIANTS: list[tuple[str, list[Callable[[Config], None]]]] = [
    ("the backend's config", []),
    ("no createContainer hook", [lambda c: c.pop("hooks", None)]),
    ("no seccomp", [lambda c: c["linux"].pop("seccomp", None)]),
    ("no user namespace", [_without_user_namespace]),
    ("no masked or read-only paths", [_without_masks]),
    ("all of these out, /proc and /dev only", [
        lambda c: c["linux"].pop("seccomp", None), _without_user_namespace, _without_masks,
        _only_proc_dev]),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/runc.json")
    args = p.parse_args()
    from runtime.isolation import cgroups, hostlimits, idmap, oci
    from runtime.native import sandbox_init
    from runtime.spec import SandboxSpec
    from tests.helpers.images import build_busybox_rootfs

    runc = shutil.which("runc")
    if runc is None:
        raise SystemExit("bench_runc: needs runc (apt-get install runc)")
    out: dict[str, Any] = {"args": {"runs": args.runs},
                           "runc": subprocess.run([runc, "--version"], capture_output=True,
                                                  text=True, check=True).stdout.splitlines()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-runc-", dir="/var/tmp") as tmp:
        d = Path(tmp)
        d.chmod(0o711)  # (the sandbox's host ids look names up in it: its root is in it)
        out["machine"] = machine_info(d)
        ids = idmap.IdRange.of_base(idmap.FIRST + 4093 * idmap.RANGE)  # (a range no node uses)
        rootfs = build_busybox_rootfs(d / "rootfs")
        (rootfs / "dev").mkdir(exist_ok=True)
        subprocess.run(["chown", "-R", f"{ids.base}:{ids.base}", str(rootfs)], check=True)
        node_dir = d / "node"
        node_dir.mkdir()
        oci.make_node_dirs(node_dir)
        init = sandbox_init(d / "cache")
        shutil.copy(init, node_dir / init.name)
        state = d / "state"

        def once(k: int, i: int, name: str, make: Callable[[str], Config]
                 ) -> tuple[float, float]:
            """One container of variant k: (wall s, CPU s) of its `runc run`."""
            sid = f"bench-runc-{k}-{i}"
            bundle = d / "bundles" / sid
            bundle.mkdir(parents=True)
            (bundle / "config.json").write_text(json.dumps(make(sid)))
            groups = [cgroups.path(h, sid) for h in cgroups.v1_hierarchies()]
            for g in groups:  # (the config binds them: they exist before runc runs)
                g.mkdir(parents=True, exist_ok=True)
            try:
                r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                t = time.perf_counter()
                p = subprocess.run([runc, "--root", str(state), "run", "--bundle",
                                    str(bundle), sid], capture_output=True, text=True,
                                   check=False, timeout=60)
                wall = time.perf_counter() - t
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            finally:  # (whatever happened: no container, group or bundle left)
                subprocess.run([runc, "--root", str(state), "delete", "--force", sid],
                               capture_output=True, check=False)
                for g in groups:
                    with contextlib.suppress(OSError):
                        g.rmdir()
                shutil.rmtree(bundle)
            if p.returncode != 0:
                raise SystemExit(f"bench_runc: {name}: runc run failed: "
                                 f"{p.stderr.strip()[-300:]}")
            return wall, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime

        def ours(sid: str, edits: list[Callable[[Config], None]]) -> Config:
            c = copy.deepcopy(oci.config(sid, SandboxSpec(image="bench"), rootfs,
                                         node_dir / init.name, ids, None, node_dir,
                                         hostlimits.Budgets()))
            c["process"]["args"] = [oci.INIT_PATH, "exec", "--", "/bin/true"]
            for e in edits:
                e(c)
            return c

        def default_spec(sid: str) -> Config:
            spec = d / "spec"
            if not (spec / "config.json").exists():
                spec.mkdir(exist_ok=True)
                subprocess.run([runc, "spec"], cwd=spec, check=True)
            c: Config = json.loads((spec / "config.json").read_text())
            c["root"] = {"path": str(rootfs), "readonly": True}
            c["process"]["terminal"] = False
            c["process"]["args"] = ["/bin/true"]
            c["linux"]["cgroupsPath"] = cgroups.cgroups_path(sid)
            return c

        makers: list[tuple[str, Callable[[str], Config]]] = [
            (name, lambda sid, e=edits: ours(sid, e))
            for name, edits in VARIANTS] + [("runc's default spec", default_spec)]
        samples: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n, _ in makers}
        for i in range(args.runs):  # the variants in turn, so drift hits them all alike
            for k, (name, make) in enumerate(makers):
                w, c = once(k, i, name, make)
                samples[name][0].append(w)
                samples[name][1].append(c)
        variants = {name: {"wall_ms_p50": statistics.median(w) * 1e3,
                           "cpu_ms_mean": statistics.fmean(c) * 1e3}
                    for name, (w, c) in samples.items()}
        out["variants"] = variants
        log(f"variants: {variants}")
    base = variants["the backend's config"]
    print(table(f"`runc run` of a container that exits at once, {args.runs} runs each",
                ["config", "wall p50 ms", "CPU ms", "CPU / ours"],
                [[k, f"{v['wall_ms_p50']:.1f}", f"{v['cpu_ms_mean']:.1f}",
                  f"{v['cpu_ms_mean'] / base['cpu_ms_mean']:.2f}"] for k, v in variants.items()]))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
