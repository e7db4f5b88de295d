"""docs/security.md's attack × backend table stays tied to the suite that
performs the attacks: every test module or test it names exists, and every
module that attacks a sandbox from inside is named there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "security.md"
# the modules that perform attacks from inside a sandbox (through the SDK)
ATTACKS = ("test_exec_integrity", "test_sandbox_limits", "test_sandbox_userns",
           "test_verify_vm", "test_verify_microvm", "test_sandbox_fncall_denials")


def _table() -> str:
    text = DOC.read_text()
    start = text.index("## Attack × backend")
    return text[start:text.index("\n## ", start + 1)]


def test_every_test_the_table_names_exists() -> None:
    modules = {p.stem: p.read_text() for p in (REPO / "tests").glob("test_*.py")}
    tests = {name for source in modules.values()
             for name in re.findall(r"^def (test_\w+)", source, re.MULTILINE)}
    named = set(re.findall(r"\btest_\w+", _table()))
    assert named, "the table names no test"
    assert sorted(n for n in named if n not in modules and n not in tests) == []


def test_every_attack_module_is_in_the_table() -> None:
    named = set(re.findall(r"\btest_\w+", _table()))
    assert [m for m in ATTACKS if m not in named] == []
    assert all((REPO / "tests" / f"{m}.py").is_file() for m in ATTACKS)
