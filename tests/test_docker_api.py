"""The Docker Engine API endpoint (`lazyfs agent --docker-socket`) driven by
clients nobody here wrote: Debian's docker CLI and docker-py. A real agent
over a real lazyfs node; a real registry (TLS and basic auth) for pull; a
git repository made with the host's git for the SWE-bench-like flow."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import docker
import pytest

from runtime import Sandbox
from tests.helpers.agents import Agent, running_agent
from tests.helpers.images import build_busybox_rootfs, tar_of
from tests.helpers.registry import Registry, push_image
from tests.helpers.sandboxes import IMAGE, runtime_missing
from tests.helpers.support import free_port, wait_until
from tests.helpers.tlscerts import ThrowawayCA

# Debian's docker CLI (docker.io), the one install.sh installs, even where
# another one comes first in PATH
DOCKER = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else shutil.which("docker")

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing())),
              pytest.mark.skipif(DOCKER is None,
                                 reason="needs the docker CLI (apt-get install docker.io)")]


class Endpoint:
    def __init__(self, agent: Agent, sock: Path, certs: Path, home: Path) -> None:
        self.agent, self.sock, self.certs = agent, sock, certs
        # the CLI's own files (config.json) in a directory of the test's
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{sock}", "DOCKER_CONFIG": str(home)}

    def cli(self, *args: str, stdin: bytes | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess[bytes]:
        assert DOCKER is not None
        return subprocess.run([DOCKER, *args], env=self.env, input=stdin,
                              capture_output=True, timeout=timeout, check=False)

    def ok(self, *args: str, stdin: bytes | None = None) -> str:
        p = self.cli(*args, stdin=stdin)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return p.stdout.decode()

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=f"unix://{self.sock}", version="auto", timeout=120)

    def sandboxes(self) -> set[str]:
        return {s.id for s in Sandbox.list(node=self.agent.unix)}

    def raw(self, request: bytes, *, read_timeout: float = 30) -> bytes:
        """One request as bytes on the socket; the answer until the server
        closes or sends a whole response."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(read_timeout)
            s.connect(str(self.sock))
            try:
                s.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass
            out = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not chunk:
                    break
                out += chunk
                head, sep, body = out.partition(b"\r\n\r\n")
                if sep and b"content-length:" in head.lower():
                    n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    if len(body) >= n:
                        break
            return out


@pytest.fixture(scope="module")
def ep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    d = tmp_path_factory.mktemp("docker")
    sock, certs, home = d / "docker.sock", d / "certs.d", d / "docker-home"
    certs.mkdir()
    home.mkdir()
    with running_agent(d, extra=["--docker-socket", str(sock),
                                 "--docker-certs-dir", str(certs)]) as a:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.1)
        yield Endpoint(a, sock, certs, home)


def test_versions_ping_and_info_as_clients_negotiate(ep: Endpoint) -> None:
    out = ep.ok("version", "--format", "{{json .}}")
    doc = json.loads(out)
    assert doc["Server"]["ApiVersion"] == "1.47"
    assert doc["Server"]["MinAPIVersion"] <= doc["Client"]["ApiVersion"] <= "1.47"
    cl = ep.client()
    assert cl.ping() is True
    assert cl.api.api_version == "1.47"
    assert cl.info()["DefaultRuntime"] == "lazyfs-container"
    # a version older than the minimum is refused in Docker's words
    answer = ep.raw(b"GET /v1.12/version HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 400 " in answer.split(b"\r\n")[0] and b"too old" in answer


def test_cli_run_exec_cp_logs_kill_wait_commit(ep: Endpoint, tmp_path: Path) -> None:
    before = ep.sandboxes()
    # run --rm: output on the right streams, the exit code, nothing left
    p = ep.cli("run", "--rm", IMAGE, "sh", "-c", "echo out; echo err >&2; exit 3")
    assert (p.returncode, p.stdout, p.stderr) == (3, b"out\n", b"err\n")
    assert ep.sandboxes() == before
    # stdin through run -i
    p = ep.cli("run", "-i", "--rm", IMAGE, "wc", "-c", stdin=b"x" * 12345)
    assert (p.returncode, p.stdout.strip()) == (0, b"12345")

    cid = ep.ok("run", "-d", "--name", "cli-box", "--label", "suite=docker-cli", IMAGE,
                "sh", "-c", "echo started; sleep 600").strip()
    assert cid in ep.sandboxes()  # the container is the sandbox: same id
    listed = ep.ok("ps", "--filter", "label=suite=docker-cli", "--format", "{{.Names}}")
    assert listed.split() == ["cli-box"]
    assert ep.ok("ps", "--filter", "label=suite=other", "-q") == ""

    p = ep.cli("exec", "cli-box", "sh", "-c", "echo in-exec; exit 5")
    assert (p.returncode, p.stdout) == (5, b"in-exec\n")
    assert ep.ok("exec", "-i", "cli-box", "cat", stdin=b"piped\n") == "piped\n"

    # cp in (a file and a directory tree) and out, bytes compared
    blob = os.urandom(300_000)
    (tmp_path / "in.bin").write_bytes(blob)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.txt").write_text("alpha\n")
    (tree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "run.sh").chmod(0o755)
    os.symlink("sub/a.txt", tree / "link")
    ep.ok("cp", str(tmp_path / "in.bin"), "cli-box:/tmp/in.bin")
    ep.ok("cp", str(tree), "cli-box:/work")
    assert ep.ok("exec", "cli-box", "/work/run.sh") == "ran\n"
    assert ep.ok("exec", "cli-box", "cat", "/work/link") == "alpha\n"
    ep.ok("cp", "cli-box:/tmp/in.bin", str(tmp_path / "out.bin"))
    assert (tmp_path / "out.bin").read_bytes() == blob
    ep.ok("cp", "cli-box:/work", str(tmp_path / "back"))
    assert (tmp_path / "back" / "sub" / "a.txt").read_text() == "alpha\n"
    assert os.readlink(tmp_path / "back" / "link") == "sub/a.txt"
    assert os.stat(tmp_path / "back" / "run.sh").st_mode & 0o777 == 0o755
    p = ep.cli("cp", "cli-box:/no/such/file", str(tmp_path / "x"))
    assert p.returncode != 0 and b"no/such/file" in p.stderr

    assert ep.ok("logs", "cli-box") == "started\n"
    ep.ok("kill", "cli-box")
    assert ep.ok("wait", "cli-box").strip() == "137"
    state = ep.ok("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", "cli-box")
    assert state.split() == ["exited", "137"]
    p = ep.cli("exec", "cli-box", "true")
    assert p.returncode != 0 and b"not running" in p.stderr

    # the exited container's files become an image later containers run
    image_id = ep.ok("commit", "cli-box", "committed/cli:1").strip()
    assert image_id.startswith("blake3:")
    assert "committed/cli" in ep.ok("images", "--format", "{{.Repository}}:{{.Tag}}")
    p = ep.cli("run", "--rm", "committed/cli:1", "cat", "/work/sub/a.txt")
    assert (p.returncode, p.stdout) == (0, b"alpha\n")
    ep.ok("rm", "cli-box")
    assert cid not in ep.sandboxes()
    ep.ok("rmi", "committed/cli:1")

    # logs -f follows a running container to its end
    ep.ok("run", "-d", "--name", "follow", IMAGE, "sh", "-c",
          "for i in 1 2 3; do echo line $i; sleep 0.3; done")
    t0 = time.monotonic()
    assert ep.ok("logs", "-f", "follow") == "line 1\nline 2\nline 3\n"
    assert time.monotonic() - t0 > 0.4  # it followed, the lines came as they were printed
    ep.ok("rm", "-f", "follow")


def test_cli_stop_signals_then_kills_after_its_timeout(ep: Endpoint) -> None:
    ep.ok("run", "-d", "--name", "polite", IMAGE, "sleep", "600")
    ep.ok("run", "-d", "--name", "stubborn", IMAGE, "sh", "-c",
          "trap '' TERM; while true; do sleep 0.2; done")
    time.sleep(0.5)
    ep.ok("stop", "-t", "30", "polite")
    assert ep.ok("inspect", "-f", "{{.State.ExitCode}}", "polite").strip() == "143"
    t0 = time.monotonic()
    ep.ok("stop", "-t", "1", "stubborn")
    assert 0.9 < time.monotonic() - t0 < 20
    assert ep.ok("inspect", "-f", "{{.State.ExitCode}}", "stubborn").strip() == "137"
    ep.ok("start", "polite")  # an exited container runs again, same sandbox
    assert ep.ok("inspect", "-f", "{{.State.Running}}", "polite").strip() == "true"
    ep.ok("pause", "polite")
    assert ep.ok("inspect", "-f", "{{.State.Status}}", "polite").strip() == "paused"
    ep.ok("unpause", "polite")
    ep.ok("rename", "polite", "renamed")
    ep.ok("rm", "-f", "renamed", "stubborn")


def test_docker_py_exec_demux_integrity_archives_and_events(ep: Endpoint) -> None:
    cl = ep.client()
    since = time.time() - 1
    c = cl.containers.run(IMAGE, ["sleep", "600"], detach=True, labels={"suite": "py"})
    try:
        r = c.exec_run(["sh", "-c", "echo out; echo err >&2; exit 4"], demux=True)
        assert (r.exit_code, r.output) == (4, (b"out\n", b"err\n"))
        # output that looks like the stream's own frame headers is data, not framing
        fake = b"\x01\x00\x00\x00\x00\x00\x00\x05forged\x02\x00\x00\x00\x00\x00\x00\x01"
        r = c.exec_run(["sh", "-c", ("printf '\\001\\000\\000\\000\\000\\000\\000\\005forged"
                        "\\002\\000\\000\\000\\000\\000\\000\\001'; exit 0")], demux=True)
        assert r.exit_code == 0 and r.output[0] == fake and r.output[1] is None
        # an exit code comes from the sandbox's init, not from what the command prints
        r = c.exec_run(["sh", "-c", "echo '{\"ExitCode\": 0}'; kill -9 $$"])
        assert r.exit_code == 137
        # archives: put a tar, get it back, owners as the sandbox sees them
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("dir/owned.txt")
            data = b"owned by 1000\n"
            info.size, info.uid, info.gid, info.mode = len(data), 1000, 1000, 0o640
            tar.addfile(info, io.BytesIO(data))
        assert c.put_archive("/tmp", buf.getvalue()) is True
        fields = c.exec_run(["ls", "-ln", "/tmp/dir/owned.txt"]).output.decode().split()
        assert fields[0] == "-rw-r-----" and fields[2:4] == ["0", "0"]  # (not copyUIDGID)
        stream, st = c.get_archive("/tmp/dir")
        assert st["name"] == "dir"
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            f = tar.extractfile("dir/owned.txt")
            assert f is not None and f.read() == b"owned by 1000\n"
        # a hostile archive is refused whole: nothing of it is written
        bad = io.BytesIO()
        with tarfile.open(fileobj=bad, mode="w") as tar:
            ok = tarfile.TarInfo("fine.txt")
            ok.size = 2
            tar.addfile(ok, io.BytesIO(b"ok"))
            esc = tarfile.TarInfo("../../etc/escaped")
            esc.size = 2
            tar.addfile(esc, io.BytesIO(b"no"))
        with pytest.raises(docker.errors.APIError, match=r"leaves the directory"):
            c.put_archive("/tmp", bad.getvalue())
        assert c.exec_run(["ls", "/tmp/fine.txt"]).exit_code != 0
        assert c.exec_run(["ls", "/etc/escaped"]).exit_code != 0
    finally:
        c.remove(force=True)
    events = cl.events(since=since, until=time.time() + 1, decode=True,
                       filters={"label": "suite=py"})
    actions = [e["Action"] for e in events if e["id"] == c.id]
    assert actions[:2] == ["create", "start"] and actions[-1] == "destroy"
    assert "die" in actions


def _git_image(d: Path) -> Path:
    """A rootfs: busybox, the host's git with its libraries, and /repo, a
    git repository made with the host's git (a function and a test of it)."""
    root = build_busybox_rootfs(d / "rootfs")
    git = Path(shutil.which("git") or "/usr/bin/git")
    libs = subprocess.run(["ldd", str(git)], capture_output=True, text=True,
                          check=True).stdout.split()
    for f in [str(git), *[x for x in libs if x.startswith("/")]]:
        dest = root / f.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(f), dest)
    repo = root / "repo"
    repo.mkdir()
    (repo / "calc.sh").write_text("add() { echo $(($1 - $2)); }\n")  # the bug to fix
    (repo / "test.sh").write_text(". ./calc.sh\n[ \"$(add 2 3)\" = 5 ] && echo PASSED "
                                  "|| { echo FAILED; exit 1; }\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(d)}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "task"]):
        subprocess.run(["git", *cmd], cwd=repo, env=env, check=True)
    return root


PATCH = b"""--- a/calc.sh
+++ b/calc.sh
@@ -1 +1 @@
-add() { echo $(($1 - $2)); }
+add() { echo $(($1 + $2)); }
"""


def test_pull_with_tls_and_auth_then_a_swe_bench_like_flow(ep: Endpoint, tmp_path: Path
                                                           ) -> None:
    root = _git_image(tmp_path)
    layer = tar_of(root, tmp_path / "layer.tar", compression="gzip")
    with Registry(tmp_path / "reg", auth=True, tls=True) as reg:
        push_image(reg, "swe/task", "1", [layer],
                   {"Cmd": ["/bin/sh"], "WorkingDir": "/repo", "Env": ["TASK=calc"]})
        assert reg.cert_path is not None
        (ep.certs / reg.host).mkdir()
        shutil.copy(reg.cert_path, ep.certs / reg.host / "ca.crt")
        cl = ep.client()
        name = f"{reg.host}/swe/task"
        with pytest.raises(docker.errors.APIError):  # no credentials: the registry says no
            cl.images.pull(name, tag="1")
        img = cl.images.pull(name, tag="1", auth_config={"username": reg.username,
                                                         "password": reg.password})
        assert img.id.startswith("blake3:") and f"{name}:1" in img.tags
        assert cl.images.get(f"{name}:1").attrs["Config"]["WorkingDir"] == "/repo"
        # the CLI: login (the endpoint checks the credentials with the registry), pull
        assert reg.password is not None and reg.username is not None
        p = ep.cli("login", reg.host, "-u", reg.username, "--password-stdin",
                   stdin=b"wrong\n")
        assert p.returncode != 0 and b"incorrect username or password" in p.stderr
        p = ep.cli("login", reg.host, "-u", reg.username, "--password-stdin",
                   stdin=reg.password.encode() + b"\n")
        assert p.returncode == 0 and b"Login Succeeded" in p.stdout, p.stderr
        ep.ok("rmi", f"{name}:1")
        p = ep.cli("pull", f"{name}:1")
        assert p.returncode == 0 and b"Downloaded newer image" in p.stdout + p.stderr, p

    # the evaluation flow, as SWE-bench's harness drives docker-py
    c = cl.containers.run(f"{name}:1", ["sleep", "3600"], detach=True)
    try:
        assert c.exec_run(["sh", "test.sh"]).exit_code == 1  # the bug is there
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("patch.diff")
            info.size = len(PATCH)
            tar.addfile(info, io.BytesIO(PATCH))
        assert c.put_archive("/tmp", buf.getvalue())
        r = c.exec_run(["git", "apply", "-v", "/tmp/patch.diff"], workdir="/repo")
        assert r.exit_code == 0, r.output
        r = c.exec_run(["sh", "-c", "echo $TASK; sh test.sh > /tmp/test.log 2>&1"])
        assert (r.exit_code, r.output) == (0, b"calc\n")
        stream, _ = c.get_archive("/tmp/test.log")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            f = tar.extractfile("test.log")
            assert f is not None and f.read() == b"PASSED\n"
        assert c.exec_run(["git", "diff", "--stat"], workdir="/repo").output.strip() \
            .endswith(b"1 insertion(+), 1 deletion(-)")
    finally:
        c.remove(force=True)
    cl.images.remove(f"{name}:1")


def test_fifty_containers_at_once_through_docker_py_threads(ep: Endpoint) -> None:
    before = ep.sandboxes()
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        cl = ep.client()
        try:
            c = cl.containers.run(IMAGE, ["sleep", "300"], detach=True,
                                  labels={"suite": "fifty"})
            r = c.exec_run(["sh", "-c", f"echo {i}; exit {i % 7}"])
            c.remove(force=True)
            results[i] = (r.exit_code, r.output)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert {i: results.get(i) for i in range(50)} == {
        i: (i % 7, f"{i}\n".encode()) for i in range(50)}
    assert ep.sandboxes() == before  # every one removed, nothing leaked


def test_malformed_and_refused_requests_leave_nothing_half_made(ep: Endpoint) -> None:
    before = ep.sandboxes()
    body = b"{not json"
    answer = ep.raw(b"POST /v1.47/containers/create HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body))
    assert b" 400 " in answer.split(b"\r\n")[0] and b"invalid JSON" in answer
    cl = ep.client()
    with pytest.raises(docker.errors.ImageNotFound, match="No such image: nope:0"):
        cl.api.create_container("nope:0", ["true"])
    for kwargs, field in (({"volumes": ["/etc:/x"]}, "Binds"),
                          ({"privileged": True}, "Privileged"),
                          ({"cap_add": ["SYS_ADMIN"]}, "CapAdd"),
                          ({"devices": ["/dev/sda:/dev/sda"]}, "Devices"),
                          ({"network_mode": "host"}, "NetworkMode")):
        with pytest.raises(docker.errors.APIError, match=field):
            cl.containers.create(IMAGE, ["true"], **kwargs)
    with pytest.raises(docker.errors.APIError, match="lazyfs build"):
        cl.images.build(fileobj=io.BytesIO(b"FROM scratch\n"))
    with pytest.raises(docker.errors.APIError, match="networks"):
        cl.networks.create("n1")
    # a head of 100 KB
    answer = ep.raw(b"GET /_ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    assert b" 431 " in answer.split(b"\r\n")[0]
    # a 10 GB archive upload: refused from its head, before any byte of it
    c = cl.containers.create(IMAGE, ["sleep", "60"])
    try:
        answer = ep.raw(f"PUT /v1.47/containers/{c.id}/archive?path=/tmp HTTP/1.1\r\n"
                        "Host: x\r\nContent-Type: application/x-tar\r\n"
                        f"Content-Length: {10 << 30}\r\n\r\n".encode() + b"\0" * 65536)
        assert b" 413 " in answer.split(b"\r\n")[0]
        # and one that says nothing of its size, sent until refused
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(ep.sock))
            s.sendall(f"PUT /v1.47/containers/{c.id}/archive?path=/tmp HTTP/1.1\r\nHost: x\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n".encode())
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b"\0" * (1 << 20))
            sent = 0
            try:
                while sent < (2 << 30):
                    s.sendall(chunk)
                    sent += 1 << 20
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert sent < (2 << 30)
        assert c.get_archive("/tmp")[1]["name"] == "tmp"
        with tarfile.open(fileobj=io.BytesIO(b"".join(c.get_archive("/tmp")[0]))) as tar:
            assert [m.name for m in tar.getmembers()] == ["tmp"]  # nothing of either upload
    finally:
        c.remove(force=True)
    assert cl.ping() is True  # the endpoint is unharmed
    assert ep.sandboxes() == before


@contextmanager
def _tls_endpoint(tmp_path: Path, ca: Path, cert: Path, key: Path) -> Iterator[int]:
    """An agent serving the Docker endpoint over TLS on a port of its own
    (yielded once it accepts connections)."""
    port = free_port()
    d = tmp_path / "agent"
    d.mkdir()
    with running_agent(d, extra=["--docker-listen", f"127.0.0.1:{port}",
                                 "--docker-tlscacert", str(ca), "--docker-tlscert", str(cert),
                                 "--docker-tlskey", str(key)]):
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(listening, 20, "the Docker endpoint's TCP port")
        yield port


def test_tcp_only_with_client_certificates(tmp_path: Path) -> None:
    """`--docker-listen` serves TCP with TLS client certificates, as dockerd's
    --tlsverify: the docker CLI (DOCKER_CERT_PATH, DOCKER_TLS_VERIFY) and
    docker-py's TLSConfig work unchanged; a client without a certificate,
    with one of another CA, or speaking plain HTTP gets nothing."""
    ca = ThrowawayCA(tmp_path / "ca")
    server = ca.issue(tmp_path / "server", "node", server_ip="127.0.0.1")
    ca.issue(tmp_path / "client", "harness")
    other = ThrowawayCA(tmp_path / "other-ca")
    other.issue(tmp_path / "stranger", "stranger")
    with _tls_endpoint(tmp_path, ca.path, server.cert, server.key) as port:
        assert DOCKER is not None
        env = {**os.environ, "DOCKER_HOST": f"tcp://127.0.0.1:{port}", "DOCKER_TLS_VERIFY": "1",
               "DOCKER_CERT_PATH": str(tmp_path / "client"),
               "DOCKER_CONFIG": str(tmp_path / "home")}
        p = subprocess.run([DOCKER, "run", "--rm", IMAGE, "sh", "-c", "echo over tls; exit 7"],
                           env=env, capture_output=True, timeout=120, check=False)
        assert (p.returncode, p.stdout) == (7, b"over tls\n"), p.stderr
        tls = docker.tls.TLSConfig(client_cert=(str(tmp_path / "client/cert.pem"),
                                                str(tmp_path / "client/key.pem")),
                                   ca_cert=str(ca.path), verify=True)
        # (requests lets $REQUESTS_CA_BUNDLE, set on some machines, override the
        # session's CA: the test's client ignores the environment)
        api = docker.APIClient(base_url=f"https://127.0.0.1:{port}", tls=tls, version="1.41")
        api.trust_env = False
        cl = docker.DockerClient(base_url=f"https://127.0.0.1:{port}", tls=tls, version="1.41")
        cl.api = api
        c = cl.containers.run(IMAGE, ["sleep", "60"], detach=True)
        r = c.exec_run(["sh", "-c", "echo out; echo err >&2"], demux=True)
        assert r.output == (b"out\n", b"err\n")
        c.remove(force=True)
        for cert_dir in ("stranger", None):  # another CA's certificate; none at all
            env2 = {**env, "DOCKER_CERT_PATH": str(tmp_path / (cert_dir or "server"))}
            if cert_dir is None:  # the CA to verify the server, no client certificate
                bare = tmp_path / "bare"
                bare.mkdir(exist_ok=True)
                shutil.copy(ca.path, bare / "ca.pem")
                env2 = {**env, "DOCKER_TLS_VERIFY": "", "DOCKER_CERT_PATH": "",
                        "DOCKER_HOST": f"tcp://127.0.0.1:{port}"}
                args = ["--tlsverify", f"--tlscacert={bare / 'ca.pem'}", "ps"]
            else:
                shutil.copy(ca.path, tmp_path / "stranger" / "ca.pem")
                args = ["ps"]
            p = subprocess.run([DOCKER, *args], env=env2, capture_output=True, timeout=60,
                               check=False)
            assert p.returncode != 0 and b"CONTAINER ID" not in p.stdout, (cert_dir, p)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /containers/json HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                answer = s.recv(4096)
            except ConnectionResetError:
                answer = b""
            assert b"Id" not in answer and b"200 OK" not in answer


def test_with_the_fleets_ca_a_node_certificate_is_no_caller(tmp_path: Path) -> None:
    """The Docker endpoint over TLS with the fleet's CA: a client
    certificate of the fleet is served, a node's certificate (it carries
    clientAuth, for etcd) gets nothing: a node taken over does not become
    root over another node's sandboxes."""
    from runtime.fleet.ca import FleetCA

    ca = FleetCA.init(tmp_path / "ca")
    server = ca.issue_node("n1", tmp_path / "n1", ("127.0.0.1",))
    client = ca.issue_client("harness", tmp_path / "harness")
    other_node = ca.issue_node("n2", tmp_path / "n2")
    with _tls_endpoint(tmp_path, ca.dir / "ca.pem", server.cert, server.key) as port:
        def containers(ident: Any) -> list[Any]:
            tls = docker.tls.TLSConfig(client_cert=(str(ident.cert), str(ident.key)),
                                       ca_cert=str(ca.dir / "ca.pem"), verify=True)
            api = docker.APIClient(base_url=f"https://127.0.0.1:{port}", tls=tls,
                                   version="1.41", timeout=30)
            api.trust_env = False
            try:
                out: list[Any] = api.containers(all=True)
                return out
            finally:
                api.close()

        assert containers(client) == []  # the fleet's client: served
        with pytest.raises((docker.errors.DockerException, OSError)):
            containers(other_node)  # another node's certificate: nothing


def test_plain_tcp_is_refused_in_one_line(tmp_path: Path) -> None:
    from tests.helpers.agents import REPO
    p = subprocess.run([sys.executable, "-m", "tools.cli", "agent", "--state",
                        str(tmp_path / "state"), "--docker-listen", "127.0.0.1:2375"],
                       cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].endswith(
        "the Docker API is never served on plain TCP")
    assert not (tmp_path / "state").exists()


def test_containers_outlive_a_restarted_agent_as_exited(tmp_path: Path) -> None:
    """The agent keeps a record per container: restarted, it shows them
    again (exited: their main process ended with it), and start, cp and
    rm work on them; a record whose sandbox is gone is dropped."""
    sock = tmp_path / "docker.sock"
    with running_agent(tmp_path, extra=["--docker-socket", str(sock)]) as a:
        wait_until(sock.exists, 20, "the Docker socket")
        cl = docker.DockerClient(base_url=f"unix://{sock}", version="auto")
        kept = cl.containers.run(IMAGE, ["sleep", "600"], detach=True, name="kept")
        kept.exec_run(["sh", "-c", "echo survived > /tmp/mark"])
        gone = cl.containers.run(IMAGE, ["sleep", "600"], detach=True, name="gone")
        a.stop()
        from runtime.config import RuntimeConfig
        from runtime.node import Node
        n = Node(RuntimeConfig(store=a.store, state_dir=a.d / "state", node_root=a.node_root))
        n.kill(gone.id)  # its sandbox goes while no agent runs
        n.close()
        a.start()
        wait_until(sock.exists, 20, "the Docker socket")
        cl = docker.DockerClient(base_url=f"unix://{sock}", version="auto")
        listed = {c.name: c for c in cl.containers.list(all=True)}
        assert set(listed) == {"kept"}
        c = listed["kept"]
        assert c.status == "exited" and c.attrs["State"]["ExitCode"] == 137
        assert "agent restarted" in c.attrs["State"]["Error"]
        c.start()
        assert c.exec_run(["cat", "/tmp/mark"]).output == b"survived\n"
        c.remove(force=True)
        assert not list((tmp_path / "state" / "docker").glob("*.json"))


def test_docker_py_tag_logs_tail_detached_exec_top_and_inspect(ep: Endpoint) -> None:
    cl = ep.client()
    img = cl.images.get(IMAGE)
    assert img.tag("tagged/bb", "7") is True
    assert cl.images.get("tagged/bb:7").id == img.id
    cl.images.remove("tagged/bb:7")
    with pytest.raises(docker.errors.ImageNotFound):
        cl.images.get("tagged/bb:7")
    assert cl.images.get(IMAGE).id == img.id  # untagging one name leaves the others
    c = cl.containers.run(IMAGE, ["sh", "-c", ("for i in 1 2 3 4 5; do echo $i; done; "
                                  "echo e >&2; sleep 600")], detach=True,
                          environment={"FOO": "bar"}, working_dir="/tmp", mem_limit="64m",
                          nano_cpus=500_000_000, pids_limit=64, labels={"k": "v"})
    try:
        wait_until(lambda: b"5" in c.logs(), 20, "the container's output")
        assert c.logs(tail=2, stderr=False) == b"4\n5\n"
        assert c.logs(stdout=False) == b"e\n"
        assert c.logs(since=time.time() + 60) == b""
        ts = c.logs(timestamps=True, stderr=False).splitlines()
        assert len(ts) == 5 and ts[0].endswith(b"Z 1")
        exec_id = cl.api.exec_create(c.id, ["sh", "-c", ("sleep 0.3; echo $FOO > detached; "
                                            "exit 9")])["Id"]
        assert cl.api.exec_start(exec_id, detach=True) in (b"", "")
        wait_until(lambda: cl.api.exec_inspect(exec_id)["ExitCode"] is not None, 20,
                   "the detached exec")
        assert cl.api.exec_inspect(exec_id)["ExitCode"] == 9
        assert c.exec_run(["cat", "/tmp/detached"]).output == b"bar\n"  # env and workdir
        attrs = cl.api.inspect_container(c.id)
        assert attrs["Config"]["Labels"] == {"k": "v"}
        assert attrs["HostConfig"]["Runtime"] == "lazyfs-container"
        sb = Sandbox.connect(c.id, node=ep.agent.unix)  # the limits are the sandbox's
        assert (sb.info.spec.memory_mb, sb.info.spec.cpu, sb.info.spec.pids) == (64, 0.5, 64)
        top = c.top()
        assert any("sleep" in " ".join(p) for p in top["Processes"]), top
    finally:
        c.remove(force=True)


@pytest.mark.parametrize("body", [
    {"Image": 5}, {"Image": IMAGE, "Cmd": [1, 2]}, {"Image": IMAGE, "Cmd": {"a": 1}},
    {"Image": IMAGE, "Env": "A=1"}, {"Image": IMAGE, "Env": [None]},
    {"Image": IMAGE, "Cmd": ["true"], "HostConfig": []},
    {"Image": IMAGE, "Cmd": ["true"], "HostConfig": {"Memory": "lots"}},
    {"Image": IMAGE, "Cmd": ["true"], "HostConfig": {"Memory": 1}},
    {"Image": IMAGE, "Cmd": ["true"], "HostConfig": {"NanoCpus": -5}},
    {"Image": IMAGE, "Cmd": ["true"], "HostConfig": {"PidsLimit": 1.5}},
    {"Image": IMAGE, "Cmd": ["true"], "Labels": {"k": 1}},
    {"Image": IMAGE, "Cmd": ["true"], "Labels": {"bad key!": "v"}},
    {"Image": IMAGE, "Cmd": ["true"], "StopSignal": "SIGNOPE"},
    {"Image": IMAGE, "Cmd": ["true"], "StopTimeout": "soon"},
    {"Image": IMAGE, "Cmd": ["true"], "WorkingDir": "relative"},
    {"Image": IMAGE, "Cmd": ["true"], "User": "1000"},
    {"Image": IMAGE, "Cmd": ["a\0b"]}, {"Image": IMAGE, "Cmd": []},
    {"Image": IMAGE, "Cmd": ["true"], "HostConfig": {"Runtime": "kata"}},
    [1, 2, 3], "a string",
])
def test_a_malformed_create_is_a_400_and_makes_nothing(ep: Endpoint, body: Any) -> None:
    before = ep.sandboxes()
    raw = json.dumps(body).encode()
    answer = ep.raw(b"POST /v1.41/containers/create HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(raw), raw))
    status = answer.split(b"\r\n")[0]
    assert b" 400 " in status, answer
    message = json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert "\n" not in message and message
    assert ep.sandboxes() == before
    assert ep.client().containers.list(all=True, filters={"status": "created"}) == []
