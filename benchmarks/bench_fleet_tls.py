"""What the fleet's TLS costs a create: a fleet of one node agent serving
plain HTTP with a token (`--insecure`) against one serving HTTPS with
client certificates (`--tls-dir`, runtime/fleet/ca.py), same run, same
image, each with its own etcd:

    python -m benchmarks.bench_fleet_tls [--quick] [--rounds 40] [--json PATH]

Per side, alternating per round so drift hits both:
    warm   Sandbox.create(fleet=...) + kill through the process's kept
           connections (what a trainer's steady state is)
    cold   the same with the process's connections dropped first, so each
           create makes a new connection (and, with TLS, a full handshake
           with both certificates checked)
and placements per second: creates (+ kill) one after another for a fixed
time, warm. Target: TLS costs at most 10 % of a create. Needs root, etcd.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.report import add_run_options, apply_profile, log, machine_info, table, write_json

ROOT = Path(__file__).resolve().parent.parent
QUICK = {"rounds": 8, "seconds": 3.0}
FULL = {"rounds": 40, "seconds": 15.0}
TOKEN = "bench-fleet-tls"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--seconds", type=float, default=None)
    add_run_options(p, ROOT / "benchmarks/results/fleet_tls.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    import os

    from runtime import Sandbox
    from runtime.client import transport
    from runtime.fleet import client as fleet_client_module
    from runtime.fleet.ca import FleetCA
    from runtime.fleet.client import read_nodes
    from runtime.fleet.etcd import Etcd
    from tests.helpers.agents import fleet_agent
    from tests.helpers.etcd import EtcdServer
    from tests.helpers.sandboxes import IMAGE
    from tests.helpers.support import wait_until

    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-tls-") as tmp, ExitStack() as stack:
        d = Path(tmp)
        out["machine"] = machine_info(d)
        ca = FleetCA.init(d / "ca")
        node = ca.issue_node("t1", d / "t1-identity")
        caller = ca.issue_client("bench", d / "caller")
        fleets = {}
        for side, node_id, extra in (("plain", "p1", []),
                                     ("tls", "t1", ["--tls-dir", str(node.dir)])):
            etcd = stack.enter_context(EtcdServer(d / f"etcd-{side}"))
            agent = fleet_agent(d / side, etcd.url, node_id, stack, token=TOKEN,
                                max_sandboxes=50, extra=extra)
            agent.start()
            e = Etcd(etcd.url)

            def registered(e: Etcd = e) -> bool:
                return len(read_nodes(e)) == 1

            wait_until(registered, 30, f"the {side} node")
            e.close()
            fleets[side] = etcd.url

        def use(side: str) -> None:
            if side == "tls":
                os.environ["LAZYFS_TLS_DIR"] = str(caller.dir)
            else:
                os.environ.pop("LAZYFS_TLS_DIR", None)

        def drop() -> None:
            transport._close_clients()
            fleet_client_module._close_fleets()

        def one(side: str, cold: bool) -> float:
            use(side)
            if cold:
                drop()
            t0 = time.perf_counter()
            sb = Sandbox.create(IMAGE, fleet=fleets[side], token=TOKEN)
            dt = time.perf_counter() - t0
            sb.kill()
            return dt

        for side in fleets:  # (first use: images mapped, pools made)
            drop()
            one(side, False)
        times: dict[str, dict[str, list[float]]] = {s: {"warm": [], "cold": []} for s in fleets}
        for i in range(args.rounds):
            order = ("plain", "tls") if i % 2 == 0 else ("tls", "plain")
            for kind in ("warm", "cold"):
                for side in order:
                    if kind == "warm":
                        use(side)
                        drop()
                        one(side, False)  # (a connection made, then kept)
                    times[side][kind].append(one(side, kind == "cold"))
        log("latencies measured")
        rate: dict[str, float] = {}
        for side in ("plain", "tls", "plain", "tls"):
            use(side)
            drop()
            one(side, False)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < args.seconds / 2:
                one(side, False)
                n += 1
            rate[side] = rate.get(side, 0.0) + n / (time.perf_counter() - t0) / 2
        drop()
        os.environ.pop("LAZYFS_TLS_DIR", None)

    res: dict[str, Any] = {}
    rows = []
    for kind in ("warm", "cold"):
        p50 = {s: statistics.median(times[s][kind]) * 1e3 for s in times}
        p90 = {s: sorted(times[s][kind])[int(0.9 * (len(times[s][kind]) - 1))] * 1e3
               for s in times}
        res[kind] = {"p50_ms": p50, "p90_ms": p90, "tls_over_plain_p50": p50["tls"] / p50["plain"]}
        rows.append([kind, f"{p50['plain']:.1f}", f"{p50['tls']:.1f}",
                     f"{p50['tls'] / p50['plain']:.3f}x", f"{p90['plain']:.1f}",
                     f"{p90['tls']:.1f}"])
    res["creates_per_s"] = rate
    out["results"] = res
    print(table(f"fleet create latency, plain HTTP + token vs HTTPS + client certificates "
                f"(ms; {args.rounds} rounds)",
                ["connections", "plain p50", "tls p50", "tls/plain", "plain p90", "tls p90"],
                rows, [(f"creates (+ kill) per second, one client, warm: plain "
                       f"{rate['plain']:.1f}, tls {rate['tls']:.1f}")]))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
