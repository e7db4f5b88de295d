"""Exec integrity in container sandboxes: a process left running by one
command cannot change, drop or forge the exit code and output the caller
receives for a later command (real runc, real kernel, a hostile static
program copied into the sandbox).

Each attack is first shown to work where the kernel allows it (the attacker
forging a process of its own command), so a passing test means the defence
held, not that the attack was broken."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Sandbox
from runtime.backends.container import RW_FD, ContainerBackend
from runtime.isolation import landlock_audit
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, runtime_missing, vm_missing
from tests.helpers.support import wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing())),
              pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (forge.c)")]

FORGE_SOURCE = Path(__file__).parent / "helpers" / "forge.c"
FORGE = "/tmp/forge"
MARK = "victim-7c1e"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("integrity")
    with node_for(busybox_store(d), d) as n:
        yield n


@pytest.fixture(scope="module")
def forge(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("forge") / "forge"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(FORGE_SOURCE)], check=True,
                   capture_output=True)
    return out.read_bytes()


@pytest.fixture
def sb(node: Node, forge: bytes) -> Iterator[Sandbox]:
    with Sandbox.create(IMAGE, node=node, memory_mb=256) as s:
        s.files.write(FORGE, forge, mode=0o755)
        yield s


def victim(code: int, seconds: float = 1.5) -> str:
    # the marker in the command line is how the attacker finds its victim
    return f"sleep {seconds}; echo honest; exit {code} # {MARK}"


@pytest.mark.parametrize("attack", ["ptrace", "fd", "signal"])
def test_the_attack_works_on_a_process_of_its_own_command(sb: Sandbox, attack: str) -> None:
    """Control: within one command (one process tree) the attack succeeds,
    so the attacker program is a real forger. The victim writes into a
    fifo made inside the sandbox: the node's own pipes (every command's
    stdio) belong to host root, an id the sandbox's user namespace does not
    map, so not even a command's own processes may reopen them through
    /proc/PID/fd (docs/security.md, "Host ids")."""
    r = sb.exec(f"rm -f /tmp/out; mkfifo /tmp/out; cat /tmp/out & sh -c '{victim(3)}' >/tmp/out "
                f"& sleep 0.3; {FORGE} {attack} $!; echo forge=$?; wait $!; echo victim=$?")
    assert b"forge=0" in r.stdout, r.stderr
    forged = {"ptrace": b"victim=0", "fd": b"PASS", "signal": b"victim=137"}[attack]
    assert forged in r.stdout


def test_a_leftover_process_cannot_forge_a_later_command(sb: Sandbox) -> None:
    """Attack 1 of the integrity issue: a setsid'd process started by an
    earlier exec hunts the grader's command and tries ptrace into
    exit_group(0), a write into its stdout, and SIGKILL. The caller still
    gets the command's own exit code and output."""
    sb.exec(f"setsid {FORGE} hunt {MARK} /tmp/forge.log </dev/null >/dev/null 2>&1 &")
    wait_until(lambda: b"ready" in sb.exec("cat /tmp/forge.log 2>/dev/null").stdout, 10,
               "the forger to start")
    for code in (3, 1):
        r = sb.exec(victim(code), timeout=30)
        assert (r.exit_code, r.stdout) == (code, b"honest\n"), r
    log = sb.files.read("/tmp/forge.log").decode()
    # the forger found its victims and every attempt was refused
    for what in ("fd", "ptrace", "signal"):
        attempts = [line for line in log.splitlines() if line.startswith(what + " ")]
        assert attempts, log
        assert all(("Permission denied" in a or "Operation not permitted" in a)
                   for a in attempts), log
    assert b"forge" in sb.exec("ps -o pid,args").stdout  # it is alive, not killed


def _tampering(s: Sandbox) -> dict[str, int]:
    return {e.detail: e.count for e in s.events() if e.kind == "tampering"}


def test_a_leftover_process_tampering_is_recorded(node: Node, sb: Sandbox) -> None:
    """The same attack, as events: every refused ptrace, /proc/PID/fd open
    and signal of the leftover forger becomes a `tampering` event of its
    sandbox (Landlock's audit records, read by the node), counted in the
    node's metric; the attack still fails; a neighbour sandbox, whose own
    command ran meanwhile, has none. Without the node's audit listener (or
    without LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON in sandbox-init) the
    attack is refused the same and no event appears."""
    backend = node.backend("container")
    assert isinstance(backend, ContainerBackend)
    if backend.denials.audit is None:
        pytest.skip("the kernel's audit records cannot be read here (see the node's log)")
    before = node.denial_counts().get("tampering", 0)
    with Sandbox.create(IMAGE, node=node, memory_mb=128) as neighbour:
        sb.exec(f"setsid {FORGE} hunt {MARK} /tmp/forge.log </dev/null >/dev/null 2>&1 &")
        wait_until(lambda: b"ready" in sb.exec("cat /tmp/forge.log 2>/dev/null").stdout, 10,
                   "the forger to start")
        r = sb.exec(victim(3), timeout=30)
        assert (r.exit_code, r.stdout) == (3, b"honest\n"), r
        assert neighbour.exec("sleep 0.5; echo ok").stdout == b"ok\n"
        log = sb.files.read("/tmp/forge.log").decode()
        assert any(line.startswith("ptrace ") for line in log.splitlines()), log

        def seen() -> dict[str, int] | None:
            t = _tampering(sb)
            return t if {"ptrace", "scope.signal"} <= t.keys() else None
        got = wait_until(seen, 5, "tampering events")
        assert got is not None
        assert got["ptrace"] >= 2 and got["scope.signal"] >= 1, got  # fd + ptrace; the kill
        assert neighbour.events() == [], neighbour.events()
        assert node.denial_counts().get("tampering", 0) >= before + 3


def test_a_domain_that_would_hide_its_refusals_is_recorded(sb: Sandbox) -> None:
    """A command may make a Landlock domain of its own, but one made
    without audit logging (here LOG_SAME_EXEC_OFF) would take the refusals
    of its processes out of the record: its own domain is the youngest that
    refuses, and the kernel logs for that one. The seccomp policy lets the
    call go on and the node records it (`landlock`, `restrict_self
    unlogged`); its refused signal to init is not a tampering event. The
    same made with LOG_NEW_EXEC_ON is not an event itself, and its refusal
    is. Without the seccomp rule the first leaves no trace at all."""
    reason = landlock_audit.unreadable()
    if reason is not None:
        pytest.skip(reason)
    r = sb.exec(f"{FORGE} nest 1 1")
    assert r.stdout == b"nest 1: Operation not permitted\n", r
    got = wait_until(lambda: {(e.kind, e.detail): e.count for e in sb.events()} or None, 5,
                     "an event")
    time.sleep(0.5)  # a tampering record, were there one, would be in by now
    assert {(e.kind, e.detail): e.count for e in sb.events()} == \
        {("landlock", "restrict_self unlogged"): 1}, got
    r = sb.exec(f"{FORGE} nest 2 1")
    assert r.stdout == b"nest 2: Operation not permitted\n", r
    wait_until(lambda: {(e.kind, e.detail): e.count for e in sb.events()} ==
               {("landlock", "restrict_self unlogged"): 1, ("tampering", "scope.signal"): 1},
               5, "the tampering event")


def test_tampering_is_recorded_without_user_namespaces(tmp_path: Path) -> None:
    """With user_namespaces=False every sandbox runs as host root, so no uid
    names a sandbox; a short command's processes are gone before the node
    reads the record, and the process reached for (init here, whose cgroup
    is the sandbox's) decides. A neighbour gets nothing."""
    reason = landlock_audit.unreadable()
    if reason is not None:
        pytest.skip(reason)
    with node_for(busybox_store(tmp_path), tmp_path, user_namespaces=False) as n, \
            Sandbox.create(IMAGE, node=n) as s, Sandbox.create(IMAGE, node=n) as neighbour:
        assert s.exec("kill -0 1; echo rc=$?").stdout == b"rc=1\n"
        assert neighbour.exec("true").exit_code == 0
        wait_until(lambda: _tampering(s) == {"scope.signal": 1}, 5, "the tampering event")
        assert neighbour.events() == []


def test_a_command_cannot_take_inits_channel_or_files(sb: Sandbox) -> None:
    """Init holds the exec channel: its descriptors are closed to the
    sandbox's root (non-dumpable, no CAP_SYS_PTRACE), and it holds no host
    file a sandbox process could grow through /proc/1/fd."""
    r = sb.exec("ls -l /proc/1/fd/; readlink /proc/1/fd/0; cat /proc/1/environ; "
                "echo x >> /proc/1/fd/2; echo rc=$?")
    assert b"->" not in r.stdout  # no descriptor of init's can be resolved
    assert r.stdout.endswith(b"rc=1\n"), r
    assert b"Permission denied" in r.stderr
    # the channel's socket is not in the sandbox's tree either
    assert sb.exec("find / -xdev -name ctl.sock 2>/dev/null | wc -l").stdout.strip() == b"0"


def test_commands_see_only_their_own_stdio(sb: Sandbox) -> None:
    """Nothing of init's (the listening socket, a connection, runc's log)
    is inherited by a command."""
    r = sb.exec("ls /proc/self/fd/")
    assert r.stdout.split() == [b"0", b"1", b"2", b"3"]  # 3: ls's own directory


# Files that describe the host (or every sandbox on it) and must read as
# nothing from inside; each exists on this host (checked), so an empty read
# inside is the mask at work, not a missing file.
HOST_FILES = ["/proc/kpagecount", "/proc/kpageflags", "/proc/kpagecgroup", "/proc/slabinfo",
              "/proc/vmallocinfo", "/proc/config.gz", "/proc/iomem", "/proc/zoneinfo",
              "/proc/cmdline", "/proc/locks", "/proc/diskstats", "/sys/kernel/vmcoreinfo"]


def _host_reads(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return bool(f.read(1))
    except OSError:
        return False


HOST_DIRS = ["/sys/kernel/debug", "/sys/kernel/tracing", "/sys/kernel/security", "/sys/firmware"]


def test_host_describing_kernel_files_read_as_nothing(sb: Sandbox) -> None:
    present = [f for f in HOST_FILES if _host_reads(f)]
    assert len(present) >= 8  # the host reads them: the test checks the mask
    for f in present:
        # the host itself reads something from each (as root), the sandbox nothing
        r = sb.exec(f"head -c 4096 {f} 2>/dev/null | wc -c")
        assert r.stdout.strip() == b"0", (f, r)
    for d in (d for d in HOST_DIRS if Path(d).is_dir()):
        r = sb.exec(f"ls -A {d} 2>/dev/null | wc -l; touch {d}/x 2>/dev/null; echo rc=$?")
        assert r.stdout.split() == [b"0", b"rc=1"], (d, r)
    # page-info files are not merely empty but unreadable in bulk
    r = sb.exec("dd if=/proc/kpageflags bs=8 count=1000 2>/dev/null | wc -c")
    assert r.stdout.strip() == b"0"


def test_the_mount_table_names_no_host_directory(node: Node, sb: Sandbox) -> None:
    """The root's overlay options name its layers as /proc/self/fd/N, not
    by the host directories they are (the node root, the state directory)."""
    host_dirs = [str(node.config.state_dir), str(node.config.node_root)]
    info = sb.info
    # the upper the root really uses: rw/ left the host's mount table, the
    # sandbox's init holds it (container.RW_FD) for the node
    state = json.loads((node.config.sandboxes / info.id / "sandbox.json").read_text())["state"]
    rw = Path(f"/proc/{state['init_pid']}/fd/{RW_FD}/upper")
    assert rw.is_dir()
    sb.files.write("/probe", b"x")
    assert (rw / "probe").read_bytes() == b"x"  # ... and is the one written to
    for f in ("/proc/self/mountinfo", "/proc/self/mounts", "/proc/1/mountinfo"):
        text = sb.exec(f"cat {f}").stdout.decode()
        assert " / " in text and "overlay" in text, (f, text[:200])
        for d in host_dirs:
            assert d not in text, (f, d, text[:400])


# -- microVM and full VM ------------------------------------------------------------
# The guest agent (runtime/native/guest-agent.c) holds the VM's only channel to
# the host, a virtio-serial port. A guest process that took its descriptor
# (pidfd_getfd, /proc/PID/fd) could write STDOUT and EXIT frames for the
# grader's command.

@pytest.fixture(scope="module", params=["microvm", "vm"])
def vm(request: pytest.FixtureRequest, node: Node, forge: bytes) -> Iterator[Sandbox]:
    why = vm_missing()
    if why is not None:
        pytest.skip(why)
    with Sandbox.create(IMAGE, backend=request.param, node=node, memory_mb=256, cpu=1) as s:
        s.files.write(FORGE, forge, mode=0o755)
        yield s


@pytest.mark.slow
def test_a_guest_process_cannot_take_the_agents_port(vm: Sandbox) -> None:
    # control: the same call takes the descriptors of a process of its own
    r = vm.exec(f"sleep 5 & {FORGE} getfd $!; echo forge=$?; kill $!")
    assert b"forge=0" in r.stdout, r
    r = vm.exec(f"{FORGE} getfd agent; echo forge=$?")
    assert b"forge=1" in r.stdout and b"Operation not permitted" in r.stderr, r
    # /proc/PID/fd of the agent is closed too, and the port cannot be opened twice
    r = vm.exec("for p in /proc/[0-9]*; do [ \"$(cat $p/comm)\" = lazyfs-agent ] && "
                "ls -l $p/fd/ 2>&1; done; for d in /dev/vport*; do echo x > $d; done; "
                "echo done")
    assert b"vport" not in r.stdout.replace(b"/dev/vport", b"") and b"done" in r.stdout, r
    # and the channel still answers in step
    assert vm.exec("echo honest; exit 3").exit_code == 3
    assert vm.exec("echo next").stdout == b"next\n"


@pytest.mark.slow
def test_a_leftover_guest_process_cannot_forge_a_later_command(vm: Sandbox) -> None:
    """ptrace into exit_group(0) and a write into the command's stdout, from
    a process an earlier command left running, are refused in the guest."""
    vm.exec(f"setsid {FORGE} hunt {MARK} /tmp/forge.log fd,ptrace "
            "</dev/null >/dev/null 2>&1 &")
    wait_until(lambda: b"ready" in vm.exec("cat /tmp/forge.log 2>/dev/null").stdout, 30,
               "the forger to start")
    r = vm.exec(victim(3), timeout=60)
    assert (r.exit_code, r.stdout) == (3, b"honest\n"), r
    log = vm.exec("cat /tmp/forge.log").stdout.decode()
    for what in ("fd", "ptrace"):
        attempts = [line for line in log.splitlines() if line.startswith(what + " ")]
        assert attempts, log
        # every attempt on the live victim is refused; one that raced the
        # victim's exit may find it gone (ESRCH; ENOENT for its /proc fd
        # entry), never a success
        refused = [a for a in attempts
                   if "Permission denied" in a or "Operation not permitted" in a]
        assert refused, log
        assert all(a in refused or a.endswith(("No such process", "No such file or directory"))
                   for a in attempts), log
    vm.exec("pkill -f 'forge hunt'; true")


@pytest.mark.slow
def test_a_leftover_guest_process_signalling_a_later_command(vm: Sandbox) -> None:
    """Signals are scoped only from Landlock ABI 6 (kernel 6.12); the guest
    kernel here is 6.1. Where the guest cannot scope them, a leftover can kill
    a later command, and the caller sees the kill (128+N), never a forged
    success."""
    abi = vm.exec("cat /sys/kernel/security/landlock/abi_version 2>/dev/null || true")
    vm.exec(f"setsid {FORGE} hunt {MARK} /tmp/forge-sig.log signal "
            "</dev/null >/dev/null 2>&1 &")
    wait_until(lambda: b"ready" in vm.exec("cat /tmp/forge-sig.log 2>/dev/null").stdout, 30,
               "the forger to start")
    r = vm.exec(victim(3), timeout=60)
    assert r.exit_code in (3, 128 + 9) and b"PASS" not in r.stdout, r
    log = vm.exec("cat /tmp/forge-sig.log").stdout.decode()
    if r.exit_code == 3:  # scoped: every attempt refused
        assert "signal" in log and "done" not in log.replace("ready", ""), log
    else:
        assert "signal" in log, (abi, log)
    vm.exec("pkill -f 'forge hunt'; true")


@pytest.mark.slow
def test_a_guest_command_cannot_leave_its_root_or_its_cgroup(vm: Sandbox) -> None:
    """The escape from a chroot (chroot("sub") without a chdir, "..", then
    chroot(".")), the same inside a user namespace of its own, the agent's
    and a kernel thread's /proc/PID/root, and a cgroup2 mount of its own:
    none reaches the microVM's upper (/rw/upper, outside the root) or the
    commands' cgroup (/cgroup), and the command stays in its limited cgroup.
    (Before commands lost CAP_SYS_CHROOT the chroot line read "chroot ok",
    /rw/upper was listed and the command moved itself into /cgroup.)"""
    before = vm.exec("cat /proc/self/cgroup").stdout
    if vm.info.spec.backend == "microvm":
        assert before == b"0::/sandbox\n"  # the commands' cgroup, with the pids and memory limits
    r = vm.exec(f"mkdir -p /tmp/esc && {FORGE} escape /tmp/esc; echo forge=$?", timeout=60)
    lines = r.stdout.decode().splitlines()
    assert lines[-1] == "forge=1", r.stdout.decode()  # 0: it got out
    ways = {line.split()[0]: line for line in lines[:-2]}
    assert ways["chroot"].startswith("chroot refused: Operation not permitted"), r
    for way in ("proc1-upper", "proc2-upper", "upper", "cgroup", "mount"):
        assert " refused: " in ways[way], r
    # a user namespace: refused to a chrooted command (a microVM's); a full
    # VM's command runs in the image's own root, where ".." leads nowhere new
    assert " refused: " in ways.get("userns-upper", ways["userns"]), r
    assert lines[-2] == "cgroup-now " + before.decode().strip(), r  # still in its own cgroup
    assert vm.exec("cat /proc/self/cgroup").stdout == before
