"""Which node a caller means, one rule for the SDK and the CLI (`resolve`):
the `node=` argument > the `fleet=` argument > $LAZYFS_NODE >
$LAZYFS_FLEET > runtime.client.transport.local(). Node forms: "unix:///PATH",
"http://HOST:PORT" (token: `token=` > $LAZYFS_NODE_TOKEN), a Node, or a
Transport; a fleet is "etcd://HOST:PORT[,HOST:PORT...]" (runtime.fleet.client:
placement over the nodes etcd lists, calls by id to the node the id names).

Above both runtime.client.transport (nodes and agents) and runtime.fleet.client
(which calls agents through runtime.client.transport), so neither imports the other's
caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazyfs.settings import setting

from .transport import Transport, agent_client, local

if TYPE_CHECKING:
    from ..node import Node


def resolve(node: str | Node | Transport | None, token: str | None = None,
            fleet: str | None = None) -> Transport:
    """The transport for `node` or `fleet` (see the module docstring)."""
    if node is None and fleet is None:
        node = setting("client_node")  # (settings client.node, LAZYFS_NODE)
        if node is None:
            fleet = setting("client_fleet")
    if node is None and fleet is not None:
        from ..fleet.client import fleet_client
        return fleet_client(fleet, token or setting("client_token"))
    if node is None:
        return local()
    if isinstance(node, str):
        return agent_client(node, token)
    return node  # a Node (it answers the API itself) or another transport
