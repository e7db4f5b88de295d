"""`python -m runtime.agent --config JSON`: the node agent of one state
directory on its Unix socket (STATE/agent.sock), as launch.start runs it in
the background. Users run `lazyfs agent` (TCP listeners, tokens, options)."""

from __future__ import annotations

import argparse
import logging
import sys

from lazyfs import logs

from ..errors import SandboxError
from .launch import agent_socket, load_config, pid_file
from .server import run_agent

log = logging.getLogger("runtime.agent")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.agent",
                                description="Serve the node agent of one state directory.")
    p.add_argument("--config", required=True,
                   help="the node's RuntimeConfig as JSON (runtime.agent.launch.dump_config)")
    args = p.parse_args(argv)
    logs.setup(logging.INFO)
    config = load_config(args.config)
    sock = agent_socket(config.state_dir)
    try:
        run_agent(config, socket=sock,
                  on_ready=lambda: log.info("serving unix://%s (pid file %s)", sock,
                                            pid_file(sock)))
    except SandboxError as e:
        log.error("%s", e)  # one line: launch.start shows the log's last line
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
