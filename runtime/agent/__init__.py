"""The node agent: the node's runtime behind an HTTP API (FastAPI app in
app.py, served by hypercorn on trio in server.py; `python -m runtime.agent`
in __main__.py). Handlers translate; the runtime (runtime.node.Node) decides.
launch.py finds, starts and stops the agent of a state directory and is the
only module here that is light to import (this file must stay empty of
imports: the SDK imports launch)."""
