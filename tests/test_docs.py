"""The README's and docs' shell and Python blocks, run as written, so they
stay true.

Every ```sh (bash, shell) and ```python block of README.md and docs/*.md
runs, except in the files of NOT_YET, unless an HTML comment right before it
(invisible where the Markdown is rendered) says otherwise:

    <!-- test: skip (why) -->          not run; the reason is required
    <!-- test: instead (why)
    commands                           run in the block's place: the block needs
    -->                                what a test machine lacks (a registry)
    <!-- test: setup (what for)
    commands                           run before the block: what a reader brings
    -->                                (a rootfs tarball, an environment spec)

The commands of setup and instead may use $DOCS_BUSYBOX_ROOTFS (a small
runnable root filesystem) and $DOCS_DEBIAN_ROOTFS (a Debian minbase tree,
debootstrapped once into /var/cache/lazyfs-tests).

Each file's blocks run in order in one bash session (`set -eu -o pipefail`),
so a block may use what an earlier one made (convert, then mount). A Python
block runs there as `python - <<'EOF'` would, under this interpreter (the
one `lazyfs` runs under, as `. .venv/bin/activate` gives it), from the
session's working directory and with its environment. The
session runs in a private network namespace (a loopback of its own: two
runs on one machine may use the same ports) and a private mount namespace
in which /mnt, /tmp and /run/lazyfs are directories of the test's own
(the checkout and the interpreter, wherever they live, stay visible
through them: they are bound back in place), with LAZYFS_STORE, LAZYFS_NODE_ROOT (= /run/lazyfs, the default the docs
name), LAZYFS_CACHE, LAZYFS_RUNTIME_DIR, LAZYFS_CONFIG and HOME all
pointing there: the user's store, node daemon,
cache and sandboxes are never touched. At the end, also on a failure or a
timeout, the session stops its sandboxes and its daemon, and then every
process left in the namespace is killed, which takes the namespace's mounts
with it. Not here: what the commands do in detail (their own tests).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Docs whose blocks are not run yet, and why. Running one is deleting its line.
NOT_YET: dict[str, str] = {}
SHELL_LANGS = {"sh", "bash", "shell"}
PYTHON_LANGS = {"python", "py"}
_PY_EOF = "DOCS_PYTHON_EOF"  # the here-document's delimiter a Python block runs in
TIMEOUT = 900  # seconds for one file's session (README: ~1 min on a 2-core VM)

# the marker's first line: its kind and (reason); commands follow on the next lines
_MARKER = re.compile(r"test:\s*(skip|instead|setup)\s*(?:\((.*)\))?\s*\Z")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None = None  # why it is not run
    setup: str = ""  # hidden commands run before it (or instead of it, when skip is set)
    lang: str = "sh"  # "sh" or "python"

    @property
    def command(self) -> str:
        """The block as the session's bash runs it."""
        if self.lang != "python":
            return self.code
        return f"\"$DOCS_PYTHON\" - <<'{_PY_EOF}'\n{self.code}\n{_PY_EOF}"

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_files() -> list[str]:
    return ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]


def doc_blocks(doc: str) -> list[Block]:
    """The shell and Python blocks of `doc` with their markers; a marker not
    followed by such a block, or a skip without its reason, is an error."""
    lines = (REPO / doc).read_text().splitlines()
    blocks: list[Block] = []
    pending: list[tuple[int, str, str, str]] = []  # (line, kind, reason, commands)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!--"):
            start = i
            text = line[4:]
            while "-->" not in text and i + 1 < len(lines):
                i += 1
                text += "\n" + lines[i]
            if "-->" not in text:
                raise ValueError(f"{doc}:{start + 1}: unterminated comment")
            body = text[:text.index("-->")].strip()
            if body.startswith("test:"):
                first, _, commands = body.partition("\n")
                m = _MARKER.match(first)
                if not m:
                    raise ValueError(f"{doc}:{start + 1}: unknown marker {first!r}")
                kind, reason, commands = m[1], (m[2] or "").strip(), commands.strip()
                if kind in ("skip", "instead") and not reason:
                    raise ValueError(f"{doc}:{start + 1}: `test: {kind}` needs its reason "
                                     "in parentheses")
                if kind == "skip" and commands:
                    raise ValueError(f"{doc}:{start + 1}: `test: skip` takes no commands")
                pending.append((start + 1, kind, reason, commands))
        elif line.startswith("```"):
            lang = line[3:].strip()
            start = i
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            if i == len(lines):
                raise ValueError(f"{doc}:{start + 1}: unterminated code block")
            code = "\n".join(lines[start + 1:i])
            if lang in SHELL_LANGS or lang in PYTHON_LANGS:
                if lang in PYTHON_LANGS and any(line == _PY_EOF for line in code.splitlines()):
                    raise ValueError(f"{doc}:{start + 1}: a line {_PY_EOF} in a Python block")
                skip = next((r for _, k, r, _ in pending if k in ("skip", "instead")), None)
                setup = "\n".join(c for _, k, _, c in pending if k in ("setup", "instead"))
                blocks.append(Block(doc, start + 1, code, skip, setup,
                                    "python" if lang in PYTHON_LANGS else "sh"))
            elif pending:
                raise ValueError(f"{doc}:{pending[0][0]}: marker before a {lang or 'plain'} "
                                 "block (only shell and Python blocks run)")
            pending = []
        elif line.strip() and pending:
            raise ValueError(f"{doc}:{pending[0][0]}: marker not followed by a code block")
        i += 1
    if pending:
        raise ValueError(f"{doc}:{pending[0][0]}: marker at the end of the file")
    return blocks


def test_every_doc_is_run_or_listed_and_its_markers_parse() -> None:
    docs = doc_files()
    for doc in docs:
        doc_blocks(doc)  # raises on a malformed or stray marker
    run = [d for d in docs if d not in NOT_YET]
    assert {"README.md", "docs/chunkstore.md", "docs/lazyfs.md"} <= set(run)
    readme = doc_blocks("README.md")
    assert all(b.skip for b in readme if "install.sh" in b.code)  # never from a test
    assert sum(1 for b in readme if not b.skip) >= 4


def test_the_parser_reads_the_markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("text\n\n<!-- test: setup (a file)\ntouch f\n-->\n```sh\nls f\n```\n\n"
                   "<!-- test: skip (needs the network) -->\n<!-- other -->\n```sh\ncurl x\n```\n"
                   "<!-- test: instead (no registry)\necho stand-in\n-->\n```bash\npull\n```\n"
                   "```python\nprint()\n```\n```toml\na = 1\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert doc_blocks("doc.md") == [
        Block("doc.md", 6, "ls f", None, "touch f"),
        Block("doc.md", 12, "curl x", "needs the network", ""),
        Block("doc.md", 18, "pull", "no registry", "echo stand-in"),
        Block("doc.md", 21, "print()", None, "", "python")]
    assert doc_blocks("doc.md")[-1].command == \
        f"\"$DOCS_PYTHON\" - <<'{_PY_EOF}'\nprint()\n{_PY_EOF}"
    for bad in ("<!-- test: skip -->\n```sh\nx\n```\n",
                "<!-- test: skip (why) -->\nprose\n```sh\nx\n```\n",
                "<!-- test: sometimes -->\n```sh\nx\n```\n",
                "<!-- test: setup (x)\ny\n-->\n```toml\nx\n```\n",
                f"```python\nx = 1\n{_PY_EOF}\n```\n"):
        doc.write_text(bad)
        with pytest.raises(ValueError):
            doc_blocks("doc.md")


def test_install_sh_installs_the_bench_extra() -> None:
    """Benchmark plots need matplotlib: install.sh installs the bench extra,
    and the README says how elsewhere. In the virtualenv install.sh made
    (CI's), matplotlib imports."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["bench"])
    install = (REPO / "install.sh").read_text()
    assert re.search(r"pip install -q -e '\.\[test,bench\]'", install), install
    assert "pip install -e '.[bench]'" in (REPO / "README.md").read_text()
    if Path(sys.prefix).resolve() == (REPO / ".venv").resolve():
        import importlib.util
        assert importlib.util.find_spec("matplotlib") is not None, \
            "matplotlib is missing from .venv: run ./install.sh"


# -- running the blocks ------------------------------------------------------

def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the docs mount images and run sandboxes"
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    return None


def _mount_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _kill_namespace(ns_file: Path) -> list[str]:
    """SIGKILL every process in the mount namespace named in ns_file (never
    ours); its mounts go with the last one. Returns what had to be killed."""
    try:
        ns = ns_file.read_text().strip()
    except OSError:
        return []
    if not ns or ns == _mount_ns("self"):
        return []
    killed: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _mount_ns(p) == ns]
        if not pids:
            return killed
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{pid} {cmd.strip()}")
            except (OSError, UnicodeDecodeError):
                continue
        time.sleep(0.2)
    raise AssertionError(f"processes of the docs session would not die: {killed}")


_PROLOGUE = """\
set -eu -o pipefail
readlink /proc/self/ns/mnt > "$DOCS_WORK/ns"
ip link set lo up  # a loopback of its own: the ports a doc picks never collide with another run's
{carry_out}mount --bind "$DOCS_WORK/mnt" /mnt
mount --bind "$DOCS_WORK/tmp" /tmp
mkdir -p -m 700 /run/lazyfs  # (the daemon's default root; ours is bound over it)
mount --bind "$DOCS_WORK/node" /run/lazyfs
{carry_in}docs_cleanup() {
    { set +x; } 2>/dev/null
    set +e
    if [ -d "$LAZYFS_RUNTIME_DIR" ]; then
        for sb in $(lazyfs sandbox ls 2>/dev/null | cut -d' ' -f1); do
            lazyfs sandbox kill "$sb" >/dev/null 2>&1
        done
    fi
    lazyfs umount --lazy /run/lazyfs/mnt >/dev/null 2>&1
}
trap docs_cleanup EXIT
cd "$DOCS_WORK/cwd"
"""


# The directories the session puts its own over, and what must stay visible
# through them: this checkout and the interpreter (a clone or a virtualenv
# under /tmp is as good as any other).
_PRIVATE = ("/mnt", "/tmp", "/run/lazyfs")


def _carried() -> list[str]:
    """The paths under _PRIVATE the session needs to see as they are: the
    checkout, the interpreter's prefixes and what is on its sys.path,
    outermost only."""
    want = {REPO, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent,
            Path(os.path.realpath(sys.executable)).parent}
    want |= {Path(e) for e in sys.path if e and os.path.isdir(e)}
    under = sorted({Path(os.path.realpath(w)) for w in want}
                   | {w.absolute() for w in want}, key=lambda q: len(q.parts))
    out: list[Path] = []
    for q in under:
        if any(q.is_relative_to(h) and q != Path(h) for h in _PRIVATE) \
                and not any(q.is_relative_to(o) for o in out) and q.is_dir():
            out.append(q)
    return [str(q) for q in out]


def _prologue() -> str:
    """_PROLOGUE with the carried paths bound out of the way before the
    private directories go over them, and back in place after."""
    out, back = [], []
    for i, path in enumerate(_carried()):
        keep = f'"$DOCS_WORK/carry/{i}"'
        out.append(f"mkdir -p {keep} && mount --rbind {shlex.quote(path)} {keep}\n")
        back.append(f"mkdir -p {shlex.quote(path)} && mount --rbind {keep} {shlex.quote(path)}\n")
    return _PROLOGUE.replace("{carry_out}", "".join(out)).replace("{carry_in}", "".join(back))


def _script(blocks: list[Block]) -> str:
    parts = [_prologue()]
    for b in blocks:
        if b.skip and not b.setup:
            continue
        parts.append(f"printf '%s\\n' {shlex.quote(b.where)} > \"$DOCS_WORK/block\"\n"
                     f"echo {shlex.quote('### ' + b.where)}\n")
        if b.setup:
            parts.append(b.setup + "\n")
        if not b.skip:
            parts.append(f"set -x\n{b.command}\n{{ set +x; }} 2>/dev/null\n")
    parts.append("echo '### done' > \"$DOCS_WORK/block\"\n")
    return "".join(parts)


def _fixtures(blocks: list[Block], work: Path) -> dict[str, str]:
    """The environment the hidden commands may use, made only if used."""
    env: dict[str, str] = {}
    hidden = "\n".join(b.setup for b in blocks)
    if "DOCS_BUSYBOX_ROOTFS" in hidden:
        from tests.helpers.images import build_busybox_rootfs
        root = build_busybox_rootfs(work / "fixtures" / "busybox")
        (root / "etc" / "motd").write_text("hello from the docs\n")
        env["DOCS_BUSYBOX_ROOTFS"] = str(root)
    if "DOCS_DEBIAN_ROOTFS" in hidden:
        if shutil.which("debootstrap") is None:
            pytest.skip("debootstrap is not installed (install.sh installs it)")
        from tests.test_lazyfs_debian import _debootstrap
        env["DOCS_DEBIAN_ROOTFS"] = str(_debootstrap("debian-minbase", None, "usr/bin/dpkg"))
    return env


@dataclass(frozen=True)
class Session:
    code: int | None  # bash's exit code; None: timed out
    where: str  # the block running when it ended ("### done": all ran)
    output: str  # from the banner of that block on
    stray: list[str]  # processes still in the namespace after bash ended (killed)


def run_session(blocks: list[Block], timeout: float = TIMEOUT) -> Session:
    """Run `blocks` in one bash session in a private mount namespace on a
    temporary store and node (module docstring); everything it started is
    gone when this returns, whatever happened."""
    work = Path(tempfile.mkdtemp(prefix="lazyfs-docs-", dir="/var/tmp"))
    try:
        for d in ("cwd", "mnt", "tmp", "node", "bin", "home"):
            (work / d).mkdir()
        (work / "tmp").chmod(0o1777)
        # `lazyfs` as the docs call it: this checkout's CLI under this interpreter
        wrapper = work / "bin" / "lazyfs"
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m tools.cli \"$@\"\n")
        wrapper.chmod(0o755)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("LAZYFS_") and k not in ("PYTHONPATH", "HOME")}
        env.update(_fixtures(blocks, work))
        env.update({
            "DOCS_WORK": str(work), "DOCS_PYTHON": sys.executable, "HOME": str(work / "home"),
            "PATH": f"{work / 'bin'}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}",
            "PYTHONPATH": str(REPO),
            "LAZYFS_STORE": str(work / "store"), "LAZYFS_NODE_ROOT": "/run/lazyfs",
            "LAZYFS_CACHE": str(work / "cache"), "LAZYFS_RUNTIME_DIR": str(work / "runtime"),
            "LAZYFS_CONFIG": str(work / "config.toml"),  # none: the defaults
        })
        script = work / "blocks.sh"
        script.write_text(_script(blocks))
        log = work / "log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--net", "bash", str(script)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=work / "cwd", start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        stray = _kill_namespace(work / "ns")
        where = (work / "block").read_text().strip() if (work / "block").exists() else "?"
        lines = log.read_text(errors="replace").splitlines()
        first = max((i for i, s in enumerate(lines) if s == f"### {where}"), default=0)
        return Session(code, where, "\n".join(lines[first:]), stray)
    finally:
        _kill_namespace(work / "ns")
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in doc_files() if d not in NOT_YET])
def test_doc_blocks_run_as_written(doc: str) -> None:
    why = _missing()
    if why:
        pytest.skip(why)
    blocks = doc_blocks(doc)
    if not any(not b.skip or b.setup for b in blocks):
        pytest.skip(f"{doc} has no block to run")
    s = run_session(blocks)
    if s.code != 0:
        block = next((b for b in blocks if b.where == s.where), None)
        tail = "\n".join(s.output.splitlines()[-80:])
        status = f"timed out after {TIMEOUT} s" if s.code is None else f"exit code {s.code}"
        raise AssertionError(f"{doc}: the block at {s.where} failed ({status}):\n"
                             f"{block.code if block else ''}\n--- output ---\n{tail}")
    assert s.where == "### done", s.where
    assert not s.stray, f"{doc}: left running after its session: {s.stray}"


@pytest.mark.root
def test_a_failing_or_hanging_session_leaves_nothing_behind() -> None:
    """A block that fails after leaving a mount and a detached process, and
    one that hangs: the session reports where, and nothing it started is
    left (the process is killed, the mount went with the namespace)."""
    why = _missing()
    if why:
        pytest.skip(why)
    marker = f"lazyfs-docs-probe-{os.getpid()}"
    leave = Block("x.md", 1, f"mkdir /mnt/m && mount -t tmpfs {marker} /mnt/m\n"
                             f"setsid sh -c 'sleep 300; true' {marker} >/dev/null 2>&1 < /dev/null &\n"
                             "echo placed")
    fail = Block("x.md", 9, "false")
    s = run_session([leave, fail])
    assert (s.code, s.where) == (1, "x.md:9"), s
    assert any(marker in p for p in s.stray), s.stray
    hang = Block("x.md", 20, "sleep 120")
    s = run_session([leave, hang], timeout=3)
    assert (s.code, s.where) == (None, "x.md:20"), s
    host = Path("/proc/self/mountinfo").read_text()
    assert marker not in host
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            assert marker.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue


@pytest.mark.root
@pytest.mark.parametrize("base", ["/tmp", "/var/tmp"])
def test_the_harness_runs_from_a_checkout_and_virtualenv_under(base: str) -> None:
    """A copy of this checkout and a virtualenv of its own, both in a folder
    with a space under /tmp (which the session puts a directory of its own
    over) or /var/tmp: the harness, run from there under that virtualenv,
    runs the blocks with that checkout's CLI and modules, and leaves the
    copy and the virtualenv in place."""
    why = _missing()
    if why:
        pytest.skip(why)
    import sysconfig
    top = Path(tempfile.mkdtemp(prefix="lazyfs docs ", dir=base))
    try:
        clone, venv = top / "check out", top / "v env"
        files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], check=True,
                               capture_output=True).stdout.decode().split("\0")
        for f in filter(None, files):
            if (REPO / f).is_file():
                (clone / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / f, clone / f)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        python = venv / "bin" / "python"
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # this interpreter's packages, for the copy's virtualenv (no index here to install from)
        Path(site, "lazyfs-tests.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        probe = (
            "import sys\n"
            "from tests.test_docs import Block, run_session\n"
            "s = run_session([Block('x.md', 1, 'lazyfs --help | head -1\\n"
            "sed -n 1p \"$PYTHONPATH/README.md\"'),\n"
            "                 Block('x.md', 5, 'import sys, tools; print(\"MOD\", tools.__file__); "
            "print(\"PY\", sys.prefix)', lang='python')])\n"
            "print(s.code, s.where)\n"
            "print(s.output)\n")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        r = subprocess.run([str(python), "-c", probe], check=False, cwd=clone, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        first, _, out = r.stdout.partition("\n")
        assert first == "0 ### done", r.stdout[-3000:]
        assert f"MOD {clone / 'tools' / '__init__.py'}" in out, out
        assert f"PY {venv}" in out, out
        assert (REPO / "README.md").read_text().splitlines()[0] in out, out
        assert (clone / "tests" / "test_docs.py").is_file() and python.exists()
    finally:
        shutil.rmtree(top, ignore_errors=True)
