"""Sandboxes: the SDK (`Sandbox`, `AsyncSandbox`), the node's runtime
(`runtime.node.Node`), the node agent (`runtime.agent`), and the backends
(fncall, container; microvm and vm to come) with their resources and
security (cgroups, seccomp, Landlock, network allowlists)."""
