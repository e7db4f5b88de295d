"""Environments from independent layers: `lazyfs build SPEC`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.catalog import Catalog
from composer.convert import convert
from composer.envspec import SpecError, build, load_spec
from composer.errors import BadSource
from composer.export import export_tree
from tests.helpers.images import build_busybox_rootfs, chroot_run, tar_of

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root: image owners")]



def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _export(store: ChunkStore, cat: Catalog, name: str, dest: Path) -> Path:
    _, img = cat.resolve(name)
    export_tree(store, [cat.load_layer(d) for d in img.layers], dest)
    return dest


def test_build_composes_independent_layers_and_reuses_them(
        store: ChunkStore, cat: Catalog, tmp_path: Path) -> None:
    base = build_busybox_rootfs(tmp_path / "base")
    convert(store, cat, f"tar:{tar_of(base, tmp_path / 'base.tar')}", "busybox:1")
    ws = _tree(tmp_path / "ws", {"repo/main.py": b"print('task')\n", "README": b"task 42\n"})
    tk1 = _tree(tmp_path / "tk1", {"bin/tool": b"#!/bin/sh\necho tool one\n"})
    tk2 = _tree(tmp_path / "tk2", {"bin/tool": b"#!/bin/sh\necho tool two\n",
                                   "share/two": b"2\n"})
    (tk1 / "bin" / "tool").chmod(0o755)
    (tk2 / "bin" / "tool").chmod(0o755)
    spec = tmp_path / "env.toml"
    spec.write_text(f'name = "env:1"\nbase = "busybox:1"\nworkspace = "dir:{ws}"\n'
                    f'toolkits = ["dir:{tk1}", {{ source = "dir:{tk2}", path = "/opt/tk2" }}]\n')
    digest, converted = build(store, cat, load_spec(spec))
    assert converted == 3
    out = _export(store, cat, "env:1", tmp_path / "out")
    assert (out / "workspace" / "repo" / "main.py").read_bytes() == b"print('task')\n"
    assert chroot_run(out, "/bin/tool").stdout == "tool one\n"
    assert chroot_run(out, "/bin/sh", "/opt/tk2/bin/tool").stdout == "tool two\n"
    assert (out / "bin" / "busybox").exists()
    assert (spec.parent / "env.toml.lock.json").exists()

    # rebuilding and a new combination of built components write no chunks
    chunks = store.stats().chunks
    assert build(store, cat, load_spec(spec)) == (digest, 0)
    spec2 = tmp_path / "env2.toml"
    spec2.write_text(spec.read_text().replace('"env:1"', '"env:2"').replace(
        f'"dir:{tk1}", ', ""))
    # env2 has no lock yet: it converts its sources again, which yields the
    # same manifests over the same chunks
    _, converted2 = build(store, cat, load_spec(spec2))
    assert converted2 == 2 and store.stats().chunks == chunks
    (spec2.parent / "env2.toml.lock.json").write_text(
        (spec.parent / "env.toml.lock.json").read_text())
    spec3 = tmp_path / "env3.toml"
    spec3.write_text(spec.read_text().replace('"env:1"', '"env:3"'))
    (spec3.parent / "env3.toml.lock.json").write_text(
        (spec.parent / "env.toml.lock.json").read_text())
    before = store.stats().chunks
    _, converted3 = build(store, cat, load_spec(spec3))
    assert converted3 == 0 and store.stats().chunks == before
    out2 = _export(store, cat, "env:2", tmp_path / "out2")
    assert chroot_run(out2, "/bin/sh", "-c", "ls /bin/tool || echo none").stdout == "none\n"


@pytest.mark.parametrize(("text", "words"), [
    ('base = "x"\n', "'name' is required"),
    ('name = "a"\nbase = "x"\nbogus = 1\n', "unknown key"),
    ('name = "a"\nbase = "never:seen"\n', "neither a source"),
    ('name = "a"\nbase = "x"\ntoolkits = [{ source = "dir:/", path = "rel" }]\n', "absolute"),
    ('name = "a"\nbase = { source = "registry://h/r", path = "/x" }\n', "only tar:, dir: and git:"),
])
def test_bad_specs_are_named(store: ChunkStore, cat: Catalog, tmp_path: Path, text: str,
                             words: str) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    with pytest.raises(SpecError, match=words):
        build(store, cat, load_spec(spec))
    assert cat.list_tags() == []


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_CONFIG_GLOBAL": "/dev/null"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, env=env,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_workspace_is_pinned_to_a_commit(store: ChunkStore, cat: Catalog,
                                             tmp_path: Path) -> None:
    base = build_busybox_rootfs(tmp_path / "base")
    convert(store, cat, f"tar:{tar_of(base, tmp_path / 'base.tar')}", "busybox:1")
    repo = _tree(tmp_path / "repo", {"src/app.py": b"v = 1\n", "run.sh": b"#!/bin/sh\necho v1\n"})
    (repo / "run.sh").chmod(0o755)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "run.sh").write_bytes(b"#!/bin/sh\necho v2\n")
    (repo / "untracked.txt").write_bytes(b"not in any commit\n")
    _git(repo, "commit", "-qam", "two")
    spec = tmp_path / "env.toml"
    spec.write_text(f'name = "g:1"\nbase = "busybox:1"\nworkspace = "git:{repo}#{first}"\n')
    build(store, cat, load_spec(spec))
    out = _export(store, cat, "g:1", tmp_path / "out")
    assert chroot_run(out, "/workspace/run.sh").stdout == "v1\n"
    assert not (out / "workspace" / "untracked.txt").exists()
    assert not (out / "workspace" / ".git").exists()
    # HEAD by default; a clone URL works the same way
    convert(store, cat, f"git:file://{repo}", "ws:head")
    head = _export(store, cat, "ws:head", tmp_path / "head")
    assert (head / "run.sh").read_bytes() == b"#!/bin/sh\necho v2\n"
    assert (head / "src" / "app.py").stat().st_mtime == int(_git(repo, "log", "-1",
                                                                 "--format=%ct"))
    with pytest.raises(BadSource, match="finding commit 'nope'"):
        convert(store, cat, f"git:{repo}#nope", "x")
    with pytest.raises(BadSource, match="does not exist"):
        convert(store, cat, f"git:{tmp_path / 'missing'}", "x")
