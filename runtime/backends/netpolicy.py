"""Network allowlists for sandboxes: the sandbox gets its own network
namespace with a veth pair to the host, and an nftables table *inside that
namespace*: outgoing, loopback, replies and the allowed destinations are
accepted and everything else rejected (reject, not drop: a denied connect
fails at once instead of hanging the agent's tool until its timeout);
incoming, only replies and loopback (a sandbox cannot serve another one).

Containers: the namespace is the sandbox's own (its processes' sockets are
in it), the rules filter its input and output. VMs (microvm, vm): the
namespace is made here and the VMM runs in it; it holds a tap device
(GUEST_IF) for the guest's NIC on a fixed link (GUEST_ADDRESS, gateway
GUEST_GATEWAY: the same in every VM, the namespace is private), the guest's
packets are *forwarded* between the tap and the veth, so the same rules
filter the forward hook, and leave masqueraded as the sandbox's address:
seen from the host a VM's traffic is a container's. The namespace itself
accepts nothing but loopback (the guest cannot reach its gateway's
services, there are none).

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
NAT_TABLE = "lazyfs_sandbox_nat"
GUEST_IF = "tap0"  # a VM's NIC, in the VM's namespace
# the guest's link (169.254/16: link-local, never a destination worth allowing)
GUEST_GATEWAY, GUEST_ADDRESS, GUEST_PREFIX = "169.254.203.1", "169.254.203.2", 30
GUEST_LINK = f"{GUEST_ADDRESS}/{GUEST_PREFIX},{GUEST_GATEWAY}"  # the guest's lazyfs.net=


def names(slot: int) -> tuple[str, str]:
    """(network namespace, host-side interface) of a slot."""
    return f"lzsb-{slot}", f"lzsb{slot}h"


def addresses(slot: int) -> tuple[str, str]:
    """(host side, sandbox side) addresses of a slot's /30."""
    base = int(NETWORK.network_address) + 4 * slot
    return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))


def guest_mac(slot: int) -> str:
    """The MAC address of the NIC of the VM in a slot (locally administered)."""
    return f"52:54:00:cb:{slot >> 8 & 0xff:02x}:{slot & 0xff:02x}"


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


def ruleset(policy: NetworkPolicy, node_address: str, guest_if: str | None = None) -> str:
    """The nftables table of a sandbox whose node side is `node_address`
    (what a `node` rule allows). `guest_if`: a VM's tap; the rules then
    filter what is forwarded from and to it, and the namespace itself
    sends only to the guest (the rejects) and accepts only loopback."""
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
               f"size {REFUSED_SET_SIZE}; counter; }}" for name, addr in REFUSED_SETS)]
    related = "  meta l4proto { icmp, ipv6-icmp } ct state related accept"
    if guest_if is None:
        lines += [" chain in {", "  type filter hook input priority 0; policy drop;",
                  '  iifname "lo" accept', related, *ins, " }",
                  " chain out {", "  type filter hook output priority 0; policy drop;",
                  '  oifname "lo" accept', *outs]
    else:
        lines += [" chain in {", "  type filter hook input priority 0; policy drop;",
                  '  iifname "lo" accept', " }",
                  " chain out {", "  type filter hook output priority 0; policy drop;",
                  f'  oifname {{ "lo", "{guest_if}" }} accept', " }",
                  " chain to_guest {", *ins, related,
                  "  drop", " }",
                  " chain from_guest {", "  type filter hook forward priority 0; policy drop;",
                  f'  oifname "{guest_if}" jump to_guest',
                  f'  iifname != "{guest_if}" drop', *outs]
    # each refused destination is counted (denials.py reads the sets)
    lines += [f"  meta l4proto {{ tcp, udp }} update @{name} {{ {fam} daddr . meta l4proto . "
              f"th dport }}" for (name, _), fam in zip(REFUSED_SETS, ("ip", "ip6"), strict=True)]
    lines += ["  meta l4proto tcp reject with tcp reset", "  reject", " }", "}"]
    return "\n".join(lines) + "\n"


def nat_table(veth: str = "eth0") -> str:
    """A VM's guest traffic leaves its namespace as the sandbox's address."""
    return (f"table ip {NAT_TABLE} {{\n chain post {{ type nat hook postrouting priority 100; "
            f'oifname "{veth}" masquerade; }}\n}}\n')


def create(slot: int, policy: NetworkPolicy, pid: int) -> Path:
    """The slot's name for the network namespace of process `pid` (the
    sandbox's init: the namespace belongs to the sandbox's user namespace, so
    the kernel lets its sysfs be mounted there), its veth pair, addresses,
    route and rules; undone on failure. The sandbox runs no command before
    this returns (the node asks for none until create is done)."""
    ns, _ = names(slot)
    try:
        _run("ip", "netns", "attach", ns, str(pid))
        _link(slot)
        _run("ip", "netns", "exec", ns, "nft", "-f", "-",
             stdin=ruleset(policy, addresses(slot)[0]))
    except BaseException:
        remove(slot, release=False)
        raise
    return NETNS_DIR / ns


def create_for_vm(slot: int, policy: NetworkPolicy) -> Path:
    """A new network namespace for a VM's VMM (the path to open and setns
    into before QEMU starts): the slot's veth pair to the host, a tap
    GUEST_IF for the guest's NIC, forwarding between the two, the rules and
    the masquerade; undone on failure."""
    ns, _ = names(slot)
    try:
        _run("ip", "netns", "add", ns)
        _link(slot)
        _run("ip", "-n", ns, "tuntap", "add", GUEST_IF, "mode", "tap")
        _run("ip", "-n", ns, "addr", "add", f"{GUEST_GATEWAY}/{GUEST_PREFIX}", "dev", GUEST_IF)
        _run("ip", "-n", ns, "link", "set", GUEST_IF, "up")
        _run("ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        _run("ip", "netns", "exec", ns, "nft", "-f", "-",
             stdin=ruleset(policy, addresses(slot)[0], GUEST_IF) + nat_table())
    except BaseException:
        remove(slot, release=False)
        raise
    return NETNS_DIR / ns


def _link(slot: int) -> None:
    """The veth pair between the host and the slot's namespace (its end
    named eth0), their addresses, loopback and the namespace's default route."""
    ns, host_if = names(slot)
    host_ip, sb_ip = addresses(slot)
    _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
    _run("ip", "link", "set", host_if, "up")
    _run("ip", "-n", ns, "addr", "add", f"{sb_ip}/30", "dev", "eth0")
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    _run("ip", "-n", ns, "link", "set", "eth0", "up")
    _run("ip", "-n", ns, "route", "add", "default", "via", host_ip)


def apply(slot: int, policy: NetworkPolicy, guest_if: str | None = None) -> None:
    """Replace the rules of the slot's sandbox by `policy`'s, in one nftables
    transaction (no moment without rules); mode none keeps the interface
    and refuses everything but loopback. The refused-destination counts
    start again from zero (read them first)."""
    ns, _ = names(slot)
    allow = policy.allow if policy.mode == "allowlist" else ()
    rules = ruleset(NetworkPolicy(mode="allowlist", allow=allow), addresses(slot)[0], guest_if)
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


def remove_all(sandbox_id: str, known: int | None) -> None:
    """Remove every slot of a sandbox: `known` (its state's) and the one its
    record names (a creation cut short before the state recorded it)."""
    for slot in {*slots_of(sandbox_id), *([] if known is None else [known])}:
        remove(slot)


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
