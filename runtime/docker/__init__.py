"""A Docker Engine API endpoint over the node's sandboxes (`lazyfs agent
--docker-socket PATH`): harnesses written for docker-py or the docker CLI
drive lazyfs sandboxes unchanged (docs/docker.md). Rooms: http (h11 over
trio, hijacked connections), shapes (Docker's non-JSON shapes), images
(Docker's view of the store), engine (containers, execs, events over the
Node), server (the routes)."""
