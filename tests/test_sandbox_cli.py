"""`lazyfs sandbox …` as users type it: run (output streamed, exit code
passed through, sandbox gone afterwards), create/ls/exec/pause/resume/kill,
and one-line errors for bad input. Who runs the node: `run` without an agent
runs it in the command; `create` without an agent starts one in the
background, so the sandbox outlives the command and later commands and the
SDK (naming no node) talk to that agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import Sandbox
from runtime.agent.launch import answers, pid_file
from runtime.backends import criu
from runtime.client.connect import resolve
from runtime.client.transport import Http
from runtime.isolation.hostlimits import FNCALL_UID_BASE
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
    assert p.returncode == 0 and int(p.stdout) >= FNCALL_UID_BASE  # the sandbox's own uid
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


def test_events_show_what_a_sandbox_was_refused(cli: Cli) -> None:
    """A denied system call inside, then `sandbox events` (through the agent
    `sandbox create` started: its HTTP route and the SDK's client)."""
    sid = cli("sandbox", "create", "--label", "cli=test", IMAGE).stdout.strip()
    try:
        assert cli("sandbox", "events", sid).stdout == ""
        p = cli("sandbox", "exec", sid, "--", "sh", "-c", "mount -t tmpfs x /mnt")
        assert p.returncode != 0 and "permission denied" in p.stderr, p
        p = cli("sandbox", "events", sid)
        assert p.returncode == 0 and p.stdout.split() == ["syscall", "mount", "x1"], p
        events = json.loads(cli("sandbox", "events", "--json", sid).stdout)
        assert [(e["kind"], e["detail"], e["count"]) for e in events] == [
            ("syscall", "mount", 1)]
    finally:
        cli("sandbox", "kill", sid)


def test_pause_and_resume_say_what_they_did_by_id_and_by_label(cli: Cli) -> None:
    ids = [cli("sandbox", "create", "--label", "cli=test", "--label", "grp=pr", IMAGE
               ).stdout.strip() for _ in range(2)]
    p = cli("sandbox", "pause", ids[0])
    assert p.returncode == 0 and p.stdout.startswith(f"paused {ids[0]}: rss "), p
    p = cli("sandbox", "resume", ids[0])
    assert (p.returncode, p.stdout, p.stderr) == (0, f"resumed {ids[0]}\n", ""), p
    p = cli("sandbox", "pause", "--label", "grp=pr")
    assert p.returncode == 0 and sorted(p.stdout.splitlines()) == sorted(
        f"paused {i}" for i in ids), p
    assert all(b["state"] == "paused" for b in _ls_json(cli, "grp=pr"))
    p = cli("sandbox", "resume", "--label", "grp=pr")
    assert p.returncode == 0 and sorted(p.stdout.splitlines()) == sorted(
        f"resumed {i}" for i in ids), p
    assert all(b["state"] == "running" for b in _ls_json(cli, "grp=pr"))
    # nothing paused any more: resuming by label resumes nothing, says nothing
    assert cli("sandbox", "resume", "--label", "grp=pr").stdout == ""
    p = cli("sandbox", "kill", "--label", "grp=pr")
    assert sorted(p.stdout.splitlines()) == sorted(f"killed {i}" for i in ids), p


def _ls_json(cli: Cli, label: str) -> list[dict[str, Any]]:
    p = cli("sandbox", "ls", "--json", "--label", label)
    assert p.returncode == 0, p.stderr
    out: list[dict[str, Any]] = json.loads(p.stdout)
    return out


def test_qos_option(cli: Cli) -> None:
    p = cli("sandbox", "run", "--qos", "best_effort", IMAGE, "--", "cat", "/proc/self/stat")
    assert p.returncode == 0, p.stderr
    # field 41 of /proc/PID/stat is the scheduling policy: 5 = SCHED_IDLE
    assert p.stdout.rsplit(")", 1)[1].split()[38] == "5", p.stdout
    p = cli("sandbox", "create", "--label", "cli=test", "--label", "grp=qos", "--qos",
            "best_effort", IMAGE)
    assert p.returncode == 0, p.stderr
    assert [b["spec"]["qos"] for b in _ls_json(cli, "grp=qos")] == ["best_effort"]
    assert cli("sandbox", "kill", "--label", "grp=qos").returncode == 0


def test_node_help_states_the_rule(cli: Cli) -> None:
    for cmd in ("run", "create", "exec", "ls", "pause", "resume", "kill"):
        text = " ".join(cli("sandbox", cmd, "--help").stdout.split())
        assert "this process" not in text
        assert ("the agent of the state directory (STATE/agent.sock) if one answers, else the "
                "node runs in this command; `sandbox create` and `run --keep` start an agent "
                "instead") in text, (cmd, text)
    text = " ".join(cli("sandbox", "create", "--help").stdout.split())
    assert "--qos [latency|best_effort]" in text and "host_address" in text


@pytest.mark.parametrize("args, code, words", [
    (("run", "--allow", "notanip", IMAGE, "--", "true"), 1,
     ["network rule 'notanip'", "'notanip' is not an address or network"]),
    (("create", "--allow", "10.0.0.1:http", IMAGE), 1, ["port 'http' is not a number"]),
    (("run", "--backend", "microvm", "--memory-mb", "64", IMAGE, "--", "true"), 1,
     ["memory_mb: 64 MB is below the microvm backend's minimum of 256 MB"]),
    (("create", "--backend", "vm", "--memory-mb", "128", IMAGE), 1,
     ["memory_mb: 128 MB is below the vm backend's minimum of 256 MB"]),
    (("pause", "--label", "nokey"), 2, ["--label 'nokey': expected KEY=VALUE"]),
    (("resume",), 2, ["name the sandboxes to resume"]),
    (("kill",), 2, ["name the sandboxes to kill"]),
    (("resume", "sb-nope"), 1, ["no sandbox 'sb-nope'"]),
])
def test_mistakes_get_one_line(cli: Cli, args: tuple[str, ...], code: int,
                               words: list[str]) -> None:
    p = cli("sandbox", *args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code and len(lines) == 1, (args, p.returncode, p.stderr)
    assert lines[0].startswith("lazyfs: error: ") and "https://" not in lines[0], lines
    assert all(w in lines[0] for w in words), (args, lines)
    assert p.stdout == ""


def test_bad_input_is_one_line(cli: Cli) -> None:
    for args, msg in [(("run", "nope:1", "--", "true"), "no image 'nope:1'"),
                      (("run", "--memory-mb", "1", IMAGE, "--", "true"), "memory_mb"),
                      (("run", "--allow", "mirror:80", IMAGE, "--", "true"), "not an address"),
                      (("exec", "sb-nope", "--", "true"), "no sandbox 'sb-nope'"),
                      (("run", "--backend", "kvm", IMAGE, "--", "true"), "'kvm' is not one of")]:
        p = cli("sandbox", *args)
        assert p.returncode != 0 and msg in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr


def test_snapshot_fork_and_verify_as_typed(cli: Cli) -> None:
    sid = cli("sandbox", "create", "--label", "cli=test", "--hidden", "/data", IMAGE
              ).stdout.strip()
    assert cli("sandbox", "exec", sid, "sh", "-c", "echo mine > /root/x").returncode == 0
    p = cli("sandbox", "snapshot", "--tag", "cli/snap:1", sid)
    assert p.returncode == 0 and " cli/snap:1 " in p.stdout and "frozen" in p.stdout, p.stderr
    digest = p.stdout.split()[0]
    p = cli("sandbox", "fork", sid, "2")
    kids = p.stdout.split()
    assert p.returncode == 0 and len(kids) == 2, p.stderr
    for k in kids:
        assert cli("sandbox", "exec", k, "cat", "/root/x").stdout == "mine\n"
    cli("sandbox", "kill", *kids)
    p = cli("sandbox", "verify", "--keep", "/root", sid, "sh", "-c",
            "cat /root/x; ls /data; exit 5")
    assert (p.returncode, p.stdout) == (5, "mine\nbig.bin\n"), p.stderr
    p = cli("sandbox", "create", "--label", "cli=test", digest)
    assert p.returncode == 0, p.stderr
    assert cli("sandbox", "exec", p.stdout.strip(), "cat", "/root/x").stdout == "mine\n"
    p = cli("sandbox", "snapshot", "--tag", "Bad Name!", sid)
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.skipif(criu.missing() is not None, reason=str(criu.missing()))
def test_checkpoint_and_restore_as_typed(cli: Cli) -> None:
    sid = cli("sandbox", "create", "--label", "cli=test", IMAGE).stdout.strip()
    assert cli("sandbox", "exec", sid, "sh", "-c",
               "echo kept > /root/x; sleep 600 </dev/null >/dev/null 2>&1 &").returncode == 0
    p = cli("sandbox", "checkpoint", "--tag", "cli/ckpt:1", sid)
    assert p.returncode == 0 and " cli/ckpt:1 " in p.stdout and "frozen" in p.stdout, p.stderr
    cli("sandbox", "kill", sid)
    p = cli("sandbox", "restore", "cli/ckpt:1")  # (it keeps the label cli=test)
    assert p.returncode == 0, p.stderr
    again = p.stdout.strip()
    assert cli("sandbox", "exec", again, "cat", "/root/x").stdout == "kept\n"
    assert cli("sandbox", "exec", again, "sh", "-c", "ps | grep -q '[s]leep 600'").returncode == 0
    # what CRIU refuses: one line naming it, the sandbox runs on
    other = cli("sandbox", "create", "--label", "cli=test", IMAGE).stdout.strip()
    cli("sandbox", "exec", other, "sh", "-c",
        "echo m > /dev/mqueue/q; (exec 4</dev/mqueue/q; sleep 600) </dev/null >/dev/null 2>&1 &")
    p = cli("sandbox", "checkpoint", other)
    assert p.returncode != 0 and "mqueue" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert "{" not in p.stderr  # the message, not the agent's JSON
    assert cli("sandbox", "exec", other, "echo", "alive").stdout == "alive\n"


def test_preempt_and_restore_as_typed(cli: Cli) -> None:
    p = cli("sandbox", "create", "--label", "cli=test", "--label", "pre=1", IMAGE)
    assert p.returncode == 0, p.stderr
    sid = p.stdout.strip()
    assert cli("sandbox", "exec", sid, "--", "sh", "-c", "echo kept > /root/kept").returncode == 0
    p = cli("sandbox", "pause", "--snapshot", sid)
    assert p.returncode == 0 and p.stdout.startswith(f"preempted {sid}: snapshot blake3:"), p
    assert "MB of disk freed" in p.stdout
    assert sid not in cli("sandbox", "ls").stdout
    listed = cli("sandbox", "preempted", "--label", "pre=1")
    assert listed.stdout.startswith(sid) and "pre=1" in listed.stdout, listed
    p = cli("sandbox", "exec", sid, "--", "true")  # one line saying what to do
    assert p.returncode != 0 and "was preempted" in p.stderr and "restore" in p.stderr, p
    assert len(p.stderr.strip().splitlines()) == 1
    p = cli("sandbox", "restore", "--label", "pre=1")
    assert (p.returncode, p.stdout) == (0, f"restored {sid}\n"), p.stderr
    p = cli("sandbox", "exec", sid, "--", "cat", "/root/kept")
    assert (p.returncode, p.stdout) == (0, "kept\n"), p.stderr
    assert cli("sandbox", "preempted").stdout == ""
    p = cli("sandbox", "restore", sid)
    assert p.returncode != 0 and "runs on this node" in p.stderr, p
    assert cli("sandbox", "pause", "--snapshot", "--label", "pre=1").stdout == f"preempted {sid}\n"
    assert cli("sandbox", "kill", sid).stdout == f"killed {sid}\n"  # discarded
    assert cli("sandbox", "preempted").stdout == ""
