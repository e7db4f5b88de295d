"""The node agent: the node's runtime behind an HTTP API (FastAPI app in
app.py, served by hypercorn on trio in server.py). Handlers translate; the
runtime (runtime.node.Node) decides."""
