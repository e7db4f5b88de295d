"""The `lazyfs` command as users run it (a real subprocess, real store)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.support import flip_byte, pack_path

# the console script installed next to the interpreter running the tests
LAZYFS = shutil.which("lazyfs", path=os.path.dirname(sys.executable)) or "lazyfs"


def run(*args: str, store: Path, ok: bool = True, env: dict[str, str] | None = None,
        **kw: object) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "LAZYFS_STORE": str(store), "LAZYFS_CONFIG": "/nonexistent",
                **(env or {})}
    proc = subprocess.run([LAZYFS, *args], check=False, capture_output=True, text=True, env=full_env,
                          timeout=120, **kw)  # type: ignore[call-overload]
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc  # type: ignore[no-any-return]


def test_help_lists_subcommands(tmp_path: Path) -> None:
    out = run("--help", store=tmp_path).stdout
    for word in ("demo", "store", "--store", "LAZYFS_STORE"):
        assert word in out
    out = run("store", "--help", store=tmp_path).stdout
    for word in ("put", "get", "verify", "gc", "info"):
        assert word in out


def test_demo_round_trips_a_tree_and_dedups_on_rerun(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.bin").write_bytes(os.urandom(300_000))
    (tree / "sub" / "copy.bin").write_bytes((tree / "a.bin").read_bytes())
    (tree / "text").write_text("hello\n" * 10_000)
    store = tmp_path / "store"
    first = run("demo", str(tree), "--chunk-size-kib", "64", store=store).stdout
    assert "round trip   OK" in first
    assert "3 files" in first
    assert "dedup        1.8" in first  # copy.bin is a duplicate of a.bin
    second = run("demo", str(tree), "--chunk-size-kib", "64", "--no-lazy", store=store).stdout
    assert "0 new to the store" in second and "everything deduplicated" in second
    assert "lazy image" not in second


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="needs root and /dev/fuse: the demo mounts an image lazily")
def test_demo_mounts_an_image_lazily(tmp_path: Path) -> None:
    from lazyfs import sysmount
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(5):
        (tree / f"big{i}.bin").write_bytes(os.urandom(2_000_000))
    out = run("demo", str(tree), "--lazy", store=tmp_path / "store").stdout
    assert "hello from a lazily loaded image" in out and "5 files in /data" in out
    fetched = re.search(r"fetched +([\d.]+) of ([\d.]+) MB", out)
    assert fetched, out
    # busybox and 100 kB of one file, not the 10 MB of data
    assert float(fetched[1]) < 0.5 * float(fetched[2])
    assert not [m for m in sysmount.mounts() if "lazyfs-demo-" in m.mount_point]


def test_put_get_stat_verify_gc(tmp_path: Path) -> None:
    store = tmp_path / "store"
    src = tmp_path / "file"
    src.write_bytes(os.urandom(200_000) + b"z" * 200_000)
    ids = run("store", "put", str(src), "--chunk-size", "100000", "--root", "f",
              store=store).stdout.split()
    assert len(ids) == 4
    out = tmp_path / "out"
    run("store", "get", *ids, "-o", str(out), store=store)
    assert out.read_bytes() == src.read_bytes()
    stat = run("store", "stat", ids[3], store=store).stdout
    assert "codec       zstd" in stat
    # the two all-"z" chunks are one chunk
    assert "checked 3 chunks" in run("store", "verify", store=store).stdout
    assert "f  3" in run("store", "roots", store=store).stdout
    gc = run("store", "gc", "--grace", "0", store=store).stdout
    assert "removed 0 of 3 chunks" in gc


def test_errors_are_one_line_with_exit_codes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    src = tmp_path / "file"
    src.write_bytes(os.urandom(50_000))
    (cid,) = run("store", "put", str(src), store=store).stdout.split()

    bad = run("store", "get", "nothex", store=store, ok=False)
    assert bad.returncode == 2 and "not a chunk id" in bad.stderr

    missing = "0" * 32
    nf = run("store", "get", missing, store=store, ok=False)
    assert nf.returncode == 1
    assert nf.stderr.strip() == f"lazyfs: error: chunk {missing} not found in trust domain trusted"

    nostore = run("store", "info", store=tmp_path / "nowhere", ok=False)
    assert nostore.returncode == 4 and "not a chunk store" in nostore.stderr
    assert "Traceback" not in nostore.stderr

    stat = run("store", "stat", cid, store=store).stdout
    pack = int(stat.split("pack")[1].split()[0], 16)
    offset = int(stat.split("offset")[1].split()[0])
    flip_byte(pack_path(store, pack), offset + 10)
    v = run("store", "verify", store=store, ok=False)
    assert v.returncode == 3 and f"BAD {cid}" in v.stdout
    g = run("store", "get", cid, store=store, ok=False)
    assert g.returncode == 1 and "is corrupt" in g.stderr and "Traceback" not in g.stderr
    dbg = run("--debug", "store", "get", cid, store=store, ok=False)
    assert "Traceback" in dbg.stderr


def test_config_file_and_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[store]\npath = "{tmp_path / "from-file"}"\nzstd_level = 5\n')
    env = {"LAZYFS_CONFIG": str(cfg)}
    src = tmp_path / "f"
    src.write_bytes(b"data" * 1000)
    full = {**os.environ, **env}
    full.pop("LAZYFS_STORE", None)
    subprocess.run([LAZYFS, "store", "put", str(src)], check=True, env=full,
                   capture_output=True)
    assert (tmp_path / "from-file" / "index").is_dir()
    cfg.write_text("[store]\nzstd_levle = 5\n")
    bad = subprocess.run([LAZYFS, "store", "info"], env=full, capture_output=True, text=True, check=False)
    assert bad.returncode == 1 and "unknown key store.zstd_levle" in bad.stderr
    cfg.write_text("[store]\nzstd_level = 99\n")
    bad = subprocess.run([LAZYFS, "store", "info"], env=full, capture_output=True, text=True, check=False)
    assert "zstd_level must be 1..22" in bad.stderr
    # the environment beats the file, the option beats the environment
    cfg.write_text(f'[store]\npath = "{tmp_path / "from-file"}"\n')
    run("store", "put", str(src), store=tmp_path / "from-env", env=env)
    assert (tmp_path / "from-env" / "index").is_dir()
    run("--store", str(tmp_path / "from-opt"), "store", "put", str(src),
        store=tmp_path / "from-env", env=env)
    assert (tmp_path / "from-opt" / "index").is_dir()


@pytest.mark.parametrize("args", [["store", "put", "/nonexistent/file"]])
def test_unreadable_input_is_named(tmp_path: Path, args: list[str]) -> None:
    p = run(*args, store=tmp_path / "s", ok=False)
    assert p.returncode != 0 and "/nonexistent/file" in p.stderr


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: image owners and devices")
def test_convert_images_inspect_export_rm_gc(tmp_path: Path) -> None:
    from tests.helpers.images import build_busybox_rootfs, tar_of
    from tests.helpers.treediff import diff_trees
    store = tmp_path / "store"
    root = build_busybox_rootfs(tmp_path / "rootfs")
    layer = tar_of(root, tmp_path / "layer.tar.gz", compression="gzip")
    out = run("convert", f"tar:{layer}", "--tag", "busybox:1", store=store).stdout
    assert out.startswith("busybox:1 blake3:") and "entries" in out
    mb = re.search(r"([\d.,]+) MB of file data", out)
    assert mb and float(mb[1]) > 1.0, out  # busybox alone is ~2 MB (stdout is not a tty)
    assert "busybox:1" in run("images", store=store).stdout
    missing = run("inspect", "busybox", store=store, ok=False)
    assert missing.returncode == 1 and "no image 'busybox'" in missing.stderr  # busybox:latest
    info = run("inspect", "busybox:1", store=store).stdout
    assert "layer 0" in info and "tar:" in info
    assert "with 0 other image(s)" in info
    run("export", "busybox:1", str(tmp_path / "out"), store=store)
    assert diff_trees(root, tmp_path / "out") == []
    # A related image: the same tree plus 2 MB of incompressible data.
    shutil.copytree(root, tmp_path / "rootfs2", symlinks=True)
    (tmp_path / "rootfs2" / "blob").write_bytes(os.urandom(2_000_000))
    run("convert", f"dir:{tmp_path / 'rootfs2'}", "--tag", "busybox:2", store=store)
    info = run("inspect", "busybox:2", store=store).stdout
    shared = re.search(r"shared  ([\d,]+) chunks, ([\d.,]+) MB \((\d+)%\) with 1 other", info)
    only = re.search(r"([\d.,]+) MB stored only for this image", info)
    assert shared and only, info
    busybox_mb = sum(p.stat().st_size for p in root.rglob("*")
                     if p.is_file() and not p.is_symlink()) / 1e6
    assert float(shared[2]) == pytest.approx(busybox_mb, rel=0.05)  # all of busybox
    assert float(only[1]) == pytest.approx(2.0, abs=0.1)  # just the new blob
    run("rm", "busybox:2", store=store)
    bad = run("convert", "tar:/nonexistent.tar", "--tag", "x", store=store, ok=False)
    assert bad.returncode == 1 and "does not exist" in bad.stderr
    run("rm", "busybox:1", store=store)
    assert run("images", store=store).stdout == ""
    gc = run("gc", "--grace", "0", store=store).stdout
    assert "dropped 2 unused layers" in gc
    assert "chunks      0" in run("store", "info", store=store).stdout


def test_cluster_setting_sources(tmp_path: Path) -> None:
    env = {"LAZYFS_CLUSTER": ""}
    p = run("push", "x:1", store=tmp_path / "s", ok=False, env=env)
    assert p.returncode == 1 and "no cluster store" in p.stderr
    cfg = tmp_path / "config.toml"
    cfg.write_text('[cluster]\nurl = "posix:///nonexistent-cluster-dir"\n')
    p = run("push", "x:1", store=tmp_path / "s", ok=False,
            env={**env, "LAZYFS_CONFIG": str(cfg)})
    assert "/nonexistent-cluster-dir" in p.stderr  # the file's URL was used
    cfg.write_text('[cluster]\nendpoint = "x"\n')
    p = run("push", "x:1", store=tmp_path / "s", ok=False,
            env={**env, "LAZYFS_CONFIG": str(cfg)})
    assert "unknown key cluster.endpoint" in p.stderr
    p = run("mount", "--help", store=tmp_path / "s")
    assert "--allow-devices" in p.stdout and "SPEC" in p.stdout


@pytest.mark.root
def test_the_cli_and_the_runtime_read_one_configuration(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A config file's [store] path is the embedded runtime's store too (the
    image exists only there), and with LAZYFS_NODE_ROOT set the runtime and
    `lazyfs mount` / `lazyfs umount` use one daemon at that root."""
    from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing
    why = runtime_missing()
    if why:
        pytest.skip(why)
    from lazyfs.mounts import stop_daemon
    from lazyfs.node import NodePaths, running, serving
    from runtime import Sandbox
    from runtime.config import RuntimeConfig
    from runtime.node import Node

    store = busybox_store(tmp_path)
    root = tmp_path / "node"
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[store]\npath = "{store}"\n\n'
                   f'[runtime]\nstate_dir = "{tmp_path / "state"}"\n')
    for k, v in {"LAZYFS_CONFIG": str(cfg), "LAZYFS_NODE_ROOT": str(root),
                 "LAZYFS_CLUSTER": ""}.items():
        monkeypatch.setenv(k, v)
    for k in ("LAZYFS_STORE", "LAZYFS_RUNTIME_DIR", "LAZYFS_CACHE"):
        monkeypatch.delenv(k, raising=False)
    cli_env = {k: v for k, v in os.environ.items() if k != "LAZYFS_STORE"}
    paths = NodePaths(root)
    mp = tmp_path / "mnt"
    mp.mkdir()
    node = Node(RuntimeConfig())  # every setting from the environment and the file
    try:
        assert (node.config.store, node.config.node_root) == (store, root)
        with Sandbox.create(IMAGE, node=node) as sb:  # the runtime starts the daemon
            assert sb.exec("cat /etc/motd").stdout == b"hello from the image\n"
        pid = paths.pidfile.read_text()
        assert serving(paths) == str(store)
        # the CLI finds the same store and the same daemon: it starts none
        p = subprocess.run([LAZYFS, "mount", IMAGE, str(mp)], env=cli_env, capture_output=True,
                           text=True, check=False, timeout=120)
        assert p.returncode == 0, p.stderr
        assert "started lazyfs daemon" not in p.stderr
        assert (mp / "etc" / "motd").read_text() == "hello from the image\n"
        assert paths.pidfile.read_text() == pid
        for target in (mp, paths.mnt):  # and stops it, at that root
            p = subprocess.run([LAZYFS, "umount", str(target)], env=cli_env,
                               capture_output=True, text=True, check=False, timeout=120)
            assert p.returncode == 0, p.stderr
        assert not running(paths)
    finally:
        node.close()
        if running(paths):
            stop_daemon(paths, lazy=True)


def test_rm_then_gc_says_what_the_grace_period_kept(tmp_path: Path) -> None:
    """`lazyfs rm` + `lazyfs gc` frees nothing within the grace period: gc
    says what it kept, why, and the command that reclaims it now, which does."""
    store = tmp_path / "store"
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "blob").write_bytes(os.urandom(3_000_000))
    run("convert", f"dir:{tree}", "--tag", "t:1", store=store)
    run("rm", "t:1", store=store)
    out = run("gc", store=store).stdout
    kept = re.search(r"^kept ([\d,]+) unreferenced chunks \(([\d.]+) MB in 1 pack\) written or "
                     r"used within the 3,600 s grace period \(all past it in (60|59) min\); "
                     r"`lazyfs gc --grace 0` reclaims them now", out, re.MULTILINE)
    assert kept and 3.0 <= float(kept[2]) < 3.1, out
    assert "kept" in run("store", "gc", store=store).stdout  # the same line, its own command
    now = run("gc", "--grace", "0", store=store).stdout
    assert "reclaimed 3.0 MB" in now and "kept" not in now, now
    assert "chunks      0" in run("store", "info", store=store).stdout


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="needs root and /dev/fuse: mounts an image")
def test_mount_refuses_a_non_empty_mountpoint_in_one_line(tmp_path: Path) -> None:
    """Mounting over files would hide them: `lazyfs mount` refuses, in one
    line and before starting a daemon, unless --nonempty; a missing mount
    point is one line too."""
    from lazyfs import sysmount
    from lazyfs.mounts import stop_daemon
    from lazyfs.node import NodePaths, running
    from tests.helpers.sandboxes import IMAGE, busybox_store
    store = busybox_store(tmp_path)
    paths = NodePaths(tmp_path / "node")
    env = {"LAZYFS_NODE_ROOT": str(paths.root), "LAZYFS_CACHE": str(tmp_path / "cache")}
    mp = tmp_path / "mnt"
    mp.mkdir()
    (mp / "notes.txt").write_text("mine\n")
    try:
        p = run("mount", IMAGE, str(mp), store=store, env=env, ok=False)
        assert p.returncode == 1 and p.stdout == ""
        assert p.stderr.splitlines() == [
            (f"lazyfs: error: mount point {mp} is not empty (1 entry): the mount would hide "
             "them; use an empty directory, or --nonempty to mount over them")]
        assert not running(paths)  # refused before anything started
        p = run("mount", IMAGE, str(tmp_path / "nowhere"), store=store, env=env, ok=False)
        assert p.returncode == 1 and p.stderr.splitlines() == [
            (f"lazyfs: error: mount point {tmp_path / 'nowhere'} does not exist "
             f"(create it with mkdir -p {tmp_path / 'nowhere'})")]
        run("mount", IMAGE, str(mp), "--nonempty", store=store, env=env)
        assert (mp / "etc" / "motd").read_text() == "hello from the image\n"
        assert not (mp / "notes.txt").exists()
        p = run("mount", IMAGE, str(mp), "--nonempty", store=store, env=env, ok=False)
        assert p.returncode == 1 and p.stderr.splitlines() == [
            f"lazyfs: error: {mp} is already a mount point"]
        run("umount", str(mp), store=store, env=env)
        assert (mp / "notes.txt").read_text() == "mine\n"
    finally:
        if sysmount.find_mount(mp) is not None:
            sysmount.umount(mp, lazy=True)
        if running(paths):
            stop_daemon(paths, lazy=True)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="needs root and /dev/fuse: the demo mounts an image lazily")
def test_demo_leaves_no_image_or_root_in_the_store(tmp_path: Path) -> None:
    """`lazyfs demo` removes its GC root and its image at the end and says how
    to free the chunks it wrote (which `lazyfs gc --grace 0` then does);
    --keep keeps both and says how to remove them."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.bin").write_bytes(os.urandom(2_000_000))
    store = tmp_path / "store"
    out = run("demo", str(tree), "--lazy", store=store).stdout
    assert "hello from a lazily loaded image" in out
    cleaned = re.search(rf"^cleaned up   removed GC root demo:{tree} and image demo:busybox; "
                        r"the ([\d.]+) MB this run wrote are freed by `lazyfs gc --grace 0`",
                        out, re.MULTILINE)
    assert cleaned and float(cleaned[1]) > 2.0, out
    assert run("store", "roots", store=store).stdout == ""
    assert run("images", store=store).stdout == ""
    assert "kept" not in run("gc", "--grace", "0", store=store).stdout
    assert "chunks      0" in run("store", "info", store=store).stdout

    out = run("demo", str(tree), "--lazy", "--keep", store=store).stdout
    assert (f"kept         GC root demo:{tree} and image demo:busybox; remove with "
            f"`lazyfs store rm-root demo:{tree}` and `lazyfs rm demo:busybox`") in out
    # (beside the roots of what the image is made of, its composition's included)
    assert f"demo:{tree}" in run("store", "roots", store=store).stdout.split()
    assert run("images", store=store).stdout.startswith("demo:busybox")
    run("store", "rm-root", f"demo:{tree}", store=store)
    run("rm", "demo:busybox", store=store)
    run("gc", "--grace", "0", store=store)
    assert "chunks      0" in run("store", "info", store=store).stdout
    p = run("store", "rm-root", "nope", store=store, ok=False)
    assert p.returncode == 1 and p.stderr.splitlines() == [
        "lazyfs: error: no GC root named 'nope' (`lazyfs store roots` lists them)"]
