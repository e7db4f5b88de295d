"""What a sandbox is asked to be (SandboxSpec), which image it runs
(ResolvedImage), what an exec is asked to do (ExecRequest) and what comes
back (ExecResult, SandboxInfo).

Pydantic models: one definition validates SDK arguments, node-agent request
bodies and the agent's state files, and gives the agent its OpenAPI schema.
Unknown fields are rejected everywhere; a bad value raises InvalidSpec naming
the field.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .errors import InvalidSpec

BACKENDS = ("fncall", "container", "microvm", "vm")
Backend = Literal["fncall", "container", "microvm", "vm"]
DEFAULT_MAX_OUTPUT = 1 << 20  # per stream; an agent running `yes` stops here
DEFAULT_EXEC_TIMEOUT = 600.0
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DIGEST_PATTERN = r"^blake3:[0-9a-f]{64}$"  # an image's or a layer's content digest
# Guest RAM floor of the QEMU backends (microvm, vm): the cloud kernel with
# pmem devices ran out of memory while booting in 128 MiB. A smaller
# memory_mb is refused at validation, before any VM starts, rather than
# silently raised.
MIN_GUEST_MB = 256
VM_BACKENDS = ("microvm", "vm")


class _Model(BaseModel):
    # bytes travel as base64 in JSON: command output is arbitrary binary
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_bytes="base64",
                              val_json_bytes="base64")


NODE = "node"  # in a rule: the node's own side of the sandbox's network


class Rule(_Model):
    """One allowed destination: an address or network, or NODE (the node's
    side of this sandbox's network, SandboxInfo.host_address, known only once
    the sandbox exists), a port (None = any) and a protocol."""

    cidr: str
    port: int | None = Field(default=None, ge=1, le=65535)
    protocol: Literal["tcp", "udp"] = "tcp"

    @field_validator("cidr")
    @classmethod
    def _cidr(cls, v: str) -> str:
        if v == NODE:
            return v
        try:
            return str(ipaddress.ip_network(v, strict=False))
        except ValueError as e:
            raise ValueError(f"{v!r} is not an address or network") from e


class NetworkPolicy(_Model):
    """Network reach of a sandbox. The default is none: loopback only."""

    mode: Literal["none", "allowlist"] = "none"
    allow: tuple[Rule, ...] = ()

    @classmethod
    def none(cls) -> NetworkPolicy:
        return cls()

    @classmethod
    def allow_only(cls, *rules: str | Rule) -> NetworkPolicy:
        """`allow_only("10.0.0.5:3128", "192.168.1.0/24:443/tcp", "node:8000")`;
        `node` is the node's side of the sandbox's own network (a server on
        the node, reached at SandboxInfo.host_address)."""
        return cls(mode="allowlist", allow=tuple(
            r if isinstance(r, Rule) else parse_rule(r) for r in rules))


def parse_rule(text: str) -> Rule:
    """`ADDR[/PREFIX][:PORT][/tcp|/udp]` (ADDR may be `node`) as a Rule; a
    bad one raises InvalidSpec in one line naming it."""
    rest, proto = text, "tcp"
    if rest.endswith(("/tcp", "/udp")):
        rest, proto = rest[:-4], rest[-3:]
    host, sep, port = rest.rpartition(":")
    if not sep or "/" in port or ":" in host:  # no port, or an IPv6 address
        host, port = rest, ""
    if port and not port.isdigit():
        raise InvalidSpec(f"network rule {text!r}: port {port!r} is not a number")
    try:
        return Rule(cidr=host, port=int(port) if port else None,
                    protocol=proto)  # type: ignore[arg-type]
    except pydantic.ValidationError as e:
        raise InvalidSpec(f"network rule {text!r}: {_describe(e).removeprefix('cidr: ')} "
                          "(expected ADDR[/PREFIX][:PORT][/tcp|/udp], ADDR an IP address or `node`, "
                          "e.g. 10.0.0.5:3128 or node:8000)"
                          ) from None


class Qos(str, Enum):
    latency = "latency"
    # containers: an idle cpu group (yields to every other sandbox) and every
    # process under SCHED_IDLE
    best_effort = "best_effort"


class SandboxSpec(_Model):
    image: str = Field(min_length=1)
    backend: Backend = "container"
    cpu: float = Field(default=1.0, gt=0, le=256)
    memory_mb: int = Field(default=1024, ge=16, le=1 << 20)
    disk_mb: int | None = Field(default=None, ge=1, le=1 << 24)
    pids: int = Field(default=1024, ge=8, le=1 << 22)
    # open files per process (RLIMIT_NOFILE; containers)
    open_files: int = Field(default=1024, ge=64, le=1 << 20)
    timeout: float | None = Field(default=3600.0, gt=0, le=365 * 86400)  # lifetime
    idle_timeout: float | None = Field(default=None, gt=0, le=365 * 86400)  # since the last call
    network: NetworkPolicy = NetworkPolicy()
    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    qos: Qos = Qos.latency
    workdir: str = "/"
    # paths of the image the sandbox does not see; verify() shows them again
    # (e.g. a task's hidden tests)
    hidden: tuple[str, ...] = Field(default=(), max_length=64)

    @field_validator("hidden")
    @classmethod
    def _hidden(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            parts = p.split("/")
            if not p.startswith("/") or p == "/" or "\0" in p or ".." in parts or "." in parts:
                raise ValueError(f"hidden path {p!r} must be an absolute path below /, "
                                 "without . or ..")
        return tuple(sorted({p.rstrip("/") for p in v}))

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not _LABEL.fullmatch(k) or len(val) > 256 or "\0" in val:
                raise ValueError(f"bad label {k!r}={val!r}: keys are 1-63 characters "
                                 "[A-Za-z0-9_.-/], values at most 256")
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        if not v.startswith("/") or "\0" in v:
            raise ValueError(f"workdir must be an absolute path, not {v!r}")
        return v

    @model_validator(mode="after")
    def _guest_memory(self) -> SandboxSpec:
        if self.backend in VM_BACKENDS and self.memory_mb < MIN_GUEST_MB:
            raise PydanticCustomError(
                "guest_memory", "memory_mb: {got} MB is below the {backend} backend's minimum "
                "of {min} MB (its guest kernel does not boot in less)",
                {"got": self.memory_mb, "backend": self.backend, "min": MIN_GUEST_MB})
        return self


def check_env(v: Mapping[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if not _ENV_NAME.fullmatch(k) or "\0" in val:
            raise ValueError(f"bad environment variable {k!r}")
    return dict(v)


class ExecRequest(_Model):
    cmd: tuple[str, ...] = Field(min_length=1)
    cwd: str | None = None
    env: dict[str, str] = {}
    stdin: bytes = b""
    timeout: float = Field(default=DEFAULT_EXEC_TIMEOUT, gt=0, le=7 * 86400)
    max_output_bytes: int = Field(default=DEFAULT_MAX_OUTPUT, ge=0)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any("\0" in a for a in v) or not v[0]:
            raise ValueError("command arguments must be non-empty strings without NUL")
        return v


def command(cmd: str | Sequence[str]) -> tuple[str, ...]:
    """A string runs through /bin/sh -c (as E2B's commands.run); a list runs as is."""
    return ("/bin/sh", "-c", cmd) if isinstance(cmd, str) else tuple(cmd)


class BackgroundExec(_Model):
    """A command started with sb.start(): wait() for its ExecResult."""

    id: str = Field(pattern=r"^ex-[0-9a-f]{16}$")
    sandbox_id: str
    cmd: tuple[str, ...]
    started: float


class ExecResult(_Model):
    exit_code: int  # as a shell reports it: 128+N when killed by signal N
    stdout: bytes
    stderr: bytes
    duration: float
    truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    # the command ran but its exit status could not be collected (a VM's
    # agent could not reap it); exit_code is then -1, never a made-up 0
    status_unknown: bool = False

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


# the label of a verifier's sandbox: the id of the sandbox it grades
VERIFIER_LABEL = "lazyfs.verifier-of"
VM_STATE_KEY = "lazyfs.vm-state"  # in an image's config: a microVM snapshot (VmState)
VM_STATE_FILE = "snapshot.bin"  # the one file of a VM-state layer: QEMU's migration stream


class VmState(_Model):
    """What makes an image a microVM snapshot (the config of its catalog
    entry, under VM_STATE_KEY): its top layer holds the VM's memory and
    device state (QEMU's migration stream, VM_STATE_FILE), the layers under
    it are the image the VM ran, mapped again as the same pmem devices.
    QEMU loads the stream only into a machine of the same shape: the same
    backend, guest memory and vCPUs (and accelerator, and balloon device)."""

    layer: str = Field(pattern=DIGEST_PATTERN)  # the state layer
    base: str = Field(pattern=DIGEST_PATTERN)  # the image the VM ran (its pmem layers)
    backend: str
    memory_mb: int
    cpus: int
    accel: Literal["kvm", "tcg"]
    sandbox_id: str  # whose state it is
    balloon: bool = False  # the VM had the free-page-reporting balloon (a device too)


class ResolvedImage(_Model):
    """The image a sandbox runs, fixed when it is created.

    The node resolves the spec's image name once, at create; from then on
    the sandbox is this content digest and these layers (bottom first),
    never the name: a tag moved later does not change a running sandbox,
    and backends are given only this. `name` is what was asked, for
    messages. For a microVM snapshot, `layers` are the image the VM ran
    (without the state layer) and `vm_state` says where its memory is."""

    name: str
    digest: str = Field(pattern=DIGEST_PATTERN)
    layers: tuple[str, ...]
    vm_state: VmState | None = None


class VerifyRequest(_Model):
    """verify(): the command, and which of the sandbox's files the verifier
    gets: the whole writable layer (keep=None) or only what is under `keep`
    (absolute paths, e.g. the workspace)."""

    exec: ExecRequest
    keep: tuple[str, ...] | None = None

    @field_validator("keep")
    @classmethod
    def _keep(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        for p in v:
            parts = p.split("/")
            if not p.startswith("/") or p == "/" or "\0" in p or ".." in parts:
                raise ValueError(f"keep path {p!r} must be an absolute path below /")
        return tuple(sorted(set(v)))


class SnapshotInfo(_Model):
    """A sandbox's files captured as an image: the image's layers plus one
    layer packed from the sandbox's writable upper. `image` is its content
    digest, usable wherever an image name is (Sandbox.create(snapshot.image))."""

    image: str = Field(pattern=DIGEST_PATTERN)
    tag: str
    sandbox_id: str
    layer: str = Field(pattern=DIGEST_PATTERN)  # the upper, packed
    base_image: str = Field(pattern=DIGEST_PATTERN)  # what the sandbox ran
    entries: int  # in the packed layer
    bytes: int  # file data in the packed layer
    bytes_new: int  # of which the store did not hold yet (after dedup)
    frozen_s: float  # how long the sandbox's processes were stopped
    seconds: float  # the whole call
    layers: int = 0  # of the snapshot image
    # sandbox-written layers squashed into `layer` (0: none; see
    # RuntimeConfig.max_snapshot_layers)
    flattened: int = 0


NODE_ID_PATTERN = r"[a-z0-9][a-z0-9-]{0,62}"  # a node's id in a fleet (runtime/fleet)
# what the node hands out (secrets.token_hex(8)); in a fleet, with ".<node id>"
SANDBOX_ID_PATTERN = rf"^sb-[0-9a-f]{{16}}(\.{NODE_ID_PATTERN})?$"


class PreemptedSandbox(_Model):
    """What is kept of a sandbox preempted with pause_many(snapshot=True):
    enough to make it again, with the same id, labels and files, on any
    node that sees the same image store (the record is JSON next to the
    snapshot image: in the cluster store, or the node's state directory)."""

    id: str = Field(pattern=SANDBOX_ID_PATTERN)
    spec: SandboxSpec  # as it was created (spec.image: the name asked then)
    image: str = Field(pattern=DIGEST_PATTERN)  # the snapshot of its files
    tag: str  # the snapshot's tag (keeps it from image gc until restored)
    image_digest: str = Field(pattern=DIGEST_PATTERN)  # what it ran before
    state: Literal["running", "paused"]  # when it was preempted
    created: float
    preempted: float  # when
    node: str  # where it ran
    # what the node got back: the sandbox's memory (cgroup usage) and the
    # bytes of its writable layer (on a tmpfs upper, the default, those are
    # memory too, and part of memory_bytes), just before it was stopped
    memory_bytes: int = 0
    disk_bytes: int = 0
    snapshot: SnapshotInfo


EventKind = Literal["syscall", "connect", "oom_kill", "process_limit", "disk_limit",
                    "tampering", "landlock"]


class SandboxEvent(_Model):
    """Something the sandbox was refused (runtime/isolation/denials.py), counted:
    kind `syscall` (detail: the system call), `connect` (the refused
    destination, ADDR:PORT/PROTO), `oom_kill`, `process_limit` (forks refused
    at the pids limit), `disk_limit` (a command ended with the sandbox's disk
    full: containers; each such command counts once), `tampering` (a
    Landlock refusal of ptrace-class access or a signal to another command's
    process; detail: the kernel's blockers, `ptrace`, `scope.signal`),
    `landlock` (a Landlock file or TCP rule: `fs.write_file`,
    `net.connect_tcp`, ...; `restrict_self unlogged`: a Landlock domain made
    so that its refusals would not be logged). `first` is None for what the kernel counts (we learn
    of it when asked)."""

    kind: EventKind
    detail: str
    count: int = Field(ge=1)
    first: float | None
    last: float


class ReadEvent(_Model):
    """One chunk of the image read for the first time through the sandbox's
    root: seconds since the node's lazyfs daemon started, the layer, the
    file's path in it and the chunk's index in the file."""

    t: float
    layer: str
    path: str
    chunk: int


class ReadLedger(_Model):
    """What a sandbox read of its image so far, as the node's lazyfs daemon
    counted it for the sandbox's root (docs/lazyfs.md, "Tracing and
    stats"): image files opened, chunks first read through this root and
    the bytes they hold, bytes served, read requests; `trace` (when asked
    for) the first reads in order. Chunks another sandbox had already
    brought into the page cache are read from there and are not counted."""

    files: int
    chunks: int
    touched_bytes: int
    served_bytes: int
    reads: int
    trace: list[ReadEvent] | None = None


class CheckpointInfo(_Model):
    """A container sandbox's processes and files at one instant: its files
    as a snapshot image (`files`) and CRIU's images of its processes packed
    into a layer of their own (`memory_layer`, untrusted chunks, zstd,
    deduplicated). `id` is the content digest of the checkpoint's record:
    Sandbox.restore(checkpoint) (or its id) starts a sandbox from it."""

    id: str = Field(pattern=DIGEST_PATTERN)
    tag: str
    sandbox_id: str
    files: SnapshotInfo
    memory_layer: str = Field(pattern=DIGEST_PATTERN)
    memory_bytes: int  # CRIU's images, all files
    memory_bytes_new: int  # of which the store did not hold yet (after dedup)
    dump_s: float  # CRIU's dump, the sandbox stopped
    frozen_s: float  # how long the sandbox's processes were stopped (dump + files)
    seconds: float  # the whole call


# the config key of a checkpoint's catalog entry, holding its CheckpointRecord
CHECKPOINT_KEY = "lazyfs.checkpoint"


class CheckpointRecord(_Model):
    """What a checkpoint's record (the config of its catalog entry, under
    CHECKPOINT_KEY) holds: what a restore needs besides the memory images."""

    files: str = Field(pattern=DIGEST_PATTERN)  # the image of its files
    spec: SandboxSpec  # the sandbox's, its image set to `files` on restore
    channel_name: str = Field(pattern=r"^lazyfs-ctl-[0-9a-f]{16}$")
    sandbox_id: str
    criu: str
    # the first host id of the checkpointed sandbox's user namespace
    # (runtime/isolation/idmap.py); None: ids mapped to themselves
    id_base: int | None = None


class SandboxInfo(_Model):
    id: str
    spec: SandboxSpec
    image_digest: str = Field(pattern=DIGEST_PATTERN)  # what spec.image resolved to at create
    state: Literal["running", "paused", "stopped"]
    # the node's own end of the sandbox's network: where a sandbox reaches a
    # server on the node (allowed as `node:PORT`); None without a network
    host_address: str | None = None
    created: float = Field(default_factory=time.time)
    last_active: float = Field(default_factory=time.time)
    node: str = ""


class Forked(_Model):
    """What sb.fork(n) made: the snapshot of the sandbox's files and the
    sandboxes running it."""

    snapshot: SnapshotInfo
    children: list[SandboxInfo]


M = TypeVar("M", bound=BaseModel)


def build(model: type[M], **kwargs: Any) -> M:
    """model(**kwargs), with a validation error raised as InvalidSpec naming
    each field and what was wrong."""
    try:
        return model(**kwargs)
    except pydantic.ValidationError as e:
        raise InvalidSpec(_describe(e)) from None


def parse(model: type[M], raw: bytes | str) -> M:
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        raise InvalidSpec(_describe(e)) from None


def _describe(e: pydantic.ValidationError) -> str:
    """One line: `field: what was wrong` per error (pydantic's own rendering
    spans lines and ends with a documentation URL)."""
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ").replace("\n", " ")
        # a model-level check names its field itself
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def show(cmd: Sequence[str]) -> str:
    return shlex.join(cmd)
