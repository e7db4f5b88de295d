"""`lazyfs sandbox …` as users type it: run (output streamed, exit code
passed through, sandbox gone afterwards), create/ls/exec/pause/resume/kill,
and one-line errors for bad input. Who runs the node: `run` without an agent
runs it in the command; `create` without an agent starts one in the
background, so the sandbox outlives the command and later commands and the
SDK (naming no node) talk to that agent."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Sandbox
from runtime.agent.launch import answers, pid_file
from runtime.transport import Http, resolve
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]
REPO = Path(__file__).resolve().parent.parent


class Cli:
    """`python -m tools.cli` with a state directory of its own."""

    def __init__(self, env: dict[str, str], state: Path) -> None:
        self.env, self.state = env, state
        self.sock = state / "agent.sock"

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO,
                              env=self.env, capture_output=True, text=True, timeout=120,
                              check=False)


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    d = tmp_path_factory.mktemp("sbcli")
    store = busybox_store(d)
    with LazyNode(d / "lazynode", store) as lazy:
        env = {**os.environ, "LAZYFS_STORE": str(store), "LAZYFS_RUNTIME_DIR": str(d / "rt"),
               "LAZYFS_NODE_ROOT": str(lazy.paths.root)}
        env.pop("LAZYFS_NODE", None)
        run = Cli(env, d / "rt")
        try:
            yield run
        finally:
            run("sandbox", "kill", "--label", "cli=test")
            run("agent", "--stop")  # the agent `sandbox create` started


def test_run_streams_and_passes_the_exit_code(cli: Cli) -> None:
    p = cli("sandbox", "run", IMAGE, "--", "sh", "-c", "cat /etc/motd; echo e >&2; exit 7")
    assert (p.returncode, p.stdout, p.stderr) == (7, "hello from the image\n", "e\n")
    p = cli("sandbox", "run", "--backend", "fncall", IMAGE, "--", "id", "-u")
    assert (p.returncode, p.stdout) == (0, "65534\n")
    assert cli("sandbox", "ls").stdout == ""  # run kills what it created


def test_run_without_an_agent_runs_the_node_in_the_command(cli: Cli) -> None:
    assert not answers(cli.sock)
    p = cli("sandbox", "run", IMAGE, "--", "true")
    assert p.returncode == 0, p.stderr
    assert not answers(cli.sock)  # no agent was started for it


def test_create_starts_an_agent_the_sandbox_outlives_the_command(cli: Cli) -> None:
    assert not answers(cli.sock)
    p = cli("sandbox", "create", "--label", "cli=test", IMAGE)
    assert p.returncode == 0, p.stderr
    sid = p.stdout.strip()
    # the command has exited; its agent (detached, logging to the state dir) has not
    assert answers(cli.sock) and pid_file(cli.sock).exists()
    assert (cli.state / "agent.log").exists()
    p = cli("sandbox", "exec", sid, "--", "cat", "/etc/motd")
    assert (p.returncode, p.stdout) == (0, "hello from the image\n"), p.stderr
    assert cli("sandbox", "kill", sid).returncode == 0
    assert sid not in cli("sandbox", "ls").stdout


def test_with_an_agent_the_sdk_and_the_cli_both_use_it(cli: Cli,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if not answers(cli.sock):
        assert cli("sandbox", "create", "--label", "cli=test", IMAGE).returncode == 0
    for k in ("LAZYFS_STORE", "LAZYFS_RUNTIME_DIR", "LAZYFS_NODE_ROOT"):
        monkeypatch.setenv(k, cli.env[k])
    monkeypatch.delenv("LAZYFS_NODE", raising=False)
    # naming no node, the SDK finds the agent (in-process it would be refused:
    # the agent's node owns the state directory)
    assert isinstance(resolve(None), Http)
    with Sandbox.create(IMAGE, labels={"cli": "test", "via": "sdk"}) as sb:
        p = cli("sandbox", "exec", sb.id, "--", "sh", "-c", "echo from-cli > /tmp/x")
        assert p.returncode == 0, p.stderr
        assert sb.files.read("/tmp/x") == b"from-cli\n"
        assert sb.id in cli("sandbox", "ls", "--label", "via=sdk").stdout
        p = cli("sandbox", "run", IMAGE, "--", "true")  # run goes to the agent too
        assert p.returncode == 0, p.stderr
    assert cli("sandbox", "ls", "--label", "via=sdk").stdout == ""


def test_agent_stop(cli: Cli) -> None:
    if not answers(cli.sock):
        assert cli("sandbox", "create", "--label", "cli=test", IMAGE).returncode == 0
    sid = cli("sandbox", "create", "--label", "cli=test", IMAGE).stdout.strip()
    p = cli("agent", "--stop")
    assert p.returncode == 0 and "stopped" in p.stderr, p.stderr
    assert not answers(cli.sock) and not pid_file(cli.sock).exists()
    # its sandboxes stay: the node of the next command (embedded) finds them
    p = cli("sandbox", "exec", sid, "--", "true")
    assert p.returncode == 0, p.stderr
    assert cli("sandbox", "kill", sid).returncode == 0
    assert "no agent" in cli("agent", "--stop").stderr


def test_lifecycle_commands(cli: Cli) -> None:
    p = cli("sandbox", "create", "--label", "cli=test", "--memory-mb", "64", IMAGE)
    assert p.returncode == 0, p.stderr
    sid = p.stdout.strip()
    assert sid in cli("sandbox", "ls", "--label", "cli=test").stdout
    assert cli("sandbox", "exec", sid, "--", "sh", "-c", "echo hi > /tmp/x").returncode == 0
    p = cli("sandbox", "pause", sid)
    assert p.returncode == 0 and "paused" in p.stdout
    assert cli("sandbox", "resume", sid).returncode == 0
    assert cli("sandbox", "exec", sid, "--", "cat", "/tmp/x").stdout == "hi\n"
    assert cli("sandbox", "kill", sid).returncode == 0
    assert cli("sandbox", "ls").stdout == ""


def test_bad_input_is_one_line(cli: Cli) -> None:
    for args, msg in [(("run", "nope:1", "--", "true"), "no image 'nope:1'"),
                      (("run", "--memory-mb", "1", IMAGE, "--", "true"), "memory_mb"),
                      (("run", "--allow", "mirror:80", IMAGE, "--", "true"), "not an address"),
                      (("exec", "sb-nope", "--", "true"), "no sandbox 'sb-nope'"),
                      (("run", "--backend", "kvm", IMAGE, "--", "true"), "'kvm' is not one of")]:
        p = cli("sandbox", *args)
        assert p.returncode != 0 and msg in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr
