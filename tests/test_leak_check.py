"""The end-of-session leak check (tests/conftest.py, helpers/leaks.py) reports
what its own session left behind and nothing that others run on the host.

Each test runs a small pytest session of its own (pytester, in a child
process) with the real check, next to a real sandbox-named cgroup."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.isolation import cgroups
from tests.helpers.support import root_only

REPO = Path(__file__).resolve().parent.parent

INNER_CONFTEST = "from tests.conftest import nothing_left_behind  # noqa: F401\n"


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester session with the real check, importing this checkout."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    pytester.makeconftest(INNER_CONFTEST)
    return pytester


@pytest.fixture
def sandbox_cgroup() -> Iterator[Path]:
    """A cgroup named as a container sandbox's (sb-<16 hex>); removed after."""
    cg = cgroups.CGROUP_ROOT / "pids" / cgroups.PARENT / f"sb-{secrets.token_hex(8)}"
    yield cg
    if cg.is_dir():
        cg.rmdir()


@root_only
def test_what_others_run_is_not_a_leak(inner: pytest.Pytester, sandbox_cgroup: Path) -> None:
    sandbox_cgroup.mkdir(parents=True)  # someone else's sandbox, before and during the run
    inner.makepyfile(test_quiet="def test_nothing() -> None:\n    pass\n")
    result = inner.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@root_only
def test_a_leak_of_the_session_fails_it(inner: pytest.Pytester, sandbox_cgroup: Path) -> None:
    # The session makes a sandbox and leaves its cgroup: as a node in a child
    # process does, its log (under the session's temporary directory) names it.
    inner.makepyfile(test_leaky=f"""
from pathlib import Path


def test_leaks(tmp_path: Path) -> None:
    Path({str(sandbox_cgroup)!r}).mkdir(parents=True)
    (tmp_path / "agent.log").write_text("created {sandbox_cgroup.name} (container, bb:1)\\n")
""")
    result = inner.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"*left behind*sandbox cgroups*{sandbox_cgroup.name}*"])
