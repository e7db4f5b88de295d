"""Sandboxes (to be built by the runtime issue): the SDK (`Sandbox`,
`AsyncSandbox`), the node agent, the fncall / container / microvm / vm
backends, scheduling, resources and security.

Nothing here yet; see ARCHITECTURE.md and SDK.md.
"""
