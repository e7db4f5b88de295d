"""Network allowlists for container sandboxes: the sandbox gets its own network
namespace with a veth pair to the host, and an nftables table *inside that
namespace*: outgoing, loopback, replies and the allowed destinations are
accepted and everything else rejected (reject, not drop: a denied connect
fails at once instead of hanging the agent's tool until its timeout);
incoming, only replies and loopback (a sandbox cannot serve another one).

The rules live in the sandbox's namespace, which its processes cannot change
(no CAP_NET_ADMIN). Reaching addresses beyond this host needs the operator's
forwarding/NAT for 10.203.0.0/16; the node's own side of the veth (the
sandbox's `node_address`, SandboxInfo.host_address; a rule names it `node`)
works as is, the usual shape: a package mirror or proxy on the node.

Each sandbox holds one /30 slot, claimed by creating the slot's file
exclusively in a directory shared by every runtime on the host; the
namespace and interface names derive from the slot, so two sandboxes never
share a name and removing one never touches another's. Before each claim the
slot tried is written to SLOT_DIR/.by-sandbox/<id>, so finding a sandbox's
slot (after a creation cut short) reads two files, not every slot's.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import subprocess
from pathlib import Path

from ..errors import BackendUnavailable, QuotaExceeded
from ..spec import NODE, NetworkPolicy

NETWORK = ipaddress.ip_network("10.203.0.0/16")
SLOTS = NETWORK.num_addresses // 4 - 1
SLOT_DIR = Path("/run/lazyfs-netslots")
NETNS_DIR = Path("/run/netns")
TABLE = "lazyfs_sandbox"
REFUSED_SETS = (("refused4", "ipv4_addr"), ("refused6", "ipv6_addr"))
REFUSED_SET_SIZE = 256  # destinations recorded per sandbox (each with a counter)


def names(slot: int) -> tuple[str, str]:
    """(network namespace, host-side interface) of a slot."""
    return f"lzsb-{slot}", f"lzsb{slot}h"


def addresses(slot: int) -> tuple[str, str]:
    """(host side, sandbox side) addresses of a slot's /30."""
    base = int(NETWORK.network_address) + 4 * slot
    return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))


def _record(sandbox_id: str, slots: Path) -> Path:
    return slots / ".by-sandbox" / sandbox_id


def allocate(sandbox_id: str, slots: Path = SLOT_DIR) -> int:
    """A free slot for the sandbox (probing from the id's hash)."""
    slots.mkdir(parents=True, exist_ok=True)
    record = _record(sandbox_id, slots)
    record.parent.mkdir(exist_ok=True)
    start = int(hashlib.blake2s(sandbox_id.encode(), digest_size=4).hexdigest(), 16)
    for i in range(SLOTS):
        slot = (start + i) % SLOTS + 1
        record.write_text(str(slot))  # before the claim: a crash leaves it naming the slot
        try:
            fd = os.open(slots / str(slot), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        os.write(fd, sandbox_id.encode())
        os.close(fd)
        return slot
    record.unlink(missing_ok=True)
    raise QuotaExceeded(f"all {SLOTS} sandbox networks of {NETWORK} are in use")


def slots_of(sandbox_id: str, slots: Path = SLOT_DIR) -> list[int]:
    """Slots claimed for a sandbox (to clean up after a creation cut short):
    the one its record names, if that slot's file names the sandbox. A
    record naming a slot it never got (the claim cut short) is removed."""
    record = _record(sandbox_id, slots)
    try:
        slot = int(record.read_text())
    except (OSError, ValueError):
        return []
    try:
        if (slots / str(slot)).read_text() == sandbox_id:
            return [slot]
    except OSError:
        pass
    record.unlink(missing_ok=True)
    return []


def _run(*cmd: str, stdin: str | None = None) -> None:
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise BackendUnavailable(f"{' '.join(cmd[:4])}… failed: {p.stderr.strip()[-300:]}")


def ruleset(policy: NetworkPolicy, node_address: str) -> str:
    """The nftables table of a sandbox whose node side is `node_address`
    (what a `node` rule allows)."""
    # Replies are accepted per rule (not for any established connection), so
    # when the policy changes (set_network) a connection opened under the
    # old one to a destination the new one refuses is cut both ways.
    ins, outs = [], []
    for r in policy.allow:
        cidr = f"{node_address}/32" if r.cidr == NODE else r.cidr
        fam = "ip" if ipaddress.ip_network(cidr).version == 4 else "ip6"
        dport = f" {r.protocol} dport {r.port}" if r.port else f" meta l4proto {r.protocol}"
        sport = f" {r.protocol} sport {r.port}" if r.port else f" meta l4proto {r.protocol}"
        outs.append(f"  {fam} daddr {cidr}{dport} accept")
        ins.append(f"  {fam} saddr {cidr}{sport} ct state established,related accept")
    lines = ["table inet lazyfs_sandbox {",
             *(f" set {name} {{ type {addr} . inet_proto . inet_service; flags dynamic; "
               f"size {REFUSED_SET_SIZE}; counter; }}" for name, addr in REFUSED_SETS),
             " chain in {", "  type filter hook input priority 0; policy drop;",
             '  iifname "lo" accept',
             "  meta l4proto { icmp, ipv6-icmp } ct state related accept", *ins, " }",
             " chain out {", "  type filter hook output priority 0; policy drop;",
             '  oifname "lo" accept', *outs]
    # each refused destination is counted (denials.py reads the sets)
    lines += [f"  meta l4proto {{ tcp, udp }} update @{name} {{ {fam} daddr . meta l4proto . "
              f"th dport }}" for (name, _), fam in zip(REFUSED_SETS, ("ip", "ip6"), strict=True)]
    lines += ["  meta l4proto tcp reject with tcp reset", "  reject", " }", "}"]
    return "\n".join(lines) + "\n"


def create(slot: int, policy: NetworkPolicy, pid: int) -> Path:
    """The slot's name for the network namespace of process `pid` (the
    sandbox's init: the namespace belongs to the sandbox's user namespace, so
    the kernel lets its sysfs be mounted there), its veth pair, addresses,
    route and rules; undone on failure. The sandbox runs no command before
    this returns (the node asks for none until create is done)."""
    ns, host_if = names(slot)
    host_ip, sb_ip = addresses(slot)
    try:
        _run("ip", "netns", "attach", ns, str(pid))
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "-n", ns, "addr", "add", f"{sb_ip}/30", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", host_ip)
        _run("ip", "netns", "exec", ns, "nft", "-f", "-", stdin=ruleset(policy, host_ip))
    except BaseException:
        remove(slot, release=False)
        raise
    return NETNS_DIR / ns


def apply(slot: int, policy: NetworkPolicy) -> None:
    """Replace the rules of the slot's sandbox by `policy`'s, in one nftables
    transaction (no moment without rules); mode none keeps the interface
    and refuses everything but loopback. The refused-destination counts
    start again from zero (read them first)."""
    ns, _ = names(slot)
    allow = policy.allow if policy.mode == "allowlist" else ()
    rules = ruleset(NetworkPolicy(mode="allowlist", allow=allow), addresses(slot)[0])
    _run("ip", "netns", "exec", ns, "nft", "-f", "-",
         stdin=f"table inet {TABLE} {{}}\ndelete table inet {TABLE}\n{rules}")


def refused(slot: int) -> dict[str, int]:
    """Refused destinations of the slot's sandbox so far, `ADDR:PORT/PROTO`
    -> packets refused (a refused TCP connect is one, its retries more)."""
    ns, _ = names(slot)
    p = subprocess.run(["ip", "netns", "exec", ns, "nft", "-j", "list", "table", "inet", TABLE],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        return {}
    out: dict[str, int] = {}
    for item in json.loads(p.stdout).get("nftables", []):
        for elem in (item.get("set") or {}).get("elem", []):
            e = elem.get("elem", {}) if isinstance(elem, dict) else {}
            addr, proto, port = e.get("val", {}).get("concat", ("?", "?", 0))
            host = f"[{addr}]" if ":" in str(addr) else addr
            out[f"{host}:{port}/{proto}"] = int(e.get("counter", {}).get("packets", 0))
    return out


def remove(slot: int, *, release: bool = True, slots: Path = SLOT_DIR) -> None:
    ns, host_if = names(slot)
    subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    if release:
        f = slots / str(slot)
        try:
            owner = f.read_text()
        except OSError:
            owner = ""
        f.unlink(missing_ok=True)
        if owner and "/" not in owner:
            _record(owner, slots).unlink(missing_ok=True)
