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
#   qemu-utils, e2fsprogs: full-VM sandboxes (qemu-img overlays over an image's ext4 disk)
#   etcd-server, etcd-client: the fleet (node agents register in etcd; tests run one on loopback)
APT_PACKAGES=(util-linux python3-venv python3-dev gcc busybox-static zstd tar
              docker-registry apache2-utils openssl debootstrap docker.io git
              fuse3 libfuse3-dev pkg-config erofs-utils
              runc libc6-dev libseccomp2 iproute2 nftables qemu-system-x86
              qemu-utils e2fsprogs etcd-server etcd-client)

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

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install -q -e '.[test,bench]' 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c 'import chunkstore, tools.cli, matplotlib' || { echo "install.sh: install failed" >&2; exit 1; }
# The microVM guest kernel (Debian's cloud kernel, unpacked into /var/cache/lazyfs/guest-kernel);
# the backend fetches it on first use too, this only saves the first sandbox the wait.
if [ "$(id -u)" -eq 0 ]; then
    .venv/bin/python -c 'from runtime.guest.kernel import guest_kernel; print("install.sh: guest kernel", guest_kernel().version)' \
        || echo "install.sh: could not fetch the microVM guest kernel (the microvm backend will say why)" >&2
fi
echo "install.sh: ready (.venv/bin/lazyfs)"
