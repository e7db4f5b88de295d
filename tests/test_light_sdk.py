"""The SDK as a training job uses it against a remote node: a fresh
interpreter imports `runtime`, creates a sandbox through a real node agent
over HTTP (TCP + token), runs a command, and never loads the node's code
(pyfuse3, LMDB, the chunk store, the composer, lazyfs) nor the agent's
(hypercorn, FastAPI). trio may load on the first request: httpx's transport
(httpcore) imports it when it is installed, whatever the caller does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.helpers.agents import REPO, Agent, running_agent
from tests.helpers.sandboxes import IMAGE, runtime_missing

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]

# (not zstandard: httpx loads it for zstd responses when it is installed)
FOREIGN = ("pyfuse3", "lmdb", "hypercorn", "fastapi", "blake3", "xxhash")
# the node's packages: only their error modules may load (every package's
# errors share one root class, so the SDK's errors import theirs)
OURS = ("chunkstore", "composer", "lazyfs", "pmem")

CLIENT = """
import json, sys
import runtime
after_import = sorted(sys.modules)
kw = json.loads(sys.argv[1])
with runtime.Sandbox.create({image!r}, **kw) as sb:
    r = sb.exec("cat /etc/motd")
print(json.dumps({{"stdout": r.stdout.decode(), "after_import": after_import,
                  "loaded": sorted(sys.modules)}}))
"""


def heavy(modules: list[str]) -> list[str]:
    out = []
    for m in modules:
        top = m.split(".")[0]
        # (lazyfs.settings: the [client] settings; it imports nothing of ours
        # but lazyfs.errors, which the same rule checks)
        if top in FOREIGN or (top in OURS and m not in (top, f"{top}.errors", "lazyfs.settings")):
            out.append(m)
    return out


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    with running_agent(tmp_path_factory.mktemp("light")) as a:
        yield a


def _client(env: dict[str, str], **kw: str) -> dict[str, list[str] | str]:
    p = subprocess.run([sys.executable, "-c", CLIENT.format(image=IMAGE), json.dumps(kw)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 0, p.stderr
    out: dict[str, list[str] | str] = json.loads(p.stdout)
    return out


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LAZYFS_NODE", "LAZYFS_NODE_TOKEN")}
    return {**env, **extra}


def test_remote_node_by_argument_loads_no_node_code(agent: Agent) -> None:
    out = _client(_env(), node=agent.http, token=agent.token)
    assert out["stdout"] == "hello from the image\n"
    assert "pyfuse3" not in out["loaded"] and "lmdb" not in out["loaded"]
    assert heavy(list(out["loaded"])) == []
    assert "trio" not in out["after_import"]  # not even trio until httpx sends


def test_remote_node_from_the_environment_loads_no_node_code(agent: Agent) -> None:
    out = _client(_env(LAZYFS_NODE=agent.http, LAZYFS_NODE_TOKEN=agent.token))
    assert out["stdout"] == "hello from the image\n"
    assert "pyfuse3" not in out["loaded"] and "lmdb" not in out["loaded"]
    assert heavy(list(out["loaded"])) == []
