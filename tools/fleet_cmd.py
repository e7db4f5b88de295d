"""`lazyfs fleet nodes|top|drain|undrain`: the fleet's nodes as etcd lists
them (runtime.fleet), the operator's drain flag, and `drain --move`
(runtime.fleet.client.Fleet.move)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from runtime.fleet.client import Fleet, read_nodes, set_draining
from runtime.fleet.etcd import Etcd
from runtime.fleet.records import NodeView, check_node_id

from .errors import QuietError
from .options import parse_labels


def _fleet_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option("--fleet", metavar="etcd://HOST:PORT", envvar="LAZYFS_FLEET",
                        default=None, help="The fleet's etcd [env LAZYFS_FLEET].")(f)


def _url(fleet: str | None) -> str:
    if not fleet:
        raise QuietError("no fleet: give --fleet etcd://HOST:PORT or set LAZYFS_FLEET",
                         exit_code=2)
    return fleet


def _etcd(fleet: str | None) -> Etcd:
    return Etcd(_url(fleet))


@click.group()
def fleet() -> None:
    """The nodes of a fleet (node agents registered in etcd)."""


def _state(n: NodeView) -> str:
    return "draining" if n.draining else "ready"


@fleet.command()
@_fleet_option
@click.option("--json", "as_json", is_flag=True, help="The node records as JSON lines.")
def nodes(fleet: str | None, as_json: bool) -> None:
    """List the nodes whose lease is alive: id, address, state, backends, labels."""
    views = read_nodes(_etcd(fleet))
    if as_json:
        for n in views:
            click.echo(json.dumps({"draining": n.draining, **n.record.model_dump(mode="json")}))
        return
    click.echo(f"{'NODE':20s} {'ADDRESS':28s} {'STATE':9s} {'BACKENDS':28s} LABELS")
    for n in views:
        r = n.record
        labels = ",".join(f"{k}={v}" for k, v in sorted(r.labels.items())) or "-"
        click.echo(f"{r.node_id:20s} {r.address:28s} {_state(n):9s} "
                   f"{','.join(r.backends) or '-':28s} {labels}")


@fleet.command()
@_fleet_option
def top(fleet: str | None) -> None:
    """Load of every node: sandboxes, memory asked and used, CPU, images."""
    views = read_nodes(_etcd(fleet))
    click.echo(f"{'NODE':20s} {'STATE':9s} {'SANDBOXES':>12s} {'MEM ASKED':>12s} "
               f"{'MEM USED':>10s} {'CPU':>11s} {'IMAGES':>6s} {'AGE':>5s}")
    now = time.time()
    for n in sorted(views, key=lambda v: -v.record.load.sandboxes):
        r, load = n.record, n.record.load
        click.echo(f"{r.node_id:20s} {_state(n):9s} "
                   f"{f'{load.sandboxes}/{r.capacity.max_sandboxes}':>12s} "
                   f"{f'{load.requested_memory_mb}/{r.capacity.memory_mb}':>12s} "
                   f"{load.memory_used_mb:>7d} MB "
                   f"{f'{load.cpu_used:.2f}/{r.capacity.cores:g}':>11s} "
                   f"{len(r.images):>6d} {now - r.reported:>4.0f}s")


@fleet.command()
@_fleet_option
@click.option("--move", is_flag=True,
              help="Also move its sandboxes to other nodes on the same cluster store "
                   "(snapshot, restore elsewhere; ids kept).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="With --move: only the sandboxes with these labels.")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="The fleet's agent token [env LAZYFS_NODE_TOKEN].")
@click.argument("node_id")
def drain(fleet: str | None, move: bool, labels: tuple[str, ...], token_file: Path | None,
          node_id: str) -> None:
    """Place no new sandbox on NODE_ID (its sandboxes run on, unless --move;
    the flag stays across agent restarts until `undrain`)."""
    if labels and not move:
        raise QuietError("--label selects the sandboxes to --move", exit_code=2)
    if not move:
        set_draining(_etcd(fleet), node_id, True)
        click.echo(f"{node_id}: draining", err=True)
        return
    check_node_id(node_id)
    token = token_file.read_text().strip() if token_file else None
    client = Fleet(_url(fleet), token)
    try:
        moves = client.move(node_id, parse_labels(labels))
    finally:
        client.close()
    for m in moves:
        click.echo(f"{m.sandbox_id} {m.to} {m.seconds:.2f}s" if m.to
                   else f"{m.sandbox_id} - {m.error}")
        if m.to and m.error:
            click.echo(f"{m.sandbox_id}: {m.error}", err=True)
    stayed = sum(m.to is None for m in moves)
    click.echo(f"{node_id}: draining; {len(moves) - stayed} sandboxes moved"
               + (f", {stayed} not (see above)" if stayed else ""), err=True)
    if stayed:
        raise SystemExit(1)


@fleet.command()
@_fleet_option
@click.argument("node_id")
def undrain(fleet: str | None, node_id: str) -> None:
    """Place sandboxes on NODE_ID again."""
    set_draining(_etcd(fleet), node_id, False)
    click.echo(f"{node_id}: ready", err=True)


@fleet.group()
def ca() -> None:
    """The fleet's certificate authority: node and client identities for
    agents serving HTTPS (`lazyfs agent --tls-dir`) and their callers
    (LAZYFS_TLS_DIR)."""


@ca.command("init")
@click.argument("ca_dir", type=click.Path(file_okay=False, path_type=Path))
def ca_init(ca_dir: Path) -> None:
    """Make a CA in CA_DIR (ca.pem, ca-key.pem mode 0600, crl.pem). Keep
    ca-key.pem off the nodes."""
    from runtime.errors import InvalidSpec
    from runtime.fleet.ca import FleetCA
    try:
        FleetCA.init(ca_dir)
    except InvalidSpec as e:
        raise QuietError(str(e), exit_code=2) from None
    click.echo(f"fleet CA in {ca_dir}: give nodes and callers identities with "
               f"`lazyfs fleet ca issue node|client NAME --ca {ca_dir} --out DIR`")


@ca.command("issue")
@click.argument("kind", type=click.Choice(["node", "client"]))
@click.argument("name")
@click.option("--ca", "ca_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The CA's directory (lazyfs fleet ca init).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where to write cert.pem, key.pem (0600), ca.pem and crl.pem.")
@click.option("--address", "addresses", multiple=True, metavar="IP",
              help="node: an IP address it is also reached at directly (https://IP:PORT).")
def ca_issue(kind: str, name: str, ca_dir: Path, out: Path, addresses: tuple[str, ...]) -> None:
    """An identity: a node's (NAME: its node id; its certificate names
    NAME.node.lazyfs, which fleet clients check against the record they
    picked) or a caller's (NAME: who it is, for logs and revocation)."""
    from runtime.errors import InvalidSpec
    from runtime.fleet.ca import FleetCA
    try:
        authority = FleetCA(ca_dir)
        ident = (authority.issue_node(name, out, addresses) if kind == "node"
                 else authority.issue_client(name, out))
    except InvalidSpec as e:
        raise QuietError(str(e), exit_code=2) from None
    click.echo(f"{kind} {name}: {ident.cert} ({ident.key}, {ident.ca})")


@ca.command("revoke")
@click.argument("cert", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--ca", "ca_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The CA's directory.")
def ca_revoke(cert: Path, ca_dir: Path) -> None:
    """Revoke CERT in the CA's crl.pem; copy that file to the agents'
    --tls-dir (they read it again within a second of a change)."""
    from runtime.errors import InvalidSpec
    from runtime.fleet.ca import FleetCA
    try:
        serial = FleetCA(ca_dir).revoke(cert)
    except InvalidSpec as e:
        raise QuietError(str(e), exit_code=2) from None
    click.echo(f"revoked serial {serial:x}: distribute {ca_dir / 'crl.pem'} to the agents")


@fleet.command("etcd-auth")
@_fleet_option
@click.option("--root-password-file", type=click.Path(dir_okay=False, exists=True,
                                                      path_type=Path), required=True,
              help="etcd's root password (made the root user's when etcd has no users yet).")
@click.option("--node", "nodes", multiple=True, metavar="NODE_ID=DIR",
              help="A node and its identity directory (gets etcd-auth: its user, password).")
@click.option("--client", "clients", multiple=True, metavar="NAME=DIR",
              help="A client and its identity directory (read-only in etcd).")
@click.option("--ca", "ca_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              default=None, help="The CA etcd's certificate chains to [IDENTITY/ca.pem].")
@click.option("--identity", type=click.Path(file_okay=False, exists=True, path_type=Path),
              default=None, help="Your client identity directory (cert.pem, key.pem, ca.pem: "
              "`lazyfs fleet ca issue client NAME`), for an etcd that asks for a client "
              "certificate [LAZYFS_TLS_DIR].")
def etcd_auth(fleet: str | None, root_password_file: Path, nodes: tuple[str, ...],
              clients: tuple[str, ...], ca_file: Path | None, identity: Path | None) -> None:
    """Switch on etcd's users and roles for the fleet (over etcds://): each
    node may write only its own record, clients only read (and delete the
    forwarding records of sandboxes they kill), root does the rest."""
    from runtime.errors import SandboxError
    from runtime.fleet import etcdauth

    def pairs(items: tuple[str, ...], what: str) -> dict[str, Path]:
        out = {}
        for item in items:
            name, sep, d = item.partition("=")
            if not sep or not name or not d:
                raise QuietError(f"--{what} {item!r}: expected NAME=DIR", exit_code=2)
            out[name] = Path(d)
        return out

    try:
        etcdauth.setup(_url(fleet), root_password_file.read_text().strip(),
                       pairs(nodes, "node"), pairs(clients, "client"), ca=ca_file,
                       identity=identity)
    except SandboxError as e:
        raise QuietError(str(e), exit_code=2) from None
    click.echo(f"etcd {_url(fleet)}: authentication on; {len(nodes)} node and "
               f"{len(clients)} client users (their passwords in DIR/etcd-auth)")
