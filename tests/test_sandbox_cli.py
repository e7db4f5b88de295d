"""`lazyfs sandbox …` as users type it: run (output streamed, exit code
passed through, sandbox gone afterwards), create/ls/exec/pause/resume/kill,
and one-line errors for bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    d = tmp_path_factory.mktemp("sbcli")
    store = busybox_store(d)
    with LazyNode(d / "lazynode", store) as lazy:
        env = {**os.environ, "LAZYFS_STORE": str(store), "LAZYFS_RUNTIME_DIR": str(d / "rt"),
               "LAZYFS_NODE_ROOT": str(lazy.paths.root)}
        env.pop("LAZYFS_NODE", None)

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=120, check=False)
        try:
            yield run
        finally:
            run("sandbox", "kill", "--label", "cli=test")


def test_run_streams_and_passes_the_exit_code(cli) -> None:  # type: ignore[no-untyped-def]
    p = cli("sandbox", "run", IMAGE, "--", "sh", "-c", "cat /etc/motd; echo e >&2; exit 7")
    assert (p.returncode, p.stdout, p.stderr) == (7, "hello from the image\n", "e\n")
    p = cli("sandbox", "run", "--backend", "fncall", IMAGE, "--", "id", "-u")
    assert (p.returncode, p.stdout) == (0, "65534\n")
    assert cli("sandbox", "ls").stdout == ""  # run kills what it created


def test_lifecycle_commands(cli) -> None:  # type: ignore[no-untyped-def]
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


def test_bad_input_is_one_line(cli) -> None:  # type: ignore[no-untyped-def]
    for args, msg in [(("run", "nope:1", "--", "true"), "no image 'nope:1'"),
                      (("run", "--memory-mb", "1", IMAGE, "--", "true"), "memory_mb"),
                      (("run", "--allow", "mirror:80", IMAGE, "--", "true"), "not an address"),
                      (("exec", "sb-nope", "--", "true"), "no sandbox 'sb-nope'"),
                      (("run", "--backend", "kvm", IMAGE, "--", "true"), "'kvm' is not one of")]:
        p = cli("sandbox", *args)
        assert p.returncode != 0 and msg in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr
