"""What a caller of sandboxes imports: the SDK (sdk.py: Sandbox,
AsyncSandbox), how it reaches a node (transport.py: the embedded Node, a node
agent's HTTP client, the async one), and which node a caller means
(connect.py). Light: no node code is loaded until a node runs embedded."""
