"""The tree differ catches every kind of difference, and the image builders
build what they claim (tests/helpers/treediff.py, tests/helpers/images.py).

The 10,000-entry directory is built only with LAZYFS_BIG_IMAGES=1."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import images
from tests.helpers.images import (
    CAP_NET_RAW_EP,
    DIR_NS_MTIME,
    EPOCH_NS,
    FUTURE_MTIME,
    LONG_NAME,
    LONG_UTF8_NAME,
    MIB,
    NS_ATIME,
    NS_MTIME,
    ODD_NAMES,
    SPARSE_DATA_AT,
    SPARSE_DATA_LEN,
    SPARSE_SIZE,
    ImageBuildError,
    add_special_files,
    build_busybox_rootfs,
    chroot_run,
    extract_layers,
    list_members,
    tar_of,
    whiteout_layer,
)
from tests.helpers.support import IS_ROOT, root_only
from tests.helpers.treediff import data_extents, diff_trees, format_diffs, read_xattrs, tree_summary

BIG = os.environ.get("LAZYFS_BIG_IMAGES") == "1"
F = Callable[..., Any]


def cp_a(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


@contextmanager
def times_kept(*dirs: Path) -> Iterator[None]:
    """Restore the directories' atime/mtime after changing their entries."""
    saved = [(d, os.lstat(d)) for d in dirs]
    yield
    for d, st in saved:
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def assert_same(a: Path, b: Path, **kw: Any) -> None:
    diffs = diff_trees(a, b, **kw)
    assert diffs == [], (f"{a} {tree_summary(a)}\n{b} {tree_summary(b)}\n"
                         + format_diffs(diffs))


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """busybox rootfs + special files (no big directory), built once; copy before changing."""
    root = build_busybox_rootfs(tmp_path_factory.mktemp("image") / "rootfs")
    add_special_files(root, big_dir=False)
    return root


@pytest.fixture
def pair(image: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The shared image (left alone) and a copy of it to change."""
    return image, cp_a(image, tmp_path / "b")


# --------------------------------------------------------------------------
# the differ


def test_cp_a_copy_is_identical(image: Path, tmp_path: Path) -> None:
    assert_same(image, cp_a(image, tmp_path / "copy"), check_holes=True,
                check_symlink_mtime=True)


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_tar_round_trip_is_identical(image: Path, tmp_path: Path, compression: str) -> None:
    tar = tar_of(image, tmp_path / "layer.tar", compression=compression)
    out = extract_layers([tar], tmp_path / "out")
    assert_same(image, out, check_holes=True, check_symlink_mtime=True)


def test_plain_gnu_tar_round_trip_is_identical(image: Path, tmp_path: Path) -> None:
    tar = tar_of(image, tmp_path / "layer.tar")
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*",
                    "--same-permissions", "--warning=no-timestamp", "-C", str(out),
                    "-xf", str(tar)], check=True)
    assert_same(image, out, check_holes=True)


def _chmod(p: Path) -> None:
    os.chmod(p / "posix/perms/setuid", 0o755)


def _unsticky(p: Path) -> None:
    os.chmod(p / "posix/perms/sticky", 0o777)


def _root_mode(p: Path) -> None:
    os.chmod(p, 0o700)


def _uid(p: Path) -> None:
    os.chown(p / "posix/owners/file", 1235, 4321)


def _gid(p: Path) -> None:
    os.chown(p / "posix/owners/dir", 1234, 4322)


def _link_owner(p: Path) -> None:
    os.chown(p / "posix/owners/link", 0, 4321, follow_symlinks=False)


def _mtime_ns(p: Path) -> None:
    os.utime(p / "posix/times/ns_file", ns=(NS_ATIME, NS_MTIME + 1))


def _dir_mtime(p: Path) -> None:
    os.utime(p / "posix/times/ns_dir", ns=(DIR_NS_MTIME, DIR_NS_MTIME - 1000))


def _flip(p: Path) -> None:
    f = p / "posix/sizes/random_3mib"
    st = os.stat(f)
    with open(f, "r+b") as fh:
        fh.seek(2_000_000)
        b = fh.read(1)
        fh.seek(2_000_000)
        fh.write(bytes([b[0] ^ 1]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def _grow(p: Path) -> None:
    f = p / "posix/sizes/one_mib"
    st = os.stat(f)
    with open(f, "ab") as fh:
        fh.write(b"\0")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def _xattr_value(p: Path) -> None:
    os.setxattr(p / "posix/xattr/user", "user.test", b"valuE")


def _xattr_added(p: Path) -> None:
    os.setxattr(p / "posix/xattr/dir", "user.extra", b"1")


def _xattr_removed(p: Path) -> None:
    os.removexattr(p / "posix/xattr/user", "user.test")


def _cap_removed(p: Path) -> None:
    os.removexattr(p / "posix/xattr/cap", "security.capability")


def _retarget(p: Path) -> None:
    link = p / "posix/symlinks/rel"
    with times_kept(link.parent):
        link.unlink()
        os.symlink("../sizes/one_mib", link)
        os.utime(link, ns=(EPOCH_NS, EPOCH_NS), follow_symlinks=False)


def _unlink_hardlink(p: Path) -> None:
    two = p / "posix/links/two"
    with times_kept(two.parent):
        two.unlink()
        shutil.copy2(p / "posix/links/one", two)


def _rdev(p: Path) -> None:
    dev = p / "posix/dev/chr"
    with times_kept(dev.parent):
        dev.unlink()
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 5))
        os.chmod(dev, 0o666)
        os.utime(dev, ns=(EPOCH_NS, EPOCH_NS))


def _extra(p: Path) -> None:
    with times_kept(p / "etc"):
        (p / "etc/extra").write_bytes(b"")


def _missing(p: Path) -> None:
    with times_kept(p / "etc"):
        (p / "etc/hostname").unlink()


def _dir_to_file(p: Path) -> None:
    d = p / "posix/deep"
    with times_kept(d.parent):
        shutil.rmtree(d)
        d.write_bytes(b"")


MUTATIONS: list[tuple[Callable[[Path], None], str, bool]] = [
    (_chmod, "posix/perms/setuid: mode 0o104755 != 0o100755", False),
    (_unsticky, "posix/perms/sticky: mode 0o41777 != 0o40777", False),
    (_root_mode, ".: mode 0o40755 != 0o40700", False),
    (_uid, "posix/owners/file: uid 1234 != 1235", True),
    (_gid, "posix/owners/dir: gid 4321 != 4322", True),
    (_link_owner, "posix/owners/link: uid 1234 != 0", True),
    (_mtime_ns, "posix/times/ns_file: mtime 1600000000.123456789 != 1600000000.123456790",
     False),
    (_dir_mtime, "posix/times/ns_dir: mtime 1650000000.000000001 != 1649999999.999999001",
     False),
    (_flip, "posix/sizes/random_3mib: content differs at byte 2000000", False),
    (_grow, f"posix/sizes/one_mib: size {MIB} != {MIB + 1}", False),
    (_xattr_value, "posix/xattr/user: xattr user.test b'value' != b'valuE'", False),
    (_xattr_added, "posix/xattr/dir: xattr user.extra only in b (b'1')", False),
    (_xattr_removed, "posix/xattr/user: xattr user.test only in a (b'value')", False),
    (_cap_removed, f"posix/xattr/cap: xattr security.capability only in a ({CAP_NET_RAW_EP!r})",
     True),
    (_retarget, "posix/symlinks/rel: symlink target '../sizes/empty' != '../sizes/one_mib'",
     False),
    (_unlink_hardlink, ("posix/elsewhere/three: hardlink group ['posix/elsewhere/three', "
                        "'posix/links/one', 'posix/links/two'] != "
                        "['posix/elsewhere/three', 'posix/links/one']"), False),
    (_rdev, "posix/dev/chr: rdev 1:3 != 1:5", True),
    (_extra, "etc/extra: only in b (regular file)", False),
    (_missing, "etc/hostname: only in a (regular file)", False),
    (_dir_to_file, "posix/deep: type directory != regular file", False),
]


@pytest.mark.parametrize("mutate,expected,root", MUTATIONS,
                         ids=[m[0].__name__.strip("_") for m in MUTATIONS])
def test_differ_reports_exactly_the_change(pair: tuple[Path, Path],
                                           mutate: Callable[[Path], None], expected: str,
                                           root: bool) -> None:
    if root and not IS_ROOT:
        pytest.skip("needs root (owners, devices, capabilities)")
    a, b = pair
    assert diff_trees(a, b) == []
    mutate(b)
    diffs = diff_trees(a, b)
    want = [expected]
    if mutate is _unlink_hardlink:  # seen from the copy's side too
        want.append("posix/links/two: hardlink group ['posix/elsewhere/three', "
                    "'posix/links/one', 'posix/links/two'] != ['posix/links/two']")
    assert diffs == want, format_diffs(diffs)


def test_broken_hardlink_is_reported_from_both_sides(pair: tuple[Path, Path]) -> None:
    a, b = pair
    _unlink_hardlink(b)
    assert any("hardlink group" in d for d in diff_trees(b, a))


def test_in_tree_link_count(pair: tuple[Path, Path]) -> None:
    a, b = pair
    with times_kept(b / "posix/elsewhere"):
        (b / "posix/elsewhere/three").unlink()
    assert diff_trees(a, b) == ["posix/elsewhere/three: only in a (regular file)",
                                "posix/links/one: nlink(in tree) 3 != 2"]


def test_symlink_mtime_only_when_asked(pair: tuple[Path, Path]) -> None:
    a, b = pair
    os.utime(b / "posix/symlinks/abs", ns=(1, 1), follow_symlinks=False)
    assert diff_trees(a, b) == []
    assert diff_trees(a, b, check_symlink_mtime=True) == [
        "posix/symlinks/abs: mtime 1700000000.000000000 != 0.000000001"]
    assert diff_trees(a, b, check_mtime=False, check_symlink_mtime=True) == []


def test_atime_only_when_asked(tmp_path: Path) -> None:
    trees = []
    for name in ("a", "b"):
        t = tmp_path / name
        (t / "d").mkdir(parents=True)
        (t / "d/f").write_bytes(b"f")
        images._stamp(t, EPOCH_NS)
        trees.append(t)
    a, b = trees
    assert diff_trees(a, b, check_atime=True) == []
    assert diff_trees(a, b, check_atime=True) == []  # walking and reading keep atimes
    os.utime(b / "d/f", ns=(NS_ATIME, EPOCH_NS))
    os.utime(b / "d", ns=(NS_ATIME, EPOCH_NS))
    assert diff_trees(a, b) == []
    assert diff_trees(a, b, check_atime=True) == [
        "d: atime 1700000000.000000000 != 1600000001.987654321",
        "d/f: atime 1700000000.000000000 != 1600000001.987654321"]


def test_holes_only_when_asked(pair: tuple[Path, Path]) -> None:
    a, b = pair
    with times_kept(b / "posix"):
        sparse = b / "posix/sizes/sparse"
        st = os.lstat(sparse)
        fd = os.open(sparse, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(4096), 0)  # same bytes, but now stored: no hole there
        finally:
            os.close(fd)
        os.utime(sparse, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert diff_trees(a, b) == []
    data = (SPARSE_DATA_AT, SPARSE_DATA_AT + SPARSE_DATA_LEN)
    assert diff_trees(a, b, check_holes=True) == [
        f"posix/sizes/sparse: data extents {[data]} != {[(0, 4096), data]}"]


def test_only_the_top_of_a_missing_subtree_is_listed(pair: tuple[Path, Path]) -> None:
    a, b = pair
    with times_kept(b / "posix"):
        shutil.rmtree(b / "posix/deep")
    assert diff_trees(a, b) == ["posix/deep: only in a (directory)"]
    assert diff_trees(b, a) == ["posix/deep: only in b (directory)"]


def test_odd_names_are_shown_readably(pair: tuple[Path, Path]) -> None:
    a, b = pair
    with times_kept(b / "posix/names"):
        (b / "posix/names/new\nline").unlink()
    assert diff_trees(a, b) == ["'posix/names/new\\nline': only in a (regular file)"]


def test_ignore_xattrs_and_root(pair: tuple[Path, Path]) -> None:
    a, b = pair
    os.setxattr(b / "etc/passwd", "user.label", b"x")
    os.chmod(b, 0o711)
    assert diff_trees(a, b, ignore_xattrs=["user.label"], check_root=False) == []


def test_not_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        diff_trees(f, tmp_path)


def test_tree_summary(image: Path) -> None:
    s = tree_summary(image)
    assert s["symlinks"] == len(images.BUSYBOX_APPLETS) + 5
    assert s["hardlinked_inodes"] == 1
    assert s["fifos"] == 1
    if IS_ROOT:
        assert s["char_devices"] == 1 and s["block_devices"] == 1
        assert s["with_xattrs"] == 3
    assert s["apparent_bytes"] > SPARSE_SIZE + 5 * MIB
    assert s["entries"] == sum(s[k] for k in ("dirs", "files", "symlinks", "char_devices",
                                              "block_devices", "fifos", "sockets"))


def test_format_diffs_limits() -> None:
    assert format_diffs([str(i) for i in range(5)], limit=2) == "0\n1\n... and 3 more"


# --------------------------------------------------------------------------
# the builders


def test_busybox_rootfs(tmp_path: Path) -> None:
    root = build_busybox_rootfs(tmp_path / "r")
    assert images._is_static_elf(root / "bin/busybox")
    assert os.access(root / "bin/busybox", os.X_OK)
    for applet in images.BUSYBOX_APPLETS:
        assert os.readlink(root / "bin" / applet) == "busybox"
    for rel, mode in images.ROOTFS_DIRS.items():
        st = os.lstat(root / rel)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == mode, rel
    assert (root / "etc/passwd").read_bytes().startswith(b"root:x:0:0:")
    assert (root / "etc/group").read_bytes().startswith(b"root:x:0:")
    assert (root / "etc/hostname").read_bytes() == b"busybox-test\n"
    assert {os.lstat(p).st_mtime_ns for p in [root, *root.rglob("*")]} == {EPOCH_NS}
    assert_same(root, build_busybox_rootfs(tmp_path / "again"))


def test_busybox_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setattr(images, "BUSYBOX_CANDIDATES", (str(tmp_path / "nope"),))
    with pytest.raises(ImageBuildError, match="apt-get install busybox-static"):
        build_busybox_rootfs(tmp_path / "r")


@root_only
def test_busybox_runs_in_chroot(image: Path) -> None:
    p = chroot_run(image, "sh", "-c", "echo hi; id -u; ls /posix/links | wc -l")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["hi", "0", "2"]


@root_only
def test_special_files(image: Path) -> None:
    p = image / "posix"

    def mode(rel: str) -> int:
        return os.lstat(p / rel).st_mode

    assert mode("perms/setuid") == stat.S_IFREG | 0o4755
    assert mode("perms/setgid") == stat.S_IFREG | 0o2755
    assert mode("perms/sticky") == stat.S_IFDIR | 0o1777
    assert mode("perms/setgid_dir") == stat.S_IFDIR | 0o2775
    assert mode("perms/none") == stat.S_IFREG
    for rel in ("owners/file", "owners/dir", "owners/link"):
        st = os.lstat(p / rel)
        assert (st.st_uid, st.st_gid) == (1234, 4321), rel
    assert os.lstat(p / "times/ns_file").st_mtime_ns == NS_MTIME  # atime: see reproducible
    assert os.lstat(p / "times/ns_dir").st_mtime_ns == DIR_NS_MTIME
    assert os.lstat(p / "times/epoch0").st_mtime_ns == 0
    assert os.lstat(p / "times/future").st_mtime_ns == FUTURE_MTIME
    inodes = {os.lstat(p / r).st_ino for r in ("links/one", "links/two", "elsewhere/three")}
    assert len(inodes) == 1 and os.lstat(p / "links/one").st_nlink == 3
    chr_, blk = os.lstat(p / "dev/chr"), os.lstat(p / "dev/blk")
    assert stat.S_ISCHR(chr_.st_mode) and chr_.st_rdev == os.makedev(1, 3)
    assert stat.S_ISBLK(blk.st_mode) and blk.st_rdev == os.makedev(7, 0)
    assert stat.S_ISFIFO(mode("dev/fifo"))
    assert read_xattrs(p / "xattr/user") == {"user.test": b"value"}
    assert read_xattrs(p / "xattr/dir") == {"user.test": b"dir value"}
    assert read_xattrs(p / "xattr/cap") == {"security.capability": CAP_NET_RAW_EP}
    assert CAP_NET_RAW_EP == b"\x01\x00\x00\x02" + b"\x00\x20\x00\x00" + bytes(12)
    getcap = shutil.which("getcap")
    if getcap:
        out = subprocess.run([getcap, str(p / "xattr/cap")], capture_output=True, text=True,
                             check=True)
        assert "cap_net_raw=ep" in out.stdout
    assert os.readlink(p / "symlinks/abs") == "/etc/passwd"
    assert (p / "symlinks/rel").resolve() == (p / "sizes/empty").resolve()
    assert not (p / "symlinks/dangling").exists() and (p / "symlinks/dangling").is_symlink()
    sizes = {f.name: f.stat().st_size for f in (p / "sizes").iterdir()}
    assert sizes == {"empty": 0, "one_mib": MIB, "one_mib_plus_one": MIB + 1,
                     "random_3mib": 3 * MIB, "sparse": SPARSE_SIZE}
    assert data_extents(p / "sizes/sparse") == [(SPARSE_DATA_AT,
                                                 SPARSE_DATA_AT + SPARSE_DATA_LEN)]
    assert os.lstat(p / "sizes/sparse").st_blocks * 512 < MIB
    leaf = next((p / "deep").rglob("leaf"))
    assert len(leaf.relative_to(p / "deep").parts) == 41
    names = set(os.listdir(p / "names"))
    assert names == set(ODD_NAMES)
    assert len(LONG_NAME.encode()) == 255 and len(LONG_UTF8_NAME.encode()) == 255
    assert not (p / "big").exists()


def test_special_files_are_reproducible(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        add_special_files(d, big_dir=False)
        os.utime(d, ns=(EPOCH_NS, EPOCH_NS))
    assert os.lstat(a / "posix/times/ns_file").st_atime_ns == NS_ATIME
    assert_same(a, b, check_symlink_mtime=True, check_holes=True, check_atime=True)
    # sparse formats 0.1 and 1.0 put tar's PID in a member name; 0.0 does not
    ta = tar_of(a, tmp_path / "a.tar", sparse_version="0.0")
    tb = tar_of(b, tmp_path / "b.tar", sparse_version="0.0")
    assert ta.read_bytes() == tb.read_bytes()
    assert_same(a, extract_layers([ta], tmp_path / "out"), check_holes=True)


def test_tar_without_sparse_is_reproducible(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    with open(src / "d/holes", "wb") as f:
        f.truncate(MIB)
        f.seek(MIB // 2)
        f.write(b"data")
    images._stamp(src, EPOCH_NS)
    ta = tar_of(src, tmp_path / "a.tar", sparse=False)
    tb = tar_of(src, tmp_path / "b.tar", sparse=False)
    assert ta.read_bytes() == tb.read_bytes()
    out = extract_layers([ta], tmp_path / "out")
    assert_same(src, out)
    holes = diff_trees(src, out, check_holes=True)
    assert holes == [f"d/holes: data extents {[(MIB // 2, MIB // 2 + 4096)]} != {[(0, MIB)]}"]


@root_only
def test_tar_carries_the_metadata(image: Path, tmp_path: Path) -> None:
    tar = tar_of(image, tmp_path / "l.tar")
    with tarfile.open(tar) as tf:
        members = {m.name: m for m in tf.getmembers()}
    assert next(iter(members)) == "."
    cap = members["./posix/xattr/cap"]
    assert cap.pax_headers["SCHILY.xattr.security.capability"].encode(
        "utf-8", "surrogateescape") == CAP_NET_RAW_EP
    assert members["./posix/times/ns_file"].pax_headers["mtime"] == "1600000000.123456789"
    assert "atime" not in members["./posix/times/ns_file"].pax_headers
    assert members["./posix/sizes/sparse"].pax_headers["GNU.sparse.realsize"] == str(SPARSE_SIZE)
    assert members["./posix/owners/file"].uid == 1234 and members["./posix/owners/file"].uname == ""
    assert members["./posix/dev/chr"].ischr() and members["./posix/dev/chr"].devminor == 3
    assert members["./posix/links/two"].islnk() or members["./posix/links/one"].islnk()
    assert tar.stat().st_size < 20 * MIB  # the 64 MiB sparse file is stored as its data
    assert list_members(tar) == [n.removeprefix("./") for n in members]


def test_tar_of_rejects_unknown_compression(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression"):
        tar_of(tmp_path, tmp_path / "x.tar", compression="bzip2")


def test_tar_of_zstd_without_the_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d/f").write_bytes(b"hello " * 1000)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which",  # the module images uses
                        lambda name, *a, **k: None if name == "zstd" else real_which(name))
    tar = tar_of(src, tmp_path / "l.tar.zst", compression="zstd")
    assert tar.read_bytes()[:4] == images.ZSTD_MAGIC
    assert_same(src, extract_layers([tar], tmp_path / "out"))


# --------------------------------------------------------------------------
# layers and whiteouts (extract_layers is the reference)


def _expected_after_upper(lower: Path, dest: Path) -> Path:
    """What lower + the upper layer of test_whiteouts must give, made by hand."""
    exp = cp_a(lower, dest)
    p = exp / "posix"
    with times_kept(exp / "etc", p, p / "links", p / "names", p / "sizes"):
        (exp / "etc/hostname").unlink()
        (p / "links/two").unlink()
        shutil.rmtree(p / "deep")
        for f in (p / "names").iterdir():
            f.unlink()
        for rel, data in {"posix/names/new": b"new\n", "etc/motd": b"hello\n",
                          "posix/sizes/one_mib": b"replaced\n"}.items():
            (exp / rel).unlink(missing_ok=True)
            (exp / rel).write_bytes(data)
            os.chmod(exp / rel, 0o644)
            os.utime(exp / rel, ns=(EPOCH_NS, EPOCH_NS))
    return exp


@root_only
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_whiteouts(image: Path, tmp_path: Path, compression: str) -> None:
    lower = tar_of(image, tmp_path / "lower.tar", compression=compression)
    upper_dir = whiteout_layer(
        tmp_path / "upper", remove=["etc/hostname", "posix/links/two", "posix/deep"],
        opaque=["posix/names"],
        add={"posix/names/new": b"new\n", "etc/motd": b"hello\n",
             "posix/sizes/one_mib": b"replaced\n"},
        like=image)
    assert (upper_dir / "etc/.wh.hostname").read_bytes() == b""
    assert (upper_dir / "posix/names/.wh..wh..opq").exists()
    upper = tar_of(upper_dir, tmp_path / "upper.tar", compression=compression)
    out = extract_layers([lower, upper], tmp_path / "out")
    assert not [p for p in out.rglob(".wh.*")]
    assert os.listdir(out / "posix/names") == ["new"]  # opaque keeps the layer's own file
    assert os.lstat(out / "posix/links/one").st_nlink == 2
    assert_same(_expected_after_upper(image, tmp_path / "expected"), out, check_holes=True)


@root_only
def test_replacing_a_hardlinked_file_makes_a_new_inode(image: Path, tmp_path: Path) -> None:
    lower = tar_of(image, tmp_path / "lower.tar")
    upper = tar_of(whiteout_layer(tmp_path / "u", add={"posix/links/one": b"new one\n"},
                                  like=image), tmp_path / "upper.tar")
    out = extract_layers([lower, upper], tmp_path / "out")
    assert (out / "posix/links/one").read_bytes() == b"new one\n"
    assert (out / "posix/links/two").read_bytes() == b"three names, one inode\n"
    assert os.lstat(out / "posix/links/two").st_nlink == 2
    assert os.lstat(out / "posix/links/one").st_nlink == 1


def test_layer_order_and_type_changes(tmp_path: Path) -> None:
    base = tmp_path / "l1"
    (base / "d/sub").mkdir(parents=True)
    (base / "d/sub/x").write_bytes(b"x")
    (base / "f").write_bytes(b"f")
    (base / "keep").write_bytes(b"keep")
    l1 = tar_of(base, tmp_path / "l1.tar")
    # layer 2: delete f, turn directory d into a file, and add f2
    l2dir = whiteout_layer(tmp_path / "l2", remove=["f"], add={"f2": b"2"})
    (l2dir / "d").write_bytes(b"d is a file now")
    l2 = tar_of(l2dir, tmp_path / "l2.tar", compression="gzip")
    # layer 3: f comes back, d becomes a directory again, f2 deleted
    l3dir = whiteout_layer(tmp_path / "l3", remove=["f2"], add={"f": b"f again", "d/y": b"y"})
    l3 = tar_of(l3dir, tmp_path / "l3.tar", compression="zstd")
    out = extract_layers([l1, l2, l3], tmp_path / "out")
    got = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert got == {"f": b"f again", "d/y": b"y", "keep": b"keep"}
    assert (out / "d").is_dir() and not (out / "d/sub").exists()


def test_layer_without_directory_entries_keeps_their_metadata(tmp_path: Path) -> None:
    base = tmp_path / "l1"
    (base / "etc").mkdir(parents=True)
    (base / "etc/a").write_bytes(b"a")
    os.chmod(base / "etc", 0o750)
    os.chmod(base, 0o755)
    images._stamp(base, 1_000_000_000_000_000_007)
    l1 = tar_of(base, tmp_path / "l1.tar")
    # a layer listing only etc/b: no "./" and no "etc/" entries
    src = tmp_path / "l2src"
    (src / "etc").mkdir(parents=True)
    (src / "etc/b").write_bytes(b"b")
    (src / "etc/.wh.a").write_bytes(b"")
    l2 = tmp_path / "l2.tar"
    subprocess.run(["tar", "--format=posix", "-C", str(src), "-cf", str(l2), "etc/b",
                    "etc/.wh.a"], check=True)
    assert list_members(l2) == ["etc/b", "etc/.wh.a"]
    out = extract_layers([l1, l2], tmp_path / "out")
    assert sorted(os.listdir(out / "etc")) == ["b"]
    for rel in (".", "etc"):
        st_out, st_base = os.lstat(out / rel), os.lstat(base / rel)
        assert st_out.st_mode == st_base.st_mode, rel
        assert st_out.st_mtime_ns == st_base.st_mtime_ns == 1_000_000_000_000_000_007, rel


def test_extract_into_non_empty_dir_fails(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out/x").write_bytes(b"")
    with pytest.raises(ImageBuildError, match="not empty"):
        extract_layers([], tmp_path / "out")


@pytest.mark.slow
@pytest.mark.skipif(not BIG, reason="set LAZYFS_BIG_IMAGES=1 for the 10,000-entry directory")
def test_big_directory_round_trip(tmp_path: Path) -> None:
    root = build_busybox_rootfs(tmp_path / "r")
    add_special_files(root, big_dir=True)
    assert len(os.listdir(root / "posix/big")) == images.BIG_DIR_ENTRIES
    assert (root / "posix/big/f09999").read_bytes() == b"f09999\n"
    tar = tar_of(root, tmp_path / "l.tar", compression="zstd")
    assert_same(root, extract_layers([tar], tmp_path / "out"), check_holes=True)
