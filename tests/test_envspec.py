"""Environments from independent layers: `lazyfs build SPEC`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
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


# -- the digest is what the sandbox sees -------------------------------------------------

def test_digest_depends_only_on_the_view(store: ChunkStore, cat: Catalog,
                                         tmp_path: Path) -> None:
    """The same spec under two file names (and two tags) builds one digest; a
    changed layer, mount point or order is another digest."""
    base = build_busybox_rootfs(tmp_path / "base")
    convert(store, cat, f"tar:{tar_of(base, tmp_path / 'base.tar')}", "busybox:1")
    ws = _tree(tmp_path / "ws", {"task.txt": b"task\n"})
    tk = _tree(tmp_path / "tk", {"bin/a": b"a\n"})
    tk2 = _tree(tmp_path / "tk2", {"bin/b": b"b\n"})
    text = (f'name = "env:1"\nbase = "busybox:1"\nworkspace = "dir:{ws}"\n'
            f'toolkits = [{{ source = "dir:{tk}", path = "/opt/a" }}, "dir:{tk2}"]\n')

    def digest_of(name: str, body: str) -> str:
        spec = tmp_path / "specs" / name
        spec.parent.mkdir(exist_ok=True)
        spec.write_text(body)
        return build(store, cat, load_spec(spec))[0]
    first = digest_of("env.toml", text)
    assert digest_of("env-copy.toml", text) == first
    assert digest_of("other.toml", text.replace('"env:1"', '"other:7"')) == first
    assert cat.resolve("other:7")[0] == cat.resolve("env:1")[0] == first
    # the same tree from another place is the same layer, hence the same image
    shutil.copytree(tk2, tmp_path / "tk2-copy", copy_function=shutil.copy2)
    os.utime(tmp_path / "tk2-copy", ns=(0, os.stat(tk2).st_mtime_ns))
    assert digest_of("moved.toml", text.replace(f"dir:{tk2}", f"dir:{tmp_path}/tk2-copy")) \
        == first
    # what the sandbox sees changes: so does the digest
    changed = {
        digest_of("mount.toml", text.replace('path = "/opt/a"', 'path = "/opt/b"')),
        digest_of("order.toml", text.replace(
            f'toolkits = [{{ source = "dir:{tk}", path = "/opt/a" }}, "dir:{tk2}"]',
            f'toolkits = ["dir:{tk2}", {{ source = "dir:{tk}", path = "/opt/a" }}]')),
        digest_of("nows.toml", text.replace(f'workspace = "dir:{ws}"\n', "")),
    }
    (tk2 / "bin" / "b").write_bytes(b"b, changed\n")
    changed.add(digest_of("layer.toml", text))
    assert first not in changed and len(changed) == 4


# -- docs/envspec.md: the example runs as written ------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_docs_example_builds_as_written(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "envspec.md").read_text()
    spec_text = _blocks(doc, "toml")[0]
    commands = [shlex.split(line, comments=True)
                for line in _blocks(doc, "sh")[0].splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["lazyfs", "convert"], ["lazyfs", "build"],
                                         ["lazyfs", "build"], ["lazyfs", "export"]]
    # the directory the example describes
    env_dir = tmp_path / "myenv"
    build_busybox_rootfs(env_dir / "rootfs")
    repo = _tree(env_dir / "task-42", {"run.sh": b"#!/bin/sh\necho task 42\n"})
    (repo / "run.sh").chmod(0o755)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "task")
    py = _tree(env_dir / "tools" / "py", {"bin/py-tool": b"#!/bin/sh\necho py tool\n"})
    (py / "bin" / "py-tool").chmod(0o755)
    node = _tree(tmp_path / "node", {"bin/node": b"#!/bin/sh\necho node\n"})
    (node / "bin" / "node").chmod(0o755)
    tar_of(node, env_dir / "node.tar.gz", compression="gzip")
    (env_dir / "env.toml").write_text(spec_text)
    env = {**os.environ, "LAZYFS_STORE": str(tmp_path / "store"), "LAZYFS_CONFIG": "/nonexistent",
           "LAZYFS_CLUSTER": "", "PYTHONPATH": str(REPO)}
    outs = []
    for argv in commands:
        p = subprocess.run([sys.executable, "-m", "tools.cli", *argv[1:]], cwd=env_dir, env=env,
                           capture_output=True, text=True, timeout=300, check=False)
        assert p.returncode == 0, (argv, p.stderr)
        outs.append(p.stdout)
    digest = outs[1].split()[1]
    assert outs[1].startswith("task-42:1 blake3:") and outs[2].split()[1] == digest
    assert "0 layers converted now, 0 new chunks" in outs[2]
    lock = json.loads((env_dir / "env.toml.lock.json").read_text())
    assert sorted(lock) == ["busybox:1 -> /", "dir:tools/py -> /",
                            "git:task-42#main -> /workspace", "tar:node.tar.gz -> /opt/node"]
    out = env_dir / "out"
    assert chroot_run(out, "/workspace/run.sh").stdout == "task 42\n"
    assert chroot_run(out, "/bin/py-tool").stdout == "py tool\n"
    assert chroot_run(out, "/opt/node/bin/node").stdout == "node\n"
    # built from elsewhere, under another file name: the same digest
    copy = tmp_path / "elsewhere" / "env-copy.toml"
    copy.parent.mkdir()
    copy.write_text(spec_text.replace('"git:task-42#main"', f'"git:{env_dir}/task-42#main"')
                    .replace('"dir:tools/py"', f'"dir:{env_dir}/tools/py"')
                    .replace('"tar:node.tar.gz"', f'"tar:{env_dir}/node.tar.gz"'))
    p = subprocess.run([sys.executable, "-m", "tools.cli", "build", str(copy)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[1] == digest
