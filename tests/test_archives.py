"""put_archive / get_archive (runtime/files.py) against hostile archives and a
hostile sandbox, on a real directory tree as a sandbox's root: names that
leave it, links that point out, a sandbox swapping a symlink in while a
file is unpacked (the swap is injected at the worst moment: a sandbox does
it with inotify, a test cannot time that), bombs of entries and of
compression. Every refusal leaves nothing written."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from runtime import files as files_module
from runtime.errors import FileError
from runtime.files import SandboxFiles

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (owners, /proc links)")


def _tar(*entries: tuple[str, bytes | None, dict[str, object]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, attrs in entries:
            info = tarfile.TarInfo(name)
            for k, v in attrs.items():
                setattr(info, k, v)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def box(tmp_path: Path) -> tuple[SandboxFiles, Path, Path]:
    root = tmp_path / "root"
    (root / "work").mkdir(parents=True)
    canary = tmp_path / "host-secret"
    canary.write_text("host's own\n")
    canary.chmod(0o600)
    return SandboxFiles(root), root, canary


def test_a_symlink_swapped_in_while_a_file_is_unpacked_touches_no_host_file(
        box: tuple[SandboxFiles, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    files, root, canary = box
    real_copy = shutil.copyfileobj

    def copy_then_swap(src: Any, dst: Any, length: int = 0) -> None:
        real_copy(src, dst, length)
        # the sandbox: a symlink to a host file renamed over the temporary file
        for name in os.listdir(root / "work"):
            if name.endswith(".tmp"):
                os.symlink(str(canary), root / "work" / "evil")
                os.rename(root / "work" / "evil", root / "work" / name)

    monkeypatch.setattr(shutil, "copyfileobj", copy_then_swap)
    files.put_archive("/work", _tar(("f.txt", b"data\n", {"mode": 0o4777, "uid": 0,
                                                          "mtime": 1})))
    st = os.stat(canary)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_mtime > 1000
    assert canary.read_text() == "host's own\n"


def test_names_and_links_that_leave_are_refused_whole(
        box: tuple[SandboxFiles, Path, Path]) -> None:
    files, root, canary = box
    before = _tree(root)
    for hostile in (
        _tar(("ok.txt", b"ok", {}), ("../escape", b"x", {})),
        _tar(("ok.txt", b"ok", {}), ("a/../../escape", b"x", {})),
        _tar(("ok.txt", b"ok", {}), ("dev", None, {"type": tarfile.CHRTYPE,
                                                     "devmajor": 1, "devminor": 3})),
        _tar(("ok.txt", b"ok", {}), ("hl", None, {"type": tarfile.LNKTYPE,
                                                    "linkname": str(canary)})),
        _tar(("ok.txt", b"ok", {}), ("hl", None, {"type": tarfile.LNKTYPE,
                                                    "linkname": "../../host-secret"})),
        b"not a tar at all" * 100,
    ):
        with pytest.raises(FileError):
            files.put_archive("/work", hostile)
        assert _tree(root) == before  # nothing of it written
    # a symlink entry is made as a symlink (it resolves inside the root later)
    files.put_archive("/work", _tar(("ln", None, {"type": tarfile.SYMTYPE,
                                                  "linkname": str(canary)})))
    assert os.readlink(root / "work" / "ln") == str(canary)
    # writing "through" it stays in the root: the link is resolved there
    (root / "etc").mkdir()
    files.put_archive("/work", _tar(("ln2", None, {"type": tarfile.SYMTYPE,
                                                   "linkname": "/etc"})))
    files.put_archive("/work/ln2", _tar(("planted", b"in the sandbox's /etc", {})))
    assert (root / "etc" / "planted").read_bytes() == b"in the sandbox's /etc"
    assert not Path("/etc/planted").exists()
    assert canary.read_text() == "host's own\n"


def test_bombs_are_refused_before_they_fill_memory(
        box: tuple[SandboxFiles, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    files, root, _ = box
    before = _tree(root)
    monkeypatch.setattr(files_module, "MAX_ARCHIVE", 1 << 20)
    zeros = _tar(("big", b"\0" * (160 << 20), {}))
    bomb = gzip.compress(zeros, compresslevel=9)
    assert len(bomb) < (1 << 20)
    with pytest.raises(FileError, match="decompresses to more than"):
        files.put_archive("/work", bomb)
    monkeypatch.setattr(files_module, "MAX_ARCHIVE_ENTRIES", 500)
    many = _tar(*((f"e{i}", b"", {}) for i in range(1000)))
    with pytest.raises(FileError, match="more than 500 entries"):
        files.put_archive("/work", many)
    assert _tree(root) == before


def test_a_tree_round_trips_with_modes_links_and_owners(
        box: tuple[SandboxFiles, Path, Path]) -> None:
    files, root, _ = box
    data = _tar(("d", None, {"type": tarfile.DIRTYPE, "mode": 0o750}),
                ("d/x.sh", b"#!/bin/sh\n", {"mode": 0o755, "uid": 1000, "gid": 1000}),
                ("d/hard", None, {"type": tarfile.LNKTYPE, "linkname": "d/x.sh"}),
                ("d/sym", None, {"type": tarfile.SYMTYPE, "linkname": "x.sh"}),
                ("d/" + "n" * 250, b"long name", {}))
    files.put_archive("/work", data, keep_owners=True)
    assert stat.S_IMODE(os.stat(root / "work/d").st_mode) == 0o750
    assert os.stat(root / "work/d/x.sh").st_uid == 1000
    assert os.stat(root / "work/d/hard").st_ino == os.stat(root / "work/d/x.sh").st_ino
    with tarfile.open(fileobj=io.BytesIO(files.get_archive("/work/d"))) as tar:
        names = {m.name: m for m in tar.getmembers()}
    assert {"d", "d/x.sh", "d/hard", "d/sym", "d/" + "n" * 250} == set(names)
    assert names["d/sym"].issym() and names["d/sym"].linkname == "x.sh"
    assert names["d/hard"].islnk() or names["d/x.sh"].islnk()
    assert names["d/x.sh"].uid == 1000 and names["d/x.sh"].mode == 0o755
