#!/usr/bin/env bash
# Install everything lazyfs needs on Debian 12: the system packages that are
# missing (through apt) and a virtualenv at .venv holding the project, its
# test dependencies and the benchmarks' plotting (the test and bench extras).
# Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"

# System packages the code and the tests use.
#   util-linux: mount/umount (tests mount tmpfs and read-only binds)
#   python3-venv, python3-dev, gcc: the virtualenv, and wheels that compile
#   busybox-static, zstd, tar: test images (static userland, zstd layers)
#   docker-registry, apache2-utils, openssl: a real registry (htpasswd auth, TLS) for tests
#   debootstrap: the Debian minbase image of the round-trip test (cached in /var/cache)
#   docker.io: a private dockerd for the docker:// source tests (never the system one)
#   git: the git: workspace source
#   fuse3, libfuse3-dev, pkg-config: the lazyfs FUSE daemon (pyfuse3 builds against libfuse3)
#   erofs-utils: fsck.erofs checks of the EROFS images we write
#   runc, libc6-dev (static libc for sandbox-init), libseccomp2, iproute2, nftables:
#   container and fncall sandboxes (runc, seccomp, network namespaces and allowlists)
#   qemu-system-x86: microVM sandboxes (the guest kernel is fetched below with apt-get download)
#   e2fsprogs: full-VM sandboxes (mkfs.ext4 of each VM's writable disk); qemu-utils:
#   qemu-img, to look into VM disks and snapshots
#   strace: benchmarks/bench_cold.py (which files a program opened)
#   make, xz-utils and the -dev/protobuf packages: building CRIU (below) for checkpoints
#   etcd-server, etcd-client: the fleet (node agents register in etcd; tests run one on loopback)
APT_PACKAGES=(util-linux python3-venv python3-dev gcc busybox-static zstd tar
              docker-registry apache2-utils openssl debootstrap docker.io git
              fuse3 libfuse3-dev pkg-config erofs-utils
              runc libc6-dev libseccomp2 iproute2 nftables qemu-system-x86
              qemu-utils e2fsprogs strace
              make xz-utils libbsd-dev libcap-dev libnet1-dev libnftables-dev libnl-3-dev
              libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler
              libgnutls28-dev uuid-dev etcd-server etcd-client libzstd-dev libxxhash-dev)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "install.sh: installing system packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CRIU for container checkpoints (runtime/backends/criu.py). Debian 12's criu
# 3.17 fails on this kernel (vDSO bounds); 4.1.1 works. Its source comes from
# Debian's archive (trixie's source package, through apt with a private
# sources list, so the machine's apt configuration is untouched), checked
# against the SHA-256 the signed Sources index gives, and is built once per
# machine into $CRIU_CACHE/<version>/criu; a later run finds it and builds
# nothing. Only root builds it (the cache is the machine's).
CRIU_VERSION=4.1.1
CRIU_DEBIAN=4.1.1-1
CRIU_ORIG_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
CRIU_CACHE="${LAZYFS_CRIU_CACHE:-/var/cache/lazyfs/criu}"
build_criu() {
    local work apt_opts src
    work=$(mktemp -d /tmp/lazyfs-criu.XXXXXX)
    trap 'rm -rf "$work"' RETURN
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
         "http://deb.debian.org/debian trixie main" > "$work/sources.list"
    apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
              -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache")
    apt-get -qq "${apt_opts[@]}" update
    # (a mirror without the .dsc still serves the upstream tarball, which is all we build)
    (cd "$work" && apt-get -qq "${apt_opts[@]}" source --download-only "criu=$CRIU_DEBIAN" \
         > "$work/source.log" 2>&1) || true
    src="$work/criu_$CRIU_VERSION.orig.tar.xz"
    echo "$CRIU_ORIG_SHA256  $src" | sha256sum -c --quiet - 2>/dev/null || {
        cat "$work/source.log" >&2
        echo "install.sh: criu $CRIU_VERSION source missing or wrong" >&2
        return 1
    }
    tar -C "$work" -xf "$src"
    make -C "$work/criu-$CRIU_VERSION" -j"$(nproc)" criu > "$work/build.log" 2>&1 \
        || { tail -20 "$work/build.log" >&2; return 1; }
    mkdir -p "$CRIU_CACHE/$CRIU_VERSION"
    install -m 0755 "$work/criu-$CRIU_VERSION/criu/criu" "$CRIU_CACHE/$CRIU_VERSION/.criu.tmp"
    mv "$CRIU_CACHE/$CRIU_VERSION/.criu.tmp" "$CRIU_CACHE/$CRIU_VERSION/criu"
}
if [ "$(id -u)" -eq 0 ] && [ ! -x "$CRIU_CACHE/$CRIU_VERSION/criu" ]; then
    echo "install.sh: building CRIU $CRIU_VERSION into $CRIU_CACHE (once per machine)"
    build_criu || echo "install.sh: could not build CRIU (checkpoints will say why)" >&2
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install -q -e '.[test,bench]' 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c 'import chunkstore, tools.cli, matplotlib' || { echo "install.sh: install failed" >&2; exit 1; }
# lazyfs-blobd, the node daemon's native data path (lazyfs/native/blobd.c), built
# now so no daemon waits for gcc; -Wall -Wextra -Werror against Debian's libfuse3,
# libzstd and libxxhash (a warning fails the install, not a later mount)
.venv/bin/python -m lazyfs.nativeblobs build > /dev/null \
    || { echo "install.sh: building lazyfs-blobd failed" >&2; exit 1; }
# The microVM guest kernel (Debian's cloud kernel, unpacked into /var/cache/lazyfs/guest-kernel);
# the backend fetches it on first use too, this only saves the first sandbox the wait.
if [ "$(id -u)" -eq 0 ]; then
    .venv/bin/python -c 'from runtime.guest.kernel import guest_kernel; print("install.sh: guest kernel", guest_kernel().version)' \
        || echo "install.sh: could not fetch the microVM guest kernel (the microvm backend will say why)" >&2
fi
echo "install.sh: ready (.venv/bin/lazyfs)"
