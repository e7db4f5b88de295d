"""The guest's initramfs: the whole userland a sandbox VM boots, besides
its image.

    path = initramfs(kernel, cache_dir)      # built once per input set, cached

Contents (cpio newc, uncompressed: under TCG decompressing costs more than
reading the extra megabytes):

    /bin/busybox       busybox-static (mount, insmod, sh ...)
    /modules/*.ko      virtio-pci, virtio-pmem + nd_pmem, EROFS, overlayfs,
    /modules/order     virtio-console, virtio-net, virtio-balloon (microvm), in
                       dependency order (kernel.load_order)
    /lazyfs-agent      the guest agent (runtime/native/guest-agent.c), static
    /init              the script below

Two flavours, each with its own /init (and cache key):

microvm  /init loads the modules, mounts each layer from its two virtio-pmem
         devices (EROFS metadata image, EROFS blob as its extra device) with
         `-o ro,dax` at /layers/<i> -- or, with lazyfs.layers_on=blk, the same
         two files as virtio-blk disks (serials lz<i>m, lz<i>b) without dax --
         composes them with overlayfs under a tmpfs upper (/rw/upper) at
         /sandbox, gives that root a minimal /dev, /proc and /sys, and becomes
         the agent (PID 1), which chroots each command into /sandbox and
         streams /rw/upper to the host for verify (--upper).
vm       /init mounts the layers as microvm's does (always pmem + dax),
         composes them under the sandbox's ext4 disk (serial lazyfs-upper,
         virtio-blk, read-write) as the overlayfs upper at /newroot. With
         lazyfs.init=PATH it starts the agent chrooted into /newroot and
         hands PID 1 to the image's init (switch_root); without, the agent is
         PID 1 and chroots each command into /newroot.

Any failure prints one line starting "lazyfs-init: FAILED" on the console
and powers off, so the host sees the VMM exit at once instead of waiting for
a timeout.

Kernel command line parameters read by /init:
    lazyfs.layers=N        layers, bottom first: pmem devices 2i (meta), 2i+1 (blob)
    lazyfs.layers_on=blk   (microvm) layers on virtio-blk instead of pmem (benchmarks)
    lazyfs.upper_mb=M      (microvm) size of the writable upper (tmpfs in guest memory)
    lazyfs.init=PATH       (vm) the image's init, run as PID 1 after switch_root
    lazyfs.hostname=H
    lazyfs.net=ADDR/PREFIX,GATEWAY   the NIC's (eth0) address and default route;
                           without it the guest has only lo
    lazyfs.test=noagent    (tests only) never start the agent
    lazyfs.test=noreap     (tests only, microvm) the agent loses every command's exit
                           status, as if it could not reap it (a fault injection)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..errors import BackendUnavailable
from ..native import guest_agent
from .kernel import GuestKernel, load_order

# virtio_blk: the microvm backend's blk mode (layers as disks, for the
# benchmark against pmem + DAX); a few hundred KiB, loaded in every boot.
# virtio_balloon: free page reporting (memory the guest frees goes back to the
# host); it binds only when the VMM has the device (qemu.VmConfig.balloon).
MODULES = ("virtio_pci", "virtio_pmem", "nd_pmem", "virtio_blk", "erofs", "overlay",
           "virtio_console", "virtio_net", "virtio_balloon")
VM_MODULES = ("virtio_pci", "virtio_pmem", "nd_pmem", "virtio_blk", "erofs", "overlay", "ext4",
              "virtio_console", "virtio_net")
BUSYBOX = Path("/bin/busybox")

# What both flavours do first: API filesystems, the failure path, the
# command line, the modules, the hostname; and two helpers.
_PRELUDE = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /bin /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
console=/dev/console  # until /dev moves into the image's root
fail() {
    echo "lazyfs-init: FAILED: $*" >$console
    dmesg | tail -n 20 >$console
    poweroff -f
    sleep 10
}
layers=0; upper_mb=256; host=sandbox; test=""; layers_on=pmem; init=""; pids=""; mem_mb=""
net=""
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        lazyfs.pids=*) pids=${arg#*=} ;;
        lazyfs.mem_mb=*) mem_mb=${arg#*=} ;;
        lazyfs.layers=*) layers=${arg#*=} ;;
        lazyfs.layers_on=*) layers_on=${arg#*=} ;;
        lazyfs.upper_mb=*) upper_mb=${arg#*=} ;;
        lazyfs.hostname=*) host=${arg#*=} ;;
        lazyfs.init=*) init=${arg#*=} ;;
        lazyfs.test=*) test=${arg#*=} ;;
        lazyfs.net=*) net=${arg#*=} ;;
    esac
done
for m in $(cat /modules/order); do
    insmod /modules/$m || fail "insmod $m"
done
hostname "$host"
ip link set lo up 2>/dev/null
if [ -n "$net" ]; then  # the sandbox's NIC: filtered on the host, in the VMM's namespace
    n=0
    while [ ! -e /sys/class/net/eth0 ]; do
        n=$((n + 1)); [ $n -gt 500 ] && fail "no eth0 (lazyfs.net)"; sleep 0.02
    done
    ip addr add "${net%,*}" dev eth0 && ip link set eth0 up \
        && ip route add default via "${net#*,}" || fail "eth0 $net"
fi
# the commands' cgroup: the sandbox's pids limit and a memory limit below the
# guest's RAM, so bombs are held there and the agent (outside) answers on
cgroup=""
if [ -n "$pids$mem_mb" ] && mkdir -p /cgroup && mount -t cgroup2 cgroup2 /cgroup; then
    echo "+pids +memory" > /cgroup/cgroup.subtree_control
    # cpu: the commands weigh as one group against the agent (nice -20)
    echo "+cpu" > /cgroup/cgroup.subtree_control 2>/dev/null
    mkdir -p /cgroup/sandbox && cgroup=/cgroup/sandbox
    [ -n "$pids" ] && echo "$pids" > $cgroup/pids.max
    if [ -n "$mem_mb" ]; then  # at most what is free now, less 16 MiB for the agent
        avail=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
        limit=$((mem_mb * 1024))
        [ $((avail - 16384)) -lt $limit ] && limit=$((avail - 16384))
        echo "$((limit * 1024))" > $cgroup/memory.max
    fi
    echo 0 > $cgroup/memory.swap.max 2>/dev/null
fi
cg_arg() { [ -n "$cgroup" ] && echo "--cgroup $cgroup"; }
disk() {  # the virtio-blk disk whose serial is $1, waiting for it
    n=0
    while :; do
        for b in /sys/block/vd*; do
            [ "$(cat $b/serial 2>/dev/null)" = "$1" ] && [ -b /dev/${b##*/} ] \
                && { echo /dev/${b##*/}; return 0; }
        done
        n=$((n + 1)); [ $n -gt 500 ] && return 1; sleep 0.02
    done
}
agent_port() {  # the virtio-serial port named lazyfs.agent
    n=0
    while :; do
        for p in /sys/class/virtio-ports/*; do
            [ "$(cat $p/name 2>/dev/null)" = lazyfs.agent ] && [ -c /dev/${p##*/} ] \
                && { echo /dev/${p##*/}; return 0; }
        done
        n=$((n + 1)); [ $n -gt 500 ] && return 1; sleep 0.02
    done
}
sandbox_dev() {  # a minimal /dev for the root at $1
    mount -t tmpfs -o mode=0755,nosuid,size=1m tmpfs $1/dev
    mknod -m 666 $1/dev/null c 1 3
    mknod -m 666 $1/dev/zero c 1 5
    mknod -m 666 $1/dev/full c 1 7
    mknod -m 666 $1/dev/random c 1 8
    mknod -m 666 $1/dev/urandom c 1 9
    mknod -m 666 $1/dev/tty c 5 0
    ln -s /proc/self/fd $1/dev/fd
    ln -s /proc/self/fd/0 $1/dev/stdin
    ln -s /proc/self/fd/1 $1/dev/stdout
    ln -s /proc/self/fd/2 $1/dev/stderr
    mkdir -p $1/dev/pts $1/dev/shm
    mount -t devpts -o newinstance,ptmxmode=0666 devpts $1/dev/pts
    mount -t tmpfs -o nosuid,nodev tmpfs $1/dev/shm
}
"""

# Both flavours' lowers: each layer mounted at /layers/<i> from its two pmem
# devices (or blk disks), $lowers the overlayfs lowerdir, top layer first.
_LAYERS = r"""[ "$layers" -gt 0 ] || fail "no layers (lazyfs.layers)"
lowers=""
i=0
if [ "$layers_on" = pmem ]; then
    last=$((2 * layers - 1))
    n=0
    while [ ! -b /dev/pmem$last ]; do
        n=$((n + 1)); [ $n -gt 500 ] && fail "no /dev/pmem$last"; sleep 0.02
    done
fi
while [ $i -lt "$layers" ]; do
    mkdir -p /layers/$i
    if [ "$layers_on" = pmem ]; then
        mount -t erofs -o ro,dax,device=/dev/pmem$((2 * i + 1)) /dev/pmem$((2 * i)) /layers/$i \
            || fail "mount layer $i (erofs, dax)"
    else  # blk: the same images as virtio-blk disks, through the guest's page cache
        meta=$(disk lz${i}m) || fail "no disk with serial lz${i}m"
        blob=$(disk lz${i}b) || fail "no disk with serial lz${i}b"
        mount -t erofs -o ro,device=$blob $meta /layers/$i || fail "mount layer $i (erofs, blk)"
    fi
    lowers="/layers/$i${lowers:+:$lowers}"
    i=$((i + 1))
done
"""

INIT = _PRELUDE + _LAYERS + r"""mkdir -p /rw /sandbox
mount -t tmpfs -o size=${upper_mb}m,mode=0755 tmpfs /rw || fail "tmpfs upper"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=$lowers,upperdir=/rw/upper,workdir=/rw/work /sandbox \
    || fail "overlay"
for d in proc sys dev tmp; do [ -d /sandbox/$d ] || mkdir -p /sandbox/$d; done
mount -t proc proc /sandbox/proc
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs /sandbox/sys
sandbox_dev /sandbox
port=$(agent_port) || fail "no virtio-serial port lazyfs.agent"
echo "lazyfs-init: layers mounted ($layers_on), starting the agent on $port"
if [ "$test" = noagent ]; then
    exec sleep 2147483647
fi
# lazyfs.test=noreap: the agent's fault injection (tests only; guest-agent.c)
exec /lazyfs-agent $(cg_arg) --upper /rw/upper \
    $([ "$test" = noreap ] && echo --test-fault noreap) "$port" /sandbox
"""

# The full VM: the image's layers as in a microVM, under an overlayfs whose
# upper is the sandbox's own ext4 disk (serial lazyfs-upper) instead of a
# tmpfs, becomes the root. With lazyfs.init=PATH (the image has an init) the
# agent is started chrooted into that root and the image's init takes PID 1
# through switch_root; otherwise the agent is PID 1, as in a microVM, and
# chroots each command into the root.
# switch_root moves /newroot away: the agent must hold its port and its root
# before, or it opens paths that are gone (the test's flake). So it starts
# first, on the initramfs' /dev, and init waits until /proc/<agent>/root is
# /newroot (the agent chroots after opening its port) before it moves /dev
# into the new root. A background job (`&`) opens /dev/null as its stdin
# before its own redirections: it cannot start once /dev has moved.
VM_INIT = _PRELUDE + _LAYERS + r"""upper=$(disk lazyfs-upper) || fail "no disk with serial lazyfs-upper"
mkdir -p /rw /newroot
mount -t ext4 -o rw,noinit_itable $upper /rw || fail "mount $upper (ext4)"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=$lowers,upperdir=/rw/upper,workdir=/rw/work /newroot \
    || fail "overlay"
for d in proc sys dev run tmp; do [ -d /newroot/$d ] || mkdir -p /newroot/$d; done
port=$(agent_port) || fail "no virtio-serial port lazyfs.agent"
if [ -n "$init" ]; then
    echo "lazyfs-init: layers mounted, $upper the upper, agent on $port, handing over to $init"
    if [ "$test" != noagent ]; then
        /lazyfs-agent --chroot "$port" /newroot </dev/null &
        agent=$!
        n=0
        while [ "$(readlink /proc/$agent/root)" != /newroot ]; do
            n=$((n + 1)); [ $n -gt 1000 ] && fail "the agent did not start"; sleep 0.01
        done
    fi
    mount --move /dev /newroot/dev || fail "move /dev"
    console=/newroot/dev/console
    mkdir -p /newroot/dev/pts /newroot/dev/shm
    mount -t devpts -o ptmxmode=0666 devpts /newroot/dev/pts
    mount -t tmpfs -o nosuid,nodev tmpfs /newroot/dev/shm
    mount -t proc proc /newroot/proc
    mount -t sysfs sysfs /newroot/sys
    umount /cgroup /proc /sys 2>/newroot/dev/null  # the image's init mounts its own
    exec switch_root /newroot "$init"
fi
mount -t proc proc /newroot/proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /newroot/sys
sandbox_dev /newroot
echo "lazyfs-init: layers mounted, $upper the upper, starting the agent on $port"
if [ "$test" = noagent ]; then
    exec sleep 2147483647
fi
exec /lazyfs-agent $(cg_arg) "$port" /newroot
"""

FLAVOURS = {"microvm": (INIT, MODULES), "vm": (VM_INIT, VM_MODULES)}


class _Cpio:
    """A cpio archive in the "newc" format the kernel unpacks."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes) -> None:
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0)
        self.ino += 1
        self.out += b"070701" + b"".join(b"%08X" % f for f in fields)
        self.out += name.encode() + b"\0"
        self.out += b"\0" * (-len(self.out) % 4)
        self.out += data
        self.out += b"\0" * (-len(self.out) % 4)

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755, b"")

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0, b"")
        return bytes(self.out)


def build(kernel: GuestKernel, agent: Path, modules: Iterable[str] = MODULES,
          init: str = INIT) -> bytes:
    if not BUSYBOX.is_file():
        raise BackendUnavailable("the guest initramfs needs busybox-static "
                                 "(apt-get install busybox-static)")
    order = load_order(kernel, modules)
    a = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "modules", "layers"):
        a.dir(d)
    a.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    a.symlink("bin/sh", "busybox")
    a.file("lazyfs-agent", agent.read_bytes(), 0o755)
    for ko in order:
        a.file(f"modules/{ko.name}", ko.read_bytes())
    a.file("modules/order", "".join(f"{ko.name}\n" for ko in order).encode())
    a.file("init", init.encode(), 0o755)
    return a.finish()


def initramfs(kernel: GuestKernel, cache_dir: Path, flavour: str = "microvm") -> Path:
    """Path of the initramfs for this kernel, agent and init (built if missing).
    flavour: "microvm" (layers from pmem or blk, overlay upper in memory) or
    "vm" (the image's own ext4 disk as the root)."""
    init, modules = FLAVOURS[flavour]
    agent = guest_agent(cache_dir)
    key = hashlib.sha256()
    for part in (kernel.version.encode(), agent.name.encode(), init.encode(),
                 " ".join(modules).encode(), str(BUSYBOX.stat().st_mtime_ns).encode()
                 if BUSYBOX.exists() else b""):
        key.update(part + b"\0")
    out = cache_dir / f"initramfs-{key.hexdigest()[:16]}.cpio"
    if out.exists():
        return out
    data = build(kernel, agent, modules, init)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".initramfs-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def tools_missing() -> str | None:
    """What the guest userland needs from the host and is not there."""
    if not BUSYBOX.is_file():
        return "busybox-static (apt-get install busybox-static)"
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        return "a C compiler for the guest agent (apt-get install gcc libc6-dev)"
    return None
