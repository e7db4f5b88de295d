"""Runtime pieces that need no root: specs and their errors, resolved images
and the backends' persisted state, the OCI config,
the seccomp and nftables policies, openat2-confined file access, and output
capture with caps and deadlines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from runtime.backends import capabilities, procio
from runtime.backends.container import ContainerState
from runtime.backends.microvm import MicrovmState
from runtime.backends.netpolicy import addresses, ruleset
from runtime.backends.vm import VmState
from runtime.errors import BackendUnavailable, FileError, InvalidSpec
from runtime.files import SandboxFiles
from runtime.isolation import cgroups, landlock, oci
from runtime.isolation.idmap import IdRange
from runtime.isolation.seccomp import CLONE_NS_FLAGS, DENIED, oci_section
from runtime.spec import (
    ExecRequest,
    NetworkPolicy,
    Qos,
    ResolvedImage,
    SandboxInfo,
    SandboxSpec,
    build,
    command,
    parse,
    parse_rule,
)

DIGEST = "blake3:" + "ab" * 32


def test_spec_errors_name_the_field() -> None:
    with pytest.raises(InvalidSpec, match="memory_mb"):
        build(SandboxSpec, image="x", memory_mb=1)
    with pytest.raises(InvalidSpec, match="backend"):
        build(SandboxSpec, image="x", backend="kvm")
    with pytest.raises(InvalidSpec, match="gpu"):
        build(SandboxSpec, image="x", gpu=1)
    with pytest.raises(InvalidSpec, match="env"):
        build(SandboxSpec, image="x", env={"A=B": "c"})
    with pytest.raises(InvalidSpec, match="labels"):
        build(SandboxSpec, image="x", labels={"": "v"})
    with pytest.raises(InvalidSpec, match="timeout"):
        build(ExecRequest, cmd=("true",), timeout=0)
    with pytest.raises(InvalidSpec, match="cmd"):
        build(ExecRequest, cmd=())
    with pytest.raises(InvalidSpec):
        parse(SandboxSpec, b'{"image": "x", "cpu": "lots"}')


def test_a_sandbox_names_its_image_by_digest() -> None:
    img = build(ResolvedImage, name="bb:1", digest=DIGEST, layers=("blake3:" + "cd" * 32,))
    assert parse(ResolvedImage, img.model_dump_json()) == img
    with pytest.raises(InvalidSpec, match="digest"):
        build(ResolvedImage, name="bb:1", digest="bb:1", layers=())  # a name is not a digest
    info = build(SandboxInfo, id="sb-1", spec=SandboxSpec(image="bb:1"), image_digest=DIGEST,
                 state="running")
    assert parse(SandboxInfo, info.model_dump_json()).image_digest == DIGEST
    with pytest.raises(InvalidSpec, match="image_digest"):
        build(SandboxInfo, id="sb-1", spec=SandboxSpec(image="bb:1"), state="running")


def test_backend_state_round_trips_as_json(tmp_path: Path) -> None:
    states = [ContainerState(rootfs=tmp_path / "rootfs", rw=tmp_path / "rw", rw_tmpfs=True,
                             net_slot=3, init_pid=42),
              MicrovmState(vm_dir=tmp_path / "vm", accel="tcg", pid=7, layers_on="blk",
                           layers=["a", "b"], boot_s=1.5),
              VmState(vm_dir=tmp_path / "vm", disk=tmp_path / "d.qcow2", init="/sbin/init",
                      snapshot=tmp_path / "s.bin")]
    for st in states:
        raw = json.loads(json.dumps(st.model_dump(mode="json")))  # as the state file holds it
        assert type(st).model_validate(raw) == st
    with pytest.raises(pydantic.ValidationError):
        ContainerState.model_validate({"rootfs": "/x", "layers": []})  # another backend's field


def test_commands_and_rules() -> None:
    assert command("echo hi | wc") == ("/bin/sh", "-c", "echo hi | wc")
    assert command(["ls", "-l"]) == ("ls", "-l")
    assert parse_rule("10.0.0.5:3128").port == 3128
    r = parse_rule("192.168.1.0/24:53/udp")
    assert (r.cidr, r.port, r.protocol) == ("192.168.1.0/24", 53, "udp")
    assert parse_rule("10.1.2.3").port is None
    with pytest.raises(ValueError, match="not an address"):
        parse_rule("mirror.example:80")
    assert (parse_rule("node:8000").cidr, parse_rule("node:8000").port) == ("node", 8000)


@pytest.mark.parametrize("text, words", [
    ("notanip", ["'notanip' is not an address or network", "node:8000"]),
    ("10.0.0.1:http", ["port 'http' is not a number"]),
    ("10.0.0.1:70000", ["network rule '10.0.0.1:70000'", "65535"]),
])
def test_a_bad_network_rule_is_one_line_invalid_spec(text: str, words: list[str]) -> None:
    """The SDK's InvalidSpec, one line naming the rule: no pydantic dump, no URL."""
    for call in (lambda: parse_rule(text), lambda: NetworkPolicy.allow_only(text)):
        with pytest.raises(InvalidSpec) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "https://" not in msg and text in msg, msg
        assert all(w in msg for w in words), msg


def test_vm_backends_refuse_memory_below_their_floor() -> None:
    """Refused at validation (no VM starts), naming the field and the minimum;
    the container backend takes the same value."""
    from runtime.client.sdk import _spec
    from runtime.spec import MIN_GUEST_MB
    for backend in ("microvm", "vm"):
        with pytest.raises(InvalidSpec) as e:
            _spec("img:1", backend, memory_mb=64)
        assert str(e.value) == (f"memory_mb: 64 MB is below the {backend} backend's minimum "
                                f"of {MIN_GUEST_MB} MB (its guest kernel does not boot in less)")
        assert _spec("img:1", backend, memory_mb=MIN_GUEST_MB).memory_mb == MIN_GUEST_MB
    assert _spec("img:1", "container", memory_mb=64).memory_mb == 64


def test_exec_result_bytes_survive_json() -> None:
    from runtime.spec import ExecResult
    r = ExecResult(exit_code=0, stdout=bytes(range(256)), stderr=b"\xff", duration=0.1)
    assert ExecResult.model_validate_json(r.model_dump_json()) == r


def test_oci_config_confines_the_sandbox(tmp_path: Path) -> None:
    spec = SandboxSpec(image="x", cpu=0.5, memory_mb=256, pids=64, env={"A": "1"},
                       qos=Qos.best_effort)
    c = oci.config("sb-1", spec, tmp_path / "rootfs", tmp_path / "init", IdRange(3))
    ns = {n["type"] for n in c["linux"]["namespaces"]}
    assert ns == {"user", "pid", "ipc", "uts", "mount", "cgroup", "network"}
    # root inside is an unprivileged host id of this sandbox's own range
    assert c["linux"]["uidMappings"] == [{"containerID": 0, "hostID": (1 << 31) + 3 * 65536,
                                          "size": 65536}]
    assert c["linux"]["gidMappings"] == c["linux"]["uidMappings"]
    # no host path but sandbox-init and the sandbox's own cgroups, read-only
    binds = [m for m in c["mounts"] if m["type"] == "bind"]
    assert [m for m in binds if not m["destination"].startswith("/sys/fs/cgroup/")] == [
        {"destination": oci.INIT_PATH, "type": "bind", "source": str(tmp_path / "init"),
         "options": ["bind", "ro", "nosuid", "nodev"]}]
    assert {m["source"] for m in binds if m["destination"].startswith("/sys/fs/cgroup/")} \
        == {str(cgroups.path(h, "sb-1")) for h in cgroups.v1_hierarchies()}
    assert all("ro" in m["options"] for m in binds)
    caps = set(c["process"]["capabilities"]["bounding"])
    assert "CAP_SYS_ADMIN" not in caps and "CAP_NET_ADMIN" not in caps
    assert "CAP_NET_RAW" not in caps and "CAP_MKNOD" not in caps
    assert c["process"]["noNewPrivileges"] is True
    assert "/proc/kcore" in c["linux"]["maskedPaths"]
    res = c["linux"]["resources"]
    assert res["memory"]["limit"] == 256 << 20
    assert res["cpu"]["quota"] == 50_000 and res["pids"]["limit"] == 64
    assert c["process"]["args"][-1] == "-i"  # best effort: SCHED_IDLE
    assert "A=1" in c["process"]["env"]


def test_seccomp_denies_namespace_flags_one_rule_each() -> None:
    s = oci_section()
    assert s["defaultAction"] == "SCMP_ACT_ALLOW"
    assert {"mount", "unshare", "bpf", "kexec_load", "open_by_handle_at"} <= set(DENIED)
    clone_rules = [r for r in s["syscalls"] if r["names"] == ["clone"]]
    bits = sorted(r["args"][0]["value"] for r in clone_rules)
    assert sum(bits) == CLONE_NS_FLAGS and all(b & (b - 1) == 0 for b in bits)
    assert all(r["args"][0]["valueTwo"] == r["args"][0]["value"] for r in clone_rules)


def test_nft_ruleset_allows_only_listed_destinations() -> None:
    text = ruleset(NetworkPolicy.allow_only("10.0.0.5:3128", "192.168.0.0/16:53/udp"),
                   "10.203.0.5")
    assert "policy drop" in text and 'oifname "lo" accept' in text
    assert "hook input priority 0; policy drop" in text  # nothing may connect in
    assert "ip daddr 10.0.0.5/32 tcp dport 3128 accept" in text
    assert "ip daddr 192.168.0.0/16 udp dport 53 accept" in text
    assert text.rstrip().endswith("}")
    # `node` is this sandbox's own node side, and only that
    text = ruleset(NetworkPolicy.allow_only("node:8000"), "10.203.0.5")
    assert "ip daddr 10.203.0.5/32 tcp dport 8000 accept" in text
    assert "10.203.0.0" not in text
    host, sb = addresses(1)
    assert (host, sb) == ("10.203.0.5", "10.203.0.6")


def test_nft_ruleset_of_a_vm_filters_what_is_forwarded() -> None:
    from runtime.backends.netpolicy import GUEST_IF, nat_table
    text = ruleset(NetworkPolicy.allow_only("node:8000"), "10.203.0.5", GUEST_IF)
    # the guest's packets are forwarded: the allowlist is on the forward
    # hook, from the tap only; the namespace itself accepts only loopback
    fwd = text.split(" chain from_guest {")[1]
    assert "hook forward priority 0; policy drop" in fwd
    assert f'iifname != "{GUEST_IF}" drop' in fwd
    assert "ip daddr 10.203.0.5/32 tcp dport 8000 accept" in fwd
    chain_in = text.split(" chain in {")[1].split(" }")[0]
    assert "policy drop" in chain_in and "saddr" not in chain_in
    assert 'oifname "eth0" masquerade' in nat_table()


def test_network_slots_are_never_shared(tmp_path: Path) -> None:
    from runtime.backends.netpolicy import allocate
    slots = [allocate("sb-same-hash", tmp_path) for _ in range(50)]
    assert len(set(slots)) == 50


def test_capabilities_say_what_each_backend_does() -> None:
    assert "files" in capabilities("container") and "pause" in capabilities("container")
    assert "exec" in capabilities("fncall") and "files" not in capabilities("fncall")
    assert "exec" in capabilities("microvm") and "network_allowlist" in capabilities("microvm")
    assert "exec" in capabilities("vm") and "network_allowlist" in capabilities("vm")
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        capabilities("kvm")


def test_files_never_leave_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "motd").write_text("inside\n")
    secret = tmp_path / "secret"
    secret.write_text("host secret\n")
    (root / "abs").symlink_to("/etc")        # absolute: the sandbox's /etc
    (root / "up").symlink_to("../../../..")  # climbs: stops at the root
    (root / "out").symlink_to(str(secret))   # the host path, as the sandbox sees it
    f = SandboxFiles(root)
    assert f.read("/abs/motd") == b"inside\n"
    assert f.read("/up/etc/motd") == b"inside\n"
    assert f.read("/../../etc/motd") == b"inside\n"
    with pytest.raises(FileError, match="No such file"):
        f.read("/out")
    f.write("/up/new/dir/file.txt", b"data", mode=0o600)
    assert (root / "new" / "dir" / "file.txt").read_bytes() == b"data"
    assert (root / "new" / "dir" / "file.txt").stat().st_mode & 0o777 == 0o600
    f.write("/abs/motd", b"changed\n")
    assert (root / "etc" / "motd").read_text() == "changed\n"
    assert secret.read_text() == "host secret\n"
    names = [e.name for e in f.list("/")]
    assert names == sorted(["abs", "etc", "new", "out", "up"])
    assert [e.type for e in f.list("/") if e.name == "abs"] == ["symlink"]
    f.remove("/new", recursive=True)
    assert not (root / "new").exists()
    with pytest.raises(FileError, match="runtime's"):
        f.read("/proc/self/environ")
    with pytest.raises(FileError, match="absolute"):
        f.read("etc/motd")
    os.mkfifo(root / "fifo")
    with pytest.raises(FileError, match="not a regular file"):
        f.read("/fifo")  # must not block on a planted fifo


def _popen(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_procio_caps_output_and_stops_once() -> None:
    stops: list[int] = []
    p = _popen("import sys\nwhile True: sys.stdout.write('y' * 4096)")

    def stop() -> None:
        stops.append(1)
        p.kill()
    out = procio.run(p, stdin=b"", timeout=30, max_output=10_000, stop=stop)
    assert out.truncated and len(out.stdout) == 10_000 and stops == [1]


def test_procio_deadline_and_stdin() -> None:
    p = _popen("import sys, time\nsys.stdout.write(sys.stdin.read().upper())\n"
               "sys.stdout.flush()\ntime.sleep(60)")
    got: list[bytes] = []
    out = procio.run(p, stdin=b"hello" * 100_000, timeout=1.0, max_output=1 << 22,
                     stop=p.kill, on_stdout=got.append)
    assert out.timed_out and bytes(out.stdout) == b"HELLO" * 100_000 == b"".join(got)
    assert out.duration < 20


def test_procio_deadline_fires_while_a_sink_blocks() -> None:
    """A reader of the stream that stops reading must not hold a command
    past its timeout: the deadline fires from the process's deadline
    thread, for several commands at once, each at its own time."""
    import threading

    def one(timeout: float, res: dict[float, float]) -> None:
        p = _popen("import sys, time\nsys.stdout.write('x')\nsys.stdout.flush()\n"
                   "time.sleep(60)")
        released = threading.Event()

        def stop() -> None:
            p.kill()
            released.set()
        def blocked(data: bytes) -> None:
            released.wait(30)
        out = procio.run(p, stdin=b"", timeout=timeout, max_output=1 << 20, stop=stop,
                         on_stdout=blocked)
        assert out.timed_out and bytes(out.stdout) == b"x"
        res[timeout] = out.duration

    res: dict[float, float] = {}
    ts = [threading.Thread(target=one, args=(t, res)) for t in (3.0, 0.5, 1.5)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sorted(res) == [0.5, 1.5, 3.0]
    for timeout, took in res.items():
        assert timeout <= took < timeout + 10, (timeout, took)


def test_landlock_is_available_here() -> None:
    assert landlock.abi() >= 1


def test_the_readmes_sandbox_and_allowlist_blocks_are_run() -> None:
    """tests/test_docs.py runs them: the SDK job with its allowlist to a
    server on the node, and the CLI's lifecycle commands."""
    from tests.test_docs import NOT_YET, doc_blocks
    run = [b.code for b in doc_blocks("README.md") if not b.skip]
    assert any('NetworkPolicy.allow_only(f"node:{port}")' in c and "sb.info.host_address" in c
               for c in run)
    assert any("lazyfs sandbox resume --label" in c and "--qos" in c for c in run)
    assert not {"docs/runtime.md", "docs/envspec.md", "docs/cluster.md"} & set(NOT_YET)


def test_a_full_vms_init_is_found_in_the_composed_layers() -> None:
    """runtime/guest/disk.py decides from the manifests, as the kernel would
    resolve the path inside the image: links (absolute, relative, "..")
    followed within the image, an upper layer's whiteout hides a lower
    init, only an executable file counts."""
    from composer.compose import compose
    from composer.manifest import Entry, Kind, LayerManifest
    from runtime.guest.disk import find_init

    def tree(*layers: list[Entry]) -> dict[str, Entry]:
        return {e.path: e for e, _ in compose([LayerManifest(x) for x in layers])}

    def d(p: str) -> Entry:
        return Entry(p, Kind.DIR, 0o755)

    bb = Entry("bin/busybox", Kind.FILE, 0o755)
    base = [d(""), d("bin"), d("sbin"), bb]
    assert find_init(tree(base)) is None
    link = Entry("sbin/init", Kind.SYMLINK, 0o777, target="../../../bin/busybox")
    assert find_init(tree([*base, link])) == "/sbin/init"  # ".." stops at the root
    absolute = Entry("sbin/init", Kind.SYMLINK, 0o777, target="/bin/busybox")
    assert find_init(tree([*base, absolute])) == "/sbin/init"
    loop = Entry("sbin/init", Kind.SYMLINK, 0o777, target="/sbin/init")
    assert find_init(tree([*base, loop])) is None
    plain = Entry("bin/init", Kind.FILE, 0o644)  # not executable
    assert find_init(tree([*base, plain])) is None
    hard = Entry("bin/init", Kind.HARDLINK, 0o755, target="bin/busybox")
    assert find_init(tree([*base, hard])) == "/bin/init"
    gone = Entry("sbin/init", Kind.WHITEOUT)
    assert find_init(tree([*base, link], [d(""), d("sbin"), gone])) is None


def test_a_file_capability_is_recorded_for_the_root_of_any_sandbox() -> None:
    """security.capability as packed from an upper written with host ids
    `ids`: revision 3 for the range's root becomes revision 2 (the root of
    whichever sandbox the layer becomes), a rootid inside the range the id
    the sandbox saw, one outside it dropped; revision 2 stays."""
    from composer.snapshot import HostIds, relative_capability

    ids = HostIds(1 << 31, 65536)
    caps = (4).to_bytes(4, "little") + bytes(12)  # CAP_DAC_READ_SEARCH permitted

    def v3(rootid: int) -> bytes:
        return (0x03000001).to_bytes(4, "little") + caps + rootid.to_bytes(4, "little")

    v2 = (0x02000001).to_bytes(4, "little") + caps
    assert relative_capability(v3(ids.base), ids) == v2
    assert relative_capability(v3(ids.base + 1000), ids) == v3(1000)
    assert relative_capability(v3(0), ids) is None  # host root's: grants no sandbox anything
    assert relative_capability(v2, ids) == v2


def test_listening_sockets_are_0600_and_leave_the_umask_alone(tmp_path: Path) -> None:
    """Many sandboxes' init sockets bound at once from threads (as a node
    creating sandboxes in parallel does): each is mode 0600, and the
    process's umask is what it was. (Saving and restoring the umask around
    bind raced between threads and could leave it 0177 for good: every
    directory the node made after that was unreadable to sandboxes.)"""
    import threading

    from runtime.backends import initexec
    before = os.umask(0o022)
    os.umask(before)
    modes: list[int] = []

    def bind_many(k: int) -> None:
        for i in range(150):
            p = tmp_path / f"s{k}-{i}.sock"
            s = initexec.listen(p)
            modes.append(os.stat(p).st_mode & 0o777)
            s.close()
            p.unlink()

    threads = [threading.Thread(target=bind_many, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    now = os.umask(before)
    assert now == before, f"the umask became {now:o}"
    assert len(modes) == 1200 and set(modes) == {0o600}
